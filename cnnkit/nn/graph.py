"""Network: the torch module a network file builds; a DAG of layers run in file order."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cnnkit.errors import ConfigError
from cnnkit.nn.init import apply_rule
from cnnkit.nn.layers import ParamLayer, Shape, ShapeError
from cnnkit.nn.spec import Node, parse_spec, read_spec


@dataclass(frozen=True)
class LayerInfo:
    """One row of the layer table."""

    name: str
    type: str
    inputs: tuple[str, ...]
    output_shape: Shape
    params: int
    macs: int


class Network(nn.Module):
    """A CNN built from a network file. forward(x) returns logits; x is (B, *input_shape)."""

    def __init__(self, spec: dict[str, Any], num_classes: int | None = None, device: Any = None):
        super().__init__()
        net, nodes = parse_spec(spec, num_classes)
        self.spec = spec  # the file's `model:` mapping, enough to rebuild this network
        self.name = net.name or "net"
        self.input_shape: Shape = tuple(net.input)
        shapes: list[Shape] = [self.input_shape]
        self.table: list[LayerInfo] = []
        steps: list[tuple[str, tuple[int, ...]]] = []
        with torch.device(device) if device is not None else nullcontext():
            for node in nodes:
                in_shapes = [shapes[i] for i in node.inputs]
                shape, module = _build_node(node, in_shapes)
                _set_submodule(self, node.name, module)
                shapes.append(shape)
                steps.append((node.name, node.inputs))
                self.table.append(_describe(node, in_shapes, shape, module, shapes, nodes))
        self.num_classes = shapes[-1][0] if len(shapes[-1]) == 1 else None
        self.output_shape: Shape = shapes[-1]
        frees = _last_reads(nodes)
        # (module name, input value indices, values to drop after it); modules are looked up by
        # name at run time, so replacing one (SyncBatchNorm, quantised, ...) takes effect.
        self._steps = tuple(
            (tuple(name.split(".")), idx, frees[i]) for i, (name, idx) in enumerate(steps)
        )
        self._nodes = nodes
        if device is None or torch.device(device).type != "meta":
            self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values: list[torch.Tensor | None] = [x]
        for path, inputs, frees in self._steps:
            module = self
            for part in path:  # plain dict lookups: get_submodule costs ~4 us a layer
                module = module._modules[part]
            values.append(module(*[values[i] for i in inputs]))
            for i in frees:  # drop what no later layer reads: less memory at inference
                values[i] = None
        return values[-1]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every layer as its `init:` says (PyTorch's default where it says nothing)."""
        for node in self._nodes:
            if not isinstance(node.layer, ParamLayer) or not node.layer.init:
                continue
            module = self.get_submodule(node.name)
            for pname, rule in node.layer.init.items():
                tensor = getattr(module, pname, None)
                if tensor is None:
                    continue
                try:
                    apply_rule(tensor, rule)
                except ValueError as e:
                    raise ConfigError(f"layer {node.index} ({node.name}): init: {e}") from None

    def multipliers(self) -> dict[str, tuple[float, float]]:
        """Parameter name -> (lr multiplier, weight-decay multiplier) from the network file."""
        out = {}
        for node in self._nodes:
            module = self.get_submodule(node.name)
            for pname, _ in module.named_parameters(recurse=True):
                layer = node.layer
                if isinstance(layer, ParamLayer):
                    mults = (layer.mult("lr_mult", pname), layer.mult("decay_mult", pname))
                else:
                    mults = (1.0, 1.0)
                out[f"{node.name}.{pname}"] = mults
        return out

    def param_groups(self, lr: float, weight_decay: float) -> list[dict[str, Any]]:
        """Optimizer parameter groups, one per distinct (lr, weight decay) pair."""
        groups: dict[tuple[float, float], list[nn.Parameter]] = {}
        params = dict(self.named_parameters())
        for pname, (lr_mult, decay_mult) in self.multipliers().items():
            if params[pname].requires_grad:
                groups.setdefault((lr * lr_mult, weight_decay * decay_mult), []).append(
                    params[pname]
                )
        return [
            {"params": ps, "lr": glr, "weight_decay": gwd, "lr_mult": glr / lr if lr else 1.0}
            for (glr, gwd), ps in groups.items()
        ]


def build_model(
    spec: str | Path | dict[str, Any], num_classes: int | None = None, device: Any = None
) -> Network:
    """Build a network from a zoo name, a YAML path or a dict; `num_classes` overrides the file's."""
    return Network(read_spec(spec), num_classes=num_classes, device=device)


def _build_node(node: Node, in_shapes: list[Shape]) -> tuple[Shape, nn.Module]:
    layer = node.layer
    if len(in_shapes) > 1 and not layer.many_inputs:
        raise ConfigError(
            f"layer {node.index} ({node.name}): inputs: a {layer.type} layer takes one input"
        )
    try:
        shape = layer.output_shape(in_shapes)
        return shape, layer.build(in_shapes)
    except ShapeError as e:
        raise ConfigError(
            f"layer {node.index} ({node.name}): {e.field}: {e} (input {_fmt_shapes(in_shapes)})"
        ) from None


def _describe(node: Node, in_shapes, shape, module, shapes, nodes) -> LayerInfo:
    names = tuple("input" if i == 0 else nodes[i - 1].name for i in node.inputs)
    params = sum(p.numel() for p in module.parameters())
    return LayerInfo(
        node.name, node.layer.type, names, shape, params, node.layer.macs(in_shapes, shape)
    )


def _last_reads(nodes: list[Node]) -> list[tuple[int, ...]]:
    """For each node, the value indices it is the last reader of."""
    last_use: dict[int, int] = {}
    for i, node in enumerate(nodes):
        for v in node.inputs:
            last_use[v] = i
    frees: list[list[int]] = [[] for _ in nodes]
    for v, i in last_use.items():
        frees[i].append(v)
    return [tuple(f) for f in frees]


def _set_submodule(root: nn.Module, dotted: str, module: nn.Module) -> None:
    """Register `module` at a dotted path, making empty containers on the way (`layer1.0.conv1`)."""
    *parents, leaf = dotted.split(".")
    parent = root
    for part in parents:
        child = parent._modules.get(part)
        if child is None:
            child = nn.Module()
            parent.add_module(part, child)
        parent = child
    parent.add_module(leaf, module)


def _fmt_shapes(shapes: list[Shape]) -> str:
    return ", ".join("(" + ", ".join(map(str, s)) + ")" for s in shapes)
