"""`cnnkit pack`: an image folder -> a packed data set, like the seed prepared ImageNet.

Every image is decoded and resized once (squash or shorter-side + centre crop) and stored as
uint8 (3, S, S) in shards: raw (memory-mapped when read) or JPEG records. Shards are packed in
parallel processes, each streaming images straight to its file (memory stays at a few images per
process), and a shard is finished by an atomic marker, so an interrupted pack resumes. The mean
image, per-channel mean/std and RGB covariance (for PCA lighting) are computed alongside.

    DST/meta.json          format, size, resize, classes, counts, stats (written last)
    DST/index.npz          labels, shard, offset, length per packed image
    DST/mean.npy           (3, S, S) float32 mean image
    DST/files.txt          source path of each packed image, in index order
    DST/bad_images.tsv     path, skipped|converted, reason
    DST/shards/NNNNN.{u8,jpg}  the pixels; NNNNN.npz  the shard's done marker + partial stats
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from cnnkit.data.decode import BadImage, ResizeMode, encode_jpeg, load_resized
from cnnkit.data.folder import scan_folder
from cnnkit.data.packed import PACK_FORMAT
from cnnkit.errors import ConfigError, DataError

PackFormat = Literal["raw", "jpeg"]
SHARD_SUFFIX = {"raw": ".u8", "jpeg": ".jpg"}


@dataclass
class PackJob:
    """One shard to write: which files, their labels, and how."""

    shard: int
    root: str
    files: list[str]
    labels: list[int]
    size: int
    resize: ResizeMode
    format: PackFormat
    quality: int
    out_dir: str


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


def _image_stats(image: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel sums (3,) and RGB cross-products (3, 3) of one uint8 image, in float64.

    Sums and squares (hence mean and std) are exact; the off-diagonal products use every 7th
    pixel, scaled up (a 7x cheaper estimate; they only steer the PCA lighting).
    """
    pixels = image.numpy().reshape(3, -1)
    sample = pixels[:, ::7].astype(np.float32)
    xxt = (sample @ sample.T).astype(np.float64) * (pixels.shape[1] / sample.shape[1])
    squares = np.square(pixels, dtype=np.uint32).sum(1, dtype=np.uint64)
    np.fill_diagonal(xxt, squares.astype(np.float64))
    return pixels.sum(1, dtype=np.int64).astype(np.float64), xxt


def pack_shard(job: PackJob) -> tuple[int, int]:
    """Decode, resize and write one shard, then its done marker; returns (shard, images seen)."""
    size, shards = job.size, Path(job.out_dir)
    data_path = shards / f"{job.shard:05d}{SHARD_SUFFIX[job.format]}"
    sums = {"image": np.zeros((3, size, size)), "channel": np.zeros(3), "xxt": np.zeros((3, 3))}
    kept, labels, offsets, lengths, report = [], [], [], [], []
    offset = 0
    with open(f"{data_path}.tmp", "wb") as out:
        for i, (rel, label) in enumerate(zip(job.files, job.labels, strict=True)):
            try:
                image, note = load_resized(Path(job.root) / rel, size, job.resize)
            except BadImage as e:
                report.append(f"{rel}\tskipped\t{e}")
                continue
            if note:
                report.append(f"{rel}\tconverted\t{note}")
            record = (
                image.numpy().tobytes()
                if job.format == "raw"
                else encode_jpeg(image.numpy(), job.quality)
            )
            out.write(record)
            (
                kept.append(i),
                labels.append(label),
                offsets.append(offset),
                lengths.append(len(record)),
            )
            offset += len(record)
            sums["image"] += image.numpy()
            channel, xxt = _image_stats(image)
            sums["channel"] += channel
            sums["xxt"] += xxt
    os.replace(f"{data_path}.tmp", data_path)
    marker = shards / f"{job.shard:05d}.npz"
    with open(f"{marker}.tmp", "wb") as f:
        np.savez(f, kept=np.array(kept, np.int64), labels=np.array(labels, np.int64),
                 offsets=np.array(offsets, np.int64), lengths=np.array(lengths, np.int64),
                 report=np.array(report, dtype=str), **sums)  # fmt: skip
    os.replace(f"{marker}.tmp", marker)
    return job.shard, len(job.files)


def _plan(src: Path, dst: Path, params: dict, labels_file: Path | None,
          shard_size: int | None) -> dict:  # fmt: skip
    """The pack's fixed plan (file list, labels, params); reused when resuming into DST."""
    plan_path = dst / "plan.json"
    if plan_path.exists():
        plan = json.loads(plan_path.read_text())
        if plan["params"] != params:
            diff = {
                k: (plan["params"].get(k), v)
                for k, v in params.items()
                if plan["params"].get(k) != v
            }
            raise DataError(f"{dst}: holds a different pack ({diff}); use another DST or delete it")
        return plan
    files, labels, classes = scan_folder(src, labels_file)
    if not files:
        raise DataError(f"{src}: no image files found")
    # ~32+ shards so every process stays busy, at most 512 images (100 MB raw) per shard
    shard_size = shard_size or min(512, max(16, -(-len(files) // 32)))
    plan = {"params": params, "files": files, "labels": labels, "classes": classes,
            "shard_size": shard_size}  # fmt: skip
    (dst / "shards").mkdir(parents=True, exist_ok=True)
    tmp = dst / "plan.json.tmp"
    tmp.write_text(json.dumps(plan))
    os.replace(tmp, plan_path)
    return plan


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
        )  # fmt: skip
        for s, a in enumerate(range(0, n, shard_size))
    ]


def _init_worker() -> None:
    torch.set_num_threads(1)  # one process per core already


def _run_jobs(jobs: list[PackJob], workers: int, total: int, done: int, show: bool) -> None:
    """Run the shard jobs in `workers` processes with a progress bar over images."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
               TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, disable=not show, transient=False) as bar:
        task = bar.add_task("packing", total=total, completed=done)
        if workers <= 1:
            for job in jobs:
                bar.advance(task, pack_shard(job)[1])
            return
        methods = mp.get_all_start_methods()
        ctx = mp.get_context("fork" if "fork" in methods else "spawn")
        with ctx.Pool(workers, initializer=_init_worker) as pool:
            for _, count in pool.imap_unordered(pack_shard, jobs):
                bar.advance(task, count)


def _finalize(plan: dict, dst: Path, jobs: list[PackJob]) -> dict:
    """Merge the shard markers into the index, mean image, stats, report and meta.json."""
    p = plan["params"]
    size = p["size"]
    total = {"image": np.zeros((3, size, size)), "channel": np.zeros(3), "xxt": np.zeros((3, 3))}
    index = {"labels": [], "shard": [], "offset": [], "length": []}
    files, report = [], []
    for job in jobs:
        with np.load(dst / "shards" / f"{job.shard:05d}.npz") as z:
            for key in total:
                total[key] += z[key]
            index["labels"].append(z["labels"])
            index["shard"].append(np.full(len(z["labels"]), job.shard, np.int32))
            index["offset"].append(z["offsets"])
            index["length"].append(z["lengths"])
            files += [job.files[k] for k in z["kept"]]
            report += list(z["report"])
    arrays = {k: np.concatenate(v) for k, v in index.items()}
    count = len(files)
    if count == 0:
        raise DataError(f"{dst}: every image was unreadable (see {dst / 'bad_images.tsv'})")
    np.savez(dst / "index.npz", **arrays)
    np.save(dst / "mean.npy", (total["image"] / count).astype(np.float32))
    (dst / "files.txt").write_text("".join(f"{f}\n" for f in files))
    (dst / "bad_images.tsv").write_text(
        "path\tstatus\treason\n" + "".join(f"{r}\n" for r in report)
    )
    pixels = count * size * size
    mean = total["channel"] / pixels
    cov = total["xxt"] / pixels - np.outer(mean, mean)
    meta = {
        "format": PACK_FORMAT, **p, "classes": plan["classes"], "num_images": count,
        "shards": [f"{j.shard:05d}{SHARD_SUFFIX[p['storage']]}" for j in jobs],
        "mean": mean.tolist(), "std": np.sqrt(np.diag(cov)).tolist(), "rgb_cov": cov.tolist(),
        "converted": sum("\tconverted\t" in r for r in report),
        "skipped": sum("\tskipped\t" in r for r in report),
    }  # fmt: skip
    tmp = dst / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, dst / "meta.json")
    return meta


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
) -> PackSummary:
    """Pack an image folder (class subfolders, or flat + labels file) into DST; resumable."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise DataError(f"{src}: not a folder")
    if size < 8 or not 1 <= quality <= 100 or (shard_size or 1) < 1:
        raise ConfigError("--size must be >= 8, --quality 1..100")
    if resize not in ("squash", "shorter") or format not in SHARD_SUFFIX:
        raise ConfigError(
            f"--resize squash|shorter-side-crop, --format raw|jpeg (got {resize}, {format})"
        )
    dst.mkdir(parents=True, exist_ok=True)
    params = {"source": str(src.resolve()), "size": size, "resize": resize, "storage": format,
              "quality": quality}  # fmt: skip
    plan = _plan(src, dst, params, Path(labels_file) if labels_file else None, shard_size)
    jobs = _jobs(plan, src, dst)
    todo = [j for j in jobs if not (dst / "shards" / f"{j.shard:05d}.npz").exists()]
    done_images = sum(len(j.files) for j in jobs if j not in todo)
    if todo or not (dst / "meta.json").exists():
        workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
        _run_jobs(todo, workers, len(plan["files"]), done_images, progress)
        meta = _finalize(plan, dst, jobs)
    else:
        meta = json.loads((dst / "meta.json").read_text())
    return PackSummary(dst, meta["num_images"], len(jobs), len(meta["classes"]),
                       meta["converted"], meta["skipped"], len(jobs) - len(todo))  # fmt: skip
