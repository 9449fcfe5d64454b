"""Caffe's binary .caffemodel: the messages of caffe.proto that carry weights, declared at run time
with Caffe's own field numbers and read by the protobuf package, then the blobs turned into a
cnnkit state_dict under the names the prototxt translation gave its layers.

Only the fields that hold weights are declared; protobuf skips the others (every layer
parameter, fillers, phases) on reading, so old and new models alike parse.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cnnkit.errors import CheckpointError, brief, one_line
from cnnkit.nn.weights import check_finite_weights

# caffe.proto (BVLC/caffe, src/caffe/proto/caffe.proto): message -> (field, number, type, label)
_OPT, _REP = "LABEL_OPTIONAL", "LABEL_REPEATED"
CAFFE_FIELDS: dict[str, list[tuple[str, int, str, str]]] = {
    "BlobShape": [("dim", 1, "TYPE_INT64", _REP)],  # packed
    "BlobProto": [
        ("shape", 7, ".caffe.BlobShape", _OPT),
        ("data", 5, "TYPE_FLOAT", _REP),  # packed
        ("double_data", 8, "TYPE_DOUBLE", _REP),  # packed
        ("num", 1, "TYPE_INT32", _OPT),  # the 4-D shape of models before BlobShape
        ("channels", 2, "TYPE_INT32", _OPT),
        ("height", 3, "TYPE_INT32", _OPT),
        ("width", 4, "TYPE_INT32", _OPT),
    ],
    "LayerParameter": [
        ("name", 1, "TYPE_STRING", _OPT),
        ("type", 2, "TYPE_STRING", _OPT),
        ("bottom", 3, "TYPE_STRING", _REP),
        ("top", 4, "TYPE_STRING", _REP),
        ("blobs", 7, ".caffe.BlobProto", _REP),
    ],
    "V1LayerParameter": [  # `layers { ... }`, Caffe before 2015
        ("bottom", 2, "TYPE_STRING", _REP),
        ("top", 3, "TYPE_STRING", _REP),
        ("name", 4, "TYPE_STRING", _OPT),
        ("type", 5, "TYPE_INT32", _OPT),  # enum LayerType on the wire
        ("blobs", 6, ".caffe.BlobProto", _REP),
    ],
    "NetParameter": [
        ("name", 1, "TYPE_STRING", _OPT),
        ("layer", 100, ".caffe.LayerParameter", _REP),
        ("layers", 2, ".caffe.V1LayerParameter", _REP),
    ],
}
_PACKED = {("BlobShape", "dim"), ("BlobProto", "data"), ("BlobProto", "double_data")}
_MAX_AXES = 32  # Caffe's blobs have at most 32 axes (kMaxBlobAxes)


@cache
def caffe_messages() -> dict[str, Any]:
    """Message classes for CAFFE_FIELDS, in a descriptor pool of their own (package `caffe`)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field_type = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(
        name="cnnkit/caffe_weights.proto", package="caffe", syntax="proto2"
    )
    for message, fields in CAFFE_FIELDS.items():
        declared = proto.message_type.add(name=message)
        for name, number, kind, label in fields:
            f = declared.field.add(name=name, number=number, label=getattr(field_type, label))
            if kind.startswith("."):
                f.type, f.type_name = field_type.TYPE_MESSAGE, kind
            else:
                f.type = getattr(field_type, kind)
            if (message, name) in _PACKED:
                f.options.packed = True
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"caffe.{name}"))
        for name in CAFFE_FIELDS
    }


def read_caffemodel(path: str | Path) -> dict[str, list[np.ndarray]]:
    """Caffe layer name -> its blobs as float32 arrays of their Caffe shapes."""
    from google.protobuf.message import DecodeError

    path = Path(path)
    try:
        net = caffe_messages()["NetParameter"].FromString(path.read_bytes())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {one_line(e, 160)}") from None
    except (DecodeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not a Caffe .caffemodel ({str(e)[:100]})") from None
    layers = [layer for layer in [*net.layer, *net.layers] if layer.blobs]
    blobs = {layer.name: [_array(path, layer.name, i, blob) for i, blob in enumerate(layer.blobs)]
             for layer in layers}  # fmt: skip
    if not blobs:
        raise CheckpointError(f"{path}: a .caffemodel with no weights (no layer has blobs)")
    return blobs


def _array(path: Path, layer: str, index: int, blob: Any) -> np.ndarray:
    """Blob `index` of `layer` as an array of its shape (flat where it gives none); a shape
    that does not hold its values (Caffe's Blob::FromProto refuses it too) is an error."""
    values = np.array(blob.data if len(blob.data) else blob.double_data, dtype=np.float32)
    if blob.HasField("shape"):
        shape = tuple(blob.shape.dim)
    else:  # the legacy 4-D fields, 0 where unused
        shape = tuple(d for d in (blob.num, blob.channels, blob.height, blob.width) if d)
    if not shape:
        return values
    if len(shape) > _MAX_AXES or min(shape) < 0 or math.prod(shape) != values.size:
        raise CheckpointError(f"{path}: layer {brief(layer)}: blob {index} has shape "
                              f"{_dims(shape)}, which does not hold its {values.size:,} values")  # fmt: skip
    return values.reshape(shape)


def caffe_state_dict(
    model: dict[str, Any], sources: dict[str, list[tuple[str, str]]], blobs: dict
) -> dict[str, torch.Tensor]:
    """The state_dict of the network `model` from Caffe's blobs; `sources` (from the
    translation) says which Caffe layers feed each cnnkit layer, and how. Every tensor the
    network holds must come, of its shape and finite, or a CheckpointError names the blob."""
    from cnnkit.nn import build_model

    own = {k: tuple(v.shape) for k, v in build_model(model, device="meta").state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for name, feeds in sources.items():
        for caffe_name, role in feeds:
            if caffe_name not in blobs:
                raise CheckpointError(f"the .caffemodel has no weights for layer {caffe_name!r}")
            layer = _BlobReader(caffe_name, name, blobs[caffe_name])
            read = {"batchnorm": _batchnorm, "bn_fork": _bn_fork}.get(role)
            state.update(read(layer, own) if read else _params(layer, role, own))
    for key, shape in own.items():
        if key.endswith("num_batches_tracked"):
            state[key] = torch.zeros(shape, dtype=torch.long)
    return state


# role -> the parameters its Caffe blobs hold, in Caffe's order
_KEYS = {
    "conv": ("weight", "bias"), "conv_transpose": ("weight", "bias"), "linear": ("weight", "bias"), "linear_t": ("weight", "bias"),
    "prelu": ("weight",), "scale": ("weight", "bias"),  # a Scale folded into its BatchNorm
    "scale_conv": ("weight", "bias"),  # a Scale with bias as a depthwise 1x1 convolution
    "channel_scale": ("weight",),  # a Scale without bias as cnnkit's `scale` layer
}  # fmt: skip
_PER_CHANNEL = ("scale_conv", "channel_scale")  # Caffe's blobs (C,), cnnkit's (C, 1, 1, ...)


class _BlobReader:
    """One Caffe layer's blobs, read into the tensors of cnnkit layer `name`."""

    def __init__(self, caffe_name: str, name: str, blobs: list[np.ndarray]):
        self.caffe_name, self.name, self.blobs = caffe_name, name, blobs

    def count(self, keys: list[str]) -> None:
        """The blobs must be `keys`, no fewer and no more."""
        if len(self.blobs) < len(keys):
            raise CheckpointError(
                f"layer {self.caffe_name!r}: no {keys[len(self.blobs)]} blob (the .caffemodel has "
                f"{len(self.blobs)}; {self.name} takes {len(keys)}: {', '.join(keys)})"
            )
        if len(self.blobs) > len(keys):
            raise CheckpointError(
                f"layer {self.caffe_name!r}: {len(self.blobs)} blobs, {self.name} takes "
                f"{len(keys)} ({', '.join(keys) or 'none'})"
            )

    def read(self, index: int, key: str, caffe_shape: tuple[int, ...]) -> np.ndarray:
        """Blob `index` as an array of `caffe_shape`: its shape must be that one, but for the
        leading 1s of a legacy 4-D blob ((1, 1, out, in) for an InnerProduct)."""
        value = self.blobs[index]
        shape, extra = value.shape, value.ndim - len(caffe_shape)
        if extra > 0 and all(d == 1 for d in shape[:extra]):
            shape = shape[extra:]
        if shape != caffe_shape:
            raise CheckpointError(
                f"layer {self.caffe_name!r}: blob {key} has shape {_dims(value.shape)} "
                f"({value.size:,} values), {self.name} needs {_dims(caffe_shape)}"
            )
        check_finite_weights({f"blob {key}": torch.from_numpy(value)}, f"layer {self.caffe_name!r}")
        return value.reshape(caffe_shape)


def _params(layer: _BlobReader, role: str, own: dict[str, tuple[int, ...]]) -> dict:
    """Weights and biases: Caffe's shapes are cnnkit's, but for a transposed InnerProduct's
    weight (in, out) and a Scale's (C,) blobs where cnnkit holds (C, 1, 1) or (C, 1, 1, 1)."""
    bare = role == "channel_scale"  # cnnkit's `scale` keeps its weight under the layer's name
    names = {k: layer.name if bare else f"{layer.name}.{k}" for k in _KEYS[role]}
    keys = [k for k, full in names.items() if full in own]
    layer.count(keys)
    state = {}
    for index, key in enumerate(keys):
        want = own[names[key]]
        transpose = role == "linear_t" and key == "weight"  # Caffe computes x @ W, W (in, out)
        caffe_shape = want[::-1] if transpose else want[:1] if role in _PER_CHANNEL else want
        value = layer.read(index, key, caffe_shape)
        value = value.T if transpose else value
        state[names[key]] = torch.from_numpy(value.reshape(want).copy())
    return state


def _batchnorm(layer: _BlobReader, own: dict[str, tuple[int, ...]]) -> dict:
    """Caffe's BatchNorm blobs: running sums and their common scale factor."""
    layer.count(["mean", "variance", "scale factor"])
    want = own[f"{layer.name}.running_mean"]
    mean, var = layer.read(0, "mean", want), layer.read(1, "variance", want)
    factor = float(layer.read(2, "scale factor", (1,))[0])
    factor = 0.0 if factor == 0 else 1.0 / factor
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf: named just below
        mean, var = mean * factor, var * factor
    _check_variance(layer, var, " (over the scale factor)")
    scaled = {"mean": torch.from_numpy(mean), "variance": torch.from_numpy(var)}
    check_finite_weights({f"blob {blob} (over the scale factor)": value
                          for blob, value in scaled.items()}, f"layer {layer.caffe_name!r}")  # fmt: skip
    return {
        f"{layer.name}.running_mean": scaled["mean"],
        f"{layer.name}.running_var": scaled["variance"],
    }


def _bn_fork(layer: _BlobReader, own: dict[str, tuple[int, ...]]) -> dict:
    """A PSPNet fork's BN blobs: slope, bias, moving mean and variance, each (1, C, 1, 1)."""
    keys = {"slope": "weight", "bias": "bias", "mean": "running_mean", "variance": "running_var"}
    layer.count(list(keys))
    want = own[f"{layer.name}.running_mean"]
    state = {f"{layer.name}.{key}": torch.from_numpy(layer.read(i, blob, (1, *want, 1, 1))
                                                     .reshape(want).copy())
             for i, (blob, key) in enumerate(keys.items())}  # fmt: skip
    _check_variance(layer, state[f"{layer.name}.running_var"].numpy())
    return state


def _check_variance(layer: _BlobReader, var: np.ndarray, what: str = "") -> None:
    """A batch norm's variance blob (`what`: how it was read) is never negative: a square's
    running average never is, and the net would compute NaN."""
    if (var < 0).any():
        raise CheckpointError(f"layer {layer.caffe_name!r}: blob variance{what} has negative "
                              "values, as no trained batch norm has (the net would compute NaN)")  # fmt: skip


def _dims(shape: tuple[int, ...]) -> str:
    more = f", ... ({len(shape):,} axes)" if len(shape) > 8 else ""
    return "(" + ", ".join(map(str, shape[:8])) + more + ")"
