"""Choices measured on this machine, the way cudnn.benchmark picks kernels: a timer that runs
copies of a network under each candidate (precision, memory format, threads, a kernel per
layer) interleaved, and a per-machine cache of what won (~/.cache/cnnkit/settings.json; a
choice timed while other processes took the CPU is timed again once the machine is idle). The
training settings (train/settings.py) and classification's kernels (`choose_inference_kernels`,
used by infer/ and by evaluation) are both measured with them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from cnnkit.nn import Network
from cnnkit.nn.kernel_plan import plan_kernels
from cnnkit.nn.kernels import FORMATS, options, set_kernels
from cnnkit.nn.onednn import freeze
from cnnkit.runtime import OtherLoad, busy_machine, idle_machine, machine_name, torch_threads

CACHE = Path("~/.cache/cnnkit/settings.json")
TARGET_MACS = {"cpu": 1.5e10, "cuda": 2e12}  # work per timed call: enough to rank formats
MARGIN = 1.03  # a choice other than the plain one must be this much faster to be taken
BUDGET_S = 2.0  # timing rounds stop after this (at least MIN_ROUNDS)
MIN_ROUNDS, MAX_ROUNDS = 2, 5
INFER_BATCH = 16  # the largest batch inference kernels are timed at
INFER_METHOD = 4  # how they are measured (4: formats x linear products, and a kernel per layer)
Plan = tuple[tuple[str, str], ...]  # (layer name, kernel) pairs; () for none
Candidate = tuple[str, bool, int, Plan]  # precision, channels_last, threads, kernels


class CandidateTimer:
    """Times forward + backward (or the forward alone, in inference mode) of copies of the
    network (one per memory format and kernel plan) on a fixed random batch, candidates
    interleaved round by round; seconds per image, median."""

    def __init__(self, network: Network, device: torch.device, batch: int,
                 exact: bool = False, forward_only: bool = False) -> None:  # fmt: skip
        self.device, self.forward_only = device, forward_only
        per_image = max(macs(network), 1)
        self.batch = batch if exact else min(
            batch, max(min(batch, 8), int(TARGET_MACS.get(device.type, 3e9) / per_image))
        )  # fmt: skip
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn((self.batch, *network.input_shape), generator=g).to(device)
        self.y = torch.randint(0, max(network.num_classes or 1, 1), (self.batch,), generator=g).to(
            device
        )
        self.models: dict[tuple, Any] = {}
        self.network = network
        self.done: dict[tuple, float] = {}
        self.busy: float | None = None  # the most cores others took during a run (OtherLoad)

    def _model(self, channels_last: bool, kernels: Plan):
        if (channels_last, kernels) not in self.models:
            model = copy.deepcopy(self.network).to(self.device).train(not self.forward_only)
            if channels_last:
                model = model.to(memory_format=torch.channels_last)
            set_kernels(model, dict(kernels))
            self.models[channels_last, kernels] = freeze(model) if self.forward_only else model
        return self.models[channels_last, kernels]

    def _call(self, candidate: Candidate) -> float:
        precision, channels_last, threads, kernels = candidate
        model = self._model(channels_last, kernels)
        x = self.x.contiguous(memory_format=torch.channels_last) if channels_last else self.x
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        with torch_threads(threads):
            sync(self.device)
            start = time.perf_counter()
            if self.forward_only:
                with torch.inference_mode():
                    model(x)
            else:
                with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
                    loss = torch.nn.functional.cross_entropy(model(x).float(), self.y)
                loss.backward()
            sync(self.device)
            seconds = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return seconds / self.batch

    def run(self, cands: list[Candidate]) -> dict[Candidate, float]:
        """Median seconds per image of each candidate not timed yet (and those already)."""
        todo = [c for c in dict.fromkeys(cands) if c not in self.done]
        for c in todo:  # warm-up: kernels chosen, memory allocated
            self._call(c)
        seconds: dict[tuple, list[float]] = {c: [] for c in todo}
        start = time.perf_counter()
        with OtherLoad() as load:
            for r in range(MAX_ROUNDS if todo else 0):
                for c in todo if r % 2 == 0 else todo[::-1]:
                    seconds[c].append(self._call(c))
                if r + 1 >= MIN_ROUNDS and time.perf_counter() - start > BUDGET_S:
                    break
        if todo and load.cores is not None:
            self.busy = max(self.busy or 0.0, load.cores)
        self.done.update({c: statistics.median(s) for c, s in seconds.items()})
        return {c: self.done[c] for c in dict.fromkeys(cands)}


def choose_inference_kernels(network: Network, device: torch.device, batch: int,
                             cache: Path | bool = True) -> tuple[bool, dict[str, str]]:  # fmt: skip
    """(channels_last, a kernel per layer) for fp32 inference of `network` at `batch` images
    on this CPU: NCHW or channels_last, and the flattening linear layers' product (F.linear's,
    its transpose or oneDNN's, nn/kernels.py), whichever forward pass is fastest; each timed in
    inference mode, interleaved, at up to INFER_BATCH images, once per machine, torch version,
    network and batch (cached beside the training settings). Off a CPU, and for networks
    without image input: (False, {}), as trained."""
    if device.type != "cpu" or len(network.input_shape) != 3:
        return False, {}
    path = cache_path(cache)
    batch = max(1, min(batch, INFER_BATCH))
    key = cache_key(network, device, [INFER_METHOD, batch, "infer"])
    found = read_cache(path).get(key) if path else None
    if not (isinstance(found, dict) and isinstance(found.get("channels_last"), bool)
            and valid_plan(network, found.get("kernels")) and still_fair(found)):  # fmt: skip
        found = _measure_inference(network, device, batch)  # (missing, or an entry damaged)
        if path is not None:
            write_cache(path, key, found)
    return found["channels_last"], {str(n): str(k) for n, k in found["kernels"]}


def valid_plan(network: Network, plan: Any) -> bool:
    """Whether a cached plan, [[layer, kernel], ...], names layers of `network` and kernels
    cnnkit has (a damaged cache entry is measured anew, as a missing one is)."""
    if not isinstance(plan, (list, tuple)):
        return False
    layers = dict(network.named_modules())
    pairs = [p for p in plan if isinstance(p, (list, tuple)) and len(p) == 2]
    return len(pairs) == len(plan) and all(
        isinstance(n, str) and n in layers and k in FORMATS for n, k in pairs
    )


def _measure_inference(network: Network, device: torch.device, batch: int) -> dict[str, Any]:
    """Whole forward passes, interleaved: NCHW and channels_last, each with every linear
    product, and the kernel per layer that timing the layers alone picks (NNPACK's Winograd for
    one convolution, NHWC for the next...)."""
    threads = torch.get_num_threads()
    linear = [n for n, m in network.named_modules() if "wxt" in options(m)]
    products = options(network.get_submodule(linear[0]))[1:] if linear else ()  # not the plain
    plans = [(), *(tuple((n, p) for n in linear) for p in products)]
    grid = [("fp32", cl, threads, plan) for cl in (False, True) for plan in plans]
    with torch.random.fork_rng(devices=[]):
        timer = CandidateTimer(network, device, batch, exact=True, forward_only=True)
        layers = plan_kernels(network, timer.x, threads, forward_only=True)
        if layers:  # each layer's input in the format its kernel leaves: the batch comes NCHW
            grid.append(("fp32", False, threads, tuple(layers.items())))
        times = timer.run(grid)
    plain, best = grid[0], min(grid, key=times.get)
    chosen = best if times[best] * MARGIN < times[plain] else plain
    return {"precision": "fp32", "channels_last": chosen[1], "threads": threads,
            "speedup": times[plain] / times[chosen], "kernels": [list(k) for k in chosen[3]],
            "busy": timer.busy}  # fmt: skip


def still_fair(entry: dict[str, Any]) -> bool:
    """False for a cached choice measured while other processes took the CPU (its `busy`),
    once the machine is idle: measured again then, as cudnn.benchmark measures every run. On a
    machine that stays busy the choice is kept (measuring again would be as swayed)."""
    busy = entry.get("busy")
    return not (isinstance(busy, (int, float)) and busy_machine(busy) and idle_machine())


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def macs(network: Network) -> int:
    """Multiply-adds of one image's forward pass."""
    return sum(row.macs for row in network.table)


def cache_path(cache: Path | bool) -> Path | None:
    """True: the user's cache file CACHE; False: none; or the file given."""
    return CACHE if cache is True else (cache or None)


def cache_key(network: Network, device: torch.device, parts: list[Any]) -> str:
    """A key for one measurement: this machine, torch's and cnnkit's versions, `parts` (the
    method, the batch, what is fixed) and the network."""
    parts = [machine_name(device), torch.__version__, _version(), *parts,
             json.dumps(network.spec, sort_keys=True, default=str), network.num_classes]  # fmt: skip
    return hashlib.sha1(json.dumps(parts, default=str).encode()).hexdigest()[:20]


def _version() -> str:
    """cnnkit's version (the timing method may change with it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cnnkit")
    except PackageNotFoundError:
        return "source"


def read_cache(path: Path) -> dict[str, Any]:
    """Every cached entry (none when the file is missing or unreadable)."""
    try:
        data = json.loads(path.expanduser().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Add one entry (atomically; a cache that cannot be written is only a missed speed-up)."""
    path = path.expanduser()
    entries = read_cache(path)
    entries[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1) + "\n")
        tmp.replace(path)
    except OSError:
        pass
