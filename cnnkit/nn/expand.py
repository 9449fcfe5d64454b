"""The expander: network-file layers -> a flat list of Nodes with their output shapes.

It expands blocks (nested, repeated as stages, sequential numbering), evaluates `$params`
and their arithmetic with `$in_channels` (the shape of what a layer or block reads), drops
layers whose `if:` is false (an absent layer stands for its first input), applies defaults,
resolves `inputs` and infers every shape, so each mistake is reported naming its layer.
The work grows with the entries expanded (each layer, absent layer and block copy), which is
bounded by MAX_ENTRIES as the layers made are by MAX_LAYERS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from cnnkit.errors import ConfigError, brief, suggest, validation_message
from cnnkit.nn.expr import (
    ExprError,
    division_hint,
    evaluate,
    is_expression,
    reads,
    with_dollars,
)
from cnnkit.nn.kinds import KINDS
from cnnkit.nn.layer_line import (
    check_field_names,
    check_own_init,
    check_unexpanded,
    infer_shape,
    layer_label,
    shape_params,
    validate_layer,
    with_defaults,
)
from cnnkit.nn.layers import Layer, Linear, Shape
from cnnkit.nn.names import check_name, given_name, given_names, input_names, is_name, written
from cnnkit.nn.spec import BLOCK_LINE_KEYS, BlockDef, NetSpec
from cnnkit.nn.stages import MAX_LAYERS, Stage, stage_of

MAX_BLOCK_DEPTH = 16
# entries expanded, counting absent layers and block copies that make no layer: the bound on
# the expander's work (copies of an all-absent block would otherwise run for hours unchecked)
MAX_ENTRIES = 5 * MAX_LAYERS


@dataclass(frozen=True)
class Node:
    """One layer of the expanded graph; `inputs` index earlier values (0 is the network input)."""

    index: int  # position in the file's top-level `layers:` list, for error messages
    name: str
    layer: Layer
    inputs: tuple[int, ...]
    shape: Shape  # output shape, per sample
    head: bool = False  # sized by num_classes (a fine-tuned net's fresh classifier)


@dataclass
class _Scope:
    """Where an entry is expanded: the top-level list or one copy of a block."""

    index: int  # top-level entry, for messages
    prefix: str  # "layer2.0."
    params: dict[str, Any]
    local: dict[str, int] | None  # a block's names -> value index; None at the top level
    last: int  # the value of the entry before (what `previous` means)
    sequential: bool = False
    counter: int = 0  # the next number of a sequential block
    depth: int = 0
    sized: frozenset[str] = frozenset({"num_classes"})  # the params num_classes sizes
    named: frozenset[str] = frozenset()  # names the file gives entries here (no default takes one)


class Expander:
    """Walks the top-level layers, expanding blocks, applying defaults and resolving inputs."""

    def __init__(self, net: NetSpec):
        self.net = net
        self.nodes: list[Node] = []
        self.shapes: list[Shape] = [tuple(net.input)]  # value index -> shape
        self.value_of: dict[str, int] = {"input": 0}  # full name -> value index
        self.taken: set[str] = set()  # module names
        self.holders: dict[str, str] = {}  # each dotted prefix of a module name -> that name
        self.later = {str(raw["name"]) for raw in net.layers if "name" in raw}
        self.entries = 0  # entries expanded so far (see MAX_ENTRIES)
        self.expanded: set[str] = set()  # blocks whose lines were expanded at least once

    def run(self) -> tuple[list[Node], int]:
        """The nodes, and the output's value: the last entry's (if absent, its input's)."""
        named = frozenset(self.later) | given_names(self.net.layers, self.net.blocks)
        scope = _Scope(0, "", {"num_classes": self.net.num_classes}, None, 0, named=named)
        for index, raw in enumerate(self.net.layers):
            scope.index = index
            self._entry(raw, index, scope)
        check_unexpanded(self.net.blocks, self.expanded)
        return self.nodes, scope.last

    # -- entries ----------------------------------------------------------------------------------

    def _entry(self, raw: Any, position: int, scope: _Scope) -> None:
        where = (
            layer_label(scope.index, scope.prefix[:-1]) if scope.prefix else f"layer {scope.index}"
        )
        self.entries += 1
        if self.entries > MAX_ENTRIES:
            raise ConfigError(
                f"{where}: the network expands to more than {MAX_ENTRIES:,} entries (layers, "
                "absent layers and block copies; check repeat)"
            )
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a mapping, got {brief(raw)}")
        raw = dict(raw)
        if "block" in raw:
            self._block(raw, position, scope)
        else:
            self._layer(raw, position, scope)

    def _layer(self, raw: dict[str, Any], position: int, scope: _Scope) -> None:
        condition = raw.pop("if", None)
        kind = raw.get("type")
        if is_expression(kind):
            kind = self._sub(f"layer {scope.index}", "type", kind, scope.params)
        if not isinstance(kind, str) or kind not in KINDS:  # (named as written, if it is)
            where = f"in {scope.prefix[:-1]}" if scope.prefix else ""
            named = layer_label(scope.index, scope.prefix + self._short(raw, "", scope))
            label = named if "name" in raw else f"layer {scope.index}{f' ({where})' * bool(where)}"
            typo = next(
                (k for k in raw if k != "type" and isinstance(k, str) and suggest(k, ["type"])),
                None,
            )
            missing = f"missing (is {brief(typo)} meant to be type?)" if typo else "missing"
            what = f"unknown type {brief(kind)}{suggest(kind, KINDS)}" if kind else missing
            raise ConfigError(f"{label}: type: {what}")
        short = self._short(raw, f"{kind}{position}", scope)
        label = layer_label(scope.index, scope.prefix + short)
        fields = with_defaults(raw, self.net.defaults.get(kind, {}))
        head = any(reads(v, scope.sized) for v in fields.values())  # a classifier (or defaults')
        names = self._sub(label, "inputs", fields.pop("inputs", None), scope.params)
        names = input_names(names)
        if names is not None and not (isinstance(names, list) and names):
            raise ConfigError(
                f"{label}: inputs: a layer name or a list of them, got {brief(names)}"
            )
        inputs = self._resolve(label, short, names or ["previous"], scope)
        in_shapes = [self.shapes[i] for i in inputs]
        env = {**scope.params, **shape_params(in_shapes[0])}
        if not self._present(label, condition, env):
            check_field_names(label, kind, fields)
            return self._alias(scope, short, inputs[0])
        written = fields
        fields = self._sub(label, None, {**fields, "type": kind}, env)
        try:
            layer = validate_layer(
                label, kind, {**fields, "name": scope.prefix + short, "inputs": names}
            )
        except ConfigError as e:
            raise ConfigError(f"{e}{division_hint(str(e), label, written, fields)}") from None
        check_own_init(label, raw, layer)
        if isinstance(layer, Linear) and layer.out_features is None and self.net.num_classes:
            layer, head = layer.model_copy(update={"out_features": self.net.num_classes}), True
        check_name(label, scope.prefix + short, short, self.taken, self.holders)
        shape = infer_shape(label, layer, in_shapes)
        self._add(Node(scope.index, scope.prefix + short, layer, tuple(inputs), shape, head))
        self._register(scope, short, len(self.nodes), raw)

    def _block(self, raw: dict[str, Any], position: int, scope: _Scope) -> None:
        condition = raw.pop("if", None)
        block_name = self._sub(f"layer {scope.index}", "block", raw.pop("block"), scope.params)
        if not isinstance(block_name, str):
            raise ConfigError(f"layer {scope.index}: block: the name of a block under "
                              f"model.blocks, got {brief(block_name)}")  # fmt: skip
        short = self._short(raw, f"{block_name}{position}", scope)
        named = raw.pop("name", None) is not None
        label = layer_label(scope.index, scope.prefix + short)
        block = self._block_def(label, block_name)
        ref = self._sub(label, "inputs", raw.pop("inputs", None), scope.params)
        value, *others = self._block_inputs(label, short, ref, scope, block_name, block)
        env = {**scope.params, **shape_params(self.shapes[value])}
        for key in ("repeat", "start", "first", "inline"):  # these may be $parameters too
            if key in raw:
                raw[key] = self._sub(label, key, raw[key], env)
        stage = stage_of(label, short, raw, named, scope.sequential)
        if not self._present(label, condition, env):  # (a present line's copies check theirs)
            if not (stage.repeat == 1 and stage.first and "block" in stage.first):  # (else:
                self._known_params(label, block_name, block, raw)  # its parameters: first's)
            return self._alias(scope, short, value)
        if scope.depth >= MAX_BLOCK_DEPTH:
            raise ConfigError(
                f"{label}: block: blocks nest more than {MAX_BLOCK_DEPTH} deep "
                f"(does {brief(block_name)} hold itself?)"
            )
        value = self._copies(label, short, block_name, block, raw, stage, scope, value, others)
        if stage.inline or stage.numbered_on:
            scope.last = value
        else:
            self._register(scope, short, value, {"name": short} if named else {})

    def _copies(
        self, label: str, short: str, block_name: str, block: BlockDef, raw: dict[str, Any],
        stage: Stage, scope: _Scope, value: int, others: list[int],
    ) -> int:  # fmt: skip
        """Expand the copies of a block line in turn (each takes the one before's output as
        its first input, the `others` as given); the value the last one outputs."""
        self.expanded.add(block_name)
        for r in range(stage.repeat):
            number = stage.start + r
            given, this, this_name, where = dict(raw), block, block_name, label
            if r == 0 and stage.first is not None:
                given.update({k: v for k, v in stage.first.items() if k != "block"})
                if "block" in stage.first:  # errors name it: `layer 0 (st): first: block ...`
                    this_name = self._sub(label, "first", stage.first["block"], scope.params)
                    this, where = self._block_def(label, this_name), f"{label}: first"
            env = {**scope.params, **shape_params(self.shapes[value]), "index": number}
            params = self._block_params(where, this_name, this, given, env)
            sized = this.sized_params(given, scope.sized)
            if len(this.inputs) != 1 + len(others):
                raise ConfigError(f"{where}: block {brief(this_name)} takes {len(this.inputs)} "
                                  f"input(s) ({', '.join(this.inputs)}), the line gives "
                                  f"{1 + len(others)}")  # fmt: skip
            local = dict(zip(this.inputs, [value, *others], strict=True))
            if stage.inline:  # its layers join the enclosing list (and its numbering)
                inner = _Scope(
                    scope.index, scope.prefix, params, local, value,
                    scope.sequential, scope.counter, scope.depth + 1, sized,
                    scope.named | given_names(this.layers, self.net.blocks),
                )  # fmt: skip
                value = self._expand(this, inner)
                scope.counter = inner.counter
                if scope.local is not None:  # its names are the enclosing block's, as at the top
                    scope.local.update(
                        (k, v) for k, v in inner.local.items() if k not in this.inputs
                    )
                continue
            if stage.numbered_on:  # unnamed in a sequential block: the next number
                name, scope.counter = str(scope.counter), scope.counter + 1
            else:
                name = stage.copy_name(short, number)
            inner = _Scope(
                scope.index, f"{scope.prefix}{name}.", params, local, value,
                this.sequential, 0, scope.depth + 1, sized,
                given_names(this.layers, self.net.blocks),
            )  # fmt: skip
            value = self._expand(this, inner)
            self.value_of[scope.prefix + name] = value
            if scope.local is not None:
                scope.local[name] = value
        return value

    def _expand(self, block: BlockDef, inner: _Scope) -> int:
        """Expand one copy of a block in its own scope; the value it outputs."""
        for i, entry in enumerate(block.layers):
            self._entry(entry, i, inner)
        return inner.last

    # -- names, values, parameters ----------------------------------------------------------------

    def _short(self, raw: dict[str, Any], default: str, scope: _Scope) -> str:
        if "name" in raw:
            return str(given_name(raw["name"], scope.index))
        if scope.sequential:
            return str(scope.counter)
        name, k = default, 1
        while (
            written(name, scope.named)
            or name in (scope.local or {})
            or scope.prefix + name in self.taken
        ):
            name, k = f"{default}_{k}", k + 1  # never a name the file gives another layer
        return name

    def _register(self, scope: _Scope, short: str, value: int, raw: dict[str, Any]) -> None:
        """`short` now names `value`; it is what the next entry reads as `previous`."""
        if scope.local is not None:
            scope.local[short] = value
        self.value_of[scope.prefix + short] = value
        scope.last = value
        if scope.sequential and "name" not in raw:
            scope.counter += 1

    def _alias(self, scope: _Scope, short: str, value: int) -> None:
        """An absent layer (its `if:` is false) stands for its first input."""
        if scope.local is not None:
            scope.local[short] = value
        self.value_of.setdefault(scope.prefix + short, value)
        scope.last = value

    def _add(self, node: Node) -> None:
        if len(self.nodes) >= MAX_LAYERS:
            raise ConfigError(
                f"layer {node.index} ({node.name}): the network expands to more than "
                f"{MAX_LAYERS:,} layers (check repeat)"
            )
        self.nodes.append(node)
        self.shapes.append(node.shape)
        self.taken.add(node.name)
        parts = node.name.split(".")
        for i in range(1, len(parts)):
            self.holders.setdefault(".".join(parts[:i]), node.name)

    def _block_def(self, label: str, name: Any) -> BlockDef:
        if not isinstance(name, str) or name not in self.net.blocks:
            hint = suggest(name, self.net.blocks)
            raise ConfigError(f"{label}: block: unknown block {brief(name)}{hint}")
        return self.net.blocks[name]

    def _block_inputs(self, label: str, short: str, ref: Any, scope: _Scope, name: str,
                      block: BlockDef) -> list[int]:  # fmt: skip
        """The values a block line gives its block's inputs (none given: `previous`)."""
        refs = ["previous"] if ref is None else input_names(ref)
        if not isinstance(refs, list) or not refs:
            raise ConfigError(f"{label}: inputs: a layer name or a list of them, got {brief(ref)}")
        if len(refs) != len(block.inputs):
            raise ConfigError(f"{label}: inputs: block {brief(name)} takes {len(block.inputs)} "
                              f"input(s) ({', '.join(block.inputs)}), got {len(refs)}")  # fmt: skip
        return self._resolve(label, short, refs, scope)

    def _block_params(self, label: str, name: str, block: BlockDef, given: dict, env: dict) -> dict:
        self._known_params(label, name, block, given)
        shape_env = {k: v for k, v in env.items() if k.startswith("in_")}
        params: dict[str, Any] = {"num_classes": self.net.num_classes}
        for key, default in block.params.items():
            if key in given:
                params[key] = self._sub(label, key, given[key], env)
            else:  # a default may use the parameters before it and the block's input shape
                params[key] = self._sub(label, key, default, {**shape_env, **params})
            if params[key] is None:
                raise ConfigError(f"{label}: block {brief(name)} needs parameter {brief(key)}")
        return params

    @staticmethod
    def _known_params(label: str, name: str, block: BlockDef, given: dict) -> None:
        unknown = [k for k in given if k not in block.params]
        if unknown:
            takes = ", ".join(block.params) or "no parameters"
            if label.endswith(": first"):
                takes += "; the line's parameters go to the first copy too"
            hint = suggest(str(unknown[0]), [*block.params, *BLOCK_LINE_KEYS])
            raise ConfigError(f"{label}: block {brief(name)} has no parameter "
                              f"{brief(unknown[0])} (it takes {takes}){hint}")  # fmt: skip

    def _present(self, label: str, condition: Any, env: dict[str, Any]) -> bool:
        if condition is None:
            return True
        value = self._sub(label, "if", condition, env)
        if not isinstance(value, bool):
            hint = ""
            if isinstance(condition, str) and not is_expression(condition):
                meant = with_dollars(condition, env)
                hint = (f" (parameters are read with $: {brief(meant)})" if meant != condition
                        else " (a condition is true, false or an expression of $parameters)")  # fmt: skip
            raise ConfigError(f"{label}: if: must be true or false, got {brief(value)}{hint}")
        return value

    def _sub(self, label: str, key: str | None, value: Any, env: dict[str, Any]) -> Any:
        """`value` with every `$...` string evaluated; errors name the field."""
        if isinstance(value, dict):
            return {k: self._sub(label, key or k, v, env) for k, v in value.items()}
        if isinstance(value, list):
            return [self._sub(label, key, v, env) for v in value]
        if is_expression(value):
            try:
                return evaluate(value, env)
            except ExprError as e:
                raise ConfigError(f"{label}: {key or 'value'}: {e}") from None
        return value

    def _resolve(self, label: str, short: str, names: list[Any], scope: _Scope) -> list[int]:
        out = []
        for ref in names:
            pool = scope.local if scope.local is not None else self.value_of
            if not isinstance(ref, str):
                raise ConfigError(f"{label}: inputs: {brief(ref)} is not a layer name")
            if ref == "previous":
                out.append(scope.last)
            elif ref in pool:
                out.append(pool[ref])
            elif ref == short:
                raise ConfigError(f"{label}: inputs: names itself (a cycle)")
            elif ref in (self.later if scope.local is None else scope.named):
                raise ConfigError(
                    f"{label}: inputs: {brief(ref)} comes later; inputs may only name earlier layers"
                )
            elif scope.local is not None and ref in self.value_of:  # a layer outside the block
                raise ConfigError(
                    f"{label}: inputs: {brief(ref)} is outside this block, whose layers read "
                    f"`input` and one another (give the block line `inputs: {ref if is_name(ref) else brief(ref)}`)"
                )
            else:
                raise ConfigError(
                    f"{label}: inputs: unknown layer {brief(ref)}{suggest(ref, pool)}"
                )
        return out


def parse_spec(model: dict[str, Any], num_classes: int | None = None) -> tuple[NetSpec, list, int]:
    """A `model:` mapping validated and expanded: (spec, nodes, the output's value index: 0 the
    input, k node k - 1's); `num_classes` overrides the file's."""
    if num_classes is not None and isinstance(model, dict):  # validated as the file's would be
        model = {**model, "num_classes": num_classes}
    try:
        net = NetSpec.model_validate(model)
    except ValidationError as e:
        top = [x for x in e.errors() if x["type"] == "extra_forbidden" and len(x["loc"]) == 1]
        if top:  # a mistyped key of model: itself (num_clases), with the one meant
            typo = str(top[0]["loc"][0])
            raise ConfigError(f"model: {typo[:40]}: unknown field"
                              f"{suggest(typo, NetSpec.model_fields)}") from None  # fmt: skip
        raise ConfigError("model: " + validation_message(e)) from None
    if len(net.input) == 2:
        raise ConfigError("model: input: give [C, H, W] for images or [F] for vectors")
    return net, *Expander(net).run()
