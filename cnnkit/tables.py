"""The console the command line's and the benchmarks' tables print to (rich, and nothing else:
`cnnkit zoo` imports no torch)."""

from __future__ import annotations

from rich.console import Console


def wide_console() -> Console:
    """A console at least 120 columns wide, so tables piped to a file are not cut."""
    return Console(width=max(Console().width, 120))
