"""Caffe's colour order: its colour nets read BGR images (OpenCV's) of 0-255 pixels less the
training set's mean; cnnkit reads RGB, so an import turns the first convolutions round."""

from __future__ import annotations

from typing import Any

CAFFE_IMAGENET_MEAN = [122.68, 116.67, 104.01]  # ilsvrc_2012_mean.binaryproto per channel, RGB
CAFFE_RESIZE = 256  # Caffe's ImageNet sets: 256 x 256 images, cropped to 227 or 224
IMAGENET_CROPS = (224, 227)


def bgr_to_rgb(model: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """Reverse the input channels of the weights of every layer reading the network's input
    (convolutions, as Caffe's colour nets begin), in place; the notes for the header."""
    readers = [layer for i, layer in enumerate(model["layers"])
               if "input" in _inputs(layer, first=i == 0)]  # fmt: skip
    convs = [r for r in readers if r["type"] == "conv" and r.get("groups", 1) == 1
             and f"{r['name']}.weight" in state]  # fmt: skip
    if not readers or len(convs) != len(readers):
        return ["the input is read by layers other than plain convolutions: their weights keep "
                "Caffe's BGR channel order (feed images accordingly)"]  # fmt: skip
    for conv in convs:
        key = f"{conv['name']}.weight"
        state[key] = state[key].flip(1).contiguous()
    model["preprocess"] = {"mean": list(CAFFE_IMAGENET_MEAN), "std": [1.0, 1.0, 1.0]}
    names = ", ".join(c["name"] for c in convs)
    notes = [f"{names}: input channels reversed from Caffe's BGR to RGB (import-caffe "
             "--keep-bgr: not, for a net trained on RGB images)",
             "preprocess: Caffe's 0-255 pixels less ImageNet's mean (ilsvrc_2012_mean, per "
             "channel, RGB): set mean to your training set's if it was not ImageNet"]  # fmt: skip
    height, width = (model["input"] + [0, 0])[1:3]
    if height == width and IMAGENET_CROPS[0] <= height <= IMAGENET_CROPS[1]:
        model["preprocess"]["resize"] = CAFFE_RESIZE
        notes.append(f"preprocess: images squashed to {CAFFE_RESIZE} x {CAFFE_RESIZE}, then "
                     f"cropped to {height}, as Caffe's ImageNet models were trained and "
                     "caffe.Classifier reads them (classify --tencrop: its oversample)")  # fmt: skip
    return notes


def _inputs(layer: dict[str, Any], first: bool) -> list[str]:
    """The values a translated layer reads: `inputs` (one name or a list), else the previous
    layer's (the input, for the first)."""
    inputs = layer.get("inputs", ["input"] if first else [])
    return [inputs] if isinstance(inputs, str) else list(inputs)
