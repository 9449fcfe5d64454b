"""A reader of protobuf text format (Caffe's .prototxt): a tree of Messages whose fields keep
their order and line numbers, so errors can name the line."""

from __future__ import annotations

import codecs
import re
from typing import Any

from cnnkit.errors import ConfigError

_TOKEN_RE = re.compile(
    r"""(?P<space>[ \t\r\n,;]+)|(?P<comment>\#[^\n]*)
    |(?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
    |(?P<punct>[{}<>:\[\]])
    |(?P<number>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?[fF]?(?![A-Za-z_]))
    |(?P<word>-?[A-Za-z_][A-Za-z0-9_.]*)""",
    re.VERBOSE,
)
_CLOSE = {"{": "}", "<": ">"}
MAX_DEPTH = 100  # protobuf's own parsers stop at 100 nested messages too
INTEGER_RANGE = (-(2**63), 2**64 - 1)  # int64 to uint64: protobuf's widest integers


class Message:
    """One protobuf text-format message: its fields in order, as (name, value, line)."""

    def __init__(self, line: int = 0):
        self.line = line
        self.fields: list[tuple[str, Any, int]] = []

    def all(self, name: str) -> list[Any]:
        """Every value of a (repeated) field."""
        return [v for n, v, _ in self.fields if n == name]

    def get(self, name: str, default: Any = None) -> Any:
        """The last value of a field (protobuf's rule for a repeated singular field)."""
        values = self.all(name)
        return values[-1] if values else default

    def sub(self, name: str) -> Message:
        """A sub-message, or an empty one when absent."""
        value = self.get(name)
        return value if isinstance(value, Message) else Message(self.line)


def parse_prototxt(text: str, source: str = "prototxt") -> Message:
    """Parse protobuf text format into a Message tree; errors name the source and line."""
    tokens = _tokenize(text, source)
    message, end = _parse_message(tokens, 0, None, source, 1, 0)
    if end != len(tokens):
        kind, value, line = tokens[end]
        raise ConfigError(f"{source}:{line}: unexpected {value!r}")
    return message


def _tokenize(text: str, source: str) -> list[tuple[str, str, int]]:
    tokens, pos, line = [], 0, 1
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if m is None:
            raise ConfigError(f"{source}:{line}: cannot read {text[pos : pos + 20]!r}")
        if m.lastgroup not in ("space", "comment"):
            tokens.append((m.lastgroup, m.group(), line))
        line += m.group().count("\n")
        pos = m.end()
    return tokens


def _parse_message(
    tokens, i: int, close: str | None, source: str, line: int, depth: int
) -> tuple[Message, int]:
    if depth > MAX_DEPTH:
        raise ConfigError(f"{source}:{line}: blocks nested more than {MAX_DEPTH} deep")
    message = Message(line)
    while i < len(tokens) and tokens[i][1] != close:
        kind, name, line = tokens[i]
        if kind != "word":
            raise ConfigError(f"{source}:{line}: expected a field name, got {name!r}")
        i += 1
        if i < len(tokens) and tokens[i][1] == ":":
            i += 1
        values, i = _parse_value(tokens, i, source, line, depth)
        message.fields.extend((name, v, line) for v in values)
    if close is not None and i >= len(tokens):
        raise ConfigError(
            f"{source}: missing {close!r} for the block opened at line {message.line}"
        )
    return message, i


def _parse_value(tokens, i: int, source: str, line: int, depth: int) -> tuple[list[Any], int]:
    if i >= len(tokens):
        raise ConfigError(f"{source}:{line}: the file ends where a value should be")
    kind, text, _ = tokens[i]
    if text in _CLOSE:
        message, i = _parse_message(tokens, i + 1, _CLOSE[text], source, line, depth + 1)
        return [message], i + 1
    if text == "[":  # list syntax: name: [1, 2] or name [{...}, {...}]
        values, i = [], i + 1
        while i < len(tokens) and tokens[i][1] != "]":
            if tokens[i][1] == "[":  # protobuf has no list of lists
                raise ConfigError(f"{source}:{tokens[i][2]}: a list inside a list")
            more, i = _parse_value(tokens, i, source, line, depth)
            values += more
        return values, i + 1
    if kind == "punct":
        raise ConfigError(f"{source}:{line}: expected a value, got {text!r}")
    return [_scalar(kind, text, f"{source}:{tokens[i][2]}")], i + 1


def _scalar(kind: str, text: str, here: str) -> Any:
    if kind == "string":  # C escapes (\n, \x41, \101) over UTF-8 text, as protobuf reads it
        try:
            return codecs.escape_decode(text[1:-1].encode("utf-8"))[0].decode("utf-8")
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"{here}: the string {text[:40]} does not decode ({e})") from None
    if kind == "number":
        text = text.rstrip("fF")
        return float(text) if any(c in text for c in ".eE") else _integer(text, here)
    return {"true": True, "True": True, "false": False, "False": False}.get(text, text)


def _integer(text: str, here: str) -> int:
    """An integer literal within protobuf's 64 bits (its text parser refuses the rest, and
    Python refuses to read one of over 4,300 digits)."""
    sign, digits = "-" if text.startswith("-") else "", text.lstrip("+-").lstrip("0") or "0"
    value = int(sign + digits) if len(digits) <= 20 else None  # 2**64 has 20 digits
    if value is None or not INTEGER_RANGE[0] <= value <= INTEGER_RANGE[1]:
        shown = text if len(text) <= 24 else f"{text[:12]}...{text[-6:]} ({len(digits):,} digits)"
        raise ConfigError(f"{here}: the integer {shown} is out of range (protobuf's integers "
                          "hold 64 bits)")  # fmt: skip
    return value
