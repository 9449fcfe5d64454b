"""`cnnkit import-caffe`: a Caffe deploy prototxt (and its .caffemodel) as a network file,
never replacing a file an earlier import did not write."""

from __future__ import annotations

from pathlib import Path

import typer

from cnnkit.cli.outputs import writable_out
from cnnkit.errors import plural

IMPORT_HEADER = "imported by cnnkit import-caffe from"  # a network file's first line


def import_caffe(
    prototxt: Path = typer.Argument(..., help="A Caffe deploy.prototxt."),
    caffemodel: Path = typer.Argument(
        None, help="Its trained .caffemodel: the weights go beside the network file."
    ),
    out: Path = typer.Option(
        None, "-o", "--out", help="Write the network file here (default: print it)."
    ),
    keep_bgr: bool = typer.Option(
        False,
        "--keep-bgr",
        help="With a .caffemodel: keep the first convolution reading Caffe's BGR order, with no "
        "preprocess, for a net trained on RGB images (by default its input channels are "
        "reversed to RGB and Caffe's preprocess written).",
    ),
    output: str = typer.Option(
        None,
        "--output",
        help="The blob the network returns, where the net has several (HED's "
        "side outputs, GoogLeNet's auxiliary heads): the layers that do not feed it are left out.",
    ),
    input_size: str = typer.Option(
        None,
        "--input-size",
        metavar="H,W",
        help="The input's height and width in place of the prototxt's (OpenPose's 1 x 1 "
        "placeholders, a fully convolutional net at another size).",
    ),
) -> None:
    """Translate a Caffe prototxt (and its .caffemodel weights) into a cnnkit network file."""
    from cnnkit.caffe import network_yaml, read_caffe
    from cnnkit.caffe.output import write_import
    from cnnkit.nn import build_model

    _check_import_paths(prototxt, caffemodel, out)
    size = _input_size(input_size)
    imported = read_caffe(prototxt, caffemodel, keep_bgr, output, size)  # weights checked too
    model, state = imported.model, imported.state
    net = build_model(model, device="meta")  # checks every shape before anything is written
    if keep_bgr and caffemodel is None:  # fresh weights: no colour order, no preprocess
        typer.echo("cnnkit: note: --keep-bgr changes nothing without a .caffemodel: a network "
                   "with fresh weights learns whichever order it is trained on", err=True)  # fmt: skip
    header = f"{IMPORT_HEADER} {prototxt.name}"
    if state is not None:
        model = {**model, "weights": out.with_suffix(".safetensors").name}
        header += f" and {caffemodel.name}"
    text = network_yaml(model, "\n".join([header, *imported.notes]))
    if out is None:
        typer.echo(text, nl=False)
        return
    write_import(out, text, state)
    params = sum(p.numel() for p in net.parameters())
    shape = "x".join(map(str, net.output_shape))
    also = f" and {out.with_suffix('.safetensors')}" if state is not None else ""
    typer.echo(
        f"wrote {out}{also}: {plural(len(net.table), 'layer')}, {params:,} parameters, "
        f"output {shape}"
    )


def _input_size(given: str | None) -> tuple[int, int] | None:
    """--input-size H,W (or one number for both) as (H, W); one line for anything else."""
    from cnnkit.errors import ConfigError

    if given is None:
        return None
    try:
        size = tuple(int(p) for p in given.replace("x", ",").split(","))
    except ValueError:
        size = ()
    size = size * 2 if len(size) == 1 else size
    if len(size) != 2 or min(size) < 1 or max(size) > 8192:
        raise ConfigError(f"--input-size {given!r}: expected H,W (or one side), 1 to 8192 each")
    return size  # type: ignore[return-value]


def _check_import_paths(prototxt: Path, caffemodel: Path | None, out: Path | None) -> None:
    """import-caffe's files, before anything is read: a YAML file given to translate, -o's
    name and what it would replace (never a file an earlier import did not write)."""
    from cnnkit.errors import ConfigError

    writable_out(out, prototxt, caffemodel, example="net.yaml")
    if prototxt.suffix.lower() in (".yaml", ".yml") and prototxt.is_file():
        raise ConfigError(f"{prototxt}: a cnnkit YAML file (info, train and classify read a "
                          "network file as it is); import-caffe reads a Caffe .prototxt")  # fmt: skip
    if caffemodel is not None and out is None:
        raise ConfigError(
            "import-caffe with a .caffemodel needs -o NET.yaml: its weights go beside it"
        )
    if out is not None and out.suffix.lower() not in (".yaml", ".yml"):
        raise ConfigError(f"-o {out}: import-caffe writes a network file: name it .yaml")
    if out is not None and out.exists() and not _written_by_import(out):
        raise ConfigError(f"-o {out}: exists, and is not the network file of an earlier "
                          "import (its first line says so): move it, or give -o another name")  # fmt: skip
    weights = out.with_suffix(".safetensors") if out is not None else None
    if caffemodel is not None and weights.exists() and not _imported_beside(out, weights):
        raise ConfigError(f"{weights}: exists, and is not the weights of an earlier import to "
                          f"{out.name}: move it, or give -o another name")  # fmt: skip


def _written_by_import(path: Path) -> bool:
    """Whether a network file was written by import-caffe (its first line says so)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().startswith(f"# {IMPORT_HEADER}")
    except (OSError, UnicodeDecodeError):
        return False


def _imported_beside(out: Path, weights: Path) -> bool:
    """True if network file `out` was written by an earlier import (its first line says so)
    and names `weights` as its weights: that import's, which a new one may replace. A network
    file of the user's own that names NET.safetensors does not make its weights ours."""
    from cnnkit.errors import CnnkitError
    from cnnkit.nn.yamlio import read_yaml

    try:
        net = read_yaml(out) if _written_by_import(out) else None
    except (CnnkitError, OSError, UnicodeDecodeError):
        return False
    model = net.get("model", net) if isinstance(net, dict) else None
    return isinstance(model, dict) and model.get("weights") == weights.name
