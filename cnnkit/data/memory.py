"""In-memory batch streams: a whole uint8 image tensor on the device, sharded by rank.

Shared by the bundled and synthetic sources. Every random choice (order, augmentation) is a
function of (seed, epoch, batch), so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cnnkit.data.base import Preprocess
from cnnkit.errors import ConfigError
from cnnkit.runtime import mix_seed


@dataclass(frozen=True)
class Jitter:
    """Batched random affine jitter + mirror of small in-memory images, done as two tensor ops
    on the device (shift, rotation, zoom, mirror, contrast, brightness)."""

    shift: float = 0.0  # max translation, fraction of the image side
    rotate: float = 0.0  # max rotation, degrees
    scale: float = 0.0  # max relative zoom (0.1: 0.9x-1.1x)
    mirror: bool = False  # random horizontal flip
    padding: str = "zeros"  # what enters from outside: zeros | border
    contrast: float = 0.0  # max relative contrast change (0.3: 0.7x-1.3x about the image mean)
    brightness: float = 0.0  # max brightness shift, in units of the data set's std

    @property
    def active(self) -> bool:
        geometric = self.shift or self.rotate or self.scale or self.mirror
        return bool(geometric or self.contrast or self.brightness)

    def __call__(self, x: torch.Tensor, gen: torch.Generator,
                 fill: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """x float (B, C, H, W) -> the same shape, each image jittered differently; with
        padding "zeros", what enters from outside is `fill` (per channel, in x's units: black
        of normalised images is -mean / std), else 0."""
        b = x.shape[0]
        r = torch.rand(b, 5, generator=gen, device=gen.device).to(x.device) * 2 - 1  # (B, 5)
        angle = r[:, 0] * math.radians(self.rotate)
        zoom = 1.0 + r[:, 1] * self.scale
        cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
        flip = torch.ones_like(cos)
        if self.mirror:
            flip = torch.where(r[:, 4] < 0, -1.0, 1.0)
        theta = torch.stack(
            [
                torch.stack([cos * flip, -sin, r[:, 2] * self.shift * 2], 1),
                torch.stack([sin * flip, cos, r[:, 3] * self.shift * 2], 1),
            ],
            1,
        )  # (B, 2, 3): affine_grid works in [-1, 1] units, so a full side is 2
        grid = F.affine_grid(theta.to(x.dtype), list(x.shape), align_corners=False)
        if fill is not None and self.padding == "zeros":  # grid_sample fills 0: shift it
            x = F.grid_sample(x - fill, grid, align_corners=False).add_(fill)
        else:
            x = F.grid_sample(x, grid, padding_mode=self.padding, align_corners=False)
        return self._photometric(x, gen) if self.contrast or self.brightness else x

    def _photometric(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Per image: contrast about its own mean, then a brightness shift (drawn after the
        geometric ones, so runs without it keep their random streams)."""
        r = torch.rand(x.shape[0], 2, generator=gen, device=gen.device).to(x.device) * 2 - 1
        gain = (1.0 + r[:, 0] * self.contrast).view(-1, 1, 1, 1)
        mean = x.mean((1, 2, 3), keepdim=True)
        return (x - mean) * gain + mean + (r[:, 1] * self.brightness).view(-1, 1, 1, 1)


class TensorBatches:
    """One rank's batches of a labelled uint8 tensor held on the device (Batches protocol)."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        preprocess: Preprocess,
        *,
        train: bool,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        augment: Jitter | None = None,
    ):
        if train and batch_size % world_size:
            raise ConfigError(
                f"data.batch_size: {batch_size} does not divide into {world_size} processes"
            )
        if train and batch_size > len(images):
            raise ConfigError(
                f"data.batch_size: {batch_size} is larger than the training set ({len(images)})"
            )
        self.images, self.labels = images, labels  # (N, C, H, W) uint8, (N,) int64
        self.batch_size, self.train = batch_size, train
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.preprocess, self.augment = preprocess, augment
        self.epoch, self.skip = 0, 0
        self.mean = torch.tensor(preprocess.mean, device=images.device).view(1, -1, 1, 1)
        self.std = torch.tensor(preprocess.std, device=images.device).view(1, -1, 1, 1)
        self.num_samples = len(self) * batch_size if train else len(images)
        self.num_images = len(images)

    def __len__(self) -> int:
        if self.train:  # whole global batches only: every step sees the same batch size
            return len(self.images) // self.batch_size
        return math.ceil(len(self._val_indices()) / self.batch_size)

    def check_room(self) -> None:
        """Nothing to check: the images are in memory already, and no worker starts."""

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Choose this epoch's seeded order; skip the first batches (mid-epoch resume)."""
        self.epoch, self.skip = epoch, skip_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if not self.train:
            idx = self._val_indices()
            for start in range(0, len(idx), self.batch_size):
                yield self._batch(idx[start : start + self.batch_size], None)
            return
        # drawn on the host (the same order on every device), moved once: a copy per batch
        # would wait for the device each step
        order = torch.randperm(len(self.images), generator=self._gen(0, "cpu"))
        order = order.to(self.images.device)
        per_rank = self.batch_size // self.world_size
        for i in range(self.skip, len(self)):
            start = i * self.batch_size + self.rank * per_rank  # rank's slice of global batch i
            idx = order[start : start + per_rank]
            yield self._batch(idx, self._gen(i + 1, self.images.device))

    def _batch(self, idx: torch.Tensor, gen: torch.Generator | None):
        x = (self.images[idx].float() - self.mean) / self.std  # (B, C, H, W) normalised
        if gen is not None and self.augment is not None and self.augment.active:
            x = self.augment(x, gen, fill=-self.mean / self.std)  # black, as torchvision fills
        return x, self.labels[idx]

    def _val_indices(self) -> torch.Tensor:
        """A contiguous, disjoint share per rank: every image counted exactly once overall."""
        n = len(self.images)
        lo, hi = n * self.rank // self.world_size, n * (self.rank + 1) // self.world_size
        return torch.arange(lo, hi, device=self.images.device)

    def _gen(self, batch: int, device) -> torch.Generator:
        gen = torch.Generator(device=device)
        gen.manual_seed(mix_seed(self.seed, self.epoch, batch, self.rank if batch else 0))
        return gen
