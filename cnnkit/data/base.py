"""What every data source provides: its config base class, the batch stream, the bundle, and the
preprocessing that classification must repeat; and the pydantic base of every run-file section.

Every source stores images as uint8 (C, H, W), 0-255. Normalisation happens on the device:
x = (x - mean) / std with mean and std per channel in 0-255 units.
"""

from __future__ import annotations

import itertools
import re
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

import torch
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from cnnkit.data.resize import Interpolation, ResizeSetting
from cnnkit.errors import ConfigError, validation_message


class Section(BaseModel):
    """The base of every run-file section (train, data, model, hard_negatives) and of what
    checkpoints record: numbers are numbers. Pydantic's lax mode reads `true` as 1, '3' as 3
    and 3.0 as 3, and YAML reads on / off / yes / no as booleans, so `epochs: on` would train
    one epoch without a word. A boolean where only a number goes, and text or a float where
    only a whole number goes (a field, or an item of a list or tuple of them), are refused
    naming the field; a float field still takes text, as PyYAML reads 1e-3 (no dot) as text.
    Other fields keep pydantic's own messages. (Network files get the same from their layers'
    strict types, nn/layers.py.)

    A model-level check, since a field-level one cannot sit on a discriminated union's tag;
    its error carries the field in its context, which errors.py adds to the location."""

    @model_validator(mode="before")
    @classmethod
    def _only_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key) if isinstance(key, str) else None
                wrong = _not_a_number(field.annotation, value) if field is not None else None
                if wrong is not None:
                    raise PydanticCustomError("number", wrong, {"field": key})
        return data


def _not_a_number(annotation: Any, value: Any) -> str | None:
    """Why `value` does not go where `annotation` takes only numbers (a boolean, text such as
    '3', or 3.0 where a whole number goes: pydantic's lax mode would take each), else None."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _not_a_number(args[0], value)
    if isinstance(value, (list, tuple)) and origin in (list, tuple) and args:
        variadic = origin is list or (len(args) == 2 and args[1] is Ellipsis)
        items = itertools.repeat(args[0]) if variadic else args
        found = (_not_a_number(a, v) for a, v in zip(items, value, strict=False))
        return next((why for why in found if why is not None), None)
    kinds = _kinds(annotation)
    if not kinds or bool in kinds or not kinds <= {int, float}:
        return None
    if isinstance(value, bool):
        return "Input should be a number, not true or false"
    if kinds == {int} and isinstance(value, str):  # a float field takes PyYAML's '1e-3'
        quoted = re.fullmatch(r"\s*[-+]?\d+(\.\d*)?([eE][-+]?\d+)?\s*", value)
        if quoted and quoted.group(2):  # `seed=1e3`, unquoted: PyYAML reads it as text
            return (f"Input should be a whole number, written out (YAML reads {value.strip()} "
                    "as text)")  # fmt: skip
        return "Input should be a number, not text" + (" (write it without quotes)" * bool(quoted))
    if kinds == {int} and isinstance(value, float) and value.is_integer():
        return "Input should be a whole number, not a float"  # others: pydantic's message
    return None


def _kinds(annotation: Any) -> set:
    """The scalar types a field may take (Annotated and unions unwrapped); `object` stands for
    any other (a model, a string, a literal, a container, an unresolved name)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _kinds(args[0])
    if origin is typing.Union or origin is types.UnionType:
        return set().union(*(_kinds(a) for a in args if a is not type(None)))
    return {annotation if annotation in (int, float, bool) else object}


# torchvision's reference scripts' --auto-augment names for the policies
POLICY_ALIASES = {"ra": "randaugment", "ta_wide": "trivialaugment", "imagenet": "autoaugment"}


def policy_name(value: Any) -> Any:
    """data.policy: torchvision's names as ours; timm's `rand-m9-n2...` strings refused with
    what says the same here."""
    if not isinstance(value, str):
        return value
    closest = _timm_policy(value)
    if closest:
        raise ValueError(f"{value!r} is timm's way of naming a policy; {closest}")
    return POLICY_ALIASES.get(value, value)


def _timm_policy(value: str) -> str | None:
    """What a timm augmentation string is closest to here (None: not such a string)."""
    if value.startswith("rand-"):  # timm's magnitude left out is 10 (of 10), its ops 2
        m, n = re.search(r"-m(\d+)", value), re.search(r"-n(\d+)", value)
        return (f"the closest here: data.policy=randaugment data.magnitude="
                f"{min(3 * int(m[1]) if m else 30, 30)} data.num_ops={n[1] if n else 2} "
                "(timm's magnitudes are of 10, torchvision's of 30)")  # fmt: skip
    if value.startswith("augmix-"):
        return ("the closest here: data.policy=augmix (torchvision's AugMix: severity 3, 3 "
                "chains of 1-3 ops, as timm's defaults; not set otherwise here)")  # fmt: skip
    if value.startswith(("original", "v0")):
        same = "the same ImageNet policy" if value.startswith("original") else (
            "the ImageNet policy, of which timm's v0 is EfficientNet's variant")  # fmt: skip
        return f"the closest here: data.policy=autoaugment ({same})"
    if value.startswith("3a"):
        return ("3-Augment (DeiT III: grey, solarize or blur per image) is not one here: "
                "data.policy takes randaugment | trivialaugment | autoaugment | augmix")  # fmt: skip
    return None


class DataConfigBase(Section):
    """Fields every `data:` section has; each source subclasses it with its own fields and the
    behaviour that depends on the source (how to build streams, how to evaluate)."""

    model_config = ConfigDict(extra="forbid")
    source: str = Field(
        description="where the images come from: digits | faces | synthetic | folder | packed"
    )
    batch_size: PositiveInt = Field(128, description="global batch: split across ranks")
    eval_batch_size: PositiveInt | None = Field(None, description="default: batch_size")
    policy: Annotated[
        Literal["none", "randaugment", "trivialaugment", "autoaugment", "augmix"],
        BeforeValidator(policy_name),
    ] = Field(
        "none",
        description="torchvision's RandAugment / TrivialAugment / AutoAugment (its ImageNet "
        "policy) / AugMix on the training batch (its reference scripts' ra / ta_wide / "
        "imagenet / augmix name them too)",
    )
    magnitude: int = Field(
        9, ge=0, le=30, description="RandAugment's magnitude, 0-30 (torchvision's --ra-magnitude)"
    )
    num_ops: int = Field(2, ge=1, le=10, description="RandAugment's ops per image (timm's n2)")
    erasing: float = Field(0.0, ge=0.0, le=1.0, description="random erasing: chance per image")
    mixup: float = Field(0.0, ge=0.0, description="mixup's Beta(alpha, alpha) (0: off)")
    cutmix: float = Field(0.0, ge=0.0, description="cutmix's Beta(alpha, alpha) (0: off)")

    def build(
        self,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        local_ranks: int = 1,
    ) -> DataBundle:
        """Make the train and validation streams for this rank (`local_ranks`: the ranks on this
        machine, which share its cores among their loader workers)."""
        raise NotImplementedError

    def class_names(self) -> list[str] | None:
        """The classes a run of this data trains, where they are known without reading its
        images (`cnnkit info RUN.yaml` sizes the network's head by them); None where only a
        scan would tell; DataError where the data cannot be read."""
        return None

    def training_notes(self) -> list[str]:
        """What a training run should say of these settings (given, but unused, or doing less
        than they seem), at its start: said, not refused. ConfigError for settings that would
        make its figures wrong."""
        fields = type(self).model_fields  # (a run's config.yaml holds every field: not "set")
        given = [k for k in ("magnitude", "num_ops") if getattr(self, k) != fields[k].default]
        if given and self.policy != "randaugment":
            return [f"data.{' and data.'.join(given)} not used: RandAugment's "
                    f"(data.policy: randaugment), and the policy is {self.policy}"]  # fmt: skip
        return []

    def stored_size(self) -> int | None:
        """The side of the stored images when larger than the network's crop (10-crop needs a
        margin); None for sources stored at the network's input size."""
        return None

    def evaluated_as(self, preprocess: Preprocess,
                     mean_image: torch.Tensor | None = None) -> DataConfigBase:  # fmt: skip
        """This data normalised as a checkpoint's `preprocess` (and `mean_image`, that of a
        `normalize: mean_image` run) says, evaluating a trained net; in-memory sources compute
        their statistics from the same images, so nothing changes."""
        return self

    def drawn_as(self, holdout: str | None) -> DataConfigBase:
        """This data, its held-out split drawn as a run's was (`holdout`: its checkpoint's
        holdout_id), where the data can draw it two ways: a pack holding fewer images than
        its folder (some unreadable) draws the folder's split, and the pack's own for runs
        made before it did. Itself where there is one way."""
        return self


@runtime_checkable
class Batches(Protocol):
    """A stream of batches for one rank: what the training loop and evaluation iterate.

    Yields (x, y): x float (B, C, H, W) on the device, augmented (train) and normalised;
    y int64 (B,) on the device. Iterating runs one epoch from the position set_epoch gave.
    """

    num_samples: int  # images in one epoch over all ranks (validation: each counted once)
    num_images: int  # images in the set (training: whole batches only take num_samples)

    def __len__(self) -> int: ...  # batches this rank yields per epoch

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None: ...  # seeded order; resume

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def check_room(self) -> None: ...  # DataError now where its workers' memory will not fit


MAX_SIDE = 8192  # the largest image side an evaluation may resize to (a bound, not a taste)


def resized_side(crop: int) -> int:
    """The side images are resized to before a crop of `crop` is cut: its 8/7, torchvision's
    224 of 256 (at most MAX_SIDE)."""
    return min(round(crop * 8 / 7), MAX_SIDE)


def unit_mistake(name: str, values: Sequence[float] | None) -> str | None:
    """What to say where a mean or std, given on cnnkit's 0-255 scale, has the look of
    torchvision's 0-1 values (mean [0.485, 0.456, 0.406], std [0.229, 0.224, 0.225]): a mean
    all within 0-1 but not all 0, or a std all under 1. On 0-255 pixels neither means
    anything, and both train silently on inputs off by 255x."""
    if not values:
        return None
    low = max(values) <= 1 and max(values) > 0 if name == "mean" else max(values) < 1
    if not low:
        return None
    scaled = ", ".join(f"{v * 255:g}" for v in values)
    return (
        f"[{', '.join(f'{v:g}' for v in values)}] is on a 0-1 scale; cnnkit's means and "
        f"stds are on 0-255, as pixels are: [{scaled}]"
    )


def _channel_values(values: Any, default: list[float]) -> Any:
    """A mean or std as Preprocess() takes it: None the default, a sequence (list, tuple,
    array) as a list; anything else as given, for validation (`_one_for_all`) to take or name
    (a string is no list of characters)."""
    if values is None:
        return default
    if isinstance(values, (str, bytes, dict)):
        return values
    try:
        return list(values)
    except TypeError:
        return values


class Preprocess(Section):
    """How a raw image becomes network input at evaluation time (stored in checkpoints and
    exports, and validated when read back: a tampered file cannot ask for a 60000 px resize)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)
    channels: int = Field(ge=1, le=4, description="1 (grey) or 3 (RGB)")
    crop: int = Field(ge=1, le=MAX_SIDE, description="network input height = width")
    resize: int | None = Field(None, ge=1, le=MAX_SIDE, description="resize to this first")
    resize_mode: ResizeSetting = "squash"
    interpolation: Interpolation = Field(
        "bilinear", description="the resize's filter: bilinear, or bicubic (timm's weights')"
    )
    mean: list[float] = Field(default_factory=lambda: [0.0], min_length=1, max_length=4)
    std: list[float] = Field(default_factory=lambda: [255.0], min_length=1, max_length=4)

    def __init__(self, channels: int, crop: int, resize: int | None = None,
                 resize_mode: str = "squash", mean: list[float] | None = None,
                 std: list[float] | None = None, interpolation: str = "bilinear",
                 **extra: Any) -> None:  # fmt: skip
        super().__init__(channels=channels, crop=crop, resize=resize, resize_mode=resize_mode,
                         mean=_channel_values(mean, [0.0]), std=_channel_values(std, [255.0]),
                         interpolation=interpolation, **extra)  # fmt: skip

    @classmethod
    def of_data(cls, *args: Any, **kwargs: Any) -> Preprocess:
        """Preprocess(...) as a data source makes it from its settings and statistics: one
        that is not valid is the data section's ConfigError line, not pydantic's traceback."""
        try:
            return cls(*args, **kwargs)
        except ValidationError as e:
            raise ConfigError(f"data: makes a preprocessing that is not valid: "
                              f"{validation_message(e)}") from None  # fmt: skip

    @field_validator("mean", "std", mode="before")
    @classmethod
    def _one_for_all(cls, values: Any) -> Any:
        """One number (`std: 58`) is one value for every channel, as a list of one is."""
        plain = isinstance(values, (int, float)) and not isinstance(values, bool)
        return [values] if plain else values

    @model_validator(mode="after")
    def _per_channel(self) -> Preprocess:
        for name in ("mean", "std"):
            if len(getattr(self, name)) not in (1, self.channels):
                raise ValueError(f"{name}: one value or one per channel ({self.channels})")
        if min(self.std) <= 0:
            raise ValueError("std: must be > 0")
        if self.resize is not None and self.resize < self.crop:  # a crop past the image's edge
            raise ValueError(f"resize: {self.resize} is smaller than the input ({self.crop} px), "
                             "which is cropped from the resized image")  # fmt: skip
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Preprocess:
        """Validated (pydantic's ValidationError names the bad field)."""
        if not isinstance(d, dict):
            raise ValueError(f"preprocess: expected a mapping, got {type(d).__name__}")
        return cls.model_validate(d)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 (B, C, H, W) on any device -> normalised float32 (B, C, H, W) there."""
        mean = torch.tensor(self.mean, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, -1, 1, 1)
        return (x.float() - mean) / std


@dataclass
class DataBundle:
    """The result of building a data section: streams plus what the model and checkpoint need."""

    train: Batches
    val: Batches
    classes: list[str]
    input_shape: tuple[int, int, int]  # (C, H, W) the network sees
    preprocess: Preprocess
    train_labels: torch.Tensor  # (N,) int64 on the CPU: every training image's class
    mean_image: torch.Tensor | None = None  # (C, S, S) 0-255 float: what normalize: mean_image
    #   subtracts before cropping (checkpoints keep it; `preprocess` has its channel averages)
    holdout: str | None = None  # holdout_id of a split drawn from the training images,
    #   OWN_VAL_SET where data.val_path gives the held-out images
