"""The one YAML reader of cnnkit: PyYAML's safe loader with bounds (file size, nesting depth,
alias expansion) and no duplicate keys, so a hostile or mistyped file fails fast, in one line.

`load_yaml(text)` raises yaml.YAMLError like `yaml.safe_load`; `read_yaml(path)` turns every
problem into a ConfigError naming the file, line and column.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from cnnkit.errors import ConfigError, brief, one_line

MAX_BYTES = 16 * 2**20  # a 10,000-layer network file is about 1 MB
MAX_DEPTH = 50  # a network file nests about 10 deep (aliases expanded too)
MAX_NODES = 1_000_000  # values after expanding aliases (a "billion laughs" file has 10^9)
_MERGE = "tag:yaml.org,2002:merge"


class LimitError(yaml.MarkedYAMLError):
    """A document past one of the bounds above, or with a duplicate key."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that caps nesting while composing, refuses duplicate keys and checks the
    document's size with aliases expanded before anything is constructed."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise LimitError(None, None, f"nested more than {MAX_DEPTH} levels deep", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self) -> Node | None:
        node = super().get_single_node()
        if node is not None:
            _expanded_size(node, {}, set(), 1)
        return node

    def construct_yaml_int(self, node: ScalarNode) -> int:
        """An integer, or an error at its line: Python turns no text of over 4,300 digits
        into an int (sys.get_int_max_str_digits), and says so with a ValueError."""
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            digits = sum(c.isdigit() for c in node.value)
            raise LimitError(None, None, f"an integer of {digits:,} digits is too long to read",
                             node.start_mark) from None  # fmt: skip

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise LimitError(
                    "in a mapping",
                    node.start_mark,
                    f"duplicate key {brief(key)}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def _expanded_size(
    node: Node, memo: dict[int, tuple[int, int]], open_: set[int], level: int
) -> int:
    """How many values `node` holds with every alias expanded (shared nodes counted each time),
    refusing more than MAX_DEPTH levels of nesting through aliases (`node` is at `level`).
    `memo` holds each node's (size, depth), so a shared node is walked once."""
    key = id(node)
    size, depth = memo.get(key, (1, 1))
    if level + depth - 1 > MAX_DEPTH:
        raise LimitError(None, None, f"nested more than {MAX_DEPTH} levels deep once aliases "
                         "are expanded", node.start_mark)  # fmt: skip
    if key in memo:
        return size
    if key in open_:
        raise LimitError(
            None, None, "an alias refers to itself (a recursive structure)", node.start_mark
        )
    if isinstance(node, (SequenceNode, MappingNode)):
        open_.add(key)
        children = (
            node.value if isinstance(node, SequenceNode) else [n for kv in node.value for n in kv]
        )
        for child in children:
            size += _expanded_size(child, memo, open_, level + 1)
            depth = max(depth, memo[id(child)][1] + 1)
            if size > MAX_NODES:
                raise LimitError(
                    None, None, f"more than {MAX_NODES:,} values once aliases are expanded",
                    node.start_mark,
                )  # fmt: skip
        open_.discard(key)
    memo[key] = (size, depth)
    return size


def load_yaml(text: str) -> Any:
    """Parse one YAML document safely and within bounds; raises yaml.YAMLError."""
    if len(text) > MAX_BYTES:
        raise LimitError(None, None, f"larger than {MAX_BYTES // 2**20} MiB", None)
    loader = _Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> Any:
    """Read a YAML file; any problem is one ConfigError with the file, line and column."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_BYTES:
            raise ConfigError(
                f"{path}: larger than {MAX_BYTES // 2**20} MiB: not a network or run file"
            )
        return load_yaml(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML{_where(e)}: {_problem(e)}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file: {_binary_hint(path)}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or one_line(e, 160)}") from None


def _binary_hint(path: Path) -> str:
    """What a binary file given for a network or run file may be, and what to give instead."""
    if path.suffix.lower() in (".onnx", ".pt2", ".torchscript"):
        return ("an export, which cnnkit writes but does not read back: give the run directory, "
                ".pt checkpoint or .safetensors export it came from")  # fmt: skip
    return "give a zoo name, a network or run file (YAML), a Caffe .prototxt or a trained model"


def _where(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""


def _problem(e: yaml.YAMLError) -> str:
    return str(getattr(e, "problem", None) or str(e).splitlines()[0])[:200]
