"""The run file's sections as typed, validated models: RunConfig (name, seed, determinism) with
ModelConfig and TrainConfig (the data section is the source's own DataConfig), and the notes on
schedule settings a run never reaches or its schedule never reads."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    field_validator,
    model_validator,
)

from cnnkit.data import DataConfig, check_source
from cnnkit.data.base import Section
from cnnkit.errors import brief, plural
from cnnkit.nn import read_spec, with_input
from cnnkit.nn.spec import Described

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
    weight_decay: NonNegativeFloat = Field(
        5e-4,
        description="L2 decay; decoupled with adamw, as torch's AdamW (torch's default "
        "there: 1e-2) (layers scale: decay_mult)",
    )
    norm_weight_decay: NonNegativeFloat | None = Field(
        None, description="normalisation layers' decay in place of weight_decay (0: timm's "
        "default; torchvision's --norm-weight-decay)",
    )  # fmt: skip
    bias_weight_decay: NonNegativeFloat | None = Field(
        None, description="every bias's decay in place of weight_decay (torchvision's "
        "--bias-weight-decay)",
    )  # fmt: skip
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

    @field_validator("milestones", mode="before")
    @classmethod
    def _milestones_as_a_list(cls, value: Any) -> Any:
        """torchvision's `--lr-steps 30 60` habit, `train.milestones=30,60`: how to give them."""
        one = isinstance(value, int) and not isinstance(value, bool)  # (=30: YAML's number)
        if one or isinstance(value, str) and re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", value):
            epochs = ",".join(str(value).replace(" ", "").split(","))
            raise ValueError(f"give the epochs as a list: train.milestones=[{epochs}] (got "
                             f"{value!r})")  # fmt: skip
        return value

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


# the settings each schedule reads (warm-up aside: every schedule has it)
SCHEDULE_SETTINGS: dict[str, tuple[str, ...]] = {
    "constant": (),
    "step": ("step_size", "gamma"),
    "multistep": ("milestones", "gamma"),
    "plateau": ("patience", "threshold", "gamma", "min_lr"),
    "cosine": ("min_lr",),
}

# the settings each optimizer reads beside lr and weight_decay (Adam's betas do momentum's job)
OPTIMIZER_SETTINGS: dict[str, tuple[str, ...]] = {
    "sgd": ("momentum",),
    "nesterov": ("momentum",),
    "adam": ("betas",),
    "adamw": ("betas",),
}


def train_notes(train: TrainConfig) -> list[str]:
    """Schedule and optimizer settings the run never uses: given to a schedule or optimizer
    that does not read them (a torchvision user's step_size under the default schedule, Adam
    given momentum), or never reached in this many epochs (a forgotten override, or a short
    trial of a long recipe): said, not refused."""
    unused = [_unused_settings(train, "schedule", SCHEDULE_SETTINGS),
              _unused_settings(train, "optimizer", OPTIMIZER_SETTINGS)]  # fmt: skip
    notes, epochs = [note for note in unused if note], train.epochs
    counted = plural(epochs, "epoch")
    if train.warmup_epochs >= epochs:
        notes.append(f"train.warmup_epochs {train.warmup_epochs:g} of {counted}: the lr "
                     f"never reaches train.lr {train.lr:g}")  # fmt: skip
    if train.schedule == "step" and train.step_size >= epochs:
        notes.append(f"train.step_size {train.step_size} of {counted}: the lr never drops")
    late = [m for m in train.milestones if m >= epochs] if train.schedule == "multistep" else []
    if late:
        notes.append(f"train.milestones {late} at or past the last epoch ({epochs}): no drop there")
    return notes + (_milestone_notes(train.milestones) if train.schedule == "multistep" else [])


def _milestone_notes(milestones: list[int]) -> list[str]:
    """Repeated or unsorted milestones, which torch's MultiStepLR takes (as our schedule does):
    what it will do with them."""
    notes = []
    repeated = sorted({m for m in milestones if milestones.count(m) > 1})
    for m in repeated:
        times = milestones.count(m)
        notes.append(f"train.milestones {milestones}: {m} is given {times} times: the lr "
                     f"drops by gamma**{times} at once there, as torch's MultiStepLR does")  # fmt: skip
    if milestones != sorted(milestones):
        notes.append(f"train.milestones {milestones} are not in increasing order: the lr drops "
                     f"at each all the same (at {sorted(milestones)}), as torch's MultiStepLR "
                     "counts them in any order")  # fmt: skip
    return notes


def _unused_settings(train: TrainConfig, kind: str,
                     reads: dict[str, tuple[str, ...]]) -> str | None:  # fmt: skip
    """Which given settings the run's schedule or optimizer (`kind`, `reads`: what each one
    reads) does not read, and the train.KIND that would. A resolved config (config.yaml, a
    checkpoint's) gives every field: there only those off their default count as given."""
    chosen, fields = getattr(train, kind), TrainConfig.model_fields
    resolved = train.model_fields_set >= set(fields)
    unused = [f for f in fields if any(f in read for read in reads.values())
              and f not in reads[chosen] and f in train.model_fields_set and not (resolved and
              getattr(train, f) == fields[f].get_default(call_default_factory=True))]  # fmt: skip
    if not unused:
        return None
    users = [name for name, read in reads.items() if set(unused) <= set(read)]
    if users:
        would = f"train.{kind}={' or '.join(users)} would use {'them' if unused[1:] else 'it'}"
    else:  # no one schedule reads them all (step_size and milestones)
        would = "; ".join(f"train.{kind}={name} uses {', '.join(f for f in unused if f in read)}"
                          for name, read in reads.items() if any(f in read for f in unused))  # fmt: skip
    return (f"train.{kind} {chosen} does not use "
            f"{', '.join(f'train.{f}' for f in unused)} ({would})")  # fmt: skip


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
    input: list[PositiveInt] | None = Field(
        None,
        min_length=1,
        max_length=3,
        description="[C, H, W] in place of the network's own (a zoo network at the data's size)",
    )
    # where a network mapping written in a run file was read (`run.yaml: model`): its layer
    # errors name it, as a network file's name that file
    _source: str | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, str) or (isinstance(value, dict) and "network" not in value):
            return {"network": value}
        if isinstance(value, dict) and "layers" in value:  # (said for what it is, not unknown)
            raise ValueError("both network: (a network named) and layers: (a network described "
                             "here); give one of the two")  # fmt: skip
        if isinstance(value, dict) and "classes" in value:  # (a network file's own are kept)
            raise ValueError("classes names a network's outputs for classify, eval and "
                             "export; training takes the data's classes (leave it out of a "
                             "run file)")  # fmt: skip
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
        """The network's `model:` mapping (what the graph builder reads), with `input`."""
        network = self.network
        if isinstance(network, dict) and self._source is not None:
            network = Described(network)
            network.source = self._source
        spec = read_spec(network)
        return spec if self.input is None else with_input(spec, self.input)


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
    # what loading it had to say (a folder's run moved to a pack): `cnnkit train` prints them
    _notes: list[str] = PrivateAttr(default_factory=list)

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
