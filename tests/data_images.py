"""Builders of small image folders for the data tests (good, odd and broken files), and a
pack read back whole."""

from __future__ import annotations

import io
import os
import signal
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from cnnkit.data.batch import BatchJob
from cnnkit.data.packed import PackedImages


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


def png_bytes(array: np.ndarray, bits: int = 16, colour: int | None = None,
              size: tuple[int, int] | None = None) -> bytes:  # fmt: skip
    """A PNG written by hand (Pillow cannot write 16-bit colour): grey (H, W) or (H, W, C).

    colour: PNG colour type (0 grey, 2 RGB, 4 grey+alpha, 6 RGBA; from C by default); size:
    (width, height) to declare in the header instead of the array's (a decompression bomb).
    """
    h, w = array.shape[:2]
    channels = 1 if array.ndim == 2 else array.shape[2]
    colour = {1: 0, 2: 4, 3: 2, 4: 6}[channels] if colour is None else colour
    dtype = ">u2" if bits == 16 else np.uint8
    raw = b"".join(b"\0" + array[y].astype(dtype).tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    width, height = size or (w, h)
    header = struct.pack(">IIBBBBB", width, height, bits, colour, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))  # fmt: skip


def jpeg_declaring(width: int, height: int) -> bytes:
    """A small JPEG whose frame header declares width x height (a decompression bomb: decoding
    it whole would allocate width * height * 3 bytes)."""
    data = bytearray(jpeg_bytes(photo(16, 16)))
    sof = data.index(b"\xff\xc0")  # baseline frame: length (2), precision (1), height, width
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def _tiff(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, "TIFF")
    return out.getvalue()


def _png(image: Image.Image, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG", **options)
    return out.getvalue()


@dataclass
class Odd:
    """One corpus entry. status: what pack reports ("good": packed with no note, "converted",
    "skipped": decoding refused it, "scan": the folder scan passed over it); expect: the RGB
    pixels it must decode to, or words of the reason; named: when given as a file by name,
    None if it must decode, else words of the one error line it must give."""

    rel: str
    status: str
    expect: np.ndarray | str
    named: str | None = None
    note: str | None = None  # what the report says of a converted image


UNICODE_NAMES = ["caf\u00e9.jpg", "cafe\u0301-nfd.jpg", "\u65e5\u672c\u8a9e.jpg",
                 "\U0001f408 cat.jpg", "with space.jpg", "-leading-dash.jpg",
                 "new\nline.jpg", "tab\there.jpg", "\u05e9\u05dc\u05d5\u05dd.png"]  # fmt: skip
UNDECODABLE_NAME = b"latin1-\xe9.jpg"  # not UTF-8: Python sees a surrogate escape


def _deep(rng: np.random.Generator) -> list[tuple[str, bytes, np.ndarray, str]]:
    """Deep and odd-mode images Pillow opens in modes other than RGB, with the pixels they
    must decode to (numpy's reading of the rule in decode.to_8bit) and the report's note."""
    grey16 = rng.integers(0, 65536, (12, 10)).astype(np.uint16)
    rgb16 = rng.integers(0, 65536, (12, 10, 3)).astype(np.uint16)
    rgba16 = rng.integers(0, 65536, (12, 10, 4)).astype(np.uint16)
    la16 = rng.integers(0, 65536, (12, 10, 2)).astype(np.uint16)
    unit = rng.random((12, 10)).astype(np.float32)
    ints = rng.integers(0, 65536, (12, 10)).astype(np.int32) % 512  # half above 255
    negative = np.arange(-60, 60, dtype=np.int32).reshape(12, 10)
    clipped = "32-bit integer grey (clipped to 0..255, as Pillow reads it)"
    grey = lambda a: np.repeat(a[..., None], 3, 2).astype(np.uint8)  # noqa: E731
    pgm = b"P5\n10 12\n65535\n" + grey16.astype(">u2").tobytes()
    return [
        ("grey16.png", png_bytes(grey16), grey(grey16 >> 8), "16-bit grey (top 8 bits) -> 8-bit RGB"),
        ("grey16.tif", _tiff(grey16), grey(grey16 >> 8), "16-bit grey (top 8 bits) -> 8-bit RGB"),
        ("grey16.pgm", pgm, grey(grey16 >> 8), "16-bit grey (top 8 bits) -> 8-bit RGB"),
        ("rgb16.png", png_bytes(rgb16), (rgb16 >> 8).astype(np.uint8), "16-bit RGB (top 8 bits) -> 8-bit RGB"),
        ("rgba16.png", png_bytes(rgba16), (rgba16[..., :3] >> 8).astype(np.uint8), "16-bit RGBA (top 8 bits) -> 8-bit RGB"),
        ("la16.png", png_bytes(la16), grey(la16[..., 0] >> 8), "16-bit RGBA (top 8 bits) -> 8-bit RGB"),
        ("float01.tif", _tiff(unit), grey(np.rint(unit * 255)), "float grey in [0, 1] (x 255) -> 8-bit RGB"),
        ("int32.tif", _tiff(ints), grey(np.clip(ints, 0, 255)), f"{clipped} -> 8-bit RGB"),
        ("int-negative.tif", _tiff(negative), grey(np.clip(negative, 0, 255)), f"{clipped} -> 8-bit RGB"),
    ]  # fmt: skip


def _modes(rng: np.random.Generator) -> list[tuple[str, bytes, np.ndarray, str]]:
    """8-bit images in modes other than RGB, with numpy's expected RGB and the note."""
    bits = rng.random((12, 10)) > 0.5
    index = rng.integers(0, 16, (12, 10)).astype(np.uint8)
    palette = rng.integers(0, 256, (16, 3)).astype(np.uint8)
    p_image = Image.fromarray(index, "P")
    p_image.putpalette(palette.ravel().tolist())
    la = rng.integers(0, 256, (12, 10, 2)).astype(np.uint8)
    rgba = rng.integers(0, 256, (12, 10, 4)).astype(np.uint8)
    cmyk = rng.integers(0, 256, (12, 10, 4)).astype(np.uint8)
    # Pillow's (and the usual) naive CMYK -> RGB: (255 - C) * (255 - K) / 255
    naive = (255 - cmyk[..., :3].astype(int)) * (255 - cmyk[..., 3:].astype(int)) / 255
    grey = lambda a: np.repeat(a[..., None], 3, 2).astype(np.uint8)  # noqa: E731
    return [
        ("bilevel.png", _png(Image.fromarray(bits)), grey(bits * 255), "1-bit -> RGB"),
        ("palette.png", _png(p_image), palette[index], "palette -> RGB"),
        ("palette-alpha.png", _png(p_image, transparency=3), palette[index], "palette -> RGB"),
        ("grey-alpha.png", _png(Image.fromarray(la, "LA")), grey(la[..., 0]), "greyscale+alpha (alpha dropped) -> RGB"),
        ("rgba.png", _png(Image.fromarray(rgba, "RGBA")), rgba[..., :3], "RGBA (alpha dropped) -> RGB"),
        ("cmyk.tif", _tiff_mode(cmyk, "CMYK"), np.rint(naive).astype(np.uint8), "CMYK -> RGB"),
    ]  # fmt: skip


def _tiff_mode(array: np.ndarray, mode: str) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array, mode).save(out, "TIFF")
    return out.getvalue()


def _refused() -> list[tuple[str, bytes, str]]:
    """Images decoding must refuse, with words of the reason."""
    wide = np.arange(120, dtype=np.float32).reshape(12, 10) * 3.0  # 0..357: which scale?
    nan = np.full((12, 10), np.nan, np.float32)
    full = jpeg_bytes(photo(seed=20))
    png = io.BytesIO()
    Image.fromarray(photo(seed=23)).save(png, "PNG")
    return [
        ("float-wide.tif", _tiff(wide), "outside [0, 1]"),
        ("float-nan.tif", _tiff(nan), "NaN"),
        ("bomb.jpg", jpeg_declaring(60000, 60000), "huge image ("),
        ("bomb.png", png_bytes(np.zeros((4, 4), np.uint8), 8, size=(30000, 30000)), "huge image ("),
        ("bomb-pillow.png", png_bytes(np.zeros((4, 4), np.uint8), 8, size=(20000, 10000)), "huge image ("),
        ("empty.jpg", b"", "empty file"),
        ("truncated.jpg", full[: len(full) // 2], "truncated"),
        ("text.jpg", b"this is not an image\n", "not an image"),
        ("broken-png.png", png.getvalue()[:60], "image"),
    ]  # fmt: skip


def write_corpus(root: Path) -> list[Odd]:
    """Class folders good/ and odd/ holding good images under odd names beside at least 25 odd
    entries: deep images, odd modes, refused images, bombs, a FIFO, a device, broken and
    duplicate links, a link loop, a GIF, text, hidden files. Returns every entry's expectation."""
    rng = np.random.default_rng(15)
    good, odd = root / "good", root / "odd"
    good.mkdir(parents=True), odd.mkdir(parents=True)
    cases = []
    undecodable = os.fsdecode(UNDECODABLE_NAME)
    for k, name in enumerate(["plain.jpg", *UNICODE_NAMES, undecodable]):
        image = photo(seed=100 + k)
        data = _png(Image.fromarray(image)) if name.endswith(".png") else jpeg_bytes(image)
        (good / name).write_bytes(data)
        expect = np.array(Image.open(io.BytesIO(data)).convert("RGB"))
        cases.append(Odd(f"good/{name}", "good", expect))
    for name, data, expect, note in _deep(rng) + _modes(rng):
        (odd / name).write_bytes(data)
        cases.append(Odd(f"odd/{name}", "converted", expect, note=note))
    for name, data, reason in _refused():
        (odd / name).write_bytes(data)
        cases.append(Odd(f"odd/{name}", "skipped", reason, named=reason))
    cases += _special_files(odd)
    return cases


def _special_files(odd: Path) -> list[Odd]:
    """Entries a folder scan passes over: FIFO, device, links, loop, GIF, text, hidden."""
    gif = io.BytesIO()
    Image.fromarray(photo(seed=7)).convert("P").save(gif, "GIF")
    (odd / "anim.gif").write_bytes(gif.getvalue())
    (odd / "notes.txt").write_text("not an image\n")
    (odd / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    os.mkfifo(odd / "fifo.jpg")
    os.symlink(os.devnull, odd / "device.jpg")
    os.symlink("missing.jpg", odd / "broken-link.jpg")
    os.symlink("grey16.png", odd / "same-as-grey16.png")
    os.symlink(".", odd / "loop")
    return [
        Odd("odd/anim.gif", "scan", "not a supported image type (.gif)"),
        Odd("odd/notes.txt", "scan", "not a supported image type (.txt)", named="not an image"),
        Odd("odd/.DS_Store", "scan", "hidden file", named="not an image"),
        Odd("odd/fifo.jpg", "scan", "not a regular file (a FIFO)", named="a FIFO"),
        Odd("odd/device.jpg", "scan", "not a regular file (a character device)", named="a character device"),
        Odd("odd/broken-link.jpg", "scan", "broken symlink", named="broken symlink"),
        Odd("odd/same-as-grey16.png", "scan", "the same file as odd/grey16.png"),
        Odd("odd/loop", "scan", "a folder already scanned"),
    ]  # fmt: skip


@contextmanager
def within(seconds: float) -> Iterator[None]:
    """Fail with TimeoutError instead of hanging (a FIFO opened for reading blocks forever):
    SIGALRM interrupts even a blocking open()."""

    def expire(signum, frame):
        import faulthandler  # where every thread stood: a rare hang under load says where

        faulthandler.dump_traceback(all_threads=True)
        raise TimeoutError(f"still running after {seconds} s (a hang)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root (links not followed) with its type, size and mtime."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(folder, name))
            found[os.path.join(folder, name)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return found


def all_images(path) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image of the pack at PATH, in its order: (pixels, labels); none may be damaged."""
    ds = PackedImages(path)
    batch = ds[BatchJob(list(range(len(ds))))]
    assert batch.bad == []
    return batch.pixels, batch.labels
