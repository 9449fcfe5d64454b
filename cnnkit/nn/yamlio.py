"""The one YAML reader of cnnkit: PyYAML's safe loader with bounds (file size, nesting depth,
values, alias expansion) and no duplicate keys, so a hostile or mistyped file fails fast, in one
line. A document over FAST_FROM characters is parsed by libyaml (where PyYAML has it), so that
even a 16 MiB one is read or refused in seconds; smaller ones by PyYAML's parser, whose error
messages name the character or alias at fault.

`load_yaml(text)` raises yaml.YAMLError like `yaml.safe_load`; `read_yaml(path)` turns every
problem into a ConfigError naming the file, line and column.
"""

from __future__ import annotations

import codecs
import datetime
import os
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from cnnkit.errors import ConfigError, brief, one_line

MAX_BYTES = 16 * 2**20  # a 10,000-layer network file is about 1 MB
# the exports cnnkit writes, never reads, by their suffixes
EXPORTS = {".onnx": "an ONNX", ".pt2": "a torch.export", ".torchscript": "a TorchScript"}
MAX_DEPTH = 50  # a network file nests about 10 deep (aliases expanded too)
MAX_NODES = 1_000_000  # values after expanding aliases (a "billion laughs" file has 10^9)
FAST_FROM = 2**20  # characters: larger documents are parsed by libyaml
_MERGE = "tag:yaml.org,2002:merge"


class LimitError(yaml.MarkedYAMLError):
    """A document past one of the bounds above, with a duplicate key, or with a value that is
    not read as written (YAML 1.1's octal) or is none of JSON's types (`!!binary`, `!!set`)."""


class _Bounded(Composer, SafeConstructor, Resolver):
    """PyYAML's composer and safe constructor, capping nesting and the number of values while
    composing, refusing duplicate keys, and checking the document's size with aliases expanded
    before anything is constructed; the events come from the parser it is mixed with."""

    def __init__(self) -> None:
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        self._depth = self._composed = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        self._composed += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise LimitError(None, None, f"nested more than {MAX_DEPTH} levels deep", mark)
            if self._composed > MAX_NODES:  # stopped while reading, not once all is read
                mark = self.peek_event().start_mark
                raise LimitError(None, None, f"more than {MAX_NODES:,} values", mark)
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
        into an int (sys.get_int_max_str_digits), and says so with a ValueError. YAML 1.1's
        octal (032 is 26), base-60 (1:0 is 60) and binary forms are refused, never read as a
        number other than the one written."""
        text = node.value.replace("_", "").lstrip("+-")
        if ":" in text or text.startswith("0b") or (len(text) > 1 and text[0] == "0" and
                                                     text[1].isdigit()):  # fmt: skip
            value = super().construct_yaml_int(node)
            raise LimitError(None, None, f"{node.value[:40]} is read by YAML 1.1 as {value}, "
                             "not as written: write it without a leading 0 or ':', or quote "
                             "it", node.start_mark)  # fmt: skip
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            digits = sum(c.isdigit() for c in node.value)
            limit = getattr(sys, "get_int_max_str_digits", None)  # (Python 3.10.7 on)
            if limit is None or digits <= limit():
                raise  # not an integer (`!!int abc`): said by construct_object
            raise LimitError(None, None, f"an integer of {digits:,} digits is too long to read",
                             node.start_mark) from None  # fmt: skip

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        """A value, or an error at its line where an explicit tag does not fit what it tags
        (`!!float abc`, `!!bool maybe`, `!!int ""`), which PyYAML's constructors let out as a
        bare ValueError, KeyError or IndexError."""
        try:
            return super().construct_object(node, deep)
        except (ValueError, KeyError, IndexError, TypeError):
            if not isinstance(node, ScalarNode):
                raise
            tag = node.tag.rsplit(":", 1)[-1]
            raise LimitError(None, None, f"{brief(node.value)} is not a valid !!{tag}",
                             node.start_mark) from None  # fmt: skip

    def construct_yaml_float(self, node: ScalarNode) -> float:
        """A float, but not YAML 1.1's base-60 form (1:30.5 is 90.5)."""
        if ":" in node.value:
            value = super().construct_yaml_float(node)
            raise LimitError(None, None, f"{node.value[:40]} is read by YAML 1.1 as {value:g}, "
                             "not as written: quote it", node.start_mark)  # fmt: skip
        return super().construct_yaml_float(node)

    def construct_yaml_timestamp(self, node: ScalarNode) -> str:
        """A date or time (2024-01-01) as the text written: a network or run file holds JSON's
        types, which a checkpoint (read with weights_only) and an export's JSON also hold."""
        return self.construct_scalar(node)

    def construct_not_plain(self, node: Node) -> None:
        """`!!binary`, `!!set`, `!!omap`, `!!pairs`: refused at their line, as no field takes
        them and neither a checkpoint nor JSON would hold them."""
        tag = node.tag.rsplit(":", 1)[-1]
        raise LimitError(None, None, f"!!{tag} is not a value a network or run file takes: "
                         "write a number, string, list or mapping", node.start_mark)  # fmt: skip

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, MappingNode):  # `!!map abc`, `!!map [1, 2]`
            what = brief(node.value) if isinstance(node, ScalarNode) else "a list"
            raise LimitError(None, None, f"{what} is not a valid !!map", node.start_mark)
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


_Bounded.add_constructor("tag:yaml.org,2002:int", _Bounded.construct_yaml_int)
_Bounded.add_constructor("tag:yaml.org,2002:float", _Bounded.construct_yaml_float)
_Bounded.add_constructor("tag:yaml.org,2002:timestamp", _Bounded.construct_yaml_timestamp)
for _tag in ("binary", "set", "omap", "pairs"):
    _Bounded.add_constructor(f"tag:yaml.org,2002:{_tag}", _Bounded.construct_not_plain)


class _Loader(Reader, Scanner, Parser, _Bounded):
    """PyYAML's own parser: its messages name the character or alias at fault."""

    def __init__(self, stream: str):
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)
        _Bounded.__init__(self)


try:  # libyaml's scanner and parser: 5x faster, for a large file refused in seconds, not minutes
    from yaml._yaml import CParser
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    _FastLoader = _Loader
else:

    class _FastLoader(_Bounded, CParser):  # (the composer above CParser's own)
        def __init__(self, stream: str):
            CParser.__init__(self, stream)
            _Bounded.__init__(self)


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
    loader = (_FastLoader if len(text) > FAST_FROM else _Loader)(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml(path: str | Path, instead: str | None = None) -> Any:
    """Read a YAML file; any problem is one ConfigError with the file, line and column.
    `instead`: what to give in place of a binary file (by default, a network or run file's
    alternatives)."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_BYTES:
            if export_kind(path) is not None and not instead:  # a large model: said for what it is
                raise ConfigError(f"{path}: {_binary_hint(path)}")
            raise ConfigError(
                f"{path}: larger than {MAX_BYTES // 2**20} MiB: not a network or run file"
            )
        data = path.read_bytes()
        return load_yaml(_text(data))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML{_where(e)}: {_problem(e)}") from None
    except UnicodeDecodeError as e:
        exported = export_kind(path) is not None
        binary = not _mostly_ascii(data[:8192]) or exported
        if exported and not instead:  # said for what it is
            raise ConfigError(f"{path}: {_binary_hint(path)}") from None
        if binary or e.encoding != "utf-8":  # (a UTF-16 mark on what is no UTF-16 text)
            raise ConfigError(f"{path}: not a text file: {instead or _binary_hint(path)}") from None
        at = e.start + 3 * data.startswith(codecs.BOM_UTF8)  # (utf-8-sig counts after the mark)
        line, column = data.count(b"\n", 0, at) + 1, at - data.rfind(b"\n", 0, at)
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{data[at]:02x} at line {line}, "
                          f"column {column}): save it as UTF-8") from None  # fmt: skip
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or one_line(e, 160)}") from None


_LAYER_NAMED = re.compile(r"(?:model: )?(?:layer (\d+)\b|layers\.(\d+)\b)")


def layer_line(path: str | Path, message: str) -> int | None:
    """The line in a network file of the top-level layer an error names first (cnnkit's
    `layer 3 (...)`, pydantic's `layers.3`), read again from the file only when an error needs
    it; None where it names none, or the file does not say."""
    found = _LAYER_NAMED.match(message)
    if found is None:
        return None
    try:
        loader = _Loader(_text(Path(path).read_bytes()))
        try:
            root = loader.get_single_node()
        finally:
            loader.dispose()
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    model = _value(root, "model")
    if isinstance(_value(model, "network"), MappingNode):  # a run file's {network: {layers}}
        model = _value(model, "network")
    layers = _value(root if model is None else model, "layers")
    index = int(found[1] or found[2])
    if not isinstance(layers, SequenceNode) or index >= len(layers.value):
        return None
    mark = layers.value[index].start_mark
    if not layers.start_mark.index <= mark.index < layers.end_mark.index:
        return None  # an alias (*name): written where its anchor is, not at this layer's place
    return mark.line + 1


def _value(node: Node | None, key: str) -> Node | None:
    """The node under `key` of a mapping node, None where there is none."""
    if isinstance(node, MappingNode):
        for k, v in node.value:
            if isinstance(k, ScalarNode) and k.value == key:
                return v
    return None


def _text(data: bytes) -> str:
    """A file's text: UTF-8, or UTF-16 / UTF-32 where a byte-order mark says so (as YAML
    allows); UnicodeDecodeError otherwise."""
    for mark, codec in ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
                        (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16")):  # fmt: skip
        if data.startswith(mark):
            return data.decode(codec)
    return data.decode("utf-8-sig")


def _mostly_ascii(sample: bytes) -> bool:
    """Whether bytes look like text in some 8-bit encoding (Latin-1, cp1252): no NUL, and at
    least 70% printable ASCII or line breaks."""
    plain = sum(32 <= b < 127 or b in (9, 10, 13) for b in sample)
    return b"\0" not in sample and plain >= 0.7 * len(sample)


def _binary_hint(path: Path) -> str:
    """What a binary file given for a network or run file may be, and what to give instead."""
    kind = export_kind(path)
    if kind is not None:
        return export_said(kind)
    return "give a zoo name, a network or run file (YAML), a Caffe .prototxt or a trained model"


def export_said(kind: str) -> str:
    return (f"{kind} export, which cnnkit writes but does not read back: give the run "
            "directory, .pt checkpoint or .safetensors export it came from")  # fmt: skip


def export_kind(path: Path) -> str | None:
    """`an ONNX`, `a torch.export`, `a TorchScript`: the export (binary, written by cnnkit, never
    read) that `path` is by its name, or by its contents under any name (`-f torchscript -o
    d.ts`); None for anything else."""
    kinds = {"torchscript": EXPORTS[".torchscript"], "torch-export": EXPORTS[".pt2"]}
    return EXPORTS.get(path.suffix.lower()) or kinds.get(archive_format(path))


def archive_format(path: Path) -> str | None:
    """A zip archive's export format: TorchScript keeps code/, torch.export an archive_format;
    None for any other file."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return None
    if any("/code/" in n for n in names):
        return "torchscript"
    return "torch-export" if any(n.endswith("/archive_format") for n in names) else None


def _where(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""


def _problem(e: yaml.YAMLError) -> str:
    return str(getattr(e, "problem", None) or str(e).splitlines()[0])[:200]


_PLAIN_SCALARS = (str, int, float, bool, type(None))


def plain_data(value: Any, where: str = "") -> Any:
    """A network or run given as Python objects, with only the types a YAML file gives (JSON's):
    dates and times as their ISO text (as read_yaml reads them), NumPy scalars as numbers, tuples
    as lists, paths as text. ConfigError at `where` (the dotted key of `value`) for anything else: a
    checkpoint holds the network and is read with weights_only, which refuses other objects."""
    if type(value) in _PLAIN_SCALARS:
        return value
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:  # np.int64(3)
        return plain_data(value.item(), where)  # (np.float64 and np.str_ subclass float, str)
    for kind in (int, float, str):  # subclasses (an IntEnum, a str Enum): the plain value
        if isinstance(value, kind):
            return kind(value) if kind is not str else str.__str__(value)
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, _PLAIN_SCALARS) and type(key).__module__ != "numpy":
                raise ConfigError(f"{where or 'the top level'}: a key of type "
                                  f"{_type_name(key)}: keys are text or numbers")  # fmt: skip
            key = plain_data(key, where)
            out[key] = plain_data(item, f"{where}.{key}" if where else str(key))
        return out
    if isinstance(value, (list, tuple)):
        return [plain_data(item, f"{where}[{k}]") for k, item in enumerate(value)]
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise ConfigError(f"{where}: {_type_name(value)} is not a value a network or run takes: "
                      "give a number, text, list or mapping")  # fmt: skip


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
