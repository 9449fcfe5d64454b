"""The console the command line's and the benchmarks' tables print to (rich, and nothing else:
`cnnkit zoo` imports no torch)."""

from __future__ import annotations

from typing import Any

from rich.console import Console


class _TableConsole(Console):
    """rich pads every line of a table to its width: on a terminal that is blank space, in a
    file or a pipe it is trailing spaces on every line (diffs, grep, copying). Piped, the
    lines are printed without them."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        if self.is_terminal:
            return super().print(*objects, **kwargs)
        with self.capture() as captured:
            super().print(*objects, **kwargs)
        self.file.write("\n".join(line.rstrip() for line in captured.get().split("\n")))
        return None


PIPED_WIDTH = 100_000  # no line of a table, or of text, is cut or wrapped in a file or a pipe


def wide_console() -> Console:
    """A console at least 120 columns wide on a terminal; piped, as wide as its lines are, so
    tables piped to a file are not cut (a 120-column table cut densenet121's layer names to
    `features.denseblock1.den…`, every row alike)."""
    console = Console()
    return _TableConsole(width=max(console.width, 120) if console.is_terminal else PIPED_WIDTH)
