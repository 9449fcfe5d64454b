"""Pools as ONNX counts their windows: torch's ceil_mode drops a last window that would start
in the padding, which ONNX's shape inference does not (export.py exports within
`onnx_countable_pools`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from cnnkit.nn.layers import pair


@contextmanager
def onnx_countable_pools(model: nn.Module, example: torch.Tensor) -> Iterator[None]:
    """The ceil_mode pools run, while `model` is exported, as ONNX counts their windows: torch
    drops a last window that would start in the padding (5x5, kernel 2, stride 2, padding 1: 3
    windows, as floor mode), but ONNX's shape inference counts it (4), and ONNX Runtime then
    refuses the model where such a pool meets an LRN, an add or a concat. A pool whose every
    axis slides floor mode's windows runs in floor mode; one whose axes differ (a non-square
    input: one axis drops its last window, the other keeps it) runs as an end padding and a
    floor-mode pool (EndPadded). The windows, and so the values, are the same."""
    floor, mixed = _ceil_pools(model, example)
    for pool in floor:
        pool.ceil_mode = False
    for pool, size in mixed.items():
        pool.forward = EndPadded(pool, size)
    try:
        yield
    finally:
        for pool in floor:
            pool.ceil_mode = True
        for pool in mixed:
            del pool.forward


def _ceil_pools(model: nn.Module, example: torch.Tensor) -> tuple[list[nn.Module], dict]:
    """The ceil_mode pools of `model` that ONNX would count otherwise on `example`: those whose
    output is floor mode's size, and those (with the (H, W) they read) whose output is neither
    floor mode's nor ONNX's ceil count."""
    pools = [m for m in model.modules()
             if isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)) and m.ceil_mode]  # fmt: skip
    sizes: dict[nn.Module, set[tuple[int, int]]] = {}
    outs: dict[nn.Module, tuple[int, int]] = {}

    def note(pool: nn.Module, args: tuple, out: torch.Tensor) -> None:
        sizes.setdefault(pool, set()).add(tuple(args[0].shape[-2:]))
        outs[pool] = tuple(out.shape[-2:])

    hooks = [pool.register_forward_hook(note) for pool in pools]
    try:
        if pools:
            with torch.no_grad():
                model(example)
    finally:
        for hook in hooks:
            hook.remove()
    floor, mixed = [], {}
    for pool, read in sizes.items():
        if len(read) != 1:  # (a pool called on several sizes: left as it is)
            continue
        (size,) = read
        if outs[pool] == _window_count(pool, size, ceil=False):
            floor.append(pool)
        elif outs[pool] != _window_count(pool, size, ceil=True):
            mixed[pool] = size
    return floor, mixed


def _window_count(pool: nn.Module, size: tuple[int, ...], ceil: bool) -> tuple[int, ...]:
    """A pool's output (H, W) for an input of `size` as ONNX counts it: floor mode, or ceil
    mode without torch's rule that drops a window starting in the padding."""
    kernel, stride, pad = pair(pool.kernel_size), pair(pool.stride), pair(pool.padding)
    dilation = pair(getattr(pool, "dilation", 1))
    return tuple(-(-(n + 2 * p - d * (k - 1) - 1) // s) + 1 if ceil else
                 (n + 2 * p - d * (k - 1) - 1) // s + 1
                 for n, k, s, p, d in zip(size, kernel, stride, pad, dilation, strict=True))  # fmt: skip


class EndPadded:
    """A ceil_mode pool at one input size as an end padding and a floor-mode pool: the same
    windows. A max pool pads with -inf; an average pool with zeros, its sums then scaled back
    to the divisors torch's ceil mode uses (a constant per output position). Set as the pool's
    `forward` while it is exported."""

    def __init__(self, pool: nn.Module, size: tuple[int, int]):
        self.pool, self.is_max = pool, isinstance(pool, nn.MaxPool2d)
        with torch.no_grad():
            ones = torch.ones(1, 1, *size)
            want = pool(ones)
            kernel, stride, pad = pair(pool.kernel_size), pair(pool.stride), pair(pool.padding)
            dilation = pair(getattr(pool, "dilation", 1))
            ends = [max(0, (o - 1) * s + d * (k - 1) + 1 - (n + 2 * p))
                    for o, n, k, s, p, d in zip(want.shape[-2:], size, kernel, stride, pad, dilation, strict=True)]  # fmt: skip
            self.padding = (0, ends[1], 0, ends[0])
            floor = self._floor_pool(F.pad(ones, self.padding))  # (0 where a window holds
            tiny = torch.finfo(floor.dtype).tiny  # no pixel: its sum is 0 either way)
            self.scale = None if self.is_max else want / floor.clamp_min(tiny)

    def _floor_pool(self, x: torch.Tensor) -> torch.Tensor:
        p = self.pool
        if self.is_max:
            return F.max_pool2d(x, p.kernel_size, p.stride, p.padding, p.dilation)
        return F.avg_pool2d(x, p.kernel_size, p.stride, p.padding, False, p.count_include_pad,
                            p.divisor_override)  # fmt: skip

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        value = float("-inf") if self.is_max else 0.0
        out = self._floor_pool(F.pad(x, self.padding, value=value))
        return out if self.scale is None else out * self.scale
