"""Layer kinds with parameters (conv, linear, norms, PReLU, scale) and what every kind shares:
the fields it accepts, its output shape, its torch module, its parameter count and its
multiply-adds. Pooling and LRN are in windows.py, the rest in pointwise.py.

Shapes here are per sample, without the batch: (C, H, W) for images, (F,) for vectors.
Field names follow torch.nn, so a spec reads like PyTorch code. Numbers are strict: `true` or
`1e30` where a count belongs is an error, never a silent conversion.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
)
from torch import nn

from cnnkit.errors import brief
from cnnkit.nn.init import FLOAT32_MAX
from cnnkit.nn.kernels import Conv2d
from cnnkit.nn.modules import (
    ChannelLayerNorm,
    ChannelLinear,
    ChannelScale,
    FlatLinear,
    ScaledTanh,  # noqa: F401  (re-exported: infer/detect.py)
)

MAX_DIM = 2**31 - 1


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("Input should be a number, not true or false")
    return value


Count = Annotated[StrictInt, Field(gt=0, le=MAX_DIM)]
NonNeg = Annotated[StrictInt, Field(ge=0, le=MAX_DIM)]


def _float32(value: float) -> float:
    if abs(value) > FLOAT32_MAX:
        raise ValueError(f"{value:g} is beyond float32's range (+-3.4e38)")
    return value


Real = Annotated[
    float, BeforeValidator(_no_bool), Field(allow_inf_nan=False), AfterValidator(_float32)
]
Flag = StrictBool
Shape = tuple[int, ...]
IntPair = Count | tuple[Count, Count]
NonNegPair = NonNeg | tuple[NonNeg, NonNeg]
Mult = Real | dict[str, Real]


class ShapeError(Exception):
    """An input shape a layer cannot take; `field` names the spec field at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def pair(value: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def need_image(shape: Shape) -> tuple[int, int, int]:
    if len(shape) != 3:
        flat = (" (global_avgpool and flatten give vectors: adaptive_avgpool, output_size: 1, "
                "keeps (C, 1, 1))") if len(shape) == 1 else ""  # fmt: skip
        raise ShapeError("inputs", f"needs a (C, H, W) input, got {fmt_shape(shape)}{flat}")
    return shape  # type: ignore[return-value]


def window_out(size: int, kernel: int, stride: int, pad: int, dilation: int, ceil: bool) -> int:
    """Output length of a sliding window (conv or pool) along one axis, as torch and Caffe count it."""
    span = dilation * (kernel - 1) + 1
    steps = (size + 2 * pad - span) / stride
    out = (math.ceil(steps) if ceil else math.floor(steps)) + 1
    if ceil and (out - 1) * stride >= size + pad:  # the last window must start inside the input
        out -= 1
    if span > size + 2 * pad and (not ceil or out < 1):  # ceil mode: one window may overhang
        raise ShapeError(
            "kernel_size",
            f"kernel {span} is larger than its input {size}"
            + (f" (+2x{pad} padding)" if pad else ""),
        )
    if out < 1:
        raise ShapeError("kernel_size", f"output size {out} is below 1")
    return out


def check_groups(in_channels: int, out_channels: int, groups: int) -> None:
    """A grouped (or transposed) convolution's groups must divide both channel counts."""
    if in_channels % groups or out_channels % groups:
        raise ShapeError("groups", f"groups={groups} must divide both in_channels={in_channels} "
                         f"and out_channels={out_channels}")  # fmt: skip


def fmt_shape(shape: Shape) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


class Layer(BaseModel):
    """Fields every layer has; subclasses add their own and the methods below."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    type: str
    name: str | None = None
    inputs: list[str] | None = None
    many_inputs: ClassVar[bool] = False
    param_names: ClassVar[tuple[str, ...]] = ()

    @field_validator("inputs", mode="before")
    @classmethod
    def _one_input_as_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    def output_shape(self, shapes: list[Shape]) -> Shape:
        return shapes[0]

    def build(self, shapes: list[Shape]) -> nn.Module:
        raise NotImplementedError

    def macs(self, shapes: list[Shape], out: Shape) -> int:
        return 0

    def param_count(self, shapes: list[Shape]) -> int:
        """Learnable values of the module `build` makes, counted without making it."""
        return 0


class ParamLayer(Layer):
    """A layer with learnable parameters: it may set init and learning-rate / decay multipliers."""

    init: dict[str, Any] | None = None
    lr_mult: Mult | None = None
    decay_mult: Mult | None = None

    def absent_params(self) -> set[str]:
        """Parameters of `param_names` this layer is configured without (bias: false, affine:
        false)."""
        if getattr(self, "affine", True) is False:
            return set(self.param_names)
        return {"bias"} if getattr(self, "bias", True) is False else set()

    @field_validator("init")
    @classmethod
    def _check_init(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        from cnnkit.nn.init import check_init

        return None if v is None else check_init(v, set(cls.param_names))

    @field_validator("lr_mult", "decay_mult")
    @classmethod
    def _check_mult(cls, v: Mult | None) -> Mult | None:
        if isinstance(v, dict):
            unknown = set(v) - set(cls.param_names)
            if unknown:
                raise ValueError(
                    f"names {brief(sorted(unknown))}; this layer has {list(cls.param_names)}"
                )
            if any(m < 0 for m in v.values()):
                raise ValueError("multipliers must be >= 0")
        elif v is not None and v < 0:
            raise ValueError("multipliers must be >= 0")
        return v

    def mult(self, which: Literal["lr_mult", "decay_mult"], param: str) -> float:
        value = getattr(self, which)
        if value is None:
            return 1.0
        return float(value.get(param, 1.0)) if isinstance(value, dict) else float(value)


class ConvFields(ParamLayer):
    """What a convolution and a transposed one share (torch's names)."""

    out_channels: Count
    kernel_size: IntPair
    stride: IntPair = 1
    dilation: IntPair = 1
    groups: Count = 1
    bias: Flag = True
    param_names: ClassVar[tuple[str, ...]] = ("weight", "bias")


class Conv(ConvFields):
    type: Literal["conv"]
    padding: NonNegPair | Literal["same", "valid"] = 0

    def output_shape(self, shapes: list[Shape]) -> Shape:
        c, h, w = need_image(shapes[0])
        check_groups(c, self.out_channels, self.groups)
        (kh, kw), (sh, sw), (dh, dw) = (
            pair(self.kernel_size),
            pair(self.stride),
            pair(self.dilation),
        )
        if self.padding == "same":
            if (sh, sw) != (1, 1):
                raise ShapeError("padding", "'same' padding needs stride 1")
            return (self.out_channels, h, w)
        ph, pw = (0, 0) if self.padding == "valid" else pair(self.padding)
        return (
            self.out_channels,
            window_out(h, kh, sh, ph, dh, ceil=False),
            window_out(w, kw, sw, pw, dw, ceil=False),
        )

    def build(self, shapes: list[Shape]) -> nn.Module:
        return Conv2d(
            shapes[0][0],
            self.out_channels,
            pair(self.kernel_size),
            pair(self.stride),
            self.padding if isinstance(self.padding, str) else pair(self.padding),
            pair(self.dilation),
            self.groups,
            self.bias,
        )

    def macs(self, shapes: list[Shape], out: Shape) -> int:
        kh, kw = pair(self.kernel_size)
        return math.prod(out) * (shapes[0][0] // self.groups) * kh * kw

    def param_count(self, shapes: list[Shape]) -> int:
        kh, kw = pair(self.kernel_size)
        weights = self.out_channels * (shapes[0][0] // self.groups) * kh * kw
        return weights + self.out_channels * self.bias


class Linear(ParamLayer):
    """Fully connected. It flattens a (C, H, W) input first, as Caffe's InnerProduct does; with
    `flatten: false` it maps each position's channels instead (ConvNeXt's MLP)."""

    type: Literal["linear"]
    out_features: Count | None = Field(None, description="omitted: the data set's class count")
    bias: Flag = True
    flatten: Flag = True
    param_names: ClassVar[tuple[str, ...]] = ("weight", "bias")

    def output_shape(self, shapes: list[Shape]) -> Shape:
        if self.out_features is None:
            raise ShapeError(
                "out_features",
                "is not set and the network has no num_classes (set model.num_classes: N, "
                "which classes: does not count; training takes it from the data; info, show "
                "net, export and bench take --num-classes N)",
            )
        return (self.out_features,) if self.flatten else (self.out_features, *shapes[0][1:])

    def _in_features(self, shape: Shape) -> int:
        return math.prod(shape) if self.flatten else shape[0]

    def build(self, shapes: list[Shape]) -> nn.Module:
        linear = FlatLinear if self.flatten else ChannelLinear
        return linear(self._in_features(shapes[0]), self.out_features, self.bias)

    def macs(self, shapes: list[Shape], out: Shape) -> int:
        return self._in_features(shapes[0]) * math.prod(out)

    def param_count(self, shapes: list[Shape]) -> int:
        return (self._in_features(shapes[0]) + self.bias) * (self.out_features or 0)


def _channels_or_features(shape: Shape) -> int:
    if len(shape) not in (1, 3):
        raise ShapeError("inputs", f"needs (C, H, W) or (F,), got {fmt_shape(shape)}")
    return shape[0]


class BatchNorm(ParamLayer):
    type: Literal["batchnorm"]
    eps: Real = Field(1e-5, gt=0)
    momentum: Real | None = Field(0.1, ge=0, le=1)
    affine: Flag = True
    param_names: ClassVar[tuple[str, ...]] = ("weight", "bias")

    def output_shape(self, shapes: list[Shape]) -> Shape:
        _channels_or_features(shapes[0])
        return shapes[0]

    def build(self, shapes: list[Shape]) -> nn.Module:
        norm = nn.BatchNorm2d if len(shapes[0]) == 3 else nn.BatchNorm1d
        return norm(shapes[0][0], self.eps, self.momentum, self.affine)

    def param_count(self, shapes: list[Shape]) -> int:
        return 2 * shapes[0][0] * self.affine


class LayerNorm(ParamLayer):
    """Layer norm over the channels at each position of (C, H, W) (ConvNeXt's LayerNorm2d), or
    over the features of (F,)."""

    type: Literal["layernorm"]
    eps: Real = Field(1e-5, gt=0)
    affine: Flag = True
    param_names: ClassVar[tuple[str, ...]] = ("weight", "bias")

    def output_shape(self, shapes: list[Shape]) -> Shape:
        _channels_or_features(shapes[0])
        return shapes[0]

    def build(self, shapes: list[Shape]) -> nn.Module:
        return ChannelLayerNorm(shapes[0][0], self.eps, self.affine)

    def param_count(self, shapes: list[Shape]) -> int:
        return 2 * shapes[0][0] * self.affine


class GroupNorm(ParamLayer):
    """torch's GroupNorm over (C, H, W): `num_groups` must divide the channels."""

    type: Literal["groupnorm"]
    num_groups: Count
    eps: Real = Field(1e-5, gt=0)
    affine: Flag = True
    param_names: ClassVar[tuple[str, ...]] = ("weight", "bias")

    def output_shape(self, shapes: list[Shape]) -> Shape:
        c, _, _ = need_image(shapes[0])
        if c % self.num_groups:
            raise ShapeError("num_groups", f"{self.num_groups} does not divide {c} channels")
        return shapes[0]

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.GroupNorm(self.num_groups, shapes[0][0], self.eps, self.affine)

    def param_count(self, shapes: list[Shape]) -> int:
        return 2 * shapes[0][0] * self.affine


class InstanceNorm(ParamLayer):
    """torch's InstanceNorm2d: each sample's channel over its own H x W (no running
    statistics; `affine: true` learns a scale and shift per channel)."""

    type: Literal["instancenorm"]
    eps: Real = Field(1e-5, gt=0)
    affine: Flag = False
    param_names: ClassVar[tuple[str, ...]] = ("weight", "bias")

    def output_shape(self, shapes: list[Shape]) -> Shape:
        _, h, w = need_image(shapes[0])
        if h * w < 2:
            raise ShapeError("inputs", "needs more than one value per channel (a 1 x 1 map)")
        return shapes[0]

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.InstanceNorm2d(shapes[0][0], self.eps, affine=self.affine)

    def param_count(self, shapes: list[Shape]) -> int:
        return 2 * shapes[0][0] * self.affine


class PReLU(ParamLayer):
    type: Literal["prelu"]
    channelwise: Flag = True
    init_slope: Real = 0.25
    param_names: ClassVar[tuple[str, ...]] = ("weight",)

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.PReLU(self.param_count(shapes), self.init_slope)

    def param_count(self, shapes: list[Shape]) -> int:
        return shapes[0][0] if self.channelwise else 1


class Scale(ParamLayer):
    """A learned scale per channel (ConvNeXt's layer_scale): x * weight, weight (C, 1, 1) or
    (F,), initially 1. Its state_dict key is the layer's own name (`features.1.0.layer_scale`,
    as torchvision names it), not `<name>.weight`."""

    type: Literal["scale"]
    param_names: ClassVar[tuple[str, ...]] = ("weight",)

    def output_shape(self, shapes: list[Shape]) -> Shape:
        _channels_or_features(shapes[0])
        return shapes[0]

    def build(self, shapes: list[Shape]) -> nn.Module:
        c = shapes[0][0]
        return ChannelScale((c, 1, 1) if len(shapes[0]) == 3 else (c,))

    def param_count(self, shapes: list[Shape]) -> int:
        return shapes[0][0]
