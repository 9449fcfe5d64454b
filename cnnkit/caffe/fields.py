"""Typed reads of a prototxt's fields as caffe.proto declares them: integers only where an int
goes, numbers where a float goes, true / false where a bool goes (protobuf's text format
refuses the rest, so cnnkit does too, naming the line and the field); sizes, fillers and
learning-rate multipliers, which many layer types share."""

from __future__ import annotations

from typing import Any

from cnnkit.errors import ConfigError, brief
from cnnkit.prototxt import Message


def integer(here: str, p: Message, field: str, default: Any = None) -> Any:
    """An int field (the default where absent)."""
    return as_integer(here, field, p.get(field, default))


def as_integer(here: str, field: str, value: Any) -> Any:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{here}: {field}: expected an integer, got {brief(value)}")
    return value


def real(here: str, p: Message, field: str, default: float) -> float:
    """A float field: a number, written with or without a decimal point."""
    return as_real(here, field, p.get(field, default))


def as_real(here: str, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{here}: {field}: expected a number, got {brief(value)}")
    return float(value)


def flag(here: str, p: Message, field: str, default: bool) -> bool:
    """A bool field: true / false (or 1 / 0, as protobuf's text format also reads)."""
    value = p.get(field, default)
    if isinstance(value, bool) or (type(value) is int and value in (0, 1)):
        return bool(value)
    raise ConfigError(f"{here}: {field}: expected true or false, got {brief(value)}")


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


def learning(here: str, layer: Message, p: Message) -> dict[str, Any]:
    """lr_mult / decay_mult from `param {}` blocks and init from the fillers."""
    out: dict[str, Any] = {}
    params = dict(zip(("weight", "bias"), layer.all("param"), strict=False))
    shared = [m for m in params.values() if isinstance(m, str)]  # V1: a blob's sharing name
    require(
        here,
        not shared,
        f"param: {brief(shared[0] if shared else '')} shares weights "
        "between layers (the old syntax's name), which cnnkit's layers do not",
    )
    require(here, all(isinstance(m, Message) for m in params.values()), "param is a { ... } block")
    v1 = {"lr_mult": layer.all("blobs_lr"), "decay_mult": layer.all("weight_decay")}
    for key in ("lr_mult", "decay_mult"):
        mults = {n: real(here, m, key, 1.0) for n, m in params.items()}
        for n, value in zip(("weight", "bias"), v1[key], strict=False):  # the old syntax's
            mults[n] = as_real(here, "blobs_lr" if key == "lr_mult" else "weight_decay", value)
        if any(v != 1.0 for v in mults.values()):
            out[key] = mults
    init = {n: filler(here, p.get(f"{n}_filler")) for n in ("weight", "bias")}
    init = {n: rule for n, rule in init.items() if rule is not None}
    if init:
        out["init"] = init
    return out


def filler(here: str, block: Message | None) -> Any:
    """A Caffe filler block as a cnnkit init rule (None: absent)."""
    if block is None:
        return None
    require(here, isinstance(block, Message), "a filler is a { ... } block")
    kind = str(block.get("type", "constant"))
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
    if kind == "xavier":  # Caffe's xavier: U(+-sqrt(3 / fan_in))
        return {"kaiming_uniform": {"nonlinearity": "linear"}}
    if kind == "msra":  # N(0, sqrt(2 / fan_in))
        return {"kaiming_normal": {"nonlinearity": "relu"}}
    raise ConfigError(f"{here}: filler type {brief(kind)} is not supported")
