"""Caffe's colour order: its colour nets read BGR images (OpenCV's) of 0-255 pixels less the
training set's mean; cnnkit reads RGB, so an import turns the first convolutions round (and
the per-channel layers before them)."""

from __future__ import annotations

from typing import Any

CAFFE_IMAGENET_MEAN = [122.68, 116.67, 104.01]  # ilsvrc_2012_mean.binaryproto per channel, RGB
CAFFE_RESIZE = 256  # Caffe's ImageNet sets: 256 x 256 images, cropped to 227 or 224
IMAGENET_CROPS = (224, 227)


# layers whose output channel c is computed from input channel c alone: the input's order
# reversed, their output's is reversed too, with their per-channel parameters (LRN across
# channels sums a window centred on c, the same window reversed)
CHANNELWISE = ("batchnorm", "scale", "prelu", "relu", "leaky_relu", "tanh", "sigmoid", "dropout",
               "maxpool", "avgpool", "adaptive_avgpool", "lrn", "crop", "elu", "silu", "softplus",
               "relu6", "power")  # fmt: skip
ELEMENTWISE = ("add", "mul", "max")  # of inputs reversed alike: reversed alike


def bgr_to_rgb(model: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """Make the network read RGB where Caffe's read BGR, in place: follow the reversed channel
    order from the input through per-channel layers (batch norm, Scale, PReLU, pooling...),
    reversing their parameters, to the convolutions that mix the channels, whose weights' input
    channels are reversed; the notes for the header. A net where the order cannot be followed
    so (a concat or a linear layer of the reversed channels) keeps Caffe's BGR, with a note."""
    flipped = _reversed_order(model, state)
    if flipped is None:
        return ["the input is read by layers that cnnkit cannot turn to RGB (only convolutions "
                "and per-channel layers before them can be): their weights keep Caffe's BGR "
                "channel order (feed images accordingly)"]  # fmt: skip
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
