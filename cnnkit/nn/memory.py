"""Sizes before allocating: a network's parameter and activation bytes, counted from its layer
table, checked against the memory of the device it is built on (one line when it cannot fit)."""

from __future__ import annotations

import os
from decimal import Decimal
from pathlib import Path
from typing import Any

import torch

from cnnkit.errors import ConfigError

META_LIMIT = 2**40  # 1 TiB: a network larger than this is a typo even to describe


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KB' (powers of 1000, as disks and `free -h` report); from 1000 PB on, a
    power of ten ('6.3e+24 bytes'), not a count of PB, and never a float overflow."""
    if n >= 1000**6:  # (Decimal: exact for an integer of any size, where float() overflows)
        return f"{Decimal(n):.1e} bytes"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def available(device: Any) -> tuple[int, str] | None:
    """(bytes, where the figure comes from) for building on `device`; None if unknown."""
    dev = torch.device(device) if device is not None else torch.empty(0).device
    if dev.type == "meta":
        return META_LIMIT, "cnnkit's limit for describing a network"
    if dev.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(dev)
        return free, f"free on {dev}"
    if dev.type == "cpu":
        return _host_available()
    return None


def _host_available() -> tuple[int, str] | None:
    meminfo = Path("/proc/meminfo")
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    try:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * size, "available physical pages"
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(name: str, params: int, activations: int, device: Any) -> None:
    """Refuse, in one line, a network whose parameters plus one image's activations (float32
    values counted from the layer table) exceed the memory available where it is built."""
    short = _shortfall(params + activations, device)
    if short is not None:
        raise ConfigError(
            f"model: {name} needs {format_bytes(short[0])} ({params:,} parameters and "
            f"{activations:,} activation values per image) but {format_bytes(short[1])} is "
            f"available ({short[2]})"
        )


def check_batch_fits(name: str, params: int, activations: int, batch: int, device: Any) -> None:
    """Refuse, in one line, a batch whose activations alone (float32, the forward pass's, from
    the layer table: a lower bound) with the parameters exceed the memory available."""
    short = _shortfall(params + batch * activations, device)
    alone = short and _shortfall(params + activations, device)
    if alone:  # no batch is small enough: the network itself does not fit
        raise ConfigError(
            f"{name} does not fit here at any batch: its {params:,} parameters and one image's "
            f"activations need at least {format_bytes(alone[0])} but {format_bytes(alone[1])} is "
            f"available ({alone[2]})"
        )
    if short is not None:
        raise ConfigError(
            f"--batch {batch}: {name} needs at least {format_bytes(short[0])} ({activations:,} "
            f"activation values per image) but {format_bytes(short[1])} is available "
            f"({short[2]})"
        )


def _shortfall(values: int, device: Any) -> tuple[int, int, str] | None:
    """(bytes `values` float32 numbers need, bytes available, where that figure is from) when
    they exceed the memory available on `device`; None when they fit or it is unknown."""
    need = values * torch.empty(0).element_size()
    limit = available(device)
    if limit is None or need <= limit[0]:
        return None
    return need, limit[0], limit[1]
