"""Batched augmentation ON THE DEVICE of uint8 (B, C, H, W) batches: random crop + mirror as one
gather, random-resized-crop as one grid_sample, mean-image or per-channel normalisation, the 2012
paper's PCA lighting; centre crop and 10 crops for evaluation. Random parameters are drawn on the
CPU from a per-batch generator (tiny tensors), so a resumed epoch repeats them exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

# ImageNet RGB principal components (0-1 pixel units) used by AlexNet re-implementations
IMAGENET_EIGVAL = (0.2175, 0.0188, 0.0045)
IMAGENET_EIGVEC = (
    (-0.5675, 0.7192, 0.4009),
    (-0.5808, -0.0045, -0.8140),
    (-0.5836, -0.6948, 0.4203),
)


def crop_mirror(x: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor,
                size: int) -> torch.Tensor:  # fmt: skip
    """Per-sample (size x size) crops at (top, left), mirrored where flip: ONE gather, any dtype.

    x (B, C, H, W); top, left (B,) int64; flip (B,) bool, all on x's device -> (B, C, size, size).
    """
    B, C, H, W = x.shape
    steps = torch.arange(size, device=x.device)
    rows = top[:, None] + steps  # (B, size)
    cols = torch.where(flip[:, None], left[:, None] + size - 1 - steps, left[:, None] + steps)
    flat = (rows[:, :, None] * W + cols[:, None, :]).view(B, 1, size * size)  # (B, 1, s*s)
    out = x.reshape(B, C, H * W).gather(2, flat.expand(B, C, size * size))
    return out.view(B, C, size, size)


def resized_crop_mirror(x: torch.Tensor, boxes: torch.Tensor, flip: torch.Tensor,
                        size: int) -> torch.Tensor:  # fmt: skip
    """Per-sample crops of boxes (B, 4: top, left, height, width) resized to size: one grid_sample.

    x float (B, C, H, W) -> float (B, C, size, size), bilinear, mirrored where flip.
    """
    B, _, H, W = x.shape
    top, left, h, w = boxes.to(x.dtype).unbind(1)
    theta = torch.zeros(B, 2, 3, device=x.device, dtype=x.dtype)
    theta[:, 0, 0] = torch.where(flip, -w / W, w / W)  # mirror = negative x scale
    theta[:, 0, 2] = (2 * left + w) / W - 1  # box centre in [-1, 1]
    theta[:, 1, 1] = h / H
    theta[:, 1, 2] = (2 * top + h) / H - 1
    grid = F.affine_grid(theta, [B, x.shape[1], size, size], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def sample_boxes(batch: int, height: int, width: int, scale: tuple[float, float],
                 ratio: tuple[float, float], generator: torch.Generator) -> torch.Tensor:  # fmt: skip
    """torchvision's RandomResizedCrop box rule, vectorised: 10 tries per image, else the centre.

    Returns (B, 4) int64 top, left, height, width.
    """
    tries = 10
    area = height * width * torch.empty(batch, tries).uniform_(*scale, generator=generator)
    log_r = torch.empty(batch, tries).uniform_(
        math.log(ratio[0]), math.log(ratio[1]), generator=generator
    )
    aspect = torch.exp(log_r)
    w = torch.sqrt(area * aspect).round().long()
    h = torch.sqrt(area / aspect).round().long()
    ok = (w > 0) & (h > 0) & (w <= width) & (h <= height)
    first = torch.where(ok.any(1), ok.float().argmax(1), torch.full((batch,), -1))
    pick = first.clamp(min=0)[:, None]
    h, w = h.gather(1, pick)[:, 0], w.gather(1, pick)[:, 0]
    side = min(height, width)  # fallback (no try fit): the centre square, like torchvision's
    h = torch.where(first >= 0, h, torch.full_like(h, side))
    w = torch.where(first >= 0, w, torch.full_like(w, side))
    top = (torch.rand(batch, generator=generator) * (height - h + 1)).long()
    left = (torch.rand(batch, generator=generator) * (width - w + 1)).long()
    return torch.stack([top, left, h, w], 1)


def center_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """(B, C, H, W) -> the centre (B, C, size, size) (a view)."""
    H, W = x.shape[-2:]
    top, left = (H - size) // 2, (W - size) // 2
    return x[..., top : top + size, left : left + size]


def ten_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, 10, C, size, size): 4 corners + centre, then the same of the mirror
    (torchvision's TenCrop order). Average the model's outputs over dim 1."""
    H, W = x.shape[-2:]
    if size > min(H, W):
        raise ValueError(f"ten_crop: crop {size} larger than the image {H}x{W}")

    def five(img: torch.Tensor) -> list[torch.Tensor]:
        corners = [img[..., :size, :size], img[..., :size, W - size :],
                   img[..., H - size :, :size], img[..., H - size :, W - size :]]  # fmt: skip
        return corners + [center_crop(img, size)]

    return torch.stack(five(x) + five(x.flip(-1)), 1)


@dataclass
class Augment:
    """How a stream turns uint8 batches into network input on the device."""

    crop: int  # network input side
    train_crop: Literal["random", "resized", "none"] = "random"
    mirror: bool = True
    lighting: float = 0.0  # std of the PCA alphas (0.1 in the 2012 paper); 0 = off
    mean: torch.Tensor | None = None  # (C,) per channel or (C, H, W) mean image, 0-255 units
    std: torch.Tensor | None = None  # (C,), 0-255 units
    eigval: torch.Tensor | None = None  # (3,) std along each principal axis, 0-255 units
    eigvec: torch.Tensor | None = None  # (3, 3) columns = principal axes
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def to(self, device: torch.device) -> Augment:
        """A copy with the tensors on `device` (float32)."""
        moved = {k: getattr(self, k) for k in ("mean", "std", "eigval", "eigvec")}
        moved = {k: None if v is None else v.float().to(device) for k, v in moved.items()}
        return Augment(self.crop, self.train_crop, self.mirror, self.lighting, scale=self.scale,
                       ratio=self.ratio, **moved)  # fmt: skip

    def sample(self, batch: int, height: int, width: int, generator: torch.Generator) -> dict:
        """Random parameters of one training batch (CPU tensors)."""
        g = generator
        flip = (
            torch.rand(batch, generator=g) < 0.5
            if self.mirror
            else torch.zeros(batch, dtype=torch.bool)
        )
        p = {"flip": flip, "alpha": torch.randn(batch, 3, generator=g) * self.lighting}
        if self.train_crop == "resized":
            p["boxes"] = sample_boxes(batch, height, width, self.scale, self.ratio, g)
        else:
            p["top"] = torch.randint(0, height - self.crop + 1, (batch,), generator=g)
            p["left"] = torch.randint(0, width - self.crop + 1, (batch,), generator=g)
        return p

    def train(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        """uint8 (B, C, H, W) on the device -> augmented, normalised float (B, C, crop, crop)."""
        p = {k: v.to(x.device, non_blocking=True) for k, v in params.items()}
        image_mean = self.mean is not None and self.mean.dim() == 3
        if self.train_crop == "resized":
            x = x.float()
            x = x - self.mean if image_mean else x
            x = resized_crop_mirror(x, p["boxes"], p["flip"], self.crop)
        elif self.train_crop == "random":
            x = x.float() - self.mean if image_mean else x  # mean image: subtract before cropping
            x = crop_mirror(x, p["top"], p["left"], p["flip"], self.crop)
        return self._finish(x, image_mean, p["alpha"] if self.lighting else None)

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 (B, C, H, W) -> the normalised centre crop."""
        image_mean = self.mean is not None and self.mean.dim() == 3
        x = x.float() - self.mean if image_mean else x
        return self._finish(center_crop(x, self.crop), image_mean, None)

    def _finish(
        self, x: torch.Tensor, image_mean: bool, alpha: torch.Tensor | None
    ) -> torch.Tensor:
        x = x.float() if x.dtype == torch.uint8 else x
        if self.mean is not None and not image_mean:
            x = x - self.mean.view(1, -1, 1, 1)
        if alpha is not None and self.eigvec is not None:  # the 2012 paper's PCA lighting
            shift = (self.eigvec @ (alpha * self.eigval).T).T  # (B, 3) in 0-255 units
            x = x + shift[:, :, None, None]
        if self.std is not None:
            x = x / self.std.view(1, -1, 1, 1)
        return x.contiguous()


def imagenet_lighting() -> tuple[torch.Tensor, torch.Tensor]:
    """(eigval, eigvec) of ImageNet's RGB covariance in 0-255 units (AlexNet's lighting)."""
    return torch.tensor(IMAGENET_EIGVAL) * 255, torch.tensor(IMAGENET_EIGVEC)


def lighting_from_cov(cov: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(eigval as std along each axis, eigvec) from an RGB covariance in 0-255 units."""
    values, vectors = torch.linalg.eigh(torch.tensor(cov, dtype=torch.float64))
    return values.clamp(min=0).sqrt().flip(0).float(), vectors.flip(1).float()
