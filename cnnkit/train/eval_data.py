"""The data `cnnkit eval` reads (`--data`: a folder, a pack, a source name or a data YAML),
made to fit the trained network: its crop, resizing, filter and normalisation."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import torch

from cnnkit.checkpoint import NOT_HELD, note_mean_image
from cnnkit.config.hints import did_you_mean
from cnnkit.data import SOURCES, DataConfig, Preprocess, check_source, data_config
from cnnkit.data.decode import is_image_name
from cnnkit.data.packfiles import RESIZE_FLAG, is_pack, read_meta
from cnnkit.data.scan import printable
from cnnkit.errors import ConfigError, DataError
from cnnkit.nn.yamlio import read_yaml

DATA_TAKES = "a folder, a packed set, a source name or a data YAML"  # what --data takes


def eval_data(spec: str | None, trained: dict[str, Any], pre: Preprocess,
              mean_image: torch.Tensor | None = None,
              labels: str | None = None) -> DataConfig:  # fmt: skip
    """The data to evaluate on, normalised as the network was trained: the run's own (its
    held-out split) when `spec` is None; a source name; a YAML file with a `data:` mapping; or
    a directory (a packed set if cnnkit packed it, else an image folder), all of whose
    images are evaluated as the run saw them (`mean_image`: the one a normalize: mean_image
    run subtracted, wherever the data is stored at its size). `labels`: the label file of a
    flat folder (ImageNet's validation set)."""
    if labels is not None and (spec is None or not Path(spec).is_dir()
                               or is_pack(spec)):  # fmt: skip
        raise ConfigError("--labels: the label file of a flat image folder given as --data DIR "
                          "(a packed set keeps its own labels)")  # fmt: skip
    if spec is None:
        if not trained:
            raise ConfigError(f"--data: an export or network file holds no data section: give "
                              f"--data ({DATA_TAKES})")  # fmt: skip
        section = dict(trained)
        for key in ("path", "val_path"):  # (moved since the run: data.path is no eval option)
            folder = section.get(key)
            if isinstance(folder, str) and folder and not Path(folder).exists():
                raise DataError(f"the run's data.{key} {printable(folder)}: no such folder now "
                                "(moved? give --data: a data YAML naming where it is now, "
                                "with the run's val_fraction or val_path, scores its held-out "
                                "split; a folder, every image in it)")  # fmt: skip
    elif source_named(spec):
        section = {"source": spec}
    elif Path(spec).is_file():
        if is_image_name(Path(spec).name):
            raise ConfigError(f"--data {spec}: an image; eval takes {DATA_TAKES} (`cnnkit "
                              "classify` takes images)")  # fmt: skip
        loaded = read_data_yaml(spec)
        section = loaded.get("data", loaded) if isinstance(loaded, dict) else None
        if not isinstance(section, dict):
            raise ConfigError(f"--data {spec}: the file has no data: mapping")
        section = check_source(section)  # (a path without a source: what it holds)
        if section.get("source") in ("folder", "packed"):  # unsaid: as the network trained
            section = {"crop": pre.crop, **section}
        if section.get("source") == "folder":
            section = {"size": pre.resize or pre.crop, "resize_mode": pre.resize_mode,
                       "interpolation": pre.interpolation, **section}  # fmt: skip
    elif Path(spec).is_dir():
        section = {"path": spec, "val_path": spec, "crop": pre.crop}
        if is_pack(spec):
            section["source"] = "packed"
        else:
            section.update(source="folder", size=pre.resize or pre.crop,
                           resize_mode=pre.resize_mode, interpolation=pre.interpolation)  # fmt: skip
            if labels is not None:
                section["val_labels"] = labels
    else:
        raise DataError(f"--data {spec}: not a data source ({', '.join(SOURCES)}), file or folder")
    cfg = _validated(section)
    if section.get("source") == "packed":
        check_pack_fits(spec, read_meta(cfg.path), pre)
    cfg = cfg.evaluated_as(pre, mean_image)
    if spec is not None and section.get("val_path") == spec and section["source"] == "folder":
        cfg._labels_option = "--labels"  # --data DIR's label file, data.val_labels to the source
    return cfg


def _validated(section: dict[str, Any]) -> DataConfig:
    """data_config, a misspelt field answered with the one meant, as train answers it."""
    try:
        return data_config(section)
    except ConfigError as e:
        typo = re.fullmatch(r"data\.(\w+): unknown field", str(e))
        if typo is None:
            raise
        raise ConfigError(f"{e}{did_you_mean(('data', typo[1]), {'data': section})}") from None


def note_normalisation(data: str, cfg: DataConfig, image: torch.Tensor | None) -> None:
    """For a `normalize: mean_image` run: a note where `--data` is not normalised with its
    mean image itself (eval_data), saying why: a bundled source normalises by its own
    statistics; a folder or pack, by the image's averages where the checkpoint lacks it or
    the data is stored at another size."""
    if not hasattr(cfg, "trained_mean"):  # the in-memory sources: digits, faces, synthetic
        print(f"cnnkit: note: --data {data}: a bundled source, normalised by its own mean and "
              "std, not by the run's mean image: figures may differ from the run's own",
              file=sys.stderr)  # fmt: skip
    elif cfg.trained_mean is None:
        side = None if image is None else image.shape[-1]
        why = NOT_HELD if side is None else (
            f"it is {side} px, these images are stored at {cfg.stored_size()} px")  # fmt: skip
        note_mean_image(f"--data {data}", why)


def source_named(spec: str) -> bool:
    """Whether --data SPEC names a source rather than a path: a name that is no path here, as
    torchvision reads a path given to ImageFolder (a folder ./faces is that folder, and a note
    says which bundled set it hides)."""
    if spec not in SOURCES:
        return False
    if not Path(spec).exists():
        return True
    if spec not in ("folder", "packed"):  # (those two alone need a path: nothing is hidden)
        kind = "folder" if Path(spec).is_dir() else "file"
        print(f"cnnkit: note: --data {spec}: the {kind} ./{spec}, not the bundled {spec} set "
              f"(a path wins; name that set from another folder, or by a data YAML with "
              f"`source: {spec}`)", file=sys.stderr)  # fmt: skip
    return False


def check_pack_fits(spec: str | None, meta: dict[str, Any], pre: Preprocess) -> None:
    """DataError unless a packed set's images were resized as the network's were trained: the
    same side (they are cropped, never resized again) and the same squash or centre square; a
    note where another filter resized them (close, not the figures the weights were made for)."""
    stored, trained = meta["size"], pre.resize or pre.crop
    if stored != trained:
        raise DataError(f"--data {spec}: packed at {stored} px, but the network was trained on "
                        f"{trained} px images (pack it again with --size {trained})")  # fmt: skip
    if pre.resize and meta["resize"] != pre.resize_mode:
        flag = RESIZE_FLAG
        raise DataError(f"--data {spec}: packed by --resize {flag[meta['resize']]}, but the "
                        f"network was trained on images resized by {flag[pre.resize_mode]} "
                        f"(pack it again with --resize {flag[pre.resize_mode]})")  # fmt: skip
    packed = meta.get("interpolation", "bilinear")
    if pre.resize and packed != pre.interpolation:
        print(f"cnnkit: note: --data {spec}: packed with {packed} resizing, but the network's "
              f"images were resized {pre.interpolation} (pack it again with --interpolation "
              f"{pre.interpolation} for the figures its weights were made for)",
              file=sys.stderr)  # fmt: skip


def read_data_yaml(spec: str) -> Any:
    """A --data file's YAML (bounded, duplicate keys refused); any problem is one line that
    names --data, and a binary file (a checkpoint, an export) says what --data takes."""
    try:
        return read_yaml(spec, instead=f"eval takes {DATA_TAKES}")
    except ConfigError as e:
        raise ConfigError(f"--data {e}") from None


def full_images(cfg: DataConfig, crop: int, trained: int | None) -> DataConfig:
    """The same data with the evaluation crop as large as the stored images, so the stream
    yields whole normalised images to cut 10 crops from (sources stored at the network's
    input size have no margin). `trained`: the image side the network was trained at."""
    if not trained or trained <= crop:  # every data set is read at that size: no margin
        raise ConfigError(
            f"--tencrop: this network was trained on images of its input size ({crop}x{crop}, "
            "no resize), so any data is read at that size: 10-crop needs a network trained "
            "with a resize larger than its crop"
        )
    stored = cfg.stored_size()
    if stored is None or stored <= crop:
        read = f"is read at {crop}x{crop}" if stored is None else (
            f"images are read at {stored}x{stored}")  # fmt: skip
        raise ConfigError(
            f"--tencrop: 10-crop needs a data set stored larger than the network's input "
            f"({crop}x{crop}); {cfg.source} {read}"
            + ("" if cfg.source in ("folder", "packed") else " (use a folder or packed set)")
        )
    if stored != trained:
        raise ConfigError(
            f"--tencrop: {getattr(cfg, 'path', cfg.source)} holds {stored} px images but the "
            f"network was trained on {trained} px ones (pack it again with --size {trained})"
        )
    return cfg.model_copy(update={"crop": stored})
