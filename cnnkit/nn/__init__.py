"""Network description -> torch module: layer kinds, blocks, shape inference, init, summary."""

from cnnkit.nn.graph import LayerInfo, Network, build_model
from cnnkit.nn.kinds import KINDS
from cnnkit.nn.spec import read_spec

__all__ = ["KINDS", "LayerInfo", "Network", "build_model", "read_spec"]
