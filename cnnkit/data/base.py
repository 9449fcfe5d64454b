"""What every data source provides: its config base class, the batch stream, the bundle, and the
preprocessing that classification must repeat.

Every source stores images as uint8 (C, H, W), 0-255. Normalisation happens on the device:
x = (x - mean) / std with mean and std per channel in 0-255 units.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class DataConfigBase(BaseModel):
    """Fields every `data:` section has; each source subclasses it with its own fields."""

    model_config = ConfigDict(extra="forbid")
    source: str = Field(description="digits | faces | synthetic | folder | packed")
    batch_size: PositiveInt = Field(128, description="global batch: split across ranks")
    eval_batch_size: PositiveInt | None = Field(None, description="default: batch_size")

    def build(
        self, device: torch.device, rank: int = 0, world_size: int = 1, seed: int = 0
    ) -> DataBundle:
        """Make the train and validation streams for this rank."""
        raise NotImplementedError


class Batches(Protocol):
    """A stream of batches for one rank: what the training loop and evaluation iterate.

    Yields (x, y): x float (B, C, H, W) on the device, augmented (train) and normalised;
    y int64 (B,) on the device. Iterating runs one epoch from the position set_epoch gave.
    """

    num_samples: int  # images in one epoch over all ranks (validation: each counted once)

    def __len__(self) -> int: ...  # batches this rank yields per epoch

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None: ...  # seeded order; resume

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...


@dataclass
class Preprocess:
    """How a raw image becomes network input at evaluation time (stored in checkpoints)."""

    channels: int  # 1 (grey) or 3 (RGB)
    crop: int  # network input height = width
    resize: int | None = None  # resize to this first (None: the image is already crop-sized)
    resize_mode: Literal["squash", "shorter"] = "squash"
    mean: list[float] = field(default_factory=lambda: [0.0])  # per channel, 0-255 units
    std: list[float] = field(default_factory=lambda: [255.0])  # per channel, 0-255 units

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Preprocess:
        return cls(**d)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 (B, C, H, W) on any device -> normalised float32 (B, C, H, W) there."""
        mean = torch.tensor(self.mean, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, -1, 1, 1)
        return (x.float() - mean) / std


@dataclass
class DataBundle:
    """The result of building a data section: streams plus what the model and checkpoint need."""

    train: Batches
    val: Batches
    classes: list[str]
    input_shape: tuple[int, int, int]  # (C, H, W) the network sees
    preprocess: Preprocess
