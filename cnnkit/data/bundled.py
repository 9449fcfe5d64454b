"""The small real data sets that ship inside installed packages: nothing is downloaded.

digits: scikit-learn's 1,797 handwritten 8x8 digits. faces: scikit-image's 200 25x25 LFW
face / non-face patches. Each has a fixed, seeded, stratified held-out split never trained on.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import torch
from pydantic import Field, PositiveInt, field_validator, model_validator

from cnnkit.data.base import DataBundle, DataConfigBase, Preprocess, Section
from cnnkit.data.holdout import holdout_id, holdout_split
from cnnkit.data.memory import Jitter, TensorBatches
from cnnkit.errors import DataError


class BundledConfig(DataConfigBase):
    """Fields shared by the bundled sets: split and batched device-side augmentation."""

    classes: ClassVar[tuple[str, ...]]  # the set's class names, by label

    val_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="held-out share (stratified)")
    split_seed: int = Field(0, ge=0, description="fixes the held-out split (not the run seed)")
    shift: float = Field(0.0, ge=0.0, le=0.5, description="max random shift, fraction of side")
    rotate: float = Field(0.0, ge=0.0, le=180.0, description="max random rotation, degrees")
    scale: float = Field(0.0, ge=0.0, lt=1.0, description="max random zoom (0.1: 0.9x-1.1x)")
    mirror: bool = Field(False, description="random horizontal flip")
    padding: Literal["zeros", "border"] = Field(
        "zeros", description="what enters from outside: zeros (black) | border (its edge)"
    )
    contrast: float = Field(0.0, ge=0.0, lt=1.0, description="max random contrast change")
    brightness: float = Field(0.0, ge=0.0, description="max random brightness shift (stds)")

    def load(self) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """All images uint8 (N, H, W), labels (N,), class names."""
        raise NotImplementedError

    def split(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
        """(train images, train labels, held-out images, held-out labels, class names): the
        fixed stratified split, as uint8 (N, H, W) and int64 (N,) arrays."""
        return self._drawn()[:5]

    def _drawn(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str], str]:
        """split() and the held-out images' fingerprint (checkpoints keep it: see holdout_id)."""
        images, labels, classes = self.load()
        labels = labels.astype(np.int64)
        train, val = holdout_split(labels, self.val_fraction, self.split_seed)
        drawn = holdout_id(None, val, len(labels))
        return images[train], labels[train], images[val], labels[val], classes, drawn

    def build(
        self,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        local_ranks: int = 1,
    ) -> DataBundle:
        """Split, move both parts to the device once, and wrap them as batch streams."""
        train_x, train_y, val_x, val_y, classes, drawn = self._drawn()
        mean, std = float(train_x.mean()), float(train_x.std(ddof=1))
        train_x, train_y = self.extra_training(train_x, train_y)
        h, w = train_x.shape[1:]
        pre = Preprocess.of_data(channels=1, crop=h, resize=None, mean=[mean], std=[std])
        jitter = Jitter(self.shift, self.rotate, self.scale, self.mirror, self.padding,
                        self.contrast, self.brightness)  # fmt: skip
        common = dict(preprocess=pre, rank=rank, world_size=world_size, seed=seed)

        def on_device(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.from_numpy(x).unsqueeze(1).to(device), torch.from_numpy(y).to(device)

        train = TensorBatches(*on_device(train_x, train_y), self.batch_size, train=True,
                              augment=jitter, **common)  # fmt: skip
        eval_batch = self.eval_batch_size or max(self.batch_size, 256)
        val = TensorBatches(*on_device(val_x, val_y), eval_batch, train=False, **common)
        return DataBundle(train, val, classes, (1, h, w), pre, torch.from_numpy(train_y),
                          holdout=drawn)  # fmt: skip

    def class_names(self) -> list[str]:
        return list(self.classes)

    def extra_training(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Images added to the training split only (none here; faces adds mined negatives)."""
        return x, y


class DigitsConfig(BundledConfig):
    """scikit-learn's handwritten digits: 1,797 grey 8x8 images, 10 classes (0-16 -> 0-255)."""

    source: Literal["digits"] = "digits"
    classes: ClassVar[tuple[str, ...]] = tuple(str(d) for d in range(10))
    batch_size: int = Field(64, gt=0, description="global batch")

    def load(self) -> tuple[np.ndarray, np.ndarray, list[str]]:
        pixels, target = _digits()
        images = np.rint(pixels.reshape(-1, 8, 8) * (255.0 / 16.0)).astype(np.uint8)
        return images, target, list(self.classes)


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (1797, 64) pixels 0-16 and (1797,) labels: read from the file it
    ships (`load_digits` reads the same one) without importing scikit-learn, which costs more
    than a short run trains (1.6-2.9 s); `load_digits` itself where the file is not found."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    folders = (spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        try:
            table = np.loadtxt(path, delimiter=",")
        except (OSError, ValueError):
            continue
        if table.shape == (1797, 65):
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.data, digits.target


class FacesConfig(BundledConfig):
    """scikit-image's LFW subset: 100 faces + 100 non-face patches, grey 25x25."""

    source: Literal["faces"] = "faces"
    classes: ClassVar[tuple[str, ...]] = ("non-face", "face")  # labels 0 and 1
    batch_size: int = Field(32, gt=0, description="global batch")
    val_fraction: float = Field(0.25, gt=0.0, lt=1.0, description="held-out share (stratified)")
    padding: Literal["zeros", "border"] = Field("border", description="fill outside the image")
    hard_negatives: HardNegatives | None = Field(None, description="mining rounds (the trainer)")
    negatives: str | None = Field(None, description=".npy uint8 (N, 25, 25) extra non-faces")

    def extra_training(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The mined non-face patches (`negatives`), appended to the training split."""
        if self.negatives is None:
            return x, y
        try:
            extra = np.load(Path(self.negatives), allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"data.negatives: cannot read {self.negatives}: {e}") from None
        if extra.dtype != np.uint8 or extra.size % (x.shape[1] * x.shape[2]):
            raise DataError(
                f"data.negatives: {self.negatives} holds {extra.dtype} {list(extra.shape)}, "
                f"not uint8 patches of {x.shape[1]}x{x.shape[2]}"
            )
        extra = extra.reshape(-1, *x.shape[1:])
        labels = np.zeros(len(extra), dtype=y.dtype)  # 0: non-face
        return np.concatenate([x, extra]), np.concatenate([y, labels])

    def load(self) -> tuple[np.ndarray, np.ndarray, list[str]]:
        try:
            from skimage.data import lfw_subset

            patches = lfw_subset()  # (200, 25, 25) float in [0, 1]; faces first
        except Exception as e:  # a broken scikit-image install: say so in one line
            raise DataError(f"faces: cannot load skimage.data.lfw_subset(): {e}") from None
        images = np.rint(patches * 255.0).astype(np.uint8)
        labels = np.array([1] * 100 + [0] * 100)
        return images, labels, list(self.classes)


# scikit-image pictures that hold no human face (checked by eye); astronaut is the test image
# and camera (a man), coins (heads on them), cat and chelsea (a cat's face) are left out.
FACE_FREE = ("coffee", "rocket", "brick", "grass", "gravel", "moon", "page", "text", "clock",
             "horse", "hubble_deep_field", "immunohistochemistry", "motorcycle", "retina",
             "cell", "colorwheel", "checkerboard")  # fmt: skip


class HardNegatives(Section, extra="forbid"):
    """Bootstrapping: train, scan face-free pictures with the detector, add its false positives
    as non-faces, train again; the trainer keeps the round best on the held-out measure."""

    images: list[str] = Field(description="face-free scikit-image pictures to mine")
    held_out: list[str] = Field(default_factory=list, description="pictures only for choosing")
    rounds: int = Field(2, ge=0, le=20, description="mining rounds after the first training")
    per_image: PositiveInt = Field(20, description="most false positives kept per picture")
    random_per_image: int = Field(0, ge=0, description="random windows per picture from round 0")
    threshold: float = Field(0.5, gt=0.0, lt=1.0, description="P(face) that counts as a hit")
    step: float = Field(1.25, gt=1.0, description="pyramid scale factor while mining")
    max_side: PositiveInt = Field(320, description="pictures shrunk to at most this side")

    def describe(self) -> str:
        """What the rounds do, for a dry run (which builds round 0)."""
        held = len(self.held_out)
        return (f"that is round 0 of {self.rounds + 1}: each later round first scans "
                f"{len(self.images)} face-free pictures for false positives and trains again "
                f"with them; {held} held-out picture{' chooses' if held == 1 else 's choose'} "
                "the round kept")  # fmt: skip

    @field_validator("images", "held_out")
    @classmethod
    def _face_free(cls, names: list[str]) -> list[str]:
        for name in names:
            if name not in FACE_FREE:
                raise ValueError(f"{name!r} is not a face-free picture; use {', '.join(FACE_FREE)}")
        return names

    @model_validator(mode="after")
    def _held_out_apart(self) -> HardNegatives:
        both = [name for name in self.held_out if name in self.images]
        if both:  # its false positives would be trained away, then score the round: inflated
            raise ValueError(f"held_out: {both[0]!r} is mined too (images): a held-out picture "
                             "is only for choosing the round")  # fmt: skip
        if self.rounds and not self.held_out:  # every round would score 0: round 0 kept, always
            raise ValueError("held_out: mining rounds need held-out face-free pictures to choose "
                             f"the best round by (one or more of {', '.join(FACE_FREE)})")  # fmt: skip
        return self


def face_free_picture(name: str, max_side: int) -> np.ndarray:
    """A face-free scikit-image picture as grey uint8 (H, W), shrunk to at most `max_side`."""
    from PIL import Image
    from skimage import data

    if name not in FACE_FREE:
        raise DataError(f"hard_negatives: {name!r} is not a face-free picture")
    try:
        image = data.stereo_motorcycle()[0] if name == "motorcycle" else getattr(data, name)()
    except Exception as e:  # a broken or partial scikit-image install: one line
        raise DataError(f"hard_negatives: cannot load skimage.data.{name}(): {e}") from None
    picture = Image.fromarray(image).convert("L")
    picture.thumbnail((max_side, max_side), Image.BILINEAR)
    return np.asarray(picture)
