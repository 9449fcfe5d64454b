"""Built-in network and run files (package data) and the name -> file lookup."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).parent

# name -> (file, one-line description). Networks are model files; runs add data: and train:.
NETS: dict[str, tuple[str, str]] = {
    "alexnet": (
        "nets/alexnet.yaml",
        "AlexNet as in the 2012 paper / Caffe bvlc_alexnet (groups, LRN, 227 px)",
    ),
    "caffenet": ("nets/caffenet.yaml", "CaffeNet: AlexNet with pooling before LRN"),
    "alexnet-owt": ("nets/alexnet-owt.yaml", "torchvision's AlexNet ('one weird trick', 224 px)"),
    "lenet5": ("nets/lenet5.yaml", "LeCun's LeNet-5 for 32x32 characters"),
    "facenet": (
        "nets/facenet.yaml",
        "face / non-face patch classifier after Garcia & Delakis (25x25)",
    ),
    "resnet18": ("nets/resnet18.yaml", "ResNet-18 (torchvision layer names)"),
    "vgg16": ("nets/vgg16.yaml", "VGG-16 written with a repeated block"),
    "inception-small": (
        "nets/inception-small.yaml",
        "a small Inception-style net: branches + concat",
    ),
    "digitnet": ("nets/digitnet.yaml", "a small CNN for 8x8 handwritten digits"),
}
RUNS: dict[str, tuple[str, str]] = {
    "digits": ("runs/digits.yaml", "digitnet on scikit-learn's 8x8 digits (offline, seconds)"),
    "faces": ("runs/faces.yaml", "facenet on scikit-image's 25x25 face / non-face patches"),
    "alexnet-imagenet": (
        "runs/alexnet-imagenet.yaml",
        "AlexNet on packed ImageNet with the 2012 / first-seed recipe (needs the data)",
    ),
}


def net_path(name: str) -> Path | None:
    """The file of a zoo network or run, or None if there is no such name."""
    entry = NETS.get(name) or RUNS.get(name)
    return _HERE / entry[0] if entry else None
