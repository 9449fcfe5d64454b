"""Device names: `resolve_device`, cnnkit's one rule for turning a device name into a device,
and the rule for `train.device` in a group (each process takes cuda:LOCAL_RANK)."""

from __future__ import annotations

import torch

from cnnkit.errors import ConfigError

DEVICE_HELP = "auto, cpu, cuda, cuda:N or mps"


def resolve_device(name: str | None = "auto", field: str = "--device") -> torch.device:
    """'auto' (or None) -> cuda if available, else cpu; a named device must exist here.

    `field` names the setting in error messages (`train.device`, `--device`).
    """
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{field}: {name!r} is not a device ({DEVICE_HELP})") from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{field}: {name!r}: cnnkit runs on {DEVICE_HELP}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"{field}: {name!r} asked for, but no CUDA device is available")
        if (device.index or 0) >= count:
            raise ConfigError(f"{field}: {name!r}: this machine has {count} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{field}: {name!r} asked for, but MPS is not available here")
    if device.type == "cuda" and device.index is not None:
        # the current device: what torch.cuda calls that name none use (RNG states, sync)
        torch.cuda.set_device(device)
    return device


def group_device_name(name: str) -> str:
    """`train.device` for a group, where each process takes cuda:LOCAL_RANK: one named GPU
    (cuda:N) would be ignored, so it is one clear line."""
    if name.startswith("cuda") and ":" in name:
        raise ConfigError(
            f"train.device: {name!r} names one GPU, but each process of a group takes "
            "cuda:LOCAL_RANK: set train.device=cuda (CUDA_VISIBLE_DEVICES chooses GPUs)"
        )
    return name
