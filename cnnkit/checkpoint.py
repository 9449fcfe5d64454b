"""Checkpoints, read and written by training and inference alike: atomic save, safe load
(`weights_only=True`: data, never code), the structure validated (`Saved`), RNG state, and
`load_trained` for inference. Format "cnnkit-checkpoint/1": model_spec, num_classes, model
(fp32 state_dict of the plain model), classes, preprocess, config, mean_image (runs with
`normalize: mean_image`), plus the training state.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import sys
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
from cnnkit.errors import CheckpointError, CnnkitError, one_line, validation_message
from cnnkit.nn import build_model
from cnnkit.nn.weights import MEAN_IMAGE_KEY, check_finite_weights

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
    try:
        with warnings.catch_warnings():  # e.g. a foreign pickle's protocol: the error says it
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        if found is None:  # random bytes also fail to unpickle: not an object, just no file
            raise CheckpointError(
                f"{path}: not a readable checkpoint (not a torch.save file)"
            ) from None
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
        raise CheckpointError(
            f"{path}: not a readable checkpoint (truncated or foreign: {one_line(e)})"
        ) from None
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
        raise CheckpointError(
            f"{target}: no such checkpoint file or run directory{dated_run_hint(target)}"
        )
    check_not_a_record(target)
    return target


CHECKPOINTS = ("best.pt", "last.pt")
RECORDS = {".csv": "a CSV file", ".png": "an image", ".jpg": "an image", ".jpeg": "an image",
           ".npy": "a NumPy array"}  # fmt: skip  # what a run writes beside them, and the like


def no_checkpoint_in(folder: Path) -> str:
    """What a folder without a checkpoint of its own is, and what to give instead: a folder of
    runs (runs/), a mining run still in its rounds, a run stopped before its first checkpoint,
    or no run at all."""
    try:
        runs = [p for p in folder.iterdir() if p.is_dir() and _run_file(p) is not None]
    except OSError:
        runs = []
    ready = [p for p in runs if _run_file(p).suffix == ".pt"]  # the newest run with a checkpoint
    newest = max(ready or runs, key=lambda p: _run_file(p).stat().st_mtime, default=None)
    rounds = [p for p in runs if re.fullmatch(r"round-\d+", p.name)]
    if rounds and (folder / "config.yaml").is_file():
        return (f"{folder}: a mining run whose rounds have not all finished (the best round's "
                f"checkpoints are copied here at its end): name a round, e.g. {newest}")  # fmt: skip
    if newest is not None:
        return f"{folder}: holds run directories, not a run of its own: name one, e.g. {newest}"
    if (folder / "config.yaml").is_file():
        return (f"{folder}: a run with no checkpoint yet (it stopped before saving its first; "
                f"`cnnkit train --resume {folder}` continues it)")  # fmt: skip
    return (f"{folder}: not a run directory (no best.pt or last.pt in it): give a run "
            "directory, a checkpoint (.pt) or a .safetensors export")  # fmt: skip


def _run_file(folder: Path) -> Path | None:
    """A run directory's checkpoint, else its config.yaml (a run with none yet), else None."""
    return next((folder / n for n in (*CHECKPOINTS, "config.yaml") if (folder / n).is_file()), None)


def check_not_a_record(path: Path) -> None:
    """CheckpointError for a run's metrics.csv, curves.png (or an image, an array) given where
    a checkpoint or network is read: what it is and what to give, not a reader's error."""
    what = RECORDS.get(path.suffix.lower())
    if what is None or not path.is_file():
        return
    give = f"its run directory {path.parent}" if _run_file(path.parent) else (
        "a run directory, a checkpoint (.pt) or a .safetensors export")  # fmt: skip
    raise CheckpointError(f"{path}: {what}, not a checkpoint or network: give {give}")


def load_trained(target: str | Path, device: Any = "cpu",
                 ema: bool = False) -> tuple[torch.nn.Module, dict[str, Any]]:  # fmt: skip
    """(Network in eval mode on `device`, meta with classes, preprocess, config) from a run
    directory, a checkpoint file or a .safetensors export (whose config is empty: it records
    no data section). `ema`: the moving average of the weights instead (train.ema)."""
    if Path(target).suffix == ".safetensors":
        if ema:
            raise CheckpointError(f"{target}: an export keeps no moving average of the weights "
                                  "(export with --ema to make one of it)")  # fmt: skip
        model, meta = read_export(Path(target))
        return model.to(device).eval(), meta
    path = checkpoint_path(target, ema)
    state = load_checkpoint(path)
    try:
        model = build_model(state["model_spec"], num_classes=state["num_classes"])
        if ema and not state.get("ema"):
            raise CheckpointError(f"{path}: no moving average of the weights (train.ema was 0)")
        weights = state["ema"] if ema else state["model"]
        model.load_state_dict(weights)
        check_finite_weights(weights, path)
    except CheckpointError:
        raise
    except CnnkitError as e:
        raise CheckpointError(f"{path}: its network does not build: {e}") from None
    except (RuntimeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: weights do not fit its network: {one_line(e)}") from None
    meta = {k: state[k] for k in ("classes", "preprocess", "config")}
    meta.update(path=str(path), epoch=state.get("epoch"), metrics=state.get("metrics", {}),
                settings=state.get("settings"), mean_image=state.get("mean_image"))  # fmt: skip
    check_input_fits(meta["preprocess"], model, path)
    return model.to(device).eval(), meta


def check_input_fits(preprocess: dict[str, Any], model: torch.nn.Module, source: Any) -> None:
    """CheckpointError unless the recorded preprocessing makes the network's input: its
    channels and its crop (a tampered or mismatched file, refused on load)."""
    shape = tuple(getattr(model, "input_shape", ()))
    if len(shape) != 3 or shape[0] > 4 or not isinstance(preprocess, dict):
        return  # vectors and many-channel inputs: no image preprocessing to match
    channels, crop = preprocess.get("channels"), preprocess.get("crop")
    square = shape[1] == shape[2]  # a crop is square: other inputs are fed by other means
    if channels != shape[0] or (square and crop != shape[1]):
        raise CheckpointError(
            f"{source}: its preprocessing makes {channels} x {crop} x {crop} inputs, but the "
            f"network takes {shape[0]} x {shape[1]} x {shape[2]}"
        )


def read_export(path: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The network of a `cnnkit export --format safetensors` file: weights plus the network,
    classes and preprocessing recorded as metadata (strings: nothing in it can run code)."""
    import json

    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        weights = load_file(str(path), device="cpu")
        mean_image = weights.pop(MEAN_IMAGE_KEY, None)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({one_line(e)})") from None
    if meta.get("format") != EXPORT_FORMAT:
        raise CheckpointError(f"{path}: no cnnkit metadata (expected format {EXPORT_FORMAT!r})")
    try:
        model = build_model(json.loads(meta["model_spec"]), json.loads(meta["num_classes"]))
        model.load_state_dict(weights)
        classes = json.loads(meta["classes"])
        preprocess = Preprocess.from_dict(json.loads(meta["preprocess"]))
        if mean_image is not None:
            check_mean_image(mean_image, preprocess)
    except ValidationError as e:
        raise CheckpointError(
            f"{path}: a damaged export: preprocess.{validation_message(e)}"
        ) from None
    except (CnnkitError, KeyError, RuntimeError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{path}: its metadata or weights do not fit ({one_line(e)})"
        ) from None
    check_finite_weights(weights, path)
    if not isinstance(classes, list) or len(classes) != (model.num_classes or len(classes)):
        count = len(classes) if isinstance(classes, list) else "no"
        raise CheckpointError(
            f"{path}: {count} class names for the network's {model.num_classes} outputs"
        )
    check_input_fits(preprocess.to_dict(), model, path)
    return model, {"classes": [str(c) for c in classes], "preprocess": preprocess.to_dict(),
                   "config": {}, "path": str(path), "epoch": None, "metrics": {},
                   "mean_image": mean_image, "settings": export_settings(meta, path),
                   "trained": meta.get("trained") != "false"}  # fmt: skip


def export_settings(meta: dict[str, str], path: Path) -> dict[str, Any] | None:
    """The settings a run's steps ran with (precision, memory format, device type) that its
    export records, else None (an export of a network, or one written before they were kept)."""
    import json

    if "settings" not in meta:
        return None
    try:
        return RunSettings.model_validate(json.loads(meta["settings"])).model_dump()
    except (ValidationError, ValueError, TypeError) as e:
        why = validation_message(e) if isinstance(e, ValidationError) else one_line(e)
        raise CheckpointError(f"{path}: a damaged export: settings: {why}") from None


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


def uses_mean_image(config: dict[str, Any]) -> bool:
    """Whether a run trained with `normalize: mean_image` (checkpoints written before they kept
    the image have only its per-channel averages)."""
    data = config.get("data") if isinstance(config, dict) else None
    return isinstance(data, dict) and data.get("normalize") == "mean_image"


def note_mean_image(what: str, held: bool = False) -> None:
    """One stderr line where such a run is applied to other images (uses_mean_image) without
    its mean image: one the checkpoint does not hold, or (`held`) a sliding window's."""
    why = "each window of a picture" if held else "the checkpoint does not hold it"
    print(f"cnnkit: {what} subtracts the training mean image's per-channel averages, not the "
          f"image itself ({why}): figures may differ slightly from the run's own",
          file=sys.stderr)  # fmt: skip
