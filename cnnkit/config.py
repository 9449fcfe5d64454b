"""The run configuration: a typed, validated `model:` + `data:` + `train:` document.

`load_run(run, overrides)` reads a zoo run name or YAML file, applies dotted overrides
(`train.lr=0.02 data.batch_size=128`) and validates every field once: `config.data` is the
source's own config (DataConfig), `config.model` a ModelConfig. `dump_run` writes it back.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from cnnkit.data import SOURCES, DataConfig, check_source
from cnnkit.data.base import Section
from cnnkit.errors import ConfigError, brief, config_error
from cnnkit.nn import read_spec
from cnnkit.nn.spec import suggest
from cnnkit.nn.yamlio import load_yaml, plain_data, read_yaml
from cnnkit.runtime import write_atomic

DEVICE_RE = re.compile(r"auto|cpu|cuda|cuda:\d+|mps")  # fullmatch ($ passes "cpu\n")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")


class TrainConfig(Section):
    """The `train:` section: optimisation, schedule, precision, checkpoints."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    epochs: PositiveInt = Field(10, description="passes over the training set")
    optimizer: Literal["sgd", "nesterov", "adam", "adamw"] = Field(
        "sgd", description="sgd | nesterov (SGD with Nesterov momentum) | adam | adamw"
    )
    lr: PositiveFloat = Field(0.01, description="base learning rate (layers scale it by lr_mult)")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum")
    weight_decay: NonNegativeFloat = Field(5e-4, description="L2 decay (layers scale: decay_mult)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam/AdamW betas")
    schedule: Literal["constant", "step", "multistep", "plateau", "cosine"] = Field(
        "constant",
        description="learning-rate schedule: constant | step | multistep | plateau | cosine",
    )
    step_size: PositiveInt = Field(30, description="step: epochs between lr drops")
    milestones: list[PositiveInt] = Field(default_factory=list, description="multistep: epochs")
    gamma: float = Field(0.1, gt=0.0, le=1.0, description="lr factor at each drop")
    patience: NonNegativeInt = Field(2, description="plateau: epochs without val-error gain")
    threshold: NonNegativeFloat = Field(1e-4, description="plateau: relative improvement needed")
    min_lr: NonNegativeFloat = Field(0.0, description="cosine / plateau floor")
    warmup_epochs: NonNegativeFloat = Field(
        0.0,
        description="linear warm-up length (epochs); it multiplies the schedule's lr, set "
        "every step (timm's shape: cosine spans all epochs, warm-up included)",
    )
    warmup_start: float = Field(0.1, gt=0.0, le=1.0, description="warm-up starts at lr * this")
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0, description="target smoothing (0.1 usual)")
    class_weights: Literal["none", "balanced"] = Field(
        "none", description="balanced: each class weighs the same in the loss (mined negatives)"
    )
    grad_clip: PositiveFloat | None = Field(None, description="max global gradient norm")
    ema: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="decay of an average of the weights at every optimizer step (timm's "
        "meaning, not torchvision's rescaled one), evaluated and saved too (0: off)",
    )
    early_stop: NonNegativeInt = Field(
        0, description="stop after this many epochs without a held-out top-1 gain (0: off)"
    )
    accumulate: PositiveInt = Field(1, description="micro-batches per optimizer step")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto: the fastest measured here (fp16 only on CUDA)"
    )
    channels_last: bool | Literal["auto"] | None = Field(
        None, description="null or auto: the faster one measured"
    )
    threads: PositiveInt | None = Field(None, description="CPU threads (null: the faster measured)")
    calibrate: bool = Field(
        True, description="auto settings by a short timing on this machine, cached (false: rules)"
    )
    compile: bool = Field(False, description="torch.compile the model")
    checkpoint_every: NonNegativeInt = Field(
        0, description="also save last.pt every N steps (0: off)"
    )
    checkpoint_minutes: NonNegativeFloat = Field(
        5.0, le=1e6, description="also save last.pt about every M minutes mid-epoch (0: off)"
    )
    sync: Literal["ddp", "average"] = Field("ddp", description="multi-process: grads or weights")
    average_every: PositiveInt = Field(1, description="sync: average: steps between averaging")
    sync_bn: bool = Field(False, description="SyncBatchNorm under DDP")
    timeout_s: PositiveInt = Field(600, description="collective timeout (distributed)")

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if not DEVICE_RE.fullmatch(v):
            raise ValueError(f"{v!r} is not one of auto, cpu, cuda, cuda:N")
        return v

    @field_validator("betas")
    @classmethod
    def _check_betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v

    @model_validator(mode="after")
    def _check_schedule(self) -> TrainConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr {self.min_lr} is above lr {self.lr}")
        if self.schedule == "multistep" and not self.milestones:
            raise ValueError("schedule multistep needs train.milestones (epochs)")
        if self.precision == "fp16" and self.device == "cpu":
            raise ValueError("precision fp16 needs CUDA (use bf16 on CPU)")
        if self.optimizer == "nesterov" and self.momentum == 0:
            raise ValueError("optimizer nesterov needs momentum > 0 (or optimizer sgd)")
        if self.channels_last == "auto":  # as precision is written; None from here on
            self.channels_last = None
        return self


def schedule_notes(train: TrainConfig) -> list[str]:
    """Schedule settings this many epochs never reach (a forgotten override, or a short trial of
    a long recipe): said, not refused."""
    notes, epochs = [], train.epochs
    if train.warmup_epochs >= epochs:
        notes.append(f"train.warmup_epochs {train.warmup_epochs:g} of {epochs} epochs: the lr "
                     f"never reaches train.lr {train.lr:g}")  # fmt: skip
    if train.schedule == "step" and train.step_size >= epochs:
        notes.append(f"train.step_size {train.step_size} of {epochs} epochs: the lr never drops")
    late = [m for m in train.milestones if m >= epochs] if train.schedule == "multistep" else []
    if late:
        notes.append(f"train.milestones {late} at or past the last epoch ({epochs}): no drop there")
    return notes


class ModelConfig(Section):
    """The `model:` section: which network, and optionally weights to start from.

    A run file may write just the network: `model: resnet18`, `model: net.yaml`, or the
    network mapping itself (`model: {input: ..., layers: ...}`).
    """

    model_config = ConfigDict(extra="forbid")
    network: str | dict[str, Any] = Field(
        description="a zoo network, a network file, or the network mapping itself"
    )
    weights: str | None = Field(
        None, description="a state_dict file (.safetensors or .pt) to start from (fine-tuning)"
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, str) or (isinstance(value, dict) and "network" not in value):
            return {"network": value}
        return value

    @field_validator("network")
    @classmethod
    def _readable(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        read_spec(value)  # a missing file or a zoo typo is reported here, before any work
        return value

    @field_validator("weights")
    @classmethod
    def _weights_file(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_file():
            raise ValueError(f"{brief(value)}: no such weights file")
        return value

    def spec(self) -> dict[str, Any]:
        """The network's `model:` mapping (what the graph builder reads)."""
        return read_spec(self.network)


class RunConfig(Section):
    """A whole run: which network, which data, how to train; seed and determinism."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field("run", description="run name (default run directory runs/<name>-<time>)")
    model: ModelConfig = Field(description="the network (a zoo name, a file or a mapping)")
    data: DataConfig = Field(description="the data: its `source` says which fields it has")
    train: TrainConfig = Field(default_factory=TrainConfig)
    seed: NonNegativeInt = Field(
        0, lt=2**63, description="seeds weights, data order and augmentation (63 bits)"
    )
    deterministic: bool = Field(False, description="bitwise repeatable CPU runs (slower)")

    @field_validator("data", mode="before")
    @classmethod
    def _known_source(cls, value: Any) -> Any:
        return check_source(value)

    @field_validator("name", mode="before")
    @classmethod
    def _number_as_name(cls, value: Any) -> Any:  # `name=2024`: YAML reads a number
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not NAME_RE.fullmatch(value):
            raise ValueError(
                "use letters, digits and . _ + - (it names a folder under runs/), "
                f"got {brief(value)}"
            )
        return value


def load_run(run: str | Path | dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """Read a zoo run, YAML file or dict, apply `key=value` overrides, validate everything."""
    raw, base = _read_run(run)
    raw = copy.deepcopy(raw)
    if isinstance(raw.get("model"), str) and any(o.startswith("model.") for o in overrides or []):
        raw["model"] = {"network": raw["model"]}  # model.weights=... on `model: resnet50`
    for item in overrides or []:
        apply_override(raw, item)
    _relative_to(raw, base)
    absolute_data(raw)
    stem = Path(str(run)).stem if not isinstance(run, dict) else "run"
    raw.setdefault("name", re.sub(r"[^A-Za-z0-9._+-]+", "-", stem).strip("-.") or "run")
    config = validate_run(raw)
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
    working directory; as it is otherwise (a zoo name)."""
    for place in ([base] if base is not None else []) + [Path.cwd()]:
        if (place / name).is_file():
            return os.path.abspath(place / name)
    return name


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
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        error = config_error(e, hide=SOURCES)
        unknown = next((x for x in e.errors() if x["type"] == "extra_forbidden"), None)
        if unknown is not None and str(error).endswith("unknown field"):
            error = ConfigError(f"{error}{_did_you_mean(unknown['loc'], raw)}")
        elif str(error).startswith("data.") and (foreign := _other_sources_fields(raw)):
            source, are = raw["data"]["source"], "is not a setting" if len(foreign) == 1 else (
                "are not settings")  # fmt: skip
            error = ConfigError(f"{error} (this data: section was written for another source: "
                                f"{', '.join(foreign)} {are} of {source}; start from a run file "
                                f"written for {source} data)")  # fmt: skip
        elif str(error) == "data: Field required" and isinstance(raw.get("model"), dict):
            error = ConfigError(f"{error} (a network file? a run file names it as model: FILE "
                                "beside data: and train:; `cnnkit info FILE` reads a network)")  # fmt: skip
        elif str(error) == "data: Field required":
            error = ConfigError(f"{error} (a run file's data: names its source: one of "
                                f"{', '.join(SOURCES)})")  # fmt: skip
        raise error from None


def _other_sources_fields(raw: dict[str, Any]) -> list[str]:
    """The fields of a run's data: section that its source lacks and another source has
    (data.source=packed given to a run written for digits: shift, rotate), as data.NAME."""
    data = raw.get("data")
    kind = SOURCES.get(data.get("source")) if isinstance(data, dict) else None
    if kind is None:
        return []
    others = {f for name, other in SOURCES.items() if other is not kind for f in other.model_fields}
    return [f"data.{k}" for k in data if k not in kind.model_fields and k in others]


def _did_you_mean(loc: tuple, raw: dict[str, Any]) -> str:
    """` (did you mean 'lr'?)` for a mistyped field, from the fields of its section."""
    section: type[BaseModel] = RunConfig
    parts = [str(p) for p in loc if str(p) not in SOURCES]
    for part in parts[:-1]:
        if part == "data" and isinstance(raw.get("data"), dict):
            section = SOURCES.get(raw["data"].get("source"), section)
            continue
        annotation = section.model_fields.get(part)
        kind = getattr(annotation, "annotation", None)
        section = kind if isinstance(kind, type) and issubclass(kind, BaseModel) else section
    close = difflib.get_close_matches(parts[-1], list(section.model_fields), n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    elsewhere = {"": RunConfig, "train.": TrainConfig, "model.": ModelConfig,
                 "data.": SOURCES.get(data.get("source"), RunConfig)}  # fmt: skip
    for prefix, other in elsewhere.items():
        if other is not section and parts[-1] in other.model_fields:
            where = "at the top level" if not prefix else f"in {prefix[:-1]}"
            return f" (it belongs {where}: {prefix}{parts[-1]})"
    owners = [name for name, kind in SOURCES.items() if parts[-1] in kind.model_fields]
    if parts[:1] == ["data"] and owners and data.get("source") in SOURCES:
        return (f" (a setting of data.source {' / '.join(owners)}, not {data['source']}: start "
                f"from a run file written for {data['source']} data)")  # fmt: skip
    return ""


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in a nested mapping; the value is parsed as YAML (numbers, lists...)."""
    key, sep, text = item.partition("=")
    if not sep or not key or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", key):
        raise ConfigError(f"override {item!r}: expected key=value, e.g. train.lr=0.02")
    try:
        value = load_yaml(text) if text else ""
    except yaml.YAMLError:
        value = text
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
        node = child
    node[leaf] = value


def run_dict(config: RunConfig) -> dict[str, Any]:
    """The config as plain data (what config.yaml and checkpoints hold); a model section with
    no weights is written as just its network, the way run files write it."""
    raw = config.model_dump(mode="json")
    if raw["model"]["weights"] is None:
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
                for p in path.parent.iterdir() if p.suffix.lower() in (".yaml", ".yml")][:1000]  # fmt: skip
    except OSError:
        return []


def _read_run(run: str | Path | dict[str, Any]) -> tuple[dict[str, Any], Path | None]:
    if isinstance(run, dict):  # as a file would give it (a date as text, never an object)
        return plain_data(run), None
    from cnnkit.zoo import NETS, RUNS, net_path, runs_training

    path = Path(run)
    if not path.is_file():
        if str(run) in NETS:  # a network, not a run: say which runs train it
            runs = runs_training(str(run))
            also = f" (zoo runs of it: {', '.join(runs)})" if runs else ""
            raise ConfigError(f"{str(run)!r} is a zoo network, not a run: give a run file "
                              f"with model: {run}{also}")  # fmt: skip
        if str(run) not in RUNS:
            files = _yaml_files_beside(path) if path.suffix.lower() in (".yaml", ".yml") else []
            raise ConfigError(f"{brief(str(run), 80)} is neither a zoo run ('cnnkit zoo' lists "
                              f"them) nor a run file{suggest(str(run), [*RUNS, *NETS, *files])}")  # fmt: skip
        path = net_path(str(run))
    data = read_yaml(path)
    if not isinstance(data, dict) or "model" not in data:
        keys = [str(k) for k in data] if isinstance(data, dict) else []
        close = difflib.get_close_matches("model", keys, n=1)
        typo = f" ({close[0]!r}: a misspelled model?)" if close else ""
        raise ConfigError(f"{path}: a run file is a mapping with model:, data: and train:{typo}")
    return data, path.parent
