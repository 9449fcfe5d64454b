"""The only module that touches torch.distributed or torchrun's variables (RANK, WORLD_SIZE,
LOCAL_RANK, TORCHELASTIC_*): process group, DDP or periodic weight averaging, collectives.
`Processes` is what training needs of them; `Local` (one process) and `Group` (torchrun)
implement it. `resolve_device` is cnnkit's one rule for turning a device name into a device.

    torchrun --standalone --nproc_per_node=2 -m cnnkit train digits --out runs/digits-ddp
    cnnkit train digits --nproc 2          # the same, started for you
"""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from cnnkit.errors import CnnkitError, ConfigError, brief

DEVICE_HELP = "auto, cpu, cuda, cuda:N or mps"


def resolve_device(name: str | None = "auto", field: str = "--device") -> torch.device:
    """'auto' (or None) -> cuda if available, else cpu; a named device must exist here.

    `field` names the setting in error messages (`train.device`, `--device`).
    """
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{field}: {name!r} is not a device ({DEVICE_HELP})") from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{field}: {name!r}: cnnkit runs on {DEVICE_HELP}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"{field}: {name!r} asked for, but no CUDA device is available")
        if (device.index or 0) >= count:
            raise ConfigError(f"{field}: {name!r}: this machine has {count} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{field}: {name!r} asked for, but MPS is not available here")
    if device.type == "cuda" and device.index is not None:
        # the current device: what torch.cuda calls that name none use (RNG states, sync)
        torch.cuda.set_device(device)
    return device


def group_device_name(name: str) -> str:
    """`train.device` for a group, where each process takes cuda:LOCAL_RANK: one named GPU
    (cuda:N) would be ignored, so it is one clear line."""
    if name.startswith("cuda") and ":" in name:
        raise ConfigError(
            f"train.device: {name!r} names one GPU, but each process of a group takes "
            "cuda:LOCAL_RANK: set train.device=cuda (CUDA_VISIBLE_DEVICES chooses GPUs)"
        )
    return name


class Processes(Protocol):
    """The processes training runs in: this one's rank, the collectives, the model wrapper."""

    rank: int
    world_size: int
    local_world_size: int  # processes on this machine (they share its cores)
    is_main: bool  # rank 0: prints and writes the run directory

    def device(self, name: str) -> torch.device: ...  # this process's device for `train.device`

    def wrap(self, model: nn.Module) -> nn.Module: ...  # DDP, or the model itself

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...  # sum over ranks, in place

    def gather(self, obj: Any) -> list[Any]: ...  # every rank's obj, rank order

    def broadcast_object(self, obj: Any) -> Any: ...  # rank 0's obj on every rank

    def agree(self, flags: Sequence[bool], every: int = 1) -> tuple[list[bool], int]: ...  # any

    # rank's, flag by flag; the fewest steps any rank proposes

    def synced(self, global_step: int, epoch_end: bool = False) -> bool: ...  # replicas equal

    def after_step(self, engine: Any, global_step: int, epoch_end: bool = False) -> None: ...

    def average(self, engine: Any) -> None: ...  # sync "average": make the replicas equal now


class Local:
    """One process alone: rank 0 of 1, no collectives."""

    rank, world_size, local_world_size, is_main = 0, 1, 1, True

    def device(self, name: str) -> torch.device:
        return resolve_device(name, "train.device")

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def agree(self, flags: Sequence[bool], every: int = 1) -> tuple[list[bool], int]:
        return list(flags), every

    def synced(self, global_step: int, epoch_end: bool = False) -> bool:
        return True

    def after_step(self, engine: Any, global_step: int, epoch_end: bool = False) -> None:
        """Nothing to average alone."""

    def average(self, engine: Any) -> None:
        """Nothing to average alone."""


GROUP_VARIABLES = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}  # -> a process alone's


def launched() -> bool:
    """True inside a torchrun worker (RANK, WORLD_SIZE and LOCAL_RANK set). Some of them set
    to what names a group (RANK=1, WORLD_SIZE=4), the others not: a ConfigError, as torch's
    env:// rendezvous refuses it, not one process training alone as if it were the group."""
    given = [name for name in GROUP_VARIABLES if name in os.environ]
    if len(given) == len(GROUP_VARIABLES):
        return True
    grouped = [n for n in given if os.environ[n].strip() != GROUP_VARIABLES[n]]
    if grouped:
        missing = " and ".join(n for n in GROUP_VARIABLES if n not in given)
        name = grouped[0]
        raise ConfigError(f"{name}={brief(os.environ[name])} is set but {missing} not: a process "
                          "of a group needs RANK, WORLD_SIZE and LOCAL_RANK (torchrun sets them "
                          f"all); unset {name} to train alone")  # fmt: skip
    return False


TORCHRUN_VARIABLES = "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"


def env_text(name: str) -> str:
    """A torchrun variable that must be set (MASTER_ADDR): one clear line where it is not."""
    value = os.environ.get(name, "").strip()
    if not value:
        raise ConfigError(f"{name} is not set: a process of a group needs {TORCHRUN_VARIABLES} "
                          "(torchrun sets them all)")  # fmt: skip
    return value


def env_number(name: str, least: int, most: int | None = None, default: str | None = None) -> int:
    """A torchrun variable as a whole number from `least` to `most`: one clear line where it is
    missing or is not one (set by hand, or by a launcher other than torchrun)."""
    value = os.environ.get(name, default)
    if value is None:
        env_text(name)  # (raises: not set)
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < least or (most is not None and number > most):
        span = f"from {least} to {most}" if most is not None else f"of {least} or more"
        raise ConfigError(f"{name}={brief(value)}: expected a whole number {span} (torchrun sets "
                          f"{TORCHRUN_VARIABLES} for each process it starts)")  # fmt: skip
    return number


def restart_count() -> int:
    """How many times torchrun restarted this group (elastic restarts; 0 on the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def is_rank0() -> bool:
    """Whether this process is rank 0 of its torchrun group, or alone (before the group is
    joined: for what only one process should say)."""
    return os.environ.get("RANK", "0") == "0"


def resume_command(run_dir: Any, world_size: int) -> str:
    """How to continue a run stopped mid-epoch: in as many processes as it had (a mid-epoch
    checkpoint of N processes resumes in N only)."""
    if world_size == 1:
        return f"`cnnkit train --resume {run_dir}`"
    if os.environ.get("CNNKIT_NPROC"):  # started by `cnnkit train --nproc N` (cnnkit.agent)
        return f"`cnnkit train --resume {run_dir} --nproc {world_size}`"
    return f"`cnnkit train --resume {run_dir}` under the same torchrun ({world_size} processes)"


def run_id() -> str | None:
    """torchrun's id of this job (the same on every rank and across restarts)."""
    value = os.environ.get("TORCHELASTIC_RUN_ID")
    return value if value and value != "none" else None


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
                    f"{self.local_world_size} processes on this machine but {gpus} GPU"
                    f"{'s' if gpus != 1 else ''}: one process per GPU (fewer --nproc / "
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
        """Leave the group together (a barrier first, so no rank tears down under another)."""
        if not dist.is_initialized():
            return
        gc.collect()  # drop dead DDP reducers now: one freed at interpreter exit can abort
        if ok:
            dist.barrier()
        dist.destroy_process_group()


def average_in_place(tensors: list[torch.Tensor], world_size: int) -> None:
    """Average tensors over ranks in place: one all-reduce per dtype and device, each tensor
    keeping its storage and memory format (channels_last stays channels_last)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        flat = _flatten_dense_tensors(group)  # a contiguous copy, logical order
        dist.all_reduce(flat)
        flat.div_(world_size)
        for t, mean in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
            t.copy_(mean)  # element by element: t's own strides are kept


def _quiet_nccl_errors() -> None:
    """On a NCCL error or timeout, abort the communicator and raise in Python (one line from
    group_for) rather than let the watchdog tear the process down with a wall of C++ logs;
    a user's own setting wins."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")


def convert_sync_batchnorm(network: nn.Module) -> None:
    """Swap BatchNorm layers for SyncBatchNorm in place."""
    for name, module in list(network.named_modules()):
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            synced = nn.SyncBatchNorm.convert_sync_batchnorm(module)
            parent_name, _, leaf = name.rpartition(".")
            network.get_submodule(parent_name).add_module(leaf, synced)


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


def on_rank0(dist: Processes, check: Callable[[], Any]) -> None:
    """`check` on rank 0 only (the run directory is rank 0's), its ConfigError raised on every
    rank at once: the others stop there too, quietly (not with "lost a peer process" when
    rank 0 ends), and none goes on into a collective that rank 0 never reaches."""
    error = None
    if dist.is_main:
        try:
            check()
        except ConfigError as e:
            error = e
    if dist.world_size > 1:
        message = dist.broadcast_object(None if error is None else str(error))
        if message is not None and error is None:
            error = ConfigError(message)
    if error is not None:
        raise error
