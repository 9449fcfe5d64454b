"""Trained networks for inference: a run directory, a checkpoint or a safetensors export, built
and checked (weights, classes, preprocessing), and the note for a mean-image run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from cnnkit.checkpoint.locate import checkpoint_path, file_kind
from cnnkit.checkpoint.saved import EXPORT_FORMAT, RunSettings, check_mean_image, load_checkpoint
from cnnkit.data.base import Preprocess
from cnnkit.errors import (
    CheckpointError,
    CnnkitError,
    ConfigError,
    one_line,
    validation_message,
)
from cnnkit.nn import build_model
from cnnkit.nn.weights import (
    MEAN_IMAGE_KEY,
    check_finite_weights,
    check_state_fits,
    holds_its_moving_average,
)


def load_trained(target: str | Path, device: Any = "cpu",
                 ema: bool = False) -> tuple[torch.nn.Module, dict[str, Any]]:  # fmt: skip
    """(Network in eval mode on `device`, meta with classes, preprocess, config) from a run
    directory, a checkpoint file or a .safetensors export (whose config is empty: it records
    no data section). `ema`: the moving average of the weights instead (train.ema), as named
    best_ema.pt means (the epoch its moving average scored best: those are its weights)."""
    if file_kind(Path(target)) == "export":
        if ema:
            raise export_ema_error(target)
        model, meta = read_export(Path(target))
        return model.to(device).eval(), meta
    path = checkpoint_path(target, ema)
    state = load_checkpoint(path)
    ema = ema or holds_its_moving_average(path, state)
    try:
        with torch.random.fork_rng(devices=[]):  # fresh weights, replaced: the caller's draws
            model = build_model(state["model_spec"], num_classes=state["num_classes"])
        if ema and not state.get("ema"):
            raise CheckpointError(f"{path}: no moving average of the weights (train.ema was 0)")
        weights = state["ema"] if ema else state["model"]
        check_state_fits(model, weights, path)  # (each key named, as a weights file's)
        model.load_state_dict(weights)
        check_finite_weights(weights, path)
    except CheckpointError:
        raise
    except CnnkitError as e:
        raise CheckpointError(f"{path}: its network does not build: {e}") from None
    except (RuntimeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: weights do not fit its network: {one_line(e)}") from None
    meta = {k: state[k] for k in ("classes", "preprocess", "config")}
    meta.update(path=str(path), epoch=state.get("epoch"), step=state.get("step", 0),
                metrics=state.get("metrics", {}),
                settings=state.get("settings"), mean_image=state.get("mean_image"),
                holdout=state.get("holdout"))  # fmt: skip
    check_input_fits(meta["preprocess"], model, path)
    return model.to(device).eval(), meta


def export_ema_error(target: str | Path) -> ConfigError:
    """--ema with a .safetensors export (a usage error): an export holds one set of weights,
    the moving average itself where `cnnkit export RUN --ema` wrote it."""
    return ConfigError(f"--ema: {target} is an export, which holds the one set of weights it "
                       "was exported with (the moving average itself, where `cnnkit export RUN "
                       "--ema` made it): give it without --ema, which picks the moving average "
                       "of a run directory or checkpoint")  # fmt: skip


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
        with torch.random.fork_rng(devices=[]):  # fresh weights, replaced: the caller's draws
            model = build_model(json.loads(meta["model_spec"]), json.loads(meta["num_classes"]))
        check_state_fits(model, weights, path)
        model.load_state_dict(weights)
        classes = json.loads(meta["classes"])
        preprocess = Preprocess.from_dict(json.loads(meta["preprocess"]))
        if mean_image is not None:
            check_mean_image(mean_image, preprocess)
    except ValidationError as e:
        raise CheckpointError(
            f"{path}: a damaged export: preprocess.{validation_message(e)}"
        ) from None
    except CheckpointError:  # (check_state_fits: each key named)
        raise
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


def uses_mean_image(config: dict[str, Any]) -> bool:
    """Whether a run trained with `normalize: mean_image` (checkpoints written before they kept
    the image have only its per-channel averages)."""
    data = config.get("data") if isinstance(config, dict) else None
    return isinstance(data, dict) and data.get("normalize") == "mean_image"


NOT_HELD = "the checkpoint does not hold it"  # note_mean_image's reason for an older run


def note_mean_image(what: str, why: str = NOT_HELD) -> None:
    """One stderr note where such a run is applied to other images (uses_mean_image) without
    its mean image, `why`: one the checkpoint does not hold, a sliding window's (detect), data
    stored at another size than the image."""
    print(f"cnnkit: note: {what} subtracts the training mean image's per-channel averages, not "
          f"the image itself ({why}): figures may differ slightly from the run's own",
          file=sys.stderr)  # fmt: skip
