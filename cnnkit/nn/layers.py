"""Layer kinds: the fields each accepts, its output shape, its torch module and its multiply-adds.

Shapes here are per sample, without the batch: (C, H, W) for images, (F,) for vectors.
Field names follow torch.nn, so a spec reads like PyTorch code.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator
from torch import nn

Shape = tuple[int, ...]
IntPair = PositiveInt | tuple[PositiveInt, PositiveInt]
NonNegPair = int | tuple[int, int]
Mult = float | dict[str, float]


class ShapeError(Exception):
    """An input shape a layer cannot take; `field` names the spec field at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def pair(value: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def need_image(shape: Shape) -> tuple[int, int, int]:
    if len(shape) != 3:
        raise ShapeError("inputs", f"needs a (C, H, W) input, got {fmt_shape(shape)}")
    return shape  # type: ignore[return-value]


def window_out(size: int, kernel: int, stride: int, pad: int, dilation: int, ceil: bool) -> int:
    """Output length of a sliding window (conv or pool) along one axis, as torch and Caffe count it."""
    span = dilation * (kernel - 1) + 1
    if span > size + 2 * pad:
        raise ShapeError(
            "kernel_size",
            f"kernel {span} is larger than its input {size}"
            + (f" (+2x{pad} padding)" if pad else ""),
        )
    steps = (size + 2 * pad - span) / stride
    out = (math.ceil(steps) if ceil else math.floor(steps)) + 1
    if ceil and (out - 1) * stride >= size + pad:  # the last window must start inside the input
        out -= 1
    if out < 1:
        raise ShapeError("kernel_size", f"output size {out} is below 1")
    return out


def fmt_shape(shape: Shape) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


class Layer(BaseModel):
    """Fields every layer has; subclasses add their own and the three methods below."""

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


class ParamLayer(Layer):
    """A layer with learnable parameters: it may set init and learning-rate / decay multipliers."""

    init: dict[str, Any] | None = None
    lr_mult: Mult | None = None
    decay_mult: Mult | None = None

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
                raise ValueError(f"names {sorted(unknown)}; this layer has {list(cls.param_names)}")
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


# --- parametric layers -------------------------------------------------------------------------


class Conv(ParamLayer):
    type: Literal["conv"]
    out_channels: PositiveInt
    kernel_size: IntPair
    stride: IntPair = 1
    padding: NonNegPair | Literal["same", "valid"] = 0
    dilation: IntPair = 1
    groups: PositiveInt = 1
    bias: bool = True
    param_names: ClassVar = ("weight", "bias")

    def output_shape(self, shapes: list[Shape]) -> Shape:
        c, h, w = need_image(shapes[0])
        if c % self.groups or self.out_channels % self.groups:
            raise ShapeError(
                "groups",
                f"groups={self.groups} must divide both in_channels={c} and out_channels={self.out_channels}",
            )
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
        return nn.Conv2d(
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


class FlatLinear(nn.Linear):
    """nn.Linear that flattens a (B, C, H, W) input first, as Caffe's InnerProduct does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(1) if x.dim() > 2 else x)


class Linear(ParamLayer):
    type: Literal["linear"]
    out_features: PositiveInt | None = Field(
        None, description="omitted: the data set's class count"
    )
    bias: bool = True
    param_names: ClassVar = ("weight", "bias")

    def output_shape(self, shapes: list[Shape]) -> Shape:
        if self.out_features is None:
            raise ShapeError("out_features", "is not set and the network has no num_classes")
        return (self.out_features,)

    def build(self, shapes: list[Shape]) -> nn.Module:
        return FlatLinear(math.prod(shapes[0]), self.out_features, self.bias)

    def macs(self, shapes: list[Shape], out: Shape) -> int:
        return math.prod(shapes[0]) * out[0]


class BatchNorm(ParamLayer):
    type: Literal["batchnorm"]
    eps: float = Field(1e-5, gt=0)
    momentum: float | None = Field(0.1, ge=0, le=1)
    affine: bool = True
    param_names: ClassVar = ("weight", "bias")

    def output_shape(self, shapes: list[Shape]) -> Shape:
        if len(shapes[0]) not in (1, 3):
            raise ShapeError("inputs", f"needs (C, H, W) or (F,), got {fmt_shape(shapes[0])}")
        return shapes[0]

    def build(self, shapes: list[Shape]) -> nn.Module:
        norm = nn.BatchNorm2d if len(shapes[0]) == 3 else nn.BatchNorm1d
        return norm(shapes[0][0], self.eps, self.momentum, self.affine)


class PReLU(ParamLayer):
    type: Literal["prelu"]
    channelwise: bool = True
    init_slope: float = 0.25
    param_names: ClassVar = ("weight",)

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.PReLU(shapes[0][0] if self.channelwise else 1, self.init_slope)


# --- windows -----------------------------------------------------------------------------------


class _Pool(Layer):
    kernel_size: IntPair
    stride: IntPair | None = Field(None, description="default: kernel_size")
    padding: NonNegPair = 0
    ceil_mode: bool = Field(False, description="Caffe's rounding of the output size")

    def output_shape(self, shapes: list[Shape]) -> Shape:
        c, h, w = need_image(shapes[0])
        (kh, kw), (ph, pw) = pair(self.kernel_size), pair(self.padding)
        sh, sw = pair(self.stride or self.kernel_size)
        if ph > kh // 2 or pw > kw // 2:
            raise ShapeError("padding", "must be at most half of kernel_size")
        ceil = self.ceil_mode
        return (c, window_out(h, kh, sh, ph, 1, ceil), window_out(w, kw, sw, pw, 1, ceil))


class MaxPool(_Pool):
    type: Literal["maxpool"]

    def build(self, shapes: list[Shape]) -> nn.Module:
        stride = pair(self.stride or self.kernel_size)
        return nn.MaxPool2d(
            pair(self.kernel_size), stride, pair(self.padding), ceil_mode=self.ceil_mode
        )


class AvgPool(_Pool):
    type: Literal["avgpool"]
    count_include_pad: bool = True

    def build(self, shapes: list[Shape]) -> nn.Module:
        stride = pair(self.stride or self.kernel_size)
        return nn.AvgPool2d(
            pair(self.kernel_size),
            stride,
            pair(self.padding),
            self.ceil_mode,
            self.count_include_pad,
        )


class AdaptiveAvgPool(Layer):
    type: Literal["adaptive_avgpool"]
    output_size: IntPair

    def output_shape(self, shapes: list[Shape]) -> Shape:
        c, _, _ = need_image(shapes[0])
        return (c, *pair(self.output_size))

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.AdaptiveAvgPool2d(pair(self.output_size))


class GlobalAvgPool(Layer):
    """Mean over H and W: (C, H, W) -> (C,)."""

    type: Literal["global_avgpool"]

    def output_shape(self, shapes: list[Shape]) -> Shape:
        return (need_image(shapes[0])[0],)

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1))


class LRN(Layer):
    """Local response normalisation across channels, in either of the two published conventions.

    paper (Krizhevsky 2012): b = a / (k + alpha * sum(a^2))^beta
    caffe (and torch.nn):   b = a / (k + alpha / size * sum(a^2))^beta
    """

    type: Literal["lrn"]
    convention: Literal["paper", "caffe"]
    size: PositiveInt = 5
    alpha: float = Field(1e-4, ge=0)
    beta: float = 0.75
    k: float | None = Field(None, description="default: 2 for paper, 1 for caffe")

    def output_shape(self, shapes: list[Shape]) -> Shape:
        return need_image(shapes[0])

    def build(self, shapes: list[Shape]) -> nn.Module:
        k = self.k if self.k is not None else (2.0 if self.convention == "paper" else 1.0)
        alpha = self.alpha * self.size if self.convention == "paper" else self.alpha
        return nn.LocalResponseNorm(self.size, alpha, self.beta, k)


# --- torch modules of our own ----------------------------------------------------------------


class ScaledTanh(nn.Module):
    """LeCun's tanh: 1.7159 * tanh(2/3 x), unit gain around zero."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1.7159 * torch.tanh(x * (2.0 / 3.0))
