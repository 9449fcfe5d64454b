"""Data-parallel scaling: images/s of cnnkit's training step with 1 vs N processes under torchrun
(gloo on CPU, NCCL one process per GPU), and the scaling efficiency.

    python benchmarks/ddp_scaling.py --model digitnet --batch 64 --steps 30 --nproc 1 2
    python benchmarks/ddp_scaling.py --model alexnet-owt --batch 128 --device cuda --nproc 1 2 4 8

Weak scaling: each process keeps --batch images per step (the global batch grows with N), as
when adding GPUs. efficiency(N) = images/s(N) / (N x images/s(1)). Each figure is the median
of --repeats timed windows after warm-up, every rank synchronised before the clock stops.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's cnnkit


def worker(args: argparse.Namespace) -> None:
    """One torchrun process: time cnnkit's train_step under DDP; rank 0 writes the result."""
    import torch
    import torch.distributed as dist

    from cnnkit import build_model
    from cnnkit.config import TrainConfig
    from cnnkit.distributed import Group
    from cnnkit.train.engine import build_engine, train_step
    from cnnkit.train.settings import choose_settings

    cfg = TrainConfig(device=args.device, sync=args.sync)
    group = Group(cfg)
    device = group.device(args.device)
    torch.manual_seed(0)
    network = build_model(args.model)
    settings = group.broadcast_object(  # as `cnnkit train` picks them: rank 0's, everywhere
        choose_settings(network, cfg, device, args.batch) if group.is_main else None
    )
    engine = build_engine(network, cfg, device, wrap=group.wrap, settings=settings)
    torch.set_num_threads(min(settings.threads, torch.get_num_threads()))
    x = torch.randn(args.batch, *network.input_shape, device=device)
    y = torch.randint(0, network.num_classes or 10, (args.batch,), device=device)
    windows = []
    for i in range(args.repeats + 1):  # the first window is warm-up
        dist.barrier()
        start = time.perf_counter()
        for step in range(args.steps):
            train_step(engine, x, y)
            group.after_step(engine, step + 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        if i:
            windows.append(
                args.steps * args.batch * group.world_size / (time.perf_counter() - start)
            )
    if group.is_main:
        result = {"nproc": group.world_size, "images_per_second": statistics.median(windows),
                  "spread": [min(windows), max(windows)], "device": str(device),
                  "precision": engine.precision, "threads": torch.get_num_threads()}  # fmt: skip
        Path(args.result).write_text(json.dumps(result))
    group.close()


def launch(args: argparse.Namespace, nproc: int) -> dict:
    """Run this script under torchrun with `nproc` processes; return rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", __file__, "--worker", "--result", str(result),
               "--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps),
               "--repeats", str(args.repeats), "--device", args.device, "--sync", args.sync]  # fmt: skip
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(args.threads or max(1, os.cpu_count() // nproc)),
        }
        done = subprocess.run(cmd, env=env, capture_output=not args.verbose, text=True)
        if done.returncode:  # the ranks' own error, not torchrun's CalledProcessError
            said = [re.sub(r"^\[rank\d+\]: ", "", line) for line in (done.stderr or "").splitlines()
                    if re.match(r"(\[rank\d+\]: )?\w[\w.]*(Error|Exception): ", line)]  # fmt: skip
            raise SystemExit(f"{nproc} processes failed (exit {done.returncode}): "
                             f"{said[0] if said else 'run with --verbose to see why'}")  # fmt: skip
        return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--model", default="digitnet", help="zoo network or network file")
    parser.add_argument("--batch", type=int, default=64, help="images per process per step")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed window")
    parser.add_argument("--repeats", type=int, default=3, help="timed windows (median)")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="process counts")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    parser.add_argument("--sync", default="ddp", choices=["ddp", "average"], help="train.sync")
    parser.add_argument("--threads", type=int, default=None, help="OMP threads per process")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--verbose", action="store_true", help="show the ranks' output")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if min(args.nproc + [args.batch, args.steps, args.repeats]) < 1:
        parser.error("--nproc, --batch, --steps and --repeats must be >= 1")
    if args.json and not args.json.parent.is_dir():  # before the run, not after
        parser.error(f"--json {args.json}: no folder {args.json.parent}")
    nprocs = sorted(set(args.nproc) | {1})  # efficiency is against 1 process: always timed
    results = [launch(args, n) for n in nprocs]
    base = results[0]["images_per_second"]  # 1 process
    print(f"{args.model}, {args.batch} images per process, {args.device}, sync {args.sync}")
    print(f"{'processes':>9} {'images/s':>10} {'per process':>12} {'efficiency':>10}")
    for r in results:
        r["efficiency"] = r["images_per_second"] / (r["nproc"] * base)
        print(f"{r['nproc']:>9} {r['images_per_second']:>10.0f} "
              f"{r['images_per_second'] / r['nproc']:>12.0f} {r['efficiency']:>10.0%}")  # fmt: skip
    if args.json:
        tmp = args.json.with_name(args.json.name + ".tmp")  # whole or not at all
        tmp.write_text(json.dumps(results, indent=2) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
