"""Caffe's colour order: its colour nets read BGR images (OpenCV's) of 0-255 pixels less the
training set's mean; cnnkit reads RGB, so an import turns the first convolutions round."""

from __future__ import annotations

from typing import Any

CAFFE_IMAGENET_MEAN = [122.68, 116.67, 104.01]  # ilsvrc_2012_mean.binaryproto per channel, RGB


def bgr_to_rgb(model: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """Reverse the input channels of the weights of every layer reading the network's input
    (convolutions, as Caffe's colour nets begin), in place; the notes for the header."""
    readers = [layer for i, layer in enumerate(model["layers"])
               if "input" in layer.get("inputs", ["input"] if i == 0 else [])]  # fmt: skip
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
    return [f"{names}: input channels reversed from Caffe's BGR to RGB (import-caffe "
            "--keep-bgr: not, for a net trained on RGB images)",
            "preprocess: Caffe's 0-255 pixels less ImageNet's mean (ilsvrc_2012_mean, per "
            "channel, RGB): set mean to your training set's if it was not ImageNet"]  # fmt: skip
