"""Parameter expressions of the network file: `$width * 4`, `($k - 1) // 2`,
`$stride != 1 or $in_channels != $out`. Numbers, booleans, `$names`, + - * / // %, comparisons,
and / or / not, parentheses; nothing else (no names of Python, no calls, no code).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Collection
from typing import Any

MAX_LENGTH = 200
MAX_NESTING = 20

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
    """Whether `value` is an expression reading one of the parameters `names`."""
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
    """Recursive descent, one method per precedence level, lowest first."""

    def __init__(self, tokens: list[tuple[str, str]], params: dict[str, Any]):
        self.tokens, self.params, self.pos, self.depth = tokens, params, 0, 0

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
            right = self.conjunction()
            value = _truth(value) or _truth(right)
        return value

    def conjunction(self) -> Any:
        value = self.negation()
        while self.peek() == "and":
            self.take()
            right = self.negation()
            value = _truth(value) and _truth(right)
        return value

    def negation(self) -> Any:
        if self.peek() == "not":
            self.take()
            return not _truth(self.negation())
        return self.comparison()

    def comparison(self) -> Any:
        value = self.sum()
        if self.peek() in _COMPARE:
            op = self.take()[1]
            value = _COMPARE[op](_number(value, op), _number(self.sum(), op))
        return value

    def sum(self) -> Any:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()[1]
            value = _arith(op, value, self.term())
        return value

    def term(self) -> Any:
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            op = self.take()[1]
            value = _arith(op, value, self.unary())
        return value

    def unary(self) -> Any:
        if self.peek() in ("-", "+"):
            op = self.take()[1]
            value = _number(self.unary(), op)
            return -value if op == "-" else value
        return self.atom()

    def atom(self) -> Any:
        kind, text = self.take()
        if kind == "num":
            return float(text) if any(c in text for c in ".eE") else int(text)
        if kind == "name":
            return _lookup(text, self.params)
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
        raise ExprError(f"{op!r} needs numbers, got {type(value).__name__} {value!r}"[:120])
    return value


def _truth(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ExprError(f"and / or / not need true or false, got {value!r}"[:120])
    return value


def _arith(op: str, left: Any, right: Any) -> int | float:
    left, right = _number(left, op), _number(right, op)
    if op in ("/", "//", "%") and right == 0:
        raise ExprError("division by zero")
    try:
        return _ARITH[op](left, right)
    except OverflowError:  # e.g. a 400-digit integer divided into a float
        raise ExprError(f"{op!r}: the result is too large") from None
