"""`cnnkit pack`, `cnnkit synth shapes` and `cnnkit bench loader`: the data pipeline's commands."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add pack, synth and bench loader to the app."""
    app.command("pack")(pack)
    synth = typer.Typer(
        help="Write synthetic image folders for offline tests.", no_args_is_help=True
    )
    synth.command("shapes")(shapes)
    app.add_typer(synth, name="synth")
    bench.command("loader")(loader)


def pack(
    src: Path = typer.Argument(
        ..., help="Image folder: one subfolder per class (or flat + --labels)."
    ),
    dst: Path = typer.Argument(..., help="Output folder (resumes if it holds an unfinished pack)."),
    size: int = typer.Option(256, "--size", help="Stored images are size x size (8 to 8192)."),
    resize: str = typer.Option("squash", "--resize", help="squash | shorter-side-crop"),
    interpolation: str = typer.Option(
        "bilinear",
        "--interpolation",
        help="The resize's filter, and the random-resized training crops': bilinear | bicubic.",
    ),
    format: str = typer.Option(
        "raw", "--format", help="raw (memory-mapped) | jpeg (5-10x smaller)"
    ),
    quality: int = typer.Option(90, "--quality", help="JPEG quality for --format jpeg."),
    workers: int = typer.Option(
        None, "--workers", "-j", min=1, help="Processes (default: the cores this process may use)."
    ),
    labels: Path = typer.Option(
        None, "--labels", help="Label file for a flat folder (NAME CLASS)."
    ),
) -> None:
    """Resize every image once and store uint8 shards, an index and the mean image (as AlexNet prepared ImageNet).

    Files that are not images, duplicates (links) and unreadable images are skipped and listed
    in DST/bad_images.tsv; a class folder with no images is refused. Resumes when run again.
    """
    from cnnkit.data.pack import pack_folder
    from cnnkit.errors import DataError, plural

    s = pack_folder(src, dst, size, resize, format, quality, workers, labels,
                    interpolation=interpolation)  # fmt: skip
    done = f"{plural(s.images, 'image')} of {plural(s.classes, 'class', 'classes')}"
    if s.resumed_shards == s.shards:
        print(f"already packed: {done} in {dst}")
    else:
        resumed = f" ({s.resumed_shards} resumed)" if s.resumed_shards else ""
        print(f"packed {done} into {plural(s.shards, 'shard')}{resumed} -> {dst}")
    if s.classes == 1:
        print(f"cnnkit: note: one class only: training needs at least 2 (is {src} the folder above the "
              "class folders?)", file=sys.stderr)  # fmt: skip
    if s.converted or s.skipped:
        print(f"converted {s.converted}, skipped {s.skipped} (reasons: {dst / 'bad_images.tsv'})")
    if s.empty_classes:  # (the pack is whole, but no run trains on it)
        more = (
            f" (and {plural(len(s.empty_classes) - 1, 'other')})"
            if len(s.empty_classes) > 1
            else ""
        )
        raise DataError(f"class {s.empty_classes[0]!r}{more} has no usable image (all skipped: "
                        f"see {dst / 'bad_images.tsv'}); fix its images and run the same cnnkit "
                        "pack again (it takes them then), or remove its folder and pack into a "
                        "new folder")  # fmt: skip


def shapes(
    dst: Path = typer.Argument(..., help="Output folder (one subfolder per class)."),
    classes: int = typer.Option(10, "--classes", help="Number of classes (1-100)."),
    per_class: int = typer.Option(100, "--per-class", help="Images per class."),
    size: int = typer.Option(256, "--size", help="Shorter side of each image."),
    seed: int = typer.Option(0, "--seed", help="Random seed."),
) -> None:
    """Coloured shapes on textured backgrounds, as JPEGs in ImageNet's folder layout."""
    from cnnkit.data.synth import synth_shapes
    from cnnkit.errors import plural

    names = synth_shapes(dst, classes, per_class, size, seed)
    images, kinds = plural(len(names) * per_class, "image"), plural(len(names), "class", "classes")
    print(f"wrote {images} of {kinds} to {dst}")


def loader(
    data: Path = typer.Argument(..., help="A packed set (cnnkit pack) or an image folder."),
    workers: int = typer.Option(
        None,
        "--workers",
        "-j",
        min=0,
        help="Loader processes (default: from the cores). Raw packed shards on a CPU are "
        "cropped in-process, which is faster than any worker: none start there, except for "
        "--resized-crop.",
    ),
    batch: int = typer.Option(256, "--batch", "-b", help="Images per batch."),
    batches: int = typer.Option(20, "--batches", help="Timed batches."),
    crop: int = typer.Option(
        None,
        "--crop",
        min=1,
        help="Network input side (default 227, or 7/8 of a smaller pack's side).",
    ),
    resized: bool = typer.Option(False, "--resized-crop", help="Random-resized-crop, not crop."),
    decode: str = typer.Option("cpu", "--decode", help="JPEGs: cpu (workers) or gpu (device)."),
    device: str = typer.Option("auto", "--device", "-d", help="auto | cpu | cuda | cuda:N"),
    as_json: bool = typer.Option(False, "--json", help="End with one line of JSON."),
) -> None:
    """Images/s of the loader alone (no model), device-side augmentation included."""
    from cnnkit.bench.loader import bench_loader, print_loader
    from cnnkit.bench.timing import say_if_busy
    from cnnkit.distributed import resolve_device
    from cnnkit.runtime import available_cores

    say_if_busy(available_cores())
    options = {"crop": crop} if crop else {}
    options["decode"] = decode
    if resized:
        options["train_crop"] = "resized"
    report = bench_loader(data, workers, batch, batches, device=resolve_device(device), **options)
    if workers and report["mode"] == "views":  # the loader's choice (data.loader._mode)
        typer.echo(f"cnnkit: note: --workers {workers}: raw shards on the CPU are cropped "
                   "in-process, straight from the page cache, which is faster than a worker's "
                   "copy through shared memory: no workers started", err=True)  # fmt: skip
    print_loader(report)
    if as_json:
        print(json.dumps(report))
