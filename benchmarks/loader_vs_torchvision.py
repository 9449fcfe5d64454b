"""cnnkit's loader against torchvision's usual ImageNet pipeline, both measured in this one run.

    python benchmarks/loader_vs_torchvision.py --images 3000 --workers 2 --batch 128 --batches 20

1. Builds (once, offline) a folder of ~500x375 real-photo JPEGs: random crops, resizes, mirrors
   and colour changes of scikit-image's bundled colour photos (astronaut, coffee, chelsea,
   rocket, ...), one class per source photo, so every file is distinct.
2. torchvision: ImageFolder + PIL RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor +
   Normalize, DataLoader(batch, workers, shuffle), batches moved to the device.
3. cnnkit: `cnnkit pack` of the same folder at 256x256 (raw shards and JPEG shards), then
   `bench loader` over the raw shards, the JPEG shards and the JPEG folder itself, with the same
   workers and batch, device-side augmentation (random-resized-crop 224 + mirror + normalise,
   like torchvision's; and the seeds' 227 crop). On a CPU device the raw shards are read
   in-process (zero-copy from the page cache), and the workers of JPEG sets crop too (one
   resize per image); on CUDA, JPEG shards are also decoded on the GPU (data.decode: gpu).
Each round times torchvision, then every cnnkit variant; a ratio is images/s against that
round's torchvision, and the median over rounds is reported (other programs' load varies).
CPU ms per image (all processes, workers included) hardly depends on that load. The last line
is JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageEnhance
from skimage import data as skdata

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from cnnkit.bench.loader import bench_loader, tree_cpu_seconds  # noqa: E402
from cnnkit.distributed import resolve_device  # noqa: E402
from cnnkit.errors import CnnkitError  # noqa: E402

PHOTOS = ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "hubble_deep_field.jpg",
          "ihc.png", "retina.jpg", "motorcycle_left.png", "motorcycle_right.png")  # fmt: skip
PHOTO_DIR = Path(skdata.__file__).parent  # bundled with scikit-image: no download
WORK = Path("/tmp/cnnkit-loader-bench")


MARK = ".made-by-cnnkit-benchmarks"  # in a --work folder these scripts own


def claim_work(work: Path, default: Path) -> None:
    """Own `work` (MARK in it), where these scripts then remake their folders (photos/,
    packed*/, jpeg-N/) at will: marked before anything is made, so an interrupted run's folders
    are theirs too; the default --work is always theirs. SystemExit for a folder of the user's
    that holds folders of those names: they are never removed."""
    if (work / MARK).is_file():
        return
    if work.is_dir() and work.resolve() != default.resolve():
        theirs = sorted(p.name for p in work.iterdir()
                        if p.name == "photos" or p.name.startswith(("packed", "jpeg-")))  # fmt: skip
        if theirs:
            raise SystemExit(f"--work {work}: holds {', '.join(theirs)}, not made by cnnkit's "
                             "benchmarks; give another --work (nothing was removed)")  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    (work / MARK).write_text("cnnkit's benchmarks/ remake the folders they made here at will\n")


def build_photo_folder(root: Path, images: int, seed: int = 0) -> Path:
    """Write `images` distinct ~500x375 JPEGs under root/<photo>/ (kept if exactly those are
    there already: the same seed makes the same files; another count is made afresh)."""
    if root.is_dir() and sum(1 for _ in root.glob("*/*.jpg")) == images:
        return root
    shutil.rmtree(root, ignore_errors=True)  # (in a --work claim_work owns)
    rng = np.random.default_rng(seed)
    sources = [Image.open(PHOTO_DIR / name).convert("RGB") for name in PHOTOS]
    for i in range(images):
        k = i % len(PHOTOS)
        src = sources[k]
        area = rng.uniform(0.3, 1.0) * src.width * src.height
        aspect = rng.uniform(0.75, 1.33)
        w = int(min(src.width, np.sqrt(area * aspect)))
        h = int(min(src.height, np.sqrt(area / aspect)))
        x0, y0 = rng.integers(0, src.width - w + 1), rng.integers(0, src.height - h + 1)
        size = (500, 375) if rng.random() < 0.8 else (375, 500)
        im = src.crop((x0, y0, x0 + w, y0 + h)).resize(size, Image.BICUBIC)
        if rng.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        im = ImageEnhance.Color(im).enhance(rng.uniform(0.6, 1.4))
        im = ImageEnhance.Brightness(im).enhance(rng.uniform(0.7, 1.3))
        folder = root / PHOTOS[k].split(".")[0]
        folder.mkdir(parents=True, exist_ok=True)
        im.save(folder / f"{i:06d}.jpg", quality=int(rng.integers(85, 96)))
    return root


def torchvision_images_per_second(root: Path, workers: int, batch: int, batches: int,
                                  warmup: int, device: torch.device) -> tuple[float, float]:  # fmt: skip
    """torchvision's usual training pipeline over the folder: (images/s, CPU ms per image)."""
    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder

    transform = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                           T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])  # fmt: skip
    loader = torch.utils.data.DataLoader(
        ImageFolder(str(root), transform=transform), batch_size=batch, shuffle=True,
        num_workers=workers, pin_memory=device.type == "cuda", drop_last=True,
        persistent_workers=workers > 0,
    )  # fmt: skip

    it = itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch
    for _ in range(warmup + 1):
        next(it)
    start, images, cpu = time.perf_counter(), 0, tree_cpu_seconds()
    for _ in range(batches):
        x, y = next(it)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        images += x.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds, cpu = time.perf_counter() - start, tree_cpu_seconds() - cpu
    del it, loader  # stops the workers
    return images / seconds, 1000 * cpu / images


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--images", type=int, default=3000, help="JPEGs made for the test")
    parser.add_argument("--workers", type=int, default=2, help="loader workers, both sides")
    parser.add_argument("--batch", type=int, default=128, help="images per batch")
    parser.add_argument("--batches", type=int, default=20, help="timed batches per pipeline")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches first")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the median is reported")
    parser.add_argument("--work", type=Path, default=WORK,
                        help="where the images and packs are made (kept for the next run; "
                        "folders of the same names not made here are refused)")  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where batches go (cuda when there is one)")  # fmt: skip
    args = parser.parse_args()
    if min(args.workers + 1, args.batch, args.batches, args.warmup + 1, args.rounds) < 1:
        parser.error("--batch, --batches and --rounds must be >= 1, --workers and --warmup >= 0")
    if args.images < args.batch:  # torchvision's loader (drop_last) would yield no batch
        parser.error(f"--images {args.images}: fewer than one --batch ({args.batch})")
    try:  # before minutes of making photos and packs
        device = resolve_device(args.device)
    except CnnkitError as e:
        parser.error(str(e))

    from cnnkit.data.pack import pack_folder

    claim_work(args.work, WORK)
    photos = build_photo_folder(args.work / "photos", args.images)
    shutil.rmtree(args.work / "packed", ignore_errors=True)  # pack afresh: its time is reported
    start = time.perf_counter()
    pack_folder(photos, args.work / "packed", size=256, progress=False, workers=args.workers)
    pack_seconds = time.perf_counter() - start
    jpeg = args.work / f"jpeg-{args.images}"  # the same images as the other variants
    if not (jpeg / "meta.json").is_file():
        shutil.rmtree(jpeg, ignore_errors=True)  # (an interrupted pack of other photos)
        pack_folder(photos, jpeg, size=256, format="jpeg", progress=False, workers=args.workers)
    rounds = [one_round(args, photos, jpeg, device) for _ in range(args.rounds)]
    report(args, rounds, pack_seconds)


def one_round(args: argparse.Namespace, photos: Path, jpeg: Path, device: torch.device) -> dict:
    """{name: (images/s, CPU ms per image)} of torchvision and each cnnkit variant."""
    common = {"workers": args.workers, "batch": args.batch, "batches": args.batches,
              "warmup": args.warmup, "device": device}  # fmt: skip
    rrc = {"crop": 224, "train_crop": "resized"}
    results = {"torchvision": torchvision_images_per_second(photos, args.workers, args.batch,
                                                            args.batches, args.warmup, device)}  # fmt: skip
    runs = {
        "cnnkit_packed_rrc224": (args.work / "packed", rrc),
        "cnnkit_packed_crop227": (args.work / "packed", {}),
        "cnnkit_jpegshards_rrc224": (jpeg, rrc),
        "cnnkit_jpegshards_crop227": (jpeg, {}),
        "cnnkit_folder_rrc224": (photos, rrc),
        "cnnkit_folder_crop227": (photos, {}),
    }
    if device.type == "cuda":  # nvJPEG: the workers only read bytes
        runs["cnnkit_jpegshards_gpu_decode_rrc224"] = (jpeg, {**rrc, "decode": "gpu"})
        runs["cnnkit_folder_gpu_decode_rrc224"] = (photos, {**rrc, "decode": "gpu"})
    for name, (path, options) in runs.items():
        r = bench_loader(path, **common, **options)
        results[name] = (r["images_per_second"], r["cpu_ms_per_image"])
    return results


def report(args: argparse.Namespace, rounds: list[dict], pack_seconds: float) -> None:
    """Medians over rounds: images/s, ratio to the same round's torchvision, CPU ms per image."""
    names = list(rounds[0])
    ips = {k: float(np.median([r[k][0] for r in rounds])) for k in names}
    cpu = {k: float(np.median([r[k][1] for r in rounds])) for k in names}
    ratio = {k: float(np.median([r[k][0] / r["torchvision"][0] for r in rounds])) for k in names}
    print(f"{args.images} JPEGs ~500x375, workers {args.workers}, batch {args.batch}, "
          f"{args.device}, median of {len(rounds)} rounds, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    for k in names:
        print(f"  {k:24s} {ips[k]:7.0f} images/s   x{ratio[k]:5.1f}   {cpu[k]:5.2f} CPU ms/image")
    print(f"  pack of {args.images} images at 256 px: {pack_seconds:.1f} s")
    ratios = {f"{k}_ratio": v for k, v in ratio.items() if k != "torchvision"}
    print(json.dumps({**args.__dict__, "work": str(args.work), "images_per_second": ips,
                      "cpu_ms_per_image": cpu, **ratios, "pack_seconds": pack_seconds,
                      "rounds": rounds}))  # fmt: skip


if __name__ == "__main__":
    try:
        main()
    except CnnkitError as e:  # a user mistake: its one line, as cnnkit says it
        print(f"cnnkit: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
