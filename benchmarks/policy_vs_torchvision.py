"""cnnkit's RandAugment, TrivialAugment, AutoAugment, AugMix against torchvision's, one device.

    python benchmarks/policy_vs_torchvision.py --batch 64 --size 224 --rounds 7 [--device cuda]

cnnkit (train/policy.py) gives each image a draw of its own and applies each op once to the
images that drew it, the parameters sent to the device in one non-blocking copy. torchvision's
v2 transforms (bilinear, as its reference scripts make them) are timed as a per-image
pipeline runs them (image by image: the same draws per image) and on groups of 8 images
sharing a draw (fewer calls, coarser randomness: cnnkit's way before). On CUDA, torchvision's affine ops and sharpness wait for the GPU inside each
call; every timing here ends with a synchronisation. Photos of scikit-image (bundled: no
download), cropped and resized to --size. Each round times every variant, the order reversed
every other round; the median over rounds is reported, then one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from skimage import data as skdata

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from cnnkit.bench.timing import synchronize  # noqa: E402
from cnnkit.distributed import resolve_device  # noqa: E402
from cnnkit.errors import CnnkitError  # noqa: E402
from cnnkit.runtime import machine_name  # noqa: E402
from cnnkit.train.policy import augment  # noqa: E402


def photos(batch: int, size: int, device: torch.device) -> torch.Tensor:
    """uint8 (batch, 3, size, size): random crops of the bundled colour photos, resized."""
    sources = [torch.from_numpy(f()).permute(2, 0, 1) for f in (skdata.astronaut,
               skdata.coffee, skdata.chelsea, skdata.rocket)]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(batch):
        photo = sources[i % len(sources)]
        side = min(photo.shape[1:]) // 2
        top = int(torch.randint(photo.shape[1] - side + 1, (1,), generator=g))
        left = int(torch.randint(photo.shape[2] - side + 1, (1,), generator=g))
        crop = photo[None, :, top : top + side, left : left + side].float()
        resized = torch.nn.functional.interpolate(crop, size=(size, size), mode="bilinear",
                                                  antialias=True)  # fmt: skip
        out.append(resized.round().clamp(0, 255).to(torch.uint8)[0])
    return torch.stack(out).to(device)


def variants(policy: str) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    from torchvision.transforms import v2

    kind = {"randaugment": v2.RandAugment, "trivialaugment": v2.TrivialAugmentWide,
            "autoaugment": v2.AutoAugment, "augmix": v2.AugMix}[policy]  # fmt: skip
    op = kind(interpolation=v2.InterpolationMode.BILINEAR)  # as the reference scripts, and cnnkit
    return {
        "cnnkit": lambda x: augment(x, policy),
        "torchvision_per_image": lambda x: torch.stack([op(image) for image in x]),
        "torchvision_per_8": lambda x: torch.cat([op(part) for part in x.split(8)]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--batch", type=int, default=64, help="images per batch")
    parser.add_argument("--size", type=int, default=224, help="image side")
    parser.add_argument("--rounds", type=int, default=7, help="rounds; the median is reported")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the batch is (cuda when there is one)")  # fmt: skip
    args = parser.parse_args()
    if min(args.batch, args.rounds) < 1 or args.size < 8:
        parser.error("--batch and --rounds must be >= 1, --size >= 8")
    try:
        device = resolve_device(args.device)
    except CnnkitError as e:
        parser.error(str(e))
    x = photos(args.batch, args.size, device)
    result: dict = {"device": machine_name(device), "batch": args.batch, "size": args.size,
                    "rounds": args.rounds, "ms_per_batch": {}, "ratio": {}}  # fmt: skip
    print(f"{args.batch} images of {args.size} px on {result['device']}, median of "
          f"{args.rounds} rounds")  # fmt: skip
    for policy in ("randaugment", "trivialaugment", "autoaugment", "augmix"):
        runs = variants(policy)
        for fn in runs.values():  # warm-up: first calls, cached grids and kernels
            fn(x)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(args.rounds):
            for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                synchronize(device)
                start = time.perf_counter()
                runs[name](x)
                synchronize(device)
                times[name].append(1000 * (time.perf_counter() - start))
        ms = {name: statistics.median(t) for name, t in times.items()}
        result["ms_per_batch"][policy] = ms
        result["ratio"][policy] = ms["torchvision_per_image"] / ms["cnnkit"]
        for name, value in ms.items():
            print(f"  {policy:15s} {name:22s} {value:8.1f} ms  x {ms[name] / ms['cnnkit']:.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
