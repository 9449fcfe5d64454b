"""Layer kinds that change the size of a feature map without pooling it: transposed convolution
and upsampling (decoders, FCN / U-Net heads, autoencoders) and explicit padding (TensorFlow's
asymmetric 'SAME'). Fields follow torch.nn; shapes are per sample, no batch."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import Field, model_validator
from torch import nn

from cnnkit.nn.layers import (
    ConvFields,
    Flag,
    IntPair,
    Layer,
    NonNeg,
    NonNegPair,
    Real,
    Shape,
    ShapeError,
    check_groups,
    need_image,
    pair,
)
from cnnkit.nn.modules import Crop as CropModule


class ConvTranspose(ConvFields):
    """torch's ConvTranspose2d: each output side is (in - 1) * stride - 2 * padding +
    dilation * (kernel - 1) + output_padding + 1; Caffe's Deconvolution is this with no
    output_padding."""

    type: Literal["conv_transpose"]
    padding: NonNegPair = 0
    output_padding: NonNegPair = 0

    def output_shape(self, shapes: list[Shape]) -> Shape:
        c, h, w = need_image(shapes[0])
        check_groups(c, self.out_channels, self.groups)
        sides = []
        for size, k, s, p, op, d in zip((h, w), pair(self.kernel_size), pair(self.stride),
                                        pair(self.padding), pair(self.output_padding),
                                        pair(self.dilation), strict=True):  # fmt: skip
            if op >= max(s, d):
                raise ShapeError("output_padding", f"{op} must be smaller than stride or "
                                 f"dilation ({max(s, d)})")  # fmt: skip
            out = (size - 1) * s - 2 * p + d * (k - 1) + op + 1
            if out < 1:
                raise ShapeError("padding", f"output size {out} is below 1")
            sides.append(out)
        return (self.out_channels, *sides)

    def build(self, shapes: list[Shape]) -> nn.Module:
        return nn.ConvTranspose2d(
            shapes[0][0], self.out_channels, pair(self.kernel_size), pair(self.stride),
            pair(self.padding), pair(self.output_padding), self.groups, self.bias,
            pair(self.dilation),
        )  # fmt: skip

    def _weights(self, shapes: list[Shape]) -> int:
        return shapes[0][0] * (self.out_channels // self.groups) * math.prod(pair(self.kernel_size))

    def macs(self, shapes: list[Shape], out: Shape) -> int:
        return math.prod(shapes[0][1:]) * self._weights(shapes)  # each input pixel, each tap

    def param_count(self, shapes: list[Shape]) -> int:
        return self._weights(shapes) + self.out_channels * self.bias


class Upsample(Layer):
    """torch's Upsample: by an integer `scale_factor` or to a `size`, nearest or bilinear."""

    type: Literal["upsample"]
    scale_factor: IntPair | None = None
    size: IntPair | None = None
    mode: Literal["nearest", "bilinear"] = "nearest"
    align_corners: Flag | None = Field(None, description="bilinear only (torch's default: false)")

    @model_validator(mode="after")
    def _one_of(self) -> Upsample:
        if (self.scale_factor is None) == (self.size is None):
            raise ValueError("give scale_factor or size (one of them)")
        if self.align_corners is not None and self.mode != "bilinear":
            raise ValueError("align_corners: for mode bilinear only")
        return self

    def output_shape(self, shapes: list[Shape]) -> Shape:
        c, h, w = need_image(shapes[0])
        if self.size is not None:
            return (c, *pair(self.size))
        fh, fw = pair(self.scale_factor)
        return (c, h * fh, w * fw)

    def build(self, shapes: list[Shape]) -> nn.Module:
        if self.size is not None:
            return nn.Upsample(
                size=pair(self.size), mode=self.mode, align_corners=self.align_corners
            )
        factor = tuple(float(f) for f in pair(self.scale_factor))
        return nn.Upsample(scale_factor=factor, mode=self.mode, align_corners=self.align_corners)


class Crop(Layer):
    """The window of the first input that is the size (H, W) of the second, from `offset`
    (one number or [top, left]): Caffe's Crop, with which FCN aligns an upsampled score map to
    its skip connection's and to the image (`inputs: [upscore8, input]`)."""

    type: Literal["crop"]
    offset: NonNegPair = 0
    many_inputs: ClassVar[bool] = True

    def output_shape(self, shapes: list[Shape]) -> Shape:
        if len(shapes) != 2:
            raise ShapeError("inputs", f"takes 2 (what to crop, and an input of the size to crop "
                             f"it to), got {len(shapes)}")  # fmt: skip
        (c, h, w), (_, rows, cols) = need_image(shapes[0]), need_image(shapes[1])
        top, left = pair(self.offset)
        if top + rows > h or left + cols > w:
            shown = self.offset if isinstance(self.offset, int) else list(self.offset)
            raise ShapeError("offset", f"{shown}: a {rows} x {cols} window from it leaves "
                             f"the {h} x {w} input")  # fmt: skip
        return (c, rows, cols)

    def build(self, shapes: list[Shape]) -> nn.Module:
        return CropModule(*pair(self.offset), *self.output_shape(shapes)[1:])


class Pad(Layer):
    """Padding of (C, H, W): one number for every side, or [left, right, top, bottom] as torch's
    F.pad orders them (TensorFlow's 'SAME' with stride 2 pads right and bottom more)."""

    type: Literal["pad"]
    padding: NonNeg | tuple[NonNeg, NonNeg, NonNeg, NonNeg]
    mode: Literal["constant", "reflect", "replicate"] = "constant"
    value: Real = Field(0.0, description="constant mode's value")
    sides: ClassVar[tuple[str, ...]] = ("left", "right", "top", "bottom")

    @model_validator(mode="after")
    def _value_for_constant(self) -> Pad:
        if self.mode != "constant" and "value" in self.model_fields_set:
            raise ValueError(f"value: for mode constant only ({self.mode} pads with the input's "
                             "own pixels)")  # fmt: skip
        return self

    def _sides(self) -> tuple[int, int, int, int]:
        p = self.padding
        return (p, p, p, p) if isinstance(p, int) else tuple(p)  # type: ignore[return-value]

    def output_shape(self, shapes: list[Shape]) -> Shape:
        c, h, w = need_image(shapes[0])
        left, right, top, bottom = self._sides()
        if self.mode == "reflect" and (max(left, right) >= w or max(top, bottom) >= h):
            raise ShapeError("padding", f"reflect padding must be smaller than the input "
                             f"({h} x {w})")  # fmt: skip
        return (c, h + top + bottom, w + left + right)

    def build(self, shapes: list[Shape]) -> nn.Module:
        sides = self._sides()
        if self.mode == "reflect":
            return nn.ReflectionPad2d(sides)
        if self.mode == "replicate":
            return nn.ReplicationPad2d(sides)
        return nn.ConstantPad2d(sides, self.value)
