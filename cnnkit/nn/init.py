"""Weight initialisation named in a network file: `{weight: {normal: 0.01}, bias: 0.1}`.

A rule is a number (constant; also `1e-3`, which YAML 1.1 reads as text), a name
(`kaiming_normal`, `xavier_uniform`, `zeros`, ...) or a one-key mapping from a name to its
argument (`{normal: 0.01}`, `{uniform: [-0.1, 0.1]}`, `{kaiming_normal: {mode: fan_out}}`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from cnnkit.errors import brief

# name -> the keyword arguments its mapping form accepts
_KEYWORDS = {
    "normal": {"mean", "std"},
    "truncated_normal": {"mean", "std"},
    "uniform": {"a", "b"},
    "constant": {"value"},
    "zeros": set(),
    "ones": set(),
    "kaiming_normal": {"a", "mode", "nonlinearity"},
    "kaiming_uniform": {"a", "mode", "nonlinearity"},
    "xavier_normal": {"gain"},
    "xavier_uniform": {"gain"},
    "orthogonal": {"gain"},
    "bilinear": set(),
    "default": set(),
}


NUMBERS = {"mean", "std", "a", "b", "gain", "value"}  # the arguments that are numbers
FLOAT32_MAX = 3.4028234663852886e38  # numbers become float32 tensors and kernel arguments
NONLINEARITIES = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                  "conv_transpose3d", "sigmoid", "tanh", "relu", "leaky_relu", "selu")  # fmt: skip


def parse_rule(rule: Any) -> tuple[str, dict[str, Any]]:
    """Turn one init rule into (name, keyword arguments); raise ValueError when malformed or
    out of range (a negative std, a uniform range upside down)."""
    name, kw = _parse_rule(rule)
    for key in NUMBERS & set(kw):
        if _number(kw[key]) is None:
            raise ValueError(
                f"init {brief(name)}: {key} must be a finite number, not {brief(kw[key])}"
            )
        kw[key] = _number(kw[key])
        if abs(kw[key]) > FLOAT32_MAX:
            raise ValueError(f"init {brief(name)}: {key} {kw[key]:g} is beyond float32's range "
                             "(+-3.4e38)")  # fmt: skip
    if kw.get("std", 0.0) < 0:
        raise ValueError(f"init {brief(name)}: std {kw['std']:g} is negative")
    if kw.get("mode", "fan_in") not in ("fan_in", "fan_out"):
        raise ValueError(f"init {brief(name)}: mode is fan_in or fan_out, not {brief(kw['mode'])}")
    if kw.get("nonlinearity", "leaky_relu") not in NONLINEARITIES:
        raise ValueError(f"init {brief(name)}: nonlinearity {brief(kw['nonlinearity'])} is not "
                         f"one of torch's ({', '.join(NONLINEARITIES)})")  # fmt: skip
    if name == "uniform" and kw.get("a", 0.0) > kw.get("b", 1.0):
        raise ValueError(f"init 'uniform': the range [{kw.get('a', 0.0):g}, {kw.get('b', 1.0):g}] "
                         "is upside down")  # fmt: skip
    return name, kw


def _parse_rule(rule: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(rule, bool):
        raise ValueError(f"init rule {brief(rule)} is not a number, a name or a one-key mapping")
    if _number(rule) is not None:
        return "constant", {"value": _number(rule)}
    if isinstance(rule, str):
        if rule not in _KEYWORDS:
            raise ValueError(f"unknown init {brief(rule)} (known: {', '.join(sorted(_KEYWORDS))})")
        return rule, {}
    if not isinstance(rule, dict) or len(rule) != 1:
        raise ValueError(f"init rule {brief(rule)} is not a number, a name or a one-key mapping")
    ((name, arg),) = rule.items()
    if name not in _KEYWORDS:
        raise ValueError(f"unknown init {brief(name)} (known: {', '.join(sorted(_KEYWORDS))})")
    if isinstance(arg, dict):
        unknown = set(arg) - _KEYWORDS[name]
        if unknown:
            raise ValueError(
                f"init {brief(name)} takes {sorted(_KEYWORDS[name])}, not {brief(sorted(unknown))}"
            )
        return name, dict(arg)
    number = _number(arg)
    if name in ("normal", "truncated_normal") and number is not None:
        return name, {"std": number}
    if name == "uniform" and number is not None:
        return name, {"a": -number, "b": number}
    if name == "uniform" and isinstance(arg, list) and len(arg) == 2:
        a, b = map(_number, arg)
        if a is not None and b is not None:
            return name, {"a": a, "b": b}
    if name == "constant" and number is not None:
        return name, {"value": number}
    if name in ("xavier_normal", "xavier_uniform", "orthogonal") and number is not None:
        return name, {"gain": number}
    raise ValueError(f"init {brief(name)} cannot take {brief(arg)}")


def bilinear_kernel(size: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Caffe's bilinear filler, as FCN's upsample_filt (upsampling by a conv_transpose of
    kernel 2f - f % 2, stride f): (1 - |x / f - c|)(1 - |y / f - c|), f = ceil(k / 2),
    c = (k - 1) / 2f, each axis its own f and c; (kh, kw)."""

    def axis(k: int) -> torch.Tensor:
        f = math.ceil(k / 2)
        c = (k - 1) / (2 * f)
        return 1 - (torch.arange(k, dtype=torch.float64) / f - c).abs()

    return torch.outer(axis(int(size[0])), axis(int(size[1]))).float()


def check_init(spec: dict[str, Any], allowed: set[str]) -> dict[str, Any]:
    """Validate an `init:` mapping whose keys name the layer's parameters (`weight`, `bias`)."""
    if not isinstance(spec, dict):
        raise ValueError("init must map parameter names (weight, bias) to rules")
    for key, rule in spec.items():
        if key not in allowed:
            raise ValueError(f"init names {brief(key)}; this layer has {sorted(allowed)}")
        parse_rule(rule)
    return spec


@torch.no_grad()
def apply_rule(tensor: torch.Tensor, rule: Any) -> None:
    """Fill `tensor` in place by one init rule."""
    name, kw = parse_rule(rule)
    if name == "default":
        return
    if name == "normal":
        nn.init.normal_(tensor, kw.get("mean", 0.0), kw.get("std", 1.0))
    elif name == "truncated_normal":
        mean, std = kw.get("mean", 0.0), kw.get("std", 1.0)
        nn.init.trunc_normal_(tensor, mean, std, mean - 2 * std, mean + 2 * std)
    elif name == "uniform":
        nn.init.uniform_(tensor, kw.get("a", 0.0), kw.get("b", 1.0))
    elif name == "constant":
        nn.init.constant_(tensor, kw["value"])
    elif name in ("zeros", "ones"):
        nn.init.constant_(tensor, 0.0 if name == "zeros" else 1.0)
    elif name == "bilinear":
        if tensor.dim() != 4:
            raise ValueError(
                "init 'bilinear': for a (conv or conv_transpose) weight of 2-D kernels"
            )
        tensor.copy_(bilinear_kernel(tensor.shape[-2:]).expand_as(tensor))
    elif name.startswith("kaiming"):
        fill = nn.init.kaiming_normal_ if name == "kaiming_normal" else nn.init.kaiming_uniform_
        fill(
            tensor,
            a=kw.get("a", 0.0),
            mode=kw.get("mode", "fan_in"),
            nonlinearity=kw.get("nonlinearity", "leaky_relu"),  # torch's: `a` is its slope
        )
    elif name == "xavier_normal":
        nn.init.xavier_normal_(tensor, gain=kw.get("gain", 1.0))
    elif name == "xavier_uniform":
        nn.init.xavier_uniform_(tensor, gain=kw.get("gain", 1.0))
    elif name == "orthogonal":
        nn.init.orthogonal_(tensor, gain=kw.get("gain", 1.0))


def _number(x: Any) -> float | None:
    """`x` as a finite float, or None: numbers and numeric text (YAML 1.1 reads `1e-3`, without
    a dot, as a string; layers' number fields take it, and so does init), never true / false."""
    if isinstance(x, str):
        try:
            x = float(x)
        except ValueError:
            return None
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        x = float(x)
    except OverflowError:  # an integer too large for a float
        return None
    return x if math.isfinite(x) else None
