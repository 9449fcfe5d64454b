"""Synthetic data: random uint8 images and labels of a given shape, made on the device (speed work)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, PositiveInt, field_validator

from cnnkit.data.base import MAX_SIDE, DataBundle, DataConfigBase, Preprocess
from cnnkit.data.memory import TensorBatches
from cnnkit.runtime import mix_seed


class SyntheticConfig(DataConfigBase):
    """Random images (uniform 0-255) with random labels: measures speed, learns nothing general."""

    source: Literal["synthetic"] = "synthetic"
    shape: list[PositiveInt] = Field([3, 224, 224], min_length=3, max_length=3, description="C,H,W")
    num_classes: PositiveInt = Field(1000)
    train_size: PositiveInt = Field(1024, description="images per epoch")
    val_size: PositiveInt = Field(256)

    @field_validator("shape")
    @classmethod
    def _image_shape(cls, v: list[int]) -> list[int]:
        """An image's, as classification's preprocessing records it."""
        if v[0] > 4:
            raise ValueError(f"{v[0]} channels: at most 4 (1 grey, 3 RGB)")
        if max(v[1:]) > MAX_SIDE:
            raise ValueError(f"{v[1]}x{v[2]}: at most {MAX_SIDE} px a side")
        return v

    def build(
        self,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        local_ranks: int = 1,
    ) -> DataBundle:
        """Generate both sets once (the same on every rank), on the device: the training set
        by the device's own generator (a GPU draws a 1.6 GB set in milliseconds, the host in
        seconds), the held-out set by the host's, so that it is the same on any device (eval
        of a run elsewhere scores the same images)."""

        def draw(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            images = torch.randint(0, 256, (n, *self.shape), generator=gen, dtype=torch.uint8,
                                   device=gen.device)  # fmt: skip
            labels = torch.randint(0, self.num_classes, (n,), generator=gen, device=gen.device)
            return images.to(device), labels.to(device)

        on_device = torch.Generator(device=device).manual_seed(mix_seed(seed, 12345))
        train_x, train_y = draw(self.train_size, on_device)
        val_x, val_y = draw(self.val_size, torch.Generator().manual_seed(mix_seed(seed, 54321)))
        c, h, _ = self.shape
        pre = Preprocess.of_data(channels=c, crop=h, mean=[127.5] * c, std=[73.9] * c)
        common = dict(preprocess=pre, rank=rank, world_size=world_size, seed=seed)
        train = TensorBatches(train_x, train_y, self.batch_size, train=True, **common)
        eval_batch = self.eval_batch_size or self.batch_size
        val = TensorBatches(val_x, val_y, eval_batch, train=False, **common)
        return DataBundle(train, val, self.class_names(), (c, h, self.shape[2]), pre,
                          train_y.cpu())  # fmt: skip

    def class_names(self) -> list[str]:
        return [f"class{i}" for i in range(self.num_classes)]
