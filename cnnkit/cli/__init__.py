"""The command line: the only place that parses arguments. One module per area registers its
commands; each command is a few lines that call the library.

    cnnkit zoo | info NET | train RUN | eval | classify | detect | export | import-caffe
    cnnkit pack | synth shapes | bench layers|train|infer|loader|scaling | show filters|net
"""

from __future__ import annotations

import errno
import inspect
import os
import re
import signal
import sys
import time
import traceback
import warnings
from contextlib import suppress

import typer

try:  # typer 0.2x carries its own copy of click; older ones use click itself
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older typer
    from click import exceptions as click_errors

from cnnkit.cli import bench, data, infer, net, train
from cnnkit.cli.streams import (
    CommandOutput,
    ReaderGone,
    TrainingOutput,
    say,
    stdout_fails,
    to_devnull,
)
from cnnkit.errors import CheckpointError, CnnkitError, ConfigError, DataError, Interrupted

DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
NO_ARGS = getattr(click_errors, "NoArgsIsHelpError", ())  # click < 8.2 shows the help itself
PATH_ERRORS = (
    errno.ENOENT,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EACCES,
    errno.EPERM,
    errno.EEXIST,
    errno.ENAMETOOLONG,
    errno.ELOOP,
)

app = typer.Typer(
    name="cnnkit",
    help="Describe any CNN in a file; train, classify, export and benchmark it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
bench_app = typer.Typer(
    help="Measure speed: layers, train, infer, loader, scaling.", no_args_is_help=True
)
app.add_typer(bench_app, name="bench")

for area in (net, train, data, infer, bench):
    area.register(app, bench_app)


def _one_line_paragraphs(typer_app: typer.Typer) -> None:
    """Each command's help from its docstring with every paragraph on one line, for the
    terminal to wrap: typer's rich help keeps a docstring's line breaks, which left lines
    ending mid-sentence ('skipped and' / 'named on stderr')."""
    for command in typer_app.registered_commands:
        text = inspect.cleandoc(command.help or command.callback.__doc__ or "")
        command.help = "\n\n".join(" ".join(p.split()) for p in text.split("\n\n"))
    for group in typer_app.registered_groups:
        _one_line_paragraphs(group.typer_instance)


_one_line_paragraphs(app)


def _version(show: bool) -> None:
    if show:
        import torch

        from cnnkit import __version__

        print(f"cnnkit {__version__} (torch {torch.__version__})")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback on errors."),
    version: bool = typer.Option(
        False,
        "--version",
        "-V",
        callback=_version,
        is_eager=True,
        help="Print the version and exit.",
    ),  # fmt: skip
) -> None:
    """cnnkit: convolutional networks from a file."""


def _settings_hint(message: str) -> str:
    """An unknown --option that names a run setting (--lr, --epochs, --batch-size): settings
    are key=value overrides, as `epochs=2` already says."""
    found = re.match(r"No such option: --([\w-]+)", message)
    if not found:
        return ""
    from cnnkit.config import TrainConfig
    from cnnkit.data.base import DataConfigBase

    name = found.group(1).replace("-", "_")
    for section, fields in (("train", TrainConfig.model_fields),
                            ("data", DataConfigBase.model_fields)):  # fmt: skip
        if name in fields:
            return f" (settings are key=value overrides: {section}.{name}=...)"
    return ""


PEER_SAYS_IT_S = 3.0  # how long a rank leaves its machine's first rank to say a file's error


def _other_rank() -> bool:
    """A rank other than the first on this machine, of `--nproc` or of torchrun's agent (which
    sets TORCHELASTIC_RUN_ID): the ranks of a machine meet the same configuration error and the
    same Ctrl-C, and its first rank's line says it, once on each machine's console."""
    if not (os.environ.get("CNNKIT_NPROC") or "TORCHELASTIC_RUN_ID" in os.environ):
        return False
    return os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) != "0"


def _said_by_first_rank(e: CnnkitError) -> bool:
    """Whether this machine's first rank says `e` for this rank. A configuration error, a Ctrl-C
    or an error the ranks agreed on: at once. An unreadable data set or checkpoint, which each
    rank meets reading files at its own pace: if the agent ends this rank within a few seconds,
    as it does when the first rank fails (with the same error, said); still here, this rank says
    it (an error of its own)."""
    if not _other_rank():
        return False
    if isinstance(e, (ConfigError, Interrupted)) or e.agreed:
        return True
    if isinstance(e, (DataError, CheckpointError)):
        time.sleep(PEER_SAYS_IT_S)
    return False


def _traceback_exit(code: int) -> None:
    """--debug: the traceback, then the exit status the one line would have had."""
    traceback.print_exc()
    sys.exit(code)


def _out_of_memory(e: BaseException) -> str | None:
    """What an allocation that failed asked for ("a tensor of 409.6 GB"), or None when `e` is
    not an allocation failure (CPU: torch's allocator or Python's MemoryError; CUDA)."""
    text = str(e)
    asked = re.search(r"allocate (?:memory: you tried to allocate )?(\d+) bytes", text)
    if asked:
        return f"a tensor of {int(asked[1]) / 1e9:.1f} GB"
    asked = re.search(r"[Tt]ried to allocate ([\d.]+ [KMGT]i?B)", text)
    if asked and "out of memory" in text.lower():
        return f"a tensor of {asked[1]}"
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return "an allocation"
    return None


def _needs_less(argv: list[str]) -> str:
    """What shrinks the memory a command takes: detect has no batch, its pyramid's first level."""
    return "a larger --min-size" if "detect" in argv[:1] else "a smaller batch"


def main(argv: list[str] | None = None) -> None:
    """Entry point of `cnnkit` and `python -m cnnkit`: user errors become one line and an exit code.

    `--debug` (anywhere on the line, before or after the subcommand) shows the traceback.
    """
    entry, argv = argv is None, list(sys.argv[1:] if argv is None else argv)
    if _rank_of_nproc():
        from cnnkit.agent import end_with_parent

        end_with_parent()  # a rank of --nproc: it ends with its agent, however that ends
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if "RANK" in os.environ and not debug and "torch" not in sys.modules:  # (read as it loads)
        # a rank: its error is one line, not torch's C++ log (a rendezvous's retries, ...)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    if not debug:  # a damaged file's header (TIFF tags past its end): the file is noted instead
        warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")
    if isinstance(sys.stdout, (TrainingOutput, CommandOutput)):  # main run again in-process
        _main(argv, debug)
        return
    output = TrainingOutput if _trains(argv) else CommandOutput
    stdout, sys.stdout = sys.stdout, output(sys.stdout)
    try:
        _main(argv, debug)
    finally:
        sys.stdout = stdout
        # the process's own command (not main() called in-process) has ended; a Ctrl-C left
        # ignored (a background job, nohup) stays so
        if entry and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, _end_now)


def _trains(argv: list[str]) -> bool:
    """Whether the command line trains (`train --help` or `--dry-run` only prints: its reader
    going stops it, as any other command's)."""
    options = argv[1 : argv.index("--")] if "--" in argv else argv[1:]
    return argv[:1] == ["train"] and not {"-h", "--help", "--dry-run"} & set(options)


def _refuse_empty(argv: list[str]) -> None:
    """An empty argument is an unset shell variable (`cnnkit pack src "$DST"`), never a path:
    read as one it is the current folder, which pack wrote its shards into."""
    if "" in argv:
        i = argv.index("")
        after = argv[i - 1] if i else None
        what = (f"{after}'s value" if after and after.startswith("-")
                else f"the argument after {after}" if after else "the command")  # fmt: skip
        raise ConfigError(f"{what} is empty (an unset shell variable?): give a value")


def _rank_of_nproc() -> bool:
    """Whether this process is a rank started by `cnnkit train --nproc N` (cnnkit.agent)."""
    return bool(os.environ.get("CNNKIT_NPROC")) and "LOCAL_RANK" in os.environ


def _hear_ctrl_c() -> None:
    """A rank of --nproc starts with SIGINT held (cnnkit.agent): a Ctrl-C during its start-up
    comes now, inside _main's handling, as KeyboardInterrupt: one line."""
    if _rank_of_nproc() and hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _main(argv: list[str], debug: bool) -> None:
    try:
        _hear_ctrl_c()
        _refuse_empty(argv)
        code = app(args=argv, prog_name="cnnkit", standalone_mode=False)
    except NO_ARGS as e:  # `cnnkit` or `cnnkit bench` alone: typer has shown the help
        sys.exit(e.exit_code)
    except click_errors.ClickException as e:  # a bad option, value or command: one line
        if debug:
            _traceback_exit(e.exit_code)
        ctx = getattr(e, "ctx", None)  # usage errors know the command: point at its help
        see = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        message = e.format_message().rstrip(".")
        hint = _settings_hint(message) if see == " (see cnnkit train --help)" else ""
        if hint:  # not typer's closest option name: what the user meant
            message, see = re.sub(r" \(Possible options: [^)]*\)", "", message), hint
        say(f"cnnkit: error: {message}{see}")
        sys.exit(e.exit_code)
    except typer.Abort:  # typer's name for an EOFError inside a command (a peer lost, ...)
        if debug:
            _traceback_exit(1)
        say("cnnkit: error: aborted (end of input: --debug shows where)")
        sys.exit(1)
    except CnnkitError as e:
        if debug:
            _traceback_exit(e.exit_code)
        kind = "" if isinstance(e, Interrupted) else "error: "
        if not _said_by_first_rank(e):
            say(f"cnnkit: {kind}{e}")
        sys.exit(e.exit_code)
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside a training step
        if debug:
            _traceback_exit(130)
        if not _other_rank():
            say("cnnkit: interrupted")
        sys.exit(130)
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        size = _out_of_memory(e)
        if size is None:
            raise
        if debug:
            _traceback_exit(1)
        say(
            f"cnnkit: error: out of memory: {size} did not fit (--debug shows where); "
            f"{_needs_less(argv)} needs less"
        )
        sys.exit(1)
    except ReaderGone:  # stdout's reader has gone (`| head`): stop quietly, as Unix tools
        to_devnull(sys.__stdout__)
        sys.exit(128 + 13)  # (SIGPIPE's status)
    except OSError as e:  # a full disk, a read-only or missing folder: one line
        if e.errno not in DISK_ERRORS and e.errno not in PATH_ERRORS:
            raise
        if debug:
            _traceback_exit(1)
        say(f"cnnkit: error: {_os_error_line(e)}")
        sys.exit(1)
    if code == 130 and not _other_rank():  # typer's own return for a Ctrl-C it caught
        say("cnnkit: interrupted")
    sys.exit(code if isinstance(code, int) else 0)  # typer.Exit(code); commands return None


def _end_now(signum: int, frame: object) -> None:
    """A Ctrl-C once the command has ended and said so (the interpreter's exit handlers, torch's
    among them, still to run): the end at once, status 130, never a KeyboardInterrupt
    traceback from inside those."""
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()
    os._exit(128 + signal.SIGINT)


def _os_error_line(e: OSError) -> str:
    """A full disk's or a path's OSError as one line: the file (long names shortened), why."""
    from cnnkit.runtime import os_reason

    name = str(e.filename) if e.filename else ""
    if not name and stdout_fails():  # print()'s error names no file: `> log` on a full disk
        name = "standard output"
    where = f"{name if len(name) <= 120 else name[:60] + '...' + name[-40:]}: " if name else ""
    kept = " (nothing half-written was kept)" if e.errno in DISK_ERRORS and e.filename else ""
    return f"{where}{os_reason(e)}{kept}"
