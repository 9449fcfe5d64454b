"""`cnnkit bench train|infer`: images/s, step time, achieved FLOP/s and its fraction of the
device's peak, with exactly the settings `cnnkit train` would use (train/settings.py), and for
infer those of `cnnkit classify` and `cnnkit eval` (on a CPU in fp32: the measured inference
kernels).

Everything is timed in one interleaved run: cnnkit's step, the peers (--baseline: the plain
fp32 NCHW loop and the careful user's autocast + channels_last loop, each in its own process),
every combination (--explore) and the peak kernels (bench/peak.py). On a GPU each timed
measurement is a block of steps between two synchronisations (the steady state); the figure
of single steps synchronised one by one is reported beside it.

FLOPs come from the layer table's multiply-adds (conv and linear): 2 per multiply-add forward,
and training counted as 3x the forward (backward ~ 2x forward), the usual convention.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from cnnkit.bench.baseline import PEERS, PlainProcess
from cnnkit.bench.model_setup import forward_flops, load_network, synthetic_batch
from cnnkit.bench.peak import Kernel, best_rates, math_mode, peak_kernels, theoretical_peak
from cnnkit.bench.timing import Timing, autocast, check_precision, measure, measure_interleaved
from cnnkit.config import TrainConfig
from cnnkit.errors import plural
from cnnkit.nn import Network
from cnnkit.nn.kernels import set_kernels
from cnnkit.nn.onednn import freeze
from cnnkit.runtime import (
    machine_name,
    quiet_compile_logs,
    restore_matmuls,
    tf32_matmuls,
    torch_threads,
)
from cnnkit.train.engine import Engine, build_engine, check_cpu_compiler, train_step
from cnnkit.train.settings import Settings, candidates, choose_settings, inference_settings
from cnnkit.train.settings import precisions as hardware_precisions

TRAIN_FLOPS_FACTOR = 3.0  # forward + backward (grad of inputs and of weights) ~ 3x forward


def train_config(device: torch.device, precision: str | None = "auto",
                 channels_last: bool | None = None, compile: bool = False,
                 threads: int | None = None, calibrate: bool = True,
                 step: TrainConfig | None = None) -> TrainConfig:  # fmt: skip
    """`cnnkit train`'s `train:` section (a run's `step`, else the default) with this device
    and these overrides."""
    if precision not in (None, "auto"):
        check_precision(precision, device)
    given = step.model_dump() if step is not None else {}
    return TrainConfig(**{**given, "device": str(device), "precision": precision or "auto",
                          "channels_last": channels_last, "compile": compile,
                          "threads": threads, "calibrate": calibrate})  # fmt: skip


def step_extras(cfg: TrainConfig) -> list[str]:
    """What a run's training step does beyond the peers' plain one (SGD with momentum 0.9 and
    weight decay 5e-4 on a cross-entropy loss): its optimizer and the rest, in words."""
    extras = [] if cfg.optimizer == "sgd" else [cfg.optimizer]
    if cfg.optimizer == "sgd" and (cfg.momentum, cfg.weight_decay) != (0.9, 5e-4):
        extras.append(f"momentum {cfg.momentum:g}, weight decay {cfg.weight_decay:g}")
    if cfg.accumulate > 1:
        extras.append(f"{cfg.accumulate} micro-batches")
    if cfg.grad_clip is not None:
        extras.append(f"gradient clipping at {cfg.grad_clip:g}")
    if cfg.ema > 0:
        extras.append(f"EMA {cfg.ema:g}")
    if cfg.label_smoothing > 0:
        extras.append(f"label smoothing {cfg.label_smoothing:g}")
    if cfg.class_weights != "none":
        extras.append("balanced class weights")
    return extras


def settings_for(net: Any, device: torch.device, batch: int, precision: str | None = "auto",
                 channels_last: bool | None = None, threads: int | None = None,
                 num_classes: int | None = None, calibrate: bool = True,
                 deterministic: bool = False) -> Settings:  # fmt: skip
    """What `cnnkit train` would run `net` with (options given here count as set explicitly;
    `calibrate` and `deterministic` as a run's `train.calibrate` and `deterministic`)."""
    model = load_network(net, device, num_classes)
    cfg = train_config(device, precision, channels_last, threads=threads, calibrate=calibrate)
    return choose_settings(model, cfg, device, batch, deterministic)


def make_train_step(network: Network, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig,
                    settings: Settings | None = None) -> tuple[Callable[[Any], Any], Engine]:  # fmt: skip
    """The training engine's real step (optimizer, precision, memory format as `cnnkit train`;
    a run's balanced class weights as uniform ones: the same work, whatever the data)."""
    weights = None
    if cfg.class_weights != "none" and network.num_classes:
        weights = torch.ones(network.num_classes)
    engine = build_engine(network, cfg, torch.device(cfg.device), class_weights=weights,
                          settings=settings)  # fmt: skip
    x = engine.prepare(x)
    return (lambda _: train_step(engine, x, y)), engine


def make_infer_step(model: Network, x: torch.Tensor, device: torch.device, precision: str):
    """One classification forward pass in eval mode, without autograd."""

    def step(_: Any = None) -> None:
        with torch.inference_mode(), autocast(device, precision):
            model(x)

    return step


def _cnnkit_step(net: Any, mode: str, batch: int, device: torch.device, cfg: TrainConfig,
                 settings: Settings, num_classes: int | None, block: int) -> Callable:  # fmt: skip
    """`block` steps of a fresh copy of the network with `settings` (threads included)."""
    model = load_network(net, device, num_classes)
    x, y = synthetic_batch(model, batch, device)
    if mode == "train":
        step, _ = make_train_step(model, x, y, cfg, settings)
    else:
        if settings.channels_last and x.dim() == 4:
            model = model.to(memory_format=torch.channels_last)
            x = x.contiguous(memory_format=torch.channels_last)
        freeze(set_kernels(model, dict(settings.kernels)))  # as classification runs
        if cfg.compile and device.type == "cpu":
            check_cpu_compiler()
        if cfg.compile:
            quiet_compile_logs()
        runnable = torch.compile(model) if cfg.compile else model
        step = make_infer_step(runnable.eval(), x, device, settings.precision)

    def run(_: Any = None) -> None:
        with torch_threads(settings.threads):
            for _ in range(block):
                step(None)

    return run


def _explored(model: Network, cfg: TrainConfig, device: torch.device, chosen: Settings) -> list:
    """Every combination of the settings `auto` would choose among (the chosen one first)."""
    options = candidates(model, cfg, device)
    combos = [Settings(p, cl, t, "set") for p, cl, t in itertools.product(*options.values())]
    return [chosen] + [c for c in combos if _key(c) != _key(chosen)]


def bench_throughput(net: str | dict[str, Any], mode: str, batch: int, device: torch.device,
                     precision: str | None = "auto", channels_last: bool | None = None,
                     compile: bool = False, warmup: int | None = None, repeats: int | None = None,
                     num_classes: int | None = None, quick_peak: bool = False,
                     baseline: bool = False, threads: int | None = None, explore: bool = False,
                     cache: Any = True, calibrate: bool = True, deterministic: bool = False,
                     max_seconds: float = 120.0,
                     step: TrainConfig | None = None) -> dict[str, Any]:  # fmt: skip
    """Time `mode` ('train' or 'infer') steps of a network; a JSON-ready report with the peak
    (`calibrate`, `deterministic`: a run's `train.calibrate` and `deterministic`; `step`: the
    run's `train:` section, whose optimizer, micro-batches, clipping, EMA and loss the step
    runs; repeats stop after `max_seconds`, each timed step repeated at least twice, once in
    each order)."""
    with _as_training_runs(deterministic):
        cfg = train_config(device, precision, channels_last, compile, threads, calibrate, step)
        model = load_network(net, device, num_classes)
        settings, runs_as = _chosen(model, mode, cfg, device, batch, cache, deterministic)
        block = 10 if device.type == "cuda" else 1
        combos = _explored(model, cfg, device, settings) if explore else [settings]
        steps = {
            _key(c): _cnnkit_step(net, mode, batch, device, cfg, c, num_classes, block)
            for c in combos
        }
        peers = [PlainProcess(model, mode, batch, device, peer, block, settings.threads)
                 for peer in PEERS if baseline]  # fmt: skip
        steps.update({p.name: p for p in peers})
        precisions = tuple(dict.fromkeys((*hardware_precisions(device), settings.precision)))
        kernels = peak_kernels(model, batch, device, precisions, quick_peak)
        steps.update({k.name + " " + k.precision: _on_threads(k.run, device, settings.threads)
                      for k in kernels})  # fmt: skip
        warmup, repeats = _counts(device, compile, warmup, repeats)
        try:
            timings = measure_interleaved(
                steps, device, warmup=warmup, repeats=repeats, max_seconds=max_seconds
            )
        finally:
            for p in peers:
                p.close()
        synced = None
        if block > 1 and not compile:  # single steps, each synchronised: what a per-step timer
            # sees (not when compiling: its own engine would compile the network once more)
            synced = measure(_cnnkit_step(net, mode, batch, device, cfg, settings, num_classes, 1),
                             device, warmup=2, repeats=repeats)  # fmt: skip
        report = _report(model, mode, batch, device, settings, cfg, timings, block, synced, kernels,
                         peers, combos)  # fmt: skip
        report["settings"]["as"] = runs_as
        return report


def _on_threads(run: Callable[[object], object], device: torch.device,
                threads: int) -> Callable[[object], object]:  # fmt: skip
    """A peak kernel run on the step's threads on a CPU: a peak on more cores than the step
    uses would understate its share (as the step's own rate above it would overstate it)."""
    if device.type != "cpu":
        return run

    def on_threads(x: object) -> object:
        with torch_threads(threads):
            return run(x)

    return on_threads


@contextmanager
def _as_training_runs(deterministic: bool) -> Iterator[None]:
    """cuDNN's autotuner (unless `deterministic`) and TF32 matmuls, as `cnnkit train` runs;
    then this process's own settings again (a test timed after a bench would inherit them)."""
    benchmark, matmuls = torch.backends.cudnn.benchmark, tf32_matmuls()
    torch.backends.cudnn.benchmark = not deterministic
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = benchmark
        restore_matmuls(matmuls)


def _chosen(model: Network, mode: str, cfg: TrainConfig, device: torch.device, batch: int,
            cache: Any, deterministic: bool) -> tuple[Settings, str]:  # fmt: skip
    """(settings, the command that runs them): `cnnkit train`'s, or for infer on a CPU the
    forward pass `cnnkit classify` runs, fp32 unless told (a forced memory format included)."""
    if mode == "infer" and device.type == "cpu" and cfg.precision in ("auto", "fp32"):
        classify = cfg.model_copy(update={"precision": "fp32"})
        settings = inference_settings(model, classify, device, batch, cache=cache)
        chosen = settings or choose_settings(model, classify, device, batch, deterministic, cache)
        return chosen, "cnnkit classify"
    return choose_settings(model, cfg, device, batch, deterministic, cache), "cnnkit train"


def _key(s: Settings) -> str:
    layers = " kernels per layer" if s.kernels else ""
    return f"cnnkit {s.precision} {'NHWC' if s.channels_last else 'NCHW'}{layers} {s.threads}t"


def _counts(device: torch.device, compile: bool, warmup: int | None, repeats: int | None):
    """Warm-up and repeat counts: more on a GPU (steps are short), 2 warm-ups when compiling."""
    default_warmup, default_repeats = (3, 10) if device.type == "cuda" else (1, 5)
    warmup = default_warmup if warmup is None else warmup
    return (max(warmup, 2) if compile else warmup), (
        default_repeats if repeats is None else repeats
    )


def _rate(timing: Timing, batch: int, block: int) -> tuple[float, float]:
    """(images/s, ms per step) of timings of `block` steps each."""
    per_step = timing.median / block
    return batch / per_step, per_step * 1e3


def _per_step(timing: Timing, block: int) -> dict[str, Any]:
    return {k: (v / block if k.endswith("_ms") else v) for k, v in timing.to_dict().items()}


def _report(model, mode, batch, device, settings: Settings, cfg, timings, block, synced,
            kernels: list[Kernel], peers, combos) -> dict[str, Any]:  # fmt: skip
    factor = TRAIN_FLOPS_FACTOR if mode == "train" else 1.0
    flops_per_image = factor * forward_flops(model)
    chosen = timings[_key(settings)]
    images_per_second, step_ms = _rate(chosen, batch, block)
    flops_per_second = flops_per_image * images_per_second
    peaks = best_rates(kernels, {name: t.median for name, t in timings.items()})
    measured = peaks[settings.precision]["flops_per_second"]
    peak = max(measured, flops_per_second)
    paper = theoretical_peak(device, settings.precision, settings.threads)
    report = {
        "net": model.name, "mode": mode, "device": str(device), "hardware": machine_name(device),
        "torch": torch.__version__, "batch": batch,
        "precision": settings.precision, "channels_last": settings.channels_last,
        "threads": settings.threads, "kernels": dict(settings.kernels), "compile": cfg.compile, "math": math_mode(device, settings.precision),
        "settings": {"how": settings.how, "describe": settings.describe(cfg.threads)},
        "images_per_second": images_per_second, "step_ms": step_ms, "step": _per_step(chosen, block),
        "steps_per_measurement": block,
        "flops_per_image": flops_per_image, "flops_per_second": flops_per_second,
        "peak": peaks, "peak_flops_per_second": peak, "peak_raised": peak > measured,
        "peak_fraction": flops_per_second / peak,
        "theoretical_peak": None if paper is None else {"flops_per_second": paper[0], "source": paper[1]},
    }  # fmt: skip
    if mode == "train":
        report["optimizer"], report["accumulate"] = cfg.optimizer, cfg.accumulate
        report["step_extras"] = step_extras(cfg)
    if synced is not None:
        report["synced"] = {"images_per_second": batch / synced.median, "step": synced.to_dict()}
    for peer, name in zip(peers, PEERS, strict=False):
        rate, ms = _rate(timings[peer.name], batch, block)
        report["baseline" if name == "plain" else "careful"] = {
            "name": peer.name, "threads": peer.threads, "images_per_second": rate, "step_ms": ms,
            "step": _per_step(timings[peer.name], block)}  # fmt: skip
        report[f"speedup_vs_{'baseline' if name == 'plain' else 'careful'}"] = ms / step_ms
    if len(combos) > 1:
        report["explore"] = [{**_combo(c), "images_per_second": _rate(timings[_key(c)], batch, block)[0],
                              "chosen": c is settings} for c in combos]  # fmt: skip
    return report


def _combo(s: Settings) -> dict[str, Any]:
    return {"precision": s.precision, "channels_last": s.channels_last, "threads": s.threads,
            "kernels": dict(s.kernels)}  # fmt: skip


def print_throughput(report: dict[str, Any], console: Any = None) -> None:
    """A few human lines: settings, images/s, step times, FLOP/s against the peak, peers."""
    from cnnkit.tables import wide_console

    console = console or wide_console()
    r, s = report, report["step"]
    say = lambda text: console.print(text, markup=False, soft_wrap=True)  # noqa: E731
    say(f"{r['net']} {r['mode']}  batch {r['batch']}  {r['device']} ({r['hardware']})  "
        f"torch {r['torch']}")  # fmt: skip
    say(f"  settings as `{r['settings']['as']}` chooses them: {r['settings']['describe']}"
        f"{'  compile' if r['compile'] else ''}  [{r['math']}]")  # fmt: skip
    if r.get("step_extras"):
        peers = "; the peers' steps are plain SGD" if "baseline" in r else ""
        say(f"  the run's step: {', '.join(r['step_extras'])}{peers}")
    steady = (
        f"{r['steps_per_measurement']} steps between two syncs"
        if r["steps_per_measurement"] > 1
        else "each step synced"
    )
    say(f"  {r['images_per_second']:.1f} images/s steady state ({steady}); step median "
        f"{s['median_ms']:.2f} ms  min {s['min_ms']:.2f}  max {s['max_ms']:.2f}  ({plural(s['repeats'], 'repeat')})")  # fmt: skip
    if "synced" in r:
        say(
            f"  {r['synced']['images_per_second']:.1f} images/s one step at a time (synced each step)"
        )
    raised = " (raised to the step's own rate: no kernel ran faster)" if r["peak_raised"] else ""
    if "nnpack" in r["kernels"].values():  # counted as direct convolutions
        raised += "; FLOPs counted as direct convolution, which NNPACK's Winograd/FFT beats"
    say(f"  {r['flops_per_second'] / 1e12:.3f} TFLOP/s achieved = {100 * r['peak_fraction']:.1f}% "
        f"of the measured {r['precision']} peak {r['peak_flops_per_second'] / 1e12:.3f} TFLOP/s{raised}")  # fmt: skip
    kernels = ", ".join(
        f"{p} {v['flops_per_second'] / 1e12:.3f} ({v['kernel']})" for p, v in r["peak"].items()
    )
    say(f"  measured peaks, TFLOP/s: {kernels}")
    if r["theoretical_peak"]:
        t = r["theoretical_peak"]
        under = t["flops_per_second"] < r["peak_flops_per_second"] and r["device"] == "cpu"
        why = "; under the measured peak: the cores run above the clock the OS reports" * under
        say(f"  on paper: {t['flops_per_second'] / 1e12:.3f} TFLOP/s {r['precision']} "
            f"({t['source']}{why})")  # fmt: skip
    for key, label in (("baseline", "speedup_vs_baseline"), ("careful", "speedup_vs_careful")):
        if key in r:
            b = r[key]
            on = f", {plural(b['threads'], 'thread')}" if r["device"] == "cpu" else ""
            say(f"  {key} {b['name']}{on}: {b['images_per_second']:.1f} images/s, step median "
                f"{b['step_ms']:.2f} ms (interleaved) -> cnnkit {r[label]:.2f}x")  # fmt: skip
    for row in r.get("explore", []):
        mark = "  <- chosen" if row["chosen"] else ""
        layers = " + kernels per layer" if row["kernels"] else ""
        say(f"  explore {row['precision']} {'NHWC' if row['channels_last'] else 'NCHW'}{layers} "
            f"{plural(row['threads'], 'thread')}: "
            f"{row['images_per_second']:.1f} images/s{mark}")  # fmt: skip
