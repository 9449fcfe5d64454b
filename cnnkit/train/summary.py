"""The figures of a run: one row per epoch (metrics.csv, TensorBoard) and summary.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from cnnkit.distributed import Processes
from cnnkit.errors import plural
from cnnkit.train.engine import Engine
from cnnkit.train.loop import Progress
from cnnkit.train.metrics import Console, best_epoch, tied_after, write_summary
from cnnkit.train.optim import Schedule
from cnnkit.train.state import RunContext


def epoch_row(
    progress: Progress, stats: dict[str, float], val: dict[str, float], schedule: Schedule,
    dist: Processes, device: torch.device,
) -> dict[str, float]:  # fmt: skip
    """The epoch's figures, training ones summed over ranks."""
    total = torch.tensor([stats["loss"], stats["correct"], stats["seen"]], device=device)
    loss, correct, seen = dist.all_reduce(total.double()).tolist()
    seen = max(seen, 1.0)
    return {
        "epoch": progress.epoch + 1,
        "train_loss": loss / seen,
        "train_top1": correct / seen,
        "val_loss": val["loss"],
        "val_top1": val["top1"],
        "val_top5": val["top5"],
        "val_images": val["images"],  # scored (not in metrics.csv): unreadable ones skipped
        "lr": schedule.lr(progress.epoch + 1 - 1 / max(progress.step, 1)),  # the last step's
        "images_per_second": seen / max(stats["seconds"], 1e-9),
        "seconds": stats["seconds"],
        "data_wait": stats.get("waited", 0.0) / max(stats["seconds"], 1e-9),  # rank 0's share
    }


def finish(engine: Engine, progress: Progress, ctx: RunContext, seconds: float | None,
           console: Console) -> dict[str, Any]:  # fmt: skip
    """Write summary.json (rank 0) and return the summary. `seconds`: what this session
    added to the run's wall time; None for one that trained nothing (a finished run resumed),
    which keeps the time summary.json has (last.pt's stops at its own writing)."""
    history, config = progress.history, ctx.config
    last = history[-1] if history else {}
    train_seconds = sum(r["seconds"] for r in history)
    images = sum(r["images_per_second"] * r["seconds"] for r in history)
    scored = int(last.get("val_images", ctx.data.val.num_samples))  # unreadable ones skipped
    summary = {
        "name": config.name,
        "run_dir": str(Path(ctx.run_dir).absolute()),  # (config.yaml's paths are too)
        "epochs": len(history),
        "val_top1": last.get("val_top1"),
        "val_top5": last.get("val_top5"),
        "val_loss": last.get("val_loss"),
        "best_val_top1": max((r["val_top1"] for r in history), default=None),
        "best_epoch": int(history[best_epoch(history)]["epoch"]) if history else None,  # best.pt's
        "val_top1_ema": last.get("val_top1_ema"),
        "best_val_top1_ema": max(
            (r["val_top1_ema"] for r in history if "val_top1_ema" in r), default=None
        ),  # fmt: skip
        "train_images": ctx.data.train.num_samples,
        "val_images": scored,
        "val_skipped": ctx.data.val.num_samples - scored,
        "wall_seconds": round(progress.seconds + (seconds or 0.0), 3),
        "images_per_second": round(images / train_seconds, 1) if train_seconds else None,
        "device": str(engine.device),
        "precision": engine.precision,
        "channels_last": engine.channels_last,
        "world_size": ctx.dist.world_size,
    }
    if ctx.dist.is_main:
        if seconds is None:
            summary["wall_seconds"] = _saved_wall(ctx.run_dir, summary["wall_seconds"])
        write_summary(ctx.run_dir / "summary.json", summary)
        console.print_last(done_line(summary, history, console.top5, ctx.run_dir))
    return summary


def _saved_wall(run_dir: Path, otherwise: float) -> float:
    """The wall time a run's summary.json gives, `otherwise` where it has none."""
    try:
        saved = json.loads((run_dir / "summary.json").read_text())
        return float(saved["wall_seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return otherwise


def done_line(summary: dict[str, Any], history: list[dict[str, float]], top5: bool,
              run_dir: Any) -> str:  # fmt: skip
    """The run's last line: the last epoch's held-out figures (the honest ones: the held-out
    split also chose best.pt), the best epoch beside them, time and place."""
    if not history:
        return f"done: no epoch trained -> {run_dir}"
    at = best_epoch(history)
    best, tied = history[at], tied_after(history, at)
    tie = f" (and {plural(tied, 'later epoch')})" if tied else ""
    five = f" top-5 {summary['val_top5']:.2%}" if top5 else ""
    skipped = f", {summary['val_skipped']} unreadable skipped" if summary.get("val_skipped") else ""
    ema = (f"; the moving average's best {summary['best_val_top1_ema']:.2%}, kept as best_ema.pt"
           if summary.get("best_val_top1_ema") is not None else "")  # fmt: skip
    images = summary["val_images"]
    return (
        f"done: held-out top-1 {summary['val_top1']:.2%}{five} at the last epoch "
        f"({plural(images, 'image')}{skipped}; best {best['val_top1']:.2%} at epoch "
        f"{int(best['epoch'])}{tie}, kept as best.pt{ema}), {summary['wall_seconds']:.1f}s -> "
        f"{run_dir}"
    )
