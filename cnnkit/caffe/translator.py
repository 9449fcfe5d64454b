"""The walk over a deploy net's layers (`Translator`): which cnnkit layer holds each Caffe blob,
the input, names and shapes checked as each layer is emitted, and the one-output rule; the
layer types themselves are caffe/layer_types.py's."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from cnnkit.caffe.deploy import deployed_layers, layer_type, net_stages, sole_readers
from cnnkit.caffe.fields import as_integer, require
from cnnkit.caffe.layer_types import SUPPORTED, LayerTypes
from cnnkit.caffe.schema import check_layer, check_net
from cnnkit.errors import ConfigError, brief, plural, suggest, validation_message
from cnnkit.nn.kinds import KINDS
from cnnkit.nn.layers import Shape, ShapeError
from cnnkit.nn.names import reserved_name
from cnnkit.nn.stages import MAX_LAYERS
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

    def __init__(self, net: Message, source: str, output: str | None = None,
                 size: tuple[int, int] | None = None):  # fmt: skip
        self.net, self.source, self.output = net, source, output  # output: the blob returned
        self.size = size  # (H, W) in place of the prototxt's (a placeholder's)
        self.layers: list[dict[str, Any]] = []
        self.blobs: dict[str, str] = {}  # Caffe blob -> cnnkit value name
        self.shapes: dict[str, Shape] = {}  # cnnkit value name -> output shape
        self.read: set[str] = set()  # cnnkit values some layer reads
        self.input: list[int] | None = None
        # cnnkit layer -> the Caffe layers whose blobs are its weights: [(caffe name, role)]
        self.sources: dict[str, list[tuple[str, str]]] = {}
        self.notes: list[str] = []  # what the network file's header should say
        self.folds: set[Message] = set()  # the Scale layers that fold into their BatchNorm
        self.suffixes: dict[str, int] = {}  # a name -> the last n of the `name_n` it was given
        self.bare_inputs: set[str] = set()  # net-level `input:` names given no dims

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
        if self.output is not None:
            self._keep_what_feeds(self.output)
        unread = [n["name"] for n in self.layers[:-1] if n["name"] not in self.read]
        if unread:
            raise ConfigError(
                f"{self.source}: several outputs ({', '.join(unread)} and "
                f"{self.layers[-1]['name']}); a cnnkit network has one (--output BLOB: the "
                "one it returns, the layers that do not feed it left out)"
            )
        last = self.layers[-1]["name"]
        if self.input[1:] == [1, 1]:  # OpenPose's prototxts: sizes "defined at runtime"
            self.notes.append("input 1 x 1: a placeholder for the size the net runs at? Set "
                              "input: [C, H, W] here to that size (or import with "
                              "--input-size H,W)")  # fmt: skip
        elif len(self.shapes[last]) == 3 and self.shapes[last][1:] == (1, 1):  # SqueezeNet, NIN
            self._count_layer()
            name = self._unique_name("flatten")  # Caffe's Softmax over (C, 1, 1): the class scores
            self.layers.append({"name": name, "type": "flatten"})
            self.shapes[name] = self.shapes[last][:1]
        model: dict[str, Any] = {"input": self.input, "layers": self.layers}
        return {"name": _clean(self.net.get("name")), **model} if self.net.get("name") else model

    def _keep_what_feeds(self, blob: str) -> None:
        """Only the layers that the Caffe blob `blob` is computed from, it last (a deploy file's
        other heads, GoogLeNet's auxiliary classifiers, HED's side outputs, left out)."""
        target = self.blobs.get(blob, blob if blob in self.shapes else None)  # (or a layer's name)
        if target in (None, "input"):
            tops = [b for b, held in self.blobs.items() if held != "input"]
            shown = ", ".join(map(brief, tops[-8:]))
            raise ConfigError(f"{self.source}: --output {brief(blob)}: no layer's top (the last "
                              f"tops: {shown})")  # fmt: skip
        reads, previous = {}, "input"
        for layer in self.layers:  # each layer's inputs, named (a layer reads the one before)
            given = layer.get("inputs", previous)
            reads[layer["name"]] = [given] if isinstance(given, str) else list(given)
            previous = layer["name"]
        kinds = {layer["name"]: layer["type"] for layer in self.layers}
        while kinds.get(target) == "softmax":  # a Softmax returned: dropped, as a final one is
            target = reads[target][0]
        if target == "input":
            raise ConfigError(f"{self.source}: --output {brief(blob)}: the input's own softmax, "
                              "no layer of the network")  # fmt: skip
        needed, todo = set(), [target]
        while todo:
            name = todo.pop()
            if name != "input" and name not in needed:
                needed.add(name)
                todo.extend(reads[name])
        left_out = [layer["name"] for layer in self.layers if layer["name"] not in needed]
        kept, previous = [], "input"
        for layer in self.layers:
            if layer["name"] in needed:
                inputs = reads[layer["name"]]
                layer = {k: v for k, v in layer.items() if k != "inputs"}
                if inputs != [previous]:
                    layer["inputs"] = inputs if len(inputs) > 1 else inputs[0]
                kept.append(layer)
                previous = layer["name"]
        self.layers = kept
        self.read = {name for inputs in (reads[k] for k in needed) for name in inputs}
        self.sources = {k: v for k, v in self.sources.items() if k in needed}
        if left_out:
            more = ", ..." if len(left_out) > 6 else ""
            self.notes.append(f"--output {blob}: what does not feed it is left out, "
                              f"{plural(len(left_out), 'layer')} ({', '.join(left_out[:6])}"
                              f"{more})")  # fmt: skip

    # -- inputs ---------------------------------------------------------------------------------

    def _net_level_input(self) -> None:
        names = self.net.all("input")
        if not names:
            return
        if not self.net.all("input_dim") and not self.net.all("input_shape"):
            self.bare_inputs = set(names)  # a legacy `input:` alone, which Caffe strips
            return  # (UpgradeNetInput): an Input layer may give it
        dims = self.net.all("input_dim") or [
            d for shape in self.net.all("input_shape") for d in shape.all("dim")
        ]
        lines = [line for name, _, line in self.net.fields if name in ("input_dim", "input_shape")]
        self.here = f"{self.source}:{lines[0] if lines else self.net.line or 1}"  # the dims'
        self._set_input(names, dims)

    def _input(self, layer: Message, last: bool) -> None:
        shapes = layer.sub("input_param").all("shape")
        self._set_input(layer.all("top"), shapes[0].all("dim") if shapes else [])

    def _set_input(self, names: list[str], dims: list[Any]) -> None:
        if len(names) != 1 or self.input is not None:
            raise ConfigError(f"{self.here}: cnnkit networks take one input, got {names}")
        dims = [as_integer(self.here, "dim", d) for d in dims]
        written = f"input dims ({', '.join(map(brief, dims))})"
        if len(dims) not in (2, 4):
            raise ConfigError(f"{self.here}: {written}: expected N, C, H, W (or N, F)")
        what = "C, H and W" if len(dims) == 4 else "F"  # (N, the batch, cnnkit takes as given)
        require(self.here, min(dims[1:]) > 0, f"{written}: {what} must be 1 or more")
        if self.size is not None:
            require(self.here, len(dims) == 4, f"--input-size: {written} is no image's")
            self.notes.append(f"input {self.size[0]} x {self.size[1]} (--input-size; the "
                              f"prototxt's: {dims[2]} x {dims[3]})")  # fmt: skip
            dims = [*dims[:2], *self.size]
        self.input = dims[1:]
        self.blobs[names[0]] = "input"
        self.shapes["input"] = tuple(self.input)

    # -- emitting -------------------------------------------------------------------------------

    def _emit(self, layer: Message, spec: dict[str, Any], *, tops: list[str] | None = None,
              inputs: list[str] | None = None, name: str | None = None) -> str:  # fmt: skip
        """Add one cnnkit layer reading the Caffe layer's bottoms (or the cnnkit `inputs`
        given) and holding its tops (or the `tops` given: one of a Slice's outputs, or none: a
        step of a layer that takes two), named after it (or `name`); its name."""
        if inputs is None:
            inputs = [self._bottom(b) for b in layer.all("bottom")]
        if not inputs:
            raise ConfigError(f"{self.here}: layer {brief(layer.get('name'))} has no bottom")
        if len(inputs) > 1 and not KINDS[spec["type"]].many_inputs:
            raise ConfigError(f"{self.here}: layer {brief(layer.get('name'))}: a "
                              f"{layer_type(layer)} takes one bottom, not {len(inputs)}")  # fmt: skip
        self._count_layer()
        name = self._unique_name(name or layer.get("name") or spec["type"])
        previous = self.layers[-1]["name"] if self.layers else "input"
        spec = {"name": name, **spec}
        if inputs != [previous]:
            spec["inputs"] = inputs if len(inputs) > 1 else inputs[0]
        self.shapes[name] = self._shape(spec, inputs)
        self.layers.append(spec)
        self.read.update(inputs)
        for top in layer.all("top") if tops is None else tops:
            self.blobs[top] = name
        if spec["type"] in ("conv", "conv_transpose", "linear", "batchnorm", "prelu"):
            self.sources[name] = [(str(layer.get("name", "")), spec["type"])]
        return name

    def _count_layer(self) -> None:
        """An error before the network's layer MAX_LAYERS + 1 (build_model's limit)."""
        require(self.here, len(self.layers) < MAX_LAYERS, f"the network has more than "
                f"{MAX_LAYERS:,} layers, more than cnnkit builds")  # fmt: skip

    def _alias(self, layer: Message, kind: str) -> None:
        """A layer that changes nothing (Split, a final Softmax): its tops name its bottom."""
        source, count = self._first_bottom(layer), len(layer.all("bottom"))
        require(self.here, count == 1, f"layer {brief(layer.get('name'))}: a {kind} takes one "
                f"bottom, not {count} (as Caffe)")  # fmt: skip
        for top in layer.all("top"):
            self.blobs[top] = source

    def _first_bottom(self, layer: Message) -> str:
        """The cnnkit value of the layer's first bottom (an error where it has none)."""
        bottoms = layer.all("bottom")
        if not bottoms:
            raise ConfigError(f"{self.here}: layer {brief(layer.get('name'))} has no bottom")
        return self._bottom(bottoms[0])

    def _bottom(self, blob: Any) -> str:
        if blob not in self.blobs and blob in self.bare_inputs:
            raise ConfigError(f"{self.here}: input {brief(blob)} has no dims (input_dim or "
                              "input_shape) and no Input layer gives it")  # fmt: skip
        if blob not in self.blobs:
            raise ConfigError(
                f"{self.here}: bottom {brief(blob)} is not produced by an earlier layer"
            )
        return self.blobs[blob]

    def _unique_name(self, raw: str) -> str:
        base = clean = _clean(raw)
        if reserved_name(base):  # `input`, `train`, `to`, `in`: names cnnkit, torch or Python hold
            base += "_caffe"
        n = self.suffixes.get(base, 1)  # names taken stay taken: no search from 1 each time
        name = base if n == 1 else f"{base}_{n}"
        while name in self.shapes:
            n += 1
            name = f"{base}_{n}"
        self.suffixes[base] = n
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
