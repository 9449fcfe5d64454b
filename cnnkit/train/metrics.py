"""What a run records and shows: metrics.csv, TensorBoard, curves.png, summary.json, and the
console (a rich progress bar per epoch, then one summary line).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cnnkit.errors import one_line
from cnnkit.runtime import write_atomic

SYNC_EVERY = 16  # steps of an epoch between the loop's reads of the device (each one syncs)
LOG_EVERY = SYNC_EVERY  # TensorBoard's per-step scalars: at those reads, never one more


def reads_device(step: int, steps: int) -> bool:
    """Whether the loop reads the device after `step` of an epoch of `steps` (every
    SYNC_EVERY-th and the last): the steps where reading the loss costs no extra sync."""
    return step % SYNC_EVERY == 0 or step == steps


PLOT_EVERY = 30.0  # seconds between redrawings of curves.png during a run
EMA_COLUMNS = ["val_loss_ema", "val_top1_ema", "val_top5_ema"]
COLUMNS = [
    "epoch",
    "train_loss",
    "train_top1",
    "val_loss",
    "val_top1",
    "val_top5",
    "lr",
    "images_per_second",
    "seconds",
    "data_wait",  # share of the epoch's training time spent waiting for the loader
]


class RunLog:
    """Rank 0's writer of the run directory's metrics files; `history` is the source of truth."""

    def __init__(self, run_dir: Path, history: list[dict[str, float]], tensorboard: bool = True,
                 global_step: int = 0) -> None:  # fmt: skip
        """`global_step`: where a resumed run's checkpoint stands. Every TensorBoard scalar is
        on the global-step axis (epoch rows at their last step, with an `epoch` scalar), so
        what a killed session logged after its checkpoint is purged, and nothing before."""
        self.run_dir = run_dir
        self.history = history
        self.tb = None  # made at the first scalar: a resume with nothing to do writes no file
        self._tensorboard, self._purge_step = tensorboard, global_step + 1
        self._last_plot = time.monotonic()
        self._plotted = len(history)  # epochs in curves.png (a resumed run's: drawn before)

    def log_epoch(self, row: dict[str, float], global_step: int) -> None:
        """The epoch `row` to TensorBoard at `global_step` (its last step). Logged before the
        epoch's last.pt is written: a kill in between leaves a row that the resumed session's
        purge (from the checkpoint's step on) drops, never an epoch missing for good."""
        if self._writer() is not None:
            self.tb.add_scalar("epoch", row["epoch"], global_step)
            for key in (k for k in COLUMNS[1:] + EMA_COLUMNS if k in row):
                self.tb.add_scalar(tensorboard_tag(key), row[key], global_step)
            self.tb.flush()

    def write_epoch(self, final: bool = False) -> None:
        """Rewrite metrics.csv from history (one row per epoch; a resumed run's drops the rows
        written after its checkpoint) and redraw curves.png (at the end, and at most every
        PLOT_EVERY seconds: a drawing costs about 0.3 s)."""
        write_csv(self.run_dir / "metrics.csv", self.history)
        if final or time.monotonic() - self._last_plot > PLOT_EVERY:
            self._plot()

    def _plot(self) -> None:
        plot_curves(self.history, self.run_dir / "curves.png", run_title(self.run_dir))
        self._last_plot, self._plotted = time.monotonic(), len(self.history)

    def write_step(self, global_step: int, loss: Any, lr: float, images_per_second: float) -> None:
        """Per-step scalars for TensorBoard (every LOG_EVERY steps; reading the loss, a device
        tensor, syncs: only where TensorBoard writes)."""
        if self._writer() is not None:
            self.tb.add_scalar("step/loss", float(loss), global_step)
            self.tb.add_scalar("step/lr", lr, global_step)
            self.tb.add_scalar("step/images_per_second", images_per_second, global_step)

    def _writer(self) -> Any:
        """TensorBoard's writer, made on first use (None without TensorBoard)."""
        if self.tb is None and self._tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir), purge_step=self._purge_step)
        return self.tb

    def close(self) -> None:
        """Draw the epochs curves.png lacks (a run that stopped early: early_stop, a callback,
        Ctrl-C), then close TensorBoard's file."""
        try:
            if self.history and self._plotted != len(self.history):
                self._plot()
        except Exception as e:  # noqa: BLE001 - may run while a run's own error propagates
            print(f"cnnkit: note: curves.png not redrawn ({one_line(e)})", file=sys.stderr)
        finally:
            if self.tb is not None:
                self.tb.close()


def tensorboard_tag(key: str) -> str:
    """An epoch column's TensorBoard tag: train_loss -> train/loss, val_top1_ema ->
    val/top1_ema; the others under epoch/ (epoch/lr, epoch/images_per_second)."""
    split, _, rest = key.partition("_")
    return f"{split}/{rest}" if split in ("train", "val") and rest else f"epoch/{key}"


def write_csv(path: Path, rows: list[dict[str, float]]) -> None:
    """All rows, written to a temporary file and renamed (the moving average's columns too,
    when any epoch has them: a resume that turns the average off keeps the earlier values)."""
    columns = COLUMNS + [k for k in EMA_COLUMNS if any(k in row for row in rows)]
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _fmt(row[k]) if k in row else "" for k in columns})
    write_atomic(path, text.getvalue().encode())  # (a failure names metrics.csv, leaves no .tmp)


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e9 else f"{v:.6g}"


def run_title(run_dir: Path) -> str:
    """How a run's pictures name it: its directory's name, a mining round's with its run's
    (`faces-20261208-0900 round-4`: the run's own curves.png is its chosen round's)."""
    run_dir = Path(run_dir)
    if re.fullmatch(r"round-\d+", run_dir.name) and run_dir.parent.name:
        return f"{run_dir.parent.name} {run_dir.name}"
    return run_dir.name


def plot_curves(history: list[dict[str, float]], path: Path, title: str | None = None) -> None:
    """curves.png: loss, top-1 error and learning rate per epoch, under `title` (written to a
    temporary file and renamed, so a viewer never reads half a picture)."""
    picture = io.BytesIO()
    curves_figure(history, title).savefig(picture, dpi=110, format="png")
    write_atomic(path, picture.getvalue())


def curves_figure(history: list[dict[str, float]], title: str | None = None):
    """Three panels, 12 x 4 inches (1320 x 440 pixels at 110 dpi): loss, top-1 error (linear,
    in %, so that an epoch at 0% stays in the picture) train vs validation (and the weights'
    moving average where the run keeps one), learning rate; `title` above them.
    The margins are fixed: a layout engine measuring every label doubled the drawing's time."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    epochs = [r["epoch"] for r in history]
    fig = Figure(figsize=(12, 4))
    fig.subplots_adjust(left=0.065, right=0.99, bottom=0.12, top=0.84 if title else 0.91,
                        wspace=0.3)  # fmt: skip
    if title:
        fig.suptitle(title, fontsize=11)
    loss, error, lr = fig.subplots(1, 3)
    style = {"marker": "o", "markersize": 3 if len(epochs) <= 60 else 0, "linewidth": 1.5}
    # the training loss is the one optimised (label smoothing, mixing), the held-out one plain
    splits = [
        ("train", "", "train (as optimised)", "train"),
        ("val", "", "val (cross-entropy)", "val"),
    ]
    if any("val_top1_ema" in r for r in history):  # (NaN where a resume turned it on later)
        splits.append(("val", "_ema", "val, weights' EMA", "val, weights' EMA"))
    for split, ema, said, short in splits:
        loss.plot(epochs, [r.get(f"{split}_loss{ema}", math.nan) for r in history], label=said,
                  **style)  # fmt: skip
        errors = [100 * (1 - r.get(f"{split}_top1{ema}", math.nan)) for r in history]
        error.plot(epochs, errors, label=short, **style)
    top = max([100 * (1 - r[k]) for r in history for k in ("train_top1", "val_top1",
               "val_top1_ema") if k in r] + [1.0])  # fmt: skip
    error.set_ylim(-0.04 * top, 1.06 * top)  # 0% sits just above the axis, never off it
    error.yaxis.set_major_formatter(PercentFormatter(decimals=None))
    lr.plot(epochs, [r.get("lr", float("nan")) for r in history], color="C4", **style)
    for ax in (loss, lr):  # short tick labels (1e-4 etc. above the axis): they fit the margin
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    loss.set(ylabel="loss", title="loss")
    error.set(ylabel="top-1 error", title="top-1 error" + _best(epochs, history))
    lr.set(ylabel="learning rate", title="learning rate")
    for ax in (loss, error, lr):
        ax.set_xlabel("epoch")
        _epoch_axis(ax, epochs)
        ax.grid(alpha=0.3)
    loss.legend()
    error.legend()
    return fig


def _epoch_axis(ax, epochs: list[float]) -> None:
    """Whole epochs only, at least half an epoch of room at each end: one epoch spans 0.5 to
    1.5 with one tick, not matplotlib's 0.945 to 1.065 in crowded hundredths (its integer
    locator gives up on fewer than two whole numbers in sight, unless told min_n_ticks=1)."""
    from matplotlib.ticker import MaxNLocator

    if epochs:
        first, last = min(epochs), max(epochs)
        room = max(0.5, 0.05 * (last - first))  # matplotlib's own 5% margins on long runs
        ax.set_xlim(first - room, last + room)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


def _best(epochs: list[float], history: list[dict[str, float]]) -> str:
    best = best_epoch(history)
    if best is None:
        return ""
    val = [100 * (1 - r["val_top1"]) for r in history]
    return f" (val: best {val[best]:.1f}% at epoch {epochs[best]:g}, last {val[-1]:.1f}%)"


def best_epoch(history: list[dict[str, float]], suffix: str = "") -> int | None:
    """The index of the best held-out epoch, the one best.pt keeps: the highest top-1, the
    first of a tie (timm's and Lightning's rule: a later epoch must do better to replace it;
    tried: ties to the lower held-out loss moved the faces run's detection of astronaut()'s
    face from 1st to 3rd-5th). `suffix` "_ema": the moving average's (best_ema.pt). None
    where no row has the figure."""
    rows = [i for i, r in enumerate(history) if f"val_top1{suffix}" in r]
    return max(rows, key=lambda i: (history[i][f"val_top1{suffix}"], -i), default=None)


def tied_after(history: list[dict[str, float]], best: int) -> int:
    """How many epochs after `best` scored its held-out top-1 again (said on the last line: a
    held-out set too small to tell epochs apart)."""
    return sum(r["val_top1"] == history[best]["val_top1"] for r in history[best + 1 :])


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """summary.json (accuracies in [0, 1]), written whole or not at all."""
    write_atomic(path, (json.dumps(summary, indent=2) + "\n").encode())


@dataclass
class StepInfo:
    """Where an epoch stands after a step, for the console (the loss is read only if shown)."""

    epoch: int  # 1-based
    epochs: int
    step: int  # steps done in the epoch
    steps: int
    loss: Any  # a device tensor: reading it syncs
    global_step: int
    lr: float
    images_per_second: float
    data_wait: float  # share of the epoch's time spent waiting for batches
    seconds: float  # this session's time in the epoch


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Console:
    """What a run prints: on a terminal, a progress bar per epoch (loss, images/s, ETA); in a
    log file (SLURM, `| tee`), a plain line every `every` seconds (step, loss, lr, images/s,
    data-wait share, ETA); then one line per epoch. If quiet, only the run's last line (`last`:
    whether that is said at all)."""

    def __init__(self, quiet: bool = False, every: float = 10.0, top5: bool = True,
                 log: RunLog | None = None, last: bool = True) -> None:  # fmt: skip
        from rich.console import Console as RichConsole

        self.quiet, self.every, self.top5, self.log, self.last = quiet, every, top5, log, last
        self.progress = None
        self._task = None
        self._last = 0.0
        self._loss = "-"  # the bar's: the loss last read at a step that reads the device
        self._logged = (0, 0.0, 0.0)  # (step, images, seconds) of the epoch at the last log point
        self.console = RichConsole(highlight=False)  # stdout: `| tee` and `> log` keep it
        self.terminal = self.console.is_terminal

    def print(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text, markup=False, soft_wrap=True)

    def print_last(self, text: str) -> None:
        """The run's last line (how it did, where it is), quiet or not: without it a quiet run
        never says which run directory it made."""
        if self.last:
            self.console.print(text, markup=False, soft_wrap=True)

    def start_epoch(self, epoch: int, epochs: int, steps: int, done: int) -> None:
        self._last = time.monotonic()
        if self.quiet or not self.terminal:  # log files get periodic lines instead
            return
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn(f"epoch {epoch}/{epochs}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]}  {task.fields[speed]} img/s"),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )
        self.progress.start()
        self._task = self.progress.add_task(
            "", total=steps, completed=done, loss=self._loss, speed="-"
        )

    def _window_rate(self, info: StepInfo) -> float:
        """Images/s over the steps since the previous log point of the epoch (the epoch's own
        average, which the epoch line gives, would hide a slowdown late in a long epoch)."""
        images = info.images_per_second * info.seconds
        _, before, then = self._logged if self._logged[0] < info.step else (0, 0.0, 0.0)
        self._logged = (info.step, images, info.seconds)
        return (images - before) / max(info.seconds - then, 1e-9)

    def step(self, info: StepInfo) -> None:
        """Refresh the bar at most 10 times a second, or print a line every `every` seconds.
        Reading the loss syncs the device: the bar shows the loss read where the loop reads
        the device anyway (reads_device), never one read of its own (a refresh every few
        steps of a fast GPU would stall it); a line every `every` seconds reads it."""
        at_sync = reads_device(info.step, info.steps)
        if at_sync and self.progress is not None:
            self._loss = f"{float(info.loss):.4f}"
        if self.log is not None and at_sync:
            self.log.write_step(info.global_step, info.loss, info.lr, self._window_rate(info))
        if self.quiet:
            return
        now = time.monotonic()
        if now - self._last < (0.1 if self.progress is not None else self.every):
            return
        self._last = now
        if self.progress is not None:
            self.progress.update(self._task, completed=info.step, loss=self._loss,
                                 speed=f"{info.images_per_second:.0f}")  # fmt: skip
            return
        left = info.seconds / max(info.step, 1) * (info.steps - info.step)
        self.print(
            f"epoch {info.epoch}/{info.epochs}  step {info.step}/{info.steps}  loss "
            f"{float(info.loss):.4f}  lr {info.lr:.3g}  {info.images_per_second:.0f} img/s  "
            f"data wait {info.data_wait:.0%}  epoch eta {_clock(left)}"
        )

    def close(self) -> None:
        """Stop the bar (its refresh thread, the hidden cursor) wherever the epoch ended:
        Ctrl-C, divergence, a callback's stop, an error."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def end_epoch(self, row: dict[str, float], epochs: int) -> None:
        self.close()
        top5 = f" top-5 {row['val_top5']:.2%}" if self.top5 else ""
        ema = f" (EMA {row['val_top1_ema']:.2%})" if "val_top1_ema" in row else ""
        self.print(
            f"epoch {int(row['epoch'])}/{epochs}  train loss {row['train_loss']:.4f} "
            f"top-1 {row['train_top1']:.2%}  val loss {row['val_loss']:.4f} "
            f"top-1 {row['val_top1']:.2%}{ema}{top5}  lr {row['lr']:.3g}  "
            f"{row['images_per_second']:.0f} img/s  {row['seconds']:.1f}s"
        )
