"""Process-wide settings: torch's CPU threads, seeds, and glibc's memory setting; the CPU
time other processes take (OtherLoad); and files written whole or not at all (atomic,
write_atomic).

Every part of cnnkit sets thread counts and mixes seeds through these (devices are resolved
by cnnkit.distributed.resolve_device: a process's device is part of its place in the group).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

import numpy as np
import torch

CPU_QUOTA = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"


def available_cores() -> int:
    """CPU cores this process may run on: its affinity mask (taskset, SLURM), and no more than
    its container's CPU quota allows (`docker run --cpus=4` on a 16-core host: 4, rounded up)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        with open(CPU_QUOTA) as f:
            quota, period = f.read().split()[:2]
        if quota != "max" and int(period) > 0:
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):  # no cgroup v2 file (not Linux, cgroup v1): the mask alone
        pass
    return cores


def machine_name(device: torch.device) -> str:
    """A human name for the hardware: the GPU's name, or the CPU's model and its cores."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                model,
            )
    except OSError:
        pass
    return f"{model} ({available_cores()} cores)"


def affinity_cores() -> int:
    """The cores this process may run on (its affinity mask; no container quota applied)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _busy_seconds() -> float | None:
    """CPU seconds the cores this process may run on have spent busy since boot, the
    hypervisor's steal included (Linux's per-core /proc/stat lines); None where unknown."""
    try:
        mine = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        with open("/proc/stat") as f:
            rows = [line.split() for line in f if line.startswith("cpu")]
        ticks = [[int(t) for t in row[1:9]] for row in rows if row[0] in mine]
    except (AttributeError, OSError, ValueError):  # not Linux, or a /proc/stat of another shape
        return None
    if not ticks:
        return None
    busy = sum(sum(t) - t[3] - (t[4] if len(t) > 4 else 0) for t in ticks)  # less idle, iowait
    return busy / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """`with OtherLoad() as load:` then `load.cores`: the cores' worth of CPU that other
    processes (and the hypervisor) took from this process's cores while the body ran; None
    where the system does not say. A timing made beside them ranks candidates by luck."""

    cores: float | None = None

    def __enter__(self) -> OtherLoad:
        self._start = (time.perf_counter(), _busy_seconds(), time.process_time())
        return self

    def __exit__(self, *exc: object) -> None:
        wall0, busy0, own0 = self._start
        busy1, wall = _busy_seconds(), time.perf_counter() - wall0
        if busy0 is not None and busy1 is not None and wall > 0:
            self.cores = max(0.0, busy1 - busy0 - (time.process_time() - own0)) / wall


def busy_machine(cores: float | None) -> bool:
    """Whether others took enough of this process's cores (`OtherLoad.cores`, counted over
    the same cores) to sway a timing: a quarter of a core, or a tenth of them on a large
    machine."""
    return cores is not None and cores >= max(0.25, 0.1 * affinity_cores())


def idle_machine(seconds: float = 0.25) -> bool:
    """Whether others leave this process's cores alone now, as OtherLoad counts them (steal
    included) over a short look; False where the system does not say."""
    with OtherLoad() as load:
        time.sleep(seconds)
    return load.cores is not None and not busy_machine(load.cores)


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((x for x in f if x.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[-1].split())


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the body with `n` intra-op CPU threads, restoring the previous count afterwards.

    One thread suits per-image CPU kernels in a loop: they lose more to thread-pool wake-ups
    than they gain (measurements in BENCHMARKS.md).
    """
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def mix_seed(*parts: int) -> int:
    """A 63-bit seed mixing integers (splitmix64), so nearby inputs give unrelated streams:
    (seed, epoch, batch, rank, ...) -> the seed of one generator."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2))) & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def seed_everything(seed: int) -> None:
    """Seed torch (all devices), numpy and python."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


try:  # (torch.fx's own test: torch 2.11 and later have it)
    from torch.fx._symbolic_trace import is_fx_symbolic_tracing
except ImportError:  # pragma: no cover - a torch that moved it: no fx test

    def is_fx_symbolic_tracing() -> bool:
        return False


def traced() -> bool:
    """Whether torch.jit or torch.fx traces, or torch.compile compiles, what runs: cnnkit's
    faster stand-ins then give way to torch's own modules, which those see (fx can follow no
    branch on a tensor's dim or device)."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or is_fx_symbolic_tracing()


@contextmanager
def random_state_kept() -> Iterator[None]:
    """The caller's random generators (python's, numpy's, torch's CPU and CUDA ones) as they
    were before, after what seeds them (fit: a notebook's draws go on as if no run had seeded
    them); CUDA first used inside, its generators seeded as torch.manual_seed left them."""
    state, seed = (random.getstate(), np.random.get_state()), torch.initial_seed()
    used = torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if used else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(state[0])
            np.random.set_state(state[1])
            if not used and torch.cuda.is_initialized():  # first used by the run: as seeded
                torch.cuda.manual_seed_all(seed)  # (by torch.manual_seed, which seeds CUDA's)


def keep_freed_memory() -> bool:
    """Let glibc keep freed blocks instead of unmapping every one over 32 MB; True if applied.

    A training step frees and reallocates the same large buffers (activations, gradients,
    bf16 weight copies) every iteration; by default glibc returns each to the kernel and the
    next step page-faults it back in (BENCHMARKS.md has the cost on an AlexNet step).
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...): nothing to tune
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30))


SPECIAL_FILESYSTEM = "a special filesystem, which takes no new files"


def cannot_write(folder: Path) -> str | None:
    """Why nothing can be created in `folder` (read-only, not ours, not a real folder such as
    /proc), found by making and removing a probe file; None when it can."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".cnnkit-probe-"):
            return None
    except OSError as e:
        if e.errno == errno.ENOENT and Path(folder).is_dir():  # how /proc refuses a new file
            return SPECIAL_FILESYSTEM
        return e.strerror or type(e).__name__


def os_reason(e: OSError) -> str:
    """An OSError's reason for one line: "No such file or directory" from making a file or
    folder in a folder that is there (/proc refuses new entries so) says what that folder is."""
    name = os.fsdecode(e.filename) if isinstance(e.filename, (str, bytes)) else None
    if e.errno == errno.ENOENT and name and not os.path.lexists(name):
        parent = Path(name).parent
        if parent.is_dir() and cannot_write(parent) == SPECIAL_FILESYSTEM:
            return f"{parent} is {SPECIAL_FILESYSTEM}"
    return e.strerror or str(e)


@contextmanager
def atomic(path: Path, private: bool = False) -> Iterator[IO[bytes]]:
    """A file written as PATH.tmp and renamed to PATH once complete; removed if writing fails
    (the error then names PATH, which a failed write() alone does not). `private`: as
    .PATH.<pid>.tmp, for a file the user names (-o), where PATH.tmp may be the user's own and
    two commands may write the same PATH at once."""
    tmp = path.with_name(temporary_name(path.name, private))
    if path.exists() and not path.is_file():  # a device or FIFO: never replaced by a file
        raise OSError(errno.EEXIST, "exists and is not a regular file", str(path))
    try:
        with open(tmp, "wb") as f:
            yield f
        os.replace(tmp, path)
    except BaseException as e:
        with suppress(OSError):  # (never in place of the error that brought it here)
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename in (None, str(tmp)):
            e.filename = str(path)  # the file the user named, not the hidden one beside it
        raise


NAME_MAX = 255  # bytes in a file name (Linux, macOS)


def temporary_name(name: str, private: bool, kind: str = "tmp") -> str:
    """NAME.tmp, or .NAME.<pid>.tmp (`kind`: another last word); the name cut short where the
    whole would be longer than a file name may be (a legal 245-character NAME), so the
    temporary is never what fails."""
    head, tail = ("." if private else ""), (f".{os.getpid()}.{kind}" if private else f".{kind}")
    if len(os.fsencode(head + name + tail)) <= NAME_MAX:
        return head + name + tail
    mark = "-" + hashlib.sha256(os.fsencode(name)).hexdigest()[:12]  # two long names: two files
    while len(os.fsencode(head + name + mark + tail)) > NAME_MAX and name:
        name = name[: min(len(name) - 1, NAME_MAX)]  # (characters: never half of a UTF-8 one)
    return head + name + mark + tail


def write_atomic(path: Path, data: bytes, private: bool = False) -> None:
    """`data` to `path` through atomic (an existing file stays as it was if this fails)."""
    with atomic(Path(path), private) as f:
        f.write(data)


def tf32_matmuls(on: bool = True) -> tuple[str | None, str, str] | None:
    """CUDA fp32 matmuls in TF32 (as cuDNN's fp32 convolutions are by default) or not; returns
    the settings before, for restore_matmuls (None: no CUDA here, nothing changed). oneDNN's
    CPU matmuls are set alike (torch's one setting): x86 CPUs have no TF32, so they compute
    as before.

    Through torch.set_float32_matmul_precision, which keeps torch's two APIs agreeing: with
    `backends.cuda.matmul.fp32_precision` set alone, torch.get_float32_matmul_precision (read
    by inductor's autotuning, TunableOp, user code) raises. The legacy allow_tf32 flags are
    never read: once a program has set the new settings, reading them can raise."""
    if not torch.cuda.is_available():
        return None
    try:
        legacy: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:  # the program set the new API's backends apart: those alone
        legacy = None
    before = (legacy, torch.backends.cuda.matmul.fp32_precision,
              torch.backends.mkldnn.matmul.fp32_precision)  # fmt: skip
    torch.set_float32_matmul_precision("high" if on else "highest")
    return before


def restore_matmuls(before: tuple[str | None, str, str] | None) -> None:
    """The settings tf32_matmuls found, as they were."""
    if before is None:
        return
    legacy, cuda, mkldnn = before
    if legacy is not None:
        torch.set_float32_matmul_precision(legacy)
    torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = (
        cuda,
        mkldnn,
    )


def in_tf32(setting: str) -> bool:
    """Whether a backend's fp32_precision means TF32 ('none': the global setting's)."""
    return setting == "tf32" or (setting == "none" and torch.backends.fp32_precision == "tf32")


# torch's log lines that a compiled run prints and that say nothing its user can act on:
# dynamo skipping the profiler ranges DDP's forward opens, inductor's C++ builder finding no
# CUDA runtime on a CPU machine with a CUDA_HOME
NOISE = (("torch._dynamo.variables.ctx_manager", "Profiler record function "),
         ("torch.utils.cpp_extension", "No CUDA runtime is found"))  # fmt: skip


def _not_noise(record: logging.LogRecord) -> bool:
    return not any(record.name == name and record.getMessage().startswith(text)
                   for name, text in NOISE)  # fmt: skip


def quiet_compile_logs() -> None:
    """Leave NOISE's lines out of torch.compile's logging (once per process)."""
    for name, _ in NOISE:
        logger = logging.getLogger(name)
        if _not_noise not in logger.filters:
            logger.addFilter(_not_noise)
