"""Pictures of a network: its graph (like Caffe's draw_net) and its first convolution's
filters as a grid (the 2012 paper's figure 3). Drawn with matplotlib and Pillow."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from cnnkit.errors import ConfigError
from cnnkit.nn import Network
from cnnkit.nn.layers import pair

# layer type -> box colour (Caffe's draw_net: convolutions, pools, the rest)
COLOURS = {
    "conv": "#ff9f80", "linear": "#a3c4f3", "maxpool": "#9fd8a0", "avgpool": "#9fd8a0",
    "adaptive_avgpool": "#9fd8a0", "global_avgpool": "#9fd8a0", "concat": "#f6d186",
    "add": "#f6d186", "mul": "#f6d186", "max": "#f6d186", "input": "#dddddd",
}  # fmt: skip
OTHER = "#eeeeee"


def graph_positions(model: Network) -> dict[str, tuple[float, float]]:
    """(column, row) of every node: the row is the longest path from the input, branches of one
    row side by side."""
    depth = {"input": 0}
    for row in model.table:
        depth[row.name] = 1 + max(depth[i] for i in row.inputs)
    rows: dict[int, list[str]] = {}
    for name, d in depth.items():
        rows.setdefault(d, []).append(name)
    pos = {}
    for d, names in rows.items():
        for i, name in enumerate(names):
            pos[name] = (i - (len(names) - 1) / 2, -float(d))
    return pos


def _label(model: Network, name: str) -> str:
    if name == "input":
        return "input\n" + "x".join(map(str, model.input_shape))
    row = next(r for r in model.table if r.name == name)
    layer = model.get_submodule(name)
    detail = ""
    if isinstance(layer, nn.Conv2d):
        detail = f" {layer.kernel_size[0]}x{layer.kernel_size[1]}/{layer.stride[0]}"
    elif isinstance(layer, (nn.MaxPool2d, nn.AvgPool2d)):
        (kh, kw), (sh, _) = pair(layer.kernel_size), pair(layer.stride)
        detail = f" {kh}x{kw}/{sh}"
    return f"{name}\n{row.type}{detail}  " + "x".join(map(str, row.output_shape))


def draw_net(model: Network, path: Path) -> None:
    """Draw the layer graph to .png, .svg or .pdf: one box per layer, arrows for the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _check_suffix(path, (".png", ".svg", ".pdf"))
    pos = graph_positions(model)
    width = max(x for x, _ in pos.values()) - min(x for x, _ in pos.values()) + 1
    height = -min(y for _, y in pos.values()) + 1
    fig, ax = plt.subplots(figsize=(max(4.0, 2.4 * width), max(3.0, 0.75 * height)))
    types = {r.name: r.type for r in model.table} | {"input": "input"}
    for row in model.table:
        for source in row.inputs:
            ax.annotate("", xy=pos[row.name], xytext=pos[source],
                        arrowprops={"arrowstyle": "->", "color": "#555555", "lw": 0.8,
                                    "shrinkA": 12, "shrinkB": 12})  # fmt: skip
    for name, (x, y) in pos.items():
        box = {"boxstyle": "round,pad=0.3", "fc": COLOURS.get(types[name], OTHER), "ec": "#333333"}
        ax.text(x, y, _label(model, name), ha="center", va="center", fontsize=7, bbox=box)
    ax.set_xlim(min(x for x, _ in pos.values()) - 0.8, max(x for x, _ in pos.values()) + 0.8)
    ax.set_ylim(min(y for _, y in pos.values()) - 0.6, 0.6)
    ax.axis("off")
    ax.set_title(f"{model.name}: {len(model.table)} layers", fontsize=9)
    fig.savefig(path, bbox_inches="tight", dpi=100)
    plt.close(fig)


def first_conv(model: nn.Module) -> nn.Conv2d:
    """The network's first convolution layer (in file order)."""
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    if conv is None:
        raise ConfigError("the network has no convolution layer to draw")
    return conv


def filter_grid(weight: torch.Tensor, cell: int = 32, gap: int = 2) -> np.ndarray:
    """(O, I, kh, kw) filters -> one uint8 image: a grid of cells, each filter stretched to
    0-255 on its own, in colour when I == 3 and grey otherwise (mean over input channels)."""
    w = weight.detach().float().cpu()
    w = w if w.shape[1] == 3 else w.mean(dim=1, keepdim=True)
    lo = w.amin(dim=(1, 2, 3), keepdim=True)
    hi = w.amax(dim=(1, 2, 3), keepdim=True)
    w = ((w - lo) / (hi - lo).clamp_min(1e-12) * 255).round().to(torch.uint8)
    scale = max(1, cell // max(w.shape[-2:]))
    w = w.repeat_interleave(scale, -2).repeat_interleave(scale, -1)  # nearest upscaling
    n, c, h, wd = w.shape
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = np.full((rows * (h + gap) + gap, cols * (wd + gap) + gap, c), 255, np.uint8)
    for i in range(n):
        top, left = gap + (i // cols) * (h + gap), gap + (i % cols) * (wd + gap)
        grid[top : top + h, left : left + wd] = w[i].permute(1, 2, 0).numpy()
    return grid if c == 3 else grid[:, :, 0]


def draw_filters(model: nn.Module, path: Path) -> tuple[int, ...]:
    """Save the first convolution's filters as a grid image; returns the weight's shape."""
    _check_suffix(path, (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp"))
    weight = first_conv(model).weight
    Image.fromarray(filter_grid(weight)).save(path)
    return tuple(weight.shape)


def _check_suffix(path: Path, allowed: tuple[str, ...]) -> None:
    if path.suffix.lower() not in allowed:
        raise ConfigError(f"-o {path}: use one of {', '.join(allowed)}")
