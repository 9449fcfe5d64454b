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


def wide_console() -> Console:
    """A console at least 120 columns wide, so tables piped to a file are not cut."""
    return _TableConsole(width=max(Console().width, 120))
