"""`evaluate_checkpoint`: loss, top-1 and top-5 of a trained network on its held-out split or
on another data set, with the precision and preprocessing it was trained with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cnnkit.config import TrainConfig
from cnnkit.data import SOURCES, data_config
from cnnkit.errors import ConfigError, DataError
from cnnkit.train.checkpoint import load_trained
from cnnkit.train.engine import build_engine, resolve_device
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


def evaluate_checkpoint(
    target: str | Path,
    data: str | None = None,
    device: str = "auto",
    batch_size: int | None = None,
) -> dict[str, Any]:
    """Evaluate a run directory or checkpoint; returns loss, top1, top5, images and where."""
    network, meta = load_trained(target)
    config = meta["config"]
    section = data_section(data, config["data"], meta["preprocess"])
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
    result = evaluate(engine, bundle.val)
    return {
        **result,
        "images": bundle.val.num_samples,
        "checkpoint": meta["path"],
        "device": str(dev),
    }
