"""The one exception family of cnnkit: every user mistake is a CnnkitError with one clear line;
`config_error` turns pydantic's validation errors into one."""

from __future__ import annotations

import reprlib
from collections.abc import Collection
from typing import Any

ECHO_CHARS = 40  # longest echo of a user's value in a message


class CnnkitError(Exception):
    """A problem the user can fix; the CLI prints its message and exits with `exit_code`."""

    exit_code = 1


class ConfigError(CnnkitError):
    """A bad network file, run file, option or override (CLI exit status 2)."""

    exit_code = 2


class DataError(CnnkitError):
    """Missing or unreadable data: a folder, an image, a packed set."""


class CheckpointError(CnnkitError):
    """A missing, truncated or foreign checkpoint or run directory."""


_echo = reprlib.Repr()
_echo.maxstring = _echo.maxother = ECHO_CHARS
_echo.maxlist = _echo.maxtuple = _echo.maxdict = _echo.maxset = 6
_echo.maxlevel = 2


def echo(value: Any) -> str:
    """A user's value as it goes into a message: its repr, cut to a few dozen characters."""
    return _echo.repr(value)


def config_error(error: Any, prefix: str = "", hide: Collection[str] = ()) -> ConfigError:
    """The first problem of a pydantic ValidationError as one ConfigError line naming the field:
    `prefix.field.path: message (got value)`. `hide`: location parts to leave out (the tags of
    a discriminated union)."""
    err = error.errors()[0]
    parts = [str(p) for p in err["loc"]]
    parts = [p for p in parts if not p.startswith(("function-", "literal[")) and p not in hide]
    loc = ".".join(([prefix] if prefix else []) + parts)
    msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    got = ""
    if "input" in err and err["type"] not in ("extra_forbidden", "missing", "value_error"):
        got = f" (got {echo(err['input'])})"
    return ConfigError(f"{loc or 'config'}: {msg}{got}")
