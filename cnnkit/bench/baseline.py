"""The PyTorch loops a cnnkit step is compared with, each in a process of its own: "plain" (fp32,
NCHW, `torch.optim.SGD`, the textbook three lines) and "careful" (what a careful user writes:
the same under torch.autocast in bf16 (fp16 on GPUs without bf16) with channels_last). For
`alexnet-owt` they run torchvision's `alexnet` itself (the same architecture); for other
networks, the cnnkit network built afresh and run the same way."""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from cnnkit.bench.model_setup import load_network
from cnnkit.errors import CnnkitError, one_line
from cnnkit.nn import Network

# cnnkit zoo name -> torchvision model of the same architecture
TORCHVISION = {"alexnet-owt": "alexnet"}


PEERS = ("plain", "careful")


def amp_dtype(device: torch.device) -> torch.dtype | None:
    """The careful user's autocast type: bf16 where the hardware computes in it, fp16 on a GPU
    without bf16, none (fp32) on a CPU without bf16 units (emulated bf16 is many times slower)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return None


def peer_label(peer: str, device: torch.device) -> str:
    """How a peer runs, for the report."""
    if peer == "plain":  # torch's defaults: on CUDA, TF32 convolutions but true fp32 matmuls
        return "fp32 NCHW" + (" (TF32 convolutions, fp32 matmuls)" if device.type == "cuda" else "")
    dtype = amp_dtype(device)
    how = "fp32" if dtype is None else f"autocast {str(dtype).removeprefix('torch.')}"
    return f"{how} channels_last"


def plain_model(model: Network, device: torch.device, peer: str = "plain") -> tuple[nn.Module, str]:
    """(the peer model on `device`, its name): torchvision's where one matches, else ours."""
    how = peer_label(peer, device)
    if model.name in TORCHVISION:
        import torchvision

        name = TORCHVISION[model.name]
        module, label = (
            torchvision.models.get_model(name, num_classes=model.num_classes),
            f"torchvision {name} {how}",
        )
    else:
        module, label = (
            load_network(model.spec, device, model.num_classes),
            f"plain {model.name} {how}",
        )
    module = module.to(device)
    if peer == "careful":
        module = module.to(memory_format=torch.channels_last)
    return module, label


def _context(peer: str, device: torch.device):
    dtype = amp_dtype(device) if peer == "careful" else None
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def _in_format(x: torch.Tensor, peer: str) -> torch.Tensor:
    """The batch as the peer feeds it: channels_last for the careful one where it is an image
    batch (B, C, H, W); a vector batch (B, F) has no memory format to choose."""
    careful = peer == "careful" and x.dim() == 4
    return x.contiguous(memory_format=torch.channels_last if careful else torch.contiguous_format)


def plain_train_step(module: nn.Module, x: torch.Tensor, y: torch.Tensor,
                     peer: str = "plain") -> Callable[[Any], None]:  # fmt: skip
    """zero_grad, loss.backward(), SGD step (momentum 0.9, weight decay 5e-4); fp32 NCHW, or
    under autocast with channels_last (with loss scaling for fp16) for the careful peer."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss()
    fp16 = peer == "careful" and amp_dtype(x.device) == torch.float16
    scaler = torch.amp.GradScaler(x.device.type, enabled=fp16)
    x = _in_format(x, peer)
    module.train()

    def step(_: Any = None) -> None:
        optimizer.zero_grad(set_to_none=True)
        with _context(peer, x.device):
            loss = loss_fn(module(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    return step


def plain_infer_step(
    module: nn.Module, x: torch.Tensor, peer: str = "plain"
) -> Callable[[Any], None]:
    """A forward pass in eval mode under inference_mode (autocast + channels_last if careful)."""
    x = _in_format(x, peer)
    module.eval()

    def step(_: Any = None) -> None:
        with torch.inference_mode(), _context(peer, x.device):
            module(x)

    return step


class PlainProcess:
    """The plain loop in a fresh Python process, as a user's own script runs it: none of the
    process-wide settings the `cnnkit` command starts with (cnnkit.runtime) reach it. Calling
    the object runs `block` steps there and returns the seconds they took, timed there as a
    step here is timed (the pipe's round trip, tens of microseconds, left out: it would weigh
    on small steps), which measure_interleaved takes (`times_itself`).
    `threads`: the CPU threads of the side it is compared with (a fresh process's default would
    be the core count, whatever cnnkit's side runs on).
    """

    times_itself = True

    def __init__(self, model: Network, mode: str, batch: int, device: torch.device,
                 peer: str = "plain", block: int = 1, threads: int | None = None):  # fmt: skip
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        threads = threads or torch.get_num_threads()
        args = (
            child,
            model.spec,
            model.num_classes,
            mode,
            batch,
            str(device),
            threads,
            peer,
            block,
        )
        self._process = context.Process(target=_serve_plain, args=args, daemon=True)
        with _sigint_ignored():  # inherited: Ctrl-C is the parent's, which ends the child
            self._process.start()
        child.close()  # the child's end lives in the child only: its exit is an EOF here
        self.name, self.threads = self._answer()  # the threads the child runs on

    def __call__(self, _: Any = None) -> float:
        """`block` steps there, back to back, synchronised at the end: their seconds."""
        self._conn.send(True)
        return self._answer()

    def _answer(self) -> Any:
        """The child's reply; its error (or its death) as one CnnkitError, never a hang."""
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(timeout=10)
            kind, value = "error", f"it ended with exit code {self._process.exitcode}"
        if kind == "error":
            raise CnnkitError(f"the PyTorch comparison loop failed: {value}")
        return value

    def close(self) -> None:
        """Stop the process (one that has died already is only reaped)."""
        try:
            self._conn.send(False)
        except OSError:  # BrokenPipeError: it is gone
            pass
        self._process.join(timeout=30)
        self._conn.close()


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while a child starts (a spawned Python keeps an ignored SIGINT ignored,
    until the child sets its own handler): a Ctrl-C mid-import in the child would print a
    traceback of its own beside the parent's one line. Only the main thread may set
    handlers; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _serve_plain(conn, spec: dict, num_classes: int, mode: str, batch: int, device: str,
                 threads: int, peer: str, block: int) -> None:  # fmt: skip
    """The child's side of PlainProcess: build the peer, then `block` steps per request. Every
    reply is (kind, value); an exception goes back as ("error", its first line). Ctrl-C,
    ignored while it started, ends it at once from here on (the parent ends too)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        name, run = _plain_runner(spec, num_classes, mode, batch, device, threads, peer, block)
        conn.send(("ok", (name, torch.get_num_threads())))
        while conn.recv():
            conn.send(("ok", run()))
    except (EOFError, KeyboardInterrupt):  # the parent is gone or stopping
        pass
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", one_line(f"{type(e).__name__}: {e}")))


def _plain_runner(spec: dict, num_classes: int, mode: str, batch: int, device: str,
                  threads: int, peer: str, block: int) -> tuple[str, Callable[[], float]]:  # fmt: skip
    """The peer's name, and a call that runs `block` of its steps, synchronised at the end, and
    returns their seconds."""
    from cnnkit.bench.model_setup import synthetic_batch
    from cnnkit.nn import Network

    torch.set_num_threads(threads)
    dev = torch.device(device)
    torch.backends.cudnn.benchmark = True  # what a careful user and cnnkit's benchmarks set
    model = Network(spec, num_classes=num_classes, device="meta")
    module, name = plain_model(model, dev, peer)
    x, y = synthetic_batch(model, batch, dev)
    step = (
        plain_train_step(module, x, y, peer)
        if mode == "train"
        else plain_infer_step(module, x, peer)
    )

    def run() -> float:
        start = time.perf_counter()  # (the previous block ended synchronised)
        for _ in range(block):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - start

    return name, run
