"""`cnnkit zoo` and `cnnkit info`: what networks exist and what a network is made of."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from cnnkit.errors import CheckpointError
from cnnkit.nn import Network, build_model
from cnnkit.nn.summary import print_layer_table, wide_console
from cnnkit.zoo import NETS, RUNS


def register(app: typer.Typer, bench: typer.Typer) -> None:
    app.command("zoo")(zoo)
    app.command("info")(info)


def zoo() -> None:
    """List the built-in networks and runs."""
    from rich import box
    from rich.table import Table

    table = Table(title="cnnkit zoo", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("name", style="bold")
    table.add_column("kind")
    table.add_column("description")
    for kind, entries in (("network", NETS), ("run", RUNS)):
        for name, (_, description) in entries.items():
            table.add_row(name, kind, description)
    wide_console().print(table)


def info(
    net: str = typer.Argument(
        ...,
        help="A zoo name, network / run file, Caffe prototxt, run directory, checkpoint or export.",
    ),
    num_classes: int = typer.Option(None, "--num-classes", help="Override the file's class count."),
) -> None:
    """Print the layer table: output shape, parameters and multiply-adds per layer, then totals."""
    print_layer_table(describe(net, num_classes))


def describe(target: str, num_classes: int | None = None) -> Network:
    """The network `target` names, built on the meta device (no memory, no weights)."""
    spec: Any = target
    path = Path(target)
    if path.suffix == ".prototxt":
        from cnnkit.caffe import import_caffe

        spec = import_caffe(path)
    elif path.is_dir() or (path.suffix in (".pt", ".pth") and path.exists()):
        from cnnkit.checkpoint import checkpoint_path, load_checkpoint

        state = load_checkpoint(checkpoint_path(path))
        spec, num_classes = state["model_spec"], num_classes or state["num_classes"]
    elif path.suffix == ".safetensors" and path.is_file():
        spec, saved = _export_spec(path)
        num_classes = num_classes or saved
    return build_model(spec, num_classes=num_classes, device="meta")


def _export_spec(path: Path) -> tuple[dict[str, Any], int | None]:
    """The network a `cnnkit export --format safetensors` file records in its metadata."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        return json.loads(meta["model_spec"]), json.loads(meta.get("num_classes", "null"))
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise CheckpointError(
            f"{path}: no cnnkit network in its metadata ({str(e)[:80]})"
        ) from None
