"""`cnnkit zoo` and `cnnkit info`: what networks exist and what a network is made of."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from cnnkit.zoo import NETS, RUNS

# info's, show net's, export's and bench's
NUM_CLASSES = typer.Option(
    None,
    "--num-classes",
    min=1,
    max=2**31 - 1,
    help="The network's class count, where its file sets none or another (fresh weights).",
)


def register(app: typer.Typer, bench: typer.Typer) -> None:
    app.command("zoo")(zoo)
    app.command("info")(info)


def zoo() -> None:
    """List the built-in networks and runs."""
    from rich import box
    from rich.table import Table

    from cnnkit.tables import wide_console

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
    num_classes: int = NUM_CLASSES,
) -> None:
    """Print the layer table: output shape, parameters and multiply-adds per layer, then totals."""
    from cnnkit.nn.summary import print_layer_table
    from cnnkit.tables import wide_console

    print_layer_table(network_for(net, num_classes, weights_note=True), wide_console())


def network_for(net: str, num_classes: int | None, weights_note: bool = False) -> Any:
    """The network NET names, built on the meta device, as info, show net and bench read it:
    a run's metrics.csv and a --num-classes that sizes no layer are one line each."""
    from cnnkit.checkpoint import check_not_a_record
    from cnnkit.infer.load import check_sized_by, network_of

    check_not_a_record(Path(net))  # a run's metrics.csv: its run directory, as classify says
    network = network_of(net, num_classes, weights_note=weights_note)
    check_sized_by(num_classes, network, net)
    return network
