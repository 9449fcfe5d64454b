"""The settings of the image sets (folder, packed): loading, augmentation and normalisation,
what each field means and how they are checked, and the augmentation they make (build_augment).
The loader that runs them is data/loader.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import (
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from cnnkit.data.augment import CropAugment
from cnnkit.data.base import DataBundle, DataConfigBase, Preprocess, unit_mistake
from cnnkit.data.resize import Interpolation
from cnnkit.errors import ConfigError, brief
from cnnkit.runtime import available_cores

LUMA = (0.299, 0.587, 0.114)  # ITU-R 601, as Pillow's convert("L") and torchvision's Grayscale


class ImageSetConfig(DataConfigBase):
    """Fields shared by the image sources (folder, packed): loading and augmentation."""

    crop: PositiveInt = Field(227, description="network input side (left out: the network's; "
                              "227 of 256 like the seeds)")  # fmt: skip
    train_crop: Literal["random", "resized"] = Field(
        "random",
        description="random: random crop; resized: random-resized-crop (torchvision's box "
        "rule, drawn on each photo at its own size)",
    )
    scale: tuple[float, float] = Field((0.08, 1.0), description="random-resized-crop area range")
    mirror: bool = Field(True, description="random horizontal mirror in training")
    lighting: float = Field(0.0, ge=0, description="PCA lighting std (0.1 in the 2012 paper)")
    normalize: Literal["channel", "mean_image"] = Field(
        "channel", description="channel: (x - mean_c) / std_c; mean_image: x - mean image"
    )
    decode: Literal["cpu", "gpu"] = Field(
        "cpu", description="JPEGs decoded by the workers, or in batches on the training device"
    )
    workers: NonNegativeInt | None = Field(
        None, description="loader processes (0: in the main process; default: from the cores)"
    )
    prefetch: PositiveInt = Field(2, description="batches prefetched per worker")
    val_fraction: float = Field(0.1, ge=0, lt=1, description="held out when no val_path")
    mean: tuple[float, float, float] | None = Field(
        None,
        description="per channel, 0-255 (None: a fine-tuned network's preprocess:, else "
        "ImageNet's for folders, the pack's own)",
    )
    std: tuple[PositiveFloat, PositiveFloat, PositiveFloat] | None = Field(
        None, description="per channel, 0-255 (each > 0: it divides)"
    )
    grey: bool = Field(False, description="luma of the RGB images (ITU-R 601, as torchvision's "
                       "Grayscale): for a network with 1 input channel")  # fmt: skip
    _mean_image: torch.Tensor | None = PrivateAttr(None)  # a trained run's (evaluated_as)
    _drawn: bool = PrivateAttr(False)  # a run's data (resumed, evaluated), not a new run's
    # the mean and std a source takes where none are given (None: the set's own, a pack's)
    default_stats: ClassVar[tuple[tuple[float, ...], tuple[float, ...]] | None] = None

    @property
    def trained_mean(self) -> torch.Tensor | None:
        """The trained run's mean image these images are normalised with (evaluated_as)."""
        return self._mean_image

    def drawn_as(self, holdout: str | None) -> ImageSetConfig:
        """A copy marked as a run's data (`_drawn`): checks of a new run's data (a held-out
        set sharing its files) are not made again of what it trained on."""
        out = self.model_copy()
        out._drawn = True
        return out

    def evaluated_as(self, preprocess: Preprocess,
                     mean_image: torch.Tensor | None = None) -> ImageSetConfig:  # fmt: skip
        """Normalised with a trained network's mean image where it has one the size of these
        images, else its per-channel mean/std (not this data's own)."""
        if mean_image is not None and mean_image.shape[-1] == self.stored_size():
            out = self.model_copy(update={"normalize": "mean_image"})
            out._mean_image = mean_image
            return out
        if self.normalize != "channel" or len(preprocess.mean) != 3:
            return self
        return self.model_copy(update={"mean": tuple(preprocess.mean),
                                       "std": tuple(preprocess.std)})  # fmt: skip

    def normalised_as(self, mean: tuple[float, ...], std: tuple[float, ...]) -> ImageSetConfig:
        """These images normalised with `mean` and `std` (what a network's weights were made
        for) where this section leaves its own out, checked as given ones are (pydantic's
        ValidationError); itself where nothing changes: `normalize: mean_image`, both given,
        or the values the source takes anyway."""
        if self.normalize != "channel" or (self.mean and self.std):
            return self
        mean, std = self.mean or tuple(mean), self.std or tuple(std)
        taken = self.default_stats  # what it normalises with otherwise (None: a pack's own)
        if taken and (mean, std) == (self.mean or taken[0], self.std or taken[1]):
            return self
        update = {"mean": mean, "std": std}
        return type(self).model_validate({**self.model_dump(exclude_unset=True), **update})

    def training_notes(self) -> list[str]:
        """A validation set that is the training set is refused (its figures would not be held
        out); a held-out fraction beside a validation set, a crop area range beside a plain
        random crop and a mean or std beside a mean image are said to be unused."""
        notes = super().training_notes()
        fields = type(self).model_fields
        if self.train_crop != "resized" and tuple(self.scale) != fields["scale"].default:
            notes.append(f"data.scale {list(self.scale)} is not used: it is the area range of "
                         "random-resized crops (data.train_crop: resized), and the crop is "
                         "random")  # fmt: skip
        given = [k for k in ("mean", "std") if getattr(self, k) is not None]
        if given and self.normalize == "mean_image":
            notes.append(f"data.{' and data.'.join(given)} not used: data.normalize: mean_image "
                         "subtracts the set's mean image, and divides by nothing")  # fmt: skip
        val_path = getattr(self, "val_path", None)
        if not val_path:
            return notes
        if Path(val_path).resolve() == Path(getattr(self, "path", "")).resolve():
            raise ConfigError("data.val_path: the training set itself (data.path), so the held-out "
                              "figures would be of training images (leave data.val_path out "
                              "to hold out data.val_fraction of data.path)")  # fmt: skip
        default = type(self).model_fields["val_fraction"].default
        if self.val_fraction != default:
            notes.append(f"data.val_fraction {self.val_fraction:g} is not used: data.val_path "
                         "holds the held-out images")  # fmt: skip
        return notes

    def worker_count(self, local_ranks: int = 1) -> int:
        """`workers`, or the cores this process may use shared among the ranks on this machine,
        one left to each rank's main process."""
        if self.workers is not None:
            return self.workers
        return max(1, available_cores() // max(local_ranks, 1) - 1)

    @field_validator("mean", "std", mode="before")
    @classmethod
    def _one_per_channel(cls, values: Any) -> Any:
        if isinstance(values, (list, tuple)) and len(values) != 3:
            raise ValueError(f"takes 3 values, one per channel (R, G, B), not {len(values)} "
                             f"(got {brief(values)})")  # fmt: skip
        return values

    @field_validator("mean", "std")
    @classmethod
    def _pixel_scale(cls, values: tuple[float, ...] | None, info: ValidationInfo) -> Any:
        mistake = unit_mistake(info.field_name, values)
        if mistake:
            raise ValueError(mistake)
        return values

    @model_validator(mode="after")
    def _check_scale(self) -> ImageSetConfig:
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ValueError(f"scale: need 0 < min <= max <= 1, got {self.scale}")
        if self.grey and self.normalize == "mean_image":
            raise ValueError("grey: takes normalize: channel (a grey mean image is not kept)")
        if self.policy != "none" and self.normalize == "mean_image":
            raise ValueError(f"policy: {self.policy} takes normalize: channel (it works on the "
                             "pixels, which a crop's own part of the mean image hides)")  # fmt: skip
        return self

    def finish(self, bundle: DataBundle) -> DataBundle:
        """The bundle a source built, made grey where `grey` asks: both streams yield the luma
        of their normalised RGB batches, normalised by the luma of the mean and std (a linear
        map, so exactly the luma of the images, normalised), and classification's
        preprocessing says 1 channel."""
        if not self.grey:
            return bundle
        pre = bundle.preprocess
        mean = sum(w * m for w, m in zip(LUMA, pre.mean, strict=True))
        std = sum(w * s for w, s in zip(LUMA, pre.std, strict=True))
        weights = torch.tensor([w * s / std for w, s in zip(LUMA, pre.std, strict=True)])
        for stream in (bundle.train, bundle.val):
            stream.grey = weights.view(1, 3, 1, 1).to(stream.device)
        grey = Preprocess.of_data(1, pre.crop, pre.resize, pre.resize_mode, [mean], [std],
                                  interpolation=pre.interpolation)  # fmt: skip
        return replace(bundle, input_shape=(1, *bundle.input_shape[1:]), preprocess=grey)


def build_augment(cfg: ImageSetConfig, stats: dict,
                  interpolation: Interpolation = "bilinear") -> CropAugment:  # fmt: skip
    """The CropAugment of a config, given the data's stats (mean (C,) or mean image, std,
    lighting) and the filter its images were resized with (its random-resized crops' too)."""
    image_mean = cfg.normalize == "mean_image"
    mean = torch.as_tensor(
        stats["mean_image"] if image_mean else stats["mean"], dtype=torch.float32
    )
    std = torch.ones(3) if image_mean else torch.as_tensor(stats["std"], dtype=torch.float32)
    eigval, eigvec = stats["lighting"]
    return CropAugment(cfg.crop, cfg.train_crop, cfg.mirror, cfg.lighting, mean, std, eigval,
                       eigvec, scale=cfg.scale, interpolation=interpolation)  # fmt: skip
