"""Inference commands: classify, export, show net / filters, detect (import-caffe: caffe.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from cnnkit.cli.net import NUM_CLASSES
from cnnkit.cli.outputs import writable_out
from cnnkit.errors import CnnkitError, plural

if TYPE_CHECKING:  # imported where used: the CLI starts without torch
    from cnnkit.infer.export import CheckResult

TARGET_HELP = ("A run directory, checkpoint (.pt), .safetensors export, or network file with "
               "weights: (a YAML file naming trained weights).")  # fmt: skip
EMA_HELP = "The run's moving average of the weights (train.ema), from its best_ema.pt."


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add this area's commands to the app."""
    app.command("classify")(classify)
    app.command("export")(export)
    from cnnkit.cli.caffe import import_caffe

    app.command("import-caffe")(import_caffe)
    app.command("detect")(detect)
    show = typer.Typer(
        help="Draw a network: its graph or its first-layer filters.", no_args_is_help=True
    )
    show.command("net")(show_net)
    show.command("filters")(show_filters)
    app.add_typer(show, name="show")


def classify(
    target: str = typer.Argument(..., help=TARGET_HELP),
    paths: list[str] = typer.Argument(..., help="Image files, folders or globs."),
    top: int = typer.Option(5, "--top", min=1, help="How many classes to print per image."),
    tencrop: bool = typer.Option(
        False,
        "--tencrop",
        help="Average 10 crops (corners + centre, mirrored): for nets trained with crops and mirrors.",
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per image."),
    batch_size: int = typer.Option(64, "--batch-size", min=1, help="Images per forward pass."),
    device: str = typer.Option(
        "cpu",
        "--device",
        help="cpu (the default: a few images need no GPU start-up), cuda, cuda:1, mps, or auto.",
    ),  # fmt: skip
    ema: bool = typer.Option(False, "--ema", help=EMA_HELP),
) -> None:
    """Print the top classes and probabilities of each image; exit status 1 if any image failed.

    In folders, files that are not images (by name, type or duplicate link) are skipped and
    named on stderr, which is no failure; a folder without any image is a failure, and so is
    finding no image at all.
    """
    from cnnkit.data.scan import printable, report_skipped
    from cnnkit.distributed import resolve_device
    from cnnkit.errors import DataError
    from cnnkit.infer.classify import Classifier
    from cnnkit.infer.images import find_images
    from cnnkit.runtime import keep_freed_memory

    keep_freed_memory()  # batch after batch reuses the same large buffers
    found = find_images(paths)
    if not found.files:
        raise DataError(_nothing_to_classify(paths, found.skipped))
    classifier = Classifier.load(target, resolve_device(device), ema)
    report_skipped(found.skipped)
    for folder in found.empty:
        typer.echo(f"cnnkit: error: {printable(folder)}: no images in this folder", err=True)
    failed = len(found.empty)
    for pred in classifier.iter_predict(found.files, top, tencrop, batch_size):
        failed += pred.error is not None
        name = printable(pred.image)
        if as_json:
            typer.echo(json.dumps({**pred.to_dict(), "image": name}))
        elif pred.error is not None:
            typer.echo(f"cnnkit: error: {name}: {pred.error}", err=True)
        else:
            ranked = ", ".join(
                f"{c} ({p:.3f})" for c, p in zip(pred.labels, pred.probs, strict=True)
            )
            typer.echo(f"{name}: {ranked}")
    if failed:
        raise typer.Exit(1)


def _nothing_to_classify(paths: list[str], skipped: list[tuple[str, str]]) -> str:
    from cnnkit.data.scan import printable

    where = ", ".join(printable(p) for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
    if not skipped:
        return f"no images to classify in {where}"
    first = f"{printable(skipped[0][0])}: {skipped[0][1]}"
    return f"no images to classify in {where} ({plural(len(skipped), 'entry', 'entries')} skipped; first {first})"


def export(
    target: str = typer.Argument(
        ..., help=TARGET_HELP + " Or a network (zoo name, YAML, prototxt)."
    ),
    fmt: str = typer.Option(
        None,
        "--format",
        "-f",
        help="onnx, torch-export (.pt2), safetensors, or torchscript (deprecated by PyTorch); "
        "by default the one the file's suffix names.",
    ),
    out: Path = typer.Option(..., "-o", "--out", help="The file to write."),
    check: bool = typer.Option(
        False, "--check", help="Compare the export with PyTorch (ONNX: in ONNX Runtime)."
    ),
    ema: bool = typer.Option(False, "--ema", help=EMA_HELP),
    num_classes: int = NUM_CLASSES,
) -> None:
    """Export a trained model (or a network with fresh weights): ONNX, torch.export, safetensors."""
    from cnnkit.checkpoint import is_checkpoint, run_of_settings
    from cnnkit.errors import ConfigError
    from cnnkit.infer.export import check_replaceable, export_checked, export_format
    from cnnkit.infer.export import export as export_model
    from cnnkit.infer.load import load_for_inference
    from cnnkit.nn.memory import format_bytes

    run = run_of_settings(target)
    if run is not None:  # its random initial weights, where the learned ones lie beside it
        raise ConfigError(f"{target}: the settings of run {run}, without its weights: give the "
                          f"run directory {run} to export what it learned (a copy of the file "
                          "elsewhere exports the network's random initial weights)")  # fmt: skip
    writable_out(out, target, _weights_of(target), example="model.onnx")
    fmt = export_format(out, fmt)

    if is_checkpoint(out):
        raise ConfigError(f"-o {out}: is a checkpoint (a torch.save file), which an export "
                          "would replace: give the export a name of its own")  # fmt: skip
    check_replaceable(out, fmt)
    loaded = load_for_inference(target, ema=ema, num_classes=num_classes)
    if check:  # written only once it passes
        r = export_checked(loaded, fmt, out)
        typer.echo(_check_line(fmt, r))
        if not r.ok:
            raise CnnkitError(f"{out}: export check failed (max abs diff {r.max_diff:.2e}), "
                              "so it was not written")  # fmt: skip
    else:
        export_model(loaded, fmt, out)
    if not loaded.trained:  # a zoo name or a network file without weights: nothing learned
        typer.echo(f"cnnkit: note: {target} has no trained weights: the export holds its random "
                   "initial ones, and says so (a run directory or checkpoint has learned ones)",
                   err=True)  # fmt: skip
    typer.echo(f"wrote {out} ({fmt}, {format_bytes(out.stat().st_size)})")


def _check_line(fmt: str, r: CheckResult) -> str:
    """How an export compares with PyTorch, in one line."""
    from cnnkit.errors import plural
    from cnnkit.infer.export import RUNTIMES, TOLERANCE

    real = r.batch_sizes[-1]
    if real:
        tried = f"random inputs (batch 1 and 3), {r.real_diff:.2e} on {plural(real, 'real image')}"
    else:  # a network on feature vectors: no images to try
        tried = "random inputs (batch 1 and 3; the network reads feature vectors, not images)"
    return (
        f"check ({RUNTIMES.get(fmt, fmt)} vs PyTorch, fp32 logits): max abs diff "
        f"{r.random_diff:.2e} on {tried}; tolerance {TOLERANCE:.0e} of the largest logit "
        f"({r.scale:.3g}): {'passed' if r.ok else 'FAILED'}"
    )


def show_net(
    net: str = typer.Argument(..., help="A zoo name, network file, Caffe prototxt, run or export."),
    out: Path = typer.Option(..., "-o", "--out", help="Image file: .png, .svg or .pdf."),
    num_classes: int = NUM_CLASSES,
) -> None:
    """Draw the layer graph (layered like graphviz's dot; every edge in sight; SVG text is text)."""
    from cnnkit.cli.net import network_for
    from cnnkit.infer.show import NET_SUFFIXES, check_suffix, draw_net

    writable_out(out, net, example="net.png", picture=True)
    check_suffix(out, NET_SUFFIXES)
    network = network_for(net, num_classes)  # (as info: the graph, built as info builds it)
    draw_net(network, out)
    typer.echo(f"wrote {out}: {plural(len(network.table), 'layer')}")


def show_filters(
    target: str = typer.Argument(..., help=TARGET_HELP),
    out: Path = typer.Option(..., "-o", "--out", help="Image file (.png, .jpg, .webp, ...)."),
) -> None:
    """Draw the first convolution's filters as an enlarged, titled grid (the 2012 paper's fig. 3)."""
    from cnnkit.checkpoint import run_of_settings
    from cnnkit.errors import ConfigError
    from cnnkit.infer.load import load_for_inference
    from cnnkit.infer.show import IMAGE_SUFFIXES, check_suffix, draw_filters

    run = run_of_settings(target)
    if run is not None:  # its random initial filters, where the learned ones lie beside it
        raise ConfigError(f"{target}: the settings of run {run}, without its weights: give the "
                          f"run directory {run} to draw what it learned")  # fmt: skip
    writable_out(out, target, example="filters.png", picture=True)
    check_suffix(out, IMAGE_SUFFIXES)
    loaded = load_for_inference(target)
    shape = draw_filters(loaded.model, out, loaded.trained, source=target,
                         weights=loaded.weights or loaded.source)  # fmt: skip
    if not loaded.trained:  # a zoo name or a network file without weights: nothing learned
        typer.echo(f"cnnkit: note: {target} has no trained weights: these are its random "
                   "initial filters (a run directory or checkpoint has learned ones)", err=True)  # fmt: skip
    typer.echo(f"wrote {out}: {plural(shape[0], 'filter')} of {shape[1]}x{shape[2]}x{shape[3]}")


def detect(
    target: str = typer.Argument(..., help=TARGET_HELP + " A patch classifier (the faces run)."),
    image: Path = typer.Argument(..., help="The photograph to search."),
    out: Path = typer.Option(None, "-o", "--out", help="Write the image with the boxes drawn."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per box."),
    label: str = typer.Option("face", "--class", help="The class to find."),
    threshold: float = typer.Option(
        0.95, "--threshold", min=0.0, max=1.0, help="Least probability of the class."
    ),
    iou: float = typer.Option(0.3, "--iou", min=0.0, max=1.0, help="NMS overlap limit."),
    min_size: int = typer.Option(
        None, "--min-size", min=1, help="Smallest face (px); default: 1.5 windows (38 for facenet)."
    ),
    step: float = typer.Option(1.2, "--scale-step", min=1.01, help="Pyramid scale factor."),
    top: int = typer.Option(3, "--top", min=1, help="At most this many boxes, best first."),
    mirror: bool = typer.Option(
        True, "--mirror/--no-mirror", help="Average each window's score with its mirror image's."
    ),
) -> None:
    """Find faces: the classifier slid over an image pyramid, then non-maximum suppression."""
    from cnnkit.checkpoint import NOT_HELD, note_mean_image
    from cnnkit.infer.detect import detect as find
    from cnnkit.infer.detect import draw_boxes
    from cnnkit.infer.images import to_hwc
    from cnnkit.infer.load import load_for_inference, require_trained
    from cnnkit.infer.show import IMAGE_SUFFIXES, check_suffix
    from cnnkit.runtime import keep_freed_memory

    keep_freed_memory()  # window batch after window batch: the same large buffers
    writable_out(out, target, image, example="boxes.png", picture=True)
    if out is not None:
        check_suffix(out, IMAGE_SUFFIXES)  # before the search, not after it
    picture = to_hwc(image)
    loaded = load_for_inference(target)
    require_trained(loaded, target)  # boxes of random weights are noise
    if loaded.mean_image is not None or loaded.mean_averaged:
        note_mean_image("detect", "each window of a picture" if loaded.mean_image is not None
                        else NOT_HELD)  # fmt: skip
    boxes = find(loaded, picture, label, threshold, iou, min_size, step, top, mirror,
                 name=str(image))  # fmt: skip
    if not boxes:
        typer.echo(f"no {label} found: no window scored {threshold:g} or more", err=True)
    for rank, box in enumerate(boxes, 1):
        d = box.to_dict()
        text = f"{rank:2d}  x {d['x0']:.0f}-{d['x1']:.0f}  y {d['y0']:.0f}-{d['y1']:.0f}  score {d['score']:.4f}"
        typer.echo(json.dumps(d) if as_json else text)
    if out is not None:
        draw_boxes(picture, boxes, out)
        typer.echo(f"wrote {out}: {plural(len(boxes), 'box', 'boxes')}", err=as_json)


def _weights_of(target: str) -> str | None:
    """The weights file a network file names (read when exporting it), else None."""
    if Path(target).suffix.lower() not in (".yaml", ".yml") or not Path(target).is_file():
        return None
    from cnnkit.nn import read_spec

    return read_spec(target).get("weights")
