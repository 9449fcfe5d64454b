"""What to say of a field a run has no place for: the field meant (by spelling, or by the
name torchvision's scripts, timm, Caffe or pycls give it), the section it belongs in, or the data
source that has it."""

from __future__ import annotations

import difflib
import json
from typing import Any

from pydantic import BaseModel

from cnnkit.config.sections import ModelConfig, RunConfig, TrainConfig
from cnnkit.data import SOURCES
from cnnkit.data.packfiles import PACK_FLAGS
from cnnkit.errors import ConfigError


def other_sources_fields(raw: dict[str, Any]) -> list[str]:
    """The fields of a run's data: section that its source lacks and another source has
    (data.source=packed given to a run written for digits: shift, rotate), as data.NAME."""
    data = raw.get("data")
    kind = SOURCES.get(data.get("source")) if isinstance(data, dict) else None
    if kind is None:
        return []
    others = {f for name, other in SOURCES.items() if other is not kind for f in other.model_fields}
    return [f"data.{k}" for k in data if k not in kind.model_fields and k in others]


def meant_otherwise(raw: dict[str, Any], error: str) -> str:
    """`data.scale is packed's random-resized-crop area range, by default [0.08, 1.0]; ` where
    the field in error is one its source takes and another source means something else by
    (digits' scale, a zoom): =null leaves out only another source's fields, so what this one
    takes is said."""
    name = error.split(":", 1)[0].removeprefix("data.").split(".")[0]
    source = raw["data"]["source"]
    field = SOURCES[source].model_fields.get(name)
    if field is None or name not in raw["data"]:
        return ""
    if all(o.model_fields[name].annotation == field.annotation
           for o in SOURCES.values() if name in o.model_fields):  # fmt: skip
        return ""
    default = list(field.default) if isinstance(field.default, tuple) else field.default
    return f"data.{name} is {source}'s {field.description}, by default {json.dumps(default)}; "


# the names torchvision's reference scripts, timm, Caffe's solver and pycls give our settings,
# which spelling alone would match wrongly (image_size -> batch_size, batch -> path) or not at all
PEER_NAMES: dict[str, str | tuple[str, ...]] = {  # (a tuple: the first the section has)
    **dict.fromkeys(
        (
            "image_size",
            "img_size",
            "input_size",
            "crop_size",
            "val_crop_size",
            "train_crop_size",
            "test_crop_size",
        ),
        "crop",
    ),
    **dict.fromkeys(("resize_size", "val_resize_size", "resize", "scale_size"), "size"),
    **dict.fromkeys(
        ("batch", "bs", "batchsize", "train_batch_size", "ims_per_batch"), "batch_size"
    ),
    **dict.fromkeys(
        ("val_batch_size", "test_batch_size", "validation_batch_size"), "eval_batch_size"
    ),
    **dict.fromkeys(
        ("data_path", "data_dir", "root", "dataset_path", "train_dir", "source_dir"), "path"
    ),
    **dict.fromkeys(("val_dir", "val_data", "test_path", "val_root"), "val_path"),
    **dict.fromkeys(("num_workers", "j", "loader_workers"), "workers"),
    **dict.fromkeys(("hflip", "flip", "random_flip", "mirror_prob"), "mirror"),
    **dict.fromkeys(("auto_augment", "autoaugment", "aa"), "policy"),
    **dict.fromkeys(("ra_magnitude", "randaugment_magnitude"), "magnitude"),
    **dict.fromkeys(("ra_num_ops", "randaugment_num_ops"), "num_ops"),
    **dict.fromkeys(("reprob", "random_erase", "random_erasing", "re_prob"), "erasing"),
    **dict.fromkeys(("learning_rate", "base_lr", "lr0"), "lr"),
    **dict.fromkeys(("wd", "decay"), "weight_decay"),
    **dict.fromkeys(("opt", "optim", "solver", "solver_type"), "optimizer"),
    **dict.fromkeys(("lr_policy", "lr_scheduler", "sched", "scheduler"), "schedule"),
    **dict.fromkeys(("stepsize", "lr_step_size", "decay_epochs"), "step_size"),
    **dict.fromkeys(("stepvalue", "lr_steps", "steps", "decay_milestones"), "milestones"),
    **dict.fromkeys(("lr_gamma", "decay_rate"), "gamma"),
    **dict.fromkeys(("warmup", "lr_warmup_epochs", "warmup_epoch"), "warmup_epochs"),
    **dict.fromkeys(("lr_warmup_decay", "warmup_factor"), "warmup_start"),  # (factors of lr)
    **dict.fromkeys(("warmup_lr", "crop_pct", "warmup_prefix"), ()),  # timm's, none alike
    **dict.fromkeys(("weight_decay_bias", "bias_decay", "bias_wd"), "bias_weight_decay"),
    **dict.fromkeys(
        ("weight_decay_norm", "norm_wd", "bn_weight_decay", "norm_decay", "bn_wd"),
        "norm_weight_decay",
    ),
    "nesterov": "optimizer",  # optimizer: nesterov
    "mixup_alpha": "mixup",
    "cutmix_alpha": "cutmix",
    **dict.fromkeys(("model_ema", "ema_decay", "model_ema_decay"), "ema"),
    **dict.fromkeys(("amp", "dtype", "mixed_precision", "half", "fp16", "bf16"), "precision"),
    **dict.fromkeys(("clip_grad", "clip_grad_norm", "clip_gradients", "max_norm"), "grad_clip"),
    **dict.fromkeys(("max_epoch", "max_epochs", "num_epochs", "n_epochs"), "epochs"),
    **dict.fromkeys(("smoothing", "label_smooth"), "label_smoothing"),
    **dict.fromkeys(
        ("grad_accum_steps", "accum_iter", "iter_size", "gradient_accumulation"), "accumulate"
    ),
    **dict.fromkeys(("lr_min", "eta_min", "min_learning_rate"), "min_lr"),
    **dict.fromkeys(("solver_mode", "gpu", "cuda"), "device"),
    **dict.fromkeys(("random_seed", "manual_seed", "rng_seed"), "seed"),
    **dict.fromkeys(("arch", "net", "architecture"), ("network", "model")),  # model.arch: network
}


# fields a run has no place for, as its data gives them (synthetic data's num_classes aside)
TAKEN_FROM_DATA = {
    "num_classes": "training takes the class count from the data set, in place of a network "
    "file's num_classes",
}


def _section_of(path: list[str], raw: dict[str, Any]) -> type[BaseModel]:
    """The settings class a dotted path leads to (data: the run's source's)."""
    section: type[BaseModel] = RunConfig
    for part in path:
        if part == "data" and isinstance(raw.get("data"), dict):
            section = SOURCES.get(raw["data"].get("source"), section)
            continue
        annotation = section.model_fields.get(part)
        kind = getattr(annotation, "annotation", None)
        section = kind if isinstance(kind, type) and issubclass(kind, BaseModel) else section
    return section


def did_you_mean(loc: tuple, raw: dict[str, Any], source_said: str | None = None) -> str:
    """` (did you mean 'lr'?)` for a mistyped field, from the fields of its section
    (`source_said`: the data source as a message names it, where the run names none)."""
    parts = [str(p) for p in loc if str(p) not in SOURCES]
    section = _section_of(parts[:-1], raw)
    key = parts[-1].lower().replace("-", "_")
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    source = SOURCES.get(data.get("source"), RunConfig)  # (synthetic data has num_classes)
    if key in TAKEN_FROM_DATA and parts[:1] != ["data"] and key not in source.model_fields:
        return f" ({TAKEN_FROM_DATA[key]})"  # model.num_classes
    known, meant = key in PEER_NAMES, PEER_NAMES.get(key, ())
    meant = (meant,) if isinstance(meant, str) else meant
    peer = next((m for m in meant if m in section.model_fields), meant[0] if meant else None)
    if peer in section.model_fields:
        return f" (did you mean {peer!r}?)"
    elsewhere = {"": RunConfig, "train.": TrainConfig, "model.": ModelConfig, "data.": source}
    for prefix, other in elsewhere.items():  # another section's own field, before a near one
        if other is not section and (peer or key) in other.model_fields:  # (train.batch_size)
            where = "at the top level" if not prefix else f"in {prefix[:-1]}"
            return f" (it belongs {where}: {prefix}{peer or key})"
    owners = [name for name, kind in SOURCES.items() if (peer or key) in kind.model_fields]
    if owners and parts[:1] != ["data"] and len(parts) > 1:  # train.workers: an image set's
        return f" (data.{peer or key} is a setting of data.source {' / '.join(owners)})"
    close = difflib.get_close_matches(key, list(section.model_fields), n=1)  # (train.LR: lr)
    if close and not known and not owners:  # (image_size: not batch_size; val_path: its own)
        return f" (did you mean {close[0]!r}?)"
    this = source_said or data.get("source")
    renamed = peer or (key if key != parts[-1] else None)  # (data.PATH: path)
    if renamed and owners and parts[:1] == ["data"] and data.get("source") in SOURCES:
        return f" (data.{renamed} is a setting of data.source {' / '.join(owners)}, not {this})"
    if parts[:1] == ["data"] and data.get("source") == "packed" and key in PACK_FLAGS:
        return (f" (a pack's images were resized when it was made: `cnnkit pack "
                f"{PACK_FLAGS[key]}` sets it)")  # fmt: skip
    if parts[:1] == ["data"] and owners and data.get("source") in SOURCES:
        model = raw.get("model")  # `model: digitnet` or `model: {network: digitnet, ...}`
        network = model.get("network") if isinstance(model, dict) else model
        if not {"folder", "packed"} & set(owners):  # (no data.path would take it either)
            return _bundled_only(key, owners, this)
        if isinstance(network, str):  # `train digits data.path=DIR`: the network on that data
            also = "" if key == "path" else f" data.{parts[-1]}=..."
            return (f" (a setting of data.source {' / '.join(owners)}, not {this}: `cnnkit "
                    f"train {network} data.path=DIR{also}` trains the run's network, "
                    f"{network}, on such data)")  # fmt: skip
        return (f" (a setting of data.source {' / '.join(owners)}, not {this}: "
                f"data.{parts[-1]}=null leaves it out, or start from a run file written for "
                f"{data['source']} data)")  # fmt: skip
    if parts[:1] == ["data"] and data.get("source") in SOURCES and not known:  # data.pth on digits
        every = sorted({f for kind in SOURCES.values() for f in kind.model_fields})
        near = difflib.get_close_matches(key, every, n=1)
        owners = [name for name, kind in SOURCES.items() if near and near[0] in kind.model_fields]
        if owners:
            return (f" (data.{near[0]} is a setting of data.source {' / '.join(owners)}, not "
                    f"{this})")  # fmt: skip
    return ""


def _bundled_only(key: str, owners: list[str], this: str) -> str:
    """A field of the bundled sets alone (digits, faces), given to a folder or a pack."""
    split = (": a folder's or a pack's held-out images are data.val_fraction of data.path "
             "(drawn by file name), or data.val_path" if key == "split_seed" else "")  # fmt: skip
    return f" (a setting of data.source {' / '.join(owners)}, not {this}{split})"


def data_typo(net: str, given: set[str]) -> None:
    """`cnnkit train resnet18 data.data_dir=DIR`: the field no data source has is the error."""
    fields = {f for kind in SOURCES.values() for f in kind.model_fields}
    for key in sorted(given):
        part = key.split(".")
        if part[0] == "data" and len(part) == 2 and part[1] not in fields:
            meant = did_you_mean(("data", part[1]), {"data": {"source": "folder"}},
                                 source_said="of a folder or a pack")  # fmt: skip
            raise ConfigError(f"{key[:60]}: unknown field{meant}: `cnnkit train {net} "
                              "data.path=DIR` trains it on a folder of class folders or a pack")  # fmt: skip
