"""The torchrun process group (`Group`): joining it, the collectives the training loop needs,
DDP or periodic averaging, leaving it; `group_for` turns its failures into one clear line."""

from __future__ import annotations

import gc
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cnnkit.distributed.device import group_device_name, resolve_device
from cnnkit.distributed.environment import env_number, env_text, launched, restart_count
from cnnkit.distributed.replicas import average_in_place, convert_sync_batchnorm
from cnnkit.errors import CnnkitError, ConfigError, plural


class Group:
    """This process's place in the torchrun group and the collectives the training loop needs.

    sync "ddp": gradients all-reduced by DistributedDataParallel at every step (the default).
    sync "average": each replica steps on its own batches and every `average_every` steps, and
    after each epoch's last step, the weights, BatchNorm statistics, optimizer moments and the
    moving average (train.ema) are averaged (the first seed's scheme; K = 1 equals synchronous
    SGD). So every evaluation and every checkpoint sees one model, the same on every rank.
    """

    def __init__(self, train_cfg: Any):
        self.world_size = env_number("WORLD_SIZE", 1)
        self.rank = env_number("RANK", 0, self.world_size - 1)
        self.local_world_size = env_number("LOCAL_WORLD_SIZE", 1, default=str(self.world_size))
        self.local_rank = env_number("LOCAL_RANK", 0, self.local_world_size - 1)
        self.is_main = self.rank == 0
        self.sync, self.every, self.sync_bn = (
            train_cfg.sync,
            train_cfg.average_every,
            train_cfg.sync_bn,
        )
        # static_graph with no_sync() micro-batches crashes or stops reducing (pytorch#143580)
        self.static_graph = train_cfg.accumulate == 1
        self.use_cuda = train_cfg.device != "cpu" and torch.cuda.is_available()
        if self.use_cuda:
            if self.local_world_size > (gpus := torch.cuda.device_count()):
                raise ConfigError(
                    f"{self.local_world_size} processes on this machine but {plural(gpus, 'GPU')}: "
                    "one process per GPU (fewer --nproc / "
                    "--nproc-per-node; train.device=cpu runs a group on the CPU)"
                )
            torch.cuda.set_device(self.local_rank)
        self.timeout_s = train_cfg.timeout_s
        if not dist.is_initialized():
            self._rendezvous(timedelta(seconds=train_cfg.timeout_s))

    def _rendezvous(self, timeout: timedelta) -> None:
        """Join the process group; a rendezvous that fails or times out (a peer never started,
        another MASTER_ADDR or MASTER_PORT) is one clear line rather than torch's traceback."""
        cuda = {"device_id": torch.device("cuda", self.local_rank)} if self.use_cuda else {}
        _quiet_nccl_errors()
        addr, port = env_text("MASTER_ADDR"), env_number("MASTER_PORT", 1, 65535)
        try:
            dist.init_process_group(
                "nccl" if self.use_cuda else "gloo",
                store=self._store(addr, port, timeout),
                rank=self.rank,
                world_size=self.world_size,
                timeout=timeout,
                **cuda,  # NCCL: one communicator for this rank's GPU, made at once
            )
        except (dist.DistError, RuntimeError) as e:
            text = str(e).lower()
            if "timeout" in text or "timed out" in text:
                raise CnnkitError(
                    f"rank {self.rank}: the other processes did not join within "
                    f"{self.timeout_s}s at {addr}:{port} (start all {self.world_size} with the "
                    "same MASTER_ADDR and MASTER_PORT, each with its own RANK; "
                    "train.timeout_s=N waits longer)"
                ) from None
            first = next(iter(str(e).splitlines()), "") or type(e).__name__
            raise CnnkitError(
                f"rank {self.rank}: could not join the group at {addr}:{port} ({first})"
            ) from None

    def _store(self, addr: str, port: int, timeout: timedelta) -> dist.Store:
        """torchrun's store under a per-attempt prefix: after an elastic restart the agent's
        store still holds the dead attempt's addresses, and reading those hangs or fails."""
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            addr,
            port,
            self.world_size,
            is_master=self.rank == 0 and not agent,
            timeout=timeout,
        )
        self._job_store = store  # unprefixed: the agent's outlives an attempt (job_value)
        return dist.PrefixStore(f"cnnkit/attempt_{restart_count()}", store)

    def job_value(self, key: str, make: Callable[[], str]) -> str:
        """A value every rank and every elastic restart of this job agrees on: rank 0 reads
        what an earlier attempt stored in torchrun's agent store (which lives as long as the
        agent), or makes it now and stores it; every rank then gets rank 0's."""
        value = None
        if self.is_main:
            store = getattr(self, "_job_store", None)
            key = f"cnnkit/job/{key}"
            if store is not None and restart_count() > 0 and store.check([key]):
                value = store.get(key).decode()
            if value is None:
                value = make()
                if store is not None:
                    store.set(key, value)
        return self.broadcast_object(value)

    def device(self, name: str) -> torch.device:
        """One device per process: cuda:LOCAL_RANK under NCCL, else the CPU."""
        if group_device_name(name).startswith("cuda"):
            resolve_device(name, "train.device")  # one clear line if no CUDA
        return torch.device("cuda", self.local_rank) if self.use_cuda else torch.device("cpu")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (returns the same tensor, reduced in place)."""
        dist.all_reduce(tensor)
        return tensor

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (generator states and epoch statistics: saved so
        each rank resumes its own)."""
        states: list[Any] = [None] * self.world_size
        dist.all_gather_object(states, obj)
        return states

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (what rank 0 decided, or read from its disk)."""
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree(self, flags: Sequence[bool], every: int = 1) -> tuple[list[bool], int]:
        """Whether any rank set each of `flags`, and the smallest `every` any rank proposes (one
        small all-reduce and a host sync): what every rank then acts on alike, so that none
        leaves for a collective the others never reach."""
        device = torch.device("cuda", self.local_rank) if self.use_cuda else torch.device("cpu")
        t = torch.tensor([*map(float, flags), -float(every)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        *raised, fewest = t.tolist()
        return [r > 0 for r in raised], int(-fewest)

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP for sync "ddp"; the plain model (replicas kept in step by averaging) otherwise."""
        if self.sync_bn:
            convert_sync_batchnorm(model)
        if self.sync == "average":
            self._broadcast(model)  # identical starting weights on every replica
            return model
        device_ids = [self.local_rank] if self.use_cuda else None
        # gradients live in DDP's buckets (train_step zeroes them in place: no copy per step);
        # the graph is the same every step (static_graph learns which layers get no gradient;
        # without it, as with accumulate > 1, DDP must look for them)
        unreached = hasattr(model, "unreached") and bool(model.unreached())
        return nn.parallel.DistributedDataParallel(
            model, device_ids=device_ids, gradient_as_bucket_view=True,
            static_graph=self.static_graph,
            find_unused_parameters=unreached and not self.static_graph,
        )  # fmt: skip

    def synced(self, global_step: int, epoch_end: bool = False) -> bool:
        """Whether the replicas are equal after this step (checkpoints wait for such a step)."""
        return self.sync != "average" or epoch_end or global_step % self.every == 0

    def after_step(self, engine: Any, global_step: int, epoch_end: bool = False) -> None:
        """sync "average": every K steps and at the epoch's end, average the replicas. sync
        "ddp": at the epoch's end, average the floating buffers (BatchNorm statistics, of the
        network and its moving average: DDP hands rank 0's to every forward, each rank then
        updates them with its own batch), so what is evaluated is the one model that is saved
        (timm's `dist_bn: reduce`)."""
        if self.sync == "average" and self.synced(global_step, epoch_end):
            self.average(engine)
        elif self.sync == "ddp" and epoch_end:
            modules = [engine.network] + ([engine.ema.module] if engine.ema is not None else [])
            buffers = [b for m in modules for b in m.buffers() if b.is_floating_point()]
            average_in_place(buffers, self.world_size)

    def average(self, engine: Any) -> None:
        """sync "average": average the replicas' weights, floating buffers (the BatchNorm
        statistics), optimizer moments (SGD momenta, Adam's two averages) and moving average
        (linear in the weights: the average of the ranks' is that of the averaged weights)."""
        if self.sync != "average":
            return
        network = engine.network
        tensors = [p.data for p in network.parameters() if p.requires_grad]
        tensors += [b for b in network.buffers() if b.is_floating_point()]
        if engine.ema is not None:  # every floating tensor of it (state_dict: views, in place)
            tensors += [t for t in engine.ema.module.state_dict().values() if t.is_floating_point()]
        for state in engine.optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        average_in_place(tensors, self.world_size)

    def _broadcast(self, model: nn.Module) -> None:
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, 0)

    def close(self, ok: bool = True) -> None:
        """Leave the group together (a barrier first, so no rank tears down under another). A
        peer gone by then (a Ctrl-C just after the run finished) is no error: the run is
        saved, and the barrier was only a farewell."""
        if not dist.is_initialized():
            return
        with _ctrl_c_held():  # (one inside gc's weakref callbacks is an unraisable traceback)
            gc.collect()  # drop dead DDP reducers now: one freed at interpreter exit can abort
            try:
                if ok:
                    dist.barrier()
            except (dist.DistError, RuntimeError):
                pass
            finally:
                with suppress(dist.DistError, RuntimeError):
                    dist.destroy_process_group()


@contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """A Ctrl-C (SIGINT) held until the block is done, then raised as KeyboardInterrupt; a
    second one raises at once (a peer that never comes). Only in the main thread, and not
    where SIGINT is ignored (a background job)."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (
        signal.SIG_IGN, None):  # fmt: skip
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if held:
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        held.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def _quiet_nccl_errors() -> None:
    """On a NCCL error or timeout, abort the communicator and raise in Python (one line from
    group_for) rather than let the watchdog tear the process down with a wall of C++ logs;
    a user's own setting wins."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")


@contextmanager
def group_for(train_cfg: Any) -> Iterator[Group | None]:
    """The process group when running under torchrun (None alone); collective timeouts and
    peer failures become one clear CnnkitError."""
    if not launched():
        yield None
        return
    group = Group(train_cfg)
    ok = False
    try:
        yield group
        ok = True
    except (dist.DistError, RuntimeError) as e:
        if isinstance(e, CnnkitError):
            raise
        text = str(e).lower()
        if "timeout" in text or "timed out" in text:
            raise CnnkitError(
                f"rank {group.rank}: a collective timed out after {group.timeout_s}s "
                "(a peer died or hung; raise train.timeout_s for slow steps)"
            ) from None
        if "connection" in text or "peer" in text or "closed" in text:
            raise CnnkitError(f"rank {group.rank}: lost a peer process ({_peer_lost(e)})") from None
        raise
    finally:
        group.close(ok)


def _peer_lost(error: BaseException) -> str:
    """gloo's words for a lost peer without the source line it names or its advice: from
    "[.../gloo/transport/tcp/pair.cc:561] Connection closed by peer [10.0.0.2]:64128. This is
    typically caused by a remote worker crashing. ... GLHF!", "Connection closed by peer
    [10.0.0.2]:64128"."""
    first = next(iter(str(error).splitlines()), "")
    first = re.sub(r"^\[[^\]]*:\d+\]\s*", "", first)  # [file.cc:561]
    first = re.split(r"\.?\s*this is typically", first, flags=re.IGNORECASE)[0]
    return first.strip().rstrip(".") or type(error).__name__
