"""Caffe's binary .caffemodel: the messages of caffe.proto that carry weights, declared at run time
with Caffe's own field numbers and read by the protobuf package, then the blobs turned into a
cnnkit state_dict under the names the prototxt translation gave its layers.

Only the fields that hold weights are declared; protobuf skips the others (every layer
parameter, fillers, phases) on reading, so old and new models alike parse.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cnnkit.errors import CheckpointError, one_line

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
    layers = [*net.layer, *net.layers]
    blobs = {layer.name: [_array(blob) for blob in layer.blobs] for layer in layers if layer.blobs}
    if not blobs:
        raise CheckpointError(f"{path}: a .caffemodel with no weights (no layer has blobs)")
    return blobs


def _array(blob: Any) -> np.ndarray:
    values = np.array(blob.data if len(blob.data) else blob.double_data, dtype=np.float32)
    if blob.HasField("shape"):
        shape = tuple(blob.shape.dim)
    else:  # the legacy 4-D fields, 0 where unused
        shape = tuple(d for d in (blob.num, blob.channels, blob.height, blob.width) if d)
    return values.reshape(shape) if shape and np.prod(shape) == values.size else values


def caffe_state_dict(
    model: dict[str, Any], sources: dict[str, list[tuple[str, str]]], blobs: dict
) -> dict[str, torch.Tensor]:
    """The state_dict of the network `model` from Caffe's blobs; `sources` (from the
    translation) says which Caffe layers feed each cnnkit layer, and how."""
    from cnnkit.nn import build_model

    shapes = build_model(model, device="meta").state_dict()  # names and shapes to fill
    state: dict[str, torch.Tensor] = {}
    for name, feeds in sources.items():
        for caffe_name, role in feeds:
            if caffe_name not in blobs:
                raise CheckpointError(f"the .caffemodel has no weights for layer {caffe_name!r}")
            for key, value in _convert(role, blobs[caffe_name]).items():
                full = f"{name}.{key}"
                if full not in shapes:
                    raise CheckpointError(f"layer {caffe_name!r}: has more blobs than {name} takes")
                want = shapes[full].shape
                if value.size != int(np.prod(want)):
                    raise CheckpointError(
                        f"layer {caffe_name!r}: blob {key} holds {value.size:,} values, "
                        f"{name} needs {tuple(want)}"
                    )
                state[full] = torch.from_numpy(value.reshape(want).copy())
    for key, value in shapes.items():
        if key.endswith("num_batches_tracked"):
            state[key] = torch.zeros((), dtype=value.dtype)
    return state


def _convert(role: str, blobs: list[np.ndarray]) -> dict[str, np.ndarray]:
    """A Caffe layer's blobs as cnnkit parameter values, by the layer's role."""
    if role in ("conv", "linear"):
        return dict(zip(("weight", "bias"), blobs, strict=False))
    if role == "prelu":
        return {"weight": blobs[0]}
    if role == "scale":  # Scale after BatchNorm: gamma and beta
        return dict(zip(("weight", "bias"), blobs, strict=False))
    if len(blobs) < 3:  # BatchNorm: running sums and their common scale factor
        raise CheckpointError(f"a BatchNorm layer has {len(blobs)} blobs, Caffe writes 3")
    factor = float(blobs[2].reshape(-1)[0])
    factor = 0.0 if factor == 0 else 1.0 / factor
    return {"running_mean": blobs[0] * factor, "running_var": blobs[1] * factor}
