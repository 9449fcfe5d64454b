"""The one exception family of cnnkit: every user mistake is a CnnkitError with one clear line."""


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
