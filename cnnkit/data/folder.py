"""The `folder` source: train straight from image files, in torchvision's ImageFolder layout (one
folder per class, like ImageNet's train/) or a flat folder plus a label file (ImageNet's val/).
Workers decode (DCT-scaled JPEG) and resize in uint8, and crop too when training on the CPU;
bad images are reported and skipped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import Field, PositiveInt
from torch.utils.data import Dataset

from cnnkit.data.augment import imagenet_lighting
from cnnkit.data.base import DataBundle, Preprocess, holdout_split
from cnnkit.data.decode import BadImage, is_image_name, load_box, load_resized
from cnnkit.data.loader import (
    CropJob,
    ImageSetConfig,
    build_augment,
    build_streams,
    new_batch,
)
from cnnkit.errors import ConfigError, DataError
from cnnkit.runtime import torch_threads

IMAGENET_MEAN = (123.675, 116.28, 103.53)  # 0-255 units
IMAGENET_STD = (58.395, 57.12, 57.375)


def read_label_file(path: Path) -> dict[str, str]:
    """File name (or stem) -> class name, from `NAME CLASS` lines or a `NAME,CLASS ...` CSV
    (Kaggle's LOC_val_solution.csv: the first word of the second column is the class)."""
    if not path.is_file():
        raise DataError(f"{path}: label file not found")
    mapping = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        parts = line.split(",", 1) if "," in line else line.split(None, 1)
        if not line.strip() or line.startswith("ImageId,"):
            continue
        if len(parts) != 2 or not parts[1].split():
            raise DataError(f"{path}:{number}: expected 'FILENAME CLASS', got {line.strip()!r}")
        mapping[parts[0].strip()] = parts[1].split()[0]
    return mapping


def _class_folders(src: Path) -> tuple[list[str], list[int], list[str]]:
    classes = sorted(d.name for d in os.scandir(src) if d.is_dir() and not d.name.startswith("."))
    files, labels = [], []
    for k, name in enumerate(classes):
        for dirpath, dirnames, names in sorted(os.walk(src / name, followlinks=True)):
            dirnames.sort()
            rel = Path(dirpath).relative_to(src)
            found = sorted(n for n in names if is_image_name(n))
            files += [str(rel / n) for n in found]
            labels += [k] * len(found)
    return files, labels, classes


def _flat_with_labels(src: Path, labels_file: Path) -> tuple[list[str], list[str]]:
    mapping = read_label_file(labels_file)
    files = sorted(n for n in os.listdir(src) if is_image_name(n))
    missing = [n for n in files if n not in mapping and Path(n).stem not in mapping]
    if missing:
        raise DataError(
            f"{labels_file}: no label for {len(missing)} images in {src} (first: {missing[0]})"
        )
    return files, [mapping.get(n, mapping.get(Path(n).stem)) for n in files]


def scan_folder(src: str | Path, labels_file: str | Path | None = None,
                classes: list[str] | None = None) -> tuple[list[str], list[int], list[str]]:  # fmt: skip
    """(relative files, labels, class names) of an ImageFolder tree or a flat folder + labels.

    With `classes` given (e.g. the training set's), labels index into that list.
    """
    src = Path(src)
    if not src.is_dir():
        raise DataError(f"{src}: not a folder")
    if labels_file is not None:
        files, names = _flat_with_labels(src, Path(labels_file))
        found = sorted(set(names))
    else:
        files, labels, found = _class_folders(src)
        names = [found[k] for k in labels]
        if not files:
            raise DataError(
                f"{src}: no images in class subfolders (a flat folder needs a label file)"
            )
    classes = classes or found
    lookup = {name: k for k, name in enumerate(classes)}
    unknown = sorted(set(names) - set(lookup))
    if unknown:
        raise DataError(f"{src}: class {unknown[0]!r} is not among the training classes")
    return files, [lookup[n] for n in names], classes


class FolderImages(Dataset):
    """Batch dataset over image files: dataset[list of positions] -> (x uint8 resized to size,
    y, bad images); dataset[CropJob] -> (x uint8 cropped, y, bad images, the kept lighting draws).
    """

    crops = True  # takes CropJobs: each image decoded, cropped and resized once
    slots: torch.Tensor | None = None  # (n, B, 3, crop, crop) shared output batches of CropJobs

    def __init__(self, root: Path, files: list[str], labels: list[int], ids: np.ndarray,
                 size: int, mode: str) -> None:  # fmt: skip
        self.root, self.files, self.size, self.mode = root, files, size, mode
        self.labels, self.ids = np.asarray(labels, np.int64), ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, key: list[int] | CropJob) -> tuple:
        with torch_threads(1):  # per-image resizes (already so in a worker process)
            return self._cropped(key) if isinstance(key, CropJob) else self._resized(key)

    def _resized(self, positions: list[int]) -> tuple:
        ids = self.ids[positions]
        x = new_batch(len(ids), self.size)
        kept, bad = [], []
        for i in ids:
            path = self.root / self.files[i]
            try:  # odd images are converted
                x[len(kept)] = load_resized(path, self.size, self.mode, fast=True)[0]
                kept.append(i)
            except BadImage as e:
                bad.append((str(path), str(e)))
        return x[: len(kept)], torch.from_numpy(self.labels[kept]), bad

    def _cropped(self, job: CropJob) -> tuple:
        """(x, y, bad, alpha); x is the slot number when written into `slots[job.slot]`."""
        ids = self.ids[job.positions]
        x = new_batch(len(ids), job.crop) if job.slot is None else self.slots[job.slot]
        out, kept, bad = x.numpy(), [], []
        crops = zip(ids, job.boxes.tolist(), job.flip.tolist(), strict=True)
        for k, (i, box, flip) in enumerate(crops):
            path = self.root / self.files[i]
            try:
                out[len(kept)] = load_box(path, self.size, self.mode, box, job.crop, flip)
                kept.append(k)
            except BadImage as e:
                bad.append((str(path), str(e)))
        y = torch.from_numpy(self.labels[ids[kept]])
        return job.slot if job.slot is not None else x[: len(kept)], y, bad, job.alpha[kept]


class FolderConfig(ImageSetConfig):
    """Train straight from image folders (ImageFolder layout; flat val + label file)."""

    source: Literal["folder"] = "folder"
    path: str = Field(description="training folder: one subfolder per class")
    val_path: str | None = Field(None, description="validation folder (class subfolders or flat)")
    val_labels: str | None = Field(None, description="label file for a flat val_path")
    size: PositiveInt = Field(256, description="images are resized to size x size first")
    resize_mode: Literal["squash", "shorter"] = Field(
        "squash", description="or shorter side + crop"
    )

    def stored_size(self) -> int:
        """Images are resized to `size` before cropping."""
        return self.size

    def build(self, device: torch.device, rank: int = 0, world_size: int = 1,
              seed: int = 0) -> DataBundle:  # fmt: skip
        """Scan the folders and make this rank's streams."""
        if self.normalize == "mean_image":
            raise ConfigError("data.normalize: mean_image needs a packed set (cnnkit pack)")
        if self.crop > self.size:
            raise ConfigError(f"data.crop: {self.crop} is larger than data.size {self.size}")
        root = Path(self.path)
        files, labels, classes = scan_folder(root)
        train_ids, val_ids = holdout_split(labels, 0.0 if self.val_path else self.val_fraction)
        train = FolderImages(root, files, labels, train_ids, self.size, self.resize_mode)
        if self.val_path:
            vfiles, vlabels, _ = scan_folder(self.val_path, self.val_labels, classes)
            val = FolderImages(Path(self.val_path), vfiles, vlabels, np.arange(len(vfiles)),
                               self.size, self.resize_mode)  # fmt: skip
        else:
            val = FolderImages(root, files, labels, val_ids, self.size, self.resize_mode)
        mean, std = self.mean or IMAGENET_MEAN, self.std or IMAGENET_STD
        stats = {"mean": mean, "std": std, "lighting": imagenet_lighting()}
        train_s, val_s = build_streams(self, train, val, build_augment(self, stats), device, rank,
                                       world_size, seed)  # fmt: skip
        pre = Preprocess(3, self.crop, self.size, self.resize_mode, list(mean), list(std))
        labels = torch.from_numpy(train.labels[train.ids])
        return DataBundle(train_s, val_s, classes, (3, self.crop, self.crop), pre, labels)
