"""Layer kinds that act element by element (activations, dropout, stochastic depth), move
channels (flatten, channel shuffle, channel split) or merge several inputs (add, mul, max,
concat). Fields follow torch.nn; shapes are per sample, no batch."""

from __future__ import annotations

import itertools
import math
from typing import ClassVar, Literal

from pydantic import Field
from torch import nn

from cnnkit.nn.layers import Count, Flag, Layer, NonNeg, Real, Shape, ShapeError, fmt_shape
from cnnkit.nn.modules import (
    ChannelShuffle as ChannelShuffleModule,
)
from cnnkit.nn.modules import (
    ChannelSplit as ChannelSplitModule,
)
from cnnkit.nn.modules import (
    Dropout as DropoutModule,
)
from cnnkit.nn.modules import (
    Merge,
    ScaledTanh,
)
from cnnkit.nn.modules import (
    Power as PowerModule,
)
from cnnkit.nn.modules import (
    Reshape as ReshapeModule,
)
from cnnkit.nn.modules import (
    StochasticDepth as StochasticDepthModule,
)

# --- element-wise ------------------------------------------------------------------------------


class _Plain(Layer):
    """An activation with no fields: `module` is its torch.nn class."""

    module: ClassVar[type[nn.Module]]

    def build(self, shapes: list[Shape]) -> nn.Module:
        return self.module()


class ReLU(_Plain):
    type: Literal["relu"]
    module: ClassVar[type[nn.Module]] = nn.ReLU


class ReLU6(_Plain):
    type: Literal["relu6"]
    module: ClassVar[type[nn.Module]] = nn.ReLU6


class Sigmoid(_Plain):
    type: Literal["sigmoid"]
    module: ClassVar[type[nn.Module]] = nn.Sigmoid


class Hardsigmoid(_Plain):
    type: Literal["hardsigmoid"]
    module: ClassVar[type[nn.Module]] = nn.Hardsigmoid


class Hardswish(_Plain):
    type: Literal["hardswish"]
    module: ClassVar[type[nn.Module]] = nn.Hardswish


class GELU(_Plain):
    type: Literal["gelu"]
    module: ClassVar[type[nn.Module]] = nn.GELU


class SiLU(_Plain):
    type: Literal["silu"]
    module: ClassVar[type[nn.Module]] = nn.SiLU


class Mish(_Plain):
    type: Literal["mish"]
    module: ClassVar[type[nn.Module]] = nn.Mish


class ELU(Layer):
    type: Literal["elu"]
    alpha: Real = 1.0

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.ELU(self.alpha)


class Softplus(Layer):
    type: Literal["softplus"]
    beta: Real = Field(1.0, gt=0)
    threshold: Real = 20.0

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.Softplus(self.beta, self.threshold)


class Power(Layer):
    """(shift + scale * x) ** power, element by element: Caffe's Power layer (with power 1, a
    fixed affine map: MobileNet v3 ports build hard-swish from it and relu6)."""

    type: Literal["power"]
    power: Real = 1.0
    scale: Real = 1.0
    shift: Real = 0.0

    def build(self, shapes: list[Shape]) -> nn.Module:
        return PowerModule(self.power, self.scale, self.shift)


class Softmax(_Plain):
    """Softmax over the channels (features) at each position: an attention map or a gate.
    Not for a classifier's end: training's loss takes the logits."""

    type: Literal["softmax"]

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.Softmax(dim=1)


class Identity(_Plain):
    type: Literal["identity"]
    module: ClassVar[type[nn.Module]] = nn.Identity


class LeakyReLU(Layer):
    type: Literal["leaky_relu"]
    negative_slope: Real = 0.01

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.LeakyReLU(self.negative_slope)


class Tanh(Layer):
    type: Literal["tanh"]
    scaled: Flag = Field(False, description="LeCun's 1.7159 * tanh(2/3 x)")

    def build(self, shapes: list[Shape]) -> nn.Module:
        return ScaledTanh() if self.scaled else nn.Tanh()


class Dropout(Layer):
    type: Literal["dropout"]
    p: Real = Field(0.5, ge=0, lt=1)

    def build(self, shapes: list[Shape]) -> nn.Module:
        return DropoutModule(self.p)


class StochasticDepth(Layer):
    """Drops the whole input of a sample (`row`) or batch with probability p while training,
    scaling what survives by 1 / (1 - p); identity in eval. Put it on a residual branch."""

    type: Literal["stochastic_depth"]
    p: Real = Field(ge=0, le=1)
    mode: Literal["row", "batch"] = "row"

    def build(self, shapes: list[Shape]) -> nn.Module:
        return StochasticDepthModule(self.p, self.mode)


# --- reshaping -----------------------------------------------------------------------------------


class Flatten(Layer):
    type: Literal["flatten"]

    def output_shape(self, shapes: list[Shape]) -> Shape:
        return (math.prod(shapes[0]),)

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.Flatten(1)


class Reshape(Layer):
    """Each sample's values in another shape, in the same order (torch's `x.reshape(len(x),
    *shape)`, Keras's and Caffe's Reshape): `shape: [256, 1, 1]` makes a squeeze-excitation's
    (C,) gate from linear layers broadcast over a (C, H, W) map; one -1 takes what is left."""

    type: Literal["reshape"]
    shape: list[Count | Literal[-1]] = Field(min_length=1, max_length=3)

    def output_shape(self, shapes: list[Shape]) -> Shape:
        size, known = math.prod(shapes[0]), math.prod(n for n in self.shape if n != -1)
        free = self.shape.count(-1)
        if free > 1 or (size % known if free else size != known):
            several = "; one -1 at most" if free > 1 else ""
            raise ShapeError("shape", f"{self.shape} does not hold the {size:,} values of "
                             f"{fmt_shape(shapes[0])}{several}")  # fmt: skip
        return tuple(size // known if n == -1 else n for n in self.shape)

    def build(self, shapes: list[Shape]) -> nn.Module:
        return ReshapeModule(self.output_shape(shapes))


class ChannelShuffle(Layer):
    """ShuffleNet's shuffle: the channels as `groups` x n, transposed to n x `groups`."""

    type: Literal["channel_shuffle"]
    groups: Count

    def output_shape(self, shapes: list[Shape]) -> Shape:
        if len(shapes[0]) != 3 or shapes[0][0] % self.groups:
            raise ShapeError(
                "groups",
                f"must divide the channels of a (C, H, W) input, got {fmt_shape(shapes[0])}",
            )
        return shapes[0]

    def build(self, shapes: list[Shape]) -> nn.Module:
        return ChannelShuffleModule(self.groups)


class ChannelSplit(Layer):
    """Slice `part` (from 0) of the channels: of `parts` equal slices (ShuffleNet v2's split),
    or of the slices that cutting at `points` makes (Caffe's Slice slice_point, the indices of
    torch.tensor_split: `points: [256]` gives channels 0-255 as part 0, the rest as part 1)."""

    type: Literal["channel_split"]
    parts: Count = 2
    points: list[Count] | None = Field(None, min_length=1)
    part: NonNeg

    def output_shape(self, shapes: list[Shape]) -> Shape:
        start, end = self.bounds(shapes[0][0])
        return (end - start, *shapes[0][1:])

    def bounds(self, channels: int) -> tuple[int, int]:
        """The channels [start, end) of the part taken, checked against the input's count."""
        if self.points is None:
            if channels % self.parts:
                raise ShapeError("parts", f"must divide the {channels} channels")
            cuts = [channels * i // self.parts for i in range(self.parts + 1)]
        else:
            if "parts" in self.model_fields_set:
                raise ShapeError("parts", "given with points: give one (points cut the channels "
                                 "where they say, parts into equal slices)")  # fmt: skip
            cuts = [0, *self.points, channels]
            if any(a >= b for a, b in itertools.pairwise(cuts)):
                raise ShapeError("points", f"{self.points} must rise and stay below the "
                                 f"{channels} channels")  # fmt: skip
        if self.part >= len(cuts) - 1:
            raise ShapeError("part", f"is counted from 0 and must be below the {len(cuts) - 1} "
                             "parts")  # fmt: skip
        return cuts[self.part], cuts[self.part + 1]

    def build(self, shapes: list[Shape]) -> nn.Module:
        return ChannelSplitModule(*self.bounds(shapes[0][0]))


# --- merges: several inputs -> one -------------------------------------------------------------


def _broadcast(shapes: list[Shape]) -> Shape | None:
    """torch's broadcast shape of same-rank shapes (each size equal or 1), or None."""
    if any(len(s) != len(shapes[0]) for s in shapes):
        return None
    out = []
    for sizes in zip(*shapes, strict=True):
        big = {n for n in sizes if n != 1}
        if len(big) > 1:
            return None
        out.append(big.pop() if big else 1)
    return tuple(out)


class _Merge(Layer):
    """Element-wise merges broadcast a size-1 dimension ((C, 1, 1) * (C, H, W): excitation)."""

    many_inputs: ClassVar[bool] = True

    def output_shape(self, shapes: list[Shape]) -> Shape:
        if len(shapes) < 2:
            raise ShapeError("inputs", f"needs at least 2 inputs, got {len(shapes)}")
        shape = _broadcast(shapes)
        if shape is None:
            raise ShapeError("inputs", "shapes differ: " + " vs ".join(map(fmt_shape, shapes)))
        return shape

    def build(self, shapes: list[Shape]) -> nn.Module:
        return Merge(self.type)


class Add(_Merge):
    """The sum of the inputs; `coeff` weighs each by a fixed number first (Caffe's Eltwise
    coeff: Inception-ResNet's residual scaled by 0.17 is `coeff: [1, 0.17]`)."""

    type: Literal["add"]
    coeff: list[Real] | None = Field(None, min_length=2)

    def output_shape(self, shapes: list[Shape]) -> Shape:
        if self.coeff is not None and len(self.coeff) != len(shapes):
            raise ShapeError("coeff", f"gives {len(self.coeff)} numbers for {len(shapes)} inputs")
        return super().output_shape(shapes)

    def build(self, shapes: list[Shape]) -> nn.Module:
        return Merge(self.type, self.coeff)


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
