"""The walk over a deploy net's layers (`Translator`): which cnnkit layer holds each Caffe blob,
the input, names and shapes checked as each layer is emitted, and the one-output rule; the
layer types themselves are caffe/layer_types.py's."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from cnnkit.caffe.deploy import deployed_layers, layer_type, net_stages, sole_readers
from cnnkit.caffe.fields import as_integer
from cnnkit.caffe.layer_types import SUPPORTED, LayerTypes
from cnnkit.caffe.schema import check_layer, check_net
from cnnkit.errors import ConfigError, brief, suggest, validation_message
from cnnkit.nn.kinds import KINDS
from cnnkit.nn.layers import Shape, ShapeError
from cnnkit.nn.names import reserved_name
from cnnkit.prototxt import Message

TRAIN_VAL_LAYERS = {
    "Data",
    "ImageData",
    "HDF5Data",
    "MemoryData",
    "WindowData",
    "DummyData",
    "Python",
    "Accuracy",
}  # a train_val net's, which deploy nets replace or drop


class Translator(LayerTypes):
    """Walks Caffe's layers in order, keeping which cnnkit layer holds each Caffe blob."""

    def __init__(self, net: Message, source: str):
        self.net, self.source = net, source
        self.layers: list[dict[str, Any]] = []
        self.blobs: dict[str, str] = {}  # Caffe blob -> cnnkit value name
        self.shapes: dict[str, Shape] = {}  # cnnkit value name -> output shape
        self.read: set[str] = set()  # cnnkit values some layer reads
        self.input: list[int] | None = None
        # cnnkit layer -> the Caffe layers whose blobs are its weights: [(caffe name, role)]
        self.sources: dict[str, list[tuple[str, str]]] = {}
        self.notes: list[str] = []  # what the network file's header should say
        self.folds: set[Message] = set()  # the Scale layers that fold into their BatchNorm

    def run(self) -> dict[str, Any]:
        check_net(self.source, self.net)
        self._net_level_input()
        caffe_layers = deployed_layers(self.net.all("layer") + self.net.all("layers"), self.source,
                                       net_stages(self.source, self.net))  # fmt: skip
        self.folds = sole_readers(caffe_layers)
        v1 = set(map(id, self.net.all("layers")))  # the old `layers { }` syntax
        for index, layer in enumerate(caffe_layers):
            self.here = f"{self.source}:{layer.line}"
            kind = layer_type(layer)
            handler = getattr(self, f"_{kind.lower()}", None) if kind in SUPPORTED else None
            if handler is None:
                if not kind:  # no type: a misspelled `type` is named by the field check
                    check_layer(self.source, layer, id(layer) in v1)
                trainval = kind in TRAIN_VAL_LAYERS or kind.endswith("Loss")
                hint = (" (a train_val prototxt? give the deploy.prototxt: an Input layer in place "
                        "of the data layers, no loss or accuracy)") if trainval else (
                        suggest(kind, SUPPORTED) or f" (supported: {', '.join(SUPPORTED)})")  # fmt: skip
                raise ConfigError(
                    f"{self.here}: layer {brief(layer.get('name', '?'))} has type {brief(kind)}, "
                    f"which cnnkit cannot import{hint}"
                )
            check_layer(self.source, layer, id(layer) in v1)  # (after the type: a fork's
            handler(layer, last=index == len(caffe_layers) - 1)  # layer is its type's error)
        return self._result()

    def _result(self) -> dict[str, Any]:
        if self.input is None:
            raise ConfigError(
                f"{self.source}: no input (an Input layer or input_dim / input_shape)"
            )
        if not self.layers:
            raise ConfigError(f"{self.source}: no layers to import")
        unread = [n["name"] for n in self.layers[:-1] if n["name"] not in self.read]
        if unread:
            raise ConfigError(
                f"{self.source}: several outputs ({', '.join(unread)} and "
                f"{self.layers[-1]['name']}); a cnnkit network has one"
            )
        last = self.layers[-1]["name"]
        if len(self.shapes[last]) == 3 and self.shapes[last][1:] == (1, 1):  # SqueezeNet, NIN
            name = self._unique_name("flatten")  # Caffe's Softmax over (C, 1, 1): the class scores
            self.layers.append({"name": name, "type": "flatten"})
            self.shapes[name] = self.shapes[last][:1]
        model: dict[str, Any] = {"input": self.input, "layers": self.layers}
        return {"name": _clean(self.net.get("name")), **model} if self.net.get("name") else model

    # -- inputs ---------------------------------------------------------------------------------

    def _net_level_input(self) -> None:
        names = self.net.all("input")
        if not names:
            return
        dims = self.net.all("input_dim") or [
            d for shape in self.net.all("input_shape") for d in shape.all("dim")
        ]
        self.here = f"{self.source}:{self.net.line or 1}"
        self._set_input(names, dims)

    def _input(self, layer: Message, last: bool) -> None:
        shapes = layer.sub("input_param").all("shape")
        self._set_input(layer.all("top"), shapes[0].all("dim") if shapes else [])

    def _set_input(self, names: list[str], dims: list[int]) -> None:
        if len(names) != 1 or self.input is not None:
            raise ConfigError(f"{self.here}: cnnkit networks take one input, got {names}")
        if len(dims) not in (2, 4):
            raise ConfigError(f"{self.here}: input dims {dims}: expected N, C, H, W (or N, F)")
        self.input = [as_integer(self.here, "dim", d) for d in dims[1:]]
        self.blobs[names[0]] = "input"
        self.shapes["input"] = tuple(self.input)

    # -- emitting -------------------------------------------------------------------------------

    def _emit(self, layer: Message, spec: dict[str, Any]) -> str:
        """Add one cnnkit layer reading the Caffe layer's bottoms and holding its tops; its name."""
        inputs = [self._bottom(b) for b in layer.all("bottom")]
        if not inputs:
            raise ConfigError(f"{self.here}: layer {brief(layer.get('name'))} has no bottom")
        name = self._unique_name(layer.get("name") or spec["type"])
        previous = self.layers[-1]["name"] if self.layers else "input"
        spec = {"name": name, **spec}
        if inputs != [previous]:
            spec["inputs"] = inputs if len(inputs) > 1 else inputs[0]
        self.shapes[name] = self._shape(spec, inputs)
        self.layers.append(spec)
        self.read.update(inputs)
        for top in layer.all("top"):
            self.blobs[top] = name
        if spec["type"] in ("conv", "conv_transpose", "linear", "batchnorm", "prelu"):
            self.sources[name] = [(str(layer.get("name", "")), spec["type"])]
        return name

    def _alias(self, layer: Message) -> None:
        """A layer that changes nothing (Split, a final Softmax): its tops name its bottom."""
        source = self._bottom(layer.get("bottom"))
        for top in layer.all("top"):
            self.blobs[top] = source

    def _bottom(self, blob: Any) -> str:
        if blob not in self.blobs:
            raise ConfigError(
                f"{self.here}: bottom {brief(blob)} is not produced by an earlier layer"
            )
        return self.blobs[blob]

    def _unique_name(self, raw: str) -> str:
        base = clean = _clean(raw)
        if reserved_name(base):  # `input`, `train`, `to`, `in`: names cnnkit, torch or Python hold
            base += "_caffe"
        name, n = base, 1
        while name in self.shapes:
            n += 1
            name = f"{base}_{n}"
        if base != clean:
            self.notes.append(
                f"layer {clean} is {name} here: cnnkit, torch or Python holds that name"
            )
        return name

    def _shape(self, spec: dict[str, Any], inputs: list[str]) -> Shape:
        fields = {k: v for k, v in spec.items() if k not in ("name", "inputs")}
        try:
            layer = KINDS[spec["type"]].model_validate(fields)
            return layer.output_shape([self.shapes[i] for i in inputs])
        except ValidationError as e:
            raise ConfigError(
                f"{self.here}: layer {spec['name']!r}: {validation_message(e)}"
            ) from None
        except ShapeError as e:
            raise ConfigError(f"{self.here}: layer {spec['name']!r}: {e.field}: {e}") from None


def _clean(name: Any) -> str:
    """A Caffe name as a cnnkit name: `inception_3a/1x1` -> `inception_3a_1x1`."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", str(name)).strip("_") or "layer"
