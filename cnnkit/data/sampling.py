"""Which images go into which batch: the per-epoch order of one rank (`EpochBatchSampler`) and
the jobs the loader hands its workers (`JobSampler`: positions, a free slot, the random crops).

Every random choice is a function of (seed, epoch, rank, batch position), so a resumed epoch
repeats its batches and augmentations exactly, with workers or without.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from cnnkit.data.augment import CropAugment
from cnnkit.data.batch import BatchJob, Crops
from cnnkit.data.slots import SlotRing
from cnnkit.errors import ConfigError
from cnnkit.runtime import mix_seed, torch_threads


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

    def _slice(self) -> tuple[int, int]:
        """Where this rank's images lie: in the set (validation) or the epoch's permutation."""
        if self.shuffle:
            per = self.n // self.world
            return self.rank * per, (self.rank + 1) * per
        return self.rank * self.n // self.world, (self.rank + 1) * self.n // self.world

    def _mine(self) -> torch.Tensor:
        lo, hi = self._slice()
        if not self.shuffle:
            return torch.arange(lo, hi)
        g = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch))
        return torch.randperm(self.n, generator=g)[lo:hi]

    def batches(self) -> list[list[int]]:
        """All batches of this epoch for this rank (before skipping)."""
        mine = self._mine().tolist()[: self.images()]
        return [mine[i : i + self.batch] for i in range(0, len(mine), self.batch)]

    def _per_rank(self) -> int:
        """This rank's images an epoch (validation's contiguous slice, or training's share)."""
        lo, hi = self._slice()
        return hi - lo

    def images(self) -> int:
        """The images this rank's batches hold an epoch: training's whole batches only, where
        at least one fits; every one of its images otherwise."""
        per = self._per_rank()
        return per - per % self.batch if self.shuffle and per >= self.batch else per

    def largest(self) -> int:
        """The most images one of this rank's batches holds: the batch, or all of this rank's
        images where they are fewer (0 for none)."""
        return min(self.batch, self._per_rank())

    def total(self) -> int:
        """Batches per epoch for this rank."""
        return -(-self.images() // self.batch)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches()[self.skip :])

    def __len__(self) -> int:
        return max(0, self.total() - self.skip)


def batch_generator(sampler: EpochBatchSampler, position: int) -> torch.Generator:
    """The generator of the random augmentation of batch `position` in the sampler's epoch."""
    s = sampler
    return torch.Generator().manual_seed(mix_seed(s.seed, s.epoch, s.rank, position, 1))


class JobSampler(Sampler[BatchJob]):
    """The sampler's batches as BatchJobs for the workers. Each job gets a free slot of the
    loader's `ring` while one is free, and, when the workers crop (`augment` given), the random
    crops drawn exactly as the main process would draw them for that batch."""

    def __init__(self, sampler: EpochBatchSampler, ring: SlotRing | None,
                 augment: CropAugment | None = None, size: int = 0,
                 encoded: bool = False) -> None:  # fmt: skip
        self.sampler, self.ring = sampler, ring
        self.augment, self.size, self.encoded = augment, size, encoded

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[BatchJob]:
        # The body starts at the epoch's first dispatch, after the DataLoader has drained every
        # batch of an earlier (maybe abandoned) epoch: no worker writes a slot any more.
        if self.ring is not None:
            self.ring.reset()
        for position, batch in enumerate(self.sampler, self.sampler.skip):
            crops = None
            if self.augment is not None:
                crops = self._crops(len(batch), position)
            slot = self.ring.take() if self.ring is not None else None
            yield BatchJob(batch, slot, crops, self.encoded)

    def _crops(self, batch: int, position: int) -> Crops:
        """The random crops of the batch at `position`, drawn on one thread: a few kernels on
        B x 22 numbers, which on more threads (the main process's) wait for cores the workers
        hold: 3.4 against 0.36 CPU ms a batch of 128 with both cores busy (Intel Xeon)."""
        with torch_threads(1):
            g = batch_generator(self.sampler, position)
            p = self.augment.sample(batch, self.size, self.size, g)
            return Crops(self.augment.boxes(p), p["flip"], p["alpha"], self.augment.crop,
                         p.get("draws"), self.augment.ratio)  # fmt: skip
