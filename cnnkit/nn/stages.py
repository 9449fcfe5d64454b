"""A block line's stage: how many copies, numbered from where, the first one's overrides, and
whether its layers splice into the enclosing list (`repeat`, `start`, `first`, `inline`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cnnkit.errors import ConfigError, brief

MAX_LAYERS = 20_000  # ResNet-1001 has about 3,000


@dataclass(frozen=True)
class Stage:
    """How a block line repeats: copies, the first copy's number and overrides, splicing."""

    repeat: int
    start: int
    first: dict[str, Any] | None
    numbered: bool  # copies are named NAME.0, NAME.1 ... (or by $index in the name)
    inline: bool  # its layers join the enclosing list
    numbered_on: bool  # unnamed in a sequential block: each copy takes the next number

    def copy_name(self, short: str, number: int) -> str:
        if "$index" in short:
            return short.replace("$index", str(number))
        return f"{short}.{number}" if self.numbered else short


def stage_of(label: str, short: str, raw: dict[str, Any], named: bool, sequential: bool) -> Stage:
    """repeat, start, first and inline of a block line (taken out of `raw`), checked."""
    repeat, start, first = raw.pop("repeat", 1), raw.pop("start", None), raw.pop("first", None)
    inline = raw.pop("inline", False)
    if not _is_int(repeat) or not 1 <= repeat <= MAX_LAYERS:
        raise ConfigError(
            f"{label}: repeat: must be a whole number from 1 to {MAX_LAYERS:,}, got {brief(repeat)}"
        )
    if start is not None and (not _is_int(start) or start < 0):
        raise ConfigError(f"{label}: start: must be a whole number >= 0, got {brief(start)}")
    if first is not None and not isinstance(first, dict):
        raise ConfigError(
            f"{label}: first: a mapping of the first copy's parameters, got {brief(first)}"
        )
    if not isinstance(inline, bool):
        raise ConfigError(f"{label}: inline: true or false, got {brief(inline)}")
    if inline and named:
        raise ConfigError(f"{label}: inline: true puts the block's layers in this list under "
                          "their own names, so the line takes no name: (drop one of the two)")  # fmt: skip
    numbered = repeat > 1 or start is not None or first is not None or "$index" in short
    return Stage(repeat, start or 0, first, numbered, inline, sequential and not named)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
