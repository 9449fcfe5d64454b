"""Inference commands: classify, export, import-caffe, show filters / show net (and detect)."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add this area's commands to the app."""
    app.command("import-caffe")(import_caffe)
    show = typer.Typer(
        help="Draw a network: its graph or its first-layer filters.", no_args_is_help=True
    )
    show.command("net")(show_net)
    app.add_typer(show, name="show")


def import_caffe(
    prototxt: Path = typer.Argument(..., help="A Caffe deploy.prototxt."),
    out: Path = typer.Option(
        None, "-o", "--out", help="Write the network file here (default: print it)."
    ),
) -> None:
    """Translate a Caffe prototxt into a cnnkit network file (YAML)."""
    from cnnkit.caffe import import_caffe as translate
    from cnnkit.caffe import network_yaml
    from cnnkit.nn import build_model

    model = translate(prototxt)
    net = build_model(model, device="meta")  # checks every shape before anything is written
    text = network_yaml(model, f"imported by cnnkit import-caffe from {prototxt.name}")
    if out is None:
        typer.echo(text, nl=False)
        return
    out.write_text(text)
    params = sum(p.numel() for p in net.parameters())
    typer.echo(
        f"wrote {out}: {len(net.table)} layers, {params:,} parameters, output {net.output_shape}"
    )


def show_net(
    net: str = typer.Argument(
        ..., help="A zoo name, network / run file, Caffe prototxt or run directory."
    ),
    out: Path = typer.Option(..., "-o", "--out", help="Image file: .png, .svg or .pdf."),
) -> None:
    """Draw the network graph (like Caffe's draw_net)."""
    from cnnkit.infer.show import draw_net

    draw_net(net, out)
    typer.echo(f"wrote {out}")
