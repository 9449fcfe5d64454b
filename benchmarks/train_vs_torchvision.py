"""Training step of zoo `alexnet-owt` under `cnnkit train`'s defaults vs torchvision's `alexnet`
in a plain fp32 NCHW PyTorch loop: same batch, same process, steps interleaved, ratio printed.

    python benchmarks/train_vs_torchvision.py --batch 64 --repeats 10
    python benchmarks/train_vs_torchvision.py --batch 64 --explore   # which setting buys what

Both sides take one SGD step (momentum 0.9, weight decay 5e-4) per batch on the same synthetic
(x, y); only the model is timed (the data pipeline is `cnnkit bench loader`'s business).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch
import torchvision

from cnnkit import build_model
from cnnkit.bench.model_setup import forward_flops
from cnnkit.bench.peak import measure_peak
from cnnkit.bench.timing import device_name
from cnnkit.config import TrainConfig
from cnnkit.train.engine import build_engine, train_step

# (name, train: overrides) of the variants --explore times against the plain fp32 loop;
# "fused" is a what-if: the engine's optimizer replaced by torch's fused SGD (one kernel)
VARIANTS = [
    ("fp32 channels_last", {"precision": "fp32", "channels_last": True}),
    ("bf16 NCHW", {"precision": "bf16", "channels_last": False}),
    ("bf16 channels_last", {"precision": "bf16", "channels_last": True}),
    ("bf16 channels_last compile", {"precision": "bf16", "channels_last": True, "compile": True}),
    ("bf16 channels_last + fused SGD (what-if)", {"precision": "bf16", "fused": True}),
]


def plain_step(batch: int, device: torch.device):
    """torchvision's alexnet, fp32, NCHW, the textbook loop."""
    model = torchvision.models.alexnet(num_classes=1000).to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = batch_of(batch, device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    return step


def cnnkit_step(batch: int, device: torch.device, overrides: dict | None = None):
    """zoo alexnet-owt through the training engine with `cnnkit train`'s defaults (+ overrides)."""
    overrides = dict(overrides or {})
    fused = overrides.pop("fused", False)
    cfg = TrainConfig(device=str(device), **overrides)
    engine = build_engine(build_model("alexnet-owt"), cfg, device)
    if fused:
        groups = engine.network.param_groups(cfg.lr, cfg.weight_decay)
        engine.optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=True)
    x, y = batch_of(batch, device)
    x = engine.prepare(x)
    label = (
        f"cnnkit ({engine.precision}, channels_last={engine.channels_last}, compile={cfg.compile})"
    )
    return (lambda: train_step(engine, x, y)), label


def tune_malloc() -> bool:
    """glibc: serve big blocks from the heap and never trim it, so freed tensors are reused
    instead of being unmapped and page-faulted in again every step (process-wide: both sides)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30))


def batch_of(batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 224, 224, generator=generator)
    return x.to(device), torch.randint(0, 1000, (batch,), generator=generator).to(device)


def timed(step, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def interleaved(steps: dict[str, object], device, warmup: int, repeats: int) -> dict[str, list]:
    """Time every step `repeats` times, alternating sides (and their order) so load drifts hit all."""
    for step in steps.values():
        for _ in range(warmup):
            timed(step, device)
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            seconds[name].append(timed(steps[name], device))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--explore", action="store_true", help="also time the variants")
    parser.add_argument(
        "--tune-malloc", action="store_true", help="glibc mallopt for both sides (see tune_malloc)"
    )
    parser.add_argument("--json", action="store_true", help="end with a JSON line")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tune_malloc and not tune_malloc():
        parser.error("--tune-malloc: glibc's mallopt is not available here")
    device = torch.device(args.device)
    torch.manual_seed(0)
    steps = {"torchvision fp32 NCHW": plain_step(args.batch, device)}
    step, label = cnnkit_step(args.batch, device)
    steps[label] = step
    if args.explore:
        for name, overrides in VARIANTS:
            steps[f"cnnkit {name}"] = cnnkit_step(args.batch, device, overrides)[0]
    seconds = interleaved(steps, device, args.warmup, args.repeats)
    report(seconds, label, args, device)


def report(seconds: dict[str, list[float]], label: str, args, device: torch.device) -> None:
    flops = 3 * forward_flops(build_model("alexnet-owt", device="meta"))
    peaks = measure_peak(device)
    baseline = statistics.median(seconds["torchvision fp32 NCHW"])
    print(
        f"{device_name(device)}, torch {torch.__version__}, batch {args.batch}, "
        f"{args.repeats} interleaved repeats (median; min-max), malloc tuned: {args.tune_malloc}"
    )
    rows = {}
    for name, times in seconds.items():
        median = statistics.median(times)
        rate = args.batch / median
        peak = peaks["fp32" if "fp32" in name else "bf16"].flops_per_second
        rows[name] = {
            "images_per_second": rate,
            "step_ms": median * 1e3,
            "speedup": baseline / median,
            "peak_fraction": rate * flops / peak,
        }
        print(
            f"  {name:48s} {rate:7.1f} images/s  {median * 1e3:8.1f} ms "
            f"({min(times) * 1e3:.0f}-{max(times) * 1e3:.0f})  x{baseline / median:.2f}  "
            f"{100 * rate * flops / peak:.1f}% of {'fp32' if 'fp32' in name else 'bf16'} peak"
        )
    ratio = rows[label]["images_per_second"] / rows["torchvision fp32 NCHW"]["images_per_second"]
    print(f"cnnkit defaults / torchvision plain fp32 = {ratio:.2f}x images/s")
    if args.json:
        print(
            json.dumps(
                {
                    "ratio": ratio,
                    "batch": args.batch,
                    "hardware": device_name(device),
                    "tune_malloc": args.tune_malloc,
                    "peaks": {p: k.flops_per_second for p, k in peaks.items()},
                    "rows": rows,
                }
            )
        )


if __name__ == "__main__":
    main()
