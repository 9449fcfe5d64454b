"""A pack's own files, read and checked before any image is: meta.json (the format, sizes,
classes, shards and channel statistics), index.npz (a label, shard, offset and length per image)
against its shards, and plan.json, which marks a pack `cnnkit pack` has yet to finish and keeps
the folder's scan (what a folder run's held-out split is drawn from)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cnnkit.data.base import MAX_SIDE
from cnnkit.data.decode import holds_images
from cnnkit.data.scan import printable
from cnnkit.errors import DataError, one_line, validation_message

PACK_FORMAT = "cnnkit-packed/1"
RESIZE_FLAG = {"squash": "squash", "shorter": "shorter-side-crop"}  # meta.json -> `pack --resize`
# a folder's data settings that a pack fixes when it is made, as `cnnkit pack` names them
PACK_FLAGS = {"size": "--size", "resize_mode": "--resize", "interpolation": "--interpolation"}


def is_pack(path: str | Path) -> bool:
    """True for a folder `cnnkit pack` wrote into, finished (a meta.json of the pack format) or
    not (a cnnkit plan.json): a folder given as data is read as a pack, not as an image folder,
    if so. An image folder holding a meta.json or plan.json of the user's own is no pack."""
    meta = _json_file(Path(path) / "meta.json")
    if isinstance(meta, dict) and meta.get("format") == PACK_FORMAT:
        return True
    return is_plan(_json_file(Path(path) / "plan.json"))


def scanned_images(path: str | Path,
                   keys: list[str]) -> tuple[list[str], np.ndarray, np.ndarray] | None:  # fmt: skip
    """(files, labels, where each packed image is among them) as `cnnkit pack` scanned the
    folder (plan.json), where it lists images the pack could not read: the list a folder
    run's split is drawn from. None where nothing was left out, or where plan.json is gone or
    does not list the packed `keys` (files.txt) in order, with a whole-number label each."""
    plan = _json_file(Path(path) / "plan.json")
    if not is_plan(plan) or len(plan["files"]) <= len(keys):
        return None
    files, labels = plan["files"], plan["labels"]
    if len(labels) != len(files) or not all(isinstance(f, str) for f in files) or not all(
        type(k) is int for k in labels
    ):  # fmt: skip
        return None
    at, positions = iter(enumerate(printable(f) for f in files)), []  # as files.txt has them
    for key in keys:
        positions.append(next((i for i, name in at if name == key), -1))
        if positions[-1] < 0:  # not a subsequence: another scan's plan
            return None
    return files, np.asarray(labels, np.int64), np.asarray(positions, np.int64)


def is_plan(plan: Any) -> bool:
    """True for what `cnnkit pack` writes to plan.json: a dict of the params, files, labels,
    classes and shard size."""
    kinds = {"params": dict, "files": list, "labels": list, "classes": list, "shard_size": int}
    return isinstance(plan, dict) and all(isinstance(plan.get(k), t) for k, t in kinds.items())


def _json_file(path: Path) -> Any:
    """A regular file's JSON (never a FIFO's: it would block), None where absent or not JSON."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):  # (UnicodeDecodeError is a ValueError)
        return None


def read_meta(path: str | Path, field: str | None = None) -> dict:
    """The meta.json of a packed set (DataError if DST is not a finished pack); `field` names
    the setting that gave the path, for the message."""
    meta_path = Path(path) / "meta.json"
    if not meta_path.is_file():
        if is_plan(_json_file(Path(path) / "plan.json")):
            hint = " (interrupted? run cnnkit pack again to resume)"
        elif not Path(path).exists():
            hint = f" (no such folder{f': set {field}' if field else ''}; cnnkit pack makes one)"
        elif field and holds_images(Path(path)):
            hint = (
                " (it holds images: `cnnkit pack` it first, or train from it with "
                "data.source=folder)"
            )
        else:
            hint = ""
        raise DataError(f"{f'{field} ' if field else ''}{path}: not a packed data set, no "
                        f"meta.json{hint}")  # fmt: skip
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError, OSError) as e:
        raise DataError(
            f"{meta_path}: unreadable ({one_line(e, 80)}); pack the set again"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != PACK_FORMAT:
        meta = meta if isinstance(meta, dict) else {}
        raise DataError(f"{meta_path}: format {meta.get('format')!r}, expected {PACK_FORMAT!r}")
    try:
        PackMeta.model_validate(meta)
    except ValidationError as e:  # hand-edited or damaged: one line, not a KeyError later
        raise DataError(f"{meta_path}: damaged ({validation_message(e)}); pack the set "
                        "again") from None  # fmt: skip
    return meta


Stats3 = Annotated[list[float], Field(min_length=3, max_length=3)]  # one per RGB channel


class PackMeta(BaseModel):
    """What the readers of a pack's meta.json take from it, checked when it is read (strict:
    "32" is not a size); what else pack.py writes there (counts, the source) is only shown."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    size: int = Field(ge=1, le=MAX_SIDE)
    resize: Literal["squash", "shorter"]
    interpolation: Literal["bilinear", "bicubic"] = "bilinear"  # (older packs: none)
    storage: Literal["raw", "jpeg"]
    classes: list[str] = Field(min_length=1)
    shards: list[Annotated[str, Field(pattern=r"^\d{5,}\.(u8|jpg)$")]]  # in DST/shards only
    mean: Stats3
    std: Annotated[list[Annotated[float, Field(ge=0)]], Field(min_length=3, max_length=3)]
    rgb_cov: Annotated[list[Stats3], Field(min_length=3, max_length=3)]


def read_index(path: Path, meta: dict) -> dict[str, np.ndarray]:
    """index.npz of a packed set, checked against its shards: DataError for a damaged index or
    a missing or cut-short shard (an incomplete copy), before any worker reads past its end."""
    try:
        with np.load(path / "index.npz") as z:
            index = {k: z[k] for k in ("labels", "shard", "offset", "length")}
            if "source" in z.files:  # each photo's size (an older pack has none)
                index["source"] = z["source"]
        shards = list(meta["shards"])
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        raise DataError(
            f"{path}/index.npz: unreadable ({one_line(e, 80)}); pack the set again"
        ) from None
    _check_index(path, index, meta)
    if "source" in index and index["source"].shape != (len(index["labels"]), 2):
        raise DataError(f"{path}/index.npz: damaged (source sizes of shape "
                        f"{index['source'].shape}); pack the set again")  # fmt: skip
    ends = index["offset"] + index["length"]
    need = np.zeros(len(shards), np.int64)
    np.maximum.at(need, index["shard"], ends)
    for name, size in zip(shards, need.tolist(), strict=True):
        shard = path / "shards" / name
        have = shard.stat().st_size if shard.is_file() else None
        if have is None or have < size:
            what = "missing" if have is None else f"{have:,} bytes, the index needs {size:,}"
            raise DataError(f"{shard}: {what} (an incomplete copy?); copy the set again, or "
                            "run the cnnkit pack that made it again (it packs damaged shards "
                            "again)")  # fmt: skip
    return index


def _check_index(path: Path, index: dict[str, np.ndarray], meta: dict) -> None:
    """DataError unless the index's arrays are integers, one per image, every label a class of
    meta.json, every shard one of its shards, and no offset or length negative: a label past
    the end would fail mid-run, a negative one be read as a class from the end. (Min and max
    only: ~1 ms for ImageNet's 1.28M images.)"""
    labels = index["labels"]
    count = len(labels) if labels.ndim == 1 else -1
    for key in ("labels", "shard", "offset", "length"):
        array = index[key]
        if not np.issubdtype(array.dtype, np.integer) or array.shape != (count,):
            raise DataError(f"{path}/index.npz: damaged ({key}: {array.dtype} of shape "
                            f"{array.shape}, not one integer per image); pack the set "
                            "again")  # fmt: skip
    ranges = (("labels", "label", meta["classes"], "classes"),
              ("shard", "shard", meta["shards"], "shards"),
              ("offset", "offset", None, ""), ("length", "length", None, ""))  # fmt: skip
    for key, word, allowed, nouns in ranges:
        values = index[key]
        low, high = (int(values.min()), int(values.max())) if count else (0, 0)
        if low >= 0 and (allowed is None or high < len(allowed)):
            continue
        bad = low if low < 0 else high
        first = int(np.flatnonzero(values == bad)[0])
        n = len(allowed or ())
        why = "below 0" if allowed is None else f"not one of meta.json's {n} {nouns}, 0 to {n - 1}"
        raise DataError(f"{path}/index.npz: damaged (image {first} has {word} {bad}, {why}); "
                        "pack the set again")  # fmt: skip
