"""Parameter expressions of the network file: `$width * 4`, `($k - 1) // 2`,
`$stride != 1 or $in_channels != $out`. Numbers, booleans, `$names`, + - * / // %, comparisons,
and / or / not (short-circuiting, as in Python), parentheses; nothing else (no names of
Python, no calls, no code).
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Collection
from typing import Any

from cnnkit.errors import brief

MAX_LENGTH = 200
MAX_NESTING = 20
MAX_BITS = 64  # an integer result past this is no size of anything (and 4,300 digits, no str)

_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\.\d+|\d+)"
    r"|\$(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<word>and|or|not|true|false)\b"
    r"|(?P<op>//|==|!=|<=|>=|[-+*/%()<>]))"
)
_ARITH = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    "//": operator.floordiv,
    "%": operator.mod,
}
_COMPARE = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}
NAME_ONLY = re.compile(r"^\$([A-Za-z_][A-Za-z0-9_]*)$")
PARAM = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")  # a parameter read anywhere in an expression


class ExprError(ValueError):
    """An expression that cannot be read or computed; the message says why."""


def is_expression(value: Any) -> bool:
    return isinstance(value, str) and "$" in value


def reads(value: Any, names: Collection[str]) -> bool:
    """Whether `value` is (or holds, in a list or mapping) an expression reading one of the
    parameters `names`."""
    if isinstance(value, (list, tuple)):
        return any(reads(v, names) for v in value)
    if isinstance(value, dict):
        return any(reads(v, names) for v in value.values())
    return isinstance(value, str) and any(m in names for m in PARAM.findall(value))


def evaluate(text: str, params: dict[str, Any]) -> Any:
    """The value of `text`: a lone `$name` is the parameter as it is (any type); anything else
    is an expression over numbers and booleans."""
    whole = NAME_ONLY.match(text.strip())
    if whole:
        return _lookup(whole.group(1), params)
    if len(text) > MAX_LENGTH:
        raise ExprError(f"expression longer than {MAX_LENGTH} characters")
    parser = _Parser(_tokenize(text), params)
    value = parser.disjunction()
    if parser.pos != len(parser.tokens):
        kind, extra = parser.tokens[parser.pos]
        raise ExprError(f"unexpected {'$' * (kind == 'name') + extra!r} in {text!r}")
    return value


def _lookup(name: str, params: dict[str, Any]) -> Any:
    if name == "num_classes" and params.get(name, 0) is None:
        raise ExprError("$num_classes: the network has no num_classes (set model.num_classes; "
                        "training takes it from the data set)")  # fmt: skip
    if name == "index" and name not in params:
        raise ExprError("$index is the copy's number on the parameters of a block line that "
                        "repeats (`{block: b, repeat: N, k: $index}`), not inside the block: "
                        "pass it in as a parameter")  # fmt: skip
    if name not in params or params[name] is None:
        known = ", ".join(sorted(k for k, v in params.items() if v is not None))
        raise ExprError(f"${name[:40]} is not a parameter here (known: {known[:120]})")
    return params[name]


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(text) and not text[pos:].isspace():
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ExprError(f"cannot read {text[pos : pos + 12].strip()!r} in {text!r}")
        tokens.append((m.lastgroup, m.group(m.lastgroup)))
        pos = m.end()
    return tokens


class _Parser:
    """Recursive descent, one method per precedence level, lowest first. Where `and` / `or`
    is decided by its left side, the right side is read with `skipping` set: parsed, not
    evaluated (values None), so `$g == 0 or $c % $g == 0` is true for g = 0."""

    def __init__(self, tokens: list[tuple[str, str]], params: dict[str, Any]):
        self.tokens, self.params, self.pos, self.depth = tokens, params, 0, 0
        self.skipping = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos][1] if self.pos < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        if self.pos >= len(self.tokens):
            raise ExprError("the expression ends where a value should be")
        self.pos += 1
        return self.tokens[self.pos - 1]

    def disjunction(self) -> Any:
        value = self.conjunction()
        while self.peek() == "or":
            self.take()
            value = self.logical(value, True, self.conjunction)
        return value

    def conjunction(self) -> Any:
        value = self.negation()
        while self.peek() == "and":
            self.take()
            value = self.logical(value, False, self.negation)
        return value

    def logical(self, left: Any, decides: bool, right: Any) -> Any:
        """`left or right(...)` (decides: True) or `left and right(...)` (False)."""
        if self.skipping or _truth(left) == decides:
            self.skipping += 1
            right()  # read, not evaluated
            self.skipping -= 1
            return left
        return _truth(right())

    def negation(self) -> Any:
        if self.peek() == "not":
            self.take()
            value = self.negation()
            return None if self.skipping else not _truth(value)
        return self.comparison()

    def comparison(self) -> Any:
        value = self.sum()
        if self.peek() in _COMPARE:
            op = self.take()[1]
            right = self.sum()
            if not self.skipping:
                value = _COMPARE[op](_number(value, op), _number(right, op))
        return value

    def sum(self) -> Any:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()[1]
            value = self.arith(op, value, self.term())
        return value

    def term(self) -> Any:
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            op = self.take()[1]
            value = self.arith(op, value, self.unary())
        return value

    def arith(self, op: str, left: Any, right: Any) -> Any:
        return None if self.skipping else _arith(op, left, right)

    def unary(self) -> Any:
        if self.peek() in ("-", "+"):
            op = self.take()[1]
            value = self.unary()
            if self.skipping:
                return None
            value = _number(value, op)
            return -value if op == "-" else value
        return self.atom()

    def atom(self) -> Any:
        kind, text = self.take()
        if kind == "num":
            return float(text) if any(c in text for c in ".eE") else int(text)
        if kind == "name":
            return None if self.skipping else _lookup(text, self.params)
        if text in ("true", "false"):
            return text == "true"
        if text == "(":
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise ExprError(f"more than {MAX_NESTING} nested parentheses")
            value = self.disjunction()
            if self.take()[1] != ")":
                raise ExprError("a '(' has no ')'")
            self.depth -= 1
            return value
        raise ExprError(f"expected a number, a $parameter or '(', got {text!r}")


def _number(value: Any, op: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ExprError(f"{op!r} needs numbers, got {type(value).__name__} {brief(value)}")
    return value


def _truth(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ExprError(f"and / or / not need true or false, got {brief(value)}")
    return value


def _arith(op: str, left: Any, right: Any) -> int | float:
    left, right = _number(left, op), _number(right, op)
    if op in ("/", "//", "%") and right == 0:
        raise ExprError("division by zero")
    try:
        result = _ARITH[op](left, right)
    except OverflowError:  # e.g. a 400-digit integer divided into a float
        raise ExprError(f"{op!r}: the result is too large") from None
    if isinstance(result, int) and result.bit_length() > MAX_BITS:
        raise ExprError(f"{op!r}: the result is too large (over {MAX_BITS} bits)")
    return result


def division_hint(message: str, label: str, written: dict[str, Any],
                   values: dict[str, Any]) -> str:  # fmt: skip
    """Where a field refused as no whole number is a real one an expression gave (`$c / 2`,
    or `$w` of a parameter `$c / 2` made): / divides to a real number, // to a whole one."""
    for key, text in written.items():
        pairs = [("", text, values.get(key))]
        if isinstance(text, list) and isinstance(values.get(key), list):  # (points.0: ...)
            pairs = [
                (f".{i}", t, v) for i, (t, v) in enumerate(zip(text, values[key], strict=True))
            ]
        for index, part, value in pairs:
            real = isinstance(value, float) and math.isfinite(value)
            if is_expression(part) and real and message.startswith(f"{label}: {key}{index}:"):
                why = ("// divides to a whole one, / to a real one" if "/" in str(part)
                       else "a real factor makes one; sizes are whole numbers" if "*" in str(part)
                       else "sizes are whole numbers")  # fmt: skip
                return f" ({brief(part)} is {value!r}, a real number: {why})"
    return ""


def with_dollars(text: str, params: dict[str, Any]) -> str:
    """`text` with each word that names a parameter read as one: `s == 2` -> `$s == 2`."""
    return re.sub(r"\b[A-Za-z_]\w*\b", lambda m: f"${m[0]}" if m[0] in params else m[0], text)
