"""The one exception family of cnnkit: every user mistake is a CnnkitError with one clear line;
`config_error` turns pydantic's validation errors into one, `brief` cuts echoed values,
`suggest` names the known word meant, `plural` counts a noun."""

from __future__ import annotations

import difflib
import math
import re
import reprlib
from collections.abc import Collection
from typing import Any


class CnnkitError(Exception):
    """A problem the user can fix; the CLI prints its message and exits with `exit_code`.
    `agreed`: every rank of a group raises it alike, after agreeing on it (a diverged loss, no
    readable image), so rank 0's line says it for all."""

    exit_code = 1
    agreed = False


class ConfigError(CnnkitError):
    """A bad network file, run file, option or override (CLI exit status 2)."""

    exit_code = 2


class DataError(CnnkitError):
    """Missing or unreadable data: a folder, an image, a packed set."""


class CheckpointError(CnnkitError):
    """A missing, truncated or foreign checkpoint or run directory."""


class Interrupted(CnnkitError):
    """The user stopped a run (Ctrl-C); the message says where it stands and how to go on."""

    exit_code = 130


class StoppedWithGroup(Interrupted):
    """A rank that stopped, saved, because a Ctrl-C reached another process of its group (on
    another machine: this one's torchrun was not interrupted). Exit status 0: with a failure,
    that torchrun would restart its ranks and wait for machines that have gone."""

    exit_code = 0


class _Repr(reprlib.Repr):
    """reprlib's cut repr, and an integer too long to write out (Python refuses to turn one of
    over 4,300 digits into text) said by its size."""

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 1000:  # about 300 digits: never written out
            return f"<an integer of about {int(x.bit_length() * math.log10(2)) + 1:,} digits>"
        return super().repr_int(x, level)


_REPR = _Repr()
_REPR.maxstring = _REPR.maxother = 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4
_REPR.maxlevel = 3


def _as_written(value: object) -> str:
    """A value echoed back as a YAML file or key=value override spells it: true, false, null."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return brief(value)


def brief(value: object, limit: int = 40) -> str:
    """`repr(value)` cut to about `limit` characters, for echoing user input in a message
    (reprlib never walks all of a huge or alias-shared structure)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit + 3 else text[:limit] + "..."


# the location parts pydantic adds for a union's members: `function-after[...]`, `literal[...]`,
# `constrained-int`, `tuple[int, int]`; never a field's name
_TYPE_TAG = re.compile(r"^(function-|literal\[|constrained-|(int|float|str|bool|bytes)$|"
                       r"(tuple|list|dict|set|frozenset)\[)")  # fmt: skip


def _field(err: dict) -> list[str]:
    """A pydantic error's location without the tags of a union's members."""
    return [str(p) for p in err["loc"] if not _TYPE_TAG.match(str(p))]


def _first(error: Any, hide: Collection[str]) -> tuple[list[str], str]:
    """(location parts, `message (got value)`) of a pydantic ValidationError's first problem."""
    errors = error.errors()  # a missing field first: it is why the others look wrong
    err = next((e for e in errors if e["type"] == "missing"), errors[0])
    typo = _misspelling(errors)
    if typo is not None:  # `paht` beside a missing `path`: the cause, with the field meant
        parts = [p for p in (str(p)[:40] for p in typo[0]["loc"]) if not _TYPE_TAG.match(p)]
        return [p for p in parts if p not in hide], f"unknown field (did you mean {typo[1]!r}?)"
    if isinstance(err.get("input"), str):  # a word where a union takes numbers or words: the
        same = [e for e in errors if _field(e) == _field(err) and e["type"] == "literal_error"]
        err = same[0] if same else err  # words it takes ('same' or 'valid'), not "an integer"
    elif isinstance(err.get("input"), (list, tuple)):  # a list where a union takes a number or
        here = _field(err)  # a tuple: what is wrong with it as a tuple (or with an item of it)
        same = [e for e in errors if _field(e)[: len(here)] == here
                and any(str(p).startswith("tuple[") for p in e["loc"])]  # fmt: skip
        err = same[0] if same else err
    parts = [str(p)[:40] for p in err["loc"]]
    field = (err.get("ctx") or {}).get("field")  # a model-level check names its field there
    if field is not None:
        parts.append(str(field)[:40])
        err = {**err, "input": err.get("input", {}).get(field)}
    parts = [p for p in parts if not _TYPE_TAG.match(p) and p not in hide]
    msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")[:200]
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    counted = _tuple_length(err, errors)
    if counted is not None:  # `mean.2: Field required` for a list of 2 where 3 are taken
        parts = parts[:-1] if err["type"] == "missing" else parts
        msg = f"takes {counted} values, not {len(err['input'])}"
        msg += f" (got {_as_written(err['input'])})" if err["type"] == "missing" else ""
    if err["type"] == "too_short" and not err.get("input"):  # pydantic: "List should have ..."
        least = (err.get("ctx") or {}).get("min_length", 1)
        return parts, "must not be empty" + (f": give at least {least}" if least > 1 else "")
    if "input" in err and err["type"] not in ("extra_forbidden", "missing", "value_error"):
        msg += f" (got {_as_written(err['input'])})"
    return parts, msg


def _tuple_length(err: dict, errors: list[dict]) -> int | None:
    """The number of values a fixed-length tuple takes, where `err` says a list given for it
    is too long, or too short (pydantic's `Field required` for each missing position)."""
    given = err.get("input")
    if err["type"] == "too_long" and (err.get("ctx") or {}).get("field_type") == "Tuple":
        return err["ctx"]["max_length"]
    if err["type"] != "missing" or not isinstance(given, (list, tuple)) or not err["loc"]:
        return None
    if not isinstance(err["loc"][-1], int):
        return None
    positions = [e["loc"][-1] for e in errors
                 if e["type"] == "missing" and e["loc"][:-1] == err["loc"][:-1]]  # fmt: skip
    return max(positions) + 1


def _misspelling(errors: list[dict]) -> tuple[dict, str] | None:
    """(the unknown key's error, the missing field) where a required field is missing and an
    unknown key beside it is close to its name: the misspelling to name rather than the field."""
    for missing in (e for e in errors if e["type"] == "missing"):
        *section, name = _field(missing) or [""]
        typos = {str(e["loc"][-1]): e for e in errors
                 if e["type"] == "extra_forbidden" and _field(e)[:-1] == section}  # fmt: skip
        close = difflib.get_close_matches(name, list(typos), n=1)
        if close:
            return typos[close[0]], name
    return None


def suggest(word: Any, known: Any) -> str:
    """` (did you mean 'x'?)` for the closest known word, or nothing."""
    close = difflib.get_close_matches(str(word)[:100], list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def plural(count: int, noun: str, nouns: str = "") -> str:
    """`1 epoch`, `3 epochs`; `nouns` where the plural is not noun + s (`class`, `classes`)."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


def validation_message(error: Any, hide: Collection[str] = ()) -> str:
    """The first problem of a pydantic ValidationError as `field.path: message (got value)`,
    location parts in `hide` left out (the tags of a discriminated union)."""
    parts, msg = _first(error, hide)
    return f"{'.'.join(parts)}: {msg}" if parts else msg


def config_error(error: Any, prefix: str = "", hide: Collection[str] = ()) -> ConfigError:
    """A pydantic ValidationError as one ConfigError line: `prefix.field.path: message`."""
    parts, msg = _first(error, hide)
    loc = ".".join(([prefix] if prefix else []) + parts)
    return ConfigError(f"{loc or 'config'}: {msg}")


def one_line(error: BaseException | str, limit: int = 240) -> str:
    """An exception's message (or a text) on one line, cut at a word, never mid-word."""
    text = " ".join(str(error).split()) or type(error).__name__
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0].rstrip(".,:;") + " ..."
