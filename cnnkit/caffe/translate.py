"""Caffe import: translate a deploy.prototxt (read by cnnkit.prototxt) into a cnnkit network
(`model:` mapping), keeping Caffe's semantics: ceil pooling, LRN's alpha / n, BatchNorm + Scale.
With a .caffemodel (read by cnnkit.caffe.weights), its weights come along as a state_dict.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from cnnkit.errors import ConfigError, brief, one_line
from cnnkit.nn.kinds import KINDS
from cnnkit.nn.layers import Shape, ShapeError
from cnnkit.prototxt import Message, parse_prototxt

_V1_TYPES = {  # the old `layers { type: CONVOLUTION }` enum names
    "CONVOLUTION": "Convolution", "POOLING": "Pooling", "LRN": "LRN", "RELU": "ReLU",
    "TANH": "TanH", "SIGMOID": "Sigmoid", "INNER_PRODUCT": "InnerProduct", "DROPOUT": "Dropout",
    "SOFTMAX": "Softmax", "CONCAT": "Concat", "ELTWISE": "Eltwise", "FLATTEN": "Flatten",
    "SPLIT": "Split",
}  # fmt: skip


def import_caffe(path: str | Path) -> dict[str, Any]:
    """Read a Caffe deploy prototxt file and return the equivalent cnnkit `model:` mapping."""
    return _translator(path).run()


def import_caffe_weights(path: str | Path, caffemodel: str | Path) -> tuple[dict[str, Any], dict]:
    """A deploy prototxt and its trained .caffemodel: (cnnkit `model:` mapping, state_dict)."""
    from cnnkit.caffe.weights import caffe_state_dict, read_caffemodel

    translator = _translator(path)
    model = translator.run()
    return model, caffe_state_dict(model, translator.sources, read_caffemodel(caffemodel))


def _translator(path: str | Path) -> _Translator:
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {one_line(e, 160)}") from None
    return _Translator(parse_prototxt(text, str(path)), str(path))


def translate(net: Message, source: str = "prototxt") -> dict[str, Any]:
    """Translate a parsed Caffe NetParameter into a cnnkit `model:` mapping."""
    return _Translator(net, source).run()


def network_yaml(model: dict[str, Any], header: str = "") -> str:
    """A network file for `model`, one layer per line like the zoo's files."""
    lines = [f"# {line}" for line in header.splitlines()] + ["model:"]
    for key in ("name", "input", "weights"):
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

    def run(self) -> dict[str, Any]:
        self._net_level_input()
        caffe_layers = self.net.all("layer") + self.net.all("layers")
        for index, layer in enumerate(caffe_layers):
            if not _in_test_phase(layer):
                continue
            self.here = f"{self.source}:{layer.line}"
            kind = str(layer.get("type", ""))
            kind = _V1_TYPES.get(kind, kind)
            handler = getattr(self, f"_{kind.lower()}", None) if kind in SUPPORTED else None
            if handler is None:
                raise ConfigError(
                    f"{self.here}: layer {brief(layer.get('name', '?'))} has type {brief(kind)}, which "
                    f"cnnkit cannot import (supported: {', '.join(SUPPORTED)})"
                )
            handler(layer, last=index == len(caffe_layers) - 1)
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
        self.input = [int(d) for d in dims[1:]]
        self.blobs[names[0]] = "input"
        self.shapes["input"] = tuple(self.input)

    # -- emitting -------------------------------------------------------------------------------

    def _emit(self, layer: Message, spec: dict[str, Any]) -> None:
        """Add one cnnkit layer reading the Caffe layer's bottoms and holding its tops."""
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
        if spec["type"] in ("conv", "linear", "batchnorm", "prelu"):
            self.sources[name] = [(str(layer.get("name", "")), spec["type"])]

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
        base = _clean(raw)
        if base in ("input", "previous"):
            base += "_"
        name, n = base, 1
        while name in self.shapes:
            n += 1
            name = f"{base}_{n}"
        return name

    def _shape(self, spec: dict[str, Any], inputs: list[str]) -> Shape:
        fields = {k: v for k, v in spec.items() if k not in ("name", "inputs")}
        try:
            layer = KINDS[spec["type"]].model_validate(fields)
            return layer.output_shape([self.shapes[i] for i in inputs])
        except (ValidationError, ShapeError) as e:
            raise ConfigError(f"{self.here}: layer {spec['name']!r}: {e}") from None

    # -- layer types ------------------------------------------------------------------------------

    def _convolution(self, layer: Message, last: bool) -> None:
        p = layer.sub("convolution_param")
        _require(self.here, int(p.get("axis", 1)) == 1, "Convolution axis must be 1")
        spec: dict[str, Any] = {"type": "conv", "out_channels": int(p.get("num_output", 0))}
        spec["kernel_size"] = _hw(p, "kernel", None)
        _require(self.here, spec["kernel_size"] is not None, "Convolution needs kernel_size")
        _put(spec, "stride", _hw(p, "stride", 1), 1)
        _put(spec, "padding", _hw(p, "pad", 0), 0)
        _put(spec, "dilation", _hw(p, "dilation", 1), 1)
        _put(spec, "groups", int(p.get("group", 1)), 1)
        _put(spec, "bias", bool(p.get("bias_term", True)), True)
        self._emit(layer, {**spec, **_learning(self.here, layer, p)})

    def _innerproduct(self, layer: Message, last: bool) -> None:
        p = layer.sub("inner_product_param")
        _require(self.here, int(p.get("axis", 1)) == 1, "InnerProduct axis must be 1")
        spec: dict[str, Any] = {"type": "linear", "out_features": int(p.get("num_output", 0))}
        _put(spec, "bias", bool(p.get("bias_term", True)), True)
        self._emit(layer, {**spec, **_learning(self.here, layer, p)})

    def _pooling(self, layer: Message, last: bool) -> None:
        p = layer.sub("pooling_param")
        method = str(p.get("pool", "MAX"))
        _require(self.here, method in ("MAX", "AVE"), f"Pooling {method} is not supported")
        if p.get("global_pooling", False):
            _, h, w = self.shapes[self._bottom(layer.get("bottom"))]
            if method == "AVE":  # keeps Caffe's (C, 1, 1) output
                return self._emit(layer, {"type": "adaptive_avgpool", "output_size": 1})
            return self._emit(layer, {"type": "maxpool", "kernel_size": [h, w], "stride": 1})
        spec: dict[str, Any] = {"type": "maxpool" if method == "MAX" else "avgpool"}
        spec["kernel_size"] = _hw(p, "kernel", None)
        _require(self.here, spec["kernel_size"] is not None, "Pooling needs kernel_size")
        spec["stride"] = _hw(p, "stride", 1)  # Caffe's default stride is 1, torch's the kernel
        _put(spec, "padding", _hw(p, "pad", 0), 0)
        spec["ceil_mode"] = str(p.get("round_mode", "CEIL")) == "CEIL"  # Caffe rounds up
        self._emit(layer, spec)

    def _lrn(self, layer: Message, last: bool) -> None:
        p = layer.sub("lrn_param")
        region = str(p.get("norm_region", "ACROSS_CHANNELS"))
        _require(self.here, region in _LRN_REGIONS, f"LRN {region} is not supported")
        spec = {"type": "lrn", "convention": "caffe", "size": int(p.get("local_size", 5))}
        spec.update(alpha=float(p.get("alpha", 1.0)), beta=float(p.get("beta", 0.75)))
        if region == "WITHIN_CHANNEL":  # Caffe ignores k there: 1 + alpha * mean(a^2)
            return self._emit(layer, {**spec, "region": "within_channel", "k": 1.0})
        self._emit(layer, {**spec, "k": float(p.get("k", 1.0))})

    def _prelu(self, layer: Message, last: bool) -> None:
        p = layer.sub("prelu_param")
        spec: dict[str, Any] = {"type": "prelu"}
        _put(spec, "channelwise", not bool(p.get("channel_shared", False)), True)
        filler = p.get("filler")
        if filler is not None:
            constant = str(filler.get("type", "constant")) == "constant"
            _require(self.here, constant, "PReLU filler must be constant")
            _put(spec, "init_slope", float(filler.get("value", 0.0)), 0.25)
        self._emit(layer, spec)

    def _relu(self, layer: Message, last: bool) -> None:
        slope = float(layer.sub("relu_param").get("negative_slope", 0.0))
        spec = {"type": "leaky_relu", "negative_slope": slope} if slope else {"type": "relu"}
        self._emit(layer, spec)

    def _tanh(self, layer: Message, last: bool) -> None:
        self._emit(layer, {"type": "tanh"})

    def _sigmoid(self, layer: Message, last: bool) -> None:
        self._emit(layer, {"type": "sigmoid"})

    def _dropout(self, layer: Message, last: bool) -> None:
        ratio = float(layer.sub("dropout_param").get("dropout_ratio", 0.5))
        self._emit(layer, {"type": "dropout", "p": ratio})

    def _flatten(self, layer: Message, last: bool) -> None:
        p = layer.sub("flatten_param")
        ok = int(p.get("axis", 1)) == 1 and int(p.get("end_axis", -1)) == -1
        _require(self.here, ok, "Flatten supports axis 1 to the end only")
        self._emit(layer, {"type": "flatten"})

    def _concat(self, layer: Message, last: bool) -> None:
        p = layer.sub("concat_param")
        axis = int(p.get("axis", p.get("concat_dim", 1)))
        _require(self.here, axis == 1, "Concat supports the channel axis (1) only")
        self._emit(layer, {"type": "concat"})

    def _eltwise(self, layer: Message, last: bool) -> None:
        p = layer.sub("eltwise_param")
        op = str(p.get("operation", "SUM"))
        coeffs = p.all("coeff")
        _require(self.here, all(c == 1 for c in coeffs), "Eltwise coeff other than 1")
        self._emit(layer, {"type": {"SUM": "add", "PROD": "mul", "MAX": "max"}[op]})

    def _batchnorm(self, layer: Message, last: bool) -> None:
        p = layer.sub("batch_norm_param")
        spec = {"type": "batchnorm", "eps": float(p.get("eps", 1e-5)), "affine": False}
        spec["momentum"] = round(1.0 - float(p.get("moving_average_fraction", 0.999)), 9)
        self._emit(layer, spec)

    def _scale(self, layer: Message, last: bool) -> None:
        """Caffe's BatchNorm has no scale and shift: the Scale after it adds them (torch's affine)."""
        held = self._bottom(layer.get("bottom"))
        norm = self.layers[-1] if self.layers else {}
        ok = norm.get("name") == held and norm.get("type") == "batchnorm" and not norm["affine"]
        _require(self.here, ok, "Scale is supported only right after a BatchNorm")
        bias = bool(layer.sub("scale_param").get("bias_term", False))
        _require(self.here, bias, "Scale after BatchNorm needs bias_term: true")
        norm["affine"] = True
        self.sources[held].append((str(layer.get("name", "")), "scale"))
        for top in layer.all("top"):
            self.blobs[top] = held

    def _split(self, layer: Message, last: bool) -> None:
        self._alias(layer)

    def _softmax(self, layer: Message, last: bool) -> None:
        _require(self.here, last, "Softmax is supported only as the last layer (it is dropped)")
        self._alias(layer)  # the network returns logits


SUPPORTED = (
    "Input", "Convolution", "Pooling", "LRN", "ReLU", "TanH", "Sigmoid", "InnerProduct",
    "Dropout", "Softmax", "Concat", "Eltwise", "BatchNorm", "Scale", "Flatten", "Split", "PReLU",
)  # fmt: skip
_LRN_REGIONS = ("ACROSS_CHANNELS", "WITHIN_CHANNEL")


def _in_test_phase(layer: Message) -> bool:
    """False for layers that Caffe includes only in the TRAIN phase."""
    phases = [str(rule.get("phase", "")) for rule in layer.all("include")]
    return not phases or "TEST" in phases


def _hw(p: Message, what: str, default: Any) -> Any:
    """A Caffe size field: `what_size` / `what` (one value or [h, w]) or `what_h` + `what_w`."""
    h, w = p.get(f"{what}_h"), p.get(f"{what}_w")
    if h is not None or w is not None:
        return [int(h if h is not None else default), int(w if w is not None else default)]
    values = p.all(f"{what}_size") or p.all(what)
    if not values:
        return default
    return int(values[0]) if len(values) == 1 else [int(v) for v in values[:2]]


def _put(spec: dict[str, Any], key: str, value: Any, default: Any) -> None:
    if value != default:
        spec[key] = value


def _require(here: str, ok: bool, what: str) -> None:
    if not ok:
        raise ConfigError(f"{here}: {what}")


def _learning(here: str, layer: Message, p: Message) -> dict[str, Any]:
    """lr_mult / decay_mult from `param {}` blocks and init from the fillers."""
    out: dict[str, Any] = {}
    params = dict(zip(("weight", "bias"), layer.all("param"), strict=False))
    for key in ("lr_mult", "decay_mult"):
        mults = {n: float(m.get(key, 1.0)) for n, m in params.items()}
        if any(v != 1.0 for v in mults.values()):
            out[key] = mults
    init = {n: _filler(here, p.get(f"{n}_filler")) for n in ("weight", "bias")}
    init = {n: rule for n, rule in init.items() if rule is not None}
    if init:
        out["init"] = init
    return out


def _filler(here: str, filler: Message | None) -> Any:
    """A Caffe filler as a cnnkit init rule (None: absent)."""
    if filler is None:
        return None
    kind = str(filler.get("type", "constant"))
    if kind == "constant":
        return float(filler.get("value", 0.0))
    if kind == "gaussian":
        return {
            "normal": {"mean": float(filler.get("mean", 0.0)), "std": float(filler.get("std", 1.0))}
        }
    if kind == "uniform":
        return {"uniform": [float(filler.get("min", 0.0)), float(filler.get("max", 1.0))]}
    if kind == "xavier":  # Caffe's xavier: U(+-sqrt(3 / fan_in))
        return {"kaiming_uniform": {"nonlinearity": "linear"}}
    if kind == "msra":  # N(0, sqrt(2 / fan_in))
        return {"kaiming_normal": {"nonlinearity": "relu"}}
    raise ConfigError(f"{here}: filler type {brief(kind)} is not supported")


def _clean(name: Any) -> str:
    """A Caffe name as a cnnkit name: `inception_3a/1x1` -> `inception_3a_1x1`."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", str(name)).strip("_") or "layer"
