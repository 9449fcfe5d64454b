"""Typed reads of a prototxt's fields as caffe.proto declares them: integers only where an int
goes, numbers where a float goes, true / false where a bool goes (protobuf's text format
refuses the rest, so cnnkit does too, naming the line and the field); sizes, fillers and
learning-rate multipliers, which many layer types share."""

from __future__ import annotations

import math
from typing import Any

from cnnkit.errors import ConfigError, brief, plural
from cnnkit.prototxt import Message


def integer(here: str, p: Message, field: str, default: Any = None) -> Any:
    """An int field (the default where absent)."""
    return as_integer(here, field, p.get(field, default))


def as_integer(here: str, field: str, value: Any) -> Any:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{here}: {field}: expected an integer, got {shown(value)}")
    return value


def real(here: str, p: Message, field: str, default: float) -> float:
    """A float field: a number, written with or without a decimal point."""
    return as_real(here, field, p.get(field, default))


def as_real(here: str, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{here}: {field}: expected a number, got {shown(value)}")
    return float(value)


def flag(here: str, p: Message, field: str, default: bool) -> bool:
    """A bool field: true / false (or 1 / 0, as protobuf's text format also reads)."""
    value = p.get(field, default)
    if isinstance(value, bool) or (type(value) is int and value in (0, 1)):
        return bool(value)
    raise ConfigError(f"{here}: {field}: expected true or false, got {shown(value)}")


def enum(here: str, p: Message, field: str, names: tuple[str, ...], default: str) -> str:
    """An enum field by name (`pool: AVE`), or by its number in caffe.proto (`names` in the
    order of their numbers: `pool: 1`); out-of-range numbers and unknown names come back as
    written for the caller's message. true or 1.0 is refused, as protobuf's text format
    refuses it (True == 1 must not read as the second value)."""
    value = p.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{here}: {field}: expected {', '.join(names[:-1])} or {names[-1]} "
                          f"(or its number), got {shown(value)}")  # fmt: skip
    return names[value] if isinstance(value, int) and 0 <= value < len(names) else str(value)


def shown(value: Any) -> str:
    """A prototxt value as written: true / false, a `{ ... }` block, else cut by brief."""
    if isinstance(value, bool):
        return str(value).lower()
    return "a { ... } block" if isinstance(value, Message) else brief(value)


def sizes(here: str, p: Message, what: str, default: Any, alone: bool = False) -> Any:
    """A Caffe size field: `what_size` / `what` (one value or [h, w]) or `what_h` + `what_w`.

    As in Caffe, the two forms exclude each other, and `what_h` / `what_w` go together except
    where Caffe defaults the missing one (`alone`: a convolution's pad_h / pad_w, default 0).
    """
    h, w = integer(here, p, f"{what}_h"), integer(here, p, f"{what}_w")
    field = f"{what}_size" if p.all(f"{what}_size") else what
    if h is not None or w is not None:
        if p.all(field):
            raise ConfigError(f"{here}: give {field} or {what}_h + {what}_w, not both (as Caffe)")
        if not alone and (h is None or w is None):
            raise ConfigError(f"{here}: {what}_h and {what}_w go together (Caffe needs both)")
        return [default if h is None else h, default if w is None else w]
    values = [as_integer(here, field, v) for v in p.all(field)]
    if len(values) > 2:
        raise ConfigError(f"{here}: {field}: {len(values)} values; give one, or one per H and W")
    if not values:
        return default
    return values[0] if len(values) == 1 else values


def require(here: str, ok: bool, what: str) -> None:
    """ConfigError `here: what` unless `ok`."""
    if not ok:
        raise ConfigError(f"{here}: {what}")


def learning(here: str, layer: Message, p: Message, notes: list[str], bias: bool) -> dict[str, Any]:
    """lr_mult / decay_mult from `param {}` blocks and init from the fillers (what cnnkit
    initialises otherwise is added to notes); without a bias (`bias_term: false`) the layer
    learns one blob, as Caffe counts its param specs, and its bias_filler is Caffe's unused."""
    blobs = ("weight", "bias") if bias else ("weight",)
    blocks = {blob: f"{blob}_filler" for blob in blobs}
    out = multipliers(here, layer, blobs)
    return {**out, **fillers(here, p, blocks, notes)}


def fillers(here: str, p: Message, blocks: dict[str, str], notes: list[str]) -> dict[str, Any]:
    """`{"init": {param: rule}}` from the filler blocks of `p` named by `blocks` (param ->
    field), those given only; {} where none is (cnnkit's default init, as Caffe's default)."""
    init = {n: filler(here, p.get(field), notes) for n, field in blocks.items()}
    init = {n: rule for n, rule in init.items() if rule is not None}
    return {"init": init} if init else {}


def multipliers(here: str, layer: Message, blobs: tuple[str, ...]) -> dict[str, Any]:
    """lr_mult / decay_mult of the layer's learned blobs, in order (a convolution's weight and
    bias; a PReLU's slope; a Scale's factor and bias), from its `param {}` blocks or the old
    syntax's blobs_lr / weight_decay; only those other than 1."""
    params = layer.all("param")
    shared = [m for m in params if isinstance(m, str)]  # V1: a blob's sharing name
    require(
        here,
        not shared,
        f"param: {brief(shared[0] if shared else '')} shares weights "
        "between layers (the old syntax's name), which cnnkit's layers do not",
    )
    require(here, all(isinstance(m, Message) for m in params), "param is a { ... } block")
    v1 = {"lr_mult": layer.all("blobs_lr"), "decay_mult": layer.all("weight_decay")}
    given = max(len(params), *(len(v) for v in v1.values()))
    require(
        here,
        given <= len(blobs),
        f"{given} param specs for a layer with "
        f"{plural(len(blobs), 'learned blob')} ({', '.join(blobs)}), as Caffe refuses",
    )
    out: dict[str, Any] = {}
    for key in ("lr_mult", "decay_mult"):
        mults = {n: real(here, m, key, 1.0) for n, m in zip(blobs, params, strict=False)}
        for n, value in zip(blobs, v1[key], strict=False):  # the old syntax's
            mults[n] = as_real(here, "blobs_lr" if key == "lr_mult" else "weight_decay", value)
        if any(v != 1.0 for v in mults.values()):
            out[key] = mults
    return out


def filler(here: str, block: Message | None, notes: list[str]) -> Any:
    """A Caffe filler block as a cnnkit init rule (None: absent). A Gaussian's `sparse` mask
    is not followed: a dense Gaussian, said in notes."""
    if block is None:
        return None
    require(here, isinstance(block, Message), "a filler is a { ... } block")
    kind = str(block.get("type", "constant"))
    sparse = integer(here, block, "sparse", -1)
    if sparse != -1:
        require(here, kind == "gaussian" and sparse >= 0, f"filler sparse: {sparse} (Caffe "
                "takes it for a gaussian filler only, -1 or more)")  # fmt: skip
        notes.append(f"{here}: the gaussian filler's sparse {sparse} is not followed: dense here")
    if kind == "constant":
        return real(here, block, "value", 0.0)
    if kind == "gaussian":
        return {
            "normal": {
                "mean": real(here, block, "mean", 0.0),
                "std": real(here, block, "std", 1.0),
            }
        }
    if kind == "uniform":
        return {"uniform": [real(here, block, "min", 0.0), real(here, block, "max", 1.0)]}
    if kind in ("xavier", "msra"):
        return _scaled_filler(here, block, kind)
    if kind == "bilinear":  # FCN's upsampling Deconvolution
        return "bilinear"
    raise ConfigError(f"{here}: filler type {brief(kind)} is not supported")


# caffe.proto's VarianceNorm, in the order of its numbers
_VARIANCE_NORMS = {"FAN_IN": "fan_in", "FAN_OUT": "fan_out", "AVERAGE": "average"}


def _scaled_filler(here: str, block: Message, kind: str) -> Any:
    """Caffe's xavier, U(+-sqrt(3 / n)), and msra, N(0, sqrt(2 / n)), with n the fan-in, the
    fan-out or their average (variance_norm) as torch's kaiming / xavier rules compute them."""
    norm = enum(here, block, "variance_norm", tuple(_VARIANCE_NORMS), "FAN_IN")
    require(here, norm in _VARIANCE_NORMS, f"filler variance_norm: {norm} is not "
            "FAN_IN, FAN_OUT or AVERAGE")  # fmt: skip
    mode = _VARIANCE_NORMS[norm]
    if mode == "average":  # n = (fan_in + fan_out) / 2: torch's xavier (Glorot) rules
        return {"xavier_uniform": 1.0} if kind == "xavier" else {"xavier_normal": math.sqrt(2.0)}
    name, gain = ("kaiming_uniform", "linear") if kind == "xavier" else ("kaiming_normal", "relu")
    return {name: {"mode": mode, "nonlinearity": gain}}


def put(spec: dict[str, Any], key: str, value: Any, default: Any) -> None:
    """`spec[key] = value` unless it is Caffe's default (the network file leaves it out)."""
    if value != default:
        spec[key] = value
