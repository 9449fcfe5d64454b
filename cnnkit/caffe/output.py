"""Writing an import: the network file and its safetensors weights, each through a temporary
file beside it renamed into place, so a full disk or a kill leaves no half-written file."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from cnnkit.errors import CnnkitError, one_line


def write_import(out: Path, text: str, state: dict[str, torch.Tensor] | None) -> None:
    """Write `text` to `out` and `state` (if any) beside it as `out`.safetensors."""
    from safetensors.torch import save

    files = {out: text.encode()}
    if state is not None:
        files[out.with_suffix(".safetensors")] = save(state)
    temporary = {path: path.with_name(f".{path.name}.{os.getpid()}.tmp") for path in files}
    path = out
    try:
        for path, data in files.items():
            temporary[path].write_bytes(data)
        for path, tmp in temporary.items():
            os.replace(tmp, path)
    except OSError as e:
        reason = e.strerror or one_line(e, 120)
        raise CnnkitError(
            f"{path}: cannot write: {reason} (nothing half-written was kept)"
        ) from None
    finally:
        for tmp in temporary.values():
            tmp.unlink(missing_ok=True)
