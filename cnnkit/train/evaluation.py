"""`evaluate_checkpoint`: loss, top-1 and top-5 of a trained network on its held-out split or
on another data set, with the precision and preprocessing it was trained with."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from cnnkit.checkpoint import load_trained, uses_mean_image
from cnnkit.config import TrainConfig
from cnnkit.data import DataConfig, Preprocess
from cnnkit.data.augment import ten_crop
from cnnkit.data.scan import unknown_classes
from cnnkit.distributed import resolve_device
from cnnkit.errors import CheckpointError, ConfigError, DataError, validation_message
from cnnkit.nn.onednn import freeze
from cnnkit.nn.yamlio import export_kind, export_said
from cnnkit.runtime import restore_matmuls, tf32_matmuls
from cnnkit.train.checks import check_same_classes, check_same_split
from cnnkit.train.engine import Engine, build_engine
from cnnkit.train.eval_data import eval_data, full_images, note_normalisation
from cnnkit.train.loop import check_read, evaluate, score_logits
from cnnkit.train.settings import inference_settings

OWN_SPLIT_CHANGED = ("evaluate it on the data as it was, or give --data images it never "
                     "trained on")  # fmt: skip


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
    data = None if _own_data(data, config) else data
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
    if data is None:  # the run's own split, drawn as it was
        cfg = cfg.drawn_as(meta.get("holdout"))
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
            "checkpoint": meta["path"], "epoch": meta.get("epoch"), "step": meta.get("step"),
            "device": str(dev),
            "classes": len(meta["classes"])}  # fmt: skip


def _own_data(data: str | None, config: dict[str, Any]) -> bool:
    """Whether --data names the bundled set the run trained on (digits, faces): its default
    split held out other images than the run's, most of which the run trained on, so the run's
    own held-out split is scored instead, as `eval RUN` scores it (a note says so). --data DIR
    naming the run's own data.path (a folder or its pack) is scored whole, every image in it
    as ever, in a note saying that it holds the images the run trained on."""
    section = config.get("data", {})
    if data is None or data in ("folder", "packed"):
        return False
    path = section.get("path")
    if (
        isinstance(path, str)
        and Path(data).is_dir()
        and Path(data).resolve() == Path(path).resolve()
    ):
        held = ("data.val_path's" if section.get("val_path") else
                "a split of it, which `cnnkit eval RUN` scores")  # fmt: skip
        print(f"cnnkit: note: --data {data}: the run's own data.path, every image in it scored, "
              f"the ones it trained on too (its held-out images: {held})", file=sys.stderr)  # fmt: skip
        return False
    if data != section.get("source") or Path(data).exists():  # (./digits: that folder)
        return False
    print(f"cnnkit: note: --data {data}: the run's own data set: its held-out split is scored, "
          "as the run drew it (another split would count images it trained on)",
          file=sys.stderr)  # fmt: skip
    return True


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
    figures would be those of random weights; an ONNX, torch.export or TorchScript file is a
    usage error, as every other command says it (exit status 2)."""
    kind = export_kind(Path(target)) if Path(target).is_file() else None
    if kind is not None:
        raise ConfigError(f"{target}: {export_said(kind)}")
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
        self.num_samples, self.num_images = batches.num_samples, batches.num_images

    def __len__(self) -> int:
        return len(self.batches)

    def check_room(self) -> None:
        self.batches.check_room()

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
