"""oneDNN's fp32 inner product for a linear layer on the CPU. torch sends an fp32 F.linear to
MKL, which on some CPUs (AMD's) runs it 2-4x slower than oneDNN, which torch also ships: here the
forward pass and both gradients are oneDNN products. For inference on weights that will not
change (`freeze`: classification, `cnnkit eval`, the inference benchmarks) the weight is reordered
once into oneDNN's blocked layout. A layer runs this way only where it was measured faster
(nn/kernels.py: the "onednn" product).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

PACK_BATCH = 16  # the batch oneDNN picks the weight's blocked layout for (any batch runs on it)


@functools.cache
def onednn_ready() -> bool:
    """Whether this torch build has oneDNN's linear ops (private, hence checked by a call)."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        x, w = torch.ones(2, 3), torch.ones(4, 3)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
        return bool((_product(x, w) == 3).all() and (_product(x, packed) == 3).all())
    except (AttributeError, RuntimeError):
        return False


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x @ weight^T + bias by oneDNN: (B, I), (O, I) -> (B, O); the weight may be packed."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and x.dim() == 2
        and len(x) > 0 and not torch.is_autocast_enabled("cpu") and onednn_ready()
    )  # fmt: skip


def freeze(network: nn.Module) -> nn.Module:
    """Let the layers that run on oneDNN pack their weights, for inference on weights that will
    not change. Never while training: a fused optimizer step changes a weight without a trace
    torch can see (its version counter stays), and a packed copy would go stale."""
    for module in network.modules():
        if getattr(module, "product", None) == "onednn":
            module.__dict__["_packed"] = PackedWeight()
    return network


class PackedWeight:
    """A frozen layer's weight in oneDNN's blocked layout, made at its first use, and again if
    the weight is replaced (load_state_dict, `p.data = new`: another tensor or storage) or
    changed in place where torch counts it (an in-place op). Not seen: an in-place change torch
    does not count (`p.data.copy_(new)`, an inference-mode tensor's): call freeze() again after
    one. Dropped by a forward pass that wants gradients. Copies and pickles start empty."""

    def __init__(self) -> None:
        self.source: torch.Tensor | None = None
        self.key: tuple[int, int | None] | None = None
        self.packed: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        version = None if weight.is_inference() else weight._version  # inference: no counter
        key = (weight.data_ptr(), version)
        if self.source is not weight or self.key != key:
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH)
            self.source, self.key = weight, key
        return self.packed

    def clear(self) -> None:
        """Drop the packed copy (the layer is being trained: its weight changes every step)."""
        if self.source is not None:
            self.__init__()

    def __reduce__(self) -> tuple:
        return PackedWeight, ()  # oneDNN's opaque tensors cannot be copied: a copy packs anew


class OnednnLinear(torch.autograd.Function):
    """y = x W^T + b with the forward, the input gradient (g W) and the weight gradient (g^T x)
    each one oneDNN product."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # (B, I), (O, I), (O,)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _product(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # (B, O)
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _product(grad, weight.t())  # (B, I): W^T read in place as (I, O)
        if ctx.needs_input_grad[1]:  # (O, I); both operands small (batch-sized): copied
            grad_w = _product(grad.t().contiguous(), x.t().contiguous())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None = None) -> torch.Tensor:  # fmt: skip
    """F.linear by oneDNN where it applies (fp32 on the CPU outside autocast), else F.linear:
    through OnednnLinear when a gradient is wanted; without, on the weight as it is, or packed
    when the layer is frozen (`packed`; one image at a time runs as fast unpacked, so the
    packing waits for a batch of two)."""
    if not _applies(x, weight):
        return F.linear(x, weight, bias)
    x = x.contiguous()
    wanted = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and wanted:
        if packed is not None:
            packed.clear()
        return OnednnLinear.apply(x, weight, bias)
    if packed is None or (len(x) < 2 and packed.source is None):
        return _product(x, weight, bias)
    return _product(x, packed.get(weight), bias)
