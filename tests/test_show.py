"""cnnkit show net / show filters: the layered layout (every edge visible), SVG text, the titled
filter grid."""

from __future__ import annotations

import json
from itertools import combinations, pairwise
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_cli
from PIL import Image

from cnnkit import ConfigError, build_model
from cnnkit.infer.layout import crossings, layered_layout
from cnnkit.infer.load import load_network
from cnnkit.infer.show import (
    draw_net,
    filter_cell,
    filter_grid,
    filter_title,
    first_conv,
    grid_columns,
    net_layout,
)

CAFFE = Path(__file__).parent / "data" / "caffe"


def enters(segment, box, eps=1e-6) -> bool:
    """Whether the rectangle a segment spans overlaps a box's inside. The drawn curve between
    two points stays in that rectangle (its Bezier control points lie on the rectangle)."""
    (x0, y0), (x1, y1) = segment
    bx, by, w, h = box
    return (max(x0, x1) > bx - w / 2 + eps and min(x0, x1) < bx + w / 2 - eps
            and max(y0, y1) > by - h / 2 + eps and min(y0, y1) < by + h / 2 - eps)  # fmt: skip


@pytest.mark.parametrize("name", ["resnet18", "inception-small"])
def test_no_edge_passes_through_a_box(name):
    net = build_model(name, device="meta")
    layout, _ = net_layout(net)
    expected = {(i, row.name) for row in net.table for i in row.inputs}
    assert {(s, t) for s, t, _ in layout.edges} == expected  # one line per input, no more
    for source, target, points in layout.edges:
        assert points[0][1] == pytest.approx(layout.boxes[source][1] - layout.boxes[source][3] / 2)
        assert points[-1][1] == pytest.approx(layout.boxes[target][1] + layout.boxes[target][3] / 2)
        for segment in pairwise(points):
            hit = [n for n, box in layout.boxes.items() if enters(segment, box)]
            assert not hit, (source, target, segment, hit)  # not even its own ends' boxes
    for box_a, box_b in combinations(layout.boxes.values(), 2):  # boxes apart
        assert abs(box_a[0] - box_b[0]) >= (box_a[2] + box_b[2]) / 2 or box_a[1] != box_b[1]
    verticals = [(p[0][0], p[0][1], p[1][1]) for _, _, pts in layout.edges
                 for p in pairwise(pts) if p[0][0] == p[1][0] and p[0][1] != p[1][1]]  # fmt: skip
    for (xa, ta, ba), (xb, tb, bb) in combinations(verticals, 2):  # no two lines on one another
        assert xa != xb or min(ta, tb) <= max(ba, bb) + 1e-9


def test_skip_connection_runs_beside_the_chain_and_branches_side_by_side():
    layout, _ = net_layout(build_model("resnet18", device="meta"))
    box = layout.boxes
    chain = ["layer1.0.conv1", "layer1.0.bn1", "layer1.0.relu1", "layer1.0.conv2", "layer1.0.bn2"]
    assert len({round(box[n][0], 6) for n in ["maxpool", *chain, "layer1.0.add"]}) == 1  # straight
    skip = next(pts for s, t, pts in layout.edges if (s, t) == ("maxpool", "layer1.0.add"))
    side = max(x for x, _ in skip)
    assert all(side - box[n][2] / 2 > box[n][0] for n in chain)  # right of every chain box
    layout, _ = net_layout(build_model("inception-small", device="meta"))
    branches = ["inc3a.b1", "inc3a.b3r", "inc3a.b5r", "inc3a.pool"]
    assert len({layout.boxes[b][1] for b in branches}) == 1  # one row, four columns
    assert len({layout.boxes[b][0] for b in branches}) == 4
    assert layout.boxes["inc3a.out"][1] < layout.boxes["inc3a.b1"][1]  # the concat comes after
    middle = (layout.boxes["inc3a.b1"][0] + layout.boxes["inc3a.pool"][0]) / 2
    assert layout.boxes["pool1"][0] == pytest.approx(middle, abs=0.3)  # the fork is centred


def test_crossing_reduction_untangles_a_crossed_pair():
    nodes = ["a", "b", "c", "d"]
    edges = [("a", "d"), ("b", "c")]  # in file order c, d: the two edges cross
    layout = layered_layout(nodes, edges, dict.fromkeys(nodes, 1.0), 0.5, 0.2, 0.3)
    assert layout.boxes["c"][0] > layout.boxes["d"][0]  # reordered: no crossing
    assert crossings(["a", "b"], ["c", "d"], {"a": ["d"], "b": ["c"]}) == 1


def test_show_net_writes_png_and_svg_with_text(tmp_path, capsys):
    png, svg = tmp_path / "net.png", tmp_path / "net.svg"
    code, out, err = run_cli(
        ["show", "net", str(CAFFE / "every_layer.prototxt"), "-o", str(png)], capsys
    )
    assert code == 0, err
    assert Image.open(png).size[1] > 400
    labels = net_layout(load_network(str(CAFFE / "every_layer.prototxt")).model)[1]
    assert labels["conv1"].splitlines()[1] == "conv 3x5/1, 8, pad 1x2, groups 2"
    assert "dilation 2" in labels["dil"]
    net = build_model("alexnet", device="meta")
    draw_net(net, svg)
    text = svg.read_text()
    assert all(f">{row.name}<" in text for row in net.table)  # searchable text, not paths
    assert ">conv 5x5/1, 256, pad 2, groups 2<" in text and ">96x55x55<" in text
    with pytest.raises(ConfigError, match="use one of"):
        draw_net(build_model("lenet5", device="meta"), tmp_path / "net.gif")
    code, _, err = run_cli(["show", "net", "lenet5", "-o", str(tmp_path / "n.gif")], capsys)
    assert code == 2 and err.count("\n") == 1 and "use one of" in err


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
    framed = filter_grid(weight[:1, :1], cell=4, gap=3, frame=80)  # one 2x2 filter, 2x larger
    assert framed.shape == (10, 10) and framed[2, 2] == 80 and framed[0, 0] == 255
    assert (framed[3:5, 3:5] == framed[3, 3]).all()  # nearest neighbour: a pixel becomes 2x2


def test_a_grid_of_filters_is_a_whole_rectangle_where_one_is_near_square():
    """96 filters were 10 x 10 with 4 empty cells, 32 were 6 x 6 with 4: AlexNet's 12 x 8,
    8 x 4; a prime count keeps the square."""
    for count, (cols, rows) in {96: (12, 8), 32: (8, 4), 64: (8, 8), 6: (3, 2), 7: (3, 3),
                                25: (5, 5), 1: (1, 1)}.items():  # fmt: skip
        grid = filter_grid(torch.randn(count, 3, 2, 2), cell=2, gap=1)
        assert grid.shape[:2] == (rows * 3 + 1, cols * 3 + 1), count
        assert grid_columns(count) == cols


def test_a_constant_filter_is_mid_grey_and_a_grouped_first_conv_is_not_drawn_as_rgb(
    tmp_path, capsys
):
    flat = filter_grid(torch.full((1, 1, 2, 2), 0.3), cell=2, gap=1)
    assert (flat[1:3, 1:3] == 128).all()  # not black: nothing to stretch
    spec = tmp_path / "g6.yaml"  # 6 input channels in 2 groups: each filter reads 3, not R, G, B
    spec.write_text("model:\n  input: [6, 16, 16]\n  layers:\n    - {type: conv, out_channels: 4,"
                    " kernel_size: 3, groups: 2}\n    - {type: flatten}\n"
                    "    - {type: linear, out_features: 2}\n")  # fmt: skip
    code, out, err = run_cli(["show", "filters", str(spec), "-o", str(tmp_path / "g.png")], capsys)
    assert code == 0, err
    image = np.asarray(Image.open(tmp_path / "g.png").convert("RGB")).astype(int)
    assert (image[..., 0] == image[..., 1]).all() and (image[..., 1] == image[..., 2]).all()


def test_show_filters_of_a_trained_run(digits_run, tmp_path, capsys):
    out = tmp_path / "filters.png"
    code, stdout, err = run_cli(["show", "filters", str(digits_run), "-o", str(out)], capsys)
    assert code == 0, err
    n, k = int(stdout.split(": ")[1].split()[0]), int(stdout.strip().split("x")[-1])
    image = np.asarray(Image.open(out).convert("L"))
    assert n >= 4 and image.shape[1] >= 300  # enlarged: readable on a screen
    side = k * (filter_cell(n) // k)
    assert side >= 40
    title = image[: image.shape[0] - -(-n // grid_columns(n)) * (side + 6)]
    assert (title < 128).any()  # the title is written above the grid
    from cnnkit.infer.load import load_for_inference

    loaded = load_for_inference(digits_run)  # the title names the weights it drew
    name, conv = first_conv(loaded.model)
    said = filter_title(loaded.model, name, conv, weights=loaded.source)[0]
    assert said.startswith(f"digitnet {name} ({digits_run}/best.pt): "), said
    assert "(" not in filter_title(loaded.model, name, conv, False, loaded.source)[0].split(":")[0]
    code, _, err = run_cli(["show", "filters", str(digits_run), "-o", str(out) + ".txt"], capsys)
    assert code == 2 and "use one of" in err
    settings = str(digits_run / "config.yaml")  # the run's settings: its learned filters lie beside
    code, _, err = run_cli(["show", "filters", settings, "-o", str(tmp_path / "f.png")], capsys)
    assert code == 2 and err == (f"cnnkit: error: {settings}: the settings of run {digits_run}, "
                                 f"without its weights: give the run directory {digits_run} to "
                                 "draw what it learned\n")  # fmt: skip
    assert not (tmp_path / "f.png").exists()


def test_filters_without_trained_weights_say_so(tmp_path, capsys):
    """A zoo name (or a network file without weights:) has random filters: a note on stderr and
    in the picture's title; a run's are not called untrained."""
    from cnnkit.infer.show import filter_title, first_conv

    code, _, err = run_cli(["show", "filters", "lenet5", "-o", str(tmp_path / "f.png")], capsys)
    assert code == 0 and err == (
        "cnnkit: note: lenet5 has no trained weights: these are its random initial filters (a "
        "run directory or checkpoint has learned ones)\n"
    )
    model = build_model("lenet5")
    name, conv = first_conv(model)
    assert filter_title(model, name, conv, trained=False)[0].endswith(
        "filters of 1x5x5, untrained (random initial weights)"
    )
    assert "untrained" not in filter_title(model, name, conv)[0]


def test_a_network_without_a_conv_to_draw_is_named_and_one_filter_is_singular(tmp_path, capsys):
    """A net that starts with conv_transpose: the error names the file and why; a first conv
    of one filter is `1 filter`."""
    up = tmp_path / "up.yaml"
    up.write_text("model:\n  input: [1, 4, 4]\n  layers:\n    - {name: up1, type: conv_transpose, "
                  "out_channels: 2, kernel_size: 2, stride: 2}\n    - {type: flatten}\n"
                  "    - {type: linear, out_features: 2}\n")  # fmt: skip
    code, _, err = run_cli(["show", "filters", str(up), "-o", str(tmp_path / "f.png")], capsys)
    assert code == 2 and err == (
        f"cnnkit: error: {up}: no convolution layer to draw (show filters draws the first conv "
        "layer's filters): up1 is a conv_transpose, whose filters are not drawn\n"
    )
    one = tmp_path / "one.yaml"
    one.write_text(
        up.read_text().replace("conv_transpose, out_channels: 2", "conv, out_channels: 1")
    )
    code, out, err = run_cli(["show", "filters", str(one), "-o", str(tmp_path / "f.png")], capsys)
    assert code == 0 and out == f"wrote {tmp_path / 'f.png'}: 1 filter of 1x2x2\n", err


def test_crossings_are_the_pairs_of_edges_that_cross():
    """The O(E log E) count equals the definition: pairs whose ends come in opposite orders
    (edges sharing an end do not cross), on random layers."""
    import random
    from itertools import combinations

    from cnnkit.infer.layout import crossings

    rng = random.Random(0)
    for _ in range(200):
        upper = [f"u{i}" for i in range(rng.randint(1, 9))]
        lower = [f"l{i}" for i in range(rng.randint(1, 9))]
        down = {a: rng.sample(lower, rng.randint(0, len(lower))) for a in upper}
        at = {n: i for i, n in enumerate(lower)}
        ends = [(i, at[b]) for i, a in enumerate(upper) for b in down[a]]
        expected = sum((a1 - a2) * (b1 - b2) < 0 for (a1, b1), (a2, b2) in combinations(ends, 2))
        assert crossings(upper, lower, down) == expected


def test_labels_show_both_strides_and_dilations_and_filters_the_first_conv_of_the_file():
    from cnnkit.infer.show import first_conv

    spec = {"input": [3, 16, 16], "layers": [
        {"name": "pre.act", "type": "relu"},
        {"name": "conv0", "type": "conv", "out_channels": 4, "kernel_size": [3, 5],
         "stride": [2, 1], "dilation": [2, 1]},
        {"name": "pre.conv", "type": "conv", "out_channels": 2, "kernel_size": 1},
        {"type": "maxpool", "kernel_size": 2, "stride": [2, 1]}]}  # fmt: skip
    model = build_model(spec)
    _, labels = net_layout(model)
    assert labels["conv0"].splitlines()[1] == "conv 3x5/2x1, 4, dilation 2x1"
    assert labels["pre.conv"].splitlines()[1] == "conv 1x1/1, 2"
    assert [text.splitlines()[1] for text in labels.values()][-1] == "maxpool 2x2/2x1"
    assert first_conv(model)[0] == "conv0"  # not pre.conv, which registers first as `pre`


def test_labels_show_padding_and_a_pool_that_rounds_up():
    """`maxpool 2x2/2` turning 21x21 into 11x11 looked like a shape error: the label says
    ceil (and any padding), as the shapes beside it need."""
    spec = {"input": [3, 21, 21], "layers": [
        {"name": "c", "type": "conv", "out_channels": 4, "kernel_size": 3, "padding": [1, 0]},
        {"name": "s", "type": "conv", "out_channels": 4, "kernel_size": 3, "padding": "same"},
        {"name": "p", "type": "maxpool", "kernel_size": 2, "stride": 2, "ceil_mode": True},
        {"name": "a", "type": "avgpool", "kernel_size": 3, "stride": 2, "padding": 1}]}  # fmt: skip
    _, labels = net_layout(build_model(spec))
    said = {name: text.splitlines()[1] for name, text in labels.items()}
    assert said["c"] == "conv 3x3/1, 4, pad 1x0" and said["s"] == "conv 3x3/1, 4, pad same"
    assert said["p"] == "maxpool 2x2/2, ceil" and said["a"] == "avgpool 3x3/2, pad 1"


def test_conv_transpose_labels_show_kernel_stride_and_groups_as_conv_labels_do():
    spec = {"input": [4, 8, 8], "layers": [
        {"name": "up", "type": "conv_transpose", "out_channels": 6, "kernel_size": 4,
         "stride": 2, "padding": 1, "groups": 2},
        {"name": "odd", "type": "conv_transpose", "out_channels": 2, "kernel_size": [3, 1],
         "stride": [2, 1], "output_padding": [1, 0], "dilation": 2}]}  # fmt: skip
    _, labels = net_layout(build_model(spec))
    assert labels["up"].splitlines()[1] == "conv_transpose 4x4/2, 6, pad 1, groups 2"
    assert labels["odd"].splitlines()[1] == (
        "conv_transpose 3x1/2x1, 2, dilation 2, output_padding 1x0"
    )


def test_a_drawing_that_fails_half_way_leaves_the_earlier_file_whole(tmp_path, monkeypatch):
    """A full disk part-way through `show net`, `show filters` or `detect -o`: the file drawn
    before is kept as it was, and nothing half-written is left beside it."""
    import errno

    from matplotlib.figure import Figure

    from cnnkit.infer.detect import Box, draw_boxes
    from cnnkit.infer.show import draw_filters

    def half_then_full(real):
        def save(self, fp, *args, **kwargs):
            import io

            whole = io.BytesIO()
            real(self, whole, *args, **kwargs)
            if isinstance(fp, (str, Path)):
                fp = open(fp, "wb")  # noqa: SIM115 (as the libraries write a named file)
            fp.write(whole.getvalue()[: len(whole.getvalue()) // 2])
            fp.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        return save

    monkeypatch.setattr(Image.Image, "save", half_then_full(Image.Image.save))
    monkeypatch.setattr(Figure, "savefig", half_then_full(Figure.savefig))
    model = build_model("digitnet", num_classes=4)
    drawings = [(lambda p: draw_net(model, p), "net.svg"), (lambda p: draw_filters(model, p), "f.png"),
                (lambda p: draw_boxes(np.zeros((16, 16), np.uint8), [Box(1, 1, 9, 9, 0.9)], p),
                 "boxes.png")]  # fmt: skip
    for draw, name in drawings:
        (tmp_path / name).write_bytes(b"the earlier drawing")
        with pytest.raises(OSError):
            draw(tmp_path / name)
        assert (tmp_path / name).read_bytes() == b"the earlier drawing"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["boxes.png", "f.png", "net.svg"]


@pytest.mark.parametrize("suffix", [".png", ".svg", ".pdf", ".jpg", ".webp", ".tiff"])
def test_a_drawing_replaces_only_a_picture_cnnkit_drew(tmp_path, capsys, suffix):
    """`show net`, `show filters` and `detect -o` draw again over their own pictures (marked in
    the format's Software or Creator field) but refuse a photograph or notes of the user's: one
    line, the file as it was. A BMP, which has no such field, is never written (drawn, it was
    refused the next time as 'not a picture cnnkit drew')."""
    from cnnkit.infer.images import drawn_by_cnnkit

    command = "net" if suffix in (".svg", ".pdf") else "filters"
    out = tmp_path / f"drawn{suffix}"
    code, _, err = run_cli(["show", command, "lenet5", "-o", str(out)], capsys)
    assert code == 0 and drawn_by_cnnkit(out), err
    code, _, err = run_cli(["show", command, "lenet5", "-o", str(out)], capsys)  # again
    assert code == 0, err
    if suffix == ".png":
        code, _, err = run_cli(["show", command, "lenet5", "-o", str(tmp_path / "d.bmp")], capsys)
        assert code == 2 and err.startswith(f"cnnkit: error: -o {tmp_path / 'd.bmp'}: use one of")
        assert not (tmp_path / "d.bmp").exists()
    photo = tmp_path / f"photo{suffix}"
    if suffix in (".svg", ".pdf"):
        photo.write_bytes(out.read_bytes().replace(b"cnnkit", b"Inkscp"))  # another program's
    else:
        Image.new("RGB", (8, 8), (200, 10, 10)).save(photo)
    mine = tmp_path / "notes.png"  # a text file of the user's, whatever its name says
    mine.write_text("keep")
    for given in (photo, mine):
        before = given.read_bytes()
        code, _, err = run_cli(["show", command, "lenet5", "-o", str(given)], capsys)
        assert code == 2 and err == (
            f"cnnkit: error: -o {given}: exists, and is not a picture cnnkit drew (the only file "
            "a drawing replaces): give a new name\n"
        )
        assert given.read_bytes() == before and not drawn_by_cnnkit(given)


def test_filters_of_a_network_file_name_its_weights_file(tmp_path):
    """A network file's weights: are what was drawn, not the file that names them."""
    from safetensors.torch import save_file

    from cnnkit.infer.load import load_for_inference

    spec = {"input": [3, 8, 8], "layers": [{"name": "c", "type": "conv", "out_channels": 4,
                                            "kernel_size": 3}]}  # fmt: skip
    save_file(build_model(spec).state_dict(), str(tmp_path / "w.safetensors"))
    net = tmp_path / "net.yaml"
    net.write_text(json.dumps({"model": {**spec, "weights": str(tmp_path / "w.safetensors")}}))
    loaded = load_for_inference(str(net))
    assert loaded.trained and loaded.weights == str(tmp_path / "w.safetensors")
    name, conv = first_conv(loaded.model)
    title = filter_title(loaded.model, name, conv, weights=loaded.weights or loaded.source)
    assert title[0].startswith(f"net c ({tmp_path / 'w.safetensors'}): 4 filters")
