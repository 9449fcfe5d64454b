"""The held-out split a run draws from its training images: stratified, each class's images
first in a keyed hash of their file names (so a folder and its pack hold out the same ones),
and the fingerprint a checkpoint keeps of it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from cnnkit.data.scan import printable
from cnnkit.errors import ConfigError

OWN_VAL_SET = "val_path"  # a run's holdout where its held-out images are a folder of their own


def holdout_split(
    labels: np.ndarray, fraction: float, seed: int = 0, keys: Sequence[str] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """A stratified (train, held-out) split of range(len(labels)): round(N * fraction) images
    held out in all, each class contributing its share (largest remainders get the odd ones)
    but keeping at least one image to train on, as sorted index arrays. Each class holds out
    the images first in the order of a keyed hash of `seed` and each image's `keys` entry (its
    file name; its index where None): which images a class holds out depends on its own files
    alone, how many may move by one when other classes change (the odd ones are handed out
    across classes, so that small classes still give a split). A run keeps the split's
    fingerprint (holdout_id): evaluation and --resume refuse a split that changed."""
    labels = np.asarray(labels)
    if not fraction:
        return np.arange(len(labels)), np.zeros(0, np.int64)
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * fraction
    take = np.minimum(np.floor(quota).astype(np.int64), counts - 1)
    extra = int(round(len(labels) * fraction)) - int(take.sum())
    room = np.flatnonzero(take < counts - 1)  # an odd one never takes a class's last image
    take[room[np.argsort(-(quota - take)[room], kind="stable")][: max(extra, 0)]] += 1
    if take.sum() == 0 or take.sum() == len(labels):
        raise ConfigError(
            f"data.val_fraction: {fraction} of {len(labels)} images leaves an empty split"
        )
    rank = _hash_order(keys if keys is not None else range(len(labels)), seed)
    order = np.lexsort((np.arange(len(labels)), rank, labels))  # by class, then by hash
    place = np.arange(len(labels)) - np.repeat(np.cumsum(counts) - counts, counts)
    held = place < np.repeat(take, counts)  # each class's first `take` in hash order
    return np.sort(order[~held]), np.sort(order[held])


def _hash_order(keys: Iterable[Any], seed: int) -> np.ndarray:
    """(N,) uint64: each key's place in a pseudo-random order fixed by `seed` alone (a keyed
    BLAKE2b of its text as files.txt writes it: ImageNet's 1.28M file names in under a second)."""
    salt = int(seed).to_bytes(8, "little")
    digest = (hashlib.blake2b(_key_bytes(k), digest_size=8, salt=salt).digest() for k in keys)
    return np.frombuffer(b"".join(digest), dtype="<u8")


def holdout_id(keys: Sequence[str] | None, val_ids: np.ndarray, total: int) -> str:
    """A short fingerprint of which images a drawn split holds out (keys: their file names;
    indices where None), kept in checkpoints so a resume can tell the split has changed."""
    names = (keys[i] if keys is not None else i for i in np.sort(val_ids))
    h = hashlib.blake2b(f"{total}\n".encode(), digest_size=8)
    for name in names:
        h.update(_key_bytes(name) + b"\n")
    return h.hexdigest()


def _key_bytes(key: Any) -> bytes:
    """An image's key as a pack's files.txt writes it (printable: a file name's undecodable
    bytes as \\xNN, tabs and line breaks escaped), so that a folder and its pack hold out the
    same images, and a name that is not UTF-8 hashes instead of raising."""
    text = str(key)
    try:
        plain = text.encode("utf-8")  # most names: already as printable writes them (fast)
    except UnicodeEncodeError:
        return printable(text).encode("utf-8")
    escaped = "\t" in text or "\n" in text or "\r" in text  # as printable writes them
    return printable(text).encode("utf-8") if escaped else plain
