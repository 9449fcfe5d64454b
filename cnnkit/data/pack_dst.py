"""What `cnnkit pack` may write in DST, and how a failure leaves it: a DST holding images, or
files of a pack's names but no plan, or lying in a folder being packed, is refused before
anything is written; a finished pack's shards whose skipped images now read are packed
again; a failed pack removes only
what it wrote (its .tmp files, and everything of its own where nothing was packed); a shard
is done only where its file is the size its done marker says; one pack at a time writes a DST."""

from __future__ import annotations

import errno
import os
import re
import sys
import zipfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # (Windows: no advisory locks; one pack at a time is the user's care)
    fcntl = None

import numpy as np

from cnnkit.data.decode import BadImage, holds_images, load_resized
from cnnkit.data.pack_shard import SHARD_SUFFIX, PackJob
from cnnkit.data.packfiles import read_index, read_meta
from cnnkit.data.scan import Scan, printable
from cnnkit.errors import ConfigError, DataError, one_line, plural
from cnnkit.runtime import os_reason

SHARD_NAME = re.compile(r"\d{5}\.(u8|jpg|npz)(\.tmp)?")  # what a pack writes in DST/shards
OWN_FILES = ("plan.json", "index.npz", "mean.npy", "files.txt", "bad_images.tsv", "meta.json")


def check_dst(src: Path, dst: Path) -> None:
    """ConfigError where DST lies inside SRC (its shards would become a class) or is a file."""
    if dst.resolve().is_relative_to(src.resolve()):
        raise ConfigError(f"{printable(str(dst))}: inside the folder being packed "
                          f"({printable(str(src))}); pack into a folder outside it")  # fmt: skip
    if dst.exists() and not dst.is_dir():
        raise ConfigError(f"{printable(str(dst))}: exists and is not a folder (DST is the "
                          "folder the pack is written to)")  # fmt: skip


def check_no_clash(dst: Path) -> None:
    """ConfigError where DST, not a pack (no plan.json), holds files of the names a pack writes:
    the pack would overwrite them, and remove them if it failed."""
    if (dst / "plan.json").exists():
        return
    names = [n for n in OWN_FILES if (dst / n).exists()]
    names += [f"shards/{p.name}" for p in _listing(dst / "shards") if SHARD_NAME.fullmatch(p.name)]
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ConfigError(f"{printable(str(dst))}: holds {shown}, which a pack writes, but is not "
                          "a pack (no plan.json); pack into an empty or new folder")  # fmt: skip


class Busy(DataError):
    """Another process packs into DST."""


class DstLock:
    """DST held by one pack at a time: an advisory lock (flock) on the folder, taken before the
    pack writes there (after a new DST's scan: a refused folder still leaves no DST) and
    released when the pack ends, or its process does, however it ends. Without it, two packs
    into one DST wrote the same shards, removed each other's .tmp files, and both failed on a
    file gone missing. Only a pack that `held` DST tidies it after a failure."""

    def __init__(self, dst: Path) -> None:
        self.dst, self.fd, self.held = dst, None, False

    def take(self) -> None:
        """Busy where another process holds DST; held without a lock where the file system
        takes none (as before locks)."""
        if self.held:
            return
        if fcntl is None:
            self.held = True
            return
        fd = os.open(self.dst, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Busy(f"{printable(str(self.dst))}: another cnnkit pack is writing it; when that "
                       "one has ended, the same command resumes from its shards (or finds the "
                       "pack done)") from None  # fmt: skip
        except OSError:  # (no locks on this file system: as before them)
            os.close(fd)
        else:
            self.fd = fd
        self.held = True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # (the lock goes with the last descriptor: forked workers' too)
        self.fd, self.held = None, False


def check_outside(dst: Path, src: Path, scan: Scan) -> None:
    """ConfigError where DST lies in a folder the scan walked through a symlink (pack_folder
    has refused DST inside SRC itself): the pack's shards would become images of that class."""
    where = dst.resolve()
    for folder in (where, *where.parents):
        try:
            st = os.stat(folder)
        except OSError:  # (not made yet)
            continue
        rel = scan.folders.get((st.st_dev, st.st_ino))
        if rel is not None:
            raise ConfigError(f"{printable(str(dst))}: inside a folder being packed "
                              f"({printable(os.path.join(src, rel))}, which is "
                              f"{printable(str(folder))} through a symlink); pack into a folder "
                              "outside it")  # fmt: skip


def check_not_images(dst: Path) -> None:
    """ConfigError where DST, about to become a pack, holds images (`cnnkit pack train val`:
    SRC and DST swapped, or a second SRC): they would be hidden by the pack beside them."""
    if holds_images(dst, depth=2):
        raise ConfigError(f"{printable(str(dst))}: holds images, and is not a pack; pack into an "
                          "empty or new folder (DST is where the pack is written)")  # fmt: skip


def tidy(dst: Path, created: bool, discard: bool) -> None:
    """After a failure: remove this pack's .tmp files; with `discard`, everything this pack wrote
    too. Only its own names: a folder the user made keeps anything else it holds, even under
    shards/."""
    shards = dst / "shards"
    own = [dst / n for n in OWN_FILES] + [
        p for p in _listing(shards) if SHARD_NAME.fullmatch(p.name)
    ]
    for path in own + [dst / f"{n}.tmp" for n in OWN_FILES]:
        if path.suffix == ".tmp" or discard:
            path.unlink(missing_ok=True)
    for folder in (shards, dst) if discard else ():
        if folder.is_dir() and (created or folder == shards) and not any(folder.iterdir()):
            folder.rmdir()


def _listing(folder: Path) -> list[Path]:
    return list(folder.iterdir()) if folder.is_dir() else []


def write_error(e: OSError, dst: Path) -> DataError:
    """One line for a failed write: a full disk says so, and that the same command resumes."""
    where = printable(str(e.filename or dst))
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DataError(f"{printable(str(dst))}: the disk is full (no space left on device "
                         f"writing {where}); free some space and run the same cnnkit pack again: "
                         "it resumes from the shards done")  # fmt: skip
    return DataError(f"{printable(str(dst))}: cannot write {where} ({os_reason(e)})")


def shards_done(dst: Path) -> int:
    """The shards finished in DST (their done markers)."""
    return len(list((dst / "shards").glob("[0-9]*.npz"))) if (dst / "shards").is_dir() else 0


def shards_to_pack(dst: Path, jobs: list[PackJob]) -> list[PackJob]:
    """The jobs whose shard is not done: no done marker, or a shard file whose size is not the
    sum of its records' lengths (cut short after packing, or before an interrupted pack's
    resume), which is named on stderr and packed again. One stat per shard and a read of its
    marker's record lengths (np.load reads that array alone); the shard itself is not read."""
    todo, damaged = [], []
    for job in jobs:
        marker = dst / "shards" / f"{job.shard:05d}.npz"
        if not marker.exists():
            todo.append(job)
            continue
        shard = marker.with_suffix(SHARD_SUFFIX[job.format])
        why = _shard_damage(shard, marker)
        if why is not None:
            todo.append(job)
            damaged.append(f"{printable(str(shard))}: {why}")
    if damaged:
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        print(f"cnnkit: note: {damaged[0]}{more}: packed again", file=sys.stderr)
    return todo


def shards_with_fixed_images(dst: Path, jobs: list[PackJob], todo: list[PackJob]
                             ) -> list[PackJob]:  # fmt: skip
    """The done shards holding an image skipped as unreadable that now reads (fixed, or
    replaced, since): packed again, so the same command takes it. Only skipped files changed
    since their shard was packed (their inode's change time, which a copy keeping the old
    modification time moves too) are decoded again; the rest of a finished pack is not read."""
    fixed, pending = [], {job.shard for job in todo}
    for job in jobs:
        if job.shard in pending:
            continue
        marker = dst / "shards" / f"{job.shard:05d}.npz"
        with np.load(marker) as z:
            kept = set(z["kept"].tolist())
        packed = marker.stat().st_mtime_ns
        skipped = [Path(job.root) / rel for i, rel in enumerate(job.files) if i not in kept]
        if any(_changed_since(path, packed) and _reads(path, job) for path in skipped):
            fixed.append(job)
    if fixed:
        print(f"cnnkit: note: {plural(len(fixed), 'shard')} with an image skipped before that "
              "now reads: packed again", file=sys.stderr)  # fmt: skip
    return fixed


def _changed_since(path: Path, ns: int) -> bool:
    try:
        st = os.stat(path)
    except OSError:  # gone: the plan's check says so
        return False
    return max(st.st_mtime_ns, st.st_ctime_ns) > ns


def _reads(path: Path, job: PackJob) -> bool:
    try:
        load_resized(path, job.size, job.resize, interpolation=job.interpolation)
    except BadImage:
        return False
    return True


def _shard_damage(shard: Path, marker: Path) -> str | None:
    """What is wrong with a shard that has a done marker, or None."""
    try:
        with np.load(marker) as z:
            need = int(z["lengths"].sum())
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return f"its done marker {marker.name} is unreadable"
    try:
        have = shard.stat().st_size
    except OSError:
        return "missing"
    return None if have == need else f"{have:,} bytes, its records need {need:,}"


def finished_meta(dst: Path) -> dict | None:
    """The meta.json of a finished pack that reads as a set, else None: none yet, or damaged
    (a hand-edited meta.json or index.npz), then named on stderr and written again from the
    shards' done markers."""
    if not (dst / "meta.json").exists():
        return None
    try:
        meta = read_meta(dst)
        read_index(dst, meta)
    except DataError as e:  # (its advice, to pack the set again, left out: this does it)
        why = one_line(str(e).rsplit("; ", 1)[0])
        print(f"cnnkit: note: {why}: written again from the shards", file=sys.stderr)
        return None
    return meta
