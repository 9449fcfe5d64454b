"""The device's peak, measured and on paper, for the fraction a network's step achieves.

Measured: a large matmul and the network's own three largest convolutions, in each precision,
timed interleaved with the step itself (the same load hits all); the peak of a precision is the
fastest of its kernels. Theoretical: the data sheet for known GPUs; for a CPU, an estimate from
its vector units (flags) x cores x clock. A report never shows a fraction above 1: a step
faster than every kernel raises the peak to the step's own rate, and says so.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cnnkit.errors import plural
from cnnkit.nn import Network
from cnnkit.runtime import available_cores, cpu_flags, in_tf32

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# dense tensor-core / vector FLOP/s from NVIDIA's data sheets (no sparsity), by name fragment
DATA_SHEETS = {  # the words of the device's name each needs (the more specific first)
    ("H200", "NVL"): {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12},
    ("H200",): {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    ("H100", "NVL"): {"bf16": 835e12, "fp16": 835e12, "tf32": 418e12, "fp32": 60e12},
    ("H100", "PCIe"): {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12},
    ("H100",): {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    ("A100",): {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    ("L4",): {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
}


@dataclass(frozen=True)
class Kernel:
    """One peak-probing kernel: a call, its FLOPs and precision."""

    name: str
    precision: str
    flops: float
    run: Callable[[object], object]


def _matmul(device: torch.device, precision: str, n: int) -> Kernel:
    a = torch.randn(n, n, device=device).to(DTYPES[precision])
    b = torch.randn(n, n, device=device).to(DTYPES[precision])
    return Kernel(f"matmul {n}", precision, 2.0 * n**3, lambda _: a @ b)


def _matmul_side(device: torch.device, precision: str, largest: int,
                 budget_s: float = 0.25, probe: int = 256) -> int:  # fmt: skip
    """The side of the largest CPU matmul (a power of 2, `probe` to `largest`) whose one call
    takes about `budget_s` at most, from a timed call at `probe`: a precision the CPU has no
    units for (bf16 without AVX-512 BF16 or AMX: 1 GFLOP/s) would take a minute at 2048."""
    kernel = _matmul(device, precision, probe)
    kernel.run(None)  # (the first call sets up)
    start = time.perf_counter()
    kernel.run(None)
    seconds = max(time.perf_counter() - start, 1e-9)
    side = probe
    while side * 2 <= largest and seconds * (side * 2 / probe) ** 3 <= budget_s:
        side *= 2
    return side


def _conv_kernel(device: torch.device, precision: str, name: str, conv: torch.nn.Conv2d,
                 shape: tuple[int, ...], macs: int, batch: int) -> Kernel:  # fmt: skip
    """The network's own convolution (its input shape, stride, groups) at `batch` images."""
    dtype, fmt = DTYPES[precision], torch.channels_last
    x = torch.randn(batch, *shape, device=device).to(dtype).contiguous(memory_format=fmt)
    weight = torch.randn(conv.weight.shape, device=device).to(dtype).contiguous(memory_format=fmt)
    kw = dict(stride=conv.stride, padding=conv.padding, dilation=conv.dilation, groups=conv.groups)

    def run(_: object) -> torch.Tensor:
        return F.conv2d(x, weight, **kw)

    return Kernel(f"{name} conv b{batch}", precision, 2.0 * macs * batch, run)


def conv_inputs(model: Network) -> dict[str, tuple[int, ...]]:
    """Each convolution's input shape (C, H, W), from one pass on the meta device."""
    shapes: dict[str, tuple[int, ...]] = {}

    def record(name: str):
        def hook(module, args, output) -> None:  # returns None: the output stays as it is
            shapes.setdefault(name, tuple(args[0].shape[1:]))

        return hook

    meta = Network(model.spec, num_classes=model.num_classes, device="meta").eval()
    hooks = [m.register_forward_hook(record(name)) for name, m in meta.named_modules()
             if isinstance(m, torch.nn.Conv2d)]  # fmt: skip
    with torch.no_grad():
        meta(torch.empty((1, *model.input_shape), device="meta"))
    for hook in hooks:
        hook.remove()
    return shapes


def peak_kernels(model: Network, batch: int, device: torch.device, precisions: tuple[str, ...],
                 quick: bool = False) -> list[Kernel]:  # fmt: skip
    """A matmul plus the model's three largest convolutions, in each precision."""
    n = 8192 if device.type == "cuda" else (512 if quick else 2048)
    rows = sorted((r for r in model.table if r.type == "conv"), key=lambda r: -r.macs)[:3]
    shapes = conv_inputs(model) if rows else {}
    target = 4e11 if device.type == "cuda" else (5e7 if quick else 1e9)  # multiply-adds a call
    kernels = []
    for precision in precisions:
        side = n if device.type == "cuda" else _matmul_side(device, precision, n)
        kernels.append(_matmul(device, precision, side))
        for row in rows:
            b = max(1, min(batch, int(target / max(row.macs, 1))))
            conv = model.get_submodule(row.name)
            kernels.append(_conv_kernel(device, precision, row.name, conv, shapes[row.name],
                                        row.macs, b))  # fmt: skip
    return kernels


def best_rates(kernels: list[Kernel], seconds: dict[str, float]) -> dict[str, dict]:
    """Precision -> {flops_per_second, kernel}: the fastest of that precision's kernels."""
    best: dict[str, dict] = {}
    for k in kernels:
        rate = k.flops / seconds[k.name + " " + k.precision]
        if rate > best.get(k.precision, {}).get("flops_per_second", 0.0):
            best[k.precision] = {"flops_per_second": rate, "kernel": k.name}
    return best


def math_mode(device: torch.device, precision: str) -> str:
    """What fp32 really computes in: on CUDA, convolutions (and maybe matmuls) use TF32."""
    if device.type != "cuda" or precision != "fp32":
        return precision
    conv = in_tf32(torch.backends.cudnn.conv.fp32_precision)
    matmul = in_tf32(torch.backends.cuda.matmul.fp32_precision)
    if conv and matmul:
        return "fp32 (TF32 convolutions and matmuls)"
    return "fp32 (TF32 convolutions)" if conv else "fp32 (true fp32)"


def theoretical_peak(device: torch.device, precision: str,
                     threads: int | None = None) -> tuple[float, str] | None:  # fmt: skip
    """(FLOP/s, where the figure comes from) on paper, or None where it cannot be known; on a
    CPU, of the cores `threads` run on (one thread a core; None: every core it may use)."""
    if device.type == "cuda":
        sheet = data_sheet(torch.cuda.get_device_name(device))
        if sheet is None:
            return None
        kind = "tf32" if math_mode(device, precision).startswith("fp32 (TF32") else precision
        return sheet[1][kind], f"{sheet[0]} data sheet, dense {kind}"
    if device.type != "cpu":
        return None
    per_cycle, units = _cpu_flops_per_cycle(cpu_flags(), precision, _half_width_avx512())
    mhz = _cpu_mhz()
    if not per_cycle or not mhz:
        return None
    cores = min(available_cores(), threads or available_cores())
    note = f"estimate: {units}, {plural(cores, 'core')} x {mhz / 1000:.2f} GHz"
    return per_cycle * cores * mhz * 1e6, note


def data_sheet(name: str) -> tuple[str, dict[str, float]] | None:
    """(the data sheet's name, its dense FLOP/s by precision) of a CUDA device's name, matched
    by whole words (an L40S is not an L4, an H100 PCIe not an H100 SXM); None if unknown."""
    words = set(re.findall(r"[A-Za-z0-9]+", name))
    for key, sheet in DATA_SHEETS.items():
        if words.issuperset(key):
            return " ".join(key), sheet
    return None


def _half_width_avx512() -> bool:
    """Whether the CPU runs AVX-512 on 256-bit units (AMD's Zen 4: family 25), at half the
    per-cycle rate of Intel's and Zen 5's 512-bit ones."""
    text = _cpuinfo()
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.M)
    family = re.search(r"^cpu family\s*:\s*(\d+)", text, re.M)
    return bool(vendor and family and vendor[1] == "AuthenticAMD" and int(family[1]) == 25)


def _cpu_flops_per_cycle(
    flags: set[str], precision: str, half_width: bool = False
) -> tuple[int, str]:
    """FLOPs per cycle per core of the widest units the flags show (two FMA pipes assumed;
    `half_width`: AVX-512 on 256-bit units)."""
    if precision == "bf16" and "amx_bf16" in flags:
        return 1024, "AMX bf16 tiles"
    half = (2 if half_width else 1, " on 256-bit units" if half_width else "")
    if precision == "bf16" and "avx512_bf16" in flags:
        return 128 // half[0], f"AVX-512 BF16 dot products{half[1]}, 2 units"
    if "avx512f" in flags:
        return 64 // half[0], f"AVX-512 FMA{half[1]}, 2 units (fp32 rate)"
    if "avx2" in flags and "fma" in flags:
        return 32, "AVX2 FMA, 2 units (fp32 rate)"
    return 0, ""


def _cpuinfo() -> str:
    """/proc/cpuinfo's text ('' where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _cpu_mhz() -> float:
    found = re.findall(r"^cpu MHz\s*:\s*([\d.]+)", _cpuinfo(), re.M)
    return max((float(v) for v in found), default=0.0)
