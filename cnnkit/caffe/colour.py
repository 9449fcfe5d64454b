"""Caffe's colour order: its colour nets read BGR images (OpenCV's) of 0-255 pixels less the
training set's mean; cnnkit reads RGB, so an import turns the first convolutions round (and
the per-channel layers before them), or puts a channel reversal first where it cannot."""

from __future__ import annotations

from typing import Any

import torch

CAFFE_IMAGENET_MEAN = [122.68, 116.67, 104.01]  # ilsvrc_2012_mean.binaryproto per channel, RGB
CAFFE_RESIZE = 256  # Caffe's ImageNet sets: 256 x 256 images, cropped to 227 or 224
IMAGENET_CROPS = (224, 227)


# layers whose output channel c is computed from input channel c alone: the input's order
# reversed, their output's is reversed too, with their per-channel parameters (LRN across
# channels sums a window centred on c, the same window reversed)
CHANNELWISE = ("batchnorm", "scale", "prelu", "relu", "leaky_relu", "tanh", "sigmoid", "dropout",
               "maxpool", "avgpool", "adaptive_avgpool", "lrn", "crop", "elu", "silu", "softplus",
               "relu6", "power", "upsample", "pad", "softmax")  # fmt: skip
# (softmax across channels: the same sums, its outputs in the reversed order too)
ELEMENTWISE = ("add", "mul", "max")  # of inputs reversed alike: reversed alike


def bgr_to_rgb(model: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """Make the network read RGB where Caffe's read BGR, in place: follow the reversed channel
    order from the input through per-channel layers (batch norm, Scale, PReLU, pooling...),
    reversing their parameters, to the convolutions that mix the channels, whose weights' input
    channels are reversed; the notes for the header. A net where the order cannot be followed
    so (a concat or a linear layer of the reversed channels) gets a 1x1 convolution that
    reverses the channels put first, so that it reads RGB all the same."""
    flipped = _reversed_order(model, state)
    if flipped is None:
        notes = [f"{_reversal_first(model, state)}: a 1x1 convolution that reverses the channels, "
                 "put first: the input is read by layers that cannot be turned from Caffe's BGR "
                 "to RGB themselves (only convolutions and per-channel layers before them can) "
                 "(import-caffe --keep-bgr: not, for a net trained on RGB images)"]  # fmt: skip
    else:
        for key, dim in flipped.items():
            state[key] = state[key].flip(dim).contiguous()
        names = ", ".join(dict.fromkeys(key.rsplit(".", 1)[0] for key in flipped))
        notes = [
            f"{names}: input channels reversed from Caffe's BGR to RGB (import-caffe "
            "--keep-bgr: not, for a net trained on RGB images)"
        ]
    height, width = (model["input"] + [0, 0])[1:3]
    if height != width:  # (a network file's preprocess is for square images only)
        return [*notes, "feed it RGB 0-255 pixels less the training set's mean (ImageNet's: "
                f"{', '.join(map(str, CAFFE_IMAGENET_MEAN))}), as Caffe's were"]  # fmt: skip
    model["preprocess"] = {"mean": list(CAFFE_IMAGENET_MEAN), "std": [1.0, 1.0, 1.0]}
    notes.append("preprocess: Caffe's 0-255 pixels less ImageNet's mean (ilsvrc_2012_mean, per "
                 "channel, RGB), unscaled: set mean to your training set's if it was not "
                 "ImageNet, and std to 1 / its transform_param scale if it had one (scale 0.017, "
                 "as MobileNet's and DenseNet's ports: std 58.8)")  # fmt: skip
    if height == width and IMAGENET_CROPS[0] <= height <= IMAGENET_CROPS[1]:
        model["preprocess"]["resize"] = CAFFE_RESIZE
        notes.append(f"preprocess: images squashed to {CAFFE_RESIZE} x {CAFFE_RESIZE}, then "
                     f"cropped to {height}, as Caffe's ImageNet models were trained and "
                     "caffe.Classifier reads them (classify --tencrop: its oversample)")  # fmt: skip
    return notes


def _reversal_first(model: dict[str, Any], state: dict[str, Any]) -> str:
    """Put a 1x1 convolution that reverses the input's channels (exact: one weight of 1 per
    output) before every layer, in place; its name."""
    taken = {layer["name"] for layer in model["layers"]}
    name = next(
        n for n in (f"rgb_to_bgr{i or ''}" for i in range(len(taken) + 1)) if n not in taken
    )
    for layer in model["layers"]:
        inputs = layer.get("inputs")
        if inputs == "input" or (isinstance(inputs, list) and "input" in inputs):
            layer["inputs"] = name if inputs == "input" else [
                name if value == "input" else value for value in inputs]  # fmt: skip
    channels = model["input"][0]
    model["layers"].insert(0, {"name": name, "type": "conv", "out_channels": channels,
                               "kernel_size": 1, "bias": False})  # fmt: skip
    dtype = next((v.dtype for v in state.values() if v.is_floating_point()), torch.float32)
    state[f"{name}.weight"] = torch.eye(channels, dtype=dtype).flip(0)[:, :, None, None].clone()
    return name


def _reversed_order(model: dict[str, Any], state: dict[str, Any]) -> dict[str, int] | None:
    """The state keys to reverse (key -> dim) so that the network reads its input's channels in
    the other order, or None where that order cannot be followed to layers that mix channels."""
    reversed_values, flips, previous = {"input"}, {}, "input"
    for layer in model["layers"]:
        name, kind, inputs = layer["name"], layer["type"], layer.get("inputs", [previous])
        inputs, previous = [inputs] if isinstance(inputs, str) else inputs, name
        held = [value in reversed_values for value in inputs]
        if kind == "crop":  # (its second input gives a size only)
            held = held[:1]
        if not any(held):
            continue
        own = {k: v for k, v in state.items() if k == name or k.startswith(f"{name}.")}
        weight = own.get(f"{name}.weight")
        if (
            kind in ("conv", "conv_transpose")
            and layer.get("groups", 1) == 1
            and weight is not None
        ):
            flips[f"{name}.weight"] = 1 if kind == "conv" else 0  # (out, in, ...) / (in, out, ...)
            continue  # its output: in its own order
        depthwise = kind == "conv" and weight is not None and weight.shape[1] == 1 and (
            layer.get("groups") == layer.get("out_channels") == len(weight))  # fmt: skip
        if (
            (kind in CHANNELWISE or depthwise)
            and len(held) == 1
            or (kind in ELEMENTWISE and all(held))
        ):
            flips.update({key: 0 for key, value in own.items() if value.ndim >= 1})
            reversed_values.add(name)
        else:  # a concat, a linear layer or a grouped convolution of the reversed channels
            return None
    return None if previous in reversed_values else flips
