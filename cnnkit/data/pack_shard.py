"""The worker side of `cnnkit pack`: one shard's images decoded, resized and written as a
stream of raw or JPEG records, then its done marker (the shard's index rows, bad-image report
and partial statistics); and the atomic writes every pack file goes through.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

import numpy as np
import torch

from cnnkit.data.decode import BadImage, ResizeMode, encode_jpeg, load_resized
from cnnkit.data.resize import Interpolation
from cnnkit.data.scan import printable
from cnnkit.runtime import atomic

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
    interpolation: Interpolation = "bilinear"


def _image_stats(image: torch.Tensor, phase: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel sums (3,) and RGB cross-products (3, 3) of one uint8 image, in float64.

    Sums and squares (hence mean and std) are exact. The off-diagonal products are the image's
    exact mean products plus its covariance around that mean, estimated from every 7th pixel
    from `phase` (successive images take successive phases): 7x cheaper than all pixels, and
    centred, so the estimate's error is the covariance's own, not that of E[xy] (~100x larger).
    """
    pixels = image.numpy().reshape(3, -1)
    count = pixels.shape[1]
    sums = pixels.sum(1, dtype=np.int64).astype(np.float64)
    mean = sums / count
    sample = pixels[:, phase % 7 :: 7].astype(np.float32) - mean[:, None].astype(np.float32)
    xxt = count * ((sample @ sample.T).astype(np.float64) / sample.shape[1] + np.outer(mean, mean))
    squares = np.square(pixels, dtype=np.uint32).sum(1, dtype=np.uint64)
    np.fill_diagonal(xxt, squares.astype(np.float64))
    return sums, xxt


def write_text(path: Path, text: str) -> None:
    with atomic(path) as f:
        f.write(text.encode("utf-8"))


def pack_shard(job: PackJob) -> tuple[int, int]:
    """Decode, resize and write one shard, then its done marker; returns (shard, images seen)."""
    shards = Path(job.out_dir)
    with atomic(shards / f"{job.shard:05d}{SHARD_SUFFIX[job.format]}") as out:
        marker = _write_records(job, out)
    with atomic(shards / f"{job.shard:05d}.npz") as f:
        np.savez(f, **marker)
    return job.shard, len(job.files)


def _write_records(job: PackJob, out: IO[bytes]) -> dict[str, np.ndarray]:
    """Write the shard's images to `out`; returns what its done marker holds."""
    size = job.size
    sums = {"image": np.zeros((3, size, size)), "channel": np.zeros(3), "xxt": np.zeros((3, 3))}
    kept, labels, offsets, lengths, sources, report = [], [], [], [], [], []
    offset = 0
    for i, (rel, label) in enumerate(zip(job.files, job.labels, strict=True)):
        try:
            image, note, source = load_resized(Path(job.root) / rel, size, job.resize,
                                               interpolation=job.interpolation)  # fmt: skip
        except BadImage as e:
            report.append(f"{printable(rel)}\tskipped\t{e}")
            continue
        if note:
            report.append(f"{printable(rel)}\tconverted\t{note}")
        pixels = image.numpy()
        record = pixels.tobytes() if job.format == "raw" else encode_jpeg(pixels, job.quality)
        out.write(record)
        kept.append(i), labels.append(label), offsets.append(offset), lengths.append(len(record))
        sources.append(source)
        offset += len(record)
        sums["image"] += pixels
        channel, xxt = _image_stats(image, len(kept))
        sums["channel"] += channel
        sums["xxt"] += xxt
    return {"kept": np.array(kept, np.int64), "labels": np.array(labels, np.int64),
            "offsets": np.array(offsets, np.int64), "lengths": np.array(lengths, np.int64),
            "sources": np.array(sources, np.int64).reshape(-1, 2),
            "report": np.array(report, dtype=str), **sums}  # fmt: skip
