"""Images in for inference: find files (files, folders, globs), read paths / PIL images / arrays,
and repeat evaluation's preprocessing (resize, centre crop or 10 crops) on uint8 (C, H, W)."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from cnnkit.data.augment import center_crop, ten_crop
from cnnkit.data.base import Preprocess
from cnnkit.data.decode import BadImage, is_image_name, read_image, resize_uint8
from cnnkit.errors import DataError

ImageInput = str | Path | Image.Image | np.ndarray | torch.Tensor


def expand_paths(patterns: list[str]) -> list[Path]:
    """Files, folders (their image files, sorted, recursively) and globs -> a list of files.

    A name that matches nothing stays in the list, so that it is reported with the others.
    """
    found: list[Path] = []
    for pattern in patterns:
        path = Path(pattern)
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else []
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file() and is_image_name(p.name))
        elif matches:
            found += [Path(p) for p in matches if Path(p).is_file()]
        else:
            found.append(path)
    return found


def to_hwc(image: ImageInput, size: int | None = None, mode: str = "squash") -> np.ndarray:
    """Any accepted image as (H, W, C) uint8 with C in 1, 3 (raises DataError when unreadable).

    Arrays may be (H, W), (H, W, C) or (C, H, W) with C in 1, 3, 4; torch tensors are (C, H, W).
    Files decode as the data pipeline decodes them (`size`, `mode`: its DCT-scaled JPEG hint).
    """
    if isinstance(image, (str, Path)):
        try:
            return read_image(image, size, mode)[0]
        except BadImage as e:
            raise DataError(f"{image}: {e}") from None
    if isinstance(image, Image.Image):
        image = np.asarray(image.convert("L" if image.mode in ("1", "L", "I", "F") else "RGB"))
    array = image.cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if isinstance(image, torch.Tensor) and array.ndim == 3:
        array = array.transpose(1, 2, 0)
    if array.dtype != np.uint8:
        raise DataError(f"image arrays must be uint8 (0-255), got {array.dtype}")
    if array.ndim == 2:
        array = array[:, :, None]
    elif array.ndim == 3 and array.shape[0] in (1, 3, 4) and array.shape[2] not in (1, 3, 4):
        array = array.transpose(1, 2, 0)  # (C, H, W) -> (H, W, C)
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4):
        raise DataError(f"an image array must be (H, W), (H, W, C) or (C, H, W); got {array.shape}")
    return np.array(array[:, :, :3], order="C")  # a writable copy


def to_channels(array: np.ndarray, channels: int) -> np.ndarray:
    """(H, W, C) uint8 -> (H, W, channels): grey by ITU-R 601 luma (Pillow's 'L'), or RGB."""
    if array.shape[2] == channels:
        return array
    mode = "L" if channels == 1 else "RGB"
    source = array[:, :, 0] if array.shape[2] == 1 else array
    converted = np.array(Image.fromarray(source).convert(mode))
    return converted.reshape(*array.shape[:2], channels)


def resized(image: ImageInput, pre: Preprocess) -> torch.Tensor:
    """Evaluation's resize: to `pre.resize` (squash or shorter side), or to the crop size when
    the data was stored crop-sized. Returns uint8 (C, S, S)."""
    size = pre.resize or pre.crop
    mode = pre.resize_mode if pre.resize else "squash"
    array = to_channels(to_hwc(image, pre.resize, mode), pre.channels)
    return resize_uint8(array, size, mode)


def crops_of(image: ImageInput, pre: Preprocess, tencrop: bool) -> torch.Tensor:
    """uint8 (N, C, crop, crop): N = 1 (centre) or 10."""
    full = resized(image, pre)[None]  # (1, C, S, S)
    return ten_crop(full, pre.crop)[0] if tencrop else center_crop(full, pre.crop)


def image_name(image: Any, index: int) -> str:
    """How results name an input: its path, or `<image N>` for in-memory images."""
    return str(image) if isinstance(image, (str, Path)) else f"<image {index}>"
