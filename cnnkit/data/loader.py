"""The fast loader shared by the folder and packed sources: worker processes build whole uint8
batches (one dataset call per batch, no per-image collate), pinned and prefetched by torch's
DataLoader; a side CUDA stream copies the next batch and augments it while the model computes.
Training on a CPU device, the workers also crop (CropJobs into shared slots); main normalises.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, NonNegativeInt, PositiveInt, model_validator
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from cnnkit.data.augment import CropAugment
from cnnkit.data.base import DataConfigBase, Preprocess
from cnnkit.errors import ConfigError
from cnnkit.runtime import mix_seed


class ImageSetConfig(DataConfigBase):
    """Fields shared by the image sources (folder, packed): loading and augmentation."""

    crop: PositiveInt = Field(227, description="network input side (227 of 256 like the seeds)")
    train_crop: Literal["random", "resized"] = Field(
        "random", description="random: random crop; resized: random-resized-crop (torchvision's)"
    )
    scale: tuple[float, float] = Field((0.08, 1.0), description="random-resized-crop area range")
    mirror: bool = Field(True, description="random horizontal mirror in training")
    lighting: float = Field(0.0, ge=0, description="PCA lighting std (0.1 in the 2012 paper)")
    normalize: Literal["channel", "mean_image"] = Field(
        "channel", description="channel: (x - mean_c) / std_c; mean_image: x - mean image"
    )
    workers: NonNegativeInt = Field(2, description="loader processes (0: in the main process)")
    prefetch: PositiveInt = Field(2, description="batches prefetched per worker")
    val_fraction: float = Field(0.1, ge=0, lt=1, description="held out when no val_path")
    mean: tuple[float, float, float] | None = Field(
        None, description="per channel, 0-255 (None: ImageNet's for folders, the pack's own)"
    )
    std: tuple[float, float, float] | None = Field(None, description="per channel, 0-255")

    def evaluated_as(self, preprocess: Preprocess) -> ImageSetConfig:
        """Normalised with a trained network's per-channel mean/std (not this data's own)."""
        if self.normalize != "channel" or len(preprocess.mean) != 3:
            return self
        return self.model_copy(update={"mean": tuple(preprocess.mean),
                                       "std": tuple(preprocess.std)})  # fmt: skip

    @model_validator(mode="after")
    def _check_scale(self) -> ImageSetConfig:
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ValueError(f"scale: need 0 < min <= max <= 1, got {self.scale}")
        return self


class EpochBatchSampler(Sampler[list[int]]):
    """This rank's batches of one epoch: seeded shuffle (train) or an exactly-once split (val).

    Training: every rank gets n // world_size images of a per-epoch permutation; full batches
    only when at least one fits. Validation: contiguous slices covering each image once.
    """

    def __init__(self, n: int, batch: int, rank: int, world_size: int, seed: int, shuffle: bool):
        if shuffle and n < world_size:
            raise ConfigError(f"data: {n} training images cannot be split over {world_size} ranks")
        self.n, self.batch, self.rank, self.world = n, batch, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Order of `epoch`; iteration starts after `skip_batches` batches."""
        self.epoch, self.skip = epoch, skip_batches

    def _mine(self) -> torch.Tensor:
        if not self.shuffle:
            lo, hi = self.rank * self.n // self.world, (self.rank + 1) * self.n // self.world
            return torch.arange(lo, hi)
        g = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch))
        per = self.n // self.world
        return torch.randperm(self.n, generator=g)[self.rank * per : (self.rank + 1) * per]

    def batches(self) -> list[list[int]]:
        """All batches of this epoch for this rank (before skipping)."""
        mine = self._mine().tolist()
        cut = (
            len(mine) - len(mine) % self.batch
            if self.shuffle and len(mine) >= self.batch
            else len(mine)
        )
        return [mine[i : i + self.batch] for i in range(0, cut, self.batch)]

    def total(self) -> int:
        """Batches per epoch for this rank."""
        per = self.n // self.world if self.shuffle else len(self._mine())
        if self.shuffle and per >= self.batch:
            return per // self.batch
        return -(-per // self.batch)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches()[self.skip :])

    def __len__(self) -> int:
        return max(0, self.total() - self.skip)


def new_batch(n: int, size: int, channels: int = 3) -> torch.Tensor:
    """An empty uint8 (n, C, size, size) batch. In a loader worker it lives in shared memory
    already, so handing it to the main process sends a file descriptor and copies nothing."""
    shape = (n, channels, size, size)
    return torch.empty(shape, dtype=torch.uint8) if get_worker_info() is None else shared(shape)


def shared(shape: tuple[int, ...]) -> torch.Tensor:
    """An empty uint8 tensor in shared memory (other processes map it; nothing is copied)."""
    storage = torch.UntypedStorage._new_shared(math.prod(shape))
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)


class BufferPool:
    """Float output buffers on the CPU, reused once nothing else references them: a fresh
    100+ MB tensor costs more in page faults than the whole augmentation. A buffer the caller
    still holds (a variable, a view, autograd) is never reused; a new one is made instead."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._buffers: list[torch.Tensor] = []
        self._idle: list[tuple[int, int]] = []  # reference counts of each buffer when unused

    def _refs(self, i: int) -> tuple[int, int]:
        buf = self._buffers[i]
        users = torch._C._storage_Use_Count(buf.untyped_storage()._cdata)
        return sys.getrefcount(buf) + 100 * buf._use_count(), users

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A float32 buffer of `shape` that nobody else uses."""
        for i in range(len(self._buffers)):  # indices, not items: no loop variable holds one
            if self._buffers[i].shape == shape and self._refs(i) == self._idle[i]:
                return self._buffers[i]
        self._buffers, self._idle = (
            self._buffers[-(self.keep - 1) :],
            self._idle[-(self.keep - 1) :],
        )
        self._buffers.append(torch.empty(shape))
        self._idle.append(self._refs(len(self._buffers) - 1))
        return self._buffers[-1]


@dataclass
class CropJob:
    """A training batch for a dataset that also crops (`crops`): positions, the random crops as
    boxes of the size x size image, mirrors, and the lighting draws handed back with the batch."""

    positions: list[int]
    boxes: torch.Tensor  # (B, 4) int64 top, left, height, width
    flip: torch.Tensor  # (B,) bool
    alpha: torch.Tensor  # (B, 3) lighting draws
    crop: int
    slot: int | None = None  # where to write the batch in the dataset's `slots`; None: anew


def batch_generator(sampler: EpochBatchSampler, position: int) -> torch.Generator:
    """The generator of the random augmentation of batch `position` in the sampler's epoch."""
    s = sampler
    return torch.Generator().manual_seed(mix_seed(s.seed, s.epoch, s.rank, position, 1))


class CropJobs(Sampler[CropJob]):
    """A sampler's batches as CropJobs: the random crops of images resized to size x size drawn
    as the main process would draw them (the same generator per batch), each given a free slot
    of `slots` output batches (shared memory made once: no page faults per batch) while any is
    free. The caller releases a slot once it has read the batch."""

    def __init__(
        self, sampler: EpochBatchSampler, augment: CropAugment, size: int, slots: int
    ) -> None:
        self.sampler, self.augment, self.size, self.slots = sampler, augment, size, slots
        self.free: list[int] = []

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[CropJob]:
        # runs at the epoch's first dispatch: the DataLoader has drained every earlier batch
        self.free = list(range(self.slots))
        for position, batch in enumerate(self.sampler, self.sampler.skip):
            g = batch_generator(self.sampler, position)
            p = self.augment.sample(len(batch), self.size, self.size, g)
            slot = self.free.pop() if self.free else None
            yield CropJob(batch, self.augment.boxes(p), p["flip"], p["alpha"], self.augment.crop,
                          slot)  # fmt: skip

    def release(self, slot: int) -> None:
        """The batch in `slot` has been read: the slot may take another."""
        self.free.append(slot)


def _load_batch_in_worker(worker_id: int) -> None:
    torch.set_num_threads(1)  # each worker is one core's worth of decoding


class ImageBatches:
    """A `Batches` stream: uint8 batches from worker processes, augmented on the device."""

    def __init__(self, dataset: Dataset, sampler: EpochBatchSampler, augment: CropAugment,
                 device: torch.device, train: bool, workers: int, prefetch: int,
                 num_samples: int) -> None:  # fmt: skip
        self.dataset, self.sampler, self.train = dataset, sampler, train
        self.device = torch.device(device)
        self.augment = augment.to(self.device)
        self.workers, self.prefetch = workers, prefetch
        self.num_samples = num_samples
        self._loader: DataLoader | None = None
        self._reported: set[str] = set()
        # a CPU device reads raw shards in-process, cropping straight from the page cache: any
        # worker would add a copy into shared memory and page faults on both sides (2x slower)
        self._direct = self.device.type == "cpu" and getattr(dataset, "direct", False)
        # on a CPU device workers crop too (from files: one resize per image), main normalises
        self._crops = self._worker_crops(train)
        self._direct = self._direct and not self._crops
        self._jobs: CropJobs | None = None
        reuse = self.device.type == "cpu" and hasattr(torch._C, "_storage_Use_Count")
        self._pool = BufferPool() if reuse else None

    def _worker_crops(self, train: bool) -> bool:
        """Whether workers crop (CPU training, per-channel mean): always for decoded images, for
        raw shards only resized crops with workers (a plain crop is cheaper in-process)."""
        cpu, crops = self.device.type == "cpu", getattr(self.dataset, "crops", False)
        if not (cpu and train and crops) or self.augment.mean.shape[-1] > 1:
            return False
        return not self._direct or (self.augment.train_crop == "resized" and self.workers > 0)

    def _crop_jobs(self) -> CropJobs:
        """CropJobs with slots enough for every batch in flight (set on the dataset before the
        workers start; those ahead of the slots, e.g. after a slow batch, get fresh memory)."""
        slots = self.workers * self.prefetch + 2
        self.dataset.slots = shared((slots, self.sampler.batch, 3, self.augment.crop,
                                     self.augment.crop))  # fmt: skip
        return CropJobs(self.sampler, self.augment, self.dataset.size, slots)

    def __len__(self) -> int:
        return self.sampler.total()

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Seeded order of `epoch`, starting after `skip_batches` (mid-epoch resume)."""
        self.sampler.set_epoch(epoch, skip_batches)

    def loader(self) -> DataLoader:
        """The torch DataLoader (persistent workers, pinned memory when the device is CUDA)."""
        if self._loader is None:
            extra = (
                {"prefetch_factor": self.prefetch, "persistent_workers": True}
                if self.workers
                else {}
            )
            self._jobs = self._crop_jobs() if self._crops else None
            self._loader = DataLoader(
                self.dataset, batch_size=None, sampler=self._jobs if self._crops else self.sampler,
                num_workers=self.workers,
                pin_memory=self.device.type == "cuda", worker_init_fn=_load_batch_in_worker,
                **extra,
            )  # fmt: skip
        return self._loader

    def uint8_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """The raw (x uint8, y int64, lighting draws if x is cropped already) CPU batches of this
        epoch, bad images reported and dropped. A cropped x is valid until the next is drawn."""
        if self._direct:
            for batch in self.sampler:
                yield *self.dataset.views(batch), None
            return
        for x, y, bad, *alpha in self.loader():
            self._report(bad)
            slot = x if isinstance(x, int) else None  # written into a shared slot
            if slot is not None:
                x = self.dataset.slots[slot][: len(y)]
            if len(y):
                yield x, y, alpha[0] if alpha else None
            if slot is not None:  # the caller has normalised it: free
                self._jobs.release(slot)

    def _report(self, bad: list[tuple[str, str]]) -> None:
        for path, reason in bad:
            if path not in self._reported:
                self._reported.add(path)
                print(f"cnnkit: skipped {path}: {reason}", file=sys.stderr)

    def _prepare(self, x: torch.Tensor, y: torch.Tensor, position: int,
                 alpha: torch.Tensor | None) -> tuple:  # fmt: skip
        if isinstance(x, torch.Tensor):  # else an ImageList of mapped views (CPU device)
            x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        crop = self.augment.crop
        out = self._pool.take((*x.shape[:2], crop, crop)) if self._pool is not None else None
        if not self.train:
            return self.augment.eval(x, out), y
        if alpha is not None:  # cropped by the workers: normalise only
            return self.augment.finish(x, alpha, out), y
        g = batch_generator(self.sampler, position)
        params = self.augment.sample(x.shape[0], x.shape[2], x.shape[3], g)
        return self.augment.train(x, params, out), y

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start = self.sampler.skip
        batches = enumerate(self.uint8_batches(), start)
        if self.device.type != "cuda":
            for position, (x, y, alpha) in batches:
                yield self._prepare(x, y, position, alpha)
            return
        yield from self._overlapped(batches)

    def _overlapped(self, batches: Iterator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Copy + augment batch i+1 on a side stream while the caller computes on batch i."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # mean/std made on the main one
        pending = None
        for position, (x, y, alpha) in batches:
            with torch.cuda.stream(stream):
                staged = self._prepare(x, y, position, alpha), stream.record_event()
            if pending is not None:
                yield self._handover(*pending)
            pending = staged
        if pending is not None:
            yield self._handover(*pending)

    def _handover(self, batch: tuple, ready: torch.cuda.Event) -> tuple:
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready)
        for t in batch:
            t.record_stream(current)  # memory from the side stream is now used on this one
        return batch


def build_augment(cfg: ImageSetConfig, stats: dict) -> CropAugment:
    """The CropAugment of a config, given the data's stats: mean (C,) or mean image, std, lighting."""
    image_mean = cfg.normalize == "mean_image"
    mean = torch.as_tensor(
        stats["mean_image"] if image_mean else stats["mean"], dtype=torch.float32
    )
    std = torch.ones(3) if image_mean else torch.as_tensor(stats["std"], dtype=torch.float32)
    eigval, eigvec = stats["lighting"]
    return CropAugment(cfg.crop, cfg.train_crop, cfg.mirror, cfg.lighting, mean, std, eigval, eigvec,
                   scale=cfg.scale)  # fmt: skip


def build_streams(cfg: ImageSetConfig, train: Dataset, val: Dataset, augment: CropAugment,
                  device: torch.device, rank: int, world_size: int,
                  seed: int) -> tuple[ImageBatches, ImageBatches]:  # fmt: skip
    """Train and validation streams for this rank over two batch datasets."""
    local = max(1, cfg.batch_size // world_size)
    local_eval = max(1, (cfg.eval_batch_size or cfg.batch_size) // world_size)
    n_train, n_val = len(train), len(val)
    train_sampler = EpochBatchSampler(n_train, local, rank, world_size, seed, shuffle=True)
    val_sampler = EpochBatchSampler(n_val, local_eval, rank, world_size, seed, shuffle=False)
    per_rank = n_train // world_size
    seen = per_rank - per_rank % local if per_rank >= local else per_rank
    streams = (
        ImageBatches(train, train_sampler, augment, device, True, cfg.workers, cfg.prefetch,
                     seen * world_size),
        ImageBatches(val, val_sampler, augment, device, False, cfg.workers, cfg.prefetch, n_val),
    )  # fmt: skip
    return streams
