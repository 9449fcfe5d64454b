"""The run configuration: a typed, validated `model:` + `data:` + `train:` document.

`load_run(run, overrides)` reads a zoo run name or YAML file, applies dotted overrides
(`train.lr=0.02 data.batch_size=128`) and validates every field; `dump_run` writes it back.
"""

from __future__ import annotations

import copy
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

from cnnkit.errors import ConfigError
from cnnkit.yamlio import load_yaml, read_yaml

DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+|mps)$")


class TrainConfig(BaseModel):
    """The `train:` section: optimisation, schedule, precision, checkpoints."""

    model_config = ConfigDict(extra="forbid")
    epochs: PositiveInt = Field(10, description="passes over the training set")
    optimizer: Literal["sgd", "nesterov", "adam", "adamw"] = Field("sgd")
    lr: PositiveFloat = Field(0.01, description="base learning rate (layers scale it by lr_mult)")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum")
    weight_decay: NonNegativeFloat = Field(5e-4, description="L2 decay (layers scale: decay_mult)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam/AdamW betas")
    schedule: Literal["constant", "step", "multistep", "plateau", "cosine"] = Field("constant")
    step_size: PositiveInt = Field(30, description="step: epochs between lr drops")
    milestones: list[PositiveInt] = Field(default_factory=list, description="multistep: epochs")
    gamma: float = Field(0.1, gt=0.0, le=1.0, description="lr factor at each drop")
    patience: NonNegativeInt = Field(2, description="plateau: epochs without val-error gain")
    threshold: NonNegativeFloat = Field(1e-4, description="plateau: relative improvement needed")
    min_lr: NonNegativeFloat = Field(0.0, description="cosine / plateau floor")
    warmup_epochs: NonNegativeFloat = Field(0.0, description="linear warm-up length (epochs)")
    warmup_start: float = Field(0.1, gt=0.0, le=1.0, description="warm-up starts at lr * this")
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0)
    class_weights: Literal["none", "balanced"] = Field(
        "none", description="balanced: each class weighs the same in the loss (mined negatives)"
    )
    grad_clip: PositiveFloat | None = Field(None, description="max global gradient norm")
    accumulate: PositiveInt = Field(1, description="micro-batches per optimizer step")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field("auto")
    channels_last: bool | None = Field(None, description="None: the hardware's faster choice")
    compile: bool = Field(False, description="torch.compile the model")
    threads: PositiveInt | None = Field(None, description="CPU threads (None: 1 for small nets)")
    checkpoint_every: NonNegativeInt = Field(200, description="also save last.pt every N steps")
    sync: Literal["ddp", "average"] = Field("ddp", description="multi-process: grads or weights")
    average_every: PositiveInt = Field(1, description="sync: average: steps between averaging")
    sync_bn: bool = Field(False, description="SyncBatchNorm under DDP")
    timeout_s: PositiveInt = Field(600, description="collective timeout (distributed)")

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if not DEVICE_RE.match(v):
            raise ValueError(f"{v!r} is not one of auto, cpu, cuda, cuda:N")
        return v

    @model_validator(mode="after")
    def _check_schedule(self) -> TrainConfig:
        if self.schedule == "multistep" and not self.milestones:
            raise ValueError("schedule multistep needs train.milestones (epochs)")
        if self.precision == "fp16" and self.device == "cpu":
            raise ValueError("precision fp16 needs CUDA (use bf16 on CPU)")
        return self


class RunConfig(BaseModel):
    """A whole run: which network, which data, how to train; seed and determinism."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field("run", description="run name (default run directory runs/<name>-<time>)")
    model: str | dict[str, Any] = Field(description="a zoo network, a network file or a mapping")
    data: dict[str, Any] = Field(description="the data section; its source validates it")
    train: TrainConfig = Field(default_factory=TrainConfig)
    seed: NonNegativeInt = Field(0, description="seeds weights, data order and augmentation")
    deterministic: bool = Field(False, description="bitwise repeatable CPU runs (slower)")

    @field_validator("data")
    @classmethod
    def _check_data(cls, v: dict[str, Any]) -> dict[str, Any]:
        from cnnkit.data import data_config

        return data_config(v).model_dump(mode="json")


def load_run(run: str | Path | dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """Read a zoo run, YAML file or dict, apply `key=value` overrides, validate everything."""
    raw, base = _read_run(run)
    raw = copy.deepcopy(raw)
    for item in overrides or []:
        apply_override(raw, item)
    if isinstance(raw.get("model"), str) and base is not None:
        relative = base / raw["model"]
        if relative.is_file():
            raw["model"] = str(relative)
    raw.setdefault("name", Path(str(run)).stem if not isinstance(run, dict) else "run")
    return validate_run(raw)


def validate_run(raw: dict[str, Any]) -> RunConfig:
    """Validate a run mapping; the first problem becomes one ConfigError naming the field."""
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        raise ConfigError(f"{loc or 'run'}: {msg}" + _got(err)) from None


def _got(err: dict[str, Any]) -> str:
    if err["type"] in ("extra_forbidden", "missing", "value_error") or "input" not in err:
        return ""
    return f" (got {err['input']!r})"


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in a nested mapping; the value is parsed as YAML (numbers, lists...)."""
    key, sep, text = item.partition("=")
    if not sep or not key or not re.match(r"^[A-Za-z_][\w.]*$", key):
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


def dump_run(config: RunConfig, path: Path | None = None) -> str:
    """The resolved config as YAML (written to `path` when given)."""
    text = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    if path is not None:
        Path(path).write_text(text)
    return text


def _read_run(run: str | Path | dict[str, Any]) -> tuple[dict[str, Any], Path | None]:
    if isinstance(run, dict):
        return run, None
    from cnnkit.zoo import RUNS, net_path

    path = Path(run)
    if not path.is_file():
        if str(run) not in RUNS:
            raise ConfigError(
                f"{str(run)!r} is neither a zoo run ('cnnkit zoo' lists them) nor a run file"
            )
        path = net_path(str(run))
    try:
        data = read_yaml(path)
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the run file: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict) or "model" not in data:
        raise ConfigError(f"{path}: a run file is a mapping with model:, data: and train:")
    return data, path.parent
