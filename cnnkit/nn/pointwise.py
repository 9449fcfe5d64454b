"""Layer kinds that act element by element (activations, dropout, flatten) or merge several
inputs (add, mul, max, concat). Fields follow torch.nn; shapes are per sample, no batch."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from cnnkit.nn.layers import Layer, ScaledTanh, Shape, ShapeError, fmt_shape

# --- element-wise ------------------------------------------------------------------------------


class ReLU(Layer):
    type: Literal["relu"]

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.ReLU()


class LeakyReLU(Layer):
    type: Literal["leaky_relu"]
    negative_slope: float = 0.01

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.LeakyReLU(self.negative_slope)


class Tanh(Layer):
    type: Literal["tanh"]
    scaled: bool = Field(False, description="LeCun's 1.7159 * tanh(2/3 x)")

    def build(self, shapes: list[Shape]) -> nn.Module:
        return ScaledTanh() if self.scaled else nn.Tanh()


class Sigmoid(Layer):
    type: Literal["sigmoid"]

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.Sigmoid()


class GELU(Layer):
    type: Literal["gelu"]

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.GELU()


class SiLU(Layer):
    type: Literal["silu"]

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.SiLU()


class Dropout(Layer):
    type: Literal["dropout"]
    p: float = Field(0.5, ge=0, lt=1)

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.Dropout(self.p)


class Identity(Layer):
    type: Literal["identity"]

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.Identity()


class Flatten(Layer):
    type: Literal["flatten"]

    def output_shape(self, shapes: list[Shape]) -> Shape:
        return (math.prod(shapes[0]),)

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.Flatten(1)


# --- merges: several inputs -> one -------------------------------------------------------------


class Merge(nn.Module):
    """Combine several tensors: sum, product, maximum or channel concatenation."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        if self.op == "concat":
            return torch.cat(xs, dim=1)
        out = xs[0]
        for x in xs[1:]:
            out = (
                out + x
                if self.op == "add"
                else out * x
                if self.op == "mul"
                else torch.maximum(out, x)
            )
        return out

    def extra_repr(self) -> str:
        return self.op


class _Merge(Layer):
    many_inputs: ClassVar = True

    def output_shape(self, shapes: list[Shape]) -> Shape:
        if len(shapes) < 2:
            raise ShapeError("inputs", f"needs at least 2 inputs, got {len(shapes)}")
        if any(s != shapes[0] for s in shapes):
            raise ShapeError("inputs", "shapes differ: " + " vs ".join(map(fmt_shape, shapes)))
        return shapes[0]

    def build(self, shapes: list[Shape]) -> nn.Module:
        return Merge(self.type)


class Add(_Merge):
    type: Literal["add"]


class Mul(_Merge):
    type: Literal["mul"]


class Max(_Merge):
    type: Literal["max"]


class Concat(_Merge):
    """Concatenate along channels; all other dimensions must agree."""

    type: Literal["concat"]

    def output_shape(self, shapes: list[Shape]) -> Shape:
        if len(shapes) < 2:
            raise ShapeError("inputs", f"needs at least 2 inputs, got {len(shapes)}")
        if any(len(s) != len(shapes[0]) or s[1:] != shapes[0][1:] for s in shapes):
            raise ShapeError(
                "inputs", "only channels may differ: " + " vs ".join(map(fmt_shape, shapes))
            )
        return (sum(s[0] for s in shapes), *shapes[0][1:])
