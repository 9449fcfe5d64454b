"""Process-wide settings cnnkit's commands start with (the CLI applies them; so can scripts)."""

from __future__ import annotations

import sys


def keep_freed_memory() -> bool:
    """Let glibc keep freed blocks instead of unmapping every one over 32 MB; True if applied.

    A training step frees and reallocates the same large buffers (activations, gradients,
    bf16 weight copies) every iteration; by default glibc returns each to the kernel and the
    next step page-faults it back in, which cost ~100 ms per AlexNet step on a 2-core CPU.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...): nothing to tune
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30))
