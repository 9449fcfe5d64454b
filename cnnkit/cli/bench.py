"""`cnnkit bench layers|train|infer|scaling`: speed measurements (the loader's is in cli/data.py).

With --json the last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from cnnkit.cli.net import NUM_CLASSES

NET = typer.Argument(
    ..., help="A zoo name, network / run file, Caffe prototxt, run directory, checkpoint or "
    ".safetensors export (its network: the weights do not change the speed).",
)  # fmt: skip
BATCH = typer.Option(
    None, "--batch", "-b", help="Images per step (default: 64; bench train|layers RUN: the "
    "run's data.batch_size, as cnnkit train runs it).",
)  # fmt: skip
DEFAULT_BATCH = 64
DEVICE = typer.Option("auto", "--device", "-d", help="auto | cpu | cuda | cuda:N")
CHANNELS_LAST = typer.Option(
    None, "--channels-last/--no-channels-last",
    help="NHWC memory format on or off (default: as cnnkit train chooses; bench infer: as "
    "cnnkit classify, whose precision stays fp32 on a CPU either way).",
)  # fmt: skip
PRECISION = typer.Option("auto", "--precision", "-p", help="auto | fp32 | bf16 | fp16")
JSON = typer.Option(False, "--json", help="End with one line of JSON holding every figure.")
REPEATS = typer.Option(
    None,
    "--repeats",
    min=1,
    help="Timed repeats (default: 5 on CPU, 10 on GPU, where each is a block of 10 steps).",
)
WARMUP = typer.Option(
    None,
    "--warmup",
    min=0,
    help="Untimed warm-ups first (GPU: blocks of 10 steps; at least 2 with --compile).",
)
THREADS = typer.Option(
    None, "--threads", min=1, help="CPU threads (default: as cnnkit train picks)."
)
BASELINE = typer.Option(
    False,
    "--baseline",
    help="Also time the same network (alexnet-owt: torchvision's alexnet) in a plain fp32 NCHW "
    "PyTorch loop and in a careful one (autocast + channels_last), each in its own process, "
    "interleaved in the same run; report both speed-ups.",
)
QUICK = typer.Option(
    False, "--quick", help="Small CPU peak kernels (a smoke run, not a figure; GPU: no change)."
)
EXPLORE = typer.Option(
    False, "--explore", help="Also time every precision / format / threads combination."
)
COMPILE = typer.Option(
    None, "--compile/--no-compile",
    help="torch.compile the model (default: as the run sets train.compile; a network: off).",
)  # fmt: skip
INFER_COMPILE = typer.Option(
    None, "--compile/--no-compile",
    help="torch.compile the model (default: off, as cnnkit classify runs it).",
)  # fmt: skip
MAX_SECONDS = typer.Option(
    120.0, "--max-seconds", min=1.0,
    help="Stop repeating after this long (at least two repeats of each timed step, one in "
    "each order, and the warm-ups): keep it "
    "under a caller's own time limit, so a slow run still reports what it measured.",
)  # fmt: skip


def _as_the_command_runs() -> None:
    """What `cnnkit train` starts with, so that a benchmark measures what training runs; a note
    where other programs keep the machine busy."""
    import torch

    from cnnkit.bench.timing import say_if_busy
    from cnnkit.runtime import available_cores, keep_freed_memory, tf32_matmuls

    say_if_busy(available_cores())
    keep_freed_memory()
    torch.backends.cudnn.benchmark = True  # as `cnnkit train` runs (unless deterministic)
    tf32_matmuls()  # as `cnnkit train` runs fp32 on CUDA


def register(app: typer.Typer, bench: typer.Typer) -> None:
    bench.command("layers")(layers)
    bench.command("train")(train)
    bench.command("infer")(infer)
    bench.command("scaling")(scaling)


def layers(
    net: str = NET,
    batch: int = BATCH,
    device: str = DEVICE,
    precision: str = PRECISION,
    channels_last: bool = CHANNELS_LAST,
    repeats: int = typer.Option(5, "--repeats", min=1, help="Timed repeats per measurement."),
    warmup: int = typer.Option(1, "--warmup", min=0, help="Untimed calls before each measurement."),
    num_classes: int = NUM_CLASSES,
    threads: int = THREADS,
    as_json: bool = JSON,
) -> None:
    """Per-layer forward and backward ms, and the whole passes timed as a whole (like caffe time).

    Precision, memory format and threads are `cnnkit train`'s choice for this network here.
    """
    _as_the_command_runs()
    from cnnkit.bench.layers import bench_layers, print_layers
    from cnnkit.bench.model_setup import check_batch
    from cnnkit.bench.throughput import settings_for
    from cnnkit.distributed import resolve_device
    from cnnkit.runtime import torch_threads
    from cnnkit.train.run import deterministic_mode

    dev = resolve_device(device)
    run = _as_the_run_sets(net, batch, precision, channels_last, threads, device=dev)
    run.pop("compile"), run.pop("step")  # (per-layer times: the layers' passes, eagerly)
    batch, (net, num_classes) = run["batch"], _network_of(net, num_classes)
    _positive(batch=batch, repeats=repeats, **({"threads": threads} if threads else {}))
    check_batch(net, batch, dev, num_classes, training=True)
    s = settings_for(net, dev, num_classes=num_classes, **run)
    with deterministic_mode(run["deterministic"], dev), torch_threads(s.threads):
        report = bench_layers(net, batch, dev, s.precision, s.channels_last, warmup, repeats,
                              num_classes=num_classes, progress=_say, kernels=dict(s.kernels))  # fmt: skip
    report["settings"] = s.describe(run["threads"])
    print_layers(report)
    _emit(report, as_json)


def train(
    net: str = NET,
    batch: int = BATCH,
    device: str = DEVICE,
    precision: str = PRECISION,
    channels_last: bool = CHANNELS_LAST,
    compile: bool = COMPILE,
    repeats: int = REPEATS,
    warmup: int = WARMUP,
    num_classes: int = NUM_CLASSES,
    baseline: bool = BASELINE,
    quick: bool = QUICK,
    threads: int = THREADS,
    explore: bool = EXPLORE,
    max_seconds: float = MAX_SECONDS,
    as_json: bool = JSON,
) -> None:
    """Training throughput with the engine's real step, as `cnnkit train` would run it:
    images/s, step ms, FLOP/s against the peak."""
    _throughput("train", **locals())


def infer(
    net: str = NET,
    batch: int = BATCH,
    device: str = DEVICE,
    precision: str = PRECISION,
    channels_last: bool = CHANNELS_LAST,
    compile: bool = INFER_COMPILE,
    repeats: int = REPEATS,
    warmup: int = WARMUP,
    num_classes: int = NUM_CLASSES,
    baseline: bool = BASELINE,
    quick: bool = QUICK,
    threads: int = THREADS,
    explore: bool = EXPLORE,
    max_seconds: float = MAX_SECONDS,
    as_json: bool = JSON,
) -> None:
    """Classification throughput (eval mode, no autograd) with `cnnkit classify`'s settings
    (on a CPU fp32; --precision bf16 times the forward pass a bf16 run's `cnnkit eval` runs):
    images/s, step ms, FLOP/s against the peak."""
    _throughput("infer", **locals())


def scaling(
    devices: str = typer.Option(
        None, "--devices", help="Comma list, e.g. cpu,cuda (default: all)."
    ),
    precision: str = typer.Option("fp32", "--precision", "-p", help="fp32 | bf16 | fp16"),
    out: Path = typer.Option(Path("."), "--out", "-o", help="Folder for scaling.json/.png."),
    quick: bool = typer.Option(False, "--quick", help="Fewer networks and repeats (a smoke run)."),
    as_json: bool = JSON,
) -> None:
    """The CPU-vs-GPU study of Strigl et al. 2010: growing networks timed on every device, with speed-ups."""
    _as_the_command_runs()
    from cnnkit.bench.scaling import (
        check_replaceable,
        ensure_dir,
        parse_devices,
        print_scaling,
        run_scaling,
        write_outputs,
    )
    from cnnkit.bench.timing import check_precision

    chosen = parse_devices(devices)
    for dev in chosen[0]:
        check_precision(precision, dev, auto=False)
    out = ensure_dir(out)  # fail before minutes of timing, not after
    check_replaceable(out, quick)  # files cnnkit did not write, a full study
    if chosen[1]:
        print(chosen[1])  # CPU only: say so before the run, not after
    report = run_scaling(chosen, precision, quick=quick)
    try:
        paths = write_outputs(report, out)  # first: a broken stdout loses no study
    except OSError:  # (a full disk): the figures on the screen at least, then the error
        print_scaling(report)
        raise
    print_scaling(report)
    print("wrote " + ", ".join(str(p) for p in paths))
    _emit(report, as_json)


def _throughput(
    mode: str, net: str, device: str, quick: bool, threads: int | None, as_json: bool, **options
) -> None:
    _as_the_command_runs()
    from cnnkit.bench.model_setup import check_batch
    from cnnkit.bench.throughput import bench_throughput, print_throughput
    from cnnkit.distributed import resolve_device
    from cnnkit.train.run import deterministic_mode

    dev = resolve_device(device)
    if mode == "train":  # (infer: classification's settings, whatever the run trains with)
        options.update(_as_the_run_sets(net, options["batch"], options["precision"],
                                        options["channels_last"], threads,
                                        options["compile"], dev))  # fmt: skip
        threads = options.pop("threads")
    options["compile"] = bool(options["compile"])  # infer: off unless asked
    options["batch"] = DEFAULT_BATCH if options["batch"] is None else options["batch"]
    net, options["num_classes"] = _network_of(net, options["num_classes"])
    _positive(batch=options["batch"], repeats=options["repeats"] or 1)
    if threads is not None:
        _positive(threads=threads)
    step = options.get("step")
    check_batch(net, options["batch"], dev, options["num_classes"], training=mode == "train",
                accumulate=step.accumulate if step is not None else 1)  # fmt: skip
    with deterministic_mode(options.get("deterministic", False), dev):
        report = bench_throughput(net, mode, device=dev, quick_peak=quick, threads=threads,
                                  **options)  # fmt: skip
    print_throughput(report)
    _emit(report, as_json)


def _as_the_run_sets(net: str, batch: int | None, precision: str, channels_last: bool | None,
                     threads: int | None, compile: bool | None = None,
                     device: Any = None) -> dict[str, Any]:  # fmt: skip
    """batch, precision, channels_last, threads, compile, calibrate, deterministic and the
    step (its `train:` section) as `cnnkit train` runs NET: where NET is a run (a zoo run, a
    run file, a run directory or a checkpoint in one: its config.yaml), its data.batch_size
    and what its `train:` and `deterministic` set (options given here win); for a network,
    the options and the default step."""
    from cnnkit.checkpoint import file_kind
    from cnnkit.config import load_run
    from cnnkit.errors import ConfigError
    from cnnkit.zoo import NETS

    chosen = {"batch": DEFAULT_BATCH if batch is None else batch, "precision": precision,
              "channels_last": channels_last, "threads": threads, "calibrate": True,
              "deterministic": False, "compile": bool(compile), "step": None}  # fmt: skip
    if net in NETS:
        return chosen
    path = Path(net)  # a run directory, or a checkpoint in one: the run's own config.yaml
    checkpoint = file_kind(path) == "checkpoint"  # (by its contents where its name does not say)
    folder = path if path.is_dir() else path.parent if checkpoint else None
    if folder is not None and (folder / "config.yaml").is_file():
        net = str(folder / "config.yaml")
    if not _a_run_file(net):  # a network file: build_model says what is wrong with it
        return chosen
    run = load_run(net)  # a run's mistakes are its one line, as `cnnkit train` says them
    train = run.train
    cuda = device is None or device.type == "cuda"
    if precision == "auto" and train.precision == "fp16" and not cuda:  # not --precision's
        raise ConfigError(f"{net}: train.precision: fp16 needs a CUDA device (give --precision "
                          "bf16 or fp32 to time it on the CPU)")  # fmt: skip
    return {"batch": run.data.batch_size if batch is None else batch,
            "precision": train.precision if precision == "auto" else precision,
            "channels_last": train.channels_last if channels_last is None else channels_last,
            "threads": train.threads if threads is None else threads,
            "compile": train.compile if compile is None else compile,
            "calibrate": train.calibrate, "deterministic": run.deterministic,
            "step": train}  # fmt: skip


def _a_run_file(net: str) -> bool:
    """Whether NET is a run file (a zoo run, or YAML with a `data:` or `train:` section beside
    its `model:`), not a network file."""
    from cnnkit.errors import CnnkitError
    from cnnkit.nn.yamlio import read_yaml
    from cnnkit.zoo import RUNS

    path = Path(net)
    if net in RUNS:
        return True
    if path.suffix.lower() not in (".yaml", ".yml") or not path.is_file():
        return False
    try:
        raw = read_yaml(path)
    except (CnnkitError, OSError):  # unreadable: build_model's line says why
        return False
    return isinstance(raw, dict) and "model" in raw and bool({"data", "train"} & set(raw))


def _network_of(net: str, num_classes: int | None) -> tuple[str | dict, int | None]:
    """(what the benchmarks build, its class count), as `cnnkit info` reads NET: a run
    directory, checkpoint, .safetensors export or Caffe prototxt to its network's description;
    a zoo name or a network / run file as given, a run file's head sized by its data's
    classes."""
    from cnnkit.checkpoint import file_kind
    from cnnkit.cli.net import network_for
    from cnnkit.infer.load import run_folder

    network = network_for(net, num_classes)
    path = Path(net)
    trained = file_kind(path) is not None  # a checkpoint or an export, by name or contents
    if run_folder(path) or trained or path.suffix == ".prototxt":
        return network.spec, network.num_classes
    return net, num_classes if num_classes is not None else network.num_classes


def _say(text: str) -> None:
    """A progress line on stderr (stdout keeps the report and its JSON)."""
    import sys

    print(f"cnnkit bench: {text}", file=sys.stderr, flush=True)


def _positive(**values: int) -> None:
    from cnnkit.errors import ConfigError

    for name, value in values.items():
        if value < 1:
            raise ConfigError(f"--{name}: must be >= 1, got {value}")


def _emit(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report))
