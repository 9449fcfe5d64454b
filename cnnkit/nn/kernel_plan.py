"""A kernel per layer, chosen by timing the way cudnn.benchmark picks a convolution algorithm:
each convolution, pooling and flattening linear layer is timed alone (forward + backward on an
input of its own shape, or the forward alone in inference mode for classification) in every
kernel that applies to it (NCHW, NHWC, NNPACK; the linear products; nn/kernels.py),
interleaved, and the fastest kept. A kernel must also agree with the layer's plain one
(TOLERANCE), or it is not used. Timing stops after the budget; the layers left untimed keep
the format they get.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn

from cnnkit.nn import Network
from cnnkit.nn.kernels import FORMATS, options, set_kernel
from cnnkit.nn.onednn import freeze
from cnnkit.runtime import torch_threads

BUDGET_S = 30.0  # per network; the layers left untimed run in the format their input has
INFER_BUDGET_S = 8.0  # the same for inference, which a first `cnnkit classify` waits for
ROUNDS = 2  # timed rounds per layer, after one warm-up
TOLERANCE = 1e-4  # a kernel's largest difference from the plain one, relative to the largest value


def plan_kernels(network: Network, x: torch.Tensor, threads: int,
                 forward_only: bool = False) -> dict[str, str]:  # fmt: skip
    """Layer name -> fastest kernel, timed on a copy of `network` fed batches shaped as `x`;
    an empty plan where nothing beats plain NCHW. Layers are timed in the order they run, each
    with its input in the format the kernel before it leaves (NNPACK's and NCHW's: NCHW).
    `forward_only`: for inference (the forward alone, in inference mode, weights frozen)."""
    model = copy.deepcopy(network).cpu().train(not forward_only)
    plan: dict[str, str] = {}
    arrives = torch.contiguous_format  # the batch itself comes NCHW
    start, budget = time.perf_counter(), INFER_BUDGET_S if forward_only else BUDGET_S
    g = torch.Generator().manual_seed(0)
    with torch_threads(threads):
        for name, (shape, first) in layer_inputs(model, x).items():
            if time.perf_counter() - start > budget:
                break
            sample = torch.randn(shape, generator=g)
            if sample.dim() == 4:
                sample = sample.contiguous(memory_format=arrives)
            layer = model.get_submodule(name)
            plan[name] = fastest_kernel(layer, sample, not first, forward_only)
            arrives = FORMATS[plan[name]]  # what this layer's output keeps
    plain = all(k == options(model.get_submodule(n))[0] for n, k in plan.items())
    return {} if plain else plan


def layer_inputs(model: nn.Module, x: torch.Tensor) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Layer name -> (input shape, whether that input is the network's own) for every layer
    that has kernel options (convolutions, pooling, flattening linear layers), in the order one
    forward pass runs them (the network's input needs no gradient)."""
    x = x.cpu()
    seen: dict[str, tuple[tuple[int, ...], bool]] = {}

    def record(name: str, args: tuple) -> None:
        seen.setdefault(name, (tuple(args[0].shape), args[0] is x))

    hooks = [m.register_forward_pre_hook(lambda _m, args, name=name: record(name, args))
             for name, m in model.named_modules() if options(m)]  # fmt: skip
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def fastest_kernel(module: nn.Module, x: torch.Tensor, grad_input: bool = True,
                   forward_only: bool = False) -> str:  # fmt: skip
    """The kernel under which forward + backward of `module` on `x` (in the memory format it
    arrives in) is fastest, among those that agree with the plain one (the first).
    `forward_only`: the forward pass alone, in inference mode, on frozen weights."""
    kernels = list(options(module))
    variants = {k: _variant(module, k, forward_only) for k in kernels}
    x = x.requires_grad_(grad_input and not forward_only)
    seconds: dict[str, list[float]] = {k: [] for k in kernels}
    results = {}
    timed = _time_forward if forward_only else _time_once
    for r in range(ROUNDS + 1):  # round 0 warms up (and keeps each kernel's results)
        for k in kernels if r % 2 else kernels[::-1]:
            took, out = timed(variants[k], x)
            if r:
                seconds[k].append(took)
            else:
                results[k] = out
    for k in kernels[1:]:
        if not _agrees(results[k], results[kernels[0]]):
            del seconds[k]
    return min(seconds, key=lambda k: statistics.median(seconds[k]))


def _variant(module: nn.Module, kernel: str, frozen: bool = False) -> nn.Module:
    copied = copy.deepcopy(module)
    set_kernel(copied, kernel)
    return freeze(copied) if frozen else copied


def _time_forward(module: nn.Module, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    """Seconds for one forward pass in inference mode, and its output."""
    with torch.inference_mode():
        start = time.perf_counter()
        y = module(x)
        return time.perf_counter() - start, [y]


def _time_once(module: nn.Module, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    """Seconds for one forward + backward; the output and the gradients it computed."""
    x.grad = None
    for p in module.parameters():
        p.grad = None
    start = time.perf_counter()
    y = module(x)
    if y.requires_grad:  # not for a first layer without weights: training has no backward there
        y.backward(torch.ones_like(y))
    took = time.perf_counter() - start
    grads = [t.grad for t in (x, *module.parameters()) if t.grad is not None]
    return took, [y.detach(), *grads]


def _agrees(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(
        (a - b).abs().max() <= TOLERANCE * b.abs().max().clamp(min=1e-12)
        for a, b in zip(got, want, strict=True)
    )
