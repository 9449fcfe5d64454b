"""Layer kinds that slide a window: max / average pooling (adaptive and global too) and local
response normalisation. Shapes are per sample, without the batch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import nn

from cnnkit.nn.layers import (
    Count,
    Flag,
    IntPair,
    Layer,
    NonNegPair,
    Real,
    Shape,
    ShapeError,
    need_image,
    pair,
    window_out,
)
from cnnkit.nn.modules import LocalResponseNorm, WithinChannelLRN


class _Pool(Layer):
    kernel_size: IntPair
    stride: IntPair | None = Field(None, description="default: kernel_size")
    padding: NonNegPair = 0
    ceil_mode: Flag = Field(False, description="Caffe's rounding of the output size")

    def output_shape(self, shapes: list[Shape]) -> Shape:
        c, h, w = need_image(shapes[0])
        (kh, kw), (ph, pw) = pair(self.kernel_size), pair(self.padding)
        sh, sw = pair(self.stride or self.kernel_size)
        if ph > kh // 2 or pw > kw // 2:
            raise ShapeError("padding", f"{self.padding} must be at most half of kernel_size "
                             f"{self.kernel_size} (as torch's pools require)")  # fmt: skip
        ceil, (dh, dw) = self.ceil_mode, pair(getattr(self, "dilation", 1))
        return (c, window_out(h, kh, sh, ph, dh, ceil), window_out(w, kw, sw, pw, dw, ceil))


class MaxPool(_Pool):
    type: Literal["maxpool"]
    dilation: IntPair = 1

    def build(self, shapes: list[Shape]) -> nn.Module:
        stride = pair(self.stride or self.kernel_size)
        return nn.MaxPool2d(pair(self.kernel_size), stride, pair(self.padding),
                            pair(self.dilation), ceil_mode=self.ceil_mode)  # fmt: skip


class AvgPool(_Pool):
    type: Literal["avgpool"]
    count_include_pad: Flag = True

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
    """Local response normalisation, in either of the two published conventions.

    paper (Krizhevsky 2012): b = a / (k + alpha * sum(a^2))^beta
    caffe (and torch.nn):   b = a / (k + alpha / size * sum(a^2))^beta
    The sum runs across `size` neighbouring channels, or with `region: within_channel` (Caffe's
    WITHIN_CHANNEL, e.g. cifar10_full) over a size x size square in each channel
    (alpha / size^2: the square's mean, the padded border counted as Caffe counts it).
    """

    type: Literal["lrn"]
    convention: Literal["paper", "caffe"]
    region: Literal["across_channels", "within_channel"] = "across_channels"
    size: Count = 5
    alpha: Real = Field(1e-4, ge=0)
    beta: Real = 0.75
    k: Real | None = Field(None, description="default: 2 for paper, 1 for caffe")

    def output_shape(self, shapes: list[Shape]) -> Shape:
        if self.region == "within_channel":
            if self.convention != "caffe":
                raise ShapeError("region", "within_channel is Caffe's: use convention: caffe")
            if self.size % 2 == 0:
                raise ShapeError("size", "within_channel needs an odd size (as Caffe does)")
        return need_image(shapes[0])

    def build(self, shapes: list[Shape]) -> nn.Module:
        k = self.k if self.k is not None else (2.0 if self.convention == "paper" else 1.0)
        if self.region == "within_channel":
            return WithinChannelLRN(self.size, self.alpha, self.beta, k)
        alpha = self.alpha * self.size if self.convention == "paper" else self.alpha
        return LocalResponseNorm(self.size, alpha, self.beta, k)
