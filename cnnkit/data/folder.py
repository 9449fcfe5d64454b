"""The `folder` source: train straight from image files, in torchvision's ImageFolder layout (one
folder per class, like ImageNet's train/) or a flat folder plus a label file (ImageNet's val/).
Workers decode (DCT-scaled JPEG) and resize in uint8, and crop too when training on the CPU;
bad images are reported and skipped.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, PositiveInt, PrivateAttr, model_validator
from torch.utils.data import Dataset

from cnnkit.data.augment import imagenet_lighting
from cnnkit.data.base import MAX_SIDE, DataBundle, Preprocess, resized_side
from cnnkit.data.batch import BatchJob, Crops, Encoded, ImageList, WorkerBatch
from cnnkit.data.boxes import rrc_boxes
from cnnkit.data.decode import BadImage, Resized, device_jpeg, image_shape, load_resized
from cnnkit.data.holdout import OWN_VAL_SET, holdout_id, holdout_split
from cnnkit.data.imageset import ImageSetConfig, build_augment
from cnnkit.data.loader import build_streams
from cnnkit.data.packfiles import is_pack
from cnnkit.data.regions import (
    file_shape,
    load_region,
    load_square_box,
    open_image,
    smaller_than,
)
from cnnkit.data.resize import Interpolation, ResizeSetting, box_region
from cnnkit.data.scan import Scan, printable, scan_folder, shared_files
from cnnkit.data.slots import new_batch
from cnnkit.errors import ConfigError, DataError
from cnnkit.runtime import torch_threads

IMAGENET_MEAN = (123.675, 116.28, 103.53)  # 0-255 units
IMAGENET_STD = (58.395, 57.12, 57.375)


class FolderImages(Dataset):
    """An ImageFolder tree as a BatchDataset (data/batch.py): one call decodes a whole batch,
    resized to size x size, cut into its crops, or read as JPEG bytes for the device."""

    crops, direct, jpeg = True, False, True
    slots: torch.Tensor | None = None  # the loader's shared ring (set before workers start)

    def __init__(self, root: Path, files: list[str], labels: list[int], ids: np.ndarray,
                 size: int, mode: str, interpolation: str = "bilinear") -> None:  # fmt: skip
        self.root, self.files, self.size, self.resize_mode = root, files, size, mode
        self.interpolation = interpolation  # every resize's filter, a random crop's too
        self.labels, self.ids = np.asarray(labels, np.int64), ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, job: BatchJob) -> WorkerBatch:
        with torch_threads(1):  # per-image resizes (already so in a worker process)
            if job.encoded:
                return self._encoded(job)
            return self._decoded(job)

    def _decoded(self, job: BatchJob) -> WorkerBatch:
        """Decode each image into the batch: whole (resized) or its crop."""
        ids = self.ids[job.positions]
        paths = [self.root / self.files[i] for i in ids]
        side = job.crops.side if job.crops else self.size
        x = new_batch(len(ids), side) if job.slot is None else self.slots[job.slot]
        cut = self._crops(paths, job.crops) if job.crops else None
        kept, bad, sources = [], [], []
        for k, path in enumerate(paths):
            try:  # odd images are converted
                if cut is None:
                    image, _, source = self._resized(path)
                    x[len(kept)].copy_(image)
                else:
                    source = cut(k, x[len(kept)])
            except BadImage as e:
                bad.append((str(path), str(e)))
                continue
            kept.append(k)
            sources.append(source)
        labels = torch.from_numpy(self.labels[ids[kept]])
        alpha = job.crops.alpha[kept] if job.crops else None
        pixels = x[: len(kept)] if job.slot is None else None
        return WorkerBatch(labels, pixels, job.slot, alpha=alpha, bad=bad,
                           sources=self._sources(sources))  # fmt: skip

    def _resized(self, path: Path) -> Resized:
        return load_resized(path, self.size, self.resize_mode, interpolation=self.interpolation)

    def _crops(self, paths: list[Path], c: Crops) -> Callable[[int, torch.Tensor], tuple]:
        """A function that writes image k's crop into `out` and returns the image's size, for k
        in the batch. The boxes of photos squashed whole are
        drawn on the photos, all at once as the main process draws them: every file's size is
        read from its header first (one file's bytes in memory at a time)."""
        sizes: list[tuple[int, int] | None] = [None] * len(paths)
        on_photos = None
        if self.resize_mode == "squash" and c.draws is not None:
            for k, path in enumerate(paths):
                try:
                    sizes[k] = file_shape(path)
                except BadImage:
                    pass  # said when its crop is cut
            shapes = torch.tensor([s or (1, 1) for s in sizes])
            on_photos = c.on_sources(shapes)

        def cut(k: int, out: torch.Tensor) -> tuple[int, int]:
            image = open_image(paths[k])
            if on_photos is None:
                box = c.boxes[k].tolist()
                # resized whole first where the region would not do as well: an image smaller
                # than the square, or bicubic (see load_square_box)
                if self.interpolation != "bilinear" or smaller_than(
                    image.shape, self.size, self.resize_mode
                ):
                    load_square_box(image, box, self.size, self.resize_mode, c.side,
                                    bool(c.flip[k]), out, self.interpolation)  # fmt: skip
                    return image.shape
                region = box_region(image.shape, box, self.size, self.resize_mode)
            else:
                box = on_photos[k]
                if image.shape != sizes[k]:  # the file changed since its size was read
                    box = rrc_boxes(c.draws[k : k + 1], *image.shape, c.ratio)[0]
                top, left, h, w = box.tolist()
                region = (top, left, top + h, left + w)
            load_region(image, region, c.side, bool(c.flip[k]), out, self.interpolation)
            return image.shape

        return cut

    def _sources(self, shapes: list[tuple[int, int]]) -> torch.Tensor | None:
        """The batch's photo sizes where each was squashed whole (see WorkerBatch.sources)."""
        if self.resize_mode != "squash":
            return None
        return torch.tensor(shapes, dtype=torch.int64).reshape(-1, 2)

    def _encoded(self, job: BatchJob) -> WorkerBatch:
        """JPEG bytes for the device; other images decoded here; broken ones reported."""
        ids = self.ids[job.positions]
        coded, decoded, kept_ids, names, bad, sources = [], {}, [], [], [], []
        for i in ids:
            path = self.root / self.files[i]
            try:
                data = device_jpeg(path)
                if data is None:  # not a JPEG the device decoders take: decode it here
                    image, _, source = self._resized(path)
                    decoded[len(kept_ids)] = image
                else:
                    coded.append(data)
                    source = image_shape(data)
            except BadImage as e:
                bad.append((str(path), str(e)))
                continue
            kept_ids.append(i)
            names.append(str(path))
            sources.append(source)
        labels = torch.from_numpy(self.labels[np.asarray(kept_ids, np.int64)])
        return WorkerBatch(labels, encoded=Encoded.join(coded), decoded=decoded, names=names,
                           bad=bad, sources=self._sources(sources))  # fmt: skip

    def views(self, positions: list[int]) -> tuple[ImageList, torch.Tensor, None]:
        raise TypeError("folder images are decoded, never viewed in place (direct is False)")


class FolderConfig(ImageSetConfig):
    """Train straight from image folders (ImageFolder layout; flat val + label file)."""

    source: Literal["folder"] = "folder"
    path: str = Field(description="training folder: one subfolder per class")
    val_path: str | None = Field(None, description="validation folder (class subfolders or flat)")
    val_labels: str | None = Field(None, description="label file for a flat val_path")
    size: PositiveInt = Field(
        256,
        le=MAX_SIDE,
        description="images are resized to size x size first (at most "
        f"{MAX_SIDE}: what a trained network may read; left out with crop: 8/7 of the "
        "network's side, 256 from 224 to 256; left out with a data.crop over 256: its 8/7)",
    )
    resize_mode: ResizeSetting = Field("squash", description="or shorter side + crop")
    interpolation: Interpolation = Field(
        "bilinear",
        description="the filter resizing a whole image to size: bilinear, or bicubic (timm's "
        "and torchvision's EfficientNet weights'; left out in a run from weights: their "
        "network's preprocess: filter); random-resized crops are resized with it too, as "
        "torchvision's reference scripts' --interpolation does",
    )

    default_stats = (IMAGENET_MEAN, IMAGENET_STD)  # (ClassVar)

    @model_validator(mode="before")
    @classmethod
    def _size_follows_a_large_crop(cls, data: Any) -> Any:
        """A crop over the default size with data.size left out (data.crop=299, bench loader
        --crop 299): images are resized to the crop's 8/7 first, torchvision's 224 of 256,
        as a network's own input side sets it, where the default could only be refused."""
        if not isinstance(data, dict) or "size" in data:
            return data
        crop, default = data.get("crop"), cls.model_fields["size"].default
        if isinstance(crop, int) and not isinstance(crop, bool) and default < crop <= MAX_SIDE:
            data = {**data, "size": resized_side(crop)}
        return data

    _evaluating: bool = PrivateAttr(False)  # evaluated_as: an empty class folder is skipped
    _labels_option: str = PrivateAttr("data.val_labels")  # eval --data DIR: its --labels

    def training_notes(self) -> list[str]:
        """ImageSetConfig's, and: a label file without the flat folder it labels; a crop that
        sees little of the resized image (data.size is AlexNet's 256 unless set)."""
        notes = super().training_notes()
        if self.val_labels and not self.val_path:
            notes.append("data.val_labels is not used: it labels a flat data.val_path, and "
                         "none is given")  # fmt: skip
        if self.crop < 0.75 * self.size:
            fit = resized_side(self.crop)
            notes.append(f"data.crop {self.crop} of data.size {self.size}: images are resized to "
                         f"{self.size} x {self.size} first, so a crop sees "
                         f"{self.crop / self.size:.0%} of their side (torchvision's 224 of 256: "
                         f"88%); data.size={fit} would be that")  # fmt: skip
        return notes

    def stored_size(self) -> int:
        """Images are resized to `size` before cropping."""
        return self.size

    def evaluated_as(self, preprocess: Preprocess,
                     mean_image: torch.Tensor | None = None) -> FolderConfig:  # fmt: skip
        """As ImageSetConfig's, and a class folder without images is skipped (named on
        stderr), not refused: evaluation matches classes to the network's by name."""
        out = super().evaluated_as(preprocess, mean_image).model_copy()
        out._evaluating = True
        return out

    def class_names(self) -> list[str]:
        """The class folders of data.path: its subfolders, hidden ones aside, as a scan takes
        them (which refuses one without images)."""
        try:
            with os.scandir(self.path) as entries:
                names = [e.name for e in entries if not e.name.startswith(".") and e.is_dir()]
        except OSError as e:
            raise DataError(f"data.path {printable(self.path)}: {e.strerror}") from None
        return sorted(names)

    def build(self, device: torch.device, rank: int = 0, world_size: int = 1,
              seed: int = 0, local_ranks: int = 1) -> DataBundle:  # fmt: skip
        """Scan the folders and make this rank's streams."""
        if self.normalize == "mean_image" and self._mean_image is None:  # see evaluated_as
            raise ConfigError("data.normalize: mean_image needs a packed set (cnnkit pack)")
        if self.crop > MAX_SIDE:  # (no data.size could hold it: not one to suggest)
            raise ConfigError(f"data.crop: {self.crop} is over the largest side a network may "
                              f"read ({MAX_SIDE})")  # fmt: skip
        if self.crop > self.size:
            raise ConfigError(f"data.crop: {self.crop} is larger than data.size {self.size}")
        root = Path(self.path)
        for field, folder in (("data.path", root), ("data.val_path", self.val_path)):
            if folder is not None and not Path(folder).is_dir():
                what = "not a folder" if Path(folder).exists() else "no such folder"
                unset = (", or data.val_path=null to hold out data.val_fraction of data.path"
                         if field == "data.val_path" else "")  # fmt: skip
                raise DataError(f"{field} {printable(str(folder))}: {what} (set {field}{unset})")
        if self.val_path and is_pack(self.val_path):  # (its shards are no class subfolders)
            raise DataError(f"data.val_path {printable(str(self.val_path))}: a packed data set, "
                            "and data.path a folder: give the held-out images as a folder too, "
                            "or train on a pack of data.path (cnnkit pack)")  # fmt: skip
        same = self.val_path and Path(self.val_path).resolve() == root.resolve()
        # one folder evaluated whole (eval --data DIR [--labels FILE]): scanned once
        option = self._labels_option if same else None  # data.path itself takes none
        scan = scan_folder(root, self.val_labels if same else None,
                           skip_empty=self._evaluating, labels_option=option)  # fmt: skip
        files, labels, classes = scan.files, scan.labels, scan.classes
        fraction = 0.0 if self.val_path else self.val_fraction
        train_ids, val_ids = holdout_split(labels, fraction, keys=files)
        drawn = holdout_id(files, val_ids, len(files)) if fraction else None
        drawn = OWN_VAL_SET if self.val_path else drawn
        resizing = (self.size, self.resize_mode, self.interpolation)
        train = FolderImages(root, files, labels, train_ids, *resizing)
        if same:
            val = FolderImages(root, files, labels, np.arange(len(files)), *resizing)
        elif self.val_path:
            held_out = scan_folder(self.val_path, self.val_labels, classes,
                                   labels_option=self._labels_option)  # fmt: skip
            if not (self._evaluating or self._drawn):  # a new run's: eval --data, a resumed
                _check_disjoint(held_out, scan, Path(self.val_path), root)  # run's, as they were
            val = FolderImages(Path(self.val_path), held_out.files, held_out.labels,
                               np.arange(len(held_out.files)), *resizing)  # fmt: skip
        else:
            val = FolderImages(root, files, labels, val_ids, *resizing)
        mean, std = self.mean or IMAGENET_MEAN, self.std or IMAGENET_STD
        image = self._mean_image
        if image is not None:  # a trained run's (evaluated_as): its channel averages to classify
            mean, std = image.mean(dim=(1, 2)).tolist(), [1.0, 1.0, 1.0]
        stats = {"mean": mean, "std": std, "lighting": imagenet_lighting(), "mean_image": image}
        augment = build_augment(self, stats, self.interpolation)
        train_s, val_s = build_streams(self, train, val, augment, device, rank, world_size, seed,
                                       local_ranks)  # fmt: skip
        pre = Preprocess.of_data(3, self.crop, self.size, self.resize_mode, list(mean), list(std),
                                 interpolation=self.interpolation)  # fmt: skip
        labels = torch.from_numpy(train.labels[train.ids])
        return self.finish(
            DataBundle(
                train_s, val_s, classes, (3, self.crop, self.crop), pre, labels, image, drawn
            )  # fmt: skip
        )


def _check_disjoint(held_out: Scan, training: Scan, val_root: Path, root: Path) -> None:
    """DataError where data.val_path takes files of data.path itself (links, hard links): its
    held-out figures would count images the run trains on."""
    shared = shared_files(held_out, training)
    if shared:
        val, train = shared[0]
        raise DataError(f"data.val_path {printable(str(val_root))}: {len(shared)} of its "
                        f"{len(held_out.files)} images are data.path's own files (links or hard "
                        f"links: {printable(str(val_root / val))} is "
                        f"{printable(str(root / train))}); held-out images must not be trained "
                        "on: give a folder of other images, or data.val_path=null to hold out "
                        "data.val_fraction of data.path")  # fmt: skip
