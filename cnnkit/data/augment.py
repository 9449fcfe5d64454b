"""Batched augmentation ON THE DEVICE of uint8 (B, C, H, W) batches: random crop + mirror as one
gather, random-resized-crop as two batched matmuls (torchvision's antialiased bilinear or
bicubic resize; the boxes: boxes.py), mean-image or per-channel normalisation, the 2012
paper's PCA lighting; centre crop and 10 crops for evaluation. Random parameters are drawn on
the CPU from a per-batch generator (tiny tensors), so a resumed epoch repeats them exactly.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from cnnkit.data.boxes import draw_boxes, frame_boxes, rrc_boxes
from cnnkit.data.resize import Interpolation, resize_crop
from cnnkit.runtime import torch_threads

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


def resized_crop_mirror(x: torch.Tensor, boxes: torch.Tensor, flip: torch.Tensor, size: int,
                        interpolation: Interpolation = "bilinear",
                        pixels: bool = False) -> torch.Tensor:  # fmt: skip
    """Per-sample crops of boxes (B, 4: top, left, height, width) resized to size, mirrored
    where flip: x float (B, C, H, W) -> float (B, C, size, size), for a whole batch on the
    device in two batched matmuls; x (C, H, W): one image (a mean image) under every box.

    torchvision's antialiased resize (PIL's triangle or bicubic filter, widened by the scale
    when shrinking) written as per-sample weight matrices, so a crop shrunk 4x is averaged as
    the CPU path and torchvision average it, not aliased as a plain bilinear sample would be.
    A bicubic result overshoots the input's range, as torchvision's float resize does; with
    `pixels` (x in 0-255) each pass is clamped to that range, as torch's uint8 resize clamps
    between its two passes (width first).
    """
    H, W = x.shape[-2:]
    top, left, h, w = boxes.to(device=x.device, dtype=torch.float32).unbind(1)
    kernel = FILTERS[interpolation]
    rows = _resize_weights(top, h, size, H, kernel)  # (B, size, H)
    cols = _resize_weights(left, w, size, W, kernel, flip.to(x.device))  # (B, size, W)
    if x.dim() == 3:  # one matmul for every box, not a copy of the image per box
        across = torch.einsum("chw,bsw->bchs", x, cols.to(x.dtype))  # (B, C, H, size)
    else:
        across = torch.matmul(x, cols.to(x.dtype).transpose(1, 2)[:, None])
    if pixels:
        across.clamp_(0, 255)
    out = torch.matmul(rows.to(x.dtype)[:, None], across)  # (B, C, size, size)
    return out.clamp_(0, 255) if pixels else out


def _triangle(d: torch.Tensor) -> torch.Tensor:
    """The bilinear filter at distances d (in filter units): 1 - |d|, 0 from 1 on."""
    return (1 - d.abs()).clamp_(min=0)


def _cubic(d: torch.Tensor) -> torch.Tensor:
    """The bicubic filter at distances d: Keys' cubic with a = -0.5 (PIL's and torch's
    antialiased bicubic), 0 from 2 on."""
    a, d = -0.5, d.abs()
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return torch.where(d < 1, near, torch.where(d < 2, far, torch.zeros_like(d)))


FILTERS = {"bilinear": _triangle, "bicubic": _cubic}


def _resize_weights(start: torch.Tensor, length: torch.Tensor, size: int, extent: int,
                    kernel=_triangle, flip: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """(B, size, extent) weights resizing [start, start + length) of an axis of `extent` pixels
    to `size` pixels, as antialiased interpolation of that crop with `kernel` does (the filter
    stretched by the scale when shrinking; each row sums to 1 over the crop's pixels); the rows
    reversed where flip."""
    scale = length / size
    stretch = scale.clamp(min=1.0)  # the filter's unit, in input pixels
    steps = torch.arange(size, device=start.device, dtype=torch.float32) + 0.5
    centre = start[:, None] + steps * scale[:, None]  # (B, size), in input pixels
    pixel = torch.arange(extent, device=start.device, dtype=torch.float32) + 0.5
    weights = kernel((pixel - centre[..., None]) / stretch[:, None, None])
    inside = (pixel >= start[:, None]) & (pixel < (start + length)[:, None])  # the crop alone
    weights = weights * inside[:, None, :]
    weights = weights / weights.sum(-1, keepdim=True)
    return weights if flip is None else torch.where(flip[:, None, None], weights.flip(1), weights)


def center_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """(B, C, H, W) -> the centre (B, C, size, size) (a view), where torchvision's CenterCrop
    takes it (its offset rounded half to even, as Python's round)."""
    H, W = x.shape[-2:]
    if size > min(H, W):  # (a negative offset would slice a corner instead)
        raise ValueError(f"center_crop: crop {size} larger than the image {H}x{W}")
    top, left = round((H - size) / 2), round((W - size) / 2)
    return x[..., top : top + size, left : left + size]


def ten_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, 10, C, size, size): 4 corners + centre, then each of them mirrored,
    as the 2012 paper and Caffe's oversample take them. In torchvision's TenCrop order, and its
    pixels where H - size and W - size are even; where odd, TenCrop's tenth crop is the centre
    of the mirrored image, a pixel off the centre crop's mirror. Average the model's outputs
    over dim 1."""
    H, W = x.shape[-2:]
    if size > min(H, W):
        raise ValueError(f"ten_crop: crop {size} larger than the image {H}x{W}")

    def five(img: torch.Tensor) -> list[torch.Tensor]:
        corners = [img[..., :size, :size], img[..., :size, W - size :],
                   img[..., H - size :, :size], img[..., H - size :, W - size :]]  # fmt: skip
        return corners + [center_crop(img, size)]

    tl, tr, bl, br, centre = five(x)  # mirrored, the top-right is the mirror's top-left
    return torch.stack([tl, tr, bl, br, centre] + [c.flip(-1) for c in (tr, tl, br, bl, centre)], 1)


@dataclass
class CropAugment:
    """How a stream turns uint8 batches into network input on the device.

    On CUDA every step is one batched kernel. On a CPU device one loop over the batch does
    crop, mirror (a negative stride), conversion and normalisation in one cache-resident pass
    per image (numpy, off torch's thread pool), into a reusable `out` buffer.
    """

    crop: int  # network input side
    train_crop: Literal["random", "resized"] = "random"
    mirror: bool = True
    lighting: float = 0.0  # std of the PCA alphas (0.1 in the 2012 paper); 0 = off
    mean: torch.Tensor | None = None  # (C,) per channel or (C, H, W) mean image, 0-255 units
    std: torch.Tensor | None = None  # (C,), 0-255 units
    eigval: torch.Tensor | None = None  # (3,) eigenvalues of the 0-1 RGB covariance, x 255
    eigvec: torch.Tensor | None = None  # (3, 3) columns = principal axes
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    interpolation: Interpolation = "bilinear"  # a random-resized crop's filter

    def to(self, device: torch.device) -> CropAugment:
        """A copy on `device`, float32, mean as (C, 1, 1) or (C, H, W), std as (C, 1, 1)."""
        mean = torch.zeros(3) if self.mean is None else torch.as_tensor(self.mean).float()
        std = torch.ones(mean.shape[0]) if self.std is None else torch.as_tensor(self.std).float()
        lighting = {k: getattr(self, k) for k in ("eigval", "eigvec")}
        lighting = {k: None if v is None else v.float().to(device) for k, v in lighting.items()}
        return CropAugment(self.crop, self.train_crop, self.mirror, self.lighting,
                       (mean.view(-1, 1, 1) if mean.dim() == 1 else mean).to(device),
                       std.view(-1, 1, 1).to(device), scale=self.scale, ratio=self.ratio,
                       interpolation=self.interpolation, **lighting)  # fmt: skip

    def sample(self, batch: int, height: int, width: int, generator: torch.Generator,
               sources: torch.Tensor | None = None) -> dict:  # fmt: skip
        """Random parameters of one training batch (CPU tensors) of height x width images.

        sources: (B, 2) each image's own (H, W) where it was squashed into that square (a
        photo): random-resized-crop boxes are then drawn on the photo, as torchvision draws
        them, and mapped into the square (else drawn in the square itself). "draws" keeps the
        numbers they came from (for workers that learn the sizes as they read the files).
        """
        g = generator
        flip = torch.rand(batch, generator=g) < 0.5
        p = {
            "flip": flip & self.mirror,
            "alpha": torch.randn(batch, 3, generator=g) * self.lighting,
        }
        if self.train_crop == "resized":
            p["draws"] = draw_boxes(batch, self.scale, self.ratio, g)
            if sources is None or height != width:
                p["boxes"] = rrc_boxes(p["draws"], height, width, self.ratio)
            else:
                boxes = rrc_boxes(p["draws"], sources[:, 0], sources[:, 1], self.ratio)
                p["boxes"] = frame_boxes(boxes, sources, height)
        else:
            p["top"] = torch.randint(0, height - self.crop + 1, (batch,), generator=g)
            p["left"] = torch.randint(0, width - self.crop + 1, (batch,), generator=g)
        return p

    def boxes(self, params: dict) -> torch.Tensor:
        """The crop of each image as a (B, 4) box (top, left, height, width), random or resized."""
        if self.train_crop == "resized":
            return params["boxes"]
        side = torch.full_like(params["top"], self.crop)
        return torch.stack([params["top"], params["left"], side, side], 1)

    def light(self, alpha: torch.Tensor) -> torch.Tensor | None:
        """PCA lighting shift (B, 3, 1, 1) over the std (the 2012 paper's), or None when off."""
        if not self.lighting or self.eigvec is None:
            return None
        shift = (self.eigvec @ (alpha.to(self.eigvec.device) * self.eigval).T).T  # (B, 3), 0-255
        return shift[:, :, None, None] / self.std

    def train(self, x: torch.Tensor, params: dict, out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 (B, C, H, W) -> augmented, normalised float (B, C, crop, crop) on x's device.

        Call on an CropAugment moved with `.to(device)`; `out`: a reusable output buffer (CPU).
        On the CPU x may also be an ImageList (per-image views of memory-mapped shards).
        """
        if not isinstance(x, torch.Tensor) or x.device.type == "cpu":
            return self._train_cpu(x, params, out)
        p = {k: v.to(x.device, non_blocking=True) for k, v in params.items()}
        if self.train_crop == "resized":
            y = self._resized_crops(x, p["boxes"], p["flip"])
        elif self.mean.shape[-1] > 1:  # mean image: subtract, then crop both at once
            y = crop_mirror(x.float() - self.mean, p["top"], p["left"], p["flip"], self.crop)
        else:
            y = crop_mirror(x, p["top"], p["left"], p["flip"], self.crop).float().sub_(self.mean)
        y.div_(self.std)
        shift = self.light(p["alpha"])
        return y if shift is None else y.add_(shift)

    def _resized_crops(self, x: torch.Tensor, boxes: torch.Tensor, flip: torch.Tensor
                       ) -> torch.Tensor:  # fmt: skip
        """The batch's random-resized crops less the mean, on the device. Bilinear weights
        never leave the pixels' range, so the mean (an image too) goes in with them; bicubic
        ones are clamped to 0-255 first, as the CPU path's uint8 resize is."""
        if self.interpolation == "bilinear":
            return resized_crop_mirror(x.float() - self.mean, boxes, flip, self.crop)
        y = resized_crop_mirror(x.float(), boxes, flip, self.crop, self.interpolation, True)
        mean = self.mean
        if mean.shape[-1] > 1:  # the mean image's crops, resized alike
            mean = resized_crop_mirror(mean, boxes, flip, self.crop, self.interpolation)
        return y.sub_(mean)

    def _train_cpu(self, x: torch.Tensor, p: dict, out: torch.Tensor | None) -> torch.Tensor:
        B, C, s = x.shape[0], x.shape[1], self.crop
        out = torch.empty(B, C, s, s) if out is None else out
        shift = self.light(p["alpha"])
        if self.train_crop == "resized":
            places = p["boxes"].tolist()
        else:
            places = list(zip(p["top"].tolist(), p["left"].tolist(), strict=True))
        scale, offset = 1 / self.std, -self.mean / self.std
        resizing = torch_threads(1) if self.train_crop == "resized" else nullcontext()
        with resizing:
            for i, (place, flip) in enumerate(zip(places, p["flip"].tolist(), strict=True)):
                src, mean = self._crop_one(x, i, place)
                src, mean = torch.from_numpy(src), torch.from_numpy(mean)
                if flip:  # torch's flip copies 7x faster than numpy; a per-channel mean stays
                    src = src.flip(-1)
                    mean = mean.flip(-1) if mean.shape[-1] > 1 else mean
                self._normalise(out[i], src, mean, None if shift is None else shift[i], scale,
                                offset)  # fmt: skip
        return out

    @staticmethod
    def _normalise(out: torch.Tensor, src: torch.Tensor, mean: torch.Tensor,
                   shift: torch.Tensor | None, scale: torch.Tensor,
                   offset: torch.Tensor) -> None:  # fmt: skip
        """One image, uint8 -> (x - mean) / std (+ lighting) written into `out`: a conversion
        then in-place passes that vectorise (a fused addcmul of uint8 with broadcast per-channel
        factors does not, and runs 2-3x slower), while the image is still in cache."""
        out.copy_(src)
        if mean.shape[-1] == 1:  # per channel: one multiply-add
            out.mul_(scale).add_(offset)
        else:  # the mean image's crop
            out.sub_(mean).mul_(scale)
        if shift is not None:
            out.add_(shift)

    def finish(self, x: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor:  # fmt: skip
        """Already cropped + mirrored uint8 (B, C, crop, crop) on the CPU -> normalised float with
        lighting (alpha: the batch's lighting draws), one image at a time (cache-resident)."""
        out = torch.empty(x.shape) if out is None else out
        shift = self.light(alpha)
        scale, offset = 1 / self.std, -self.mean / self.std
        for i in range(len(x)):
            self._normalise(out[i], x[i], self.mean, None if shift is None else shift[i], scale,
                            offset)  # fmt: skip
        return out

    def _crop_one(self, x: torch.Tensor, i: int, place: list) -> tuple[np.ndarray, np.ndarray]:
        """Image i's crop at place ((top, left) or a box) and the mean to subtract, as numpy."""
        s, mean, img = self.crop, self.mean, x[i]  # img (C, H, W)
        if self.train_crop != "resized":
            top, left = place
            src = img[:, top : top + s, left : left + s].numpy()
            return src, (
                mean[:, top : top + s, left : left + s] if mean.shape[-1] > 1 else mean
            ).numpy()
        top, left, h, w = place
        src = resize_crop(img[:, top : top + h, left : left + w], s, False,
                          interpolation=self.interpolation).numpy()  # fmt: skip
        if mean.shape[-1] > 1:
            mean = F.interpolate(mean[None, :, top : top + h, left : left + w], size=(s, s),
                                 mode=self.interpolation, antialias=True)[0]  # fmt: skip
        return src, mean.numpy()

    def eval(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 (B, C, H, W) -> the normalised centre crop (float) on x's device.

        `out`: a reusable output buffer (CPU); x may then also be a list of (C, H, W) images.
        """
        mean = center_crop(self.mean, self.crop) if self.mean.shape[-1] > 1 else self.mean
        if out is None:
            return (center_crop(x, self.crop).float() - mean).div_(self.std)
        scale, offset = 1 / self.std, -self.mean / self.std
        for i in range(len(x)):  # one image at a time: it stays in cache
            self._normalise(out[i], center_crop(x[i], self.crop), mean, None, scale, offset)
        return out


def imagenet_lighting() -> tuple[torch.Tensor, torch.Tensor]:
    """(eigval, eigvec) of ImageNet's RGB covariance in 0-255 units (AlexNet's lighting)."""
    return torch.tensor(IMAGENET_EIGVAL) * 255, torch.tensor(IMAGENET_EIGVEC)


def lighting_from_cov(cov: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(eigval, eigvec) from an RGB covariance in 0-255 units, on imagenet_lighting's scale.

    IMAGENET_EIGVAL are the covariance's eigenvalues (variances) of 0-1 pixels: the paper's shift
    is eigvec @ (alpha * eigval), so in 0-255 units eigval is the 0-1 eigenvalue times 255.
    """
    values, vectors = torch.linalg.eigh(torch.tensor(cov, dtype=torch.float64) / 255**2)
    return (values.clamp(min=0) * 255).flip(0).float(), vectors.flip(1).float()
