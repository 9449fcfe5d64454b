"""Pictures of a network: its graph (like Caffe's draw_net) and its first convolution's
filters as a grid (the 2012 paper's figure 3). Drawn with matplotlib and Pillow."""

from __future__ import annotations

import math
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from torch import nn

from cnnkit.errors import ConfigError, plural
from cnnkit.infer.images import figure_metadata, save_picture
from cnnkit.infer.layout import Layout, layered_layout
from cnnkit.nn import Network
from cnnkit.nn.graph import LayerInfo
from cnnkit.nn.layers import pair
from cnnkit.runtime import atomic

# layer type -> box colour (Caffe's draw_net: convolutions, pools, the rest)
COLOURS = {
    "conv": "#ff9f80", "linear": "#a3c4f3", "maxpool": "#9fd8a0", "avgpool": "#9fd8a0",
    "adaptive_avgpool": "#9fd8a0", "global_avgpool": "#9fd8a0", "concat": "#f6d186",
    "add": "#f6d186", "mul": "#f6d186", "max": "#f6d186", "input": "#dddddd",
}  # fmt: skip
OTHER = "#eeeeee"
NET_SUFFIXES = (".png", ".svg", ".pdf")
# what Pillow writes with a Software field (drawn_by_cnnkit): a BMP drawn could never be drawn
# over again, nor told from the user's own
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".webp")


BOX_HEIGHT, GAP_X, GAP_Y = 0.56, 0.22, 0.34  # inches
FONT_SIZE = 8  # points: three lines fill BOX_HEIGHT


def net_graph(model: Network) -> tuple[list[str], list[tuple[str, str]], dict[str, str]]:
    """(node names with "input" first, edges (source, target), node -> layer type)."""
    nodes = ["input"] + [row.name for row in model.table]
    edges = [(source, row.name) for row in model.table for source in row.inputs]
    return nodes, edges, {r.name: r.type for r in model.table} | {"input": "input"}


def net_layout(model: Network) -> tuple[Layout, dict[str, str]]:
    """The layered layout of the network's graph, in inches, and each box's label."""
    nodes, edges, _ = net_graph(model)
    rows = {row.name: row for row in model.table}  # a lookup per box, not a search
    labels = {name: label(model, name, rows) for name in nodes}
    widths = {name: _text_width(text) + 0.24 for name, text in labels.items()}
    return layered_layout(nodes, edges, widths, BOX_HEIGHT, GAP_X, GAP_Y), labels


def label(model: Network, name: str, rows: dict[str, LayerInfo]) -> str:
    """Three lines: the layer's name, its type and key hyper-parameters, its output shape
    (`rows`: the layer table by name)."""
    if name == "input":
        return "input\ndata\n" + "x".join(map(str, model.input_shape))
    row = rows[name]
    return f"{name}\n{describe(row.type, model.get_submodule(name))}\n" + "x".join(
        map(str, row.output_shape)
    )


def _steps(size: tuple[int, ...]) -> str:
    """`2` where both axes agree, `2x1` where they do not."""
    return str(size[0]) if len(set(size)) == 1 else "x".join(map(str, size))


def _padding(layer: nn.Module) -> str:
    """`, pad 2` (`, pad 1x0`, `, pad same`) where a layer pads its input; "" where not."""
    padding = layer.padding
    if isinstance(padding, str):
        return "" if padding == "valid" else f", pad {padding}"
    padding = pair(padding)
    return f", pad {_steps(padding)}" if max(padding) > 0 else ""


def describe(kind: str, layer: nn.Module) -> str:
    """`conv 11x11/4, 96, pad 2, groups 2` (and dilation > 1; a conv_transpose's
    output_padding > 0), `maxpool 3x3/2, ceil` (its padding, and ceil for a pool that rounds
    its output size up, ceil_mode, as Caffe's do: the shapes beside it follow), `linear 4096`,
    `lrn 5`, `dropout 0.5`."""
    if isinstance(layer, (nn.Conv2d, nn.ConvTranspose2d)):
        (kh, kw), s = layer.kernel_size, _steps(layer.stride)
        text = f"{kind} {kh}x{kw}/{s}, {layer.out_channels}{_padding(layer)}"
        text += f", groups {layer.groups}" if layer.groups > 1 else ""
        text += f", dilation {_steps(layer.dilation)}" if max(layer.dilation) > 1 else ""
        extra = getattr(layer, "output_padding", (0,))  # a transposed conv's
        return text + (f", output_padding {_steps(extra)}" if max(extra) > 0 else "")
    if isinstance(layer, (nn.MaxPool2d, nn.AvgPool2d)):
        (kh, kw), s = pair(layer.kernel_size), _steps(pair(layer.stride))
        return f"{kind} {kh}x{kw}/{s}{_padding(layer)}" + (", ceil" if layer.ceil_mode else "")
    if isinstance(layer, nn.Linear):
        return f"{kind} {layer.out_features}"
    if isinstance(layer, nn.LocalResponseNorm):
        return f"{kind} {layer.size}"
    if isinstance(layer, nn.Dropout):
        return f"{kind} {layer.p:g}"
    return kind


def _text_width(text: str) -> float:
    """Width in inches of the widest line at FONT_SIZE, as matplotlib measures it."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    font, measure = FontProperties(size=FONT_SIZE), TextToPath()
    widths = [measure.get_text_width_height_descent(line, font, ismath=False)[0] for line in
              text.splitlines()]  # fmt: skip
    return max(widths) / 72


def draw_net(model: Network, path: Path) -> Layout:
    """Draw the layer graph to .png, .svg or .pdf (text kept as text in SVG): one box per layer
    with its type, hyper-parameters and output shape, arrows for the data; returns the layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    check_suffix(path, NET_SUFFIXES)
    layout, labels = net_layout(model)
    types = net_graph(model)[2]
    params = sum(p.numel() for p in model.parameters())
    heading = f"{model.name}: {len(model.table)} layers, {params:,} parameters"
    margin, title = 0.15, 0.35
    width = max(layout.width, 1.1 * _text_width(heading) * (FONT_SIZE + 2) / FONT_SIZE)
    top = max([0.0, *(y + h / 2 for _, y, _, h in layout.boxes.values())])  # the first boxes' tops
    with plt.rc_context({"svg.fonttype": "none", "pdf.fonttype": 42}):
        fig = plt.figure(figsize=(width + 2 * margin, layout.height + top + 2 * margin + title))
        ax = fig.add_axes((0, 0, 1, 1))
        ax.set_xlim(-margin, width + margin)
        ax.set_ylim(-layout.height - margin, top + margin + title)
        ax.axis("off")
        for _, _, points in layout.edges:
            ax.add_patch(_arrow(points))
        for name, (x, y, w, h) in layout.boxes.items():
            colour = COLOURS.get(types[name], OTHER)
            ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, "round,pad=0,rounding_size=0.06",
                                        fc=colour, ec="#333333", lw=0.8))  # fmt: skip
            ax.text(x, y, labels[name], ha="center", va="center", fontsize=FONT_SIZE,
                    linespacing=1.25, parse_math=False)  # fmt: skip
        ax.text(
            0,
            top + margin + title / 2,
            heading,
            fontsize=FONT_SIZE + 2,
            va="center",
            parse_math=False,
        )  # a name with $ in it is words, not mathtext
        with atomic(Path(path), private=True) as f:  # an existing drawing stays whole if this fails
            fmt = Path(path).suffix[1:].lower()
            fig.savefig(f, dpi=100, format=fmt, metadata=figure_metadata(fmt))
        plt.close(fig)
    return layout


def _arrow(points: list[tuple[float, float]]):
    """The edge as a FancyArrowPatch: straight down a dummy's layer, an S-curve across gaps."""
    from matplotlib.patches import FancyArrowPatch
    from matplotlib.path import Path as MplPath

    vertices, codes = [points[0]], [MplPath.MOVETO]
    for (x0, y0), (x1, y1) in pairwise(points):
        if x0 == x1:
            vertices.append((x1, y1))
            codes.append(MplPath.LINETO)
        else:
            mid = (y0 + y1) / 2
            vertices += [(x0, mid), (x1, mid), (x1, y1)]
            codes += [MplPath.CURVE4] * 3
    return FancyArrowPatch(path=MplPath(vertices, codes), arrowstyle="-|>", mutation_scale=9,
                           color="#444444", lw=0.9, shrinkA=0, shrinkB=0)  # fmt: skip


def first_conv(model: nn.Module, source: str = "the network") -> tuple[str, nn.Conv2d]:
    """The network's first convolution layer (in file order) and its name; `source` names
    the network in the error where it has none."""
    rows = getattr(model, "table", None)  # a Network: its layers in file order
    names = [r.name for r in rows] if rows else [n for n, _ in model.named_modules()]
    convs = ((n, model.get_submodule(n)) for n in names)
    found = next(((n, m) for n, m in convs if isinstance(m, nn.Conv2d)), None)
    if found is None:
        up = next((r.name for r in rows or [] if r.type == "conv_transpose"), None)
        why = f": {up} is a conv_transpose, whose filters are not drawn" if up else ""
        raise ConfigError(f"{source}: no convolution layer to draw (show filters draws the "
                          f"first conv layer's filters){why}")  # fmt: skip
    return found


def filter_grid(
    weight: torch.Tensor, cell: int = 32, gap: int = 2, frame: int | None = None,
    colour: bool | None = None,
) -> np.ndarray:  # fmt: skip
    """(O, I, kh, kw) filters -> one uint8 image: a grid of cells `gap` white pixels apart
    (with a 1-pixel frame of grey `frame` around each), each filter stretched to 0-255 on its
    own (a constant one mid-grey) and enlarged by repeating pixels (nearest neighbour) to about
    `cell` pixels, in colour when `colour` (default: I == 3) and grey otherwise (mean over I)."""
    w = weight.detach().float().cpu()
    colour = w.shape[1] == 3 if colour is None else colour
    w = w if colour else w.mean(dim=1, keepdim=True)
    lo = w.amin(dim=(1, 2, 3), keepdim=True)
    hi = w.amax(dim=(1, 2, 3), keepdim=True)
    flat = hi - lo <= 1e-12  # nothing to stretch: mid-grey, not black
    w = ((w - lo) / (hi - lo).clamp_min(1e-12) * 255).masked_fill(flat, 127.5)
    w = w.round().to(torch.uint8)
    scale = max(1, cell // max(w.shape[-2:]))
    w = w.repeat_interleave(scale, -2).repeat_interleave(scale, -1)  # nearest upscaling
    n, c, h, wd = w.shape
    cols = grid_columns(n)
    rows = math.ceil(n / cols)
    grid = np.full((rows * (h + gap) + gap, cols * (wd + gap) + gap, c), 255, np.uint8)
    for i in range(n):
        top, left = gap + (i // cols) * (h + gap), gap + (i % cols) * (wd + gap)
        if frame is not None:
            grid[top - 1 : top + h + 1, left - 1 : left + wd + 1] = frame
        grid[top : top + h, left : left + wd] = w[i].permute(1, 2, 0).numpy()
    return grid if c == 3 else grid[:, :, 0]


def grid_columns(count: int) -> int:
    """Columns of a grid of `count` filters: a whole rectangle at most twice as wide as tall
    where one is (96: 12 x 8, 32: 8 x 4, not 10 x 10 and 6 x 6 with empty cells), else the
    square's."""
    square = math.ceil(math.sqrt(count))
    return next((cols for cols in range(square, 2 * square + 1)
                 if count % cols == 0 and cols <= 2 * (count // cols)), square)  # fmt: skip


def filter_cell(count: int, width: int = 560) -> int:
    """Cell side (pixels) that makes a grid of `count` filters about `width` pixels wide,
    between 40 and 120: a 5x5 filter becomes 120x120 pixels, an 11x11 one 46x46 in a grid of
    96 (12 across)."""
    return min(120, max(40, width // grid_columns(count)))


def draw_filters(model: nn.Module, path: Path, trained: bool = True,
                 source: str = "the network", weights: str | None = None) -> tuple[int, ...]:  # fmt: skip
    """Save the first convolution's filters as a titled grid image (the title says so where
    the weights are not `trained`: random initial ones, and names the `weights` file where
    they are); returns the weight's shape. `source` names the network in errors."""
    check_suffix(path, IMAGE_SUFFIXES)
    name, conv = first_conv(model, source)
    grid = filter_grid(conv.weight, filter_cell(len(conv.weight)), gap=6, frame=80,
                       colour=_reads_rgb(conv))  # fmt: skip
    grid = Image.fromarray(grid).convert("RGB")
    save_picture(titled(grid, filter_title(model, name, conv, trained, weights)), path)
    return tuple(conv.weight.shape)


def filter_title(model: nn.Module, name: str, conv: nn.Conv2d, trained: bool = True,
                 weights: str | None = None) -> list[str]:  # fmt: skip
    """The lines above the filters: the layer and its filters (and the weights file they
    were read from), how they are drawn."""
    o, i, kh, kw = conv.weight.shape
    how = (
        "colour (RGB)"
        if _reads_rgb(conv)
        else f"grey (mean of {i} input channels)"
        if i > 1
        else "grey"
    )
    if conv.groups > 1:
        how += f", {conv.groups} groups of {conv.in_channels // conv.groups} input channels"
    untrained = "" if trained else ", untrained (random initial weights)"
    read = f" ({weights})" if trained and weights else ""
    return [f"{getattr(model, 'name', 'net')} {name}{read}: {plural(o, 'filter')} of "
            f"{i}x{kh}x{kw}{untrained}", f"each stretched to its own min-max, {how}"]  # fmt: skip


def _reads_rgb(conv: nn.Conv2d) -> bool:
    """Whether each filter reads the RGB image (drawn in colour), not grey or grouped channels."""
    return conv.in_channels == 3 and conv.groups == 1


def titled(image: Image.Image, lines: list[str], margin: int = 12) -> Image.Image:
    """`image` on a white page below `lines` of text (the first bold-sized), centred."""
    fonts = [font(18), font(13)]
    heights = [fonts[min(k, 1)].getbbox("Hg")[3] + 6 for k in range(len(lines))]
    widths = [fonts[min(k, 1)].getlength(t) for k, t in enumerate(lines)]
    width = max(image.width, math.ceil(max(widths))) + 2 * margin
    page = Image.new("RGB", (width, image.height + sum(heights) + 3 * margin), "white")
    pen, top = ImageDraw.Draw(page), margin
    for k, text in enumerate(lines):
        pen.text(((width - widths[k]) / 2, top), text, fill=(20, 20, 20), font=fonts[min(k, 1)])
        top += heights[k]
    page.paste(image, ((width - image.width) // 2, top + margin))
    return page


def font(size: int) -> ImageFont.FreeTypeFont:
    """matplotlib's DejaVu Sans at `size` pixels (a font every install has)."""
    from matplotlib import font_manager

    return ImageFont.truetype(font_manager.findfont("DejaVu Sans"), size)


def check_suffix(path: Path, allowed: tuple[str, ...]) -> None:
    """One clear line when -o names a file type this picture cannot be written as."""
    if path.suffix.lower() not in allowed:
        raise ConfigError(f"-o {path}: use one of {', '.join(allowed)}")
