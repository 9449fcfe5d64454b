"""Where a command writes (-o): checked before any work, in one line."""

from __future__ import annotations

from pathlib import Path


def writable_out(out: Path | None, *inputs: str | Path | None, example: str,
                 picture: bool = False) -> None:  # fmt: skip
    """One clear line instead of a traceback when -o points into a missing folder or names one
    (`example`: a file name to suggest in it), and instead of overwriting a file the command
    reads (`inputs`), or, for a `picture`, any file but a picture cnnkit drew."""
    from cnnkit.errors import ConfigError

    for given in inputs:
        if out is not None and given is not None and _same_file(out, Path(given)):
            raise ConfigError(f"-o {out}: is the input {given}; give the output a name of its own")
    if out is not None and out.is_dir():
        raise ConfigError(f"-o {out}: is a folder; give the file to write (e.g. {out / example})")
    if out is not None and out.exists() and not out.is_file():  # never read, nor renamed over
        from cnnkit.data.decode import file_kind

        raise ConfigError(f"-o {out}: is {file_kind(out.stat().st_mode)}, not a file to write; "
                          "give a file name")  # fmt: skip
    from cnnkit.train.rundir import RUN_FILES

    own = (*RUN_FILES, "curves.png")
    if (
        out is not None
        and out.name in own
        and out.exists()
        and (out.parent / "config.yaml").is_file()
    ):
        raise ConfigError(f"-o {out}: is a file of the run in {out.parent}, which this would "
                          "replace: give the output a name of its own")  # fmt: skip
    if picture and out is not None and out.is_file():
        from cnnkit.infer.images import drawn_by_cnnkit

        if not drawn_by_cnnkit(out):
            raise ConfigError(f"-o {out}: exists, and is not a picture cnnkit drew (the only "
                              "file a drawing replaces): give a new name")  # fmt: skip
    if out is not None and not out.parent.is_dir():
        what = "is a file, not a folder" if out.parent.exists() else "does not exist"
        raise ConfigError(f"-o {out}: the folder {out.parent} {what}")
    if out is not None:  # before any work
        from cnnkit.runtime import cannot_write

        reason = cannot_write(out.parent)
        if reason is not None:
            raise ConfigError(f"-o {out}: cannot write in {out.parent} ({reason})")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and a.samefile(b)
    except OSError:
        return False
