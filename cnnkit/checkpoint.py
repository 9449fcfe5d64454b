"""Checkpoints, read and written by training and inference alike: atomic save, safe load
(`weights_only=True`: data, never code), RNG state, and `load_trained` for inference. Format "cnnkit-checkpoint/1": model_spec, num_classes, model (fp32
state_dict of the plain model), classes, preprocess, config, plus the training state.
"""

from __future__ import annotations

import os
import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cnnkit.errors import CheckpointError, CnnkitError
from cnnkit.nn import build_model

FORMAT = "cnnkit-checkpoint/1"
REQUIRED = ("model_spec", "num_classes", "model", "classes", "preprocess", "config")


def save_checkpoint(state: dict[str, Any], path: str | Path) -> None:
    """Write `state` to a temporary file beside `path`, then rename: a kill never leaves half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Read a cnnkit checkpoint safely; anything missing, truncated, foreign or code-carrying
    raises CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        what = f" ({found.group(1)})" if found else ""
        raise CheckpointError(
            f"{path}: refused: it holds a pickled object{what}, not only tensors and plain data"
        ) from None
    except Exception as e:
        raise CheckpointError(
            f"{path}: not a readable checkpoint (truncated or foreign: {_one(e)})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a cnnkit checkpoint (expected format {FORMAT!r})")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks {missing[0]!r}")
    return state


def checkpoint_path(target: str | Path) -> Path:
    """A checkpoint file, or a run directory's best.pt (else last.pt)."""
    target = Path(target)
    if target.is_dir():
        for name in ("best.pt", "last.pt"):
            if (target / name).is_file():
                return target / name
        raise CheckpointError(f"{target}: run directory holds no best.pt or last.pt")
    if not target.exists():
        raise CheckpointError(f"{target}: no such checkpoint file or run directory")
    return target


def load_trained(target: str | Path, device: Any = "cpu") -> tuple[torch.nn.Module, dict[str, Any]]:
    """(Network in eval mode on `device`, meta with classes, preprocess, config) from a run
    directory or checkpoint file."""
    path = checkpoint_path(target)
    state = load_checkpoint(path)
    try:
        model = build_model(state["model_spec"], num_classes=state["num_classes"])
        model.load_state_dict(state["model"])
    except CnnkitError as e:
        raise CheckpointError(f"{path}: its network does not build: {e}") from None
    except (RuntimeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: weights do not fit its network: {_one(e)}") from None
    meta = {k: state[k] for k in ("classes", "preprocess", "config")}
    meta.update(path=str(path), epoch=state.get("epoch"), metrics=state.get("metrics", {}))
    return model.to(device).eval(), meta


def rng_state() -> dict[str, Any]:
    """Every random generator's state as plain data (torch CPU + each CUDA device, numpy, python)."""
    np_state = np.random.get_state(legacy=False)
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "python": [version, list(internal), gauss],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def _one(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:160]
