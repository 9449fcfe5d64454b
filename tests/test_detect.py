"""cnnkit detect: the convolutional sliding window equals classifying each window, boxes land
where the evidence is (in the original image's pixels), NMS, drawing, hard-negative mining."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import one_error_line, run_cli
from PIL import Image

from cnnkit import ConfigError, build_model
from cnnkit.data.base import Preprocess
from cnnkit.errors import DataError
from cnnkit.infer.detect import (
    Box,
    detect,
    draw_boxes,
    iou_of,
    mine_hard_negatives,
    score_maps,
    sliding_net,
)
from cnnkit.infer.load import Loaded, load_for_inference, save_safetensors

PATCH_NET = {
    "input": [1, 16, 16],
    "layers": [
        {"name": "c1", "type": "conv", "out_channels": 4, "kernel_size": 3},  # (4, 14, 14)
        {"type": "tanh", "scaled": True},
        {"name": "p1", "type": "maxpool", "kernel_size": 2},  # (4, 7, 7)
        {"name": "c2", "type": "conv", "out_channels": 6, "kernel_size": 3, "stride": 2},
        {"type": "relu"},  # (6, 3, 3)
        {"type": "flatten"},
        {"name": "fc1", "type": "linear", "out_features": 8},
        {"type": "dropout"},
        {"name": "fc2", "type": "linear", "out_features": 2},
    ],
}


def test_sliding_net_equals_classifying_every_window():
    torch.manual_seed(0)
    model = build_model(PATCH_NET).eval()
    slider = sliding_net(model)
    assert (slider.window, slider.stride) == (16, 4)
    x = torch.randn(1, 1, 40, 52)
    with torch.no_grad():
        maps = slider.net(x)
        for i, j in [(0, 0), (2, 5), (6, 9)]:
            window = x[:, :, i * 4 : i * 4 + 16, j * 4 : j * 4 + 16]
            torch.testing.assert_close(maps[0, :, i, j], model(window)[0], atol=1e-5, rtol=1e-5)


def brightness_detector(padded: bool = False) -> Loaded:
    """A 'face' classifier that fires on bright 8x8 windows: logit = 40 * (mean - 0.8).
    `padded`: behind a padded 3x3 convolution that passes each pixel on as it is."""
    conv = {"name": "c", "type": "conv", "out_channels": 1, "kernel_size": 3, "padding": 1}
    fc = {"name": "fc", "type": "linear", "out_features": 2}
    model = build_model({"input": [1, 8, 8], "layers": [conv, fc] if padded else [fc]})
    with torch.no_grad():
        if padded:
            model.c.weight.zero_()[0, 0, 1, 1] = 1.0
            model.c.bias.zero_()
        model.fc.weight.zero_()
        model.fc.weight[1].fill_(40 / 64)
        model.fc.bias.copy_(torch.tensor([0.0, -32.0]))
    return Loaded(
        model.eval(), ["background", "face"], Preprocess(1, 8, mean=[0.0], std=[255.0]), "test"
    )


@pytest.mark.parametrize("padded", [False, True])
def test_boxes_land_on_the_bright_square_in_original_pixels(tmp_path, padded):
    """Padding does not move the windows (it once shifted every box up-left by the padding)."""
    image = np.zeros((32, 32), np.uint8)
    image[8:24, 12:28] = 255  # a 16x16 'face': at scale 0.5 exactly one 8x8 window is all white
    loaded = brightness_detector(padded)
    boxes = detect(loaded, image, threshold=0.5, iou=0.3, min_face=16, step=1.5)
    assert boxes and [b.score for b in boxes] == sorted((b.score for b in boxes), reverse=True)
    best = boxes[0]
    assert (best.x0, best.y0, best.x1, best.y1) == (12, 8, 28, 24)  # original pixels
    for a in boxes:  # NMS: no two kept boxes overlap more than the limit
        assert all(iou_of(a, (b.x0, b.y0, b.x1, b.y1)) <= 0.3 + 1e-6 for b in boxes if b is not a)
    draw_boxes(image, boxes, tmp_path / "boxes.png")
    drawn = np.asarray(Image.open(tmp_path / "boxes.png"))
    assert drawn.shape == (32, 32, 3) and (drawn[..., 0] > drawn[..., 2]).any()  # red boxes


@pytest.mark.parametrize("side", [(102, 102), (101, 97), (64, 120)])
def test_every_box_lies_inside_the_image_when_pools_round_up(side):
    """A ceil_mode pool adds a row or column of windows that would reach past the image's edge
    where its size is not a whole number of strides: those windows are not scored."""
    torch.manual_seed(0)
    spec = {"input": [1, 27, 27], "layers": [
        {"type": "conv", "out_channels": 4, "kernel_size": 3}, {"type": "relu"},
        {"type": "maxpool", "kernel_size": 3, "stride": 2, "ceil_mode": True},
        {"type": "conv", "out_channels": 4, "kernel_size": 3},
        {"type": "maxpool", "kernel_size": 3, "stride": 2, "ceil_mode": True},
        {"type": "flatten"}, {"type": "linear", "out_features": 2}]}  # fmt: skip
    loaded = Loaded(build_model(spec).eval(), ["background", "face"],
                    Preprocess(1, 27, mean=[0.0], std=[255.0]), "test")  # fmt: skip
    image = np.random.default_rng(0).integers(0, 256, side, dtype=np.uint8)
    h, w = side
    for scale, slider, odds in score_maps(loaded, image, [1.0, 0.6], 1):
        size = (round(h * scale), round(w * scale))
        assert odds.shape == tuple((n - 27) // slider.stride + 1 for n in size), scale
    boxes = detect(loaded, image, threshold=0.0, iou=1.0, min_face=27, top=100000)
    # inside (a scale's rounded size reached half a scaled pixel past the edge: clipped)
    assert boxes and max(b.x1 for b in boxes) <= w and max(b.y1 for b in boxes) <= h
    assert min(b.x0 for b in boxes) >= 0 and min(b.y0 for b in boxes) >= 0


@pytest.mark.parametrize("net", ["ceil_pools", "facenet"])
def test_a_level_scored_in_bands_equals_one_pass(net, monkeypatch):
    """A large level is scored in bands of rows that overlap by the halo (memory bounded: a
    12800 px level had taken 18 GB): the same log-odds as one pass, with padding and pools that
    round up, and for facenet."""
    import cnnkit.infer.detect as detect_module

    torch.manual_seed(0)
    if net == "facenet":
        model = build_model("facenet").eval()
    else:
        model = build_model({"input": [1, 27, 27], "num_classes": 2, "layers": [
            {"type": "conv", "out_channels": 4, "kernel_size": 3, "padding": 1}, {"type": "relu"},
            {"type": "maxpool", "kernel_size": 3, "stride": 2, "ceil_mode": True},
            {"type": "conv", "out_channels": 4, "kernel_size": 3, "padding": 2},
            {"type": "maxpool", "kernel_size": 3, "stride": 2, "ceil_mode": True},
            {"type": "flatten"}, {"type": "linear"}]}).eval()  # fmt: skip
    window = model.input_shape[-1]
    loaded = Loaded(model, ["background", "face"], Preprocess(1, window, mean=[0.0], std=[255.0]),
                    "test")  # fmt: skip
    image = np.random.default_rng(0).integers(0, 256, (173, 131), dtype=np.uint8)
    whole = [odds for _, _, odds in score_maps(loaded, image, [1.0, 0.7], 1)]
    monkeypatch.setattr(detect_module, "BAND_PIXELS", 131 * 5)  # 1-2 output rows a band
    banded = [odds for _, _, odds in score_maps(loaded, image, [1.0, 0.7], 1)]
    for one, many in zip(whole, banded, strict=True):
        assert one.shape == many.shape
        torch.testing.assert_close(many, one, rtol=0, atol=1e-4)


def test_the_smallest_face_searched_is_one_and_a_half_windows_by_default():
    image = np.zeros((48, 48), np.uint8)
    image[4:12, 4:12] = 255  # one window (8 px): only searched when asked for
    image[24:40, 24:40] = 255  # two windows
    loaded = brightness_detector()
    found = detect(loaded, image, threshold=0.5)
    assert found and all(iou_of(b, (24, 24, 40, 40)) > 0 for b in found)
    small = detect(loaded, image, threshold=0.5, min_face=8)
    assert any((b.x0, b.y0, b.x1, b.y1) == (4, 4, 12, 12) for b in small)
    with pytest.raises(DataError, match=r"the image \(10x10\) is smaller than the smallest face "
                                        r"searched \(12 px\): give a smaller --min-size"):  # fmt: skip
        detect(loaded, image[:10, :10], threshold=0.5)  # not "no face found"


def test_a_pyramid_level_over_the_pixel_limit_is_one_line_not_an_oom():
    """--min-size 1 scaled a 512 px image 8x (an 8 px window) to 16.8 M pixels: fine; 2048 px
    to 268 M pixels: refused with the --min-size that fits, before any memory is taken."""
    loaded = brightness_detector()
    detect(loaded, np.zeros((64, 64), np.uint8), threshold=0.5, min_face=1)
    with pytest.raises(DataError, match=r"the smallest face searched \(1 px\) scales the "
                       r"2048x2048 image 8x, to 268,435,456 pixels, over the limit of "
                       r"120,000,000: give --min-size 2 or more"):  # fmt: skip
        detect(loaded, np.zeros((2048, 2048), np.uint8), threshold=0.5, min_face=1)
    from cnnkit.infer.detect import _check_level_pixels

    with pytest.raises(DataError, match=r"give --min-size 13 or more"):  # 12: a rounded level
        _check_level_pixels(4064, 6803, 25 / 11, 25, 11)  # over the limit (the advice looped)
    _check_level_pixels(4064, 6803, 25 / 13, 25, 13)


def test_unknown_class_and_branching_nets_are_clear_errors():
    with pytest.raises(ConfigError, match="'cat' is not one of"):
        detect(brightness_detector(), np.zeros((16, 16), np.uint8), label="cat")
    with pytest.raises(ConfigError, match="branches"):
        sliding_net(build_model("inception-small", device="meta"))


def test_hard_negative_mining_returns_the_false_positives():
    loaded = brightness_detector()
    grass = np.full((40, 40), 30, np.uint8)
    grass[8:24, 8:24] = 250  # bright, not a face
    patches = mine_hard_negatives(loaded, [grass, np.zeros((20, 20), np.uint8)], threshold=0.5)
    assert patches.dtype == np.uint8 and patches.shape[1:] == (1, 8, 8) and len(patches) >= 1
    assert patches.mean() > 200  # the bright square, cut out and resized to the window


def test_cli_detect_json_and_drawing(tmp_path, capsys):
    loaded = brightness_detector()
    save_safetensors(loaded, tmp_path / "det.safetensors")
    image = np.zeros((48, 48, 3), np.uint8)
    image[10:26, 20:36] = 255
    Image.fromarray(image).save(tmp_path / "photo.png")
    args = ["detect", str(tmp_path / "det.safetensors"), str(tmp_path / "photo.png")]
    code, out, err = run_cli(
        [*args, "--json", "--min-size", "8", "-o", str(tmp_path / "b.png")], capsys
    )
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows and set(rows[0]) == {"x0", "y0", "x1", "y1", "score"} and rows[0]["score"] >= 0.9
    assert (tmp_path / "b.png").is_file()
    Image.fromarray(np.zeros_like(image)).save(tmp_path / "dark.png")  # nothing to find
    args[-1] = str(tmp_path / "dark.png")
    code, out, err = run_cli([*args, "--min-size", "8", "-o", str(tmp_path / "none.png")], capsys)
    assert code == 0 and "0 boxes" in out and "no face found" in err, err
    assert Image.open(tmp_path / "none.png").size == (48, 48)  # the picture, no box on it


def test_mirror_average_scores_a_window_with_its_mirror_image():
    """A detector that fires on bright left halves: the mirrored view fires on right halves, so
    averaging halves the log-odds of a lopsided window and keeps a symmetric one's."""
    model = build_model(
        {"input": [1, 8, 8], "layers": [{"name": "fc", "type": "linear", "out_features": 2}]}
    )
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[1].view(8, 8)[:, :4] = 10 / 32  # mean of the left half, x10
        model.fc.bias.copy_(torch.tensor([0.0, -5.0]))
    loaded = Loaded(model.eval(), ["bg", "face"], Preprocess(1, 8, mean=[0.0], std=[255.0]), "t")
    lopsided = np.zeros((8, 8), np.uint8)
    lopsided[:, :4] = 255
    plain = detect(loaded, lopsided, threshold=0.01, min_face=8, mirror=False)[0].score
    both = detect(loaded, lopsided, threshold=0.01, min_face=8)[0].score
    assert plain == pytest.approx(1 / (1 + np.exp(-5)), abs=1e-4)  # log-odds 10 - 5
    assert both == pytest.approx(0.5, abs=1e-4)  # (5 + -5) / 2
    full = np.full((8, 8), 255, np.uint8)
    assert detect(loaded, full, threshold=0.01, min_face=8)[0].score == pytest.approx(
        plain, abs=1e-4
    )


@pytest.mark.slow
def test_faces_run_finds_the_astronauts_face(tmp_path):
    """End to end: the zoo faces run (mining included, fp32) finds the face in astronaut()
    among the boxes `cnnkit detect` shows by default (the face: about x 165-275, y 65-180; the
    test image is never mined). Its first three rounds only: the full run of five keeps round 2
    on an AMD EPYC, round 3 (the face 4th) on an Intel Xeon, and the rounds are the same bit for
    bit however many follow."""
    from skimage.data import astronaut

    import cnnkit

    summary = cnnkit.fit(
        "faces", ["data.hard_negatives.rounds=2"], out=tmp_path / "run", quiet=True
    )
    assert summary["val_top1"] >= 0.95 and summary["chosen_round"] >= 1
    boxes = detect(load_for_inference(tmp_path / "run"), astronaut(), top=3)
    assert any(iou_of(b, (165, 65, 275, 180)) >= 0.5 for b in boxes), boxes


def label_rows(drawn: np.ndarray, colour: tuple[int, int, int]) -> int:
    """How many pixel rows hold at least 10 pixels of the label's fill colour."""
    match = np.abs(drawn.astype(int) - colour).sum(-1) < 10
    return int((match.sum(1) >= 10).sum())


@pytest.mark.parametrize("side", [256, 1024])
def test_score_labels_are_filled_and_scale_with_the_picture(tmp_path, side):
    image = np.full((side, side), 90, np.uint8)
    at, text = side // 2, max(11, side / 28)  # the text is about side / 28 pixels tall
    boxes = [Box(at, at, at + side // 4, at + side // 4, 0.987), Box(8, 8, 40, 40, 0.5)]
    draw_boxes(image, boxes, tmp_path / "boxes.png")
    drawn = np.asarray(Image.open(tmp_path / "boxes.png"))
    above = drawn[at // 2 : at]  # the best box's label sits on its top edge, outside
    red = label_rows(above, (230, 30, 30))
    assert 0.9 * text <= red <= 2 * text  # a filled label, as tall as its text and margins
    row = above[-red // 2]  # across the label's middle: white text on the red
    assert ((row > 200).all(-1)).sum() >= 3
    yellow = label_rows(drawn[: at // 2], (255, 200, 0))  # no room above: inside the top
    assert yellow >= 0.9 * text
    with pytest.raises(ConfigError, match="use one of"):
        draw_boxes(image, boxes, tmp_path / "boxes.xyz")


def test_cli_detect_bad_inputs_are_one_line(tmp_path, capsys):
    save_safetensors(brightness_detector(), tmp_path / "det.safetensors")
    (tmp_path / "photo.png").write_text("not a picture")
    args = ["detect", str(tmp_path / "det.safetensors")]
    code, _, err = run_cli([*args, str(tmp_path / "photo.png")], capsys)
    assert code == 1 and err.count("\n") == 1 and "not an image" in err
    Image.fromarray(np.zeros((20, 20), np.uint8)).save(tmp_path / "ok.png")
    code, _, err = run_cli([*args, str(tmp_path / "ok.png"), "-o", str(tmp_path / "b.xyz")], capsys)
    assert code == 2 and err.count("\n") == 1 and "use one of" in err
    code, _, err = run_cli(["detect", "facenet", str(tmp_path / "ok.png")], capsys)  # fresh weights
    assert code == 2 and err.count("\n") == 1 and "a network without trained weights" in err
    before = (tmp_path / "ok.png").read_bytes()
    code, _, err = run_cli(
        [*args, str(tmp_path / "ok.png"), "-o", str(tmp_path / "ok.png")], capsys
    )
    assert code == 2 and "is the input" in err and (tmp_path / "ok.png").read_bytes() == before
    code, _, err = run_cli([*args, str(tmp_path / "ok.png"), "-o", str(tmp_path)], capsys)
    assert code == 2 and f"e.g. {tmp_path / 'boxes.png'}" in err


def test_cli_detect_size_errors_name_the_image(tmp_path, capsys):
    """An image too small for the smallest face, or one whose pyramid would be over the pixel
    limit, is one line that starts with the image's name, as every other image error does."""
    save_safetensors(brightness_detector(), tmp_path / "det.safetensors")
    Image.fromarray(np.zeros((10, 10), np.uint8)).save(tmp_path / "tiny.png")
    Image.fromarray(np.zeros((2048, 2048), np.uint8)).save(tmp_path / "big.png")
    args = ["detect", str(tmp_path / "det.safetensors")]
    code, _, err = run_cli([*args, str(tmp_path / "tiny.png")], capsys)
    line = one_error_line(code, err)
    assert line.startswith(f"cnnkit: error: {tmp_path / 'tiny.png'}: the image (10x10) is smaller")
    code, _, err = run_cli([*args, str(tmp_path / "big.png"), "--min-size", "1"], capsys)
    line = one_error_line(code, err)
    assert line.startswith(f"cnnkit: error: {tmp_path / 'big.png'}: the smallest face searched")


@pytest.mark.parametrize("layers,message", [
    ([{"type": "conv", "out_channels": 4, "kernel_size": 3, "stride": [2, 1]}], "strides or pads"),
    ([{"type": "conv", "out_channels": 4, "kernel_size": 3}], "need square images"),
])  # fmt: skip
def test_networks_detect_cannot_slide_are_one_line(layers, message):
    from cnnkit.infer.detect import sliding_net

    shape = [1, 12, 12] if message != "need square images" else [1, 12, 10]
    spec = {"input": shape, "layers": [*layers, {"type": "flatten"},
                                       {"type": "linear", "out_features": 2}]}  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        sliding_net(build_model(spec))
