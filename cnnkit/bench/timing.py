"""Careful timing: warm-up first, device synchronised around every measurement, median of repeats.

Every model figure in cnnkit.bench times through `measure`, so they share one method; the
loader's (bench/loader.py) is one window of batches after warm-up, as a stream is timed.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from cnnkit.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of each timed repeat (warm-up excluded)."""

    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def min(self) -> float:
        return min(self.seconds)

    @property
    def max(self) -> float:
        return max(self.seconds)

    def to_dict(self) -> dict[str, Any]:
        """Milliseconds: median, min, max and the number of repeats."""
        return {
            "median_ms": self.median * 1e3,
            "min_ms": self.min * 1e3,
            "max_ms": self.max * 1e3,
            "repeats": len(self.seconds),
        }


def synchronize(device: torch.device) -> None:
    """Wait until every kernel queued on `device` has finished (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def measure(
    fn: Callable[[Any], Any],
    device: torch.device,
    *,
    setup: Callable[[], Any] | None = None,
    warmup: int = 1,
    repeats: int = 5,
    max_seconds: float | None = None,
    min_repeats: int = 2,
) -> Timing:
    """Time `fn(setup())` `repeats` times after `warmup` untimed calls; `setup` is never timed.

    With `max_seconds`, stops early once that much time was spent timing (after at least
    `min_repeats`), so a slow network on a slow device cannot run for ever.
    """
    for _ in range(warmup):
        fn(setup() if setup else None)
    synchronize(device)
    seconds: list[float] = []
    spent = 0.0
    while len(seconds) < repeats:
        arg = setup() if setup else None
        synchronize(device)
        start = time.perf_counter()
        fn(arg)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        spent += seconds[-1]
        if max_seconds is not None and spent > max_seconds and len(seconds) >= min_repeats:
            break
    return Timing(tuple(seconds))


def measure_interleaved(
    fns: dict[str, Callable[[Any], Any]],
    device: torch.device,
    *,
    warmup: int = 1,
    repeats: int = 5,
    max_seconds: float | None = None,
) -> dict[str, Timing]:
    """Time several steps in turns, reversing the order every round, so that a change in the
    machine's load hits every side alike (how a step is compared with a peer in one run). A step
    with `times_itself` (a peer in its own process) returns its own seconds, which count."""
    for fn in fns.values():
        for _ in range(warmup):
            fn(None)
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    start = time.perf_counter()
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            seconds[name].append(_seconds(fns[name], device))
        if max_seconds is not None and time.perf_counter() - start > max_seconds and r >= 1:
            break
    return {name: Timing(tuple(s)) for name, s in seconds.items()}


def _seconds(fn: Callable[[Any], Any], device: torch.device) -> float:
    """One timed call of `fn`, as `measure` times it, or the seconds it reports itself."""
    if getattr(fn, "times_itself", False):
        return fn(None)
    return measure(fn, device, warmup=0, repeats=1).seconds[0]


def timer_overhead(device: torch.device, repeats: int = 50) -> float:
    """Median seconds that `measure` reports for doing nothing: the floor under every figure."""
    return measure(lambda _: None, device, warmup=3, repeats=repeats).median


def check_precision(precision: str, device: torch.device, auto: bool = True) -> str:
    """Validate a precision name for a device (fp16 autocast is for CUDA); `auto`: whether the
    caller takes 'auto' too (then it is handled before this check)."""
    if precision not in PRECISIONS:
        names = ", ".join(("auto",) * auto + PRECISIONS)
        raise ConfigError(f"--precision: {precision!r} is not one of {names}")
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError("--precision: fp16 needs a CUDA device (use bf16 on the CPU)")
    return precision


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """The autocast context of a precision: bf16/fp16 mixed precision, or nothing for fp32."""
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


BUSY = 0.5  # cores' worth of other programs' work from which a benchmark says so


def busy_cores(seconds: float = 0.3) -> float | None:
    """Cores' worth of CPU time other programs use on the cores this process may run on (its
    affinity), sampled from /proc/stat over `seconds` while this process sleeps; None where
    there is no /proc/stat."""
    try:
        mine = {f"cpu{n}" for n in os.sched_getaffinity(0)}
    except (AttributeError, OSError):
        mine = None

    def busy() -> tuple[int, float]:
        total = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *values = line.split()
                if name.startswith("cpu") and name != "cpu" and (mine is None or name in mine):
                    ticks = [int(v) for v in values[:8]]  # user nice system idle iowait ...
                    total += sum(ticks) - ticks[3] - ticks[4]
        return total, time.monotonic()

    try:
        (before, start), _ = busy(), time.sleep(seconds)
        after, end = busy()
    except (OSError, ValueError, IndexError):
        return None
    return (after - before) / (os.sysconf("SC_CLK_TCK") * (end - start))


def say_if_busy(cores: int) -> None:
    """A note on a terminal's stderr where other programs keep over BUSY of the machine's cores
    busy as a benchmark starts: its figures come out lower than on an idle machine (ratios
    against a peer timed in the same run suffer less). Not sampled where stderr is no terminal
    (a script's or a test's run: their output stays the same from one run to the next)."""
    if not sys.stderr.isatty():
        return
    used = busy_cores()
    if used is not None and used > BUSY:
        print(f"cnnkit bench: note: other programs keep {used:.1f} of this machine's cores busy "
              f"({cores} for this process): figures come out lower than on an idle machine "
              "(ratios against a peer timed in the same run, less so)", file=sys.stderr)  # fmt: skip
