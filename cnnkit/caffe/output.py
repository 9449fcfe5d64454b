"""Writing an import: the network file and its safetensors weights, each through a temporary
file beside it renamed into place, so a full disk or a kill leaves no half-written file, and a
failed rename puts back the file replaced before it (the network file and its weights agree)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

import torch

from cnnkit.errors import CnnkitError, one_line
from cnnkit.runtime import temporary_name


def write_import(out: Path, text: str, state: dict[str, torch.Tensor] | None) -> None:
    """Write `state` (if any) as `out`.safetensors and `text` to `out`: both to temporary
    files first, then renamed, the weights before the network file that names them."""
    from safetensors.torch import save

    files = {out.with_suffix(".safetensors"): save(state)} if state is not None else {}
    files[out] = text.encode()
    temporary = {path: _temporary(path, "tmp") for path in files}
    kept: dict[Path, Path] = {}  # a file a rename replaces -> its old contents, till all are in
    done: list[Path] = []
    path = out
    try:
        for path, data in files.items():
            if path.is_dir():  # checked before any rename: os.replace would fail on it
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
            temporary[path].write_bytes(data)
        for path in list(files)[:-1]:  # a later rename may fail: keep what these replace
            if path.exists():
                kept[path] = _keep(path)
        for path, tmp in temporary.items():
            os.replace(tmp, path)
            done.append(path)
    except OSError as e:
        reason = e.strerror or one_line(e, 120)
        undone = _undo(done, kept)
        raise CnnkitError(f"{path}: cannot write: {reason} ({undone})") from None
    finally:
        for tmp in [*temporary.values(), *kept.values()]:
            with contextlib.suppress(OSError):  # never over the error that brought us here
                tmp.unlink(missing_ok=True)


def _temporary(path: Path, kind: str) -> Path:
    """`.NAME.PID.kind` beside `path` (NAME cut short where the whole would be too long)."""
    return path.with_name(temporary_name(path.name, private=True, kind=kind))


def _keep(path: Path) -> Path:
    """A copy of `path`'s present contents beside it (a hard link where it can be one)."""
    copy = _temporary(path, "old")
    try:
        os.link(path, copy, follow_symlinks=False)
    except OSError:  # a file system without hard links
        shutil.copy2(path, copy, follow_symlinks=False)
    return copy


def _undo(done: list[Path], kept: dict[Path, Path]) -> str:
    """Put back the files `done` replaced (remove those it created); what the message adds."""
    for path in reversed(done):
        old = kept.get(path)
        try:
            os.replace(old, path) if old is not None else path.unlink()
        except OSError as e:
            kept.pop(path, None)  # the user's old contents: never removed
            where = f"its old contents are in {old.name}" if old is not None else "remove it"
            return f"{path} could not be put back ({e.strerror or one_line(e, 80)}): {where}"
    return "nothing half-written was kept"
