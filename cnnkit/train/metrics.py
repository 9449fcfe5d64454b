"""What a run records and shows: metrics.csv, TensorBoard, curves.png, summary.json, and the
console (a rich progress bar per epoch, then one summary line).
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

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
]


class RunLog:
    """Rank 0's writer of the run directory's metrics files; `history` is the source of truth."""

    def __init__(self, run_dir: Path, history: list[dict[str, float]], tensorboard: bool = True):
        self.run_dir = run_dir
        self.history = history
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir), purge_step=len(history) + 1)
        self._last_plot = 0.0

    def write_epoch(self, row: dict[str, float], final: bool = False) -> None:
        """Record the epoch `row` (already last in history): rewrite metrics.csv (one row per
        epoch), log to TensorBoard, redraw curves.png (throttled for sub-second epochs)."""
        write_csv(self.run_dir / "metrics.csv", self.history)
        if self.tb is not None:
            step = int(row["epoch"])
            for key in COLUMNS[1:]:
                self.tb.add_scalar(key.replace("_", "/", 1), row[key], step)
            self.tb.flush()
        if final or row["seconds"] > 1.0 or time.monotonic() - self._last_plot > 5.0:
            plot_curves(self.history, self.run_dir / "curves.png")
            self._last_plot = time.monotonic()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def write_csv(path: Path, rows: list[dict[str, float]]) -> None:
    """All rows, written to a temporary file and renamed."""
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _fmt(row[k]) for k in COLUMNS})
    tmp.replace(path)


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e9 else f"{v:.6g}"


def plot_curves(history: list[dict[str, float]], path: Path) -> None:
    """curves.png: loss, top-1 error and learning rate per epoch (written to a temporary file
    and renamed, so a viewer never reads half a picture)."""
    tmp = path.with_suffix(".tmp.png")
    curves_figure(history).savefig(tmp, dpi=110)
    tmp.replace(path)


def curves_figure(history: list[dict[str, float]]):
    """Three panels, 12 x 4 inches (1320 x 440 pixels at 110 dpi): loss, top-1 error (linear,
    in %, so that an epoch at 0% stays in the picture) train vs validation, learning rate."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    epochs = [r["epoch"] for r in history]
    fig = Figure(figsize=(12, 4), layout="constrained")
    loss, error, lr = fig.subplots(1, 3)
    style = {"marker": "o", "markersize": 3 if len(epochs) <= 60 else 0, "linewidth": 1.5}
    for split in ("train", "val"):
        loss.plot(epochs, [r[f"{split}_loss"] for r in history], label=split, **style)
        error.plot(epochs, [100 * (1 - r[f"{split}_top1"]) for r in history], label=split, **style)
    top = max([100 * (1 - r[f"{k}_top1"]) for r in history for k in ("train", "val")] + [1.0])
    error.set_ylim(-0.04 * top, 1.06 * top)  # 0% sits just above the axis, never off it
    error.yaxis.set_major_formatter(PercentFormatter(decimals=None))
    lr.plot(epochs, [r.get("lr", float("nan")) for r in history], color="C2", **style)
    lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    loss.set(ylabel="cross-entropy", title="loss")
    error.set(ylabel="top-1 error", title="top-1 error" + _best(epochs, history))
    lr.set(ylabel="learning rate", title="learning rate")
    for ax in (loss, error, lr):
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    loss.legend()
    error.legend()
    return fig


def _best(epochs: list[float], history: list[dict[str, float]]) -> str:
    val = [100 * (1 - r["val_top1"]) for r in history]
    if not val:
        return ""
    best = min(range(len(val)), key=val.__getitem__)
    return f" (val: best {val[best]:.1f}% at epoch {epochs[best]:g}, last {val[-1]:.1f}%)"


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """summary.json (accuracies in [0, 1])."""
    path.write_text(json.dumps(summary, indent=2) + "\n")


class Console:
    """Per-epoch progress bar (loss, images/s, ETA) and one line per epoch; silent if quiet."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.progress = None
        self._task = None
        self._last = 0.0
        if not quiet:
            from rich.console import Console as RichConsole

            self.console = RichConsole(stderr=True, highlight=False)

    def print(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text, markup=False, soft_wrap=True)

    def start_epoch(self, epoch: int, epochs: int, steps: int, done: int) -> None:
        if self.quiet or not self.console.is_terminal:  # log files get the epoch lines only
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
        self._task = self.progress.add_task("", total=steps, completed=done, loss="-", speed="-")

    def step(self, done: int, loss: Any, images_per_second: float) -> None:
        """Refresh the bar at most 10 times a second (reading the loss syncs the device)."""
        now = time.monotonic()
        if self.progress is None or now - self._last < 0.1:
            return
        self._last = now
        self.progress.update(
            self._task, completed=done, loss=f"{float(loss):.4f}", speed=f"{images_per_second:.0f}"
        )

    def end_epoch(self, row: dict[str, float], epochs: int) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        self.print(
            f"epoch {int(row['epoch'])}/{epochs}  train loss {row['train_loss']:.4f} "
            f"top-1 {row['train_top1']:.2%}  val loss {row['val_loss']:.4f} "
            f"top-1 {row['val_top1']:.2%} top-5 {row['val_top5']:.2%}  lr {row['lr']:.3g}  "
            f"{row['images_per_second']:.0f} img/s  {row['seconds']:.1f}s"
        )
