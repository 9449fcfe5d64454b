"""One layer line of a network file made a checked Layer: defaults merged, fields validated,
its own `init:` checked, its output shape inferred; `layer_label` is how messages name it and
`shape_params` the `$in_*` parameters its input's shape gives."""

from __future__ import annotations

import math
from typing import Any, Literal, get_args, get_origin

from pydantic import ValidationError

from cnnkit.errors import ConfigError, brief, suggest, validation_message
from cnnkit.nn.expr import is_expression
from cnnkit.nn.kinds import KINDS
from cnnkit.nn.layers import Layer, ParamLayer, Shape, ShapeError, fmt_shape
from cnnkit.nn.spec import BLOCK_LINE_KEYS

MERGED_FIELDS = ("init", "lr_mult", "decay_mult")  # dict fields that defaults merge key by key


def layer_label(index: int, name: str) -> str:
    """`layer 3 (stage.0.conv1)`: how a message names a layer (a long name cut, one with a
    newline or other control character quoted, so the message stays one line)."""
    shown = name if name.isprintable() else repr(name)
    return f"layer {index} ({shown if len(shown) <= 80 else shown[:80] + '...'})"


def shape_params(shape: Shape) -> dict[str, int]:
    """`$in_channels` (and `$in_height`, `$in_width` for images) of a value of this shape."""
    if len(shape) == 3:
        return {"in_channels": shape[0], "in_height": shape[1], "in_width": shape[2]}
    return {"in_channels": shape[0]}


def infer_shape(label: str, layer: Layer, in_shapes: list[Shape]) -> Shape:
    """The layer's output shape from its inputs'; a mistake is one line naming the field."""
    if len(in_shapes) > 1 and not layer.many_inputs:
        raise ConfigError(f"{label}: inputs: a {layer.type} layer takes one input")
    try:
        shape = layer.output_shape(in_shapes)
    except ShapeError as e:
        shapes = ", ".join(map(fmt_shape, in_shapes))
        raise ConfigError(f"{label}: {e.field}: {e} (input {shapes})") from None
    if math.prod(shape) == 0:
        raise ConfigError(f"{label}: its output {fmt_shape(shape)} is empty")
    return shape


INFERRED = "cnnkit reads it from the layer's input: leave it out"
TORCH_ARGUMENTS = {  # torch's arguments a line leaves out or names otherwise (a first try)
    "in_channels": INFERRED, "in_features": INFERRED, "num_features": INFERRED,
    "num_parameters": "channelwise: true is torch's num_parameters=C, false its 1",
    "inplace": "leave it out: cnnkit builds the module",
    "padding_mode": "convolutions pad with zeros; a pad layer before one pads with mode: "
                    "reflect or replicate",
}  # fmt: skip


def validate_layer(label: str, kind: str, fields: dict[str, Any]) -> Layer:
    """A layer line's fields validated as its kind (a mistyped field named first)."""
    try:
        return KINDS[kind].model_validate(fields)
    except ValidationError as e:  # a mistyped field first: it is why a required one is missing
        typo = next((str(x["loc"][0]) for x in e.errors() if x["type"] == "extra_forbidden"), None)
        hint = f" ({TORCH_ARGUMENTS[typo]})" if typo in TORCH_ARGUMENTS else None
        hint = hint or (suggest(typo, KINDS[kind].model_fields) if typo else "")
        what = f"{typo}: unknown field{hint}" if typo else _missing_choice(kind, e)
        raise ConfigError(f"{label}: {what or validation_message(e)}") from None


def _missing_choice(kind: str, e: ValidationError) -> str | None:
    """`convention: required: paper or caffe` for a missing field of a few values (an LRN's
    convention), which pydantic calls only 'Field required'."""
    missing = next((str(x["loc"][0]) for x in e.errors() if x["type"] == "missing"), None)
    field = KINDS[kind].model_fields.get(missing) if missing else None
    choices = get_args(field.annotation) if field is not None else ()
    if get_origin(field.annotation if field is not None else None) is not Literal or not choices:
        return None
    return f"{missing}: required: {' or '.join(map(str, choices))}"


def check_field_names(label: str, kind: str, fields: dict[str, Any]) -> None:
    """A line left out (`if:` false) is not validated as a layer (its values may hold only
    where it is present), but a field its kind does not have is a typo wherever it is."""
    typo = next((str(k) for k in fields if k not in KINDS[kind].model_fields), None)
    if typo is not None:
        hint = f" ({TORCH_ARGUMENTS[typo]})" if typo in TORCH_ARGUMENTS else None
        hint = hint or suggest(typo, KINDS[kind].model_fields)
        raise ConfigError(f"{label}: {typo}: unknown field{hint}")


def check_unexpanded(blocks: dict[str, Any], expanded: set[str]) -> None:
    """A block no line expanded (unused, or used only where `if:` is false) is not built, but
    its lines' layer types, field names and blocks are checked all the same: a typo there
    would surface only once some use reached it."""
    for name, block in blocks.items():
        if name in expanded:
            continue
        for i, line in enumerate(block.layers):
            label, kind = f"model: blocks.{name}.layers[{i}]", line.get("type")
            inner = line.get("block")
            if inner is not None and not is_expression(inner):
                if inner not in blocks:
                    raise ConfigError(f"{label}: block: unknown block {brief(inner)}"
                                      f"{suggest(inner, blocks)}")  # fmt: skip
                params = blocks[inner].params  # (a line with first: may pass first's own)
                typo = None if "first" in line else next(
                    (k for k in line if k not in params and k not in BLOCK_LINE_KEYS), None)  # fmt: skip
                if typo is not None:
                    raise ConfigError(f"{label}: block {brief(inner)} has no parameter "
                                      f"{brief(typo)}{suggest(str(typo), params)}")  # fmt: skip
            if inner is None and isinstance(kind, str) and not is_expression(kind):
                if kind not in KINDS:
                    raise ConfigError(f"{label}: type: unknown type {brief(kind)}"
                                      f"{suggest(kind, KINDS)}")  # fmt: skip
                fields = {k: v for k, v in line.items() if k not in ("if", "inputs")}
                check_field_names(label, kind, fields)


def check_own_init(label: str, raw: dict[str, Any], layer: Layer) -> None:
    """An `init:` rule written on a line that itself says `bias: false` (or `affine: false`)
    is a contradiction; one from `defaults:`, or beside a `$parameter` that is false in this
    use of a block, is skipped (as a layer without the parameter skips it)."""
    init, literal = raw.get("init"), raw.get("affine") is False or raw.get("bias") is False
    if literal and isinstance(init, dict) and isinstance(layer, ParamLayer):
        absent = sorted(set(init) & layer.absent_params(), key=str)
        if absent:
            why = "affine: false" if raw.get("affine") is False else "bias: false"
            raise ConfigError(f"{label}: init: {absent[0]}: this layer has no {absent[0]} ({why})")


def with_defaults(fields: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """A line's fields over its kind's `defaults:` (MERGED_FIELDS merged key by key)."""
    merged = {**defaults, **fields}
    for key in MERGED_FIELDS:
        if isinstance(defaults.get(key), dict) and isinstance(fields.get(key), dict):
            merged[key] = {**defaults[key], **fields[key]}
    return merged
