"""The torch modules of our own that layer kinds build, where torch.nn has no exact match."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cnnkit.nn.onednn import linear as onednn_linear
from cnnkit.runtime import traced


class ScaledTanh(nn.Module):
    """LeCun's tanh: 1.7159 * tanh(2/3 x), unit gain around zero."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 1.7159 * torch.tanh(x * (2.0 / 3.0))


class Power(nn.Module):
    """(shift + scale * x) ** power, element by element (Caffe's Power layer); the steps that
    change nothing are left out. Where power or scale is 0, the constant Caffe writes (1, or
    shift ** power), whatever x holds (inf and nan too)."""

    def __init__(self, power: float, scale: float, shift: float):
        super().__init__()
        self.power, self.scale, self.shift = power, scale, shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.power * self.scale == 0.0:
            return torch.full_like(x, 1.0 if self.power == 0.0 else self.shift**self.power)
        if self.scale != 1.0:
            x = x * self.scale
        if self.shift != 0.0:
            x = x + self.shift
        return x if self.power == 1.0 else x.pow(self.power)

    def extra_repr(self) -> str:
        return f"power={self.power:g}, scale={self.scale:g}, shift={self.shift:g}"


class FlatLinear(nn.Linear):
    """nn.Linear that flattens a (B, C, H, W) input first, as Caffe's InnerProduct does.

    `product` "wxt" computes (W @ x^T)^T instead of F.linear's x @ W^T: the same sums, which
    some CPUs' BLAS runs several times faster for small batches; "onednn" runs them on oneDNN
    instead of the BLAS (nn/onednn.py). Which is fastest is measured (nn/kernels.py). Exports,
    tracing and compiling see F.linear."""

    product = "xwt"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if traced():  # (flatten(1) whatever x is: fx follows no branch on x.dim())
            return super().forward(x.flatten(1))
        x = x.flatten(1) if x.dim() > 2 else x
        if self.product == "xwt":
            return super().forward(x)
        if self.product == "onednn":  # packed weights only once frozen (onednn.freeze)
            return onednn_linear(x, self.weight, self.bias, self.__dict__.get("_packed"))
        if self.bias is None:
            return (self.weight @ x.T).T
        return torch.addmm(self.bias[:, None], self.weight, x.T).T


class ChannelLinear(nn.Linear):
    """nn.Linear over the channels of each position: (B, C, H, W) -> (B, out, H, W)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # ((B, C): movedim moves nothing)
        return super().forward(x.movedim(1, -1)).movedim(-1, 1)


class ChannelLayerNorm(nn.LayerNorm):
    """nn.LayerNorm over the channels of each position of (B, C, H, W), as torchvision's
    ConvNeXt LayerNorm2d computes it (channels last, normalise, back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (no branch on x.dim(): fx traces it)
        return super().forward(x.movedim(1, -1)).movedim(-1, 1)


class ChannelScale(nn.Module):
    """x * weight with a learned weight per channel, (C, 1, 1) or (F,), initially ones.

    A network's state_dict holds the weight under the layer's own name, `a.layer_scale` rather
    than `a.layer_scale.weight`, as torchvision stores ConvNeXt's bare `layer_scale` parameter
    (see `bare_scale_keys`)."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def bare_scale_keys(
    names: tuple[str, ...], module: nn.Module, state: dict, prefix: str, *_
) -> None:
    """state_dict post-hook of a network: `a.layer_scale.weight` -> `a.layer_scale`."""
    for name in names:
        if prefix + name + ".weight" in state:
            state[prefix + name] = state.pop(prefix + name + ".weight")


def scale_weight_keys(
    names: tuple[str, ...], module: nn.Module, state: dict, prefix: str, *_
) -> None:
    """load_state_dict pre-hook of a network: `a.layer_scale` -> `a.layer_scale.weight`."""
    for name in names:
        if prefix + name in state:
            state[prefix + name + ".weight"] = state.pop(prefix + name)


class LocalResponseNorm(nn.LocalResponseNorm):
    """nn.LocalResponseNorm (x / (k + alpha / size * sum of x^2 over `size` channels)^beta),
    computed as torch.nn does it to rounding, 1.5-3x faster: the window sum over channels is
    one matrix product with a band of ones (torch pads and runs avg_pool3d), and the backward is
    written out. Exports, tracing and compiling see plain nn.LocalResponseNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if traced() or x.dim() != 4 or x.device.type not in ("cpu", "cuda"):  # meta: shapes
            return super().forward(x)
        return _CrossChannelLRN.apply(x, self.size, self.alpha, self.beta, self.k)


class _CrossChannelLRN(torch.autograd.Function):
    """y = x * d^-beta, d = k + A (x * x) with A = alpha / size * band (a sum over the channel
    window torch.nn uses: size // 2 before, (size - 1) // 2 after). Gradient:
    g * d^-beta - 2 beta x * A^T (g * y / d). Half-precision inputs are computed in fp32."""

    @staticmethod
    def forward(ctx, x, size, alpha, beta, k):  # type: ignore[override]
        dtype = x.dtype
        if not (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)):
            x = x.contiguous()
        with torch.autocast(x.device.type, enabled=False):
            x = x.float()
            band = _band(x.shape[1], size, x.device) * (alpha / size)
            den = _over_channels(x * x, band, k)
            if not ctx.needs_input_grad[0]:  # nothing to save: in place
                return den.pow_(-beta).mul_(x).to(dtype)
            scale = den.pow(-beta)
            y = x * scale
        ctx.save_for_backward(x, den, scale, y, band)
        ctx.beta = beta
        return y.to(dtype)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, den, scale, y, band = ctx.saved_tensors
        g = g.float()
        spread = _over_channels(g * y / den, band.T, 0.0)
        grad = (g * scale).addcmul_(x, spread, value=-2.0 * ctx.beta)
        return grad, None, None, None, None


def _band(channels: int, size: int, device: torch.device) -> torch.Tensor:
    """(C, C) fp32: row c has ones at the channels c' whose squares enter channel c's sum."""
    offset = torch.arange(channels, device=device)
    offset = offset[None, :] - offset[:, None]
    return ((offset >= -(size // 2)) & (offset <= (size - 1) // 2)).float()


def _over_channels(z: torch.Tensor, matrix: torch.Tensor, add: float) -> torch.Tensor:
    """add + matrix @ z over the channels of (B, C, H, W) z, in z's memory format."""
    b, c, h, w = z.shape
    shift = torch.full((c,), add, dtype=z.dtype, device=z.device)
    if z.is_contiguous():
        out = torch.baddbmm(shift[:, None], matrix.expand(b, c, c), z.view(b, c, h * w))
        return out.view(b, c, h, w)
    rows = z.permute(0, 2, 3, 1).reshape(b * h * w, c)  # channels_last: a view
    return torch.addmm(shift, rows, matrix.T).view(b, h, w, c).permute(0, 3, 1, 2)


class WithinChannelLRN(nn.Module):
    """Caffe's LRN WITHIN_CHANNEL: x / (k + alpha * mean of x^2 over a size x size square)^beta,
    the square zero-padded and its mean divided as Caffe's average pooling divides."""

    def __init__(self, size: int, alpha: float, beta: float, k: float):
        super().__init__()
        self.size, self.alpha, self.beta, self.k = size, alpha, beta, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = F.avg_pool2d(x * x, self.size, 1, self.size // 2, count_include_pad=True)
        return x / (self.k + self.alpha * mean).pow(self.beta)

    def extra_repr(self) -> str:
        return f"{self.size}, alpha={self.alpha}, beta={self.beta}, k={self.k}"


class Dropout(nn.Dropout):
    """torch's Dropout, whose mask on a CPU is drawn 16 bits at a time: four keep-or-drop
    draws per 64-bit random word, 5x faster than torch's CPU bernoulli_ (which spent 7 ms of an
    AlexNet step at batch 64). The keep probability is 1 - p to 2^-16 and the survivors are
    scaled by its inverse (rounded to x's type, as torch's is). On other devices, traced or
    compiled, in place, or for a p that 16 bits cannot draw (under 2^-17, over 1 - 2^-17):
    torch's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dropped = round(self.p * 65536)  # of 65536 equally likely 16-bit values
        if (traced() or not self.training or not 0 < dropped < 65536 or self.inplace
                or x.device.type != "cpu"):  # fmt: skip
            return super().forward(x)
        words = torch.randint(-(2**63), 2**63 - 1, (-(-x.numel() // 4),), dtype=torch.int64)
        draws = words.view(torch.int16)[: x.numel()].view(x.shape)  # uniform in [-2^15, 2^15)
        keep = (draws >= dropped - 32768).to(x.dtype)
        return x * keep.mul_(65536 / (65536 - dropped))


class StochasticDepth(nn.Module):
    """Drop a residual branch per sample ("row") or per batch with probability p while
    training, scaling survivors by 1 / (1 - p); identity in eval (torchvision.ops' rule)."""

    def __init__(self, p: float, mode: str = "row"):
        super().__init__()
        self.p, self.mode = p, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        survival = 1.0 - self.p
        size = [x.shape[0]] + [1] * (x.dim() - 1) if self.mode == "row" else [1] * x.dim()
        noise = torch.empty(size, dtype=x.dtype, device=x.device).bernoulli_(survival)
        if survival > 0.0:
            noise.div_(survival)
        return x * noise

    def extra_repr(self) -> str:
        return f"p={self.p}, mode={self.mode}"


class ChannelShuffle(nn.Module):
    """ShuffleNet's channel shuffle: (B, g * n, H, W) -> groups interleaved, as torchvision
    writes it (view, transpose, view)."""

    def __init__(self, groups: int):
        super().__init__()
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        x = x.view(b, self.groups, c // self.groups, h, w).transpose(1, 2).contiguous()
        return x.view(b, c, h, w)

    def extra_repr(self) -> str:
        return f"groups={self.groups}"


class ChannelSplit(nn.Module):
    """Channels [start, end) of the input: a view, as torch.tensor_split's parts are."""

    def __init__(self, start: int, end: int):
        super().__init__()
        self.start, self.end = start, end

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.start : self.end]

    def extra_repr(self) -> str:
        return f"channels {self.start}:{self.end}"


class Crop(nn.Module):
    """The (rows, cols) window of the first input from (top, left); the second input, which
    gave its size, is not read."""

    def __init__(self, top: int, left: int, rows: int, cols: int):
        super().__init__()
        self.top, self.left, self.rows, self.cols = top, left, rows, cols

    def forward(self, x: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
        return x[:, :, self.top : self.top + self.rows, self.left : self.left + self.cols]

    def extra_repr(self) -> str:
        return f"offset=({self.top}, {self.left}), size=({self.rows}, {self.cols})"


class Reshape(nn.Module):
    """Each sample in `shape` (its values in the same order)."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.shape = shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], *self.shape)

    def extra_repr(self) -> str:
        return f"shape={self.shape}"


class Merge(nn.Module):
    """Combine several tensors: sum (each weighed by its `coeff`, where given), product, maximum
    (broadcasting) or channel concatenation."""

    def __init__(self, op: str, coeff: list[float] | None = None):
        super().__init__()
        self.op, self.coeff = op, coeff

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        if self.op == "concat":
            return torch.cat(xs, dim=1)
        if self.coeff is not None:  # (a weight of 1 multiplies nothing)
            xs = tuple(x if c == 1 else x * c for x, c in zip(xs, self.coeff, strict=True))
        out = xs[0]
        for x in xs[1:]:
            if self.op == "add":
                out = out + x
            elif self.op == "mul":
                out = out * x
            else:
                out = torch.maximum(out, x)
        return out

    def extra_repr(self) -> str:
        return self.op if self.coeff is None else f"{self.op}, coeff={self.coeff}"
