"""Caffe import: translate a deploy.prototxt (read by cnnkit.prototxt) into a cnnkit network
(`model:` mapping), keeping Caffe's semantics: ceil pooling, LRN's alpha / n, BatchNorm + Scale.
With a .caffemodel (read by cnnkit.caffe.weights), its weights come along as a state_dict.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from cnnkit.caffe.colour import bgr_to_rgb
from cnnkit.caffe.deploy import deployed_layers, layer_type, sole_readers
from cnnkit.caffe.fields import (
    as_integer,
    fillers,
    flag,
    integer,
    learning,
    multipliers,
    real,
    require,
    sizes,
)
from cnnkit.caffe.schema import check_layer, check_net
from cnnkit.errors import ConfigError, brief, one_line, validation_message
from cnnkit.nn.kinds import KINDS
from cnnkit.nn.layers import Shape, ShapeError
from cnnkit.nn.names import reserved_name
from cnnkit.nn.spec import suggest
from cnnkit.prototxt import Message, parse_prototxt


@dataclass
class CaffeImport:
    """A translated prototxt: the `model:` mapping, the state_dict of its .caffemodel (None
    without one) and notes for the network file's header (the layers renamed)."""

    model: dict[str, Any]
    state: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


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


def read_caffe(path: str | Path, caffemodel: str | Path | None = None,
               keep_bgr: bool = False) -> CaffeImport:  # fmt: skip
    """A Caffe deploy prototxt (and its trained .caffemodel) as a cnnkit network. Caffe's
    colour nets read BGR images (OpenCV's order) of 0-255 pixels less the mean: the trained
    weights of the layers reading a 3-channel input get their input channels reversed, so the
    network reads RGB as every cnnkit and torchvision path gives it, and the network file a
    `preprocess:` of Caffe's scale and ImageNet's mean (`keep_bgr`: neither, for a net that
    was trained on RGB)."""
    from cnnkit.caffe.weights import caffe_state_dict, read_caffemodel

    translator = _translator(path)
    model = translator.run()
    state = None
    if caffemodel is not None:
        state = caffe_state_dict(model, translator.sources, read_caffemodel(caffemodel))
        if not keep_bgr and model["input"][0] == 3:
            translator.notes += bgr_to_rgb(model, state)
    return CaffeImport(model, state, translator.notes)


def import_caffe(path: str | Path) -> dict[str, Any]:
    """Read a Caffe deploy prototxt file and return the equivalent cnnkit `model:` mapping."""
    return read_caffe(path).model


def import_caffe_weights(path: str | Path, caffemodel: str | Path) -> tuple[dict[str, Any], dict]:
    """A deploy prototxt and its trained .caffemodel: (cnnkit `model:` mapping, state_dict)."""
    imported = read_caffe(path, caffemodel)
    return imported.model, imported.state


def _translator(path: str | Path) -> _Translator:
    path = Path(path)
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file: a deploy .prototxt is text (a trained "
                          ".caffemodel comes second)") from None  # fmt: skip
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or one_line(e, 160)}") from None
    return _Translator(parse_prototxt(text, str(path)), str(path))


def translate(net: Message, source: str = "prototxt") -> dict[str, Any]:
    """Translate a parsed Caffe NetParameter into a cnnkit `model:` mapping."""
    return _Translator(net, source).run()


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


class _Translator:
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
        caffe_layers = deployed_layers(self.net.all("layer") + self.net.all("layers"), self.source)
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

    # -- layer types ------------------------------------------------------------------------------

    def _convolution(self, layer: Message, last: bool, kind: str = "conv") -> None:
        p, here = layer.sub("convolution_param"), self.here
        what = "Convolution" if kind == "conv" else "Deconvolution"
        require(here, integer(here, p, "axis", 1) == 1, f"{what} axis must be 1")
        spec: dict[str, Any] = {"type": kind, "out_channels": integer(here, p, "num_output", 0)}
        spec["kernel_size"] = sizes(here, p, "kernel", None)
        require(here, spec["kernel_size"] is not None, f"{what} needs kernel_size")
        _put(spec, "stride", sizes(here, p, "stride", 1), 1)
        _put(spec, "padding", sizes(here, p, "pad", 0, alone=True), 0)  # Caffe: pad_w 0
        _put(spec, "dilation", sizes(here, p, "dilation", 1), 1)
        _put(spec, "groups", integer(here, p, "group", 1), 1)
        _put(spec, "bias", flag(here, p, "bias_term", True), True)
        self._emit(layer, {**spec, **learning(here, layer, p, self.notes)})

    def _deconvolution(self, layer: Message, last: bool) -> None:
        """Caffe's Deconvolution: torch's ConvTranspose2d with no output_padding; its weight
        blob is (in, out / group, kh, kw) as torch's."""
        self._convolution(layer, last, kind="conv_transpose")

    def _innerproduct(self, layer: Message, last: bool) -> None:
        p, here = layer.sub("inner_product_param"), self.here
        require(here, integer(here, p, "axis", 1) == 1, "InnerProduct axis must be 1")
        spec: dict[str, Any] = {"type": "linear", "out_features": integer(here, p, "num_output", 0)}
        _put(spec, "bias", flag(here, p, "bias_term", True), True)
        name = self._emit(layer, {**spec, **learning(here, layer, p, self.notes)})
        if flag(here, p, "transpose", False):  # Caffe then holds W as (in, out): y = x @ W
            self.sources[name] = [(str(layer.get("name", "")), "linear_t")]

    def _pooling(self, layer: Message, last: bool) -> None:
        p = layer.sub("pooling_param")
        method = _enum(p.get("pool", "MAX"), _POOL_METHODS)
        why = " (stochastic pooling is not imported)" if method == "STOCHASTIC" else ""
        require(self.here, method in ("MAX", "AVE"), f"pool: {method} is not MAX or AVE{why}")
        if flag(self.here, p, "global_pooling", False):
            shape = self.shapes[self._bottom(layer.get("bottom"))]
            require(
                self.here, len(shape) == 3, f"global_pooling needs a (C, H, W) input, not {shape}"
            )
            if method == "AVE":  # keeps Caffe's (C, 1, 1) output
                return self._emit(layer, {"type": "adaptive_avgpool", "output_size": 1})
            return self._emit(
                layer, {"type": "maxpool", "kernel_size": list(shape[1:]), "stride": 1}
            )
        spec: dict[str, Any] = {"type": "maxpool" if method == "MAX" else "avgpool"}
        spec["kernel_size"] = sizes(self.here, p, "kernel", None)
        require(self.here, spec["kernel_size"] is not None, "Pooling needs kernel_size")
        spec["stride"] = sizes(
            self.here, p, "stride", 1
        )  # Caffe's default is 1, torch's the kernel
        _put(spec, "padding", sizes(self.here, p, "pad", 0), 0)
        mode = p.get("round_mode", "CEIL")  # Caffe rounds up unless told
        require(self.here, mode in _ROUND_MODES, f"pooling_param round_mode: {brief(mode)} is "
                "not CEIL or FLOOR")  # fmt: skip
        spec["ceil_mode"] = _ROUND_MODES[mode]
        self._emit(layer, spec)

    def _lrn(self, layer: Message, last: bool) -> None:
        p, here = layer.sub("lrn_param"), self.here
        region = _enum(p.get("norm_region", "ACROSS_CHANNELS"), _LRN_REGIONS)
        require(here, region in _LRN_REGIONS, f"LRN {region} is not supported")
        spec = {"type": "lrn", "convention": "caffe", "size": integer(here, p, "local_size", 5)}
        require(
            here,
            spec["size"] % 2 == 1,
            f"LRN local_size {spec['size']}: Caffe takes odd "
            "sizes only (a window centred on the channel)",
        )
        spec.update(alpha=real(here, p, "alpha", 1.0), beta=real(here, p, "beta", 0.75))
        if region == "WITHIN_CHANNEL":  # Caffe ignores k there: 1 + alpha * mean(a^2)
            return self._emit(layer, {**spec, "region": "within_channel", "k": 1.0})
        self._emit(layer, {**spec, "k": real(here, p, "k", 1.0)})

    def _prelu(self, layer: Message, last: bool) -> None:
        p = layer.sub("prelu_param")
        spec: dict[str, Any] = {"type": "prelu"}
        _put(spec, "channelwise", not flag(self.here, p, "channel_shared", False), True)
        filler = p.get("filler")
        if filler is not None:
            constant = str(filler.get("type", "constant")) == "constant"
            require(self.here, constant, "PReLU filler must be constant")
            _put(spec, "init_slope", real(self.here, filler, "value", 0.0), 0.25)
        self._emit(layer, {**spec, **multipliers(self.here, layer, ("weight",))})  # the slope

    def _relu(self, layer: Message, last: bool) -> None:
        slope = real(self.here, layer.sub("relu_param"), "negative_slope", 0.0)
        spec = {"type": "leaky_relu", "negative_slope": slope} if slope else {"type": "relu"}
        self._emit(layer, spec)

    def _tanh(self, layer: Message, last: bool) -> None:
        self._emit(layer, {"type": "tanh"})

    def _sigmoid(self, layer: Message, last: bool) -> None:
        self._emit(layer, {"type": "sigmoid"})

    def _dropout(self, layer: Message, last: bool) -> None:
        ratio = real(self.here, layer.sub("dropout_param"), "dropout_ratio", 0.5)
        self._emit(layer, {"type": "dropout", "p": ratio})

    def _flatten(self, layer: Message, last: bool) -> None:
        p, here = layer.sub("flatten_param"), self.here
        ok = integer(here, p, "axis", 1) == 1 and integer(here, p, "end_axis", -1) == -1
        require(here, ok, "Flatten supports axis 1 to the end only")
        self._emit(layer, {"type": "flatten"})

    def _concat(self, layer: Message, last: bool) -> None:
        p, here = layer.sub("concat_param"), self.here
        axis = integer(here, p, "axis", integer(here, p, "concat_dim", 1))
        dims = (
            len(self.shapes[self._bottom(layer.all("bottom")[0])]) + 1 if layer.all("bottom") else 4
        )
        require(
            here,
            -dims <= axis < dims and axis % dims == 1,
            "Concat supports the channel axis (1, or -3 of 4) only",
        )
        self._emit(layer, {"type": "concat"})

    def _eltwise(self, layer: Message, last: bool) -> None:
        p = layer.sub("eltwise_param")
        op = _enum(p.get("operation", "SUM"), tuple(_ELTWISE))
        require(self.here, op in _ELTWISE, f"Eltwise operation {brief(op)}: SUM, PROD or MAX")
        coeffs = p.all("coeff")
        require(
            self.here,
            all(c == 1 for c in coeffs),
            "Eltwise coeff other than 1 is not imported (cnnkit's add sums its inputs as they are)",
        )
        self._emit(layer, {"type": _ELTWISE[op]})

    def _batchnorm(self, layer: Message, last: bool) -> None:
        p = layer.sub("batch_norm_param")
        spec = {"type": "batchnorm", "eps": real(self.here, p, "eps", 1e-5), "affine": False}
        fraction = real(self.here, p, "moving_average_fraction", 0.999)
        spec["momentum"] = round(1.0 - fraction, 9)
        self._emit(layer, spec)

    def _scale(self, layer: Message, last: bool) -> None:
        """Caffe's BatchNorm has no scale and shift: the Scale after it adds them, folded into
        the BatchNorm (torch's affine) where nothing else reads the un-scaled output."""
        held, caffe_name = self._bottom(layer.get("bottom")), str(layer.get("name", ""))
        norm = self.layers[-1] if self.layers else {}
        ok = norm.get("name") == held and norm.get("type") == "batchnorm" and not norm["affine"]
        ok = ok and len(layer.all("bottom")) == 1
        require(self.here, ok, "Scale is supported only right after a BatchNorm (one bottom)")
        p, dims = layer.sub("scale_param"), len(self.shapes[held]) + 1  # with the batch axis
        axis, count = integer(self.here, p, "axis", 1), integer(self.here, p, "num_axes", 1)
        per_channel = axis % dims == 1 if -dims <= axis < dims else False
        count_ok = count == 1 or (count == -1 and dims == 2)  # -1: to the last axis
        require(self.here, per_channel and count_ok, "Scale supports one factor per channel "
                f"only (axis 1, num_axes 1), not axis {axis}, num_axes {count}")  # fmt: skip
        bias = flag(self.here, p, "bias_term", False)
        learned = multipliers(self.here, layer, ("weight", "bias") if bias else ("weight",))
        blocks = {"weight": "filler", "bias": "bias_filler"} if bias else {"weight": "filler"}
        given = fillers(self.here, p, blocks, self.notes)  # Caffe's defaults: 1 and 0
        if not bias:  # x * gamma
            name = self._emit(layer, {"type": "scale", **learned, **given})
            self.sources[name] = [(caffe_name, "channel_scale")]
        elif layer in self.folds:
            norm.update(affine=True, **learned, **given)
            self.sources[held].append((caffe_name, "scale"))
            for top in layer.all("top"):
                self.blobs[top] = held
        else:  # gamma * x + beta beside a reader of x: a depthwise 1x1 convolution computes it
            shape = self.shapes[held]
            why = "Scale with bias_term beside another reader of its (N, F) BatchNorm output"
            require(self.here, len(shape) == 3, f"{why}: cnnkit cannot express it")
            conv = {"type": "conv", "out_channels": shape[0], "kernel_size": 1, "groups": shape[0],
                    "init": {"weight": 1.0, "bias": 0.0, **given.get("init", {})}, **learned}  # fmt: skip
            self.sources[self._emit(layer, conv)] = [(caffe_name, "scale_conv")]

    def _split(self, layer: Message, last: bool) -> None:
        self._alias(layer)

    def _softmax(self, layer: Message, last: bool) -> None:
        require(self.here, last, "Softmax is supported only as the last layer (it is dropped)")
        self._alias(layer)  # the network returns logits


SUPPORTED = (
    "Input", "Convolution", "Deconvolution", "Pooling", "LRN", "ReLU", "TanH", "Sigmoid",
    "InnerProduct", "Dropout", "Softmax", "Concat", "Eltwise", "BatchNorm", "Scale", "Flatten", "Split", "PReLU",
)  # fmt: skip
# caffe.proto's enums in the order of their numbers (the text format takes either)
_POOL_METHODS = ("MAX", "AVE", "STOCHASTIC")
_LRN_REGIONS = ("ACROSS_CHANNELS", "WITHIN_CHANNEL")
_ROUND_MODES = {"CEIL": True, "FLOOR": False, 0: True, 1: False}
_ELTWISE = {"PROD": "mul", "SUM": "add", "MAX": "max"}


def _enum(value: Any, names: tuple[str, ...]) -> str:
    """An enum field's name, given by name or by its number in caffe.proto."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(names):
        return names[value]
    return str(value)


def _put(spec: dict[str, Any], key: str, value: Any, default: Any) -> None:
    if value != default:
        spec[key] = value


def _clean(name: Any) -> str:
    """A Caffe name as a cnnkit name: `inception_3a/1x1` -> `inception_3a_1x1`."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", str(name)).strip("_") or "layer"
