"""The command line's standard streams: stdout whose reader goes (`| head`) stops a command
quietly (training goes on without its log), and error lines that still end with their own
exit status where stderr's reader has gone too."""

from __future__ import annotations

import os
import stat
import sys


class TrainingOutput:
    """stdout of `cnnkit train`: when its reader goes (`| head`, a `| tee` whose terminal
    closed), the run trains on, its log dropped (metrics.csv and TensorBoard keep it), said
    once on stderr; a run does not die of its log."""

    def __init__(self, stream) -> None:
        self._stream, self._gone = stream, False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._reader_gone()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._reader_gone()

    def _reader_gone(self) -> None:
        self._gone = True
        to_devnull(sys.__stdout__)  # what is left in the buffer goes nowhere, quietly, at exit
        say(
            "cnnkit: stdout's reader has gone: training goes on without printing its log "
            "(metrics.csv and TensorBoard keep it)"
        )

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class ReaderGone(Exception):
    """stdout's reader has gone: not an OSError, so it passes typer, which makes EPIPE status 1
    (classify's "an image failed"), on to _main, which stops quietly."""


class CommandOutput:
    """stdout of every command but train: when its reader goes (`| head`), the command stops
    quietly with SIGPIPE's status, as Unix tools do."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise ReaderGone from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise ReaderGone from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def to_devnull(stream) -> None:
    """Point the stream's file descriptor at /dev/null: what is left in its buffer, and what is
    written after, goes nowhere quietly (the exit does not fail on it)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)  # the stream's descriptor keeps its own copy
    except (OSError, AttributeError, ValueError):
        pass


def stdout_fails() -> bool:
    """Whether stdout has no room (a file on a full disk, /dev/full): then it, not a file of
    the command's, is what print()'s nameless error was about. Looked at, never written to;
    left to /dev/null after, so the exit does not fail on it again."""
    try:
        st = os.fstat(sys.__stdout__.fileno())
        if stat.S_ISCHR(st.st_mode):
            full = st.st_rdev == os.makedev(1, 7)  # /dev/full
        else:
            full = stat.S_ISREG(st.st_mode) and os.fstatvfs(sys.__stdout__.fileno()).f_bavail == 0
    except (OSError, AttributeError, ValueError):
        return False
    if full:
        to_devnull(sys.__stdout__)
    return full


def say(line: str) -> None:
    """A line on stderr; where its reader has gone too (`2>&1 | head -1`), nothing, and the
    command still ends with its own status (an error's 1 or 2, a Ctrl-C's 130), not 1 for the
    failed write."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:  # (EPIPE; a full disk under 2> file)
        to_devnull(sys.__stderr__)
