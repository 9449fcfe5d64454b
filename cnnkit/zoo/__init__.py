"""Built-in network and run files (package data) and the name -> file lookup."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).parent

# name -> (file, one-line description). Networks are model files; runs add data: and train:.
NETS: dict[str, tuple[str, str]] = {
    "alexnet": (
        "nets/alexnet.yaml",
        "AlexNet as in the 2012 paper (groups, the paper's LRN, 227 px)",
    ),
    "caffenet": ("nets/caffenet.yaml", "CaffeNet: AlexNet with pooling before LRN"),
    "alexnet-owt": ("nets/alexnet-owt.yaml", "torchvision's AlexNet ('one weird trick', 224 px)"),
    "lenet5": ("nets/lenet5.yaml", "LeCun's LeNet-5 for 32x32 characters"),
    "facenet": (
        "nets/facenet.yaml",
        "face / non-face patch classifier after Garcia & Delakis (25x25)",
    ),
    "resnet18": ("nets/resnet18.yaml", "ResNet-18 (torchvision layer names)"),
    "resnet34": ("nets/resnet34.yaml", "ResNet-34 (torchvision layer names)"),
    "resnet50": ("nets/resnet50.yaml", "ResNet-50: bottleneck stages, one line each"),
    "resnet101": ("nets/resnet101.yaml", "ResNet-101"),
    "resnet152": ("nets/resnet152.yaml", "ResNet-152"),
    "resnext50_32x4d": ("nets/resnext50_32x4d.yaml", "ResNeXt-50 32x4d: grouped bottlenecks"),
    "wide_resnet50_2": ("nets/wide_resnet50_2.yaml", "Wide ResNet-50-2: bottlenecks twice as wide"),
    "vgg11": ("nets/vgg11.yaml", "VGG-11 (configuration A)"),
    "vgg11_bn": ("nets/vgg11_bn.yaml", "VGG-11 with batch norm"),
    "vgg13": ("nets/vgg13.yaml", "VGG-13 (configuration B)"),
    "vgg13_bn": ("nets/vgg13_bn.yaml", "VGG-13 with batch norm"),
    "vgg16": ("nets/vgg16.yaml", "VGG-16 (configuration D)"),
    "vgg16_bn": ("nets/vgg16_bn.yaml", "VGG-16 with batch norm"),
    "vgg19": ("nets/vgg19.yaml", "VGG-19 (configuration E)"),
    "vgg19_bn": ("nets/vgg19_bn.yaml", "VGG-19 with batch norm"),
    "googlenet": (
        "nets/googlenet.yaml",
        "GoogLeNet (torchvision's, batch norm; no auxiliary heads)",
    ),
    "densenet121": ("nets/densenet121.yaml", "DenseNet-121: dense blocks of concatenated layers"),
    "squeezenet1_0": (
        "nets/squeezenet1_0.yaml",
        "SqueezeNet 1.0: fire modules, no fully connected layer",
    ),
    "squeezenet1_1": ("nets/squeezenet1_1.yaml", "SqueezeNet 1.1: 2.4x less computation than 1.0"),
    "mobilenet_v2": (
        "nets/mobilenet_v2.yaml",
        "MobileNetV2: inverted residuals, one line per table row",
    ),
    "mobilenet_v3_large": (
        "nets/mobilenet_v3_large.yaml",
        "MobileNetV3-Large: bnecks with SE, hard-swish",
    ),
    "mobilenet_v3_small": ("nets/mobilenet_v3_small.yaml", "MobileNetV3-Small"),
    "efficientnet_b0": (
        "nets/efficientnet_b0.yaml",
        "EfficientNet-B0: MBConv stages with SE and stochastic depth",
    ),
    "shufflenet_v2_x1_0": (
        "nets/shufflenet_v2_x1_0.yaml",
        "ShuffleNet V2 1x: channel split and shuffle",
    ),
    "regnet_y_400mf": (
        "nets/regnet_y_400mf.yaml",
        "RegNetY-400MF: bottlenecks with SE, quantised widths",
    ),
    "convnext_tiny": (
        "nets/convnext_tiny.yaml",
        "ConvNeXt-T: depthwise 7x7, LayerNorm, layer scale",
    ),
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
        "AlexNet on packed ImageNet with the first seed's recipe (needs the data)",
    ),
}


def net_path(name: str) -> Path | None:
    """The file of a zoo network or run, or None if there is no such name."""
    entry = NETS.get(name) or RUNS.get(name)
    return _HERE / entry[0] if entry else None


def zoo_name(name: str) -> bool:
    """A zoo network's or run's bare name (`digitnet`, not `./digitnet`): the zoo's, whatever
    file of that name the working directory holds (one named `digitnet` took its place)."""
    return "/" not in name and not Path(name).suffix and net_path(name) is not None


def zoo_names() -> list[str]:
    """Every zoo network and run name."""
    return [*NETS, *RUNS]


def runs_training(net: str) -> list[str]:
    """The zoo runs whose model is the zoo network `net`."""
    import yaml

    return [name for name, (file, _) in RUNS.items()
            if (yaml.safe_load((_HERE / file).read_text()) or {}).get("model") == net]  # fmt: skip
