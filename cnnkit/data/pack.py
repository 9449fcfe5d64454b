"""`cnnkit pack`: an image folder -> a packed data set, like the seed prepared ImageNet.

Every image is decoded and resized once (squash or shorter-side + centre crop) and stored as
uint8 (3, S, S) in shards: raw (memory-mapped when read) or JPEG records. Shards are packed in
parallel processes, each streaming images straight to its file (memory stays at a few images per
process), and a shard is finished by an atomic marker, so an interrupted pack resumes (a
shard whose file is not the size its marker says is packed again, and a finished pack whose
meta.json or index.npz does not read is finished again, by the same command). The mean
image, per-channel mean/std and RGB covariance (for PCA lighting) are computed alongside.

    DST/meta.json          format, size, resize, classes, counts, stats (written last)
    DST/index.npz          labels, shard, offset, length, source (H, W) per packed image
    DST/mean.npy           (3, S, S) float32 mean image
    DST/files.txt          source path of each packed image, in index order
    DST/bad_images.tsv     path, skipped|converted, reason (non-image files and duplicates too)
    DST/shards/NNNNN.{u8,jpg}  the pixels; NNNNN.npz  the shard's done marker + partial stats

Every file is written as NAME.tmp and renamed when complete, so nothing half-written ever looks
finished. A failed write (a full disk) is one error line; the shards done stay done and the same
command resumes. A pack that fails before its first shard, or finds no readable image, leaves
nothing behind. The worker side (one shard, and the atomic writes) is pack_shard.py; what
DST may hold, and how a failure leaves it, pack_dst.py.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import numpy as np
import torch

from cnnkit.data.base import MAX_SIDE
from cnnkit.data.decode import ResizeMode
from cnnkit.data.pack_dst import (
    Busy,
    DstLock,
    check_dst,
    check_no_clash,
    check_not_images,
    check_outside,
    finished_meta,
    shards_done,
    shards_to_pack,
    shards_with_fixed_images,
    tidy,
    write_error,
)
from cnnkit.data.pack_shard import SHARD_SUFFIX, PackFormat, PackJob, pack_shard, write_text
from cnnkit.data.packfiles import PACK_FORMAT, is_plan
from cnnkit.data.resize import Interpolation, resize_mode
from cnnkit.data.scan import Scan, printable, scan_images
from cnnkit.errors import ConfigError, DataError, Interrupted
from cnnkit.runtime import atomic, available_cores


@dataclass
class PackSummary:
    """What a pack produced (printed by the CLI)."""

    dst: Path
    images: int
    shards: int
    classes: int
    converted: int
    skipped: int
    resumed_shards: int
    empty_classes: list[str] = field(default_factory=list)  # every image of theirs skipped


_OPTION = {
    "source": "SRC",
    "size": "--size",
    "resize": "--resize",
    "storage": "--format",
    "quality": "--quality",
    "interpolation": "--interpolation",
}  # the pack's parameters as `cnnkit pack` names them
OLDER = {"interpolation": "bilinear"}  # what a pack's plan made before a parameter was one meant


def _shown(key: str, value: Any) -> str:
    return "shorter-side-crop" if key == "resize" and value == "shorter" else str(value)


def _plan(src: Path, dst: Path, params: dict, labels_file: Path | None,
          shard_size: int | None, lock: DstLock) -> dict:  # fmt: skip
    """The pack's fixed plan (file list, labels, params); reused when resuming into DST, DST
    held first (`lock`: one pack at a time).

    The folder is scanned before anything is written: a refused folder leaves no DST. A new
    DST is held once scanned, and a plan another pack wrote meanwhile is read as a resume's.
    """
    plan_path = dst / "plan.json"
    if plan_path.exists():
        lock.take()
        try:
            plan = json.loads(plan_path.read_text())
        except (ValueError, UnicodeDecodeError):  # not JSON: a user's own file, never deleted
            plan = None
        if not is_plan(plan):
            raise DataError(f"{printable(str(plan_path))}: not a cnnkit pack's plan; pack into "
                            "another folder (this one is not a pack)")  # fmt: skip
        then = {**OLDER, **plan["params"]}
        if then != params:
            diff = [f"{_OPTION.get(k, k)} {_shown(k, v)} here, {_shown(k, then.get(k))} there"
                    for k, v in params.items() if then.get(k) != v]  # fmt: skip
            raise DataError(f"{dst}: holds a different pack ({'; '.join(diff)}); use another DST "
                            "or delete it")  # fmt: skip
        plan["params"] = then  # (an older plan's, with what it meant said)
        scan = scan_images(src, labels_file, labels_option="--labels")
        check_outside(dst, src, scan)
        _check_unchanged(plan, scan, src, dst)
        return plan
    check_not_images(dst)  # (before the scan: ImageNet's takes a while)
    scan = scan_images(src, labels_file, labels_option="--labels")
    check_outside(dst, src, scan)
    # ~32+ shards so every process stays busy, at most 512 images (100 MB raw) per shard
    shard_size = shard_size or min(512, max(16, -(-len(scan.files) // 32)))
    plan = {"params": params, "files": scan.files, "labels": scan.labels,
            "classes": scan.classes, "shard_size": shard_size,
            "skipped": [f"{printable(p)}\tskipped\t{r}" for p, r in scan.skipped]}  # fmt: skip
    (dst / "shards").mkdir(parents=True, exist_ok=True)
    lock.take()
    if plan_path.exists():  # written by another pack during the scan (which has ended)
        return _plan(src, dst, params, labels_file, shard_size, lock)
    write_text(plan_path, json.dumps(plan))
    return plan


def _check_unchanged(plan: dict, scan: Scan, src: Path, dst: Path) -> None:
    """DataError unless the folder (and label file) still hold what the plan was made from: a
    pack resumed or re-run after images were added, removed or relabelled would be stale."""
    if (scan.files, scan.labels, scan.classes) == (plan["files"], plan["labels"], plan["classes"]):
        return
    then = dict(zip(plan["files"], plan["labels"], strict=True))
    now = dict(zip(scan.files, scan.labels, strict=True))
    added, gone = len(now.keys() - then.keys()), len(then.keys() - now.keys())
    names = plan["classes"], scan.classes
    relabelled = sum(names[0][then[f]] != names[1][now[f]] for f in now.keys() & then.keys())
    what = [f"{n} {word}" for n, word in ((added, "added"), (gone, "gone"),
                                          (relabelled, "relabelled")) if n]  # fmt: skip
    change = ", ".join(what) if what else "classes or order changed"
    raise DataError(f"{printable(str(src))} changed since {printable(str(dst))} was packed "
                    f"({change}); delete {printable(str(dst))} and pack again, or pack into "
                    "another folder")  # fmt: skip


def _jobs(plan: dict, src: Path, dst: Path) -> list[PackJob]:
    shard_size = plan["shard_size"]
    p = plan["params"]
    n = len(plan["files"])
    return [
        PackJob(
            s,
            str(src),
            plan["files"][a : a + shard_size],
            plan["labels"][a : a + shard_size],
            p["size"],
            p["resize"],
            p["storage"],
            p["quality"],
            str(dst / "shards"),
            p["interpolation"],
        )  # fmt: skip
        for s, a in enumerate(range(0, n, shard_size))
    ]


def _init_worker() -> None:
    torch.set_num_threads(1)  # one process per core already
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's: no tracebacks


def _run_jobs(jobs: list[PackJob], workers: int, total: int, done: int, show: bool) -> None:
    """Run the shard jobs in `workers` processes with a progress bar over images."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
               TimeRemainingColumn())  # fmt: skip
    if workers <= 1:
        with Progress(*columns, disable=not show, transient=False) as bar:
            task = bar.add_task("packing", total=total, completed=done)
            for job in jobs:
                bar.advance(task, pack_shard(job)[1])
        return
    # the workers start before the progress bar's thread does
    before = set(mp.active_children())
    with _pool_context().Pool(workers, initializer=_init_worker) as pool:
        started = [p for p in mp.active_children() if p not in before]  # the pool's workers
        finished = pool.imap_unordered(pack_shard, jobs)
        with Progress(*columns, disable=not show, transient=False) as bar:
            task = bar.add_task("packing", total=total, completed=done)
            for _ in jobs:
                bar.advance(task, _next_finished(finished, started)[1])


def _pool_context() -> Any:
    """How the pack's processes start: a fork of this process where it runs no other thread
    (`cnnkit pack`), else from a fork server (a notebook's, a test runner's threads: a fork
    could copy a lock one of them holds, and hang), which needs a script's call under
    `if __name__ == "__main__":`; spawn where there is no fork."""
    methods = mp.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return mp.get_context("fork")
    if "forkserver" not in methods:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


class WorkerDied(Exception):
    """A pack worker process ended mid-shard (the OOM killer, a crash in an image decoder): the
    pool would start another, but that shard would never come back."""


def _next_finished(finished: Any, workers: list[Any]) -> tuple[int, int]:
    """The next shard's (shard, images), waited for in 0.25 s slices: Ctrl-C's KeyboardInterrupt
    is raised between two of them, not only once a shard ends (an ImageNet shard takes seconds;
    Python runs the handler in the main thread only, so a signal that the kernel hands to one
    of the pool's threads would otherwise wait for the next shard); WorkerDied if one of the
    pool's `workers` has ended (they live as long as the pool), instead of waiting forever."""
    while True:
        try:
            return finished.next(timeout=0.25)
        except mp.TimeoutError:
            dead = next((w for w in workers if w.exitcode is not None), None)
            if dead is not None:
                code = dead.exitcode
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
                raise WorkerDied(how) from None


def _merge_markers(dst: Path, jobs: list[PackJob]) -> tuple[dict, dict, list, list]:
    """The shard markers summed and joined: (stat totals, index arrays, files, report lines)."""
    size = jobs[0].size
    total = {"image": np.zeros((3, size, size)), "channel": np.zeros(3), "xxt": np.zeros((3, 3))}
    index = {"labels": [], "shard": [], "offset": [], "length": [], "source": []}
    files, report = [], []
    for job in jobs:
        with np.load(dst / "shards" / f"{job.shard:05d}.npz") as z:
            for key in total:
                total[key] += z[key]
            index["labels"].append(z["labels"])
            index["shard"].append(np.full(len(z["labels"]), job.shard, np.int32))
            index["offset"].append(z["offsets"])
            index["length"].append(z["lengths"])
            # (None from a marker an older cnnkit wrote, when resuming its pack: left out)
            index["source"].append(z["sources"] if "sources" in z.files else None)
            files += [job.files[k] for k in z["kept"]]
            report += list(z["report"])
    if any(part is None for part in index["source"]):
        del index["source"]
    return total, {k: np.concatenate(v) for k, v in index.items()}, files, report


def _finalize(plan: dict, dst: Path, jobs: list[PackJob]) -> dict:
    """Merge the shard markers into the index, mean image, stats, report and meta.json."""
    p = plan["params"]
    size = p["size"]
    total, arrays, files, report = _merge_markers(dst, jobs)
    count = len(files)
    if count == 0:
        first = report[0].replace("\tskipped\t", ": ") if report else "?"
        raise NothingPacked(f"none of the {len(plan['files'])} images could be read "
                            f"(first: {first})")  # fmt: skip
    with atomic(dst / "index.npz") as f:
        np.savez(f, **arrays)
    mean_image = io.BytesIO()  # written whole: numpy's own write to a file of a full disk
    np.save(mean_image, (total["image"] / count).astype(np.float32))  # raises with no errno
    with atomic(dst / "mean.npy") as f:
        f.write(mean_image.getbuffer())
    write_text(dst / "files.txt", "".join(f"{printable(f)}\n" for f in files))
    report = plan.get("skipped", []) + report
    write_text(dst / "bad_images.tsv", "path\tstatus\treason\n" + "".join(f"{r}\n" for r in report))
    pixels = count * size * size
    mean = total["channel"] / pixels
    cov = total["xxt"] / pixels - np.outer(mean, mean)
    used = set(np.unique(arrays["labels"]).tolist())
    meta = {
        "format": PACK_FORMAT, **p, "classes": plan["classes"], "num_images": count,
        "shards": [f"{j.shard:05d}{SHARD_SUFFIX[p['storage']]}" for j in jobs],
        "mean": mean.tolist(), "std": np.sqrt(np.diag(cov).clip(0)).tolist(), "rgb_cov": cov.tolist(),
        "converted": sum("\tconverted\t" in r for r in report),
        "skipped": sum("\tskipped\t" in r for r in report),
        "empty_classes": [c for k, c in enumerate(plan["classes"]) if k not in used],
    }  # fmt: skip
    write_text(dst / "meta.json", json.dumps(meta, indent=1))
    return meta


class NothingPacked(DataError):
    """Every image of the folder was unreadable: the pack is discarded."""


def _check_options(src: Path, size: int, resize: str, format: str, quality: int,
                   shard_size: int | None) -> None:  # fmt: skip
    if not src.is_dir():
        raise DataError(f"{printable(str(src))}: not a folder")
    for bad, what in ((size < 8, f"--size must be >= 8 (got {size})"),
                      (not 1 <= quality <= 100, f"--quality must be 1..100 (got {quality})"),
                      ((shard_size or 1) < 1, f"shard_size must be >= 1 (got {shard_size})")):  # fmt: skip
        if bad:
            raise ConfigError(what)
    if size > MAX_SIDE:  # (MAX_SIDE squared is within decode.MAX_PIXELS)
        raise ConfigError(f"--size {size}: over the limit of {MAX_SIDE} px a side (the largest "
                          "a network trained on the pack may read)")  # fmt: skip
    try:
        resize_mode(resize, "--resize")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if format not in SHARD_SUFFIX:
        raise ConfigError(f"--format: {format!r} is not {' or '.join(SHARD_SUFFIX)}")


def _pack(src: Path, dst: Path, params: dict, labels_file: Path | None, shard_size: int | None,
          workers: int | None, progress: bool, lock: DstLock) -> PackSummary:  # fmt: skip
    """Plan (or reload the plan), holding DST; pack the shards not done yet, finalize."""
    plan = _plan(src, dst, params, labels_file, shard_size, lock)
    jobs = _jobs(plan, src, dst)
    (dst / "shards").mkdir(parents=True, exist_ok=True)  # (also where a resumed pack lost it)
    todo = shards_to_pack(dst, jobs)
    todo += shards_with_fixed_images(dst, jobs, todo)
    done_images = sum(len(j.files) for j in jobs if j not in todo)
    meta = None if todo else finished_meta(dst)
    if meta is None:
        if todo:
            workers = max(1, min(workers or available_cores(), len(todo)))
            _run_jobs(todo, workers, len(plan["files"]), done_images, progress)
        meta = _finalize(plan, dst, jobs)
    return PackSummary(dst, meta["num_images"], len(jobs), len(meta["classes"]),
                       meta["converted"], meta["skipped"], len(jobs) - len(todo),
                       meta.get("empty_classes", []))  # fmt: skip


def pack_folder(
    src: str | Path,
    dst: str | Path,
    size: int = 256,
    resize: ResizeMode = "squash",
    format: PackFormat = "raw",
    quality: int = 90,
    workers: int | None = None,
    labels_file: str | Path | None = None,
    shard_size: int | None = None,
    progress: bool = True,
    interpolation: Interpolation = "bilinear",
) -> PackSummary:
    """Pack an image folder (class subfolders, or flat + labels file) into DST; resumable."""
    src, dst = Path(src), Path(dst)
    _check_options(src, size, resize, format, quality, shard_size)
    if interpolation not in get_args(Interpolation):
        raise ConfigError(f"--interpolation: {interpolation!r} is not bilinear or bicubic")
    resize = resize_mode(resize)  # (shorter-side-crop: shorter, as meta.json says it)
    check_dst(src, dst)
    params = {"source": str(src.resolve()), "size": size, "resize": resize, "storage": format,
              "quality": quality, "interpolation": interpolation}  # fmt: skip
    check_no_clash(dst)
    created = not dst.exists()
    labels, lock = Path(labels_file) if labels_file else None, DstLock(dst)

    def tidy_held(discard: bool) -> None:  # a pack that never held DST leaves it alone
        if lock.held:  # (another pack's .tmp files, or its plan, may be there)
            tidy(dst, created, discard)

    try:
        return _pack(src, dst, params, labels, shard_size, workers, progress, lock)
    except Busy:
        raise
    except NothingPacked as e:
        tidy_held(discard=True)
        raise DataError(f"{printable(str(src))}: {e}") from None
    except OSError as e:
        tidy_held(discard=not (dst / "plan.json").exists())
        raise write_error(e, dst) from None
    except WorkerDied as e:
        tidy_held(discard=False)
        raise DataError(f"pack: a worker process died ({e}): out of memory, or a crash decoding "
                        f"an image; {shards_done(dst)} shards done in {printable(str(dst))}, the "
                        "same command resumes from them") from None  # fmt: skip
    except KeyboardInterrupt:
        tidy_held(discard=False)
        if not lock.held or not (dst / "plan.json").exists():
            raise Interrupted(
                "pack interrupted before its first shard: nothing was packed"
            ) from None
        raise Interrupted(f"pack interrupted: {shards_done(dst)} shards done in "
                          f"{printable(str(dst))}; the same command resumes from them") from None  # fmt: skip
    except BaseException:
        tidy_held(discard=False)
        raise
    finally:
        lock.release()  # (after the tidying: no other pack starts meanwhile)
