"""The checkpoint file: format "cnnkit-checkpoint/1" and its structure (`Saved`, checked on every
read), the atomic save, the safe load (`weights_only=True`: data, never code), RNG state."""

from __future__ import annotations

import os
import pickle
import random
import re
import warnings
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import (
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    model_validator,
)

from cnnkit.data.base import Preprocess, Section
from cnnkit.errors import CheckpointError, validation_message
from cnnkit.nn.weights import check_checksums, starts_as_torch_save, unreadable

FORMAT = "cnnkit-checkpoint/1"
EXPORT_FORMAT = "cnnkit-safetensors/1"  # `cnnkit export --format safetensors`


class RunSettings(Section):
    """The resolved settings of a run's steps (train/settings.Settings) and its device type."""

    model_config = ConfigDict(extra="forbid")
    device: str
    precision: Literal["fp32", "bf16", "fp16"]
    channels_last: bool
    threads: PositiveInt
    how: str
    speedup: float | None = None
    kernels: list[tuple[str, str]] = Field(default_factory=list)


class Saved(Section):
    """What a cnnkit checkpoint holds, checked when it is read (best.pt has no optimizer, RNG
    or scaler; the training fields have their fresh-run values when absent)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False)
    format: str
    model_spec: dict[str, Any]
    num_classes: PositiveInt | None
    model: dict[str, torch.Tensor] = Field(min_length=1)
    classes: list[str]
    holdout: str | None = None  # which images a split drawn from the data held out (holdout_id)
    preprocess: Preprocess
    config: dict[str, Any]
    epoch: NonNegativeInt = 0
    step: NonNegativeInt = 0
    global_step: NonNegativeInt = 0
    best_top1: float = -1.0
    seconds: NonNegativeFloat = 0.0
    history: list[dict[str, float]] = Field(default_factory=list)
    run_id: str | None = None  # the run's, in each of its checkpoints (older ones: none)
    partial: dict[str, float] = Field(default_factory=dict)
    partial_ranks: list[dict[str, float]] | None = None  # each rank's `partial`, rank order
    metrics: dict[str, float] = Field(default_factory=dict)
    optimizer: dict[str, Any] | None = None
    schedule: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None
    rng_ranks: list[dict[str, Any]] | None = None
    ema: dict[str, torch.Tensor] | None = None  # train.ema's moving average of the weights
    ema_count: NonNegativeInt = 0
    ema_buffer_ranks: list[dict[str, torch.Tensor]] | None = None  # DDP, mid-epoch: each rank's
    settings: RunSettings | None = None  # what the steps ran with: a resume keeps them
    mean_image: torch.Tensor | None = None  # (C, S, S): normalize: mean_image subtracted it

    @model_validator(mode="after")
    def _consistent(self) -> Saved:
        if self.num_classes is not None and len(self.classes) != self.num_classes:
            raise ValueError(f"classes: {len(self.classes)} names for {self.num_classes} outputs")
        if not isinstance(self.config.get("data"), dict):
            raise ValueError("config: no data section")
        if self.mean_image is not None:
            check_mean_image(self.mean_image, self.preprocess)
        return self


def check_mean_image(image: torch.Tensor, pre: Preprocess) -> None:
    """ValueError unless `image` is a finite float (C, S, S) at the side `pre` resizes to."""
    side = pre.resize or pre.crop
    if image.shape != (pre.channels, side, side) or not image.is_floating_point():
        raise ValueError(f"mean_image: {tuple(image.shape)} {image.dtype}; the preprocessing "
                         f"wants float {pre.channels} x {side} x {side}")  # fmt: skip
    if not torch.isfinite(image).all():
        raise ValueError("mean_image: not finite")


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
    except RuntimeError as e:  # torch's zip writer hides a full disk behind its own error
        if isinstance(e.__context__, OSError):
            if e.__context__.filename is None:
                e.__context__.filename = str(path)  # the error line names the checkpoint
            raise e.__context__ from None
        raise
    except OSError as e:
        if e.filename is None or e.filename == str(tmp):
            e.filename = str(path)
        raise
    finally:
        tmp.unlink(missing_ok=True)


LEGACY_HEAD = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
# torch.save's legacy (pre-1.6, or _use_new_zipfile_serialization=False) first bytes: its
# magic number pickled at protocol 2


def is_checkpoint(path: str | Path) -> bool:
    """True for a torch.save file (a run's checkpoint, a state_dict): a zip archive with a
    data.pkl, unlike a TorchScript (code/) or torch.export (archive_format) archive, or a file
    in the legacy format, which starts with torch's magic number."""
    import zipfile

    if not Path(path).is_file():  # a FIFO would block the read
        return False
    try:
        with open(path, "rb") as f:
            if f.read(len(LEGACY_HEAD)) == LEGACY_HEAD:
                return True
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return False
    return any(n.endswith("/data.pkl") for n in names) and not any(
        "/code/" in n or n.endswith("archive_format") for n in names
    )


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Read a cnnkit checkpoint safely; anything missing, truncated, foreign or code-carrying
    raises CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if not starts_as_torch_save(path):  # text read as a pickle would name a made-up "object"
        raise CheckpointError(unreadable(path, "checkpoint"))
    check_checksums(path, "checkpoint")
    try:
        with warnings.catch_warnings():  # e.g. a foreign pickle's protocol: the error says it
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        if found is None:  # random bytes also fail to unpickle: not an object, just no file
            raise CheckpointError(unreadable(path, "checkpoint")) from None
        raise CheckpointError(
            f"{path}: refused: it holds a pickled object ({found.group(1)}), not only tensors "
            "and plain data"
        ) from None
    except Exception as e:
        if "TorchScript" in str(e):  # torch's advice to unpickle it unsafely: not ours to give
            raise CheckpointError(f"{path}: a TorchScript export, which cnnkit writes but does "
                                  "not read back: give the run or checkpoint it came from, or "
                                  "load it with torch.jit.load") from None  # fmt: skip
        if isinstance(e, PermissionError):
            raise CheckpointError(f"{path}: cannot read it (permission denied)") from None
        raise CheckpointError(unreadable(path, "checkpoint")) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        weights = isinstance(state, dict) and state and all(
            isinstance(v, torch.Tensor) for v in state.values())  # fmt: skip
        hint = (": a bare state_dict, as torchvision and timm publish: give it as weights: beside "
                "its network (model: {network: NET, weights: FILE})" if weights else "")  # fmt: skip
        raise CheckpointError(f"{path}: not a cnnkit checkpoint (expected format {FORMAT!r}){hint}")
    try:
        Saved.model_validate(state)
    except ValidationError as e:
        raise CheckpointError(f"{path}: a damaged checkpoint: {validation_message(e)}") from None
    return state


def rng_state() -> dict[str, Any]:
    """Every random generator's state as plain data: torch's CPU one and this process's CUDA
    device's (not every GPU's: reading one opens a context on it), numpy's and python's."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    np_state = np.random.get_state(legacy=False)
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state()] if cuda else [],
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
    if state["cuda"] and torch.cuda.is_available():  # onto this process's device
        torch.cuda.set_rng_state(state["cuda"][0])
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
