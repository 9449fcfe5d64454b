"""The training loop: `train_one_epoch`, `evaluate` and `fit`, which owns the run directory,
checkpoints every epoch and every N steps, and resumes exactly from `last.pt`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cnnkit.config import RunConfig
from cnnkit.data import Batches, DataBundle
from cnnkit.errors import ConfigError
from cnnkit.nn import Network, build_model
from cnnkit.train.engine import Engine, resolve_device, train_step
from cnnkit.train.metrics import Console
from cnnkit.train.optim import Schedule

StepHook = Callable[[int, int, int], None]  # (epoch index, steps done in it, global step)


class Local:
    """The single-process stand-in for cnnkit.distributed.Group: rank 0 of 1, no collectives."""

    rank, world_size, is_main = 0, 1, True

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def after_step(self, engine: Engine, global_step: int) -> None:
        """Hook for weight averaging (sync: average); nothing to do alone."""

    def device(self, name: str) -> torch.device:
        return resolve_device(name)

    def gather_rng(self, state: dict) -> list[dict]:
        """Every rank's generator states (here: just ours)."""
        return [state]


@dataclass
class Progress:
    """Where training stands: what a checkpoint restores besides the tensors."""

    epoch: int = 0  # epochs completed (index of the epoch in progress)
    step: int = 0  # optimizer steps done in that epoch
    global_step: int = 0
    best_top1: float = -1.0
    seconds: float = 0.0  # training wall time of earlier sessions
    history: list[dict[str, float]] = field(default_factory=list)
    partial: dict[str, float] = field(default_factory=dict)  # epoch stats of earlier sessions
    running: Callable[[], dict[str, float]] | None = None  # this session's, read on demand


@torch.no_grad()
def evaluate(engine: Engine, batches: Batches, dist: Any = None) -> dict[str, float]:
    """Loss, top-1 and top-5 over the whole validation stream (each image once, all ranks)."""
    dist = dist or Local()
    model = engine.network.eval()
    totals = torch.zeros(4, device=engine.device, dtype=torch.float64)  # loss, top1, top5, n
    batches.set_epoch(0)
    for x, y in batches:
        with engine.autocast():
            logits = model(engine.prepare(x)).float()
        k = min(5, logits.shape[1])
        hits = logits.topk(k, 1).indices == y[:, None]  # (B, k)
        loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
        totals += torch.stack([loss, hits[:, 0].sum(), hits.any(1).sum(), torch.tensor(len(y))])
    totals = dist.all_reduce(totals)
    n = max(totals[3].item(), 1.0)
    return {
        "loss": totals[0].item() / n,
        "top1": totals[1].item() / n,
        "top5": totals[2].item() / n,
    }


def train_one_epoch(
    engine: Engine,
    batches: Batches,
    schedule: Schedule,
    progress: Progress,
    console: Console,
    on_step: StepHook,
    dist: Any,
) -> dict[str, float]:
    """Train from progress.step to the end of epoch progress.epoch; return its train stats."""
    steps = len(batches)
    batches.set_epoch(progress.epoch, skip_batches=progress.step)
    stats = {"loss": 0.0, "correct": 0.0, "seen": 0.0, "seconds": 0.0, **progress.partial}
    progress.running = None
    loss_sum = torch.zeros((), device=engine.device)
    correct = torch.zeros((), device=engine.device, dtype=torch.long)
    start, seen = time.perf_counter(), 0
    for x, y in batches:
        schedule.apply(engine.optimizer, progress.epoch + progress.step / steps)
        loss, hits = train_step(engine, x, y)
        loss_sum += loss * len(y)
        correct += hits
        seen += len(y)
        progress.step += 1
        progress.global_step += 1
        dist.after_step(engine, progress.global_step)
        elapsed = time.perf_counter() - start
        console.step(progress.step, loss, seen * dist.world_size / max(elapsed, 1e-9))
        progress.running = _running(stats, loss_sum, correct, seen, elapsed)
        on_step(progress.epoch, progress.step, progress.global_step)
    return progress.running() if progress.running else stats


def _running(stats: dict, loss_sum, correct, seen: int, seconds: float):
    """The epoch's running stats, read only when needed (reading syncs the device)."""
    return lambda: _merge(stats, loss_sum, correct, seen, seconds)


def _merge(stats: dict, loss_sum, correct, seen: int, seconds: float) -> dict[str, float]:
    """Running stats of the epoch: earlier sessions' share (resume) plus this one's."""
    return {
        "loss": stats["loss"] + loss_sum.item(),
        "correct": stats["correct"] + correct.item(),
        "seen": stats["seen"] + seen,
        "seconds": stats["seconds"] + seconds,
    }


@contextmanager
def deterministic_mode(on: bool, device: torch.device) -> Iterator[None]:
    """Bitwise-repeatable kernels while training (restored afterwards)."""
    before = torch.are_deterministic_algorithms_enabled()
    benchmark = torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(on, warn_only=device.type != "cpu")
    torch.backends.cudnn.benchmark = not on
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)
        torch.backends.cudnn.benchmark = benchmark


@contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """Run with `n` intra-op CPU threads (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def seed_everything(seed: int) -> None:
    """Seed torch (all devices), numpy and python."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def build_network(config: RunConfig, data: DataBundle) -> Network:
    """The run's network with the data's class count, checked against the data's image shape."""
    network = build_model(config.model, num_classes=len(data.classes))
    if tuple(network.input_shape) != tuple(data.input_shape):
        raise ConfigError(
            f"model: input {list(network.input_shape)} does not match the data's images "
            f"{list(data.input_shape)}"
        )
    return network
