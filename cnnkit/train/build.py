"""What a run trains, built before its first step: the network, checked against the data, and
the engine with the settings chosen for it (rank 0's choice, or a resumed run's own)."""

from __future__ import annotations

import sys
from typing import Any

import torch
from pydantic import ValidationError

from cnnkit.config import RunConfig
from cnnkit.data import DataBundle
from cnnkit.data.packfiles import is_pack, read_meta
from cnnkit.data.preprocess import network_preprocess
from cnnkit.distributed import Processes
from cnnkit.errors import ConfigError, DataError, validation_message
from cnnkit.nn import Network, build_unchecked
from cnnkit.runtime import available_cores, torch_threads
from cnnkit.train.checks import check_batchnorm
from cnnkit.train.engine import Engine, balanced_weights, build_engine, smallest_chunk
from cnnkit.train.metrics import Console
from cnnkit.train.settings import Settings, choose_settings


def normalised_for_weights(config: RunConfig) -> tuple[RunConfig, str | None]:
    """A run that starts from weights (model.weights, or its network file's own) normalises its
    images as they were made for: with the mean and std of the network's `preprocess:` (as timm
    takes a pretrained model's), where data.mean and data.std are left out. A run from fresh
    weights takes its data's own statistics (a pack's; ImageNet's for a folder). Returns the
    run, and a note where this changed its normalisation."""
    if not hasattr(config.data, "normalised_as"):  # (in-memory sets: their own statistics)
        return config, None
    spec = config.model.spec()
    pre = spec.get("preprocess")
    starts = config.model.weights is not None or spec.get("weights") is not None
    if not starts or not isinstance(pre, dict) or not {"mean", "std"} & set(pre):
        return config, None
    # the network's defaults where its preprocess: gives one of the two (0-255 pixels to 0-1)
    mean, std = _three(pre.get("mean", [0.0])), _three(pre.get("std", [255.0]))
    if mean is None or std is None:  # (another channel count: the data's, as without weights)
        return config, None
    try:
        data = config.data.normalised_as(mean, std)
    except ValidationError as e:
        raise ConfigError(f"model: the network's preprocess.{validation_message(e)}") from None
    if data is config.data:
        return config, None
    said = " and ".join(f"data.{k} [{', '.join(f'{v:g}' for v in getattr(data, k))}]"
                        for k in ("mean", "std") if getattr(config.data, k) is None)  # fmt: skip
    note = (
        f"{said} from the network's preprocess:, as its weights were made for (set data.mean "
        "and data.std to normalise otherwise)"
    )
    return config.model_copy(update={"data": data}), note


def resized_for_weights(config: RunConfig) -> tuple[RunConfig, str | None]:
    """A run that starts from weights resizes whole images with the filter of its network's
    `preprocess:` (timm's pretrained models' interpolation; bilinear where it resizes and
    names no filter, none where it does neither): a folder's data.interpolation left out takes
    it; a pack resized with another filter is said. Returns the run, and a note."""
    spec = config.model.spec()
    pre = spec.get("preprocess")
    starts = config.model.weights is not None or spec.get("weights") is not None
    says = starts and isinstance(pre, dict) and ("interpolation" in pre or pre.get("resize"))
    wanted = pre.get("interpolation", "bilinear") if says else None
    data = config.data
    if wanted not in ("bilinear", "bicubic"):
        return config, None
    if hasattr(data, "interpolation"):  # a folder, resized as it is read
        if "interpolation" in data.model_fields_set or data.interpolation == wanted:
            return config, None
        data = data.model_copy(update={"interpolation": wanted})
        return config.model_copy(update={"data": data}), (
            f"data.interpolation {wanted} from the network's preprocess:, as its weights were "
            "made for (set data.interpolation to resize otherwise)"
        )
    if data.source == "packed" and is_pack(data.path):
        try:
            packed = read_meta(data.path).get("interpolation", "bilinear")
        except DataError:  # (said where the run opens it)
            return config, None
        if packed != wanted:
            return config, (f"data.path {data.path}: packed with {packed} resizing, but the "
                            f"network's weights were made for {wanted} (cnnkit pack "
                            f"--interpolation {wanted} makes such a pack)")  # fmt: skip
    return config, None


def for_weights(config: RunConfig) -> tuple[RunConfig, list[str]]:
    """A new run as it takes its weights' statistics and filter (normalised_for_weights,
    resized_for_weights), and the notes saying where that changed it."""
    notes = []
    for adapt in (normalised_for_weights, resized_for_weights):
        config, note = adapt(config)
        notes += [note] if note else []
    return config, notes


def _three(values: Any) -> tuple[float, ...] | None:
    """A preprocess: mean or std as the 3 per-channel values of an image set (1 value: all)."""
    if not isinstance(values, (list, tuple)) or len(values) not in (1, 3):
        return None
    return tuple(values) * (3 // len(values))  # (checked as data.mean and data.std are)


def build_network(config: RunConfig, data: DataBundle, fresh: bool = True) -> Network:
    """The run's network with the data's class count, checked against the data's image shape,
    starting from `model.weights` when given (a classifier of another class count starts
    fresh); a resumed run's own checkpoint replaces them. A `fresh` run's network file's
    `preprocess:` is checked as classify, eval and export check it (a resumed run keeps the
    network it began with, right or not)."""
    if len(data.classes) < 2:  # one output: a softmax of 1, loss 0 and "100%" whatever it learns
        path = getattr(config.data, "path", None)
        where = f" in {path}" if path else ""
        hint = " (is data.path the folder above the class folders?)" if path else ""
        raise DataError(f"data: {len(data.classes)} class ({', '.join(data.classes)}){where}: a "
                        f"classifier needs at least 2{hint}")  # fmt: skip
    spec = config.model.spec()
    network = build_unchecked(spec, num_classes=len(data.classes), weights=config.model.weights)
    if fresh:
        file = config.model.network
        named = file if isinstance(file, str) else (config.model._source or "run: model")
        network_preprocess(named.removesuffix(": model"), tuple(network.input_shape),
                           spec.get("preprocess"))  # fmt: skip
    last, model = network.table[-1], _model_named(config)
    if network.num_classes != len(data.classes):
        raise ConfigError(
            f"{model}: the last layer {last.name} ({last.type}) gives {list(network.output_shape)}, "
            f"not scores for the data's {len(data.classes)} classes (end with a linear layer, "
            "out_features left out, after a flatten or global_avgpool)"
        )
    if tuple(network.input_shape) != tuple(data.input_shape):
        raise ConfigError(
            f"{model}: input {list(network.input_shape)} does not match the data's images "
            f"{list(data.input_shape)}{_shape_hint(config, network.input_shape, data.input_shape)}"
        )
    return network


def _model_named(config: RunConfig) -> str:
    """How messages name the run's network: `model net.yaml`, or the run file's own mapping."""
    network = config.model.network
    if isinstance(network, str) and network.isprintable() and len(network) <= 200:
        return f"model {network}"
    return config.model._source or "model"


def _shape_hint(config: RunConfig, want: tuple[int, ...], have: tuple[int, ...]) -> str:
    """The data settings that give a network's input: the grey images, the crop, the shape."""
    if config.data.source == "synthetic":
        return f" (set data.shape={list(want)})"
    grey = want[0] == 1 and have[0] == 3
    hints = ["data.grey: true gives the images' luma"] if grey else []
    if len(want) == 3 and len(have) == 3 and want[1:] != have[1:] and want[1] == want[2]:
        if hasattr(config.data, "crop") and (grey or want[0] == have[0]):
            size = ", and data.size the side images are resized to first" * hasattr(
                config.data, "size")  # fmt: skip
            hints.append(f"set data.crop={want[1]}{size}")
            if not grey:
                hints[-1] += (f"; or model.input={list(have)} builds the network for the "
                              "data's images, where its layers allow")  # fmt: skip
    if not hints:
        hints.append(f"model.input={list(have)} builds the network for the data's images, where "
                     "its layers allow")  # fmt: skip
    return f" ({'; '.join(hints)})"


def build_run_engine(config: RunConfig, data: DataBundle, device: torch.device,
                     dist: Processes, console: Console,
                     resume: dict[str, Any] | None = None, ranks: int = 1) -> Engine:  # fmt: skip
    """The network built and put on the device with the settings chosen for it (rank 0's
    choice on every rank: one precision and format for the whole group); a resumed run keeps
    the settings it began with (resumed_settings). `ranks`: the processes the choice is for
    (each takes its share of the batch and, from --nproc, of the cores: a dry run of N
    chooses what N ranks will run)."""
    network = build_network(config, data, fresh=resume is None)
    if network.fresh_keys and resume is None and dist.is_main:
        given = "model.weights" if config.model.weights else "the network file's weights:"
        print(f"cnnkit: note: {given} {', '.join(network.fresh_keys)} start fresh (the "
              f"file's classifier is for other classes than the data's {len(data.classes)})",
              file=sys.stderr)  # fmt: skip
    per_rank = config.data.batch_size // ranks
    if not (config.train.sync_bn and ranks > 1):  # (SyncBatchNorm counts every rank's values)
        images = min(per_rank, len(data.train_labels) // ranks)  # (a set smaller than a batch)
        check_batchnorm(network, smallest_chunk(images, config.train.accumulate),
                        config.train.accumulate > 1)  # fmt: skip
    chosen = None
    if dist.is_main:
        cores = torch.get_num_threads() if ranks == dist.world_size else max(
            1, available_cores() // ranks)  # fmt: skip
        with torch_threads(cores):
            chosen = resumed_settings(resume, config, device, ranks) or choose_settings(
                network, config.train, device, per_rank, config.deterministic,
                notify=console.print)  # fmt: skip
    settings = dist.broadcast_object(chosen)
    weights = None
    if config.train.class_weights == "balanced":
        weights = balanced_weights(data.train_labels, len(data.classes))
    return build_engine(network, config.train, device, wrap=dist.wrap, class_weights=weights,
                        settings=settings)  # fmt: skip


SETTING_FIELDS = ("precision", "channels_last", "threads", "compile")


def resumed_settings(resume: dict[str, Any] | None, config: RunConfig, device: torch.device,
                     ranks: int = 1) -> Settings | None:  # fmt: skip
    """The settings a resumed run's steps ran with, so it continues bitwise as it began
    (another thread count or kernel alone changes the weights), unless the resume sets them
    anew (train.precision=..., train.threads=...), runs on another kind of device, or in
    another number of processes `ranks` (the split changes anyway, and threads chosen for
    one process each would oversubscribe the cores of two)."""
    saved = (resume or {}).get("settings")
    if not saved or saved["device"] != device.type:
        return None
    if len(resume.get("rng_ranks") or [None]) != ranks:
        return None
    before = resume["config"].get("train") or {}  # a dict: the checkpoint is validated
    if any(before.get(k) != getattr(config.train, k) for k in SETTING_FIELDS):
        return None
    fields = {k: v for k, v in saved.items() if k != "device"}
    return Settings(**{**fields, "how": "resumed"})
