"""Network: the torch module a network file builds; a DAG of layers run in file order."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from cnnkit.errors import ConfigError
from cnnkit.nn.expand import Node, parse_spec
from cnnkit.nn.init import apply_rule
from cnnkit.nn.layers import ParamLayer, Shape
from cnnkit.nn.memory import check_fits
from cnnkit.nn.modules import bare_scale_keys, scale_weight_keys
from cnnkit.nn.yamlio import layer_line


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
        with _naming(getattr(spec, "source", None)):  # its errors name its file
            net, nodes, self._output = parse_spec(spec, num_classes)
            # the file's `model:` mapping, enough to rebuild this network (weights come separately)
            self.spec = {k: v for k, v in spec.items() if k != "weights"}
            self.name = net.name or "net"
            self.input_shape: Shape = tuple(net.input)
            shapes: list[Shape] = [self.input_shape, *(node.shape for node in nodes)]
            self.param_count = sum(
                n.layer.param_count([shapes[i] for i in n.inputs]) for n in nodes
            )
            self.activation_count = sum(math.prod(shape) for shape in shapes)  # per image
            check_fits(self.name, self.param_count, self.activation_count, device)
            self.table: list[LayerInfo] = []
            with torch.device(device) if device is not None else nullcontext():
                for node in nodes:
                    in_shapes = [shapes[i] for i in node.inputs]
                    module = node.layer.build(in_shapes)
                    _set_submodule(self, node.name, module)
                    self.table.append(_describe(node, in_shapes, module, nodes))
            out = shapes[self._output]
            self.num_classes = out[0] if len(out) == 1 else None
            self.output_shape: Shape = out
            self.heads = tuple(node.name for node in nodes if node.head)  # sized by num_classes
            if num_classes is None and net.num_classes is not None:  # the file's own count
                check_classes(self, net.num_classes, f"num_classes: {net.num_classes}")
            self.fresh_keys: list[str] = []  # a classifier left fresh by weights of other classes
            frees = _last_reads(nodes, self._output)
            # (module name, input value indices, values to drop after it); modules are looked up by
            # name at run time, so replacing one (SyncBatchNorm, quantised, ...) takes effect.
            self._steps = tuple(
                (tuple(node.name.split(".")), node.inputs, frees[i]) for i, node in enumerate(nodes)
            )
            self._nodes = nodes
            self._groups = _groups(self, nodes)  # (first step, last step, Group): for their hooks
            scales = tuple(node.name for node in nodes if node.layer.type == "scale")
            if scales:  # torchvision's key for a bare scale parameter is the layer's own name
                self.register_state_dict_post_hook(partial(bare_scale_keys, scales))
                self.register_load_state_dict_pre_hook(partial(scale_weight_keys, scales))
            # on top of PyTorch's default; on meta it fills nothing but still checks that each
            # rule fits its tensor (kaiming on a 1-D weight), so `cnnkit info` says what build will
            self._apply_init()

    def unreached(self) -> list[str]:
        """Layers with parameters whose output never reaches the network's output (a branch
        nothing reads): they get no gradient, which DDP must be told of (find_unused_parameters)
        where it cannot learn it once (static_graph)."""
        needed = {self._output}
        for i in range(len(self._nodes) - 1, -1, -1):
            if i + 1 in needed:
                needed.update(self._nodes[i].inputs)
        dead = [node.name for i, node in enumerate(self._nodes) if i + 1 not in needed]
        return [
            name for name in dead if next(self.get_submodule(name).parameters(), None) is not None
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hooked = [g for g in self._groups if g[2]._forward_hooks or g[2]._forward_pre_hooks]
        if hooked:
            return self._forward_hooked(x, hooked)
        values: list[torch.Tensor | None] = [x]
        for path, inputs, frees in self._steps:
            module = self
            try:
                for part in path:  # plain dict lookups: get_submodule costs ~4 us a layer
                    module = module._modules[part]
            except KeyError:
                raise TypeError(_gone(path)) from None
            values.append(module(*[values[i] for i in inputs]))
            for i in frees:  # drop what no later layer reads: less memory at inference
                values[i] = None
        return values[self._output]

    def _forward_hooked(self, x: torch.Tensor, hooked: list) -> torch.Tensor:
        """forward, calling the forward hooks of groups (`layer4`) as nn.Module would: with the
        group's input (what its first layer reads) and its output (its last layer's), which a
        hook may replace."""
        values: list[torch.Tensor | None] = [x]
        taken: dict[int, tuple] = {}
        for step, (path, inputs, frees) in enumerate(self._steps):
            args = [values[i] for i in inputs]
            for first, _, group in hooked:
                if first == step:
                    taken[id(group)] = tuple(args)
                    _call_pre_hooks(group, taken[id(group)])
            try:
                module = self.get_submodule(".".join(path))
            except AttributeError:
                raise TypeError(_gone(path)) from None
            values.append(module(*args))
            for _, last, group in hooked:
                if last == step:
                    values[-1] = _call_hooks(group, taken.pop(id(group), ()), values[-1])
            for i in frees:
                values[i] = None
        return values[self._output]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every layer anew: PyTorch's default, then what its `init:` says."""
        for module in self.modules():
            if module is not self and callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
        self._apply_init()

    def _apply_init(self) -> None:
        """The network file's `init:` rules, layer by layer."""
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
                except ValueError as e:  # (torch's "Fan in and fan out ...": say of what)
                    shape = "x".join(map(str, tensor.shape))
                    raise ConfigError(f"layer {node.index} ({node.name}): init: {pname} "
                                      f"({shape}): {e}") from None  # fmt: skip

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

    def param_groups(self, lr: float, weight_decay: float, norm_weight_decay: float | None = None,
                     bias_weight_decay: float | None = None) -> list[dict[str, Any]]:  # fmt: skip
        """Optimizer parameter groups, one per distinct (lr_mult, decay_mult, decay) triple: the
        same groups whatever the base rates, so a resume may change `train.weight_decay` (to 0
        too) and still load the saved momenta group by group. The decay of normalisation
        layers' parameters is `norm_weight_decay`, of every bias `bias_weight_decay`, where
        given (torchvision's reference's --norm-weight-decay and --bias-weight-decay: the bias
        of a normalisation layer is a bias); the layers' decay_mult scale them all."""
        rates = {"weight_decay": weight_decay, "norm_weight_decay": norm_weight_decay,
                 "bias_weight_decay": bias_weight_decay}  # fmt: skip
        norms = norm_parameters(self)
        groups: dict[tuple[float, float, str], list[nn.Parameter]] = {}
        params = dict(self.named_parameters())
        for pname, mults in self.multipliers().items():
            decay = "weight_decay"
            if pname.rpartition(".")[2] == "bias" and bias_weight_decay is not None:
                decay = "bias_weight_decay"
            elif pname in norms and norm_weight_decay is not None:
                decay = "norm_weight_decay"
            if params[pname].requires_grad:
                groups.setdefault((*mults, decay), []).append(params[pname])
        return [
            {"params": ps, "lr": lr * lr_mult, "weight_decay": rates[decay] * decay_mult,
             "lr_mult": lr_mult, "decay_mult": decay_mult}
            for (lr_mult, decay_mult, decay), ps in groups.items()
        ]  # fmt: skip


NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)


def norm_parameters(module: nn.Module) -> set[str]:
    """The names of the parameters of normalisation layers in `module` (batch, layer, group and
    instance norms: torchvision's norm classes), inside composite layers too. (Not a Network
    method: a layer may take any name but the Network's own attributes'.)"""
    return {f"{name}.{pname}" if name else pname
            for name, sub in module.named_modules() if isinstance(sub, NORMS)
            for pname, _ in sub.named_parameters(recurse=False)}  # fmt: skip


def check_classes(network: Network, num_classes: int, asked: str, of: str = "") -> None:
    """ConfigError where `num_classes` (`asked`: what gave it) sizes no layer of `network` (`of`:
    its file, where the message names it) and the fixed output is not that many scores: a
    class count asked for, then silently not given. (Not a Network method: a layer may take any
    name but the Network's own attributes'.)"""
    if network.heads or scores(network) == num_classes:
        return
    last = network.table[-1]
    raise ConfigError(
        f"{asked}: no layer{f' of {of}' if of else ''} is sized by num_classes: the last "
        f"layer {last.name} ({last.type}) gives {list(network.output_shape)} (a linear layer "
        "that leaves out out_features, or a layer given $num_classes, takes the class count)"
    )


def scores(network: Network) -> int | None:
    """How many class scores a network gives: its output's size, (N,) or a fully
    convolutional (N, 1, 1); None for any other shape."""
    out = tuple(network.output_shape)
    return out[0] if len(out) == 1 or out[1:] == (1, 1) else None


@contextmanager
def _naming(source: str | None) -> Iterator[None]:
    """Errors in a network read from a file (or the zoo) name it: a run file may name a network
    file that names another; and the line of the layer they name, where the file says."""
    try:
        yield
    except ConfigError as e:
        if source is None:
            raise
        message = str(e).removeprefix(f"{source}: ")
        file = source.removesuffix(": model")  # (a run file's own network mapping)
        line = layer_line(file, message)
        if line is None and message != str(e):
            raise
        where = f"{file}: line {line}" if line is not None else source
        raise ConfigError(f"{where}: {message}") from None


def _describe(
    node: Node, in_shapes: list[Shape], module: nn.Module, nodes: list[Node]
) -> LayerInfo:
    names = tuple("input" if i == 0 else nodes[i - 1].name for i in node.inputs)
    params = sum(p.numel() for p in module.parameters())
    macs = node.layer.macs(in_shapes, node.shape)
    return LayerInfo(node.name, node.layer.type, names, node.shape, params, macs)


def _last_reads(nodes: list[Node], output: int) -> list[tuple[int, ...]]:
    """For each node, the value indices it is the last reader of (never the output's)."""
    last_use: dict[int, int] = {}
    for i, node in enumerate(nodes):
        for v in node.inputs:
            if v != output:
                last_use[v] = i
    frees: list[list[int]] = [[] for _ in nodes]
    for v, i in last_use.items():
        frees[i].append(v)
    return [tuple(f) for f in frees]


class Group(nn.Module):
    """Layers whose names share a prefix (torchvision's `layer4`, `layer4.1`, `features`): the
    container that names them. The network runs its layers one by one, so a group is never
    called itself; its forward hooks are called all the same (with the group's input and
    output; its pre-hooks with its input, which they may read, not replace),
    and it indexes like nn.Sequential (`model.layer4[-1]`). Backward hooks on a group are
    refused: the group has no call of its own whose gradient they could see."""

    def register_full_backward_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a group of a cnnkit network's layers takes no backward hooks: in a "
                        "forward hook, output.register_hook(...) sees its output's gradient")  # fmt: skip

    register_full_backward_pre_hook = register_full_backward_hook
    register_backward_hook = register_full_backward_hook

    def forward(self, *args: Any) -> Any:
        raise TypeError("a group of a cnnkit network's layers runs as part of the network: call "
                        "the network (a forward hook on the group sees its input and output)")  # fmt: skip

    def __getitem__(self, index: int | slice) -> nn.Module | list[nn.Module]:
        return list(self._modules.values())[index]

    def __setitem__(self, index: int, module: nn.Module) -> None:
        raise TypeError("a group of a cnnkit network's layers is not replaced whole (the network "
                        "runs its layers by name): replace a layer (model.layer4[1].conv1 = ..., "
                        "model.fc = nn.Linear(...)), or change the network file")  # fmt: skip

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Any:
        return iter(self._modules.values())


def _gone(path: tuple[str, ...]) -> str:
    return (f"{'.'.join(path)}: no such layer in the network now: it runs its layers by name, so "
            "a group set whole (setattr(model.layer4, '1', ...)) leaves its layers out; replace "
            "layers one by one (model.fc = nn.Linear(...)), or change the network file")  # fmt: skip


def _call_pre_hooks(group: nn.Module, args: tuple) -> None:
    """A group's forward pre-hooks, in order, as nn.Module calls them. They may look, not
    replace: more than the group's first layer may read its input (a residual shortcut)."""
    with_kwargs = group._forward_pre_hooks_with_kwargs
    for key, hook in list(group._forward_pre_hooks.items()):
        result = hook(group, args, {}) if with_kwargs.get(key) else hook(group, args)
        if result is not None:
            raise TypeError("a forward pre-hook on a group of a cnnkit network's layers cannot "
                            "replace its input: hook the layers that read it")  # fmt: skip


def _call_hooks(group: nn.Module, args: tuple, output: Any) -> Any:
    """A group's forward hooks, in order, as nn.Module calls them (`with_kwargs` ones with no
    keyword arguments); a hook's return value replaces the output."""
    with_kwargs = group._forward_hooks_with_kwargs
    for key, hook in list(group._forward_hooks.items()):
        result = (
            hook(group, args, {}, output) if with_kwargs.get(key) else hook(group, args, output)
        )
        output = output if result is None else result
    return output


def _groups(root: nn.Module, nodes: list[Node]) -> tuple[tuple[int, int, Group], ...]:
    """Each Group with the first and last steps of the layers it holds."""
    spans: dict[str, list[int]] = {}
    for step, node in enumerate(nodes):
        parts = node.name.split(".")
        for depth in range(1, len(parts)):
            span = spans.setdefault(".".join(parts[:depth]), [step, step])
            span[1] = step
    inner_first = sorted(spans, key=lambda name: -name.count("."))  # as nested modules return
    return tuple((*spans[name], root.get_submodule(name)) for name in inner_first)


def _set_submodule(root: nn.Module, dotted: str, module: nn.Module) -> None:
    """Register `module` at a dotted path, making groups on the way (`layer1.0.conv1`)."""
    *parents, leaf = dotted.split(".")
    parent = root
    for part in parents:
        child = parent._modules.get(part)
        if child is None:
            child = Group()
            parent.add_module(part, child)
        parent = child
    parent.add_module(leaf, module)
