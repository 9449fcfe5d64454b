"""Image decoding for packing, folder loading and inference: JPEG with DCT-domain downscaling
(resized by data/resize.py), and the bad-image policy: odd images are converted to 8-bit RGB with a note saying
how, broken or dangerous ones raise BadImage with the reason.

Every file read goes through `read_file` (regular files only: a FIFO or a device named *.jpg is
refused, never opened for reading) and every decode through `check_pixels` (one
decompression-bomb limit, MAX_PIXELS, on the size actually decoded: a JPEG's DCT-scaled size
when a target size is given, the full size otherwise).
"""

from __future__ import annotations

import glob
import io
import os
import re
import stat
import warnings
from itertools import islice
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from cnnkit.data.resize import Flipped, Interpolation, ResizeMode, centre_offset, resize_uint8
from cnnkit.data.tiff import libtiff_quiet, unopened_tiff

try:  # libjpeg-turbo with DCT scaling straight into numpy; Pillow's draft is the fallback
    import simplejpeg
except ImportError:  # pragma: no cover - depends on the environment
    simplejpeg = None

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
MAX_PIXELS = 120_000_000  # the decompression-bomb limit: no image decodes to more pixels
_JPEG_MAGIC = b"\xff\xd8\xff"
_TIFF_MAGIC = (b"II*\0", b"MM\0*")
_MODE_NAMES = {"L": "greyscale", "LA": "greyscale+alpha (alpha dropped)", "P": "palette",
               "1": "1-bit", "PA": "palette+alpha (alpha dropped)",
               "RGBA": "RGBA (alpha dropped)"}  # fmt: skip
_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))  # fmt: skip


class BadImage(Exception):
    """An image that cannot be used; the message is the reason written to the report."""


def file_kind(mode: int) -> str:
    """What a non-regular file is, for messages: 'a FIFO', 'a folder', ..."""
    return next((kind for test, kind in _FILE_KINDS if test(mode)), "an unusual file")


def read_file(path: str | Path) -> bytes:
    """The bytes of a regular file (symlinks followed); BadImage for anything else.

    Checked before opening and again on the open descriptor (opened non-blocking), so a FIFO
    or a device file named like an image is refused instead of hanging or reading forever.
    """
    try:
        kind = os.stat(path).st_mode
        if stat.S_ISREG(kind):
            fd = os.open(
                path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
            )
            with open(fd, "rb") as f:
                kind = os.fstat(fd).st_mode
                if stat.S_ISREG(kind):
                    return f.read()
    except FileNotFoundError:  # a name given to classify, or a glob that matched nothing
        if os.path.islink(path):
            raise BadImage("broken symlink") from None
        pattern = glob.has_magic(str(path))
        raise BadImage(
            "no file matches this pattern" if pattern else "no such file or folder"
        ) from None
    except OSError as e:
        raise BadImage(f"unreadable file ({e.strerror})") from None
    raise BadImage(f"not a regular file ({file_kind(kind)})")


def check_pixels(width: int, height: int) -> None:
    """BadImage unless an image of width x height pixels is within the decompression-bomb limit."""
    if width * height > MAX_PIXELS:
        raise BadImage(
            f"huge image ({width}x{height} = {width * height:,} pixels, over the limit of "
            f"{MAX_PIXELS:,})"
        )


def is_image_name(name: str) -> bool:
    """True for file names with an image extension (case-insensitive), hidden files excluded."""
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def holds_images(folder: Path | str, look: int = 200, depth: int = 1) -> bool:
    """Whether `folder` looks like an image folder: an image name among its first `look`
    entries or, `depth` levels down, those of its first subfolders (ImageFolder's class
    folders; 2: a data set's split folders too), a bounded look, never a walk of a million
    files."""
    try:
        with os.scandir(folder) as top:
            entries = list(islice(top, look))
        if any(is_image_name(e.name) for e in entries):
            return True
        subfolders = [e.path for e in entries if e.is_dir()][:8] if depth > 0 else []
    except OSError:
        return False
    return any(holds_images(sub, look, depth - 1) for sub in subfolders)


DCT_MARGIN = 2  # a DCT-scaled decode keeps twice the pixels a resize needs (see dct_factor)


def _scaled_minimum(h: int, w: int, size: int, mode: ResizeMode) -> tuple[int, int]:
    """Smallest (h, w) a decoder may return so that resizing to `size` never upsamples."""
    if mode == "squash":
        return min(h, size), min(w, size)
    side = max(min(h, w), size)  # never upsampled: the size itself when smaller
    return -(-h * size // side), -(-w * size // side)  # exact: ceil(h * size / side)


def dct_factor(h: int, w: int, size: int | None, mode: ResizeMode,
               flipped: Flipped = (False, False)) -> int:  # fmt: skip
    """How many source pixels one decoded pixel may cover: 2, 4 or 8 for DCT-domain downscaling,
    1 for a full decode.

    Only power-of-two factors: libjpeg-turbo's other n/8 scales have no SIMD IDCT and decode
    slower than the full image. The decoded image keeps DCT_MARGIN times the pixels needed, so
    the antialiased resize does the last halving (its filter, torchvision's): scaled all the
    way, the DCT's own filter was 1.5-2 levels off a full decode and resize on average, up to
    60 at sharp edges, against 0.4 (at most 8-12) with the margin, for 20-25% more decode time.
    A source less than 4 times the size needed is decoded whole.
    For the centre square the factor also divides the square's offset, so the square starts on
    a decoded pixel's edge (`flipped`: the square of the picture turned upright, centre_offset's).
    """
    if not size:
        return 1
    need_h, need_w = _scaled_minimum(h, w, size, mode)
    top, left = centre_offset(h, w, flipped) if mode == "shorter" else (0, 0)
    factor = 8
    while factor >= 2 and (h // factor < DCT_MARGIN * need_h or w // factor < DCT_MARGIN * need_w
                           or top % factor or left % factor):  # fmt: skip
        factor //= 2
    return max(factor, 1)


def _decode_turbo(data: bytes, size: int | None, mode: ResizeMode, fast: bool,
                  factor: int | None) -> Decoded | None:  # fmt: skip
    """Decode an RGB/grey JPEG with simplejpeg (DCT-scaled by `factor`, else as `size` allows),
    or None to let Pillow do it."""
    if simplejpeg is None:
        return None
    try:
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    if colorspace not in ("RGB", "YCbCr", "Gray"):  # CMYK/YCCK: Pillow knows Adobe's inversion
        return None
    factor = dct_factor(h, w, size, mode) if factor is None else factor
    min_h, min_w = -(-h // factor), -(-w // factor)  # what libjpeg returns at 1/factor
    check_pixels(min_w, min_h)  # the DCT-scaled size is what gets allocated
    note = "greyscale -> RGB" if colorspace == "Gray" else None  # as Pillow's path says
    args = {"colorspace": "RGB", "min_height": min_h, "min_width": min_w, "fastupsample": fast,
            "fastdct": fast}  # fmt: skip
    try:
        return Decoded(simplejpeg.decode_jpeg(data, **args), note, factor, (h, w))
    except ValueError as e:
        reason = _jpeg_reason(str(e))
    if reason == "truncated JPEG":  # libjpeg would fill the rest grey: refused, as Pillow does
        raise BadImage(reason)
    try:  # libjpeg's recoverable warnings (stray bytes before a marker): Pillow reads these too
        array = simplejpeg.decode_jpeg(data, strict=False, **args)
    except ValueError as e:
        raise BadImage(_jpeg_reason(str(e))) from None
    what = reason.removeprefix("corrupt JPEG (").removesuffix(")")
    note = "; ".join(filter(None, [note, f"decoded despite libjpeg's warning: {what}"]))
    return Decoded(array, note, factor, (h, w))


def _jpeg_reason(message: str) -> str:
    low = message.lower()
    if "premature end" in low or "truncated" in low:
        return "truncated JPEG"
    return f"corrupt JPEG ({message.strip()})"


def _decode_pillow(data: bytes, size: int | None, mode: ResizeMode, suffix: str,
                   factor: int | None) -> Decoded:  # fmt: skip
    """Decode anything Pillow reads (a JPEG DCT-scaled as _decode_turbo does)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
            notes = []
            if im.format == "PNG" and suffix in (".jpg", ".jpeg"):
                notes.append("PNG data in a .JPEG file")
            source = (im.height, im.width)
            if factor is None:
                factor = dct_factor(im.height, im.width, size, mode)
            if im.format != "JPEG":
                factor = 1
            elif factor > 1:
                drafted = im.draft("RGB", (im.width // factor, im.height // factor))
                factor = round(source[1] / drafted[1][2]) if drafted else 1  # (0, 0, W/f, H/f)
            check_pixels(im.width, im.height)  # after draft: the size that will be decoded
            sixteen = has_16_bit_samples(im)
            with libtiff_quiet(im.format == "TIFF"):
                im.load()
    except Image.DecompressionBombError as e:  # Pillow's own limit, at twice its warning
        found = re.search(r"\((\d+) pixels\)", str(e))
        count = f"{int(found[1]):,}" if found else "too many"
        raise BadImage(f"huge image ({count} pixels, over the limit of {MAX_PIXELS:,})") from None
    except UnidentifiedImageError:
        if data.startswith(_TIFF_MAGIC):
            raise BadImage(unopened_tiff(data)) from None
        raise BadImage("not an image (unrecognised format)") from None
    except (OSError, SyntaxError, ValueError) as e:
        damaged = "damaged TIFF" if data.startswith(_TIFF_MAGIC) else "unreadable image"
        reason = "truncated image" if "truncated" in str(e).lower() else f"{damaged} ({e})"
        raise BadImage(reason) from None
    im, what = to_8bit(im, sixteen)
    if what is None and sixteen and im.mode in ("RGB", "RGBA"):
        what = f"16-bit {im.mode} (top 8 bits)"  # Pillow keeps the high byte: right scaling
    if what is not None:
        notes.append(f"{what} -> 8-bit RGB")
    elif im.mode != "RGB":
        notes.append(f"{_MODE_NAMES.get(im.mode, im.mode)} -> RGB")
    if im.mode != "RGB":
        im = im.convert("RGB")
    array = np.array(im)  # writable: torch.from_numpy takes it
    return Decoded(array, "; ".join(notes) or None, factor, source)


def has_16_bit_samples(im: Image.Image) -> bool:
    """True when Pillow will read 16-bit samples (its raw mode, e.g. 'RGB;16B'); known only
    before the image is loaded."""
    for tile in getattr(im, "tile", ()):  # an image made in memory has none
        args = tile[3]
        raw = args if isinstance(args, str) else (args[0] if args else "")
        if isinstance(raw, str) and ";16" in raw:
            return True
    return False


def to_8bit(im: Image.Image, sixteen: bool = False) -> tuple[Image.Image, str | None]:
    """A deep greyscale image (16-bit, 32-bit integer, float) as 8-bit 'L', and what it was;
    other images are returned as they are, with None. `sixteen`: its file holds 16-bit samples
    (a 16-bit PGM opens in Pillow's 32-bit mode 'I').

    The rule: 16-bit keeps its top 8 bits (x >> 8, so 65535 -> 255); 32-bit integers are
    clipped to 0..255, as Pillow's convert('L') and convert('RGB') read them (what a
    torchvision user gets); floats in [0, 1] become round(255 x). Any other range (negative
    16-bit, floats outside [0, 1], NaN) raises BadImage: no scaling of it would be right for
    every image.
    """
    if im.mode.startswith("I;16") and im.mode != "I;16S":
        return _grey(np.asarray(im).astype(np.uint16) >> 8), "16-bit grey (top 8 bits)"
    if im.mode == "I" and not sixteen:
        return im.convert("L"), "32-bit integer grey (clipped to 0..255, as Pillow reads it)"
    if im.mode not in ("I", "F", "I;16S"):
        return im, None
    values = np.asarray(im)
    if not np.isfinite(values).all():
        raise BadImage("float image with NaN or infinite values: no 8-bit scaling is right")
    low, high = (values.min(), values.max()) if values.size else (0, 0)
    if im.mode == "F":
        if low < 0 or high > 1:
            raise BadImage(f"float image with values outside [0, 1] (min {low:.4g}, max "
                           f"{high:.4g}): no 8-bit scaling is right for it")  # fmt: skip
        return _grey(np.rint(values * 255.0)), "float grey in [0, 1] (x 255)"
    if low < 0 or high > 65535:
        raise BadImage(f"integer image with values outside 0..65535 (min {low}, max {high}): "
                       "no 8-bit scaling is right for it")  # fmt: skip
    return _grey(values.astype(np.uint16) >> 8), "16-bit grey (top 8 bits)"


def _grey(values: np.ndarray) -> Image.Image:
    return Image.fromarray(values.astype(np.uint8), "L")


class Decoded(NamedTuple):
    """A decoded image: (h, w, 3) uint8 RGB, the conversion note (greyscale, CMYK, PNG data...)
    or None, and how it maps onto the source: a JPEG downscaled in the DCT domain by `factor`
    has ceil(H / factor) x ceil(W / factor) pixels, the last row and column covering only part
    of a block (its true extent is H / factor x W / factor)."""

    array: np.ndarray
    note: str | None
    factor: int
    source: tuple[int, int]  # the source's (H, W)


def decode_image(
    path: str | Path, size: int | None = None, mode: ResizeMode = "squash", fast: bool = False
) -> Decoded:
    """Decode a file to uint8 RGB, at least `size` after resizing (DCT-scaled JPEGs).

    fast: libjpeg-turbo's fast chroma upsampling and fast IDCT (10% faster; values within
    about a level of the exact decode's on average: for training crops, not for packing).
    Raises BadImage with the reason when the file cannot be used.
    """
    path = Path(path)
    return decode_data(read_file(path), size, mode, fast, path.suffix.lower())


def decode_data(data: bytes, size: int | None = None, mode: ResizeMode = "squash",
                fast: bool = False, suffix: str = "", factor: int | None = None) -> Decoded:  # fmt: skip
    """decode_image of a file's bytes (`suffix`: its name's, for notes); `factor`: the DCT
    scaling to decode a JPEG at, instead of the one `size` allows."""
    if not data:
        raise BadImage("empty file")
    if data.startswith(_JPEG_MAGIC):
        decoded = _decode_turbo(data, size, mode, fast, factor)
        if decoded is not None:
            return decoded
    return _decode_pillow(data, size, mode, suffix, factor)


def image_shape(data: bytes) -> tuple[int, int] | None:
    """(H, W) from an image's header, None where it cannot be read."""
    if data.startswith(_JPEG_MAGIC) and simplejpeg is not None:
        try:
            h, w, _, _ = simplejpeg.decode_jpeg_header(data)
            return h, w
        except ValueError:
            pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                return im.height, im.width
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return None  # (UnidentifiedImageError is an OSError)


def read_image(
    path: str | Path, size: int | None = None, mode: ResizeMode = "squash", fast: bool = False
) -> tuple[np.ndarray, str | None]:
    """decode_image's (H, W, 3) uint8 RGB array and note."""
    return decode_image(path, size, mode, fast)[:2]


def device_jpeg(path: str | Path) -> bytes | None:
    """The bytes of a JPEG that batched device decoders take (RGB, YCbCr or grey), None for
    any other image (decode it on the CPU instead); BadImage if the file cannot be read."""
    data = read_file(path)
    if not data:
        raise BadImage("empty file")
    if not data.startswith(_JPEG_MAGIC) or simplejpeg is None:
        return None
    if not data.rstrip(b"\0").endswith(b"\xff\xd9"):  # no end marker: truncated, say so on the CPU
        return None
    try:
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None  # let the CPU path say what is wrong with it
    if h * w > MAX_PIXELS:  # device decoders decode whole images: the CPU DCT-scales this one
        return None
    return data if colorspace in ("RGB", "YCbCr", "Gray") else None


def decode_jpeg_bytes(data: bytes | memoryview, size: int | None = None) -> np.ndarray:
    """Decode JPEG bytes (a packed shard's record) to (H, W, 3) uint8 RGB; BadImage where its
    header claims more pixels than MAX_PIXELS (a damaged record: nothing is allocated)."""
    if simplejpeg is None:  # (Pillow's path says what else is wrong as BadImage too)
        return _decode_pillow(bytes(data), size, "squash", ".jpg", None).array
    h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    check_pixels(w, h)
    return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=size or 0, min_width=size or 0)


def encode_jpeg(image_chw: np.ndarray, quality: int) -> bytes:
    """Encode a (3, H, W) uint8 image as JPEG bytes, chroma at full resolution (4:4:4): no
    colour lost to subsampling, and nvJPEG decodes it as libjpeg-turbo does."""
    hwc = np.ascontiguousarray(image_chw.transpose(1, 2, 0))
    if simplejpeg is not None:
        return simplejpeg.encode_jpeg(
            hwc, quality=quality, colorspace="RGB", colorsubsampling="444"
        )
    out = io.BytesIO()
    Image.fromarray(hwc).save(out, "JPEG", quality=quality, subsampling=0)
    return out.getvalue()


class Resized(NamedTuple):
    """An image resized to size x size: (3, size, size) uint8, the conversion note (Decoded's)
    and the source's (H, W)."""

    image: torch.Tensor
    note: str | None
    source: tuple[int, int]


def load_resized(path: str | Path, size: int, mode: ResizeMode = "squash", fast: bool = False,
                 interpolation: Interpolation = "bilinear") -> Resized:  # fmt: skip
    """decode_image + resize_uint8."""
    array, note, factor, source = decode_image(path, size, mode, fast)
    resized = resize_uint8(array, size, mode, factor, source, interpolation=interpolation)
    return Resized(resized, note, source)
