"""`cnnkit synth shapes`: a learnable synthetic ImageNet-style folder of JPEGs (one folder per
class; each class is a shape in a colour family on a textured background) for offline tests.
"""

from __future__ import annotations

import colorsys
import math
import multiprocessing as mp
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from cnnkit.data.decode import MAX_PIXELS
from cnnkit.errors import ConfigError
from cnnkit.runtime import available_cores

SHAPES = (
    "circle",
    "square",
    "triangle",
    "star",
    "cross",
    "ring",
    "diamond",
    "hexagon",
    "bar",
    "arc",
)
COLOURS = ("red", "orange", "yellow", "lime", "green", "teal", "cyan", "blue", "purple", "pink")


def class_names(classes: int) -> list[str]:
    """Names of the first `classes` (shape, colour) classes, e.g. 'red-circle'."""
    pairs = [(s, (s + k) % len(COLOURS)) for k in range(len(COLOURS)) for s in range(len(SHAPES))]
    return [f"{COLOURS[c]}-{SHAPES[s]}" for s, c in pairs[:classes]]


def _background(rng: np.random.Generator, h: int, w: int) -> Image.Image:
    """Smooth random colour noise plus a few faint lines: a texture the net must ignore."""
    coarse = rng.integers(40, 216, size=(4, 4, 3), dtype=np.uint8)
    im = Image.fromarray(coarse).resize((w, h), Image.BICUBIC)
    draw = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(3, 8))):
        xy = [tuple(rng.integers(0, [w, h])) for _ in range(2)]
        draw.line(xy, fill=tuple(int(v) for v in rng.integers(0, 256, 3)), width=2)
    return im


def _polygon(cx: float, cy: float, r: float, sides: int, turn: float, inner: float = 1.0) -> list:
    """Corners of a regular polygon, or of a star when inner < 1 (every other corner pulled in)."""
    n = sides * 2 if inner < 1 else sides
    radii = [r * inner if inner < 1 and i % 2 else r for i in range(n)]
    angles = [turn + 2 * math.pi * i / n for i in range(n)]
    return [
        (cx + q * math.cos(a), cy + q * math.sin(a)) for q, a in zip(radii, angles, strict=True)
    ]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float,
                turn: float, fill: tuple) -> None:  # fmt: skip
    box = (cx - r, cy - r, cx + r, cy + r)
    width = max(2, int(r / 3))
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "ring":
        draw.ellipse(box, outline=fill, width=width)
    elif shape == "arc":
        draw.arc(box, math.degrees(turn), math.degrees(turn) + 200, fill=fill, width=width)
    elif shape == "cross":
        draw.line((cx - r, cy, cx + r, cy), fill=fill, width=width)
        draw.line((cx, cy - r, cx, cy + r), fill=fill, width=width)
    elif shape == "bar":
        dx, dy = r * math.cos(turn), r * math.sin(turn)
        draw.line((cx - dx, cy - dy, cx + dx, cy + dy), fill=fill, width=int(r / 2))
    else:
        sides, inner, base = {"square": (4, 1, math.pi / 4), "triangle": (3, 1, -math.pi / 2),
                              "star": (5, 0.45, -math.pi / 2), "diamond": (4, 1, 0),
                              "hexagon": (6, 1, 0)}[shape]  # fmt: skip
        draw.polygon(_polygon(cx, cy, r, sides, base + 0.3 * turn, inner), fill=fill)


def draw_example(rng: np.random.Generator, class_index: int, size: int) -> Image.Image:
    """One image of class `class_index`: shorter side `size`, aspect up to 4:3 like photos."""
    pairs = [(s, (s + k) % len(COLOURS)) for k in range(len(COLOURS)) for s in range(len(SHAPES))]
    shape, colour = pairs[class_index]
    h, w = size, int(size * rng.uniform(1.0, 4 / 3))
    if rng.random() < 0.5:
        h, w = w, h
    im = _background(rng, h, w)
    hue = (colour / len(COLOURS) + rng.uniform(-0.03, 0.03)) % 1.0
    fill = tuple(
        int(255 * v) for v in colorsys.hsv_to_rgb(hue, rng.uniform(0.7, 1), rng.uniform(0.75, 1))
    )
    r = size * rng.uniform(0.18, 0.32)
    cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
    _draw_shape(ImageDraw.Draw(im), SHAPES[shape], cx, cy, r, rng.uniform(0, 2 * math.pi), fill)
    return im.filter(ImageFilter.GaussianBlur(rng.uniform(0, 1.0)))


def _write_class(job: tuple[str, int, str, int, int, int, int]) -> None:
    """All images of one class (its own seeded generator: the same files in any process)."""
    dst, k, name, per_class, size, seed, quality = job
    folder = Path(dst) / name
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, k])
    for i in range(per_class):
        draw_example(rng, k, size).save(folder / f"{name}_{i:05d}.JPEG", quality=quality)


def synth_shapes(dst: str | Path, classes: int = 10, per_class: int = 100, size: int = 256,
                 seed: int = 0, quality: int = 90, workers: int | None = None) -> list[str]:  # fmt: skip
    """Write DST/<class>/<class>_<i>.JPEG for each class, classes in parallel processes
    (`workers`: default the cores available); returns the class names."""
    limit = len(SHAPES) * len(COLOURS)
    if not 1 <= classes <= limit:
        raise ConfigError(f"--classes: must be 1..{limit}, got {classes}")
    if per_class < 1:
        raise ConfigError(f"--per-class must be >= 1 (got {per_class})")
    if size < 8:
        raise ConfigError(f"--size must be >= 8 (got {size})")
    if size * (size * 4 // 3) > MAX_PIXELS:  # sides up to 4/3 x size: none a pack would refuse
        raise ConfigError(f"--size {size}: its images would be over the limit of "
                          f"{MAX_PIXELS:,} pixels")  # fmt: skip
    if seed < 0:
        raise ConfigError(f"--seed must be >= 0 (got {seed})")
    final = Path(dst).resolve()  # (".": a named folder beside it for the scratch set)
    if final.exists() and (not final.is_dir() or any(p.name != SCRATCH for p in final.iterdir())):
        what = "not empty" if final.is_dir() else "exists and is not a folder"
        raise ConfigError(f"{dst}: {what} (synth writes a new set: give a new folder)")
    names = class_names(classes)
    blocker = next((p for p in final.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:  # (mkdir would say "File exists" of it)
        raise ConfigError(f"{dst}: {blocker} is a file, not a folder")
    final.parent.mkdir(parents=True, exist_ok=True)
    # the whole set, or nothing, at DST: made beside it, or inside it where it is a folder already
    work = final / SCRATCH if final.exists() else final.parent / f".{final.name}.partial"
    shutil.rmtree(work, ignore_errors=True)  # an interrupted one's
    jobs = [(str(work), k, name, per_class, size, seed, quality) for k, name in enumerate(names)]
    workers = min(workers or available_cores(), len(jobs))
    try:
        if workers <= 1 or per_class * classes < 64:  # a pool costs more than it saves
            for job in jobs:
                _write_class(job)
        else:
            with mp.Pool(workers) as pool:  # the platform default: fork on Linux (no re-import)
                pool.map(_write_class, jobs)
        _publish(work, final)
    except BaseException as e:
        shutil.rmtree(work, ignore_errors=True)
        name = str(getattr(e, "filename", None) or "")
        if isinstance(e, OSError) and name.startswith(str(work)):  # said of DST, not the scratch
            raise OSError(e.errno, e.strerror, str(final) + name[len(str(work)) :]) from None
        if isinstance(e, OSError) and not name and e.errno:  # a worker's (the pool drops names)
            raise OSError(e.errno, e.strerror, str(final)) from None
        raise
    return names


SCRATCH = ".partial"  # the set being made, inside a DST folder that exists already


def _publish(work: Path, final: Path) -> None:
    """The finished set at `final`: one rename of the scratch folder, or, where `final` is an
    empty folder already (the current directory of a shell, say, which a rename over it would
    leave deleted), one rename per class folder, moved back if any fails."""
    if not final.exists():
        os.replace(work, final)
        return
    moved = []
    try:
        for part in sorted(work.iterdir()):
            os.replace(part, final / part.name)
            moved.append(part)
    except BaseException:
        for part in moved:
            os.replace(final / part.name, part)
        raise
    work.rmdir()
