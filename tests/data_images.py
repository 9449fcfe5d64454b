"""Builders of small image folders for the data tests (good, odd and broken files)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image


def photo(h: int = 30, w: int = 40, seed: int = 0) -> np.ndarray:
    """A smooth random RGB image (JPEG-friendly), (h, w, 3) uint8."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (3, 4, 3), dtype=np.uint8)
    return np.array(Image.fromarray(coarse).resize((w, h), Image.BILINEAR))


def jpeg_bytes(array: np.ndarray, mode: str = "RGB", quality: int = 95) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).convert(mode).save(out, "JPEG", quality=quality)
    return out.getvalue()


def write_bad_folder(root: Path) -> dict[str, str]:
    """Class folders with good images and one of each odd/broken kind.

    Returns {relative path: expected status} for the odd and bad files: "converted" or "skipped".
    """
    good, odd = root / "good", root / "odd"
    good.mkdir(parents=True), odd.mkdir(parents=True)
    for i in range(4):
        (good / f"g{i}.JPEG").write_bytes(jpeg_bytes(photo(seed=i)))
        (odd / f"o{i}.JPEG").write_bytes(jpeg_bytes(photo(seed=10 + i)))
    full = jpeg_bytes(photo(seed=20))
    (odd / "empty.JPEG").write_bytes(b"")
    (odd / "truncated.JPEG").write_bytes(full[: len(full) // 2])
    (odd / "text.JPEG").write_text("this is not an image\n")
    (odd / "grey.JPEG").write_bytes(jpeg_bytes(photo(seed=21), "L"))
    (odd / "cmyk.JPEG").write_bytes(jpeg_bytes(photo(seed=22), "CMYK"))
    png = io.BytesIO()
    Image.fromarray(photo(seed=23)).save(png, "PNG")
    (good / "png_inside.JPEG").write_bytes(png.getvalue())
    return {
        "odd/empty.JPEG": "skipped",
        "odd/truncated.JPEG": "skipped",
        "odd/text.JPEG": "skipped",
        "odd/grey.JPEG": "converted",
        "odd/cmyk.JPEG": "converted",
        "good/png_inside.JPEG": "converted",
    }
