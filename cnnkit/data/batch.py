"""The loader's contract with the image sets it reads (folder, packed): the job a worker gets
for one batch, the record it hands back, and the `BatchDataset` protocol both sets implement.

One dataset call makes one whole batch (no per-image collate). Where the pixels go depends on
the job: into a slot of the loader's shared ring (made once), into fresh shared memory when
every slot is in flight, or nowhere: JPEG bytes handed back undecoded, for the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from cnnkit.data.boxes import rrc_boxes


@dataclass
class Crops:
    """The random crops a worker cuts (CPU training): boxes of the size x size image, mirrors,
    and the lighting draws handed back with the batch (the main process adds the lighting).

    Random-resized crops also carry their draws: a worker that knows each image's own size
    (a photo squashed into the square) draws the boxes on the photos instead (`on_sources`).
    """

    boxes: torch.Tensor  # (B, 4) int64: top, left, height, width
    flip: torch.Tensor  # (B,) bool
    alpha: torch.Tensor  # (B, 3) lighting draws
    side: int  # output side (the network's input)
    draws: torch.Tensor | None = None  # (B, DRAWS) random-resized-crop draws (boxes.py)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)  # their aspect range

    def on_sources(self, sources: torch.Tensor) -> torch.Tensor | None:
        """The boxes drawn on images of these (B, 2) sizes (H, W), in their pixels: None for
        crops that keep their boxes (random crops)."""
        if self.draws is None:
            return None
        return rrc_boxes(self.draws, sources[:, 0], sources[:, 1], self.ratio)


@dataclass
class BatchJob:
    """One batch for a worker: which images, and how to hand them back."""

    positions: list[int]  # indices into the dataset
    slot: int | None = None  # write the pixels into this slot of `dataset.slots`; None: anew
    crops: Crops | None = None  # cut these crops (else: whole size x size images)
    encoded: bool = False  # hand back JPEG bytes undecoded (decoded on the device)


@dataclass
class Encoded:
    """A batch's JPEG files as one byte buffer: image i is data[offsets[i]:offsets[i + 1]]."""

    data: torch.Tensor  # (total,) uint8
    offsets: torch.Tensor  # (B + 1,) int64

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def items(self) -> list[torch.Tensor]:
        """Per-image byte tensors (views, nothing copied)."""
        o = self.offsets.tolist()
        return [self.data[o[i] : o[i + 1]] for i in range(len(self))]

    @classmethod
    def join(cls, items: list[bytes | np.ndarray]) -> Encoded:
        """One buffer from per-image bytes."""
        sizes = [len(b) for b in items]
        offsets = np.zeros(len(items) + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        data = np.empty(int(offsets[-1]), np.uint8)
        for i, b in enumerate(items):
            data[offsets[i] : offsets[i + 1]] = np.frombuffer(b, np.uint8)
        return cls(torch.from_numpy(data), torch.from_numpy(offsets))


@dataclass
class WorkerBatch:
    """What a dataset call returns for one BatchJob. Kept images come in job order; the labels,
    lighting draws and pixels (or bytes) are those of the kept images only."""

    labels: torch.Tensor  # (B,) int64
    pixels: torch.Tensor | None = None  # uint8 (B, C, H, W) in fresh memory (job.slot is None)
    slot: int | None = None  # the pixels are in this slot of the dataset's ring
    encoded: Encoded | None = None  # JPEG bytes of the images the device decodes, in order
    decoded: dict[int, torch.Tensor] = field(default_factory=dict)  # others, decoded here
    names: list[str] = field(default_factory=list)  # each kept image's file (encoded jobs)
    alpha: torch.Tensor | None = None  # (B, 3) lighting draws when the worker cropped
    sources: torch.Tensor | None = None  # (B, 2) int64 each photo's own (H, W) where it was
    # squashed into the stored square (random-resized crops are drawn on it); None: unknown
    bad: list[tuple[str, str]] = field(default_factory=list)  # (path, reason) skipped

    def __len__(self) -> int:
        return len(self.labels)


class ImageList:
    """A batch as per-image uint8 (C, H, W) views into memory-mapped shards: indexable like a
    batch tensor (x[i], x.shape, len(x)), nothing copied."""

    def __init__(self, views: list[np.ndarray]) -> None:
        self.views = views
        self.shape = (len(views), *views[0].shape)

    def __len__(self) -> int:
        return len(self.views)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.views[i])


@runtime_checkable
class BatchDataset(Protocol):
    """An image set the loader reads: FolderImages and PackedImages implement it."""

    size: int  # side of the stored (packed) or resized (folder) images
    resize_mode: str  # squash | shorter: how images of another size become size x size
    interpolation: str  # bilinear | bicubic: the filter of that resize
    crops: bool  # can cut Crops itself (decoding once into the crop, CPU training)
    direct: bool  # a CPU device may read `views` in the main process (raw shards)
    jpeg: bool  # can hand back JPEG bytes for decoding on the device (BatchJob.encoded)
    slots: torch.Tensor | None  # (n, B, C, H, W) shared ring the loader sets before workers start

    def __len__(self) -> int: ...

    def __getitem__(self, job: BatchJob) -> WorkerBatch: ...

    def views(
        self, positions: list[int]
    ) -> tuple[ImageList, torch.Tensor, torch.Tensor | None]: ...  # + WorkerBatch.sources
