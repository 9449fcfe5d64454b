"""The one exception family of cnnkit: every user mistake is a CnnkitError with one clear line."""

import reprlib


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


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4
_REPR.maxlevel = 3


def brief(value: object, limit: int = 40) -> str:
    """`repr(value)` cut to about `limit` characters, for echoing user input in a message
    (reprlib never walks all of a huge or alias-shared structure)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit + 3 else text[:limit] + "..."
