"""`evaluate_checkpoint`: loss, top-1 and top-5 of a trained network on its held-out split or
on another data set, with the precision and preprocessing it was trained with."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

from cnnkit.config import TrainConfig
from cnnkit.data import SOURCES, data_config
from cnnkit.data.augment import ten_crop
from cnnkit.errors import ConfigError, DataError
from cnnkit.train.checkpoint import load_trained
from cnnkit.train.engine import Engine, build_engine, resolve_device
from cnnkit.train.loop import evaluate


def data_section(spec: str | None, trained: dict[str, Any], pre: dict[str, Any]) -> dict[str, Any]:
    """The data section to evaluate on: the run's own (its held-out split) when `spec` is None; a
    source name; a YAML file with a `data:` mapping; or a directory (a packed set if it holds
    meta.json, else an image folder), all of whose images are evaluated as the run saw them."""
    if spec is None:
        return dict(trained)
    if spec in SOURCES:
        return {"source": spec}
    path = Path(spec)
    if path.is_file():
        loaded = yaml.safe_load(path.read_text())
        section = loaded.get("data", loaded) if isinstance(loaded, dict) else None
        if not isinstance(section, dict):
            raise ConfigError(f"--data {spec}: the file has no data: mapping")
        return section
    if not path.is_dir():
        raise DataError(f"--data {spec}: not a data source ({', '.join(SOURCES)}), file or folder")
    section = {"path": str(path), "val_path": str(path), "crop": pre["crop"]}
    if (path / "meta.json").is_file():
        return {"source": "packed", **section}
    size = pre.get("resize") or pre["crop"]
    mean, std = pre["mean"], pre["std"]
    return {"source": "folder", **section, "size": size, "resize_mode": pre["resize_mode"],
            "mean": mean * 3 if len(mean) == 1 else mean, "std": std * 3 if len(std) == 1 else std}  # fmt: skip


def full_image_section(section: dict[str, Any], crop: int, trained: int | None) -> dict[str, Any]:
    """The same data with the evaluation crop as large as the stored images, so the stream
    yields whole normalised images to cut 10 crops from; bundled sets have no margin.
    `trained`: the image side the network was trained at (the corners must be at that scale)."""
    source = section.get("source")
    if source == "folder":
        stored = int(section.get("size") or data_config(section).size)
    elif source == "packed":
        from cnnkit.data.packed import read_meta

        stored = int(read_meta(section["path"])["size"])
    else:
        stored = crop
    if stored <= crop:
        raise ConfigError(
            f"--tencrop: 10-crop needs a data set stored larger than the network's input "
            f"({crop}x{crop}); {source} images are {stored}x{stored} (use a folder or packed set)"
        )
    if trained is not None and stored != trained:
        raise ConfigError(
            f"--tencrop: {section.get('path')} holds {stored} px images but the network was "
            f"trained on {trained} px ones (pack it again with --size {trained})"
        )
    return {**section, "crop": stored}


class Renormalised:
    """A stream normalised with one mean/std, yielded as if normalised with another."""

    def __init__(self, batches: Any, have: Any, want: dict[str, Any]):
        def view(v: list[float]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1)

        self.batches, self.num_samples = batches, batches.num_samples
        self.scale = view(have.std) / view(want["std"])
        self.shift = (view(have.mean) - view(want["mean"])) / view(want["std"])

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.batches.set_epoch(epoch, skip_batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for x, y in self.batches:
            yield x * self.scale.to(x.device) + self.shift.to(x.device), y


def _as_trained(bundle: Any, trained: dict[str, Any], section: dict[str, Any]) -> Any:
    """A packed set normalises with its own statistics: re-express its batches in the
    checkpoint's per-channel mean/std, as the network was trained (channel normalisation)."""
    pre, val = bundle.preprocess, bundle.val
    if section.get("source") != "packed" or section.get("normalize", "channel") != "channel":
        return val
    same = list(pre.mean) == list(trained["mean"]) and list(pre.std) == list(trained["std"])
    return val if same or len(trained["mean"]) != len(pre.mean) else Renormalised(val, pre, trained)


@torch.no_grad()
def evaluate_ten_crops(engine: Engine, batches: Any, crop: int) -> dict[str, dict[str, float]]:
    """Centre-crop and 10-crop (softmax averaged over 4 corners + centre, each mirrored) loss,
    top-1 and top-5 over a stream of whole normalised images (one crop per pass: same memory)."""
    model = engine.network.eval()
    totals = {
        "centre": torch.zeros(4, dtype=torch.float64),
        "tencrop": torch.zeros(4, dtype=torch.float64),
    }
    batches.set_epoch(0)
    for x, y in batches:
        crops, probs = ten_crop(x, crop), 0.0
        for i in range(10):
            with engine.autocast():
                logits = model(engine.prepare(crops[:, i].contiguous())).float()
            probs = probs + logits.softmax(1) / 10
            if i == 4:  # the centre crop (torchvision's TenCrop order)
                totals["centre"] += _scores(logits.log_softmax(1), y)
        totals["tencrop"] += _scores(probs.clamp_min(1e-12).log(), y)
    return {name: _means(t) for name, t in totals.items()}


def _scores(log_probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    k = min(5, log_probs.shape[1])
    hits = log_probs.topk(k, 1).indices == y[:, None]
    loss = F.nll_loss(log_probs, y, reduction="sum")
    return (
        torch.stack([loss, hits[:, 0].sum(), hits.any(1).sum(), torch.tensor(len(y))])
        .double()
        .cpu()
    )


def _means(t: torch.Tensor) -> dict[str, float]:
    n = max(t[3].item(), 1.0)
    return {"loss": t[0].item() / n, "top1": t[1].item() / n, "top5": t[2].item() / n}


def evaluate_checkpoint(
    target: str | Path,
    data: str | None = None,
    device: str = "auto",
    batch_size: int | None = None,
    tencrop: bool = False,
) -> dict[str, Any]:
    """Evaluate a run directory or checkpoint; returns loss, top1, top5, images and where (with
    `tencrop`: the centre crop's figures plus a "tencrop" mapping of the 10-crop ones)."""
    network, meta = load_trained(target)
    config = meta["config"]
    section = data_section(data, config["data"], meta["preprocess"])
    crop = int(network.input_shape[-1])
    if tencrop:
        section = full_image_section(section, crop, meta["preprocess"].get("resize"))
    if batch_size is not None:
        section["eval_batch_size"] = batch_size
    dev = resolve_device(device)
    trained = dict(config.get("train", {}), device=device, compile=False)
    if trained.get("precision") == "fp16" and dev.type != "cuda":
        trained["precision"] = "auto"  # trained with CUDA fp16, evaluated elsewhere
    train_cfg = TrainConfig.model_validate(trained)
    bundle = data_config(section).build(dev, 0, 1, config.get("seed", 0))
    if len(bundle.classes) != network.num_classes:
        raise DataError(
            f"--data: {len(bundle.classes)} classes, but the network was trained on {network.num_classes}"
        )
    engine = build_engine(network, train_cfg, dev)
    val = _as_trained(bundle, meta["preprocess"], section)
    if tencrop:
        both = evaluate_ten_crops(engine, val, crop)
        result = {**both["centre"], "tencrop": both["tencrop"]}
    else:
        result = evaluate(engine, val)
    return {
        **result,
        "images": bundle.val.num_samples,
        "checkpoint": meta["path"],
        "device": str(dev),
    }
