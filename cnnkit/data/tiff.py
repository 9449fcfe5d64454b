"""TIFF decoding's two rough edges: libtiff's own stderr lines, kept off the console while it
decodes, and why Pillow could not open a TIFF (samples it does not read, or a damaged file)."""

from __future__ import annotations

import io
import os
import sys
import threading
import warnings
from contextlib import contextmanager

from PIL import TiffImagePlugin

_STDERR = threading.Lock()  # one thread at a time moves fd 2, and puts it back
_SAMPLE_KINDS = {1: "unsigned", 2: "signed", 3: "float"}  # TIFF's SampleFormat tag


@contextmanager
def libtiff_quiet(tiff: bool):
    """fd 2 sent to /dev/null while libtiff decodes a TIFF (`tiff`; anything else as it is):
    its own error handler prints lines such as `tempfile.tif: Using code not yet in table.`,
    naming a file the user never gave, where the BadImage reason says what is wrong. Only the
    decode's milliseconds: images are decoded in the main thread or in worker processes."""
    if not tiff:
        yield
        return
    with _STDERR:
        saved = _quiet_fd2()
        try:
            yield
        finally:
            if saved is not None:
                os.dup2(saved, 2)
                os.close(saved)


def _quiet_fd2() -> int | None:
    """fd 2 pointed at /dev/null, and a copy of the old one to put back; None where it is not
    (no fd 2, no descriptor left): the decode goes on, its lines unquieted."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        return None
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        os.close(saved)
        return None
    os.dup2(devnull, 2)
    os.close(devnull)
    return saved


def unopened_tiff(data: bytes) -> str:
    """Why Pillow cannot open a TIFF: samples it does not read, where the header says so cleanly
    (float colour, over 32 bits), else a damaged (or unusual) file."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a tag past the file's end: damaged
            fp = io.BytesIO(data)
            tags = TiffImagePlugin.ImageFileDirectory_v2(fp.read(8))
            fp.seek(tags.next)
            tags.load(fp)
    except Exception:  # noqa: BLE001 - any failure to read the header: damaged
        tags = {}
    bits, kinds = _as_tuple(tags.get(258, ())), _as_tuple(tags.get(339, (1,)))
    if bits and (max(bits) > 32 or (3 in kinds and len(bits) > 1)):
        kind = _SAMPLE_KINDS.get(kinds[0], "unusual")
        return f"a TIFF Pillow cannot read ({len(bits)} x {max(bits)}-bit {kind} samples)"
    return "damaged or unsupported TIFF (Pillow cannot read its header)"


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)
