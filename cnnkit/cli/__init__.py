"""The command line: the only place that parses arguments. One module per area registers its
commands; each command is a few lines that call the library.

    cnnkit zoo | info NET | train RUN | eval | classify | detect | export | import-caffe
    cnnkit pack | synth shapes | bench layers|train|infer|loader|scaling | show filters|net
"""

from __future__ import annotations

import errno
import sys

import typer

from cnnkit.cli import bench, data, infer, net, train
from cnnkit.errors import CnnkitError, Interrupted

DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)

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


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback on errors."),
) -> None:
    """cnnkit: convolutional networks from a file."""


def main(argv: list[str] | None = None) -> None:
    """Entry point of `cnnkit` and `python -m cnnkit`: user errors become one line and an exit code.

    `--debug` (anywhere on the line, before or after the subcommand) shows the traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        app(args=argv, prog_name="cnnkit")  # usage errors: typer prints them and exits 2
    except CnnkitError as e:
        if debug:
            raise
        kind = "" if isinstance(e, Interrupted) else "error: "
        print(f"cnnkit: {kind}{e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside a training step
        if debug:
            raise
        print("cnnkit: interrupted", file=sys.stderr)
        sys.exit(130)
    except OSError as e:  # a full disk, a read-only folder: the machine's problem, in one line
        if debug or e.errno not in DISK_ERRORS:
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(
            f"cnnkit: error: {where}{e.strerror} (nothing half-written was kept)", file=sys.stderr
        )
        sys.exit(1)
