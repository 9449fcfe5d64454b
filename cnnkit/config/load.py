"""Reading a run: a zoo run, a YAML file or a mapping, with dotted `key=value` overrides, its
files made absolute, validated once (the first problem one line naming the field, and the field
meant); writing it back as YAML (config.yaml)."""

from __future__ import annotations

import copy
import difflib
import os
import re
import shlex
from contextlib import suppress
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from cnnkit.config.hints import data_typo, did_you_mean, meant_otherwise, other_sources_fields
from cnnkit.config.sections import ModelConfig, RunConfig
from cnnkit.data import SOURCES, check_source
from cnnkit.data.base import resized_side
from cnnkit.data.decode import holds_images
from cnnkit.data.folder import IMAGENET_MEAN, IMAGENET_STD
from cnnkit.data.packfiles import PACK_FLAGS, RESIZE_FLAG, is_pack, read_meta
from cnnkit.errors import ConfigError, DataError, brief, config_error, suggest
from cnnkit.nn.yamlio import load_yaml, plain_data, read_yaml
from cnnkit.runtime import write_atomic


def load_run(run: str | Path | dict[str, Any], overrides: list[str] | None = None,
             trained: bool = False) -> RunConfig:  # fmt: skip
    """Read a zoo run, YAML file or dict, apply `key=value` overrides, validate everything.
    `trained`: the run file is a run directory's that has trained (source_follows_path's
    `resumed`: what its resume would take)."""
    given = {o.split("=", 1)[0].strip() for o in overrides or []}
    raw, base = _read_run(run, given)
    raw = copy.deepcopy(raw)
    if isinstance(raw.get("model"), str) and any(o.startswith("model.") for o in overrides or []):
        raw["model"] = {"network": raw["model"]}  # model.weights=... on `model: resnet50`
    if "data.path" in given and "data.source" not in given:
        _folder_as_written(raw)
    _relative_to(raw, base)  # the run file's files: beside it
    for item in overrides or []:
        apply_override(raw, item)
    notes = source_follows_path(raw, overrides, resumed=trained)
    _relative_to(raw, None)  # the command line's: in the working directory
    absolute_data(raw)
    _source_of_path(raw)
    _crop_for_network(raw)
    stem = Path(str(run)).stem if not isinstance(run, dict) else "run"
    raw.setdefault("name", re.sub(r"[^A-Za-z0-9._+-]+", "-", stem).strip("-.") or "run")
    config = validate_run(raw)
    config._notes = notes
    if isinstance(config.model.network, dict) and not isinstance(run, dict):
        config.model._source = f"{run}: model"  # (a network file names itself)
    data = config.data  # a new run (a resumed one keeps the settings it started with)
    if getattr(data, "val_fraction", None) == 0 and not getattr(data, "val_path", None):
        raise ConfigError("data.val_fraction: 0 leaves no held-out images, which best.pt, early "
                          "stopping and the plateau schedule read: give data.val_path, or a "
                          "fraction above 0")  # fmt: skip
    return config


def describe_run(config: RunConfig) -> list[tuple[str, Any, Any, str]]:
    """Every setting of a run as (dotted key, value, default, description), the data section's
    being its source's own fields."""
    rows: list[tuple[str, Any, Any, str]] = []

    def walk(prefix: str, model: BaseModel) -> None:
        for name, field in type(model).model_fields.items():
            value = getattr(model, name)
            if isinstance(value, BaseModel):
                walk(f"{prefix}{name}.", value)
                continue
            default = None if field.is_required() else field.get_default(call_default_factory=True)
            rows.append((f"{prefix}{name}", value, default, field.description or ""))

    walk("", config)
    return rows


def _relative_to(raw: dict[str, Any], base: Path | None) -> None:
    """Files a run file names (its network, its weights) are relative to the run file; made
    absolute, so the run's config.yaml names them from any directory (--resume, config)."""
    model = raw.get("model")
    if isinstance(model, str):
        raw["model"] = _file_at(model, base)
    elif isinstance(model, dict):
        for key in ("network", "weights"):
            if isinstance(model.get(key), str):
                model[key] = _file_at(model[key], base)


def _file_at(name: str, base: Path | None) -> str:
    """`name` made absolute where it is a file beside the run file (`base`), else in the
    working directory (the command line's: `base` None); as it is otherwise (a zoo name)."""
    from cnnkit.zoo import zoo_name

    if zoo_name(name):
        return name
    for place in ([base] if base is not None else []) + [Path.cwd()]:
        if (place / name).is_file():
            return os.path.abspath(place / name)
    return name


def source_follows_path(raw: dict[str, Any], overrides: list[str] | None,
                        resumed: bool = False) -> list[str]:  # fmt: skip
    """`data.path=PACK` given on the command line to a run of a folder (a run directory's
    config.yaml names its source): the source is the pack, and the folder's own fields (its
    size, resize_mode, interpolation) are left behind, unless `data.source` is given too;
    given on the command line too, they stay, for validation to refuse as a pack's run does.
    A `resumed` run keeps its normalisation (a folder's statistics left out are ImageNet's, a
    pack's its own). Returns notes where the pack's images were resized otherwise than the
    run's folder said. (A folder given to a pack's run is said, with how to pack it or train
    from it: a pack's settings, such as its mean image, need not fit a folder.)"""
    keys = {item.split("=", 1)[0].strip() for item in overrides or []}
    data = raw.get("data")
    if "data.path" not in keys or "data.source" in keys or not isinstance(data, dict):
        return []
    if (
        data.get("source") != "folder"
        or not isinstance(data.get("path"), str)
        or not is_pack(data["path"])
    ):
        return []
    given = {k.removeprefix("data.") for k in keys}
    val = data.get("val_path")
    if isinstance(val, str) and "val_path" not in given and not is_pack(val):
        raise ConfigError(f"data.path={data['path']} is a pack, data.val_path {val} the folder "
                          "the run held out: give data.val_path=VALPACK (that folder packed as "
                          "the training set was), or data.val_path=null to hold out part of "
                          "the pack")  # fmt: skip
    fields = SOURCES["packed"].model_fields
    moved = {k: v for k, v in data.items() if k in fields or k in given} | {"source": "packed"}
    for name, imagenet in (("mean", IMAGENET_MEAN), ("std", IMAGENET_STD)):
        if resumed and moved.get(name) is None:  # (=null too: the folder's meaning of it)
            moved[name] = list(imagenet)
    raw["data"] = moved
    return _resized_otherwise(data, data["path"])


def _resized_otherwise(folder: dict[str, Any], pack: str) -> list[str]:
    """A note where pack's images were resized otherwise than `folder` (a data section) says
    its images were: its size, resize mode or filter."""
    try:
        meta = read_meta(pack)
    except DataError:
        return []  # (said where the run opens it)
    made = {"size": meta.get("size"), "resize_mode": meta.get("resize"),
            "interpolation": meta.get("interpolation", "bilinear")}  # fmt: skip
    said = {k: folder[k] for k in made if folder.get(k) is not None}
    differ = [k for k in said if said[k] != made[k]]
    if not differ:
        return []
    value = {**said, "resize_mode": RESIZE_FLAG.get(said.get("resize_mode"), "")}
    return [f"data.path {pack}: its images were packed with "
            + ", ".join(f"{k} {made[k]}" for k in differ) + ", the run's folder read them with "
            + ", ".join(f"{k} {said[k]}" for k in differ) + " (cnnkit pack "
            + " ".join(f"{PACK_FLAGS[k]} {value[k]}" for k in differ) + " packs them as it did)"]  # fmt: skip


def _folder_as_written(raw: dict[str, Any]) -> None:
    """A run file's folder, its source left out (read as a folder: check_source), named
    `source: folder` before `data.path=PACK` replaces it: the run then moves to the pack
    (source_follows_path) as one that says `source: folder` does, not refused field by field."""
    data = raw.get("data")
    if isinstance(data, dict) and data.get("source") is None and isinstance(data.get("path"), str):
        with suppress(ConfigError):  # (a misspelt `sorce:` is said when the run is validated)
            if check_source(data).get("source") == "folder":
                data["source"] = "folder"


def _source_of_path(raw: dict[str, Any]) -> None:
    """A data section's source, where a path says it (check_source), written into the run: every
    message about its fields then names that source's (did you mean, another source's)."""
    data = raw.get("data")
    if isinstance(data, dict) and data.get("source") is None:
        with suppress(ConfigError):  # (said when the run is validated)
            data["source"] = check_source(data).get("source")


def _crop_for_network(raw: dict[str, Any]) -> None:
    """An image set's crop left out is the network's input side, as timm takes a model's input
    size (resnet18 on a folder: 224, not AlexNet's 227); a folder's size left out with it is
    what keeps torchvision's 224 of 256: the crop's 8/7, or 256 where the crop is 7/8 of it or
    more. A bad section or network is left as it is, for validation to name."""
    data = raw.get("data")
    if not isinstance(data, dict) or "crop" in data:
        return
    named = data.get("source")  # (_source_of_path's, where a path gave it)
    source = SOURCES.get(named) if isinstance(named, str) else None
    try:
        shape = ModelConfig.model_validate(raw.get("model")).spec().get("input")
    except (ConfigError, ValidationError, TypeError, ValueError):
        return
    if source is None or "crop" not in source.model_fields or not isinstance(shape, list):
        return
    if len(shape) != 3 or shape[1] != shape[2] or not isinstance(shape[1], int) or shape[1] < 1:
        return  # (not a square image: the mismatch is named when the network is built)
    side = shape[1]
    if side == source.model_fields["crop"].default:
        return
    data["crop"] = side
    if "size" in source.model_fields and "size" not in data:
        size = source.model_fields["size"].default  # 256 for crops of 224 to 256
        data["size"] = (
            size if side <= size <= round(side * 8 / 7) else max(resized_side(side), side)
        )


DATA_FILES = ("path", "val_path", "val_labels", "negatives")  # a data section's files


def absolute_data(raw: dict[str, Any]) -> None:
    """The data's folders and files (relative to the working directory, as given) made
    absolute: config.yaml is the resolved run, read again from anywhere."""
    data = raw.get("data")
    if isinstance(data, dict):
        for key in DATA_FILES:
            if isinstance(data.get(key), str) and data[key]:
                data[key] = os.path.abspath(data[key])


def validate_run(raw: dict[str, Any]) -> RunConfig:
    """Validate a run mapping; the first problem becomes one ConfigError naming the field (and,
    for a mistyped one, the field meant)."""
    empty = {s: {} for s in MAPPING_SECTIONS if s in raw and raw[s] is None}  # `train:` alone
    try:
        return RunConfig.model_validate({**raw, **empty})
    except ValidationError as e:
        error = config_error(e, hide=SOURCES)
        unknown = next((x for x in e.errors() if x["type"] == "extra_forbidden"), None)
        if unknown is not None and str(error).endswith("unknown field"):
            error = ConfigError(f"{error}{did_you_mean(unknown['loc'], raw)}")
        elif str(error).startswith("data.") and (foreign := other_sources_fields(raw)):
            source, are = raw["data"]["source"], "is not a setting" if len(foreign) == 1 else (
                "are not settings")  # fmt: skip
            error = ConfigError(f"{error} (this data: section was written for another source: "
                                f"{meant_otherwise(raw, str(error))}{', '.join(foreign)} {are} "
                                f"of {source}, and =null leaves each out; or start from a run "
                                f"file written for {source} data)")  # fmt: skip
        elif str(error) == "data: Field required" and isinstance(raw.get("model"), dict):
            error = ConfigError(f"{error} (a network file? a run file names it as model: FILE "
                                "beside data: and train:; `cnnkit info FILE` reads a network)")  # fmt: skip
        elif str(error) == "data: Field required":
            error = ConfigError(f"{error} (a run file's data: names its source: one of "
                                f"{', '.join(SOURCES)})")  # fmt: skip
        raise error from None


# a run's sections that only a mapping sets (model: a name too); `train:` alone: its defaults
MAPPING_SECTIONS = ("data", "train")


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in a nested mapping; the value is parsed as YAML (numbers, lists...)."""
    key, sep, text = item.partition("=")
    dotted = sep and re.fullmatch(r"[A-Za-z_]\w*(\.\w+)*", key)
    index = re.search(r"\.\d", key) if dotted else None  # train.milestones.0=3
    if index:
        whole = key[: index.start()]
        raise ConfigError(f"override {item!r}: list items cannot be set one by one: give the "
                          f"whole list, e.g. {whole}=[...]")  # fmt: skip
    if item[:1] in ("+", "~"):  # Hydra's add (+, ++) and delete (~)
        bare = item.lstrip("+~").partition("=")[0]
        raise ConfigError(f"override {item!r}: Hydra's + and ~ are not used here: {bare}=VALUE "
                          f"sets it, whether the run file gives it or not (left out, a setting "
                          f"has its default: `cnnkit config RUN` lists them)")  # fmt: skip
    if not sep or not key or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", key):
        underscored = key.replace("-", "_")
        if sep and "-" in key and re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", underscored):
            raise ConfigError(f"override {item!r}: settings take underscores where "
                              f"command-line flags take dashes: {underscored}={text}")  # fmt: skip
        raise ConfigError(f"override {item!r}: expected key=value, e.g. train.lr=0.02")
    if not text.strip():  # `data.path=$DATA` with DATA unset: never a value (null unsets one)
        raise ConfigError(f"override {item!r}: the value is empty (an unset shell variable?): "
                          f"give one, or {key}=null for none")  # fmt: skip
    try:
        value = load_yaml(text)
    except yaml.YAMLError:
        value = text
    node = raw
    *parents, leaf = key.split(".")
    if not parents and leaf in MAPPING_SECTIONS and not isinstance(value, dict):
        raise ConfigError(f"override {item!r}: {leaf} is a section: set its settings one by "
                          f"one ({leaf}.KEY=VALUE)")  # fmt: skip
    for part in parents:
        if node is raw and part in MAPPING_SECTIONS and node.get(part) is None:
            node[part] = {}  # `train:` with nothing under it: the section's defaults
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
        node = child
    if _merges(node.get(leaf), value, leaf):  # `train={lr: 0.2}`: those settings, the rest kept
        node[leaf] = {**node[leaf], **value}
    else:
        node[leaf] = value


def _merges(section: Any, value: Any, name: str) -> bool:
    """Whether `name={...}` on the command line sets those settings of a section, keeping its
    others (it replaced the whole section: a zoo run's epochs, schedule and augmentation went
    back to the defaults without a word), as OmegaConf merges; a data section given another
    source is that source's section whole (`data={source: folder, path: DIR}`)."""
    if not isinstance(section, dict) or not isinstance(value, dict):
        return False
    return not (name == "data" and "source" in value and value["source"] != section.get("source"))


def run_dict(config: RunConfig) -> dict[str, Any]:
    """The config as plain data (what config.yaml and checkpoints hold); a model section with
    no weights nor input is written as just its network, the way run files write it."""
    raw = config.model_dump(mode="json")
    if raw["model"]["input"] is None:
        del raw["model"]["input"]
    if raw["model"]["weights"] is None and "input" not in raw["model"]:
        raw["model"] = raw["model"]["network"]
    return raw


def dump_run(config: RunConfig, path: Path | None = None) -> str:
    """The resolved config as YAML (written to `path` when given)."""
    text = yaml.safe_dump(run_dict(config), sort_keys=False)
    if path is not None:
        write_atomic(Path(path), text.encode())
    return text


def _yaml_files_beside(path: Path) -> list[str]:
    """The YAML files in the folder `path` names (as `path` would be written), for a
    did-you-mean; none where the folder cannot be read."""
    try:
        return [str(path.parent / p.name) if str(path.parent) != "." else p.name
                for p in path.parent.iterdir()
                if p.suffix.lower() in (".yaml", ".yml") and p.is_file()][:1000]  # fmt: skip
    except OSError:
        return []


def _folder_given(path: Path) -> str:
    """What to say of a folder given where a run file goes: a run directory is continued with
    --resume (a new run from its settings is its config.yaml), any other is not a run file."""
    plain = str(path).isprintable() and len(str(path)) <= 120  # written as a shell takes it
    name = shlex.quote(str(path)) if plain else brief(str(path), 80)
    config = path / "config.yaml"
    anew = (f" ({shlex.quote(str(config)) if plain else 'its config.yaml'} starts a new run from "
            "its settings)") if config.is_file() else ""  # fmt: skip
    if anew or (path / "last.pt").is_file():
        return (f"{name} is a run directory, not a run file: `cnnkit train --resume {name}` "
                f"continues it{anew}")  # fmt: skip
    if holds_images(path):
        return (f"{name} is a folder of images, not a run file (a YAML file with model:, data: "
                f"and train:): `cnnkit train resnet18 data.path={name}` trains ResNet-18 on it, "
                "holding out 10% (any network `cnnkit zoo` lists; README: Data)")  # fmt: skip
    return f"{name} is a folder, not a run file (a YAML file with model:, data: and train:)"


def _read_run(run: str | Path | dict[str, Any],
              given: set[str] = frozenset()) -> tuple[dict[str, Any], Path | None]:  # fmt: skip
    """The run's mapping and the folder its files are relative to; a zoo network with data
    given (`cnnkit train resnet18 data.path=DIR`, as timm's `--model`) is a run of its own
    (`given`: the keys the overrides set)."""
    data_given = bool(given & {"data.path", "data.source"})
    if isinstance(run, dict):  # as a file would give it (a date as text, never an object)
        return plain_data(run), None
    from cnnkit.zoo import NETS, RUNS, net_path, runs_training, zoo_name

    path = Path(run)
    if not path.is_file() or zoo_name(str(run)):
        if str(run) in NETS and data_given:  # the train section's defaults
            return {"model": str(run), "data": {}}, None
        if str(run) in NETS:  # a network, not a run: say which runs train it
            data_typo(str(run), given)
            runs = runs_training(str(run))
            also = f"; zoo runs of it: {', '.join(runs)}" if runs else ""
            raise ConfigError(f"{str(run)!r} is a zoo network, not a run: give its data "
                              f"(`cnnkit train {run} data.path=DIR`: a folder of class folders "
                              f"or a pack) or a run file with model: {run}{also}")  # fmt: skip
        if str(run) not in RUNS and path.is_dir():
            raise ConfigError(_folder_given(path))
        if str(run) not in RUNS:
            files = _yaml_files_beside(path) if path.suffix.lower() in (".yaml", ".yml") else []
            raise ConfigError(f"{brief(str(run), 80)} is neither a zoo run or network ('cnnkit "
                              f"zoo' lists them) nor a run file"
                              f"{suggest(str(run), [*RUNS, *NETS, *files])}")  # fmt: skip
        path = net_path(str(run))
    data = read_yaml(path)
    if not isinstance(data, dict) or "model" not in data:
        keys = [str(k) for k in data] if isinstance(data, dict) else []
        close = difflib.get_close_matches("model", keys, n=1)
        typo = f" ({close[0]!r}: a misspelled model?)" if close else ""
        raise ConfigError(f"{path}: a run file is a mapping with model:, data: and train:{typo}")
    return data, path.parent
