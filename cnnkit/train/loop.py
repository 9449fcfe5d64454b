"""One epoch of training and one pass of evaluation: `train_one_epoch`, `evaluate`, and the
running statistics of an epoch (`EpochStats`). `train/run.py` wires them into a whole run.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from cnnkit.data import Batches
from cnnkit.distributed import Local, Processes
from cnnkit.errors import CnnkitError, DataError
from cnnkit.train.engine import Engine, train_step
from cnnkit.train.metrics import SYNC_EVERY, Console, StepInfo, reads_device
from cnnkit.train.optim import Schedule
from cnnkit.train.recipe import BatchRecipe

StepHook = Callable[[int, int, int], None]  # (epoch index, steps done in it, global step)
FINITE_EVERY = SYNC_EVERY  # steps between checks that the loss is still finite


class StopTraining(Exception):  # noqa: N818 - a request, not an error
    """Raised by a callback to end the run after the step or epoch it was told about: the
    run's files are written and its summary returned, as after the last epoch."""


def diverged(epoch: int, step: int) -> CnnkitError:
    error = CnnkitError(
        f"training diverged at epoch {epoch + 1} step {step}: the loss is not finite (lower "
        "train.lr or set train.grad_clip); checkpoints saved before it are kept as they were"
    )
    error.agreed = True  # (every rank: they agree on it)
    return error


def weights_finite(network: torch.nn.Module) -> bool:
    """Whether every parameter is finite (one sync)."""
    flags = [torch.isfinite(p).all() for p in network.parameters()]
    return bool(torch.stack(flags).all().item()) if flags else True


@contextmanager
def _buffers_kept(*modules: torch.nn.Module | None) -> Iterator[None]:
    """The modules' buffers (BatchNorm's running statistics and batch count; the moving
    average's too) as they were before the body: a step weighted 0 runs its forward pass in
    training mode. (The moving average's weights still take the step, as the network's do.)"""
    saved = [(b, b.clone()) for m in modules if m is not None for b in m.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def _stand_in(empty: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two blank images of the network's input and label 0 (two: BatchNorm over a batch of
    one fails in training), for a rank whose first batch was all unreadable (weighted 0)."""
    x = torch.zeros(2, *empty.shape[1:], dtype=empty.dtype, device=empty.device)
    return x, torch.zeros(2, dtype=torch.long, device=empty.device)


class EpochStats:
    """The training statistics of the epoch in progress: device tensors added to at every step
    (no host sync), read only when needed (a checkpoint, the end of the epoch). `earlier` holds
    what sessions before a resume contributed to the same epoch: the sums go on from it in the
    same precision, so a resumed epoch's figures are the uninterrupted one's to the bit."""

    def __init__(self, device: torch.device, earlier: dict[str, float] | None = None):
        self.earlier = {"loss": 0.0, "correct": 0.0, "seen": 0.0, "seconds": 0.0, "waited": 0.0,
                        **(earlier or {})}  # fmt: skip
        self.loss_sum = torch.tensor(float(self.earlier["loss"]), device=device)  # fp32, as saved
        self.correct = torch.tensor(int(self.earlier["correct"]), device=device)
        self.seen = 0
        self.waited = 0.0  # seconds this session's part of the epoch waited for batches
        self.started = time.perf_counter()

    def finite(self) -> bool:
        """Whether every loss of the epoch so far was finite (a NaN or inf stays in the sum)."""
        return bool(torch.isfinite(self.loss_sum).item())

    def add(self, loss: torch.Tensor, correct: torch.Tensor, images: int) -> None:
        """One step's mean loss and number correct over `images` images."""
        self.loss_sum += loss.detach() * images
        self.correct += correct
        self.seen += images

    @property
    def seconds(self) -> float:
        """Wall time of this session's part of the epoch."""
        return time.perf_counter() - self.started

    def read(self) -> dict[str, float]:
        """Totals so far, earlier sessions included (syncs the device)."""
        return {
            "loss": self.loss_sum.item(),
            "correct": self.correct.item(),
            "seen": self.earlier["seen"] + self.seen,
            "seconds": self.earlier["seconds"] + self.seconds,
            "waited": self.earlier["waited"] + self.waited,
        }


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
    running: EpochStats | None = None  # this session's statistics of the epoch in progress
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # its checkpoints all say it

    def epoch_stats(self) -> dict[str, float]:
        """The statistics of the epoch in progress so far (what a mid-epoch checkpoint keeps)."""
        return self.running.read() if self.running is not None and self.step else {}


@torch.no_grad()
def evaluate(engine: Engine, batches: Batches, dist: Processes | None = None) -> dict[str, float]:
    """Loss, top-1 and top-5 over the whole validation stream (each image once, all ranks),
    and how many images were scored (unreadable ones are skipped)."""
    dist = dist or Local()
    model = engine.network.eval()
    totals = torch.zeros(4, device=engine.device, dtype=torch.float64)  # loss, top1, top5, n
    batches.set_epoch(0)
    for x, y in batches:
        if not len(y):  # every image of the batch unreadable (the loader said which)
            continue
        with engine.autocast():
            logits = model(engine.prepare(x)).float()
        totals[:3] += score_logits(logits.log_softmax(1), y)
        totals[3] += len(y)
    totals = dist.all_reduce(totals)
    check_read(totals[3].item(), batches)
    n = max(totals[3].item(), 1.0)
    return {
        "loss": totals[0].item() / n,
        "top1": totals[1].item() / n,
        "top5": totals[2].item() / n,
        "images": int(totals[3].item()),
    }


def check_read(images: float, batches: Batches) -> None:
    """DataError when a validation stream that lists images yielded none (every one
    unreadable): no figure rather than a 0% one."""
    listed = batches.num_samples
    if images == 0 and listed:
        raise DataError(f"no held-out image could be read: all {listed} were unreadable")


def score_logits(log_probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(summed loss, top-1 hits, top-5 hits) of a batch of log-probabilities, float64 on their
    device (no host sync)."""
    k = min(5, log_probs.shape[1])
    hits = log_probs.topk(k, 1).indices == y[:, None]  # (B, k)
    loss = torch.nn.functional.nll_loss(log_probs, y, reduction="sum")
    return torch.stack([loss.double(), hits[:, 0].sum().double(), hits.any(1).sum().double()])


def check_progress(stats: EpochStats, progress: Progress, dist: Processes) -> None:
    """What the ranks agree on every FINITE_EVERY steps (each check syncs): the loss is still
    finite on every rank, and some rank has read an image this epoch (not all unreadable:
    HEIC files named .jpg, a damaged copy). Either failing ends every rank alike."""
    read = stats.seen + stats.earlier["seen"] > 0
    (bad, anyone_read), _ = dist.agree((not stats.finite(), read))
    if bad:
        raise diverged(progress.epoch, progress.step)
    if not anyone_read:
        error = DataError(f"no training image of the first {progress.step} batches of epoch "
                          f"{progress.epoch + 1} could be read (each was skipped, as said "
                          "above): is the data set readable?")  # fmt: skip
        error.agreed = True
        raise error


def train_one_epoch(
    engine: Engine,
    batches: Batches,
    schedule: Schedule,
    progress: Progress,
    console: Console,
    on_step: StepHook,
    dist: Processes,
    recipe: BatchRecipe | None = None,
) -> dict[str, float]:
    """Train from progress.step to the end of epoch progress.epoch; return its train stats.
    `recipe`: augmentation and mixing of the batch on its device (train/recipe.py)."""
    steps = len(batches)
    batches.set_epoch(progress.epoch, skip_batches=progress.step)
    stats = progress.running = EpochStats(engine.device, progress.partial)
    loss = torch.zeros((), device=engine.device)
    it = iter(batches)
    # a step with collectives inside (DDP's all-reduces, SyncBatchNorm's): never skipped
    ddp = hasattr(engine.model, "no_sync") or any(
        isinstance(m, torch.nn.SyncBatchNorm) for m in engine.network.modules()
    )
    kept = None
    while True:
        t0 = time.perf_counter()
        x, y = next(it, (None, None))
        stats.waited += time.perf_counter() - t0
        if x is None:
            break
        at = progress.epoch + progress.step / steps  # where in the schedule this step is
        if engine.takes(len(y)):  # else every image of the batch was unreadable (the loader
            # said which), or all but one through a BatchNorm that needs 2: it trains on none
            if recipe is not None and recipe.active:
                x, y = recipe(x, y, engine.network.num_classes)
            schedule.apply(engine.optimizer, at)
            loss, hits = train_step(engine, x, y)
            stats.add(loss, hits, len(y))
            kept = (x, y) if ddp else None
        elif ddp or dist.world_size > 1:  # the other ranks step, and DDP's all-reduces pair
            # across ranks (sync: average's need the same optimizer state on each): this one
            # steps too, on its last batch weighted 0: its gradient adds nothing to the sum, but
            # DDP still divides by every rank, so that step's gradient is (W - 1) / W of the
            # others' mean (rare: a whole batch of unreadable files)
            schedule.apply(engine.optimizer, at)
            average = engine.ema.module if engine.ema is not None else None
            with _buffers_kept(engine.network, average):  # nor moves BatchNorm's statistics
                train_step(engine, *(kept or _stand_in(x)), scale=0.0)
        progress.step += 1
        progress.global_step += 1
        if reads_device(progress.step, steps):
            check_progress(stats, progress, dist)
        dist.after_step(engine, progress.global_step, progress.step == steps)
        seconds = max(stats.seconds, 1e-9)
        console.step(StepInfo(progress.epoch + 1, schedule.cfg.epochs, progress.step, steps, loss,
                              progress.global_step, schedule.lr(at),
                              stats.seen * dist.world_size / seconds, stats.waited / seconds, seconds))  # fmt: skip
        on_step(progress.epoch, progress.step, progress.global_step)
    return stats.read()
