"""Finding a run's checkpoint: a run directory's best.pt or last.pt, and one line saying what a
path is when it holds none (a folder of runs, a run not saved yet, a run's metrics.csv)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from cnnkit.checkpoint.saved import is_checkpoint
from cnnkit.errors import CheckpointError, ConfigError, plural
from cnnkit.nn.weights import is_safetensors


def dated_run_hint(target: str | Path) -> str:
    """For a path that does not exist: ' (did you mean ...?)' naming the newest dated run
    beside it (`cnnkit train NAME` writes runs/NAME-YYYYMMDD-HHMMSS), else ''."""
    path = Path(target)
    stamp = re.compile(re.escape(path.name) + r"-\d{8}-\d{6}(-\d+)?")
    try:
        runs = [p for p in path.parent.iterdir() if stamp.fullmatch(p.name) and p.is_dir()]
    except OSError:
        return ""
    runs.sort(key=lambda p: (p.name[len(path.name) + 1 :][:15], len(p.name), p.name))  # -10 > -2
    return f" (did you mean {runs[-1]}, the newest dated run of that name?)" if runs else ""


NETWORK_SUFFIXES = (".yaml", ".yml", ".json", ".prototxt")  # the names of network files


def checkpoint_path(target: str | Path, ema: bool = False) -> Path:
    """A checkpoint file, or a run directory's best.pt (else last.pt); with `ema`, the
    checkpoint of the moving average's best epoch (best_ema.pt) first."""
    target = Path(target)
    if target.is_dir():
        for name in ("best_ema.pt", "best.pt", "last.pt")[0 if ema else 1 :]:
            if (target / name).is_file():
                return target / name
        raise CheckpointError(no_checkpoint_in(target))
    if not target.exists():
        if target.suffix.lower() in NETWORK_SUFFIXES:  # a usage error (exit 2), as info says it
            raise ConfigError(f"{target}: no such network or run file")
        raise CheckpointError(
            f"{target}: no such checkpoint file or run directory{dated_run_hint(target)}"
        )
    check_not_a_record(target)
    return target


def file_kind(path: Path) -> Literal["export", "checkpoint"] | None:
    """What a trained model's file is, by its name (any case), else by its first bytes (m.PT,
    a checkpoint saved as model.ckpt): "export" (safetensors), "checkpoint" (a torch.save
    file), None for anything else (a network file, a folder, no file)."""
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return "export"
    if suffix in (".pt", ".pth"):
        return "checkpoint"
    if suffix in NETWORK_SUFFIXES or not path.is_file():
        return None
    if is_safetensors(path):
        return "export"
    return "checkpoint" if is_checkpoint(path) else None


CHECKPOINTS = ("best.pt", "last.pt")
RECORDS = {".csv": "a CSV file", ".png": "an image", ".jpg": "an image", ".jpeg": "an image",
           ".npy": "a NumPy array"}  # fmt: skip  # what a run writes beside them, and the like


def no_checkpoint_in(folder: Path) -> str:
    """What a folder without a checkpoint of its own is, and what to give instead: a folder of
    runs (runs/), a mining run still in its rounds, a run stopped before its first checkpoint,
    one that trained and lost its checkpoints, or no run at all."""
    runs = _runs_in(folder)
    rounds = [p for p in runs if re.fullmatch(r"round-\d+", p.name)]
    if rounds and (folder / "config.yaml").is_file():
        return (f"{folder}: a mining run whose rounds have not all finished (the best round's "
                f"checkpoints are copied here at its end): name a round, e.g. "
                f"{_newest(runs)}")  # fmt: skip
    held = holds_runs(folder)
    if held is not None:
        return held
    if not (folder / "config.yaml").is_file():
        return (f"{folder}: not a run directory (no best.pt or last.pt in it): give a run "
                "directory, a checkpoint (.pt) or a .safetensors export")  # fmt: skip
    trained = trained_files(folder)  # as `--resume` judges the run (train.rundir.resume_state)
    if trained:
        return (f"{folder}: best.pt and last.pt are missing, yet the run trained "
                f"({', '.join(trained)}): put them back (`--resume` refuses the run too: "
                "starting it again would overwrite them)")  # fmt: skip
    return (f"{folder}: a run with no checkpoint yet (it stopped before saving its first; "
            f"`cnnkit train --resume {folder}` starts it again)")  # fmt: skip


def holds_runs(folder: Path) -> str | None:
    """`runs: holds run directories, not a run of its own: name one, e.g. runs/d1` for a folder
    of runs (the newest with a checkpoint named), else None."""
    newest = _newest(_runs_in(folder))
    if newest is None:
        return None
    return f"{folder}: holds run directories, not a run of its own: name one, e.g. {newest}"


def _runs_in(folder: Path) -> list[Path]:
    """The run directories in a folder (each with a checkpoint or a config.yaml)."""
    try:
        return [p for p in folder.iterdir() if p.is_dir() and _run_file(p) is not None]
    except OSError:
        return []


def _newest(runs: list[Path]) -> Path | None:
    """The newest of `runs` with a checkpoint, else the newest of them."""
    ready = [p for p in runs if _run_file(p).suffix == ".pt"]
    return max(ready or runs, key=lambda p: _run_file(p).stat().st_mtime, default=None)


def trained_files(run_dir: Path) -> list[str]:
    """What in a run directory shows it trained: best.pt, best_ema.pt, summary.json, and
    metrics.csv's epoch rows. A run without last.pt and any of these is not one to start again
    (`--resume` refuses it; eval says so alike)."""
    found = [f for f in ("best.pt", "best_ema.pt", "summary.json") if (run_dir / f).exists()]
    try:
        rows = len((run_dir / "metrics.csv").read_text().splitlines()) - 1
    except (OSError, UnicodeDecodeError):
        rows = 0
    return found + [f"metrics.csv: {plural(rows, 'epoch')}"] * (rows > 0)


def _run_file(folder: Path) -> Path | None:
    """A run directory's checkpoint, else its config.yaml (a run with none yet), else None."""
    return next((folder / n for n in (*CHECKPOINTS, "config.yaml") if (folder / n).is_file()), None)


def run_of_settings(path: str | Path) -> Path | None:
    """The run directory whose config.yaml `path` is, where a checkpoint lies beside it (its
    learned weights, which the settings alone lack); None for any other file."""
    path = Path(path)
    if path.name != "config.yaml" or not path.is_file():
        return None
    return path.parent if any((path.parent / n).is_file() for n in CHECKPOINTS) else None


def check_not_a_record(path: Path) -> None:
    """CheckpointError for a run's metrics.csv, curves.png (or an image, an array) given where
    a checkpoint or network is read: what it is and what to give, not a reader's error."""
    what = RECORDS.get(path.suffix.lower())
    if what is None or not path.is_file():
        return
    give = f"its run directory {path.parent}" if _run_file(path.parent) else (
        "a run directory, a checkpoint (.pt) or a .safetensors export")  # fmt: skip
    raise CheckpointError(f"{path}: {what}, not a checkpoint or network: give {give}")
