"""`cnnkit bench train|infer`: images/s, step time, achieved FLOP/s and its fraction of the
device's measured peak (large matmul and conv timed in the same run).

FLOPs come from the layer table's multiply-adds (conv and linear): 2 per multiply-add forward,
and training counted as 3x the forward (backward ~ 2x forward), the usual convention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cnnkit.bench.baseline import PlainProcess
from cnnkit.bench.model_setup import forward_flops, load_network, synthetic_batch
from cnnkit.bench.peak import measure_peak, peak_dict
from cnnkit.bench.timing import (
    Timing,
    autocast,
    check_precision,
    device_name,
    measure_interleaved,
)
from cnnkit.config import TrainConfig
from cnnkit.nn import Network
from cnnkit.train.engine import Engine, build_engine, resolve_precision, train_step

TRAIN_FLOPS_FACTOR = 3.0  # forward + backward (grad of inputs and of weights) ~ 3x forward


def train_config(
    device: torch.device,
    precision: str | None = "auto",
    channels_last: bool | None = None,
    compile: bool = False,
) -> TrainConfig:
    """`cnnkit train`'s default `train:` section with this device and these overrides."""
    if precision not in (None, "auto"):
        check_precision(precision, device)
    return TrainConfig(
        device=str(device),
        precision=precision or "auto",
        channels_last=channels_last,
        compile=compile,
    )


def resolve_settings(
    device: torch.device, precision: str | None, channels_last: bool | None
) -> tuple[str, bool]:
    """(precision, channels_last) with 'auto' / None filled in as `cnnkit train` fills them."""
    return resolve_precision(train_config(device, precision, channels_last), device)


def make_train_step(
    network: Network, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig
) -> tuple[Callable[[Any], Any], Engine]:
    """The training engine's real step (optimizer, precision, memory format as `cnnkit train`)."""
    engine = build_engine(network, cfg, torch.device(cfg.device))
    x = engine.prepare(x)
    return (lambda _: train_step(engine, x, y)), engine


def make_infer_step(model: Network, x: torch.Tensor, device: torch.device, precision: str):
    """One classification forward pass in eval mode, without autograd."""

    def step(_: Any = None) -> None:
        with torch.inference_mode(), autocast(device, precision):
            model(x)

    return step


def bench_throughput(
    net: str | dict[str, Any],
    mode: str,
    batch: int,
    device: torch.device,
    precision: str | None = "auto",
    channels_last: bool | None = None,
    compile: bool = False,
    warmup: int | None = None,
    repeats: int | None = None,
    num_classes: int | None = None,
    quick_peak: bool = False,
    baseline: bool = False,
) -> dict[str, Any]:
    """Time `mode` ('train' or 'infer') steps of a network; a JSON-ready report with the peak.

    With `baseline`, a plain fp32 NCHW PyTorch loop of the same architecture is timed in the
    same run, in a plain process of its own (PlainProcess), steps interleaved with cnnkit's,
    and the speed-up over it is reported.
    """
    cfg = train_config(device, precision, channels_last, compile)
    precision, channels_last = resolve_precision(cfg, device)  # 'auto' -> the engine's choice
    model = load_network(net, device, num_classes, channels_last=mode == "infer" and channels_last)
    x, y = synthetic_batch(model, batch, device, channels_last)
    steps = {"cnnkit": _cnnkit_step(model, mode, x, y, cfg)}
    plain = PlainProcess(model, mode, batch, device) if baseline else None
    if plain is not None:
        steps[plain.name] = plain
    warmup, repeats = _counts(device, compile, warmup, repeats)
    try:
        timings = measure_interleaved(
            steps, device, warmup=warmup, repeats=repeats, max_seconds=120.0
        )
    finally:
        if plain is not None:
            plain.close()
    peaks = measure_peak(device, tuple(dict.fromkeys(("fp32", "bf16", precision))), quick_peak)
    factor = TRAIN_FLOPS_FACTOR if mode == "train" else 1.0
    settings = {"precision": precision, "channels_last": channels_last, "compile": compile}
    report = _report(model, mode, batch, device, settings, timings.pop("cnnkit"), factor, peaks)
    for peer_name, timing in timings.items():
        report["baseline"] = {
            "name": peer_name,
            "images_per_second": batch / timing.median,
            "step_ms": timing.median * 1e3,
            "step": timing.to_dict(),
        }
        report["speedup_vs_baseline"] = timing.median * 1e3 / report["step_ms"]
    return report


def _cnnkit_step(model: Network, mode: str, x, y, cfg: TrainConfig) -> Callable[[Any], Any]:
    """The engine's training step, or an inference pass in the engine's precision and format."""
    device = torch.device(cfg.device)
    if mode == "train":
        return make_train_step(model, x, y, cfg)[0]
    precision, _ = resolve_precision(cfg, device)
    runnable = torch.compile(model) if cfg.compile else model
    model.eval()
    return make_infer_step(runnable, x, device, precision)  # type: ignore[arg-type]


def _counts(device: torch.device, compile: bool, warmup: int | None, repeats: int | None):
    """Warm-up and repeat counts: more on a GPU (steps are short), 2 warm-ups when compiling."""
    default_warmup, default_repeats = (5, 30) if device.type == "cuda" else (1, 5)
    warmup = default_warmup if warmup is None else warmup
    return (max(warmup, 2) if compile else warmup), (
        default_repeats if repeats is None else repeats
    )


def _report(model, mode, batch, device, settings, timing: Timing, factor, peaks) -> dict[str, Any]:
    flops_per_image = factor * forward_flops(model)
    images_per_second = batch / timing.median
    flops_per_second = flops_per_image * images_per_second
    peak = peaks[settings["precision"]].flops_per_second
    return {
        "net": model.name,
        "mode": mode,
        "device": str(device),
        "hardware": device_name(device),
        "torch": torch.__version__,
        "batch": batch,
        **settings,
        "images_per_second": images_per_second,
        "step_ms": timing.median * 1e3,
        "step": timing.to_dict(),
        "flops_per_image": flops_per_image,
        "flops_per_second": flops_per_second,
        "peak": peak_dict(peaks),
        "peak_flops_per_second": peak,
        "peak_fraction": flops_per_second / peak,
    }


def print_throughput(report: dict[str, Any], console: Any = None) -> None:
    """A few human lines: settings, images/s, step times, FLOP/s against the peak."""
    from cnnkit.nn.summary import wide_console

    console = console or wide_console()
    r, s = report, report["step"]
    console.print(
        f"{r['net']} {r['mode']}  batch {r['batch']}  {r['device']} ({r['hardware']})  "
        f"{r['precision']}  channels_last={r['channels_last']}  compile={r['compile']}"
    )
    console.print(
        f"  {r['images_per_second']:.1f} images/s   step median {s['median_ms']:.2f} ms  "
        f"min {s['min_ms']:.2f}  max {s['max_ms']:.2f}  ({s['repeats']} repeats)"
    )
    peaks = ", ".join(
        f"{p} {v['flops_per_second'] / 1e12:.3f} TFLOP/s ({v['kernel']})"
        for p, v in r["peak"].items()
    )
    console.print(
        f"  {r['flops_per_second'] / 1e12:.3f} TFLOP/s achieved = "
        f"{100 * r['peak_fraction']:.1f}% of the measured {r['precision']} peak"
    )
    console.print(f"  measured peaks: {peaks}", markup=False, soft_wrap=True)
    if "baseline" in r:
        b = r["baseline"]
        console.print(
            f"  baseline {b['name']}: {b['images_per_second']:.1f} images/s, step median "
            f"{b['step_ms']:.2f} ms (interleaved) -> cnnkit {r['speedup_vs_baseline']:.2f}x",
            soft_wrap=True,
        )
