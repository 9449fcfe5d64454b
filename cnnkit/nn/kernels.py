"""Per-layer CPU kernels: a convolution or pooling layer may run in a memory format of its own
(NCHW or NHWC), a stride-1 convolution may run on NNPACK, whose Winograd and FFT convolutions
take fewer multiplies than oneDNN's direct ones, and a flattening linear layer may run as
(W x^T)^T or on oneDNN instead of the BLAS (nn/kernel_plan.py and nn/tuning.py measure which
is fastest). The first kernel of each layer's options is the plain one. The network's
parameters and state_dict are unchanged.

    set_kernels(network, {"features.3": "nnpack", "features.2": "nhwc", "fc6": "onednn"})
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from cnnkit.nn.modules import FlatLinear
from cnnkit.nn.onednn import onednn_ready
from cnnkit.runtime import traced

KERNELS = ("nchw", "nhwc", "nnpack")
# a flattening linear layer's product: F.linear's x @ W^T (the BLAS), (W @ x^T)^T, or oneDNN's
PRODUCTS = ("xwt", "wxt", "onednn")
NNPACK_MAX_KERNEL = 16  # NNPACK's largest kernel side
# the memory format each kernel takes its input and weights in (NNPACK: NCHW)
FORMATS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last,
           "nnpack": torch.contiguous_format, "xwt": torch.contiguous_format,
           "wxt": torch.contiguous_format, "onednn": torch.contiguous_format}  # fmt: skip


@functools.cache
def nnpack_ready() -> bool:
    """Whether this torch build has NNPACK and it initialises on this CPU."""
    try:
        return bool(torch._nnpack_available())
    except (AttributeError, RuntimeError):
        return False


def nnpack_fits(conv: nn.Module) -> bool:
    """Whether NNPACK computes this convolution: stride 1, no dilation or groups, zero padding
    smaller than the kernel, kernel sides up to 16."""
    if not isinstance(conv, nn.Conv2d) or isinstance(conv.padding, str):
        return False
    (kh, kw), (ph, pw) = conv.kernel_size, conv.padding
    return (
        conv.stride == (1, 1) and conv.dilation == (1, 1) and conv.groups == 1
        and conv.padding_mode == "zeros" and ph < kh and pw < kw
        and max(kh, kw) <= NNPACK_MAX_KERNEL
    )  # fmt: skip


def options(module: nn.Module) -> tuple[str, ...]:
    """The kernels worth timing for a layer (none for layers whose speed the format barely
    changes: they run in whatever format their input arrives in)."""
    if isinstance(module, nn.Conv2d):
        nnpack = isinstance(module, Conv2d) and nnpack_ready() and nnpack_fits(module)
        return KERNELS if nnpack else KERNELS[:2]
    if isinstance(module, (nn.MaxPool2d, nn.AvgPool2d)):
        return KERNELS[:2]
    if isinstance(module, FlatLinear):
        return PRODUCTS if onednn_ready() else PRODUCTS[:2]
    return ()


def set_kernels(network: nn.Module, plan: Mapping[str, str]) -> nn.Module:
    """Run each named layer with its kernel (see `options`); returns the network."""
    for name, kernel in plan.items():
        set_kernel(network.get_submodule(name), kernel)
    return network


def set_kernel(module: nn.Module, kernel: str) -> None:
    """Put the layer's input and weights in the kernel's memory format; NNPACK for a conv."""
    if isinstance(module, FlatLinear) and kernel in PRODUCTS:  # a product, no memory format
        module.product = kernel  # "onednn" runs F.linear where this torch lacks oneDNN
        return
    if kernel not in options(module):
        raise ValueError(f"kernel {kernel!r} does not apply to {type(module).__name__}")
    old = getattr(module, "_kernel_hook", None)
    if old is not None:
        old.remove()
    fmt = FORMATS[kernel]
    module.to(memory_format=fmt)
    module._kernel_hook = module.register_forward_pre_hook(InputFormat(fmt))
    if isinstance(module, Conv2d):
        module.nnpack = kernel == "nnpack"


class InputFormat:
    """A forward pre-hook putting 4-d inputs in one memory format (a class: copies pickle)."""

    def __init__(self, memory_format: torch.memory_format):
        self.memory_format = memory_format

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        return tuple(
            a.contiguous(memory_format=self.memory_format)
            if isinstance(a, torch.Tensor) and a.dim() == 4 else a
            for a in args
        )  # fmt: skip


class Conv2d(nn.Conv2d):
    """nn.Conv2d that runs on NNPACK when `nnpack` is set and the input is fp32 on the CPU
    outside autocast; otherwise (and in exports) exactly nn.Conv2d."""

    nnpack = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nnpack and _nnpack_applies(x):
            return NnpackConv.apply(x, self.weight, self.bias, self.padding)
        return super().forward(x)


def _nnpack_applies(x: torch.Tensor) -> bool:
    return (
        not traced() and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 4
        and not torch.is_autocast_enabled("cpu")
    )  # fmt: skip


class NnpackConv(torch.autograd.Function):
    """A convolution whose forward, input gradient and weight gradient are each an NNPACK
    forward convolution: the input gradient convolves the output gradient with the flipped,
    transposed weights; the weight gradient correlates input and output gradient with batch
    and channels swapped (the gradient as the kernel, in tiles NNPACK can take)."""

    @staticmethod
    def forward(ctx, x, weight, bias, padding):  # (B, C, H, W), (O, C, kh, kw)
        x = x.contiguous()
        ctx.save_for_backward(x, weight)
        ctx.padding, ctx.has_bias = tuple(padding), bias is not None
        return torch._nnpack_spatial_convolution(x, weight.contiguous(), bias, list(padding))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # (B, O, H', W')
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        (kh, kw), (ph, pw) = weight.shape[2:], ctx.padding
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            flipped = weight.flip(2, 3).transpose(0, 1).contiguous()  # (C, O, kh, kw)
            grad_x = torch._nnpack_spatial_convolution(
                grad, flipped, None, [kh - 1 - ph, kw - 1 - pw]
            )
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(x, grad, (kh, kw), (ph, pw))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum((0, 2, 3))
        return grad_x, grad_w, grad_b, None


def weight_grad(x: torch.Tensor, grad: torch.Tensor, kernel: tuple[int, int],
                padding: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """d loss / d weight of a stride-1 convolution as NNPACK convolutions: the padded input with
    its batch as channels, (C, B, H+2p, W+2p), against the output gradient, (O, B, H', W'), as the
    kernel; the gradient is cut into tiles of at most 17 - k a side so that each tile plus the
    kernel's reach fits NNPACK's 16x16 FFT, and the tiles' results summed."""
    (kh, kw), (ph, pw) = kernel, padding
    xt = F.pad(x, (pw, pw, ph, ph)).transpose(0, 1)
    gt = grad.transpose(0, 1)
    rows = _edges(grad.shape[2], max(1, min(NNPACK_MAX_KERNEL, 17 - kh)))
    cols = _edges(grad.shape[3], max(1, min(NNPACK_MAX_KERNEL, 17 - kw)))
    total = None
    for r0, r1 in itertools.pairwise(rows):
        for c0, c1 in itertools.pairwise(cols):
            tile = torch._nnpack_spatial_convolution(
                xt[:, :, r0 : r1 + kh - 1, c0 : c1 + kw - 1].contiguous(),
                gt[:, :, r0:r1, c0:c1].contiguous(), None, [0, 0],
            )  # fmt: skip  # (C, O, kh, kw)
            total = tile if total is None else total.add_(tile)
    return total.transpose(0, 1).contiguous()


def _edges(size: int, tile: int) -> list[int]:
    """Edges of near-equal parts of `size`, none longer than `tile`."""
    parts = math.ceil(size / tile)
    return [round(i * size / parts) for i in range(parts + 1)]
