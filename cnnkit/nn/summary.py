"""The layer table of `cnnkit info`: one row per layer, then totals."""

from __future__ import annotations

import torch
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cnnkit.errors import plural
from cnnkit.nn.graph import Network
from cnnkit.nn.memory import format_bytes


def print_layer_table(model: Network, console: Console) -> None:
    """Print name, type, inputs, output shape, parameters and multiply-adds of every layer."""
    title = f"{model.name}  input {_shape(model.input_shape)}"
    table = Table(title=Text(title), title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("#", "name", "type", "inputs", "output"):  # long names wrap, never cut
        table.add_column(column, overflow="fold")
    table.add_column("params", justify="right")
    table.add_column("mult-adds", justify="right")
    previous = "input"
    for i, row in enumerate(model.table):
        inputs = "" if row.inputs == (previous,) else ", ".join(row.inputs)
        table.add_row(
            str(i),
            row.name,
            row.type,
            inputs,
            _shape(row.output_shape),
            f"{row.params:,}" if row.params else "",
            f"{row.macs:,}" if row.macs else "",
        )
        previous = row.name
    console.print(table)
    params = sum(row.params for row in model.table)
    macs = sum(row.macs for row in model.table)
    size = torch.empty(0).element_size()  # the default dtype's bytes per value
    memory = (
        f"memory: {format_bytes(model.param_count * size)} of parameters, "
        f"{format_bytes(model.activation_count * size)} of activations per image"
    )
    console.print(f"layers: {len(model.table)}   output: {_shape(model.output_shape)}   {memory}")
    console.print(f"parameters: {params:,}")
    console.print(f"multiply-adds: {macs:,} ({_short_count(macs)}) per image")
    unreached = model.unreached()
    if unreached:  # (a branch nothing reads: counted above, yet it never learns)
        shown = ", ".join(unreached[:5]) + (", ..." if len(unreached) > 5 else "")
        verb = "never reaches" if len(unreached) == 1 else "never reach"
        console.print(f"note: {plural(len(unreached), 'layer')} with parameters {verb} the "
                      f"output ({shown}): no gradient, never trained")  # fmt: skip


def _short_count(n: int) -> str:
    """'1.814 G' as torchvision's model tables give GFLOPS; a small net's in M or K, not
    '0.000 G'."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= 0.1 * size:
            return f"{n / size:.3f} {unit}"
    return str(n)


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))
