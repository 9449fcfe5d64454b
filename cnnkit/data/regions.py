"""Training crops cut straight from image files (a folder's workers): each file's size read
from its header first, then the crop's region decoded, DCT-scaled as far as the region allows,
and resized once."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from cnnkit.data.decode import DCT_MARGIN, decode_data, image_shape, read_file
from cnnkit.data.resize import Interpolation, ResizeMode, resize_crop, resize_uint8


class ImageFile(NamedTuple):
    """A file's bytes, its name's suffix and its image's (H, W), read from its header."""

    data: bytes
    suffix: str
    shape: tuple[int, int]


def open_image(path: str | Path) -> ImageFile:
    """Read a file and the size of its image from the header (the pixels are not decoded);
    BadImage as decode_image would raise it."""
    path = Path(path)
    data, suffix = read_file(path), path.suffix.lower()
    shape = image_shape(data)
    if shape is None:  # no header that says: decoding says why (or finds the size after all)
        shape = decode_data(data, suffix=suffix).source
    return ImageFile(data, suffix, shape)


HEADER_BYTES = 1 << 16  # where an image's size is found (after a JPEG's EXIF, as a rule)


def file_shape(path: str | Path) -> tuple[int, int]:
    """An image file's (H, W) from its first bytes (the whole file where those do not say);
    BadImage as decode_image would raise it."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError:
        head = b""  # open_image says why
    shape = image_shape(head) if head else None
    return shape if shape is not None else open_image(path).shape


def region_factor(region: tuple[int, int, int, int], crop: int) -> int:
    """The DCT scaling (8, 4, 2 or 1) at which a JPEG's region (y0, x0, y1, x1) still has more
    than DCT_MARGIN times crop x crop pixels: resizing it to the crop never upsamples what a
    full decode would not, and its antialiased filter does the last halving (dct_factor)."""
    h, w = region[2] - region[0], region[3] - region[1]
    factor = 8  # a pixel to spare: the region's edges are rounded to the decoded pixels
    while factor >= 2 and (h // factor <= DCT_MARGIN * crop or w // factor <= DCT_MARGIN * crop):
        factor //= 2
    return max(factor, 1)


def load_region(image: ImageFile, region: tuple[int, int, int, int], crop: int, flip: bool,
                out: torch.Tensor | None = None,
                interpolation: Interpolation = "bilinear") -> torch.Tensor:  # fmt: skip
    """Region (y0, x0, y1, x1) of an image, in its own pixels, resized to crop x crop with
    `interpolation` (mirrored if flip): one decode, DCT-scaled as far as the region allows,
    one resize (torchvision's RandomResizedCrop of the photo). Returns a
    contiguous (3, crop, crop) uint8 tensor, `out` when given. Raises BadImage like
    read_image."""
    factor = region_factor(region, crop)
    array, _, factor, _ = decode_data(image.data, fast=True, suffix=image.suffix, factor=factor)
    y0, x0, y1, x1 = region
    if factor > 1:  # in decoded pixels: the nearest edges (under half a pixel of jitter)
        h, w = array.shape[:2]
        y0, x0 = min(round(y0 / factor), h - 1), min(round(x0 / factor), w - 1)
        y1 = min(max(round(y1 / factor), y0 + 1), h)
        x1 = min(max(round(x1 / factor), x0 + 1), w)
    region_pixels = torch.from_numpy(array[y0:y1, x0:x1]).permute(2, 0, 1)
    return resize_crop(region_pixels, crop, flip, out, interpolation)


def smaller_than(shape: tuple[int, int], size: int, mode: ResizeMode) -> bool:
    """Whether an (H, W) image is upsampled to size x size (squashed, or its centre square)."""
    h, w = shape
    return min(h, w) < size if mode == "shorter" else h < size or w < size


def load_square_box(image: ImageFile, box: tuple[int, int, int, int], size: int,
                    mode: ResizeMode, crop: int, flip: bool, out: torch.Tensor | None = None,
                    interpolation: Interpolation = "bilinear") -> torch.Tensor:  # fmt: skip
    """Box (top, left, h, w) of the image resized whole to size x size, decoded and resized as
    a pack does it, then resized to crop x crop (both with `interpolation`; mirrored if flip;
    into `out` when given). For images smaller than `size`: a region with edges rounded to
    their pixels (load_region) would move the crop by up to size / side output pixels, and
    draw fewer distinct crops; for bicubic resizes, the crop the device path cuts from the
    pack's or the square's bicubic pixels (a region resized once is bilinear's shortcut)."""
    array, _, factor, source = decode_data(image.data, size, mode, suffix=image.suffix)
    top, left, h, w = box
    square = resize_uint8(array, size, mode, factor, source, interpolation=interpolation)
    return resize_crop(square[:, top : top + h, left : left + w], crop, flip, out, interpolation)
