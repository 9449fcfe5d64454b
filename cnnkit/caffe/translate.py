"""Caffe import: translate a deploy.prototxt (read by cnnkit.prototxt) into a cnnkit network
(`model:` mapping), keeping Caffe's semantics: ceil pooling, LRN's alpha / n, BatchNorm + Scale.
With a .caffemodel (read by cnnkit.caffe.weights), its weights come along as a state_dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cnnkit.caffe.colour import bgr_to_rgb
from cnnkit.caffe.translator import Translator
from cnnkit.errors import ConfigError, one_line
from cnnkit.prototxt import Message, parse_prototxt


@dataclass
class CaffeImport:
    """A translated prototxt: the `model:` mapping, the state_dict of its .caffemodel (None
    without one) and notes for the network file's header (the layers renamed)."""

    model: dict[str, Any]
    state: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def read_caffe(path: str | Path, caffemodel: str | Path | None = None, keep_bgr: bool = False,
               output: str | None = None, size: tuple[int, int] | None = None) -> CaffeImport:  # fmt: skip
    """A Caffe deploy prototxt (and its trained .caffemodel) as a cnnkit network. Caffe's
    colour nets read BGR images (OpenCV's order) of 0-255 pixels less the mean: the trained
    weights of the layers reading a 3-channel input get their input channels reversed, so the
    network reads RGB as every cnnkit and torchvision path gives it, and the network file a
    `preprocess:` of Caffe's scale and ImageNet's mean (`keep_bgr`: neither, for a net that
    was trained on RGB). `output`: the blob the network returns, where the net has several
    (the layers that do not feed it left out); `size`: the input's (H, W) in place of the
    prototxt's."""
    from cnnkit.caffe.weights import caffe_state_dict, read_caffemodel

    translator = _translator(path, output, size)
    model = translator.run()
    state = None
    if caffemodel is not None:
        state = caffe_state_dict(model, translator.sources, read_caffemodel(caffemodel))
        if not keep_bgr and len(model["input"]) == 3 and model["input"][0] == 3:  # images
            translator.notes += bgr_to_rgb(model, state)
        if len(model["input"]) == 3 and model["input"][0] == 1 and "preprocess" not in model:
            translator.notes.append(
                "preprocess: none in a deploy prototxt: cnnkit feeds greyscale pixels / 255 "
                "(near Caffe's LeNet's transform_param scale 0.00390625); for a net trained "
                "on 0-255 pixels less a mean, set preprocess: {mean: [M], std: [1]}"
            )
    return CaffeImport(model, state, translator.notes)


def import_caffe(path: str | Path) -> dict[str, Any]:
    """Read a Caffe deploy prototxt file and return the equivalent cnnkit `model:` mapping."""
    return read_caffe(path).model


def import_caffe_weights(path: str | Path, caffemodel: str | Path) -> tuple[dict[str, Any], dict]:
    """A deploy prototxt and its trained .caffemodel: (cnnkit `model:` mapping, state_dict)."""
    imported = read_caffe(path, caffemodel)
    return imported.model, imported.state


def _translator(path: str | Path, output: str | None = None,
                size: tuple[int, int] | None = None) -> Translator:  # fmt: skip
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # (a Windows editor's byte-order mark)
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file: a deploy .prototxt is text (a trained "
                          ".caffemodel comes second)") from None  # fmt: skip
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or one_line(e, 160)}") from None
    return Translator(parse_prototxt(text, str(path)), str(path), output, size)


def translate(net: Message, source: str = "prototxt") -> dict[str, Any]:
    """Translate a parsed Caffe NetParameter into a cnnkit `model:` mapping."""
    return Translator(net, source).run()


def network_yaml(model: dict[str, Any], header: str = "") -> str:
    """A network file for `model`, one layer per line like the zoo's files."""
    lines = [f"# {line}" for line in header.splitlines()] + ["model:"]
    for key in ("name", "input", "weights", "preprocess"):
        if key in model:
            lines.append(f"  {key}: {_flow(model[key])}")
    lines.append("  layers:")
    lines += [f"    - {_flow(layer)}" for layer in model["layers"]]
    return "\n".join(lines) + "\n"


def _flow(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False)
    return text.strip().removesuffix("...").strip()  # a plain scalar ends with a '...' marker
