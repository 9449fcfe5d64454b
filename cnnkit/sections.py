"""The pydantic base of the run file's sections (train, data, model) and what checkpoints record:
numbers stay numbers. Pydantic's lax mode reads `true` as 1 and `false` as 0, and YAML reads
`yes`, `no`, `on` and `off` as booleans, so `epochs: on` would train one epoch without a word;
here a boolean where a number goes is an error naming the field. (Network files get the same
from their layers' strict field types, nn/layers.py.)"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, model_validator


class Section(BaseModel):
    """A BaseModel whose number fields refuse booleans (bool fields take them as usual)."""

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key) if isinstance(value, bool) else None
                if field is not None and not _takes_bool(field.annotation):
                    raise ValueError(f"{key}: Input should be a number, not true or false")
        return data


def _takes_bool(annotation: Any) -> bool:
    """Whether a field of this type may hold a boolean (bool, Any, a union or literal with one)."""
    if annotation is bool or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _takes_bool(args[0])
    if origin is Literal:
        return any(isinstance(a, bool) for a in args)
    if origin is typing.Union or origin is types.UnionType:
        return any(_takes_bool(a) for a in args)
    return False
