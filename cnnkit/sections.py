"""The pydantic base of the run file's sections (train, data, model) and what checkpoints record:
booleans are not numbers. Pydantic's lax mode reads `true` as 1 and `false` as 0, and YAML reads
`yes`, `no`, `on` and `off` as booleans, so `epochs: on` would train one epoch without a word;
here a boolean where only a number goes (a number field, or an item of a list or tuple of
numbers) is an error naming the field. Other fields keep pydantic's own messages. (Network files
get the same from their layers' strict field types, nn/layers.py.)"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, model_validator
from pydantic_core import PydanticCustomError

NUMBERS = (int, float)


class Section(BaseModel):
    """A BaseModel whose number fields refuse booleans (every other field as pydantic says).

    A model-level check (a field-level one cannot sit on a discriminated union's tag); the
    error carries the field in its context, and errors.py puts it into the location."""

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key) if isinstance(key, str) else None
                if field is not None and _boolean_number(field.annotation, value):
                    raise PydanticCustomError(
                        "bool_number", "Input should be a number, not true or false",
                        {"field": key},
                    )  # fmt: skip
        return data


def _boolean_number(annotation: Any, value: Any) -> bool:
    """Whether `value` holds a boolean where `annotation` takes only numbers."""
    if isinstance(value, bool):
        kinds = _kinds(annotation)
        return bool(kinds) and bool not in kinds and kinds <= set(NUMBERS)
    if isinstance(value, (list, tuple)):
        items = _items(annotation)
        return any(_boolean_number(a, v) for a, v in zip(items, value, strict=False))
    return False


def _kinds(annotation: Any) -> set:
    """The scalar types a field may take (Annotated and unions unwrapped); `object` for any
    other (a model, a string, a literal, a container, an unresolved name)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _kinds(args[0])
    if origin is typing.Union or origin is types.UnionType:
        return set().union(*(_kinds(a) for a in args if a is not type(None)))
    return {annotation if annotation in (*NUMBERS, bool) else object}


def _items(annotation: Any) -> list:
    """The item annotations of a list / tuple field, one per position (repeated for list[T]
    and tuple[T, ...]); empty for anything else."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _items(args[0])
    if origin is list and args:
        return [args[0]] * 10_000
    if origin is tuple and args:
        return [args[0]] * 10_000 if len(args) == 2 and args[1] is Ellipsis else list(args)
    return []
