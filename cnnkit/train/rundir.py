"""The run directory of a new run, and the config of a run to resume."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from cnnkit.config import RunConfig, apply_override, validate_run
from cnnkit.errors import ConfigError

RUN_FILES = ("config.yaml", "last.pt", "best.pt", "metrics.csv", "summary.json")


def new_run_dir(
    name: str, out: str | Path | None, reuse: bool = False, tag: str | None = None
) -> Path:
    """The directory a new run will write (not created yet); refuses one that holds a run unless
    `reuse` (an elastic restart before the first checkpoint). `tag`: torchrun's job id, so every
    rank and every restart agrees on the default runs/<name>-<tag>."""
    if out is None and tag is not None:
        out = Path("runs") / f"{name}-{tag[:12]}"
    if out is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"{name}-{stamp}"
        n = 1
        while path.exists():
            n += 1
            path = Path("runs") / f"{name}-{stamp}-{n}"
        return path
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path}: exists and is not a directory")
    if not reuse and any((path / f).exists() for f in RUN_FILES):
        raise ConfigError(f"--out {path}: already holds a run (continue it with --resume {path})")
    return path


def resume_config(state: dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """The run config stored in a checkpoint, with overrides (e.g. train.epochs=30) applied; the
    network is the checkpoint's own (its file may have moved since)."""
    raw = dict(state["config"], model=state["model_spec"])
    for item in overrides or []:
        apply_override(raw, item)
    return validate_run(raw)
