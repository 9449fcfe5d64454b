"""The device's measured peak: large matmuls and convolutions timed in fp32, bf16 (and fp16).

Peak = the best rate any of these kernels reaches in its fastest repeat (a peak is what the
hardware can do), so a network's fraction of it says how close to the hardware the network
runs. Measured in the same run as the network, on the same load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cnnkit.bench.timing import measure

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Kernel:
    """One peak-probing kernel: its name, FLOPs per call and the achieved FLOP/s."""

    name: str
    flops: float
    flops_per_second: float


def _sizes(device: torch.device, quick: bool) -> tuple[int, tuple[int, int, int]]:
    """Matmul side and conv (batch, channels, side): big enough to saturate, small enough to be quick."""
    if device.type == "cuda":
        return 8192, (128, 256, 56)
    return (512, (4, 64, 28)) if quick else (2048, (16, 256, 28))


def _matmul(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> Kernel:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    timing = measure(lambda _: a @ b, device, warmup=2, repeats=repeats)
    flops = 2.0 * n**3
    return Kernel(f"matmul {n}x{n}", flops, flops / timing.min)


def _conv(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int], repeats: int):
    batch, channels, side = shape
    x = torch.randn(batch, channels, side, side, device=device).to(dtype)
    w = torch.randn(channels, channels, 3, 3, device=device).to(dtype)
    # channels_last is the fast layout for oneDNN (CPU) and cuDNN tensor cores alike
    x = x.contiguous(memory_format=torch.channels_last)
    w = w.contiguous(memory_format=torch.channels_last)
    timing = measure(lambda _: F.conv2d(x, w, padding=1), device, warmup=2, repeats=repeats)
    flops = 2.0 * batch * channels * channels * 9 * side * side
    return Kernel(f"conv3x3 {channels}ch {side}px b{batch}", flops, flops / timing.min)


def measure_peak(
    device: torch.device, precisions: tuple[str, ...] = ("fp32", "bf16"), quick: bool = False
) -> dict[str, Kernel]:
    """Precision -> the fastest of a large matmul and a large conv in that precision."""
    n, conv_shape = _sizes(device, quick)
    repeats = 5 if device.type == "cpu" else 10
    peaks = {}
    with torch.no_grad():
        for precision in precisions:
            dtype = DTYPES[precision]
            kernels = [
                _matmul(device, dtype, n, repeats),
                _conv(device, dtype, conv_shape, repeats),
            ]
            peaks[precision] = max(kernels, key=lambda k: k.flops_per_second)
    return peaks


def peak_dict(peaks: dict[str, Kernel]) -> dict[str, dict[str, float | str]]:
    """JSON-ready: precision -> {flops_per_second, kernel}."""
    return {p: {"flops_per_second": k.flops_per_second, "kernel": k.name} for p, k in peaks.items()}
