"""The epochs of a run: train, evaluate (the weights and their moving average), save, stop.

A run ends after its last epoch, when the held-out top-1 has not improved for
`train.early_stop` epochs, when a callback raises StopTraining, or at Ctrl-C (saved at the
step boundary, exit 130 with the line to resume).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from cnnkit.checkpoint import rng_state
from cnnkit.distributed import resume_command
from cnnkit.errors import Interrupted, StoppedWithGroup, plural
from cnnkit.train.engine import Engine
from cnnkit.train.loop import (
    Progress,
    StepHook,
    StopTraining,
    diverged,
    evaluate,
    train_one_epoch,
    weights_finite,
)
from cnnkit.train.metrics import Console, best_epoch
from cnnkit.train.optim import Schedule
from cnnkit.train.recipe import BatchRecipe
from cnnkit.train.saver import CheckpointWriter, MidEpochSaves
from cnnkit.train.state import RunContext, ema_buffers, training_state
from cnnkit.train.summary import epoch_row


@dataclass
class Hooks:
    """What the caller hears of a run: a step hook `on_step(epoch, step, global_step)` and
    callbacks (objects with optional `on_step_end(epoch, step, global_step)` and
    `on_epoch_end(row)` methods); epoch and step counted from 1, as the log and metrics.csv
    count them (on_step's epoch was counted from 0)."""

    on_step: StepHook | None = None
    callbacks: Sequence[Any] = field(default_factory=list)

    def step(self, epoch: int, step: int, global_step: int) -> None:
        if self.on_step is not None:
            self.on_step(epoch + 1, step, global_step)
        for cb in self.callbacks:
            if hasattr(cb, "on_step_end"):
                cb.on_step_end(epoch + 1, step, global_step)

    def epoch(self, row: dict[str, float]) -> None:
        for cb in self.callbacks:
            if hasattr(cb, "on_epoch_end"):
                cb.on_epoch_end(dict(row))


class StopRequest:
    """Set by the first Ctrl-C: the run stops after the step in progress (alone) or at the
    next step where the processes of a group agree (Agreement), saved. `callback`: a callback
    raised StopTraining on this rank (in a group, every rank stops at the next agreed step)."""

    requested = False
    callback = False


AGREE_SECONDS = 5.0  # between a group's checks for a Ctrl-C: torchrun's agent kills at 30 s
AGREE_MOST = 16  # steps between checks at most (each is a tiny all-reduce and a host sync)


class Agreement:
    """When the processes of a group check together for a Ctrl-C or a callback's stop: at
    first every step, then every K steps, K chosen so that checks come about every
    AGREE_SECONDS (the slowest rank's proposal wins); so the agreed step comes well within
    torchrun's 30 s of grace however long a step takes, and a GPU's short steps are not synced
    each. Returns (interrupted, stopped by a callback), the same on every rank."""

    def __init__(self) -> None:
        self.next, self.last, self.since = 0, 0, time.perf_counter()

    def stop(self, dist: Any, request: StopRequest, global_step: int,
             epoch_end: bool) -> tuple[bool, bool]:  # fmt: skip
        if global_step < self.next and not epoch_end:
            return False, False
        now = time.perf_counter()
        per_step = (now - self.since) / max(global_step - self.last, 1)
        every = max(1, min(AGREE_MOST, int(AGREE_SECONDS / max(per_step, 1e-6))))
        (interrupted, callback), every = dist.agree((request.requested, request.callback), every)
        self.next, self.last, self.since = global_step + every, global_step, now
        return interrupted, callback


@contextmanager
def stop_on_interrupt() -> Iterator[StopRequest]:
    """The first Ctrl-C asks the run to stop at a step boundary (saving last.pt there, so the
    resumed run is exact); a second one stops at once. Only in the main thread, and not in a
    background job (SIGINT ignored). A rank of torchrun gets the Ctrl-C from its agent (ranks
    run in sessions of their own, away from the terminal's)."""
    stop = StopRequest()
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT)
    if not in_main or previous is signal.SIG_IGN:  # SIG_IGN: a background job
        yield stop
        return

    def handler(signum, frame) -> None:
        if stop.requested:
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        stop.requested = True

    signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def check_finite(engine: Engine, progress: Progress, dist: Any) -> None:
    """Never save a diverged model: the loss and every weight must be finite (on every rank:
    all of a group stop together, none left waiting in the save's gather)."""
    stats_ok = progress.running is None or progress.running.finite()
    (bad,), _ = dist.agree((not stats_ok or not weights_finite(engine.network),))
    if bad:
        raise diverged(progress.epoch, progress.step)


def stale_epochs(history: list[dict[str, float]]) -> int:
    """Epochs since the best held-out top-1 (0 when the last epoch is the best)."""
    if not history:
        return 0
    return len(history) - 1 - best_epoch(history)


def train_epochs(engine: Engine, schedule: Schedule, progress: Progress, console: Console,
                 hooks: Hooks, ctx: RunContext, writer: CheckpointWriter,
                 stop: StopRequest) -> None:  # fmt: skip
    """Epoch after epoch until the run ends (see the module's docstring)."""
    config, data, dist = ctx.config, ctx.data, ctx.dist
    steps, epochs = len(data.train), config.train.epochs
    after_step = _after_step(engine, schedule, progress, hooks, ctx, writer, stop)
    pre = data.preprocess
    d = config.data
    recipe = BatchRecipe(d.policy, d.magnitude, d.num_ops, d.erasing, d.mixup, d.cutmix,
                         tuple(pre.mean), tuple(pre.std))  # fmt: skip
    try:
        while progress.epoch < epochs and not _early_stop(
            progress, config.train.early_stop, console
        ):
            console.start_epoch(progress.epoch + 1, epochs, steps, progress.step)
            stats = train_one_epoch(engine, data.train, schedule, progress, console, after_step,
                                    dist, recipe)  # fmt: skip
            row = _evaluate(engine, progress, stats, schedule, ctx)
            schedule.end_epoch(1.0 - row["val_top1"])
            progress.history.append(row)
            progress.epoch, progress.step, progress.partial = progress.epoch + 1, 0, {}
            progress.running = None
            save_epoch(engine, schedule, progress, ctx, row, writer)
            console.end_epoch(row, epochs)
            if _stopped_after_epoch(hooks, row, stop, dist):
                raise StopTraining
    except StopTraining:
        _stopped_by_callback(engine, schedule, progress, console, ctx, writer)


def _after_step(engine: Engine, schedule: Schedule, progress: Progress, hooks: Hooks,
                ctx: RunContext, writer: CheckpointWriter,
                stop: StopRequest) -> StepHook:  # fmt: skip
    """What follows each step: last.pt when a mid-epoch save is due, a stop (Ctrl-C or a
    callback's) saved and raised, then the hooks."""
    config, dist = ctx.config, ctx.dist
    steps = len(ctx.data.train)
    saves = MidEpochSaves(config.train.checkpoint_every, config.train.checkpoint_minutes, dist)
    agreement = Agreement()

    def stopping(step: int, global_step: int) -> tuple[bool, bool]:
        """A Ctrl-C or a callback's stop: alone at once; in a group at a step every rank
        agrees on."""
        if dist.world_size == 1:
            return stop.requested, stop.callback
        return agreement.stop(dist, stop, global_step, step == steps)

    def after_step(epoch: int, step: int, global_step: int) -> None:
        stop_now, stopped = stopping(step, global_step)
        if saves.due(global_step, step, steps, dist.synced(global_step, step == steps)):
            save_mid_epoch(engine, schedule, progress, ctx, writer)
        elif stop_now:  # sync: average between two averagings: average early
            dist.average(engine)
            save_mid_epoch(engine, schedule, progress, ctx, writer)
        if stop_now:
            writer.wait()
            where = f"at epoch {epoch + 1} step {step} (saved); resume with "
            resume = resume_command(ctx.run_dir, dist.world_size)
            if not stop.requested:  # the Ctrl-C reached another process of the group only
                raise StoppedWithGroup(f"stopped with the group's interrupted processes {where}"
                                       f"{resume}")  # fmt: skip
            raise Interrupted(f"interrupted {where}{resume}")
        if stopped:  # a callback raised StopTraining on some rank at an earlier step
            raise StopTraining
        try:
            hooks.step(epoch, step, global_step)
        except StopTraining:
            if dist.world_size == 1:
                raise
            stop.callback = True  # every rank stops at the next step they agree on

    return after_step


def _stopped_by_callback(engine: Engine, schedule: Schedule, progress: Progress,
                         console: Console, ctx: RunContext,
                         writer: CheckpointWriter) -> None:  # fmt: skip
    """A callback stopped the run: say where it stopped (inside an epoch: saved there)."""
    console.close()
    where = (f"at epoch {progress.epoch + 1} step {progress.step}" if progress.step
             else f"after epoch {progress.epoch}")  # fmt: skip
    console.print(f"stopped by a callback {where}")
    if progress.step:  # inside an epoch: keep where it stood (sync: average: averaged)
        ctx.dist.average(engine)
        save_mid_epoch(engine, schedule, progress, ctx, writer)


def _stopped_after_epoch(hooks: Hooks, row: dict[str, float], stop: StopRequest,
                         dist: Any) -> bool:  # fmt: skip
    """The callbacks hear of the epoch; True where one raised StopTraining on any rank (every
    rank of a group then stops here, or none)."""
    try:
        hooks.epoch(row)
    except StopTraining:
        stop.callback = True
    return dist.agree((stop.callback,))[0][0]


def _early_stop(progress: Progress, patience: int, console: Console) -> bool:
    if not patience or stale_epochs(progress.history) < patience:
        return False
    best = progress.history[best_epoch(progress.history)]
    console.print(
        f"early stop: no held-out gain for {plural(patience, 'epoch')} (best "
        f"{best['val_top1']:.2%} at epoch {int(best['epoch'])})"
    )
    return True


def _evaluate(engine: Engine, progress: Progress, stats: dict[str, float], schedule: Schedule,
              ctx: RunContext) -> dict[str, float]:  # fmt: skip
    """The epoch's row: training figures, held-out ones, and the moving average's if kept."""
    val = evaluate(engine, ctx.data.val, ctx.dist)
    row = epoch_row(progress, stats, val, schedule, ctx.dist, engine.device)
    if engine.ema is not None:
        averaged = evaluate(replace(engine, network=engine.ema.module), ctx.data.val, ctx.dist)
        row.update({f"val_{k}_ema": averaged[k] for k in ("loss", "top1", "top5")})
    return row


def save_mid_epoch(engine: Engine, schedule: Schedule, progress: Progress, ctx: RunContext,
                   writer: CheckpointWriter) -> None:  # fmt: skip
    """last.pt in the middle of an epoch (every rank's generators and statistics of the epoch
    so far gathered for exact resume; under DDP, each rank's moving average's buffers too: its
    BatchNorm statistics follow the rank's own batches until the epoch's end averages them)."""
    check_finite(engine, progress, ctx.dist)
    ranks = ctx.dist.gather((rng_state(), progress.epoch_stats(), ema_buffers(engine)))
    if ctx.dist.is_main:
        writer.save(
            (training_state(engine, schedule, progress, ctx, ranks), ctx.run_dir / "last.pt")
        )


def save_epoch(engine: Engine, schedule: Schedule, progress: Progress, ctx: RunContext,
               row: dict[str, float], writer: CheckpointWriter) -> None:  # fmt: skip
    """best.pt (if the epoch is the best), best_ema.pt (if the moving average's is: timm's
    choice), and last.pt, written in the background, between the epoch's TensorBoard row and
    the metrics files (a kill in between is harmless: a resumed run purges the one and rewrites
    the others from last.pt)."""
    check_finite(engine, progress, ctx.dist)
    ranks = ctx.dist.gather((rng_state(), {}))
    if not ctx.dist.is_main:
        return
    state = training_state(engine, schedule, progress, ctx, ranks)
    saves = []
    skip = ("optimizer", "scaler", "rng", "rng_ranks")
    last = len(progress.history) - 1  # this epoch's row
    if best_epoch(progress.history) == last:
        progress.best_top1 = state["best_top1"] = row["val_top1"]
        saves.append(({k: v for k, v in state.items() if k not in skip}, ctx.run_dir / "best.pt"))
    if "val_top1_ema" in row and best_epoch(progress.history, "_ema") == last:
        best = {k: v for k, v in state.items() if k not in skip}
        saves.append((best, ctx.run_dir / "best_ema.pt"))
    ctx.log.log_epoch(row, progress.global_step)
    first = not (ctx.run_dir / "last.pt").exists()
    writer.save(*saves, (state, ctx.run_dir / "last.pt"))
    if first:  # the run's first last.pt on disk before its first metrics row: a save that fails
        writer.wait()  # (a full disk) then leaves no record of an epoch without its checkpoint
    ctx.log.write_epoch(final=progress.epoch == ctx.config.train.epochs)
