"""CPU inference: a cnnkit network in PyTorch (fp32, eager, with the memory format, linear
products and allocator setting `cnnkit classify` runs with) vs the same network exported by
`cnnkit export --format onnx` and run in ONNX Runtime. Same batch, same process, runs
interleaved, medians and the ratio printed.

    python benchmarks/classify_vs_onnxruntime.py --net alexnet --batch 16 --repeats 10
    python benchmarks/classify_vs_onnxruntime.py --net runs/digits --batch 256 --threads 2

--net takes a zoo name, network file, run directory or checkpoint.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime as ort
import torch

from cnnkit.errors import CnnkitError
from cnnkit.infer.export import export
from cnnkit.infer.load import load_for_inference
from cnnkit.nn.kernels import set_kernels
from cnnkit.nn.onednn import freeze
from cnnkit.nn.tuning import choose_inference_kernels
from cnnkit.runtime import keep_freed_memory, machine_name


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--net", default="alexnet", help="zoo network or network file")
    parser.add_argument("--batch", type=int, default=16, help="images per forward pass")
    parser.add_argument("--repeats", type=int, default=10, help="timed passes (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed passes first")
    parser.add_argument("--threads", type=int, default=0, help="0: the libraries' defaults")
    args = parser.parse_args()
    if args.batch < 1 or args.repeats < 1 or args.warmup < 0 or args.threads < 0:
        parser.error("--batch and --repeats must be >= 1, --warmup and --threads >= 0")
    return args


def time_interleaved(runners: dict, x: torch.Tensor, warmup: int, repeats: int) -> dict:
    """Seconds per call of each runner, alternating runners every repeat (the order reversed
    every other repeat: neither always runs right after the other)."""
    for run in runners.values():
        for _ in range(warmup):
            run(x)
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    for repeat in range(repeats):
        order = list(runners.items())
        for name, run in order[::-1] if repeat % 2 else order:
            start = time.perf_counter()
            run(x)
            seconds[name].append(time.perf_counter() - start)
    return seconds


def main() -> None:
    args = parse_args()
    keep_freed_memory()  # as `cnnkit classify` runs (both sides gain: ORT allocates with malloc)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_for_inference(args.net)
    model = loaded.model.eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        export(loaded, "onnx", path)
        options = ort.SessionOptions()
        # idle ORT threads otherwise spin on the cores PyTorch's next (interleaved) call runs on
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if args.threads:
            options.intra_op_num_threads = args.threads
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    x = torch.randn(args.batch, *model.input_shape)
    channels_last, plan = choose_inference_kernels(model, torch.device("cpu"), args.batch)
    if channels_last:  # as Classifier does, which converts each batch (counted here too)
        model = model.to(memory_format=torch.channels_last)
    freeze(set_kernels(model, plan))  # as Classifier does: oneDNN's linear layers pack weights

    def pytorch(batch: torch.Tensor):
        with torch.inference_mode():
            if channels_last:
                batch = batch.contiguous(memory_format=torch.channels_last)
            return model(batch)

    def onnxruntime(batch: torch.Tensor):
        return session.run(None, {"image": batch.numpy()})[0]

    diff = float((pytorch(x) - torch.from_numpy(onnxruntime(x))).abs().max())
    seconds = time_interleaved(
        {"pytorch": pytorch, "onnxruntime": onnxruntime}, x, args.warmup, args.repeats
    )
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    print(f"{args.net}  batch {args.batch}  {machine_name(torch.device('cpu'))}  "
          f"torch threads {torch.get_num_threads()}  channels_last {channels_last}  "
          f"kernels {sorted(set(plan.values())) or 'plain'}  "
          f"max abs diff {diff:.2e}")  # fmt: skip
    for name, median in medians.items():
        print(f"  {name:12s} {median * 1e3:9.2f} ms/batch  {args.batch / median:9.1f} images/s")
    ratio = medians["pytorch"] / medians["onnxruntime"]
    print(f"  onnxruntime / pytorch speed: {ratio:.2f}x")
    record = {"net": args.net, "batch": args.batch, "channels_last": channels_last, "kernels": plan,
              "max_abs_diff": diff, "speedup": ratio}  # fmt: skip
    record.update({f"{k}_ms": v * 1e3 for k, v in medians.items()})
    print(json.dumps(record))


if __name__ == "__main__":
    try:
        main()
    except CnnkitError as e:  # a user mistake (--net nonet): its one line, as cnnkit says it
        print(f"cnnkit: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
