"""`cnnkit bench loader`: images/s of the input pipeline alone (no model), from the files or shards
to augmented float batches on the device, so it can be compared with what the model consumes.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from cnnkit.bench.timing import synchronize
from cnnkit.data import data_config
from cnnkit.data.base import Batches
from cnnkit.data.packfiles import is_pack, read_meta
from cnnkit.errors import ConfigError, DataError
from cnnkit.runtime import machine_name


def loader_config(
    data: str | Path, workers: int | None, batch: int, **options: Any
) -> dict[str, Any]:
    """A `data:` section for DATA: a packed set (an unfinished one is an error that says so),
    else an image folder (`workers` None: the loader's default for this machine; no crop
    given: 227, or 7/8 of a smaller pack's side)."""
    path = Path(data)
    if not path.is_dir():
        raise DataError(f"{path}: not a folder (give an image folder or a packed set)")
    source = "packed" if is_pack(path) else "folder"
    if source == "packed" and "crop" not in options:  # 227 where it fits, else 7/8 of the side
        side = read_meta(path, "data.path")["size"]
        options = {**options, "crop": 227 if side >= 227 else max(1, side * 7 // 8)}
    section = {"source": source, "path": str(path), "batch_size": batch, "val_fraction": 0.0,
               **({} if workers is None else {"workers": workers}), **options}  # fmt: skip
    return section


def tree_cpu_seconds() -> float:
    """CPU seconds used so far by this process and its live descendants (loader workers), read
    from /proc; only this process's own time where /proc is missing. Unlike images/s, CPU time
    per image hardly changes when other programs load the machine."""
    if not os.path.isdir("/proc/self/task"):
        return time.process_time()
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for pid in (int(name) for name in os.listdir("/proc") if name.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime + stime
    todo, total = [os.getpid()], 0
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


def _endless(stream: Batches) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    epoch = 0
    while True:
        stream.set_epoch(epoch)
        images = 0
        for item in stream:
            images += len(item[0])
            yield item
        if images == 0:  # no batch, or only batches of unreadable images (each said above)
            raise DataError("bench loader: an epoch of the data set yields no image (too few "
                            "images, or none readable)")  # fmt: skip
        epoch += 1


def bench_loader(data: str | Path, workers: int | None = None, batch: int = 256, batches: int = 20,
                 warmup: int | None = None, device: torch.device | None = None,
                 **options: Any) -> dict[str, Any]:  # fmt: skip
    """Time `batches` training batches after `warmup` untimed ones and the first (which starts
    the workers); `warmup` None: 3 more than the workers prefetch, so the batches made while
    they started are not counted. Returns the figures ("warmup": every untimed batch;
    "workers": the processes started, 0 where the main process makes the batches)."""
    if batches < 1 or batch < 1:
        raise ConfigError(f"bench loader: --batches and --batch must be >= 1 (got {batches}, "
                          f"{batch})")  # fmt: skip
    if warmup is not None and warmup < 0:
        raise ConfigError(f"bench loader: warmup must be >= 0 (got {warmup})")
    try:
        return _time_loader(data, workers, batch, batches, warmup, device, options)
    except (ConfigError, DataError) as e:  # building or running the loader: its words, flags'
        e.args = (as_flags(str(e)),)
        raise


FLAGS = {"crop": "--crop", "decode": "--decode", "workers": "--workers", "batch_size": "--batch"}


def as_flags(message: str) -> str:
    """A message naming the `data:` settings bench loader made from its flags, in its flags'
    words (`data.workers=2` as `--workers 2`; data.prefetch, which no flag sets, left out of
    advice to lower it)."""
    message = re.sub(r", data\.prefetch or ", " or ", message)  # (SHM_ADVICE's list)
    message = re.sub(r" or data\.prefetch\b", "", message)  # (a worker that died)
    message = re.sub(r"\bdata\.workers=(\d+)", r"--workers \1", message)
    return re.sub(r"\bdata\.(crop|decode|workers|batch_size)\b",
                  lambda m: FLAGS[m.group(1)], message)  # fmt: skip


def _time_loader(data: str | Path, workers: int | None, batch: int, batches: int,
                 warmup: int | None, device: torch.device | None,
                 options: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """bench_loader's timing, its errors in the words of the data settings."""
    device = device or torch.device("cpu")
    cfg = data_config(loader_config(data, workers, batch, **options))
    stream = cfg.build(device).train
    storage = (
        json.loads((Path(data) / "meta.json").read_text())["storage"]
        if cfg.source == "packed"
        else "files"
    )
    workers = 0 if stream.mode == "views" else stream.workers  # views: cut in-process, no workers
    if warmup is None:
        warmup = 3 + workers * stream.prefetch
    it = _endless(stream)
    for _ in range(warmup + 1):  # the first batch also starts the worker processes
        next(it)
    synchronize(device)
    cpu = tree_cpu_seconds()  # (reads /proc: before the clock starts)
    images, largest, start = 0, 0, time.perf_counter()
    for _ in range(batches):
        x, _ = next(it)
        images, largest = images + x.shape[0], max(largest, x.shape[0])
    synchronize(device)
    seconds, cpu = time.perf_counter() - start, tree_cpu_seconds() - cpu
    del it  # stops the workers
    if images == 0:
        raise DataError(f"bench loader: the {batches} timed batches held no readable image; time "
                        "more of them (--batches)")  # fmt: skip
    return {
        "data": str(data), "source": cfg.source, "storage": storage, "decode": cfg.decode,
        "mode": stream.mode, "device": machine_name(device), "workers": workers,
        "batch": batch, "largest_batch": largest, "batches": batches, "warmup": warmup + 1,
        "images": images, "cpu_seconds": cpu,
        "input_shape": list(x.shape[1:]), "train_crop": cfg.train_crop, "seconds": seconds,
        "images_per_second": images / seconds, "cpu_ms_per_image": 1000 * cpu / images,
    }  # fmt: skip


def print_loader(report: dict[str, Any]) -> None:
    """One human line per figure."""
    what = f"{report['source']} ({report['storage']}, {report['mode']}, decode {report['decode']})"
    print(f"loader  {what} {report['data']}  on {report['device']}")
    batch = report["batch"]
    if report["largest_batch"] < batch:  # a set smaller than one batch
        batch = f"{batch} (of {report['largest_batch']} images: the set is smaller)"
    workers = f"workers {report['workers']}" if report["workers"] else "in-process (no workers)"
    print(f"  {workers}, batch {batch}, input {report['input_shape']}"
          f" ({report['train_crop']} crop), {report['images']} images in {report['seconds']:.2f} s"
          f" after {report['warmup']} untimed batches")  # fmt: skip
    coarse = ", coarse: under 0.2 CPU s measured" if report["cpu_seconds"] < 0.2 else ""
    print(f"  {report['images_per_second']:,.0f} images/s, "
          f"{report['cpu_ms_per_image']:.2f} CPU ms per image (all processes{coarse})")  # fmt: skip
