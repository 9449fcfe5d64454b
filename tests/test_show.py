"""cnnkit show net / show filters: the graph layout and the filter grid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_cli
from PIL import Image

from cnnkit import ConfigError, build_model
from cnnkit.infer.show import draw_net, filter_grid, graph_positions

CAFFE = Path(__file__).parent / "data" / "caffe"


def test_layout_puts_branches_side_by_side_and_merges_below():
    net = build_model("inception-small", device="meta")
    pos = graph_positions(net)
    branches = ["inc3a.b1", "inc3a.b3r", "inc3a.b5r", "inc3a.pool"]
    assert len({pos[b][1] for b in branches}) == 1  # one row
    assert len({pos[b][0] for b in branches}) == 4  # four columns
    assert pos["inc3a.out"][1] < min(pos[b][1] for b in branches)  # the concat comes after
    for row in net.table:
        assert all(pos[row.name][1] < pos[i][1] for i in row.inputs)  # every arrow points down


def test_show_net_writes_png_and_svg(tmp_path, capsys):
    png, svg = tmp_path / "net.png", tmp_path / "net.svg"
    code, out, err = run_cli(
        ["show", "net", str(CAFFE / "every_layer.prototxt"), "-o", str(png)], capsys
    )
    assert code == 0, err
    assert Image.open(png).size[1] > 400
    draw_net(build_model("alexnet", device="meta"), svg)
    assert "conv5" in svg.read_text() and "fc8" in svg.read_text()
    with pytest.raises(ConfigError, match="use one of"):
        draw_net(build_model("lenet5", device="meta"), tmp_path / "net.gif")


def test_filter_grid_stretches_each_filter():
    weight = torch.arange(4 * 3 * 2 * 2, dtype=torch.float32).view(4, 3, 2, 2)
    weight[1] *= -1
    grid = filter_grid(weight, cell=2, gap=1)
    assert grid.shape == (2 * 3 + 1, 2 * 3 + 1, 3)  # a 2x2 grid of 2x2 cells, 1 pixel gaps
    for i in range(4):
        w = weight[i].permute(1, 2, 0).numpy()
        expected = np.round((w - w.min()) / (w.max() - w.min()) * 255)
        top, left = 1 + (i // 2) * 3, 1 + (i % 2) * 3
        np.testing.assert_array_equal(grid[top : top + 2, left : left + 2], expected)
    assert (grid[0] == 255).all() and (grid[:, 3] == 255).all()  # white gaps


def test_show_filters_of_a_trained_run(digits_run, tmp_path, capsys):
    out = tmp_path / "filters.png"
    code, stdout, err = run_cli(["show", "filters", str(digits_run), "-o", str(out)], capsys)
    assert code == 0, err
    n, k = int(stdout.split(": ")[1].split()[0]), int(stdout.strip().split("x")[-1])
    image = Image.open(out)
    assert image.mode == "L" and n >= 4  # grey: the digits net reads one channel
    cols, side = int(np.ceil(np.sqrt(n))), k * max(1, 32 // k)
    rows = int(np.ceil(n / cols))
    assert image.size == (cols * (side + 2) + 2, rows * (side + 2) + 2)
