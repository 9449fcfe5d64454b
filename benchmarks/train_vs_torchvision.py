"""Training step of zoo `alexnet-owt` under `cnnkit train`'s defaults vs torchvision's `alexnet`
in a plain fp32 NCHW PyTorch loop: same batch, same run, steps interleaved, ratio printed.

    python benchmarks/train_vs_torchvision.py --batch 64 --repeats 10              # as users run them
    python benchmarks/train_vs_torchvision.py --batch 64 --same-process --tune-malloc --explore

By default each side runs in its own process, set up as its users run it: the torchvision loop
in a plain Python process, cnnkit's engine in a process started the way the `cnnkit` command
starts (cnnkit.runtime). The parent asks each for one timed step in turn, so load drifts hit
both. --same-process runs both in this process (process-wide settings then apply to both).

Both sides take one SGD step (momentum 0.9, weight decay 5e-4) per batch on the same synthetic
(x, y); only the model is timed (the data pipeline is `cnnkit bench loader`'s business).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import torch
import torchvision

from cnnkit import build_model
from cnnkit.bench.model_setup import forward_flops
from cnnkit.bench.peak import measure_peak
from cnnkit.config import TrainConfig
from cnnkit.runtime import keep_freed_memory, machine_name
from cnnkit.train.engine import build_engine, train_step
from cnnkit.train.settings import choose_settings

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
    network = build_model("alexnet-owt")
    settings = choose_settings(network, cfg, device, batch)  # what `cnnkit train` would run
    torch.set_num_threads(settings.threads)
    engine = build_engine(network, cfg, device, settings=settings)
    if fused:
        groups = engine.network.param_groups(cfg.lr, cfg.weight_decay)
        engine.optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=True)
    x, y = batch_of(batch, device)
    x = engine.prepare(x)
    label = (
        f"cnnkit ({engine.precision}, channels_last={engine.channels_last}, compile={cfg.compile})"
    )
    return (lambda: train_step(engine, x, y)), label


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


def side_process(side: str, batch: int, device: str, threads: int | None, conn) -> None:
    """One side in its own process: build its step, then time one step per request."""
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    torch.manual_seed(0)
    if side == "cnnkit":
        keep_freed_memory()  # what the `cnnkit` command does first
        step, label = cnnkit_step(batch, dev)
    else:
        step, label = plain_step(batch, dev), "torchvision fp32 NCHW"
    conn.send(label)
    while conn.recv():
        conn.send(timed(step, dev))


def interleaved_processes(args) -> tuple[dict[str, list[float]], str]:
    """Both sides in their own processes, one timed step each in turn (order alternating)."""
    # Idle OpenMP threads of the waiting side must sleep, not spin on the cores the other side
    # is timing (libgomp spins ~300 ms after each parallel region by default).
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    ctx = mp.get_context("spawn")
    sides = {}
    for side in ("torchvision", "cnnkit"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=side_process, args=(side, args.batch, args.device, args.threads, child)
        )
        proc.start()
        sides[parent.recv()] = (parent, proc)
    names = list(sides)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.warmup + args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            sides[name][0].send(True)
            elapsed = sides[name][0].recv()
            if r >= args.warmup:
                seconds[name].append(elapsed)
    for conn, proc in sides.values():
        conn.send(False)
        proc.join()
    return seconds, names[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--same-process", action="store_true", help="both sides in this process")
    parser.add_argument("--explore", action="store_true", help="also time variants (same process)")
    parser.add_argument(
        "--tune-malloc", action="store_true", help="same process: keep freed memory, both sides"
    )
    parser.add_argument("--json", action="store_true", help="end with a JSON line")
    args = parser.parse_args()
    device = torch.device(args.device)
    if not (args.same_process or args.explore):
        seconds, label = interleaved_processes(args)
        return report(seconds, label, args, device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tune_malloc and not keep_freed_memory():
        parser.error("--tune-malloc: glibc's mallopt is not available here")
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
    where = "one process" if args.same_process or args.explore else "a process per side"
    tuned = "both sides" if args.tune_malloc else "cnnkit's side (as the cnnkit command)"
    if args.same_process or args.explore:
        tuned = "both sides" if args.tune_malloc else "neither side"
    print(
        f"{machine_name(device)}, torch {torch.__version__}, batch {args.batch}, {where}, "
        f"{args.repeats} interleaved repeats (median; min-max), freed memory kept: {tuned}"
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
                    "hardware": machine_name(device),
                    "tune_malloc": args.tune_malloc,
                    "same_process": bool(args.same_process or args.explore),
                    "peaks": {p: k.flops_per_second for p, k in peaks.items()},
                    "rows": rows,
                }
            )
        )


if __name__ == "__main__":
    main()
