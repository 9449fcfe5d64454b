"""`evaluate_checkpoint`: loss, top-1 and top-5 of a trained network on its held-out split or
on another data set, with the precision and preprocessing it was trained with."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from cnnkit.checkpoint import NOT_HELD, load_trained, note_mean_image, uses_mean_image
from cnnkit.config import TrainConfig
from cnnkit.data import SOURCES, DataConfig, Preprocess, check_source, data_config
from cnnkit.data.augment import ten_crop
from cnnkit.data.decode import is_image_name
from cnnkit.data.packfiles import RESIZE_FLAG, is_pack, read_meta
from cnnkit.data.scan import printable, unknown_classes
from cnnkit.distributed import resolve_device
from cnnkit.errors import CheckpointError, ConfigError, DataError, validation_message
from cnnkit.nn.onednn import freeze
from cnnkit.nn.yamlio import read_yaml
from cnnkit.runtime import restore_matmuls, tf32_matmuls
from cnnkit.train.checks import check_same_classes, check_same_split
from cnnkit.train.engine import Engine, build_engine
from cnnkit.train.loop import check_read, evaluate, score_logits
from cnnkit.train.settings import inference_settings

DATA_TAKES = "a folder, a packed set, a source name or a data YAML"  # what --data takes
OWN_SPLIT_CHANGED = ("evaluate it on the data as it was, or give --data images it never "
                     "trained on")  # fmt: skip


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
    cfg = data_config(section)
    if section.get("source") == "packed":
        check_pack_fits(spec, read_meta(cfg.path), pre)
    cfg = cfg.evaluated_as(pre, mean_image)
    if spec is not None and section.get("val_path") == spec and section["source"] == "folder":
        cfg._labels_option = "--labels"  # --data DIR's label file, data.val_labels to the source
    return cfg


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


@torch.no_grad()
def evaluate_ten_crops(engine: Engine, batches: Any, crop: int) -> dict[str, dict[str, float]]:
    """Centre-crop and 10-crop (softmax averaged over 4 corners + centre, each mirrored) loss,
    top-1 and top-5 over a stream of whole normalised images (one crop per pass: same memory)."""
    model = engine.network.eval()
    totals = {name: torch.zeros(4, dtype=torch.float64, device=engine.device)
              for name in ("centre", "tencrop")}  # fmt: skip
    batches.set_epoch(0)
    for x, y in batches:
        if not len(y):  # every image of the batch unreadable (the loader said which)
            continue
        crops, probs = ten_crop(x, crop), 0.0
        for i in range(10):
            with engine.autocast():
                logits = model(engine.prepare(crops[:, i].contiguous())).float()
            probs = probs + logits.softmax(1) / 10
            if i == 4:  # the centre crop (torchvision's TenCrop order)
                totals["centre"][:3] += score_logits(logits.log_softmax(1), y)
        totals["tencrop"][:3] += score_logits(probs.clamp_min(1e-12).log(), y)
        for t in totals.values():
            t[3] += len(y)
    check_read(totals["centre"][3].item(), batches)
    return {name: _means(t) for name, t in totals.items()}


def _means(t: torch.Tensor) -> dict[str, float]:
    n = max(t[3].item(), 1.0)
    return {"loss": t[0].item() / n, "top1": t[1].item() / n, "top5": t[2].item() / n}


def evaluate_checkpoint(
    target: str | Path,
    data: str | None = None,
    device: str = "auto",
    batch_size: int | None = None,
    tencrop: bool = False,
    ema: bool = False,
    labels: str | None = None,
    loaded: tuple[torch.nn.Module, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Evaluate a run directory, checkpoint or export; returns loss, top1, top5, images and
    where (with `tencrop`: the centre crop's figures plus a "tencrop" mapping of the 10-crop
    ones; `ema`: the moving average of the weights that train.ema kept; `labels`: a flat
    --data folder's label file; `loaded`: the network and its meta, as load_trained gives
    them, of a network file with weights: loaded already). On a CPU an fp32 run is evaluated
    with the kernels classification measures as fastest (settings.inference_settings)."""
    network, meta = loaded if loaded is not None else _trained(target, ema)
    config, pre = meta["config"], Preprocess.from_dict(meta["preprocess"])
    cfg = eval_data(data, config.get("data", {}), pre, meta.get("mean_image"), labels)
    if data is not None and uses_mean_image(config):
        note_normalisation(data, cfg, meta.get("mean_image"))
    cfg, grey = _grey_for(cfg, pre)
    crop = int(network.input_shape[-1])
    if tencrop:
        cfg = full_images(cfg, crop, pre.resize)
    if batch_size is not None:
        cfg = cfg.model_copy(update={"eval_batch_size": batch_size})
    dev = resolve_device(device)
    bundle = cfg.build(dev, 0, 1, config.get("seed", 0))
    if data is None:  # the run's own split: drawn from the training images as they are now
        check_same_classes(meta["classes"], bundle, str(target), OWN_SPLIT_CHANGED)
        check_same_split(meta.get("holdout"), bundle, str(target), OWN_SPLIT_CHANGED)
    label_map = class_map(bundle.classes, meta["classes"], data or "the held-out split",
                          indexed=hasattr(cfg, "path"))  # fmt: skip
    train_cfg = _eval_settings(config, device, dev, meta.get("path", target), meta.get("settings"))
    batch = cfg.eval_batch_size or cfg.batch_size
    engine = build_engine(
        network, train_cfg, dev, settings=inference_settings(network, train_cfg, dev, batch)
    )
    freeze(engine.network)  # evaluated, never trained: oneDNN's linear layers pack their weights
    batches = CountedBatches(bundle.val, label_map, grey)
    matmuls = tf32_matmuls() if dev.type == "cuda" else None  # fp32 as training ran it
    try:
        if tencrop:
            both = evaluate_ten_crops(engine, batches, crop)
            result = {**both["centre"], "tencrop": both["tencrop"]}
        else:
            result = evaluate(engine, batches)
    finally:
        if matmuls is not None:
            restore_matmuls(matmuls)
    if not batches.images:  # never a 0% figure for an empty set
        raise DataError(nothing_held_out(data, cfg))
    return {**result, "images": batches.images, "skipped": bundle.val.num_samples - batches.images,
            "checkpoint": meta["path"], "epoch": meta.get("epoch"), "device": str(dev),
            "classes": len(meta["classes"])}  # fmt: skip


def _grey_for(cfg: DataConfig, pre: Preprocess) -> tuple[DataConfig, tuple[float, float] | None]:
    """RGB folders / packed sets for a grey network: read unnormalised, to be made grey as
    classify does (Pillow's "L") and normalised with the network's (mean, std), returned;
    unless the data section makes its own luma (data.grey: a run's own data, as it trained)."""
    if pre.channels != 1 or not hasattr(cfg, "normalize") or getattr(cfg, "grey", False):
        return cfg, None
    cfg = cfg.model_copy(update={"normalize": "channel", "mean": (0.0,) * 3, "std": (1.0,) * 3})
    return cfg, (pre.mean[0], pre.std[0])


def _trained(target: str | Path, ema: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    """load_trained's network and meta; ConfigError for an export of fresh weights, whose
    figures would be those of random weights."""
    network, meta = load_trained(target, ema=ema)
    if meta.get("trained") is False:
        raise ConfigError(f"{target}: the export of a network without trained weights (its "
                          "metadata says so): evaluate a run directory or checkpoint")  # fmt: skip
    return network, meta


def nothing_held_out(data: str | None, cfg: DataConfig) -> str:
    """Why evaluation found no image, and what to give instead: a data YAML is scored on its
    held-out split, which `val_fraction: 0` without a val_path leaves empty."""
    if data is None:
        return "the run: no held-out image to evaluate (give --data)"
    if getattr(cfg, "val_fraction", None) == 0 and not getattr(cfg, "val_path", None):
        return (f"--data {data}: holds no image out (val_fraction: 0, no val_path), and eval "
                f"scores a data YAML's held-out split: give the folder itself (--data "
                f"{cfg.path}) to score every image, or a val_path or val_fraction")  # fmt: skip
    return f"--data {data}: no image to evaluate"


def class_map(data_classes: list[str], trained: list[str], where: str,
              indexed: bool = True) -> torch.Tensor | None:  # fmt: skip
    """The data's class indices as the network's (matched by name, as training matches a
    validation set), None where they are the same; DataError for a class the network lacks.
    A set holding only some of the classes is fine; one that names them differently is not.
    A network that names no classes (class0, class1...: a network file with published
    weights, its export) takes classes given by index (Caffe's val.txt) as those outputs, and
    named ones in sorted order, as torchvision's ImageFolder numbers them, if as many.
    `indexed`: the data's classes may be a label file's indices (a folder's, a pack's; not a
    bundled set's own names, digits' '0'-'9')."""
    if list(data_classes) == list(trained):
        return None
    unnamed = list(trained) == [f"class{k}" for k in range(len(trained))]
    if unnamed and all(c.isdigit() and int(c) < len(trained) for c in data_classes):
        return torch.tensor([int(c) for c in data_classes])
    if unnamed and not set(data_classes) <= set(trained):
        if len(data_classes) != len(trained):
            raise DataError(f"--data {where}: {len(data_classes)} classes, and the network "
                            f"names none of its {len(trained)} outputs: to be taken in order, "
                            "as torchvision's ImageFolder numbers them, the data must hold "
                            "every class")  # fmt: skip
        print(f"cnnkit: note: --data {where}: the network names no classes: the data's "
              f"{len(data_classes)} classes, in sorted order, are its outputs 0-"
              f"{len(trained) - 1}, as torchvision's ImageFolder numbers them", file=sys.stderr)  # fmt: skip
        return None
    lookup = {name: k for k, name in enumerate(trained)}
    unknown = [c for c in data_classes if c not in lookup]
    if unknown:
        raise DataError(f"--data {where}: class {unknown[0]!r} is not one the network was "
                        f"trained on{unknown_classes(unknown, trained, indexed)}")  # fmt: skip
    twice = [c for c in data_classes if list(trained).count(c) > 1]
    if twice:  # (ImageNet's published names hold 'crane' and 'maillot' twice each)
        outputs = [k for k, name in enumerate(trained) if name == twice[0]]
        raise DataError(f"--data {where}: class {twice[0]!r} names {len(outputs)} of the "
                        f"network's outputs ({', '.join(map(str, outputs))}), so matching by "
                        "name cannot say which its images are")  # fmt: skip
    return torch.tensor([lookup[c] for c in data_classes])


class CountedBatches:
    """A Batches stream that counts the images it yields: those evaluated, not the unreadable
    ones the loader skipped (and named on stderr). `label_map`: the data's labels as the
    network's class indices (class_map). `grey`: a grey network's (mean, std), for RGB data
    yielded in 0-255: made grey as Pillow's "L" (and so classify) does, then normalised."""

    def __init__(self, batches: Any, label_map: torch.Tensor | None = None,
                 grey: tuple[float, float] | None = None):  # fmt: skip
        self.batches, self.images, self.label_map, self.grey = batches, 0, label_map, grey
        self.num_samples = batches.num_samples

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.batches.set_epoch(epoch, skip_batches)

    def __iter__(self) -> Any:
        for x, y in self.batches:
            self.images += len(y)
            if self.label_map is not None:
                self.label_map = self.label_map.to(y.device)
                y = self.label_map[y]
            if self.grey is not None:
                x = (luma(x) - self.grey[0]) / self.grey[1]
            yield x, y


def luma(rgb: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) float 0-255 integers -> (B, 1, H, W): ITU-R 601 luma rounded exactly as
    Pillow's convert("L") (fixed point, 16 bits; exact in float32 below 2**24)."""
    r, g, b = rgb.unbind(1)
    return ((r * 19595 + g * 38470 + b * 7471 + 32768) / 65536).floor()[:, None]


def _eval_settings(config: dict[str, Any], name: str, device: torch.device,
                   source: Any = "the checkpoint",
                   ran: dict | None = None) -> TrainConfig:  # fmt: skip
    """The run's precision and memory format, on the evaluation device: on the kind of device
    it trained on, the precision its steps ran in (`ran`, the checkpoint's settings; on a GPU
    their memory format too: a CPU's measures its own kernels for a forward pass), so that
    evaluation repeats the held-out figures even where `auto` was measured (fp32 on a CPU
    that also computes in bf16, say). An export (no `config`): the precision its run's steps ran
    in where it records them and the device is of that kind, else fp32 as classify computes,
    never one that `auto` picks."""
    trained = config.get("train", {})
    trained = dict(trained if isinstance(trained, dict) else {}, device=name, compile=False)
    same_device = bool(ran) and ran.get("device") == device.type
    if not config:
        trained["precision"] = ran["precision"] if same_device else "fp32"
    if trained.get("precision") == "auto" and same_device:
        trained["precision"] = ran["precision"]
    if trained.get("channels_last") in (None, "auto") and same_device and device.type == "cuda":
        trained["channels_last"] = bool(ran.get("channels_last"))  # as classify runs it there
    if trained.get("precision") == "fp16" and device.type != "cuda":
        trained["precision"] = "auto"  # trained with CUDA fp16, evaluated elsewhere
    try:
        return TrainConfig.model_validate(trained)
    except ValidationError as e:
        raise CheckpointError(f"{source}: its train settings are damaged: train."
                              f"{validation_message(e)}") from None  # fmt: skip
