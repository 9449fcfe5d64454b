"""The settings a training step runs with: precision, memory format and CPU threads.

`precision: auto`, `channels_last: auto` and `threads: auto` are decided by measurement, the way
cudnn.benchmark picks kernels: the network's own forward + backward is timed on this machine
for each candidate (interleaved: seconds for a small network, ~45 s for ResNet-18 on 2 cores
with the kernel plan), the fastest wins (reduced precision only when it is clearly faster,
since fp32 keeps the most accuracy), and the choice is cached per machine, torch version,
network and batch in ~/.cache/cnnkit, so the next run reuses it.
Where fp32 on the CPU wins and the memory format is left on auto, each convolution and pooling
layer then gets its own fastest kernel (NCHW, NHWC or NNPACK: nn/kernel_plan.py), kept if the
whole step runs faster with them. The timer and the cache are cnnkit/nn/tuning.py's. Explicit settings always win; `train.calibrate: false` or
`deterministic: true` falls back to the static rules (a timing-dependent choice would make a run
unrepeatable).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from cnnkit.config import TrainConfig
from cnnkit.errors import ConfigError, plural
from cnnkit.nn import Network
from cnnkit.nn.kernel_plan import plan_kernels
from cnnkit.nn.tuning import (
    MARGIN,
    MIN_ROUNDS,
    CandidateTimer,
    Plan,
    cache_key,
    cache_path,
    choose_inference_kernels,
    macs,
    read_cache,
    still_fair,
    valid_plan,
    write_cache,
)
from cnnkit.runtime import available_cores, busy_machine

SMALL_STEP_MACS = 1e9  # static rule: below this per step, extra CPU threads mostly wait
PLAN_BATCH = 64  # the largest batch kernels per layer are timed at
PLAN_S = 12.0  # and smaller where the check that a plan pays (PLAN_STEPS steps) would take longer
PLAN_STEPS = 2 * (1 + MIN_ROUNDS)  # that check: the step with and without, warm-up and rounds
METHOD = 7  # how settings are measured; part of the cache key, so a new method measures anew
# (7: no fp32 NCHW speed-up where fp32 NCHW was not timed)


@dataclass(frozen=True)
class Settings:
    """What a training step runs with, and how that was decided."""

    precision: str  # fp32 | bf16 | fp16
    channels_last: bool
    threads: int  # torch's intra-op CPU threads
    how: str  # set (explicitly) | measured | cached | rules | resumed (as the run began)
    speedup: float | None = None  # measured: images/s against fp32 NCHW at the same threads
    kernels: Plan = ()  # a kernel per layer (nn/kernels.py) on top of the format; () for none
    busy: float | None = None  # measured/cached: the cores' worth other processes took meanwhile

    def __post_init__(self) -> None:  # the cache stores the plan as lists
        object.__setattr__(self, "kernels", tuple((str(n), str(k)) for n, k in self.kernels))

    def saved(self) -> dict[str, Any]:
        """The fields a checkpoint keeps (how busy the machine was is the cache's business)."""
        return {k: v for k, v in asdict(self).items() if k != "busy"}

    def describe(self, threads_asked: int | None = None) -> str:
        """For the start line: "bf16 autocast, channels_last, 2 threads: fastest measured (1.4x
        fp32 NCHW)" (`threads_asked`: train.threads, where more than the cores here)."""
        what = "fp32" if self.precision == "fp32" else f"{self.precision} autocast"
        parts = [what] + (["channels_last"] if self.channels_last else [])
        if self.kernels:
            named = {"nnpack": "NNPACK", "nhwc": "NHWC", "nchw": "NCHW", "wxt": "(W x^T)^T",
                     "onednn": "oneDNN linear"}  # fmt: skip
            counts = {k: [v for _, v in self.kernels].count(k) for k in named}
            mix = ", ".join(f"{n} {named[k]}" for k, n in counts.items() if n)
            parts.append(f"kernels per layer ({mix})")
        parts.append(plural(self.threads, "thread"))
        if threads_asked is not None and threads_asked > self.threads:
            parts[-1] += f" ({threads_asked} asked; {available_cores()} cores here)"
        why = {"set": "as set", "rules": "static rules", "cached": "fastest measured (cached)",
               "measured": "fastest measured",
               "resumed": "as the run began (kept for an exact resume)"}[self.how]  # fmt: skip
        plain = self.precision == "fp32" and not self.channels_last and not self.kernels
        if self.speedup is not None and self.how in ("measured", "cached") and not plain:
            why += f", {self.speedup:.2f}x fp32 NCHW"
        if self.how in ("measured", "cached") and busy_machine(self.busy):
            why += (f"; measured while other processes took {self.busy:.1f} cores' worth of "
                    "CPU: measured again once the machine is idle")  # fmt: skip
        return f"{', '.join(parts)}: {why}"


def precisions(device: torch.device) -> list[str]:
    """The precisions worth trying here: bf16 where the hardware computes in it, fp16 on CUDA."""
    if device.type == "cuda":
        return ["fp32", "bf16", "fp16"] if torch.cuda.is_bf16_supported() else ["fp32", "fp16"]
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return ["fp32", "bf16"]
    return ["fp32"]


def static_settings(network: Network, cfg: TrainConfig, device: torch.device, batch: int,
                    how: str = "rules") -> Settings:  # fmt: skip
    """The rules without measuring: reduced precision where the hardware has it, NHWC with it,
    one CPU thread for small steps; the config's own values where it sets them."""
    precision = cfg.precision
    if precision == "auto":  # bf16 where the hardware has it, else fp16 on CUDA, else fp32
        tried = precisions(device)
        precision = "bf16" if "bf16" in tried else ("fp16" if "fp16" in tried else "fp32")
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision: fp16 needs a CUDA device (use bf16 on CPU)")
    image = len(network.input_shape) == 3
    channels_last = cfg.channels_last if cfg.channels_last is not None else precision != "fp32"
    threads = min(cfg.threads, available_cores()) if cfg.threads else torch.get_num_threads()
    if cfg.threads is None and device.type == "cpu" and macs(network) * batch < SMALL_STEP_MACS:
        threads = 1
    return Settings(precision, bool(channels_last and image), threads, how)


def inference_settings(network: Network, cfg: TrainConfig, device: torch.device, batch: int,
                       cache: Path | bool = True) -> Settings | None:  # fmt: skip
    """What a forward pass in eval mode runs with (evaluation, `cnnkit bench infer`): on a CPU
    in fp32 with the memory format on auto, the kernels classification measures as fastest
    (cnnkit/nn/tuning.py: channels_last or not, the linear layers' product, a kernel per
    layer); else None, the training settings' rules."""
    rules = static_settings(network, cfg, device, batch)
    if device.type != "cpu" or rules.precision != "fp32" or cfg.channels_last is not None:
        return None
    channels_last, plan = choose_inference_kernels(network, device, batch, cache=cache)
    return Settings("fp32", channels_last, rules.threads, "measured",
                    kernels=tuple(sorted(plan.items())))  # fmt: skip


def choose_settings(network: Network, cfg: TrainConfig, device: torch.device, batch: int,
                    deterministic: bool = False, cache: Path | bool = True,
                    notify: Callable[[str], None] | None = None) -> Settings:  # fmt: skip
    """The settings `cnnkit train` runs `network` with at `batch` images per step on `device`
    (`cache`: True for the user's cache file, tuning.CACHE; False for none; or a file. `notify`
    is told before a measurement starts)."""
    cache = cache_path(cache)
    if cfg.precision == "fp16" and device.type != "cuda":  # before any measuring
        static_settings(network, cfg, device, batch)  # raises the one-line ConfigError
    explicit = cfg.precision != "auto" and cfg.channels_last is not None
    explicit = explicit and (cfg.threads is not None or device.type != "cpu")
    if explicit:
        return static_settings(network, cfg, device, batch, how="set")
    if not cfg.calibrate or deterministic:
        return static_settings(network, cfg, device, batch)
    key = _cache_key(network, cfg, device, batch)
    found = _cached(read_cache(cache).get(key), network, device) if cache else None
    if found is not None and still_fair(asdict(found)):
        return found
    if notify is not None:
        where = f": cached in {cache}" if cache is not None else ""
        why = f"once{where}" if found is None else (
            "again: the cached choice was timed while other processes took the CPU")  # fmt: skip
        notify(f"measuring the fastest settings for {network.name} at batch {batch} on this "
               f"machine ({why})")  # fmt: skip
    chosen = measure_settings(network, cfg, device, batch)
    if cache is not None:
        write_cache(cache, key, {k: v for k, v in asdict(chosen).items() if k != "how"})
    return chosen


def _cached(entry: Any, network: Network, device: torch.device) -> Settings | None:
    """A cache entry as the settings it holds; None for none, or for one that is damaged or
    names what this device does not run (measured anew, as a missing one is)."""
    if not isinstance(entry, dict) or not valid_plan(network, entry.get("kernels", [])):
        return None
    try:
        found = Settings(**{**entry, "how": "cached"})
    except (TypeError, ValueError):  # fields missing, unknown, or not of their kind
        return None
    threads, speedup = found.threads, found.speedup
    ok = found.precision in precisions(device) and isinstance(found.channels_last, bool)
    ok = ok and type(threads) is int and threads >= 1
    ok = ok and all(v is None or type(v) in (int, float) for v in (speedup, found.busy))
    return found if ok else None


def candidates(network: Network, cfg: TrainConfig, device: torch.device) -> dict[str, list]:
    """Values to try per setting (a setting the config fixes has one)."""
    image = len(network.input_shape) == 3
    formats = [cfg.channels_last] if cfg.channels_last is not None else [False, True]
    most = torch.get_num_threads()
    threads = sorted({1, max(1, most // 2), most}) if device.type == "cpu" else [most]
    return {
        "precision": [cfg.precision] if cfg.precision != "auto" else precisions(device),
        "channels_last": formats if image else [False],
        "threads": [min(cfg.threads, available_cores())] if cfg.threads is not None else threads,
    }


def measure_settings(network: Network, cfg: TrainConfig, device: torch.device,
                     batch: int) -> Settings:  # fmt: skip
    """Time every candidate (precision x format x threads; the best format can depend on the
    thread count) and return the fastest, with its speed-up over fp32 NCHW at its threads;
    then a kernel per layer where the step runs faster with them."""
    options = candidates(network, cfg, device)
    grid = [(*c, ()) for c in itertools.product(*options.values())]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        timer = CandidateTimer(network, device, batch)
        times = timer.run(grid)
        chosen = _fastest(times)
        plain = times.get(("fp32", False, chosen[2], ()))  # (not timed: no ratio to give)
        speedup = None if plain is None else plain / times[chosen]
        busy = timer.busy
        if _plans_kernels(network, cfg, device, chosen):  # (fp32 NCHW was timed)
            chosen, gain, plan_busy = _with_kernels(network, device, batch, chosen, times[chosen])
            speedup = None if speedup is None else speedup * gain
            busy = max((b for b in (busy, plan_busy) if b is not None), default=None)
    precision, channels_last, threads, kernels = chosen
    return Settings(precision, channels_last, threads, "measured", speedup, kernels, busy)


def _plans_kernels(network: Network, cfg: TrainConfig, device: torch.device, chosen: tuple) -> bool:
    """Kernels per layer are for fp32 CPU steps of image networks whose format is on auto."""
    return (
        device.type == "cpu" and chosen[0] == "fp32" and cfg.channels_last is None
        and not cfg.compile and len(network.input_shape) == 3
    )  # fmt: skip


def _with_kernels(network: Network, device: torch.device, batch: int, chosen: tuple,
                  per_image_s: float | None = None) -> tuple[tuple, float, float | None]:  # fmt: skip
    """`chosen` with the fastest kernel per layer if its step is MARGIN faster than without
    (both timed again, interleaved), and that gain; else `chosen` and 1; and the timer's
    `busy`. Timed at the run's own batch (which kernel wins changes with the batch), up to
    `plan_batch`'s."""
    timer = CandidateTimer(network, device, plan_batch(batch, per_image_s), exact=True)
    plan = plan_kernels(network, timer.x, chosen[2])
    if not plan:
        return chosen, 1.0, None
    planned = ("fp32", False, chosen[2], tuple(sorted(plan.items())))
    times = timer.run([chosen, planned])
    if times[planned] * MARGIN < times[chosen]:
        return planned, times[chosen] / times[planned], timer.busy
    return chosen, 1.0, timer.busy


def plan_batch(batch: int, per_image_s: float | None) -> int:
    """The batch a kernel plan is measured at: the run's, up to PLAN_BATCH, and fewer (down to
    8) where PLAN_STEPS steps of it would take over PLAN_S at `per_image_s`, the seconds per
    image the grid measured for the choice (ResNet-18 at batch 128 on a 2-core Zen 3: 23
    images, and 45 s for the whole measurement, where 64 took 88 s)."""
    timed = per_image_s is not None and not math.isnan(per_image_s) and per_image_s > 0
    fits = int(min(PLAN_S / PLAN_STEPS / per_image_s, PLAN_BATCH)) if timed else PLAN_BATCH
    return min(batch, PLAN_BATCH, max(fits, 8))


def _fastest(times: dict[tuple, float]) -> tuple:
    """The fastest candidate; fp16 only if MARGIN faster than bf16's best (its range is far
    narrower and it needs loss scaling: on a GPU where both run at one rate, a coin flip of
    timing noise must not pick it), and a reduced precision only if MARGIN faster than fp32's."""

    def best_of(precision: str) -> tuple | None:
        found = [c for c in times if c[0] == precision]
        return min(found, key=times.get) if found else None

    best = min(times, key=times.get)
    bf16 = best_of("bf16")
    if best[0] == "fp16" and bf16 is not None and times[bf16] <= times[best] * MARGIN:
        best = bf16
    fp32 = best_of("fp32")
    if best[0] != "fp32" and fp32 is not None and times[fp32] <= times[best] * MARGIN:
        return fp32
    return best


def _cache_key(network: Network, cfg: TrainConfig, device: torch.device, batch: int) -> str:
    """The choice's key: also the threads this process may use, which the candidates come
    from (under --nproc each rank has its share of the cores: another choice)."""
    fixed = {k: getattr(cfg, k) for k in ("precision", "channels_last", "threads", "compile")}
    budget = torch.get_num_threads() if device.type == "cpu" else None
    return cache_key(network, device, [METHOD, batch, fixed, budget])
