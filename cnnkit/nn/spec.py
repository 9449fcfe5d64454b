"""The network file: read it (zoo name, path or dict), expand blocks and defaults, resolve inputs.

The result is a flat list of `Node`s in order, each naming the earlier outputs it reads, so
the graph builder never sees blocks, `$params`, `previous` or defaults.
"""

from __future__ import annotations

import copy
import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError

from cnnkit.errors import ConfigError
from cnnkit.nn.kinds import KINDS
from cnnkit.nn.layers import Layer, Linear

NAME_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
RESERVED = {"input", "previous"}
MERGED_FIELDS = ("init", "lr_mult", "decay_mult")  # dict fields that defaults merge key by key


class BlockDef(BaseModel):
    """A block: layers written once, used many times with parameters (`$name` in its layers)."""

    model_config = ConfigDict(extra="forbid")
    params: dict[str, Any] = Field(
        default_factory=dict, description="name -> default (null: required)"
    )
    layers: list[dict[str, Any]] = Field(min_length=1)


class NetSpec(BaseModel):
    """The `model:` section of a network or run file."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    input: list[PositiveInt] = Field(min_length=1, max_length=3, description="[C, H, W] or [F]")
    num_classes: PositiveInt | None = Field(None, description="omitted: taken from the data set")
    defaults: dict[str, dict[str, Any]] = Field(default_factory=dict, description="type -> fields")
    blocks: dict[str, BlockDef] = Field(default_factory=dict)
    layers: list[dict[str, Any]] = Field(min_length=1)


@dataclass(frozen=True)
class Node:
    """One layer of the expanded graph; `inputs` index earlier values (0 is the network input)."""

    index: int  # position in the file's top-level `layers:` list, for error messages
    name: str
    layer: Layer
    inputs: tuple[int, ...]


def read_spec(spec: str | Path | dict[str, Any]) -> dict[str, Any]:
    """Return the `model:` mapping of a zoo name, a YAML file or a dict (a run file's too)."""
    if isinstance(spec, dict):
        data, source = spec, None
    else:
        data, source = _read_yaml_or_zoo(str(spec))
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source or 'spec'}: expected a mapping with 'layers' (or 'model'), got {type(data).__name__}"
        )
    model = data.get("model", data)
    if isinstance(model, str):  # a run file naming a zoo network or another file
        base = Path(source).parent if source else Path.cwd()
        relative = base / model
        return read_spec(str(relative) if relative.is_file() else model)
    if not isinstance(model, dict) or "layers" not in model:
        raise ConfigError(
            f"{source or 'spec'}: no 'layers' list (a network file has model: {{input, layers}})"
        )
    return copy.deepcopy(model)


def _read_yaml_or_zoo(spec: str) -> tuple[Any, str]:
    from cnnkit.zoo import net_path

    path = Path(spec)
    if not path.is_file():
        zoo_file = net_path(spec)
        if zoo_file is None:
            raise ConfigError(
                f"{spec!r} is neither a zoo network ('cnnkit zoo' lists them) nor a file"
            )
        path = zoo_file
    try:
        return yaml.safe_load(path.read_text()), str(path)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
        raise ConfigError(f"{path}: not valid YAML{at}: {getattr(e, 'problem', e)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None


def parse_spec(model: dict[str, Any], num_classes: int | None = None) -> tuple[NetSpec, list[Node]]:
    """Validate a `model:` mapping and expand it into nodes; `num_classes` overrides the file's."""
    try:
        net = NetSpec.model_validate(model)
    except ValidationError as e:
        raise ConfigError("model: " + _first_error(e)) from None
    if num_classes is not None:
        net = net.model_copy(update={"num_classes": num_classes})
    if len(net.input) == 2:
        raise ConfigError("model: input: give [C, H, W] for images or [F] for vectors")
    return net, _Expander(net).run()


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "literal[")))
    msg = err["msg"].removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


class _Expander:
    """Walks the top-level layers, expanding blocks, applying defaults and resolving inputs."""

    def __init__(self, net: NetSpec):
        self.net = net
        self.nodes: list[Node] = []
        self.value_of: dict[str, int] = {"input": 0}  # layer or block name -> value index
        self.later = self._all_declared_names()

    def run(self) -> list[Node]:
        for index, raw in enumerate(self.net.layers):
            if not isinstance(raw, dict):
                raise ConfigError(f"layer {index}: expected a mapping, got {raw!r}")
            if "block" in raw:
                self._add_block(index, raw)
            else:
                params = {"num_classes": self.net.num_classes}
                self._add_layer(index, index, raw, "", params, len(self.nodes), local=None)
        return self.nodes

    def _all_declared_names(self) -> set[str]:
        return {
            str(raw["name"]) for raw in self.net.layers if isinstance(raw, dict) and "name" in raw
        }

    def _add_block(self, index: int, raw: dict[str, Any]) -> None:
        raw = dict(raw)
        block_name = raw.pop("block")
        label = f"layer {index} ({raw.get('name', block_name)})"
        if block_name not in self.net.blocks:
            raise ConfigError(
                f"{label}: block: unknown block {block_name!r}{_suggest(block_name, self.net.blocks)}"
            )
        block = self.net.blocks[block_name]
        name = str(raw.pop("name", f"{block_name}{index}"))
        repeat = raw.pop("repeat", 1)
        if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
            raise ConfigError(f"{label}: repeat: must be a whole number >= 1, got {repeat!r}")
        inputs = raw.pop("inputs", None)
        params = self._block_params(label, block_name, block, raw)
        if isinstance(inputs, list) and len(inputs) != 1:
            raise ConfigError(f"{label}: inputs: a block takes one input, got {inputs!r}")
        ref = inputs[0] if isinstance(inputs, list) else inputs
        value = (
            self._resolve(label, name, [ref], None, len(self.nodes))[0] if ref else len(self.nodes)
        )
        for r in range(repeat):
            prefix = f"{name}.{r}." if repeat > 1 else f"{name}."
            local = {"input": value}
            for i, raw_layer in enumerate(block.layers):
                if "block" in raw_layer:
                    raise ConfigError(
                        f"{label}: block {block_name!r} holds a block: blocks do not nest"
                    )
                previous = value if i == 0 else len(self.nodes)
                self._add_layer(index, i, raw_layer, prefix, params, previous, local)
            value = len(self.nodes)
            if repeat > 1:
                self.value_of[prefix[:-1]] = value
        self.value_of[name] = value

    def _block_params(self, label: str, block_name: str, block: BlockDef, given: dict) -> dict:
        unknown = set(given) - set(block.params)
        if unknown:
            takes = ", ".join(block.params) or "no parameters"
            raise ConfigError(
                f"{label}: block {block_name!r} has no parameter {sorted(unknown)[0]!r} (it takes {takes})"
            )
        params = {"num_classes": self.net.num_classes, **block.params, **given}
        missing = [k for k, v in params.items() if v is None and k != "num_classes"]
        if missing:
            raise ConfigError(f"{label}: block {block_name!r} needs parameter {missing[0]!r}")
        return params

    def _add_layer(
        self,
        index: int,
        position: int,
        raw: dict,
        prefix: str,
        params: dict,
        previous: int,
        local: dict[str, int] | None,
    ) -> None:
        """Add one layer; `position` is its place in its list (for its default name `relu3`)."""
        short = raw.get("name", f"{raw.get('type', 'layer')}{position}")
        name = prefix + str(short)
        label = f"layer {index} ({name})"
        fields = _substitute(label, raw, params)
        kind = fields.get("type")
        if kind not in KINDS:
            hint = _suggest(str(kind), KINDS)
            raise ConfigError(
                f"{label}: type: " + (f"unknown type {kind!r}{hint}" if kind else "missing")
            )
        fields = _with_defaults(fields, self.net.defaults.get(kind, {}))
        fields["name"] = name
        layer = _validate(label, kind, fields)
        if isinstance(layer, Linear) and layer.out_features is None and self.net.num_classes:
            layer = layer.model_copy(update={"out_features": self.net.num_classes})
        self._check_name(label, name, str(short))
        names = layer.inputs or ["previous"]
        inputs = tuple(self._resolve(label, str(short), names, local, previous))
        self.nodes.append(Node(index, name, layer, inputs))
        self.value_of[name] = len(self.nodes)
        if local is not None:
            local[str(short)] = len(self.nodes)

    def _check_name(self, label: str, name: str, short: str) -> None:
        if not NAME_RE.match(name) or short in RESERVED:
            raise ConfigError(
                f"{label}: name: {short!r} is not a usable name (letters, digits, _ and -; "
                "not 'input' or 'previous')"
            )
        if name in self.value_of:
            raise ConfigError(f"{label}: name: {name!r} is used twice")
        taken = next(
            (n for n in self.value_of if n.startswith(name + ".") or name.startswith(n + ".")), None
        )
        if taken and taken != "input":
            raise ConfigError(
                f"{label}: name: {name!r} clashes with {taken!r} (one would hold the other)"
            )

    def _resolve(
        self, label: str, short: str, names: list[str], local: dict[str, int] | None, previous: int
    ) -> list[int]:
        out = []
        for ref in names:
            if ref == "previous":
                out.append(previous)
            elif local is not None and ref in local:
                out.append(local[ref])
            elif local is None and ref in self.value_of:
                out.append(self.value_of[ref])
            elif ref == short:
                raise ConfigError(f"{label}: inputs: names itself (a cycle)")
            elif local is None and ref in self.later:
                raise ConfigError(
                    f"{label}: inputs: {ref!r} comes later; inputs may only name earlier layers"
                )
            else:
                pool = local if local is not None else self.value_of
                raise ConfigError(f"{label}: inputs: unknown layer {ref!r}{_suggest(ref, pool)}")
        return out


def _validate(label: str, kind: str, fields: dict[str, Any]) -> Layer:
    try:
        return KINDS[kind].model_validate(fields)
    except ValidationError as e:
        raise ConfigError(f"{label}: {_first_error(e)}") from None


def _with_defaults(fields: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    merged = {**defaults, **fields}
    for key in MERGED_FIELDS:
        if isinstance(defaults.get(key), dict) and isinstance(fields.get(key), dict):
            merged[key] = {**defaults[key], **fields[key]}
    return merged


def _substitute(label: str, value: Any, params: dict[str, Any]) -> Any:
    """Replace every `$name` string by its parameter value."""
    if isinstance(value, dict):
        return {k: _substitute(label, v, params) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(label, v, params) for v in value]
    if isinstance(value, str) and value.startswith("$"):
        key = value[1:]
        if key not in params or params[key] is None:
            raise ConfigError(
                f"{label}: {value} is not a parameter here (known: {sorted(k for k in params if params[k] is not None)})"
            )
        return params[key]
    return value


def _suggest(word: str, known: Any) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
