"""Images in for inference: find files (files, folders, globs), read paths / PIL images / arrays,
and repeat evaluation's preprocessing (resize, centre crop or 10 crops) on uint8 (C, H, W).
Files are read and checked as the data pipeline reads them (data/decode.py: regular files only,
the one pixel limit, deep images scaled to 8 bits)."""

from __future__ import annotations

import glob
import io
import os
import stat
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from cnnkit.data import decode
from cnnkit.data.augment import center_crop, ten_crop
from cnnkit.data.base import Preprocess
from cnnkit.data.decode import (
    BadImage,
    Decoded,
    check_pixels,
    dct_factor,
    decode_data,
    has_16_bit_samples,
    image_shape,
    is_image_name,
    read_file,
    to_8bit,
)
from cnnkit.data.resize import Interpolation, resize_uint8
from cnnkit.data.scan import Walker, printable, skip_reason
from cnnkit.errors import DataError
from cnnkit.runtime import atomic

ImageInput = str | Path | Image.Image | np.ndarray | torch.Tensor
DRAWN_BY = "cnnkit"  # the Software / Creator field of the pictures cnnkit draws
EXIF_SOFTWARE = 0x0131  # EXIF's Software tag


@dataclass
class FoundImages:
    """The image files to read, what was passed over (path, reason), and the folders given
    that held no image at all."""

    files: list[Path] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)


def find_images(patterns: list[str]) -> FoundImages:
    """Files, folders (their image files, recursively) and globs -> the files to classify.

    Folders are scanned as pack scans them (regular image files only, each real file once,
    links followed but not in loops; the rest is listed in `skipped`). A file named explicitly
    is read whatever its name, and a name that exists is taken literally, not as a glob
    (`photo [1].png` is that file, never `photo 1.png`); a name that matches nothing stays in
    the list, so that it is reported with the others.
    """
    found, taken = FoundImages(), {}
    for pattern in patterns:
        is_glob = glob.has_magic(pattern) and not os.path.lexists(pattern)
        matches = sorted(glob.glob(pattern, recursive=True)) if is_glob else []
        for name in matches or [pattern]:
            path = Path(name)
            if path.is_dir():
                _add_folder(found, path, taken)
            elif matches and not is_image_name(path.name):
                found.skipped.append((name, _passed_over(skip_reason(path.name))))
            else:
                _add_file(found, path, taken)
    return found


def _add_folder(found: FoundImages, folder: Path, taken: dict) -> None:
    walker = Walker(folder, taken)
    walker.claim_folder(folder)
    (images,) = walker.found([""])
    files = walker.take([images])[0]
    kept = set(files)  # named by their whole path where a later folder holds them again
    taken.update({key: str(folder / path) for path, key, _ in images if path in kept})
    found.files += [folder / f for f in files]
    found.skipped += [(str(folder / f), _passed_over(reason)) for f, reason in walker.skipped]
    if not images:  # (one whose images were all given before is no failure: they were read)
        found.empty.append(str(folder))


def _passed_over(reason: str) -> str:
    """A folder's or pattern's file passed over by its name, said with the way to read it: a
    file named itself is read by its data (a GIF too), as in find_images."""
    if reason.startswith("not a supported image type"):
        return f"{reason}, passed over in a folder or pattern: name the file itself to read it"
    return reason


def _add_file(found: FoundImages, path: Path, taken: dict) -> None:
    try:
        st = os.stat(path)
    except OSError:
        st = None  # missing or unreadable: reading it says why
    key = (st.st_dev, st.st_ino) if st is not None and stat.S_ISREG(st.st_mode) else None
    if key is not None and key in taken:
        found.skipped.append((str(path), f"the same file as {printable(taken[key])}"))
        return
    if key is not None:
        taken[key] = str(path)
    found.files.append(path)


def check_preprocess(pre: Preprocess) -> None:
    """DataError when evaluation's resize would make images over the pixel limit (a 60000 px
    resize would allocate gigabytes per image)."""
    side = pre.resize or pre.crop
    try:
        check_pixels(side, side)
    except BadImage:
        raise DataError(f"preprocess.resize {side}: {side}x{side} images are over the limit "
                        f"of {decode.MAX_PIXELS:,} pixels") from None  # fmt: skip


# EXIF orientation -> the turn that shows the picture upright, as PIL's exif_transpose does
UPRIGHT = {
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.swapaxes(0, 1),
    6: lambda a: np.rot90(a, -1),
    7: lambda a: np.rot90(a, 2).swapaxes(0, 1),
    8: lambda a: np.rot90(a, 1),
}
# EXIF orientation -> which of the stored (rows, columns) that turn reverses
REVERSED = {2: (False, True), 3: (True, True), 4: (True, False), 6: (True, False),
            7: (True, True), 8: (False, True)}  # fmt: skip


def decode_file(path: str | Path, size: int | None = None, mode: str = "squash") -> Decoded:
    """A file decoded as the data pipeline decodes it (`size`, `mode`: its DCT-scaled JPEG
    hint), turned upright by its EXIF orientation (a phone's photo: what a viewer shows, and
    where detect's boxes land); DataError when it cannot be."""
    decoded, orientation = _decode_stored(path, size, mode)
    turn = UPRIGHT.get(orientation)
    if turn is None:
        return decoded
    array = np.ascontiguousarray(turn(decoded.array))
    source = decoded.source[::-1] if array.shape[:2] != decoded.array.shape[:2] else decoded.source
    return Decoded(array, decoded.note, decoded.factor, tuple(source))


def _decode_stored(path: str | Path, size: int | None, mode: str) -> tuple[Decoded, int]:
    """A file decoded as stored, and its EXIF orientation; a JPEG is DCT-scaled so that the
    centre square of the picture turned upright starts on a decoded pixel's edge."""
    try:
        data = read_file(path)
        orientation = _orientation(data)
        flipped = REVERSED.get(orientation, (False, False))
        shape = image_shape(data) if size and any(flipped) else None
        factor = dct_factor(*shape, size, mode, flipped) if shape else None
        suffix = Path(path).suffix.lower()
        return decode_data(data, size, mode, suffix=suffix, factor=factor), orientation
    except BadImage as e:
        raise DataError(f"{path}: {e}") from None


_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _orientation(data: bytes) -> int:
    """The EXIF orientation tag (1: upright), read from the header alone (a PNG's eXIf chunk
    found by its chunks' lengths: Pillow's getexif decodes the whole PNG to look after it)."""
    try:
        chunk = _png_exif(data) if data.startswith(_PNG_MAGIC) else None
        if chunk:
            return int(_exif_of(chunk).get(0x0112, 1))
        with warnings.catch_warnings():  # a big image's DecompressionBombWarning: the decode
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # checks its size
            with Image.open(io.BytesIO(data)) as image:  # (a PNG's text chunks, read on open:
                return int(Image.Image.getexif(image).get(0x0112, 1))  # ImageMagick's, XMP)
    except Exception:  # noqa: BLE001 - no EXIF, or none PIL can read: as stored
        return 1


def _png_exif(data: bytes) -> bytes | None:
    """A PNG's eXIf chunk (before its image data or after it), None where it has none."""
    at = len(_PNG_MAGIC)
    while at + 8 <= len(data):
        length, kind = int.from_bytes(data[at : at + 4], "big"), data[at + 4 : at + 8]
        if kind == b"eXIf":
            return data[at + 8 : at + 8 + length]
        if kind == b"IEND":
            return None
        at += 12 + length  # length, type, data, CRC
    return None


def _exif_of(chunk: bytes) -> Image.Exif:
    exif = Image.Exif()
    exif.load(chunk if chunk.startswith(b"Exif\x00\x00") else b"Exif\x00\x00" + chunk)
    return exif


def _resized_file(path: str | Path, size: int, mode: str,
                  interpolation: Interpolation = "bilinear") -> torch.Tensor:  # fmt: skip
    """A file resized as a folder's images are, then turned upright: (3, size, size) uint8.
    Turned before, a DCT-scaled decode's partial last row or column would come first, where
    the resize does not look for it (the picture shifted by part of a pixel, an edge smeared)."""
    (array, _, factor, source), orientation = _decode_stored(path, size, mode)
    flipped = REVERSED.get(orientation, (False, False))
    x = resize_uint8(array, size, mode, factor, source, flipped, interpolation)
    turn = UPRIGHT.get(orientation)
    if turn is None:
        return x
    return torch.from_numpy(np.ascontiguousarray(turn(x.permute(1, 2, 0).numpy()))).permute(2, 0, 1)


def to_hwc(image: ImageInput, size: int | None = None, mode: str = "squash") -> np.ndarray:
    """Any accepted image as (H, W, C) uint8 with C in 1, 3 (raises DataError when unreadable).

    Arrays and tensors may be (H, W), (H, W, C) or (C, H, W) with C in 1, 3, 4 (a tensor whose
    first and last sides could both be channels is torch's (C, H, W), an array numpy's
    (H, W, C)). Files decode as the data pipeline decodes them (`size`, `mode`: its DCT-scaled
    JPEG hint) and are turned upright by their EXIF orientation; a PIL image is taken as given.
    """
    if isinstance(image, (str, Path)):
        return decode_file(image, size, mode).array
    if isinstance(image, Image.Image):
        image = _pil_array(image)
    tensor = isinstance(image, torch.Tensor)
    array = image.detach().cpu().numpy() if tensor else np.asarray(image)
    if array.dtype != np.uint8:
        scaled = " (0-1 floats: (x * 255).round() as uint8)" if array.dtype.kind == "f" else ""
        raise DataError(f"image arrays must be uint8 (0-255), got {array.dtype}{scaled}")
    if array.ndim == 2:
        array = array[:, :, None]
    elif array.ndim == 3 and array.shape[0] in (1, 3, 4) and (
        tensor or array.shape[2] not in (1, 3, 4)):  # fmt: skip
        array = array.transpose(1, 2, 0)  # (C, H, W) -> (H, W, C)
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4):
        batch = " (a batch: give list(batch))" if array.ndim == 4 else ""
        raise DataError(f"an image array must be (H, W), (H, W, C) or (C, H, W); got "
                        f"{tuple(image.shape) if tensor else array.shape}{batch}")  # fmt: skip
    if 0 in array.shape[:2]:
        raise DataError(f"an empty image ({array.shape[0]} x {array.shape[1]} pixels)")
    return np.array(array[:, :, :3], order="C")  # a writable copy


def _pil_array(image: Image.Image) -> np.ndarray:
    """A PIL image as uint8 (H, W) grey or (H, W, 3) RGB, deep greys scaled as files are."""
    try:
        check_pixels(image.width, image.height)
        image = to_8bit(image, has_16_bit_samples(image))[0]
        return np.asarray(image.convert("L" if image.mode in ("1", "L") else "RGB"))
    except BadImage as e:
        raise DataError(str(e)) from None
    except (OSError, SyntaxError, ValueError) as e:
        raise DataError(f"unreadable image ({e})") from None


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
    the data was stored crop-sized, then to the network's channels (a colour image made grey
    after resizing, as evaluation makes a folder's). Returns uint8 (C, S, S)."""
    check_preprocess(pre)
    size = pre.resize or pre.crop
    mode = pre.resize_mode if pre.resize else "squash"
    if isinstance(image, (str, Path)):
        x = _resized_file(image, size, mode, pre.interpolation)
    else:
        x = resize_uint8(to_hwc(image), size, mode, interpolation=pre.interpolation)
    if x.shape[0] == pre.channels:
        return x
    hwc = np.ascontiguousarray(x.permute(1, 2, 0).numpy())
    return torch.from_numpy(to_channels(hwc, pre.channels)).permute(2, 0, 1)


def crops_of(image: ImageInput, pre: Preprocess, tencrop: bool) -> torch.Tensor:
    """uint8 (N, C, crop, crop): N = 1 (centre) or 10."""
    full = resized(image, pre)[None]  # (1, C, S, S)
    return ten_crop(full, pre.crop)[0] if tencrop else center_crop(full, pre.crop)


def image_name(image: Any, index: int) -> str:
    """How results name an input: its path, or `<image N>` for in-memory images."""
    return str(image) if isinstance(image, (str, Path)) else f"<image {index}>"


def save_picture(picture: Image.Image, path: Path) -> None:
    """A PIL image to `path` in the format its suffix names, written whole or not at all, and
    marked as cnnkit's (drawn_by_cnnkit) where the format has a field for it."""
    kind = Image.registered_extensions().get(Path(path).suffix.lower())
    marked: dict[str, Any] = {}
    if kind == "PNG":
        from PIL.PngImagePlugin import PngInfo

        marked["pnginfo"] = PngInfo()
        marked["pnginfo"].add_text("Software", DRAWN_BY)
    elif kind in ("JPEG", "WEBP", "TIFF"):
        exif = Image.Exif()
        exif[EXIF_SOFTWARE] = DRAWN_BY
        marked["exif"] = exif.tobytes()
    with atomic(Path(path), private=True) as f:
        picture.save(f, format=kind, **marked)


def figure_metadata(fmt: str) -> dict[str, str]:
    """matplotlib's savefig metadata that marks a figure as cnnkit's (drawn_by_cnnkit)."""
    return {"Software" if fmt == "png" else "Creator": DRAWN_BY}


def drawn_by_cnnkit(path: Path) -> bool:
    """Whether `path` holds a picture cnnkit drew (its Software or Creator field says so): the
    only file a drawing's -o replaces. A photograph or a drawing of the user's is never ours,
    nor is a format without such a field (BMP)."""
    try:
        if path.suffix.lower() in (".svg", ".pdf"):
            if path.stat().st_size > 64 << 20:  # larger than any network drawing
                return False
            mark = b"<dc:title>%s</dc:title>" if path.suffix.lower() == ".svg" else b"/Creator (%s)"
            return mark % DRAWN_BY.encode() in path.read_bytes()
        with warnings.catch_warnings(), Image.open(path) as im:  # the header: no pixels decoded
            warnings.simplefilter("ignore")  # (a decompression-bomb warning: not ours either way)
            return DRAWN_BY in (im.info.get("Software"), im.getexif().get(EXIF_SOFTWARE))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return False
