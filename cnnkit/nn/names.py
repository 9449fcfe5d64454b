"""Which names a layer may take: the network file's naming rule, shared by the expander and
the Caffe importer, and the names a file gives, which no default name may take.

A layer is an attribute of the Network (or of a container, for dotted names), so names that
torch's nn.Module API or the Network's own attributes hold would shadow them; and the code
torch.export and TorchScript write names it, so a Python keyword would not compile there.
"""

from __future__ import annotations

import functools
import keyword
import re
from typing import Any

from torch import nn

from cnnkit.errors import ConfigError, brief
from cnnkit.nn.expr import is_expression

NAME_RE = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")  # fullmatch: no "a\n"
MAX_NAME = 200
RESERVED = {"input", "previous"}
# keep in sync with graph.Network (a test checks it)
NETWORK_ATTRIBUTES = frozenset({"spec", "name", "input_shape", "param_count", "activation_count",
                                "table", "num_classes", "output_shape", "heads", "fresh_keys", "multipliers",
                                "param_groups", "reset_parameters", "_apply_init", "unreached",
                                "_forward_hooked", "_groups", "_steps", "_nodes", "_output"})  # fmt: skip
MODULE_ATTRIBUTES = frozenset(dir(nn.Module()))
# torch.fx's code (ONNX, .pt2) and TorchScript's (whose parser also holds NoneType, Ellipsis)
KEYWORDS = frozenset(keyword.kwlist) | {"NoneType", "Ellipsis"}


def reserved_name(part: str, top: bool = True) -> bool:
    """True where a layer (or the `top` part of a dotted name) may not take this name."""
    return (part in RESERVED or part in MODULE_ATTRIBUTES or part in KEYWORDS
            or (top and part in NETWORK_ATTRIBUTES))  # fmt: skip


def check_name(label: str, name: str, short: str, taken: set[str], holders: dict[str, str]) -> None:
    """Raise unless `name` (full, dotted; `short` its last part as written) is usable: unique
    among `taken`, and neither holding nor held by another (`a` and `a.b`; `holders` maps each
    dotted prefix of a taken name to that name): a set lookup per dot."""
    if len(name) > MAX_NAME:
        raise ConfigError(f"{label}: name: {brief(short)} makes a name of {len(name)} "
                          f"characters (at most {MAX_NAME})")  # fmt: skip
    if not NAME_RE.fullmatch(name) or short in RESERVED:
        raise ConfigError(
            f"{label}: name: {brief(short)} is not a usable name (ASCII letters, digits, _ and "
            "-, dots between parts as in layer4.1; not 'input' or 'previous')"
        )
    parts = name.split(".")
    word = next((p for p in parts if p in KEYWORDS), None)
    if word is not None:
        raise ConfigError(f"{label}: name: {word!r} is a Python keyword, which an exported "
                          "model (ONNX, .pt2, TorchScript) cannot name a layer; choose another "
                          f"name ({word}_, {word}1)")  # fmt: skip
    clash = next((p for i, p in enumerate(parts) if reserved_name(p, i == 0)), None)
    if clash is not None:
        raise ConfigError(f"{label}: name: {brief(clash)} is taken by torch's nn.Module "
                          "API or the network's own attributes; choose another name")  # fmt: skip
    if name in taken:
        raise ConfigError(f"{label}: name: {name!r} is used twice")
    holder = next((p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in taken), None)
    other = holders.get(name) or holder
    if other:
        raise ConfigError(
            f"{label}: name: {name!r} clashes with {other!r} (one would hold the other)"
        )


def input_names(value: Any) -> Any:
    """`inputs:` as a list of names, an integer the name it is (`inputs: [1]` reads the layer
    `name: 1`, as a sequential block numbers them); anything else as given, for the caller
    to refuse."""
    values = value if isinstance(value, list) else [value] if is_name(value) else value
    if not isinstance(values, list):
        return values
    return [str(v) if is_name(v) else v for v in values]


def is_name(value: Any) -> bool:
    """A name as `name:` takes it: a string, or an integer (never true or false)."""
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def given_name(name: Any, index: int) -> str | int:
    """A layer line's `name:` (layer `index` in its list), or ConfigError: left empty (null),
    or no name (a list, true)."""
    if name is None:  # `name:` left empty, or null: YAML's nothing
        raise ConfigError(f"layer {index}: name: empty (null); give a name, or leave name: out "
                          "to have the layer named by its type and place")  # fmt: skip
    if not is_name(name):
        raise ConfigError(f"layer {index}: name: not a name: {brief(name)}")
    return name


def given_names(
    lines: list[Any], blocks: dict[str, Any], seen: frozenset[str] = frozenset()
) -> frozenset[str]:
    """The names `lines` give (literal ones) and those of the blocks they splice in (`inline`,
    at any depth), which land beside them: no default name may take one (`seen`: the blocks
    being walked, as a block may hold itself)."""
    names = {str(r["name"]) for r in lines
             if isinstance(r, dict) and isinstance(r.get("name"), (str, int))}  # fmt: skip
    for line in lines:
        if isinstance(line, dict) and line.get("inline", False) is not False:
            for name in _spliced(line, blocks) - seen:
                names |= given_names(blocks[name].layers, blocks, seen | {name})
    return frozenset(names)


def written(name: str, named: frozenset[str]) -> bool:
    """Whether the file gives `name` here: literally, or as a copy of a `NAME$index` line."""
    copies = _copy_names(named)
    return name in named or (copies is not None and copies.fullmatch(name) is not None)


@functools.lru_cache(maxsize=64)
def _copy_names(named: frozenset[str]) -> re.Pattern[str] | None:
    """What the copies of the `$index` names among `named` match (denselayer$index: denselayer1)."""
    templates = [
        re.escape(n).replace(re.escape("$index"), "-?[0-9]+") for n in named if "$index" in n
    ]
    return re.compile("|".join(templates)) if templates else None


def _spliced(line: dict[str, Any], blocks: dict[str, Any]) -> set[str]:
    """The blocks an inline line may splice in: its `block` and its `first`'s (every block
    where a $parameter names it)."""
    first = line.get("first")
    refs = [line.get("block"), first.get("block") if isinstance(first, dict) else first]
    if any(is_expression(ref) for ref in refs):
        return set(blocks)
    return {ref for ref in refs if isinstance(ref, str) and ref in blocks}
