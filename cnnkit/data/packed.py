"""The `packed` source: a set written by `cnnkit pack`. Raw shards are memory-mapped, so every
loader process and every rank shares the page cache and a batch is one gather of uint8 rows;
JPEG shards are decoded by the workers.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import Field, PrivateAttr
from torch.utils.data import Dataset

from cnnkit.data.augment import lighting_from_cov
from cnnkit.data.base import DataBundle, Preprocess, resized_side
from cnnkit.data.batch import BatchJob, Crops, Encoded, ImageList, WorkerBatch
from cnnkit.data.boxes import frame_boxes
from cnnkit.data.decode import BadImage, decode_jpeg_bytes
from cnnkit.data.holdout import OWN_VAL_SET, holdout_id, holdout_split
from cnnkit.data.imageset import ImageSetConfig, build_augment
from cnnkit.data.loader import build_streams
from cnnkit.data.packfiles import RESIZE_FLAG, read_index, read_meta, scanned_images
from cnnkit.data.resize import planar, resize_crop
from cnnkit.data.scan import unknown_classes
from cnnkit.data.slots import new_batch
from cnnkit.errors import ConfigError, DataError, one_line
from cnnkit.runtime import torch_threads


class PackedImages(Dataset):
    """A packed set as a BatchDataset (data/batch.py): one call copies (raw) or decodes (JPEG)
    a whole batch, or cuts its crops, or hands back the JPEG records for the device."""

    crops = True
    slots: torch.Tensor | None = None  # the loader's shared ring (set before workers start)

    def __init__(self, path: str | Path, ids: np.ndarray | None = None,
                 label_map: np.ndarray | None = None) -> None:  # fmt: skip
        self.path = Path(path)
        self.meta = read_meta(path)
        self.index = read_index(self.path, self.meta)
        labels = self.index["labels"]
        self.labels = label_map[labels] if label_map is not None else labels
        self.ids = np.arange(len(labels)) if ids is None else ids
        self.size, self.resize_mode = self.meta["size"], self.meta["resize"]
        self.interpolation = self.meta.get("interpolation", "bilinear")  # (older packs: none)
        self.direct = self.meta["storage"] == "raw"  # a CPU device crops from the page cache
        self.jpeg = self.meta["storage"] == "jpeg"
        # each photo's own (H, W), where it was squashed whole into the square
        self._source_hw = self.index.get("source") if self.resize_mode == "squash" else None
        self._shards: list[np.ndarray] = []  # mapped lazily in each process, shared by subsets
        self._files: list[str] | None = None  # files.txt, read at the first damaged record

    def subset(self, ids: np.ndarray) -> PackedImages:
        """The same set restricted to images `ids` (the index is shared, not read again)."""
        part = copy.copy(self)  # (by __getstate__: without the mappings)
        part.ids, part._shards = ids, self._shards  # this set's list: mapped once a process
        return part

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_shards": [], "_files": None}  # never pickle the mappings

    def __len__(self) -> int:
        return len(self.ids)

    def shards(self) -> list[np.ndarray]:
        """The shard files, memory-mapped read-only (page cache shared by all processes)."""
        if not self._shards:  # (filled in place: the subsets sharing the list see them)
            folder = self.path / "shards"
            self._shards.extend([_mapped(folder / name) for name in self.meta["shards"]])
        return self._shards

    def _record(self, i: int) -> np.ndarray:
        """Image i's bytes in its shard (a view of the mapping)."""
        offset = self.index["offset"][i]
        return self.shards()[self.index["shard"][i]][offset : offset + self.index["length"][i]]

    def _image(self, i: int) -> torch.Tensor:
        """Image i as (3, size, size) uint8: a view of a raw shard, or decoded (BadImage for a
        damaged JPEG record)."""
        s, record = self.size, self._record(i)
        if self.direct:
            return torch.from_numpy(record.reshape(3, s, s))
        try:
            image = decode_jpeg_bytes(record, s)
        except (ValueError, OSError) as e:  # simplejpeg / Pillow on damaged bytes
            raise BadImage(f"damaged JPEG record ({one_line(e, 80)})") from None
        if image.shape[:2] != (s, s):
            raise BadImage(f"damaged JPEG record ({image.shape[1]}x{image.shape[0]}, not {s}x{s})")
        return torch.from_numpy(image).permute(2, 0, 1)

    def keys(self) -> list[str] | None:
        """Every image's source file (files.txt), the names a held-out split is drawn by; None
        where that list is missing or does not match the index."""
        if self._files is None:
            self.packed_from(0)  # reads files.txt
        return self._files if len(self._files) == len(self.labels) else None

    def name(self, i: int) -> str:
        """How reports name image i: the set and its index."""
        return f"{self.path} image {i}"

    def packed_from(self, i: int) -> str:
        """The file image i was packed from (files.txt), or '?' where that list is missing."""
        if self._files is None:
            try:
                self._files = (self.path / "files.txt").read_text("utf-8").splitlines()
            except (OSError, UnicodeDecodeError):
                self._files = []
        return self._files[i] if i < len(self._files) else "?"

    def sources(self, ids: np.ndarray) -> torch.Tensor | None:
        """(B, 2) int64 the (H, W) of the photos images `ids` were squashed from, None where
        the set does not say (packed shorter-side, or by an older cnnkit)."""
        return None if self._source_hw is None else torch.from_numpy(self._source_hw[ids])

    def __getitem__(self, job: BatchJob) -> WorkerBatch:
        ids = self.ids[job.positions]
        labels = torch.from_numpy(self.labels[ids])
        if job.encoded:
            return WorkerBatch(labels, encoded=Encoded.join([self._record(i) for i in ids]),
                               names=[self.name(i) for i in ids], sources=self.sources(ids))  # fmt: skip
        side = job.crops.side if job.crops else self.size
        x = new_batch(len(ids), side) if job.slot is None else self.slots[job.slot]
        with torch_threads(1):  # per-image resizes (already so in a worker process)
            kept, bad = self._fill(x, ids, job)
        if bad:
            labels = labels[kept]
        alpha = job.crops.alpha[kept] if job.crops else None
        pixels = x[: len(kept)] if job.slot is None else None
        return WorkerBatch(labels, pixels, job.slot, alpha=alpha, bad=bad,
                           sources=self.sources(ids[kept]))  # fmt: skip

    def _fill(self, out: torch.Tensor, ids: np.ndarray, job: BatchJob) -> tuple[list, list]:
        """Every image of the batch into `out`, in order: whole (one memcpy from the page cache,
        or a decode) or its crop, resized and mirrored. Returns (positions kept, (name, reason)
        of the damaged JPEG records left out)."""
        kept, bad, c = [], [], job.crops
        boxes = None if c is None else self._boxes(c, ids)
        for k, i in enumerate(ids):
            row = out[len(kept)]
            try:
                if c is None and self.direct:
                    row.view(-1).copy_(torch.from_numpy(self._record(i)))
                elif c is None:
                    planar(self._image(i), row)
                else:
                    top, left, h, w = boxes[k].tolist()
                    region = self._image(i)[:, top : top + h, left : left + w]
                    resize_crop(region, c.side, bool(c.flip[k]), row, self.interpolation)
            except BadImage as e:
                bad.append((f"{self.name(i)} (packed from {self.packed_from(i)})", str(e)))
                continue
            kept.append(k)
        return kept, bad

    def _boxes(self, crops: Crops, ids: np.ndarray) -> torch.Tensor:
        """The crops' boxes in the stored squares: drawn on the photos where the set knows
        their sizes (as the main process draws them), else as the crops came."""
        sources = self.sources(ids)
        on_photos = None if sources is None else crops.on_sources(sources)
        return crops.boxes if on_photos is None else frame_boxes(on_photos, sources, self.size)

    def views(self, positions: list[int]) -> tuple[ImageList, torch.Tensor, torch.Tensor | None]:
        """(images as views of the mapped shards, labels, their photos' sizes (`sources`)): the
        zero-copy batch of a CPU device."""
        ids, s = self.ids[positions], self.size
        views = [self._record(i).reshape(3, s, s) for i in ids]
        return ImageList(views), torch.from_numpy(self.labels[ids]), self.sources(ids)


def _val_label_map(train_classes: list[str], val_classes: list[str], where: str) -> np.ndarray:
    """Index map from the val pack's class ids to the training pack's (matched by name)."""
    lookup = {name: k for k, name in enumerate(train_classes)}
    unknown = [c for c in val_classes if c not in lookup]
    if unknown:
        raise DataError(f"{where}: class {unknown[0]!r} is not among the training classes"
                        f"{unknown_classes(unknown, train_classes)}")  # fmt: skip
    return np.array([lookup[c] for c in val_classes], np.int64)


def _check_disjoint(val_path: str, path: str, val_meta: dict, meta: dict) -> None:
    """DataError where the val pack was packed from data.path's own folder and holds images the
    training pack holds too (`cnnkit pack train val_pack`: its held-out figures would count
    images trained on); one pack given as both is one set evaluated whole (eval --data)."""
    source = meta.get("source")
    if source is None or val_meta.get("source") != source:
        return
    if Path(val_path).resolve() == Path(path).resolve():
        return
    try:
        names = [(Path(p) / "files.txt").read_text().splitlines() for p in (val_path, path)]
    except OSError:  # (a pack of an older cnnkit: no file list to tell)
        return
    shared = set(names[0]).intersection(names[1])
    if shared:
        raise DataError(f"data.val_path {val_path}: packed from the training pack's own folder "
                        f"({source}), and {len(shared)} of its {len(names[0])} images "
                        f"are in data.path's pack too (first: {min(shared)}); held-out images "
                        "must not be trained on: pack the held-out folder, or data.val_path="
                        "null to hold out data.val_fraction of data.path")  # fmt: skip


class PackedConfig(ImageSetConfig):
    """Train from sets written by `cnnkit pack` (raw memory-mapped or JPEG shards)."""

    source: Literal["packed"] = "packed"
    path: str = Field(description="packed training set (cnnkit pack output)")
    val_path: str | None = Field(None, description="packed validation set (default: hold out)")
    _holdout: str | None = PrivateAttr(None)  # the split a run drew (drawn_as)

    def class_names(self) -> list[str]:
        return read_meta(self.path, "data.path")["classes"]

    def build(self, device: torch.device, rank: int = 0, world_size: int = 1,
              seed: int = 0, local_ranks: int = 1) -> DataBundle:  # fmt: skip
        """Open the packed sets and make this rank's streams."""
        meta = read_meta(self.path, "data.path")
        if self.crop > meta["size"]:
            raise ConfigError(
                f"data.crop: {self.crop} is larger than the packed size {meta['size']}"
            )
        if self.val_path:
            train = PackedImages(self.path)
            val_meta = read_meta(self.val_path, "data.val_path")
            made = [(m["size"], m["resize"], m.get("interpolation", "bilinear"))
                    for m in (val_meta, meta)]  # fmt: skip
            if made[0] != made[1]:
                said = [f"--size {s} --resize {RESIZE_FLAG[r]} --interpolation {i}"
                        for s, r, i in made]  # fmt: skip
                raise DataError(f"{self.val_path}: packed with {said[0]}, the training set with "
                                f"{said[1]}: pack both alike")  # fmt: skip
            if not self._drawn:  # a new run's (a resumed or evaluated one's: as it was)
                _check_disjoint(self.val_path, self.path, val_meta, meta)
            label_map = _val_label_map(meta["classes"], val_meta["classes"], self.val_path)
            val = PackedImages(self.val_path, label_map=label_map)
            drawn = OWN_VAL_SET
        else:
            every = PackedImages(self.path)
            train_ids, val_ids, drawn = self._split(every)
            train, val = every.subset(train_ids), every.subset(val_ids)
        image = self._mean_image  # a trained run's (evaluated_as), else the pack's own
        if image is None and self.normalize == "mean_image":
            image = torch.from_numpy(np.load(Path(self.path) / "mean.npy")).float()
        stats = {"mean": self.mean or meta["mean"], "std": self.std or dividing_std(meta["std"]),
                 "lighting": lighting_from_cov(meta["rgb_cov"]), "mean_image": image}  # fmt: skip
        augment = build_augment(self, stats, meta.get("interpolation", "bilinear"))
        train_s, val_s = build_streams(self, train, val, augment, device, rank, world_size, seed,
                                       local_ranks)  # fmt: skip
        mean, std = self._preprocess_stats(meta, stats)
        pre = Preprocess.of_data(3, self.crop, meta["size"], meta["resize"], mean, std,
                                 interpolation=meta.get("interpolation", "bilinear"))  # fmt: skip
        labels = torch.from_numpy(train.labels[train.ids])
        return self.finish(DataBundle(train_s, val_s, meta["classes"], (3, self.crop, self.crop),
                                      pre, labels, image, drawn))  # fmt: skip

    def drawn_as(self, holdout: str | None) -> PackedConfig:
        out = super().drawn_as(holdout)
        out._holdout = holdout
        return out

    def _split(self, every: PackedImages) -> tuple[np.ndarray, np.ndarray, str | None]:
        """(training ids, held-out ids, holdout_id) of val_fraction: drawn from the images
        the folder held where the pack left some out as unreadable (_folders_split), as a
        folder run draws it (it counts them, skipped as read), so a run moves between a folder
        and its pack; the pack's own images' split where it left none out, or for a run
        (drawn_as) that drew another: made before, or before fingerprints."""
        if not self.val_fraction:
            return np.arange(len(every.labels)), np.zeros(0, np.int64), None
        keys = every.keys()
        folders = self._folders_split(every, keys)
        if folders is not None and not (self._drawn and self._holdout != folders[2]):
            return folders
        train_ids, val_ids = holdout_split(every.labels, self.val_fraction, keys=keys)
        return train_ids, val_ids, holdout_id(keys, val_ids, len(every.labels))

    def _folders_split(self, every: PackedImages,
                       keys: list[str] | None) -> tuple[np.ndarray, np.ndarray, str] | None:  # fmt: skip
        """The folder's split of a pack that left images out, as packed ids; None where it
        left none out (meta.json's count first: plan.json is read only then), where its scan
        is not known, or where a class would keep no readable image to train on (its
        readable ones all held out: the pack's own split keeps one)."""
        scanned = scanned_images(self.path, keys) if keys and every.meta.get("skipped") else None
        if scanned is None:
            return None
        files, labels, positions = scanned
        train_f, val_f = holdout_split(labels, self.val_fraction, keys=files)
        packed = np.full(len(files), -1, np.int64)  # each scanned file's packed index, or -1
        packed[positions] = np.arange(len(keys))
        train, val = (packed[ids][packed[ids] >= 0] for ids in (train_f, val_f))
        if np.setdiff1d(every.labels, every.labels[train]).size:
            return None
        return train, val, holdout_id(files, val_f, len(files))

    def stored_size(self) -> int:
        """The side the set was packed at."""
        return int(read_meta(self.path)["size"])

    def training_notes(self) -> list[str]:
        """ImageSetConfig's, and a crop that sees little of the images the set was packed at
        (a 256 px pack for LeNet-5's 32): as a folder's `size` is noted."""
        notes = super().training_notes()
        try:
            side = self.stored_size()
        except (DataError, KeyError, TypeError, ValueError):  # (said when the set is opened)
            return notes
        if self.crop < 0.75 * side:
            notes.append(f"data.crop {self.crop} of a set packed at {side} px: a crop sees "
                         f"{self.crop / side:.0%} of an image's side (torchvision's 224 of 256: "
                         f"88%); `cnnkit pack SRC DST --size {resized_side(self.crop)}` packs "
                         "it for this network")  # fmt: skip
        return notes

    def _preprocess_stats(self, meta: dict, stats: dict) -> tuple[list[float], list[float]]:
        """Per-channel mean/std for classification (the mean image's channel averages if used)."""
        if self.normalize == "mean_image":
            return stats["mean_image"].mean(dim=(1, 2)).tolist(), [1.0, 1.0, 1.0]
        return list(stats["mean"]), list(stats["std"])


def dividing_std(std: list[float]) -> list[float]:
    """A pack's channel std as normalisation divides by it: at least 1 (0-255 units, one grey
    level), since a channel constant over the whole set has std 0 and would divide by zero; 1
    keeps such a channel centred and unscaled (meta.json keeps the true figure)."""
    return [max(float(s), 1.0) for s in std]


def _mapped(path: Path) -> np.ndarray:
    """A shard file memory-mapped copy-on-write (read-only in effect, writable for torch); an
    empty array for an empty file (a shard all of whose images were skipped: mmap refuses it).

    torch's mapping keeps no file descriptor open (np.memmap keeps one per mapping): ImageNet's
    2,500 shards, mapped by each process, stay clear of the usual limit of 1,024 open files."""
    size = path.stat().st_size
    if size == 0:
        return np.zeros(0, np.uint8)
    name = str(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a name of other bytes, which torch cannot pass: by descriptor
        if not os.path.isdir("/proc/self/fd"):
            return np.memmap(path, np.uint8, "c")  # (one open file each, as before)
        fd = os.open(path, os.O_RDONLY)
        try:
            return torch.from_file(f"/proc/self/fd/{fd}", shared=False, size=size,
                                   dtype=torch.uint8).numpy()  # fmt: skip
        finally:
            os.close(fd)  # (the mapping stays)
    return torch.from_file(name, shared=False, size=size, dtype=torch.uint8).numpy()
