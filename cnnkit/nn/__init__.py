"""Network description -> torch module: layer kinds, blocks, shape inference, init, summary."""

from cnnkit.nn.build import build_model, build_unchecked
from cnnkit.nn.graph import LayerInfo, Network
from cnnkit.nn.kinds import KINDS
from cnnkit.nn.spec import read_spec, with_input
from cnnkit.nn.weights import load_weights, read_state_dict

__all__ = [
    "KINDS",
    "LayerInfo",
    "Network",
    "build_model",
    "build_unchecked",
    "load_weights",
    "read_spec",
    "read_state_dict",
    "with_input",
]
