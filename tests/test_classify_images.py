"""How classify reads an image, without a trained run (ten crops, JPEG crops, grey from
colour, EXIF orientation, DCT-scaled decoding), which networks it takes (trained weights,
class scores), a file named like a glob, and a stdout whose reader has gone."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from helpers import one_error_line, run_cli
from PIL import Image

from cnnkit import CnnkitError, build_model
from cnnkit.data.base import Preprocess
from cnnkit.infer import Classifier
from cnnkit.infer.load import load_network


def test_tencrop_averages_the_papers_ten_crops():
    loaded = load_network("inception-small")
    loaded.preprocess = Preprocess(channels=3, crop=32, resize=40, mean=[120.0] * 3, std=[60.0] * 3)
    classifier = Classifier(loaded)
    image = np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    crops = TF.ten_crop(torch.from_numpy(image).permute(2, 0, 1), 32)
    x = loaded.preprocess.normalize(torch.stack(crops))
    with torch.no_grad():
        expected = loaded.model(x).softmax(1).mean(0)
    got = classifier.predict(image, top=10, tencrop=True)
    torch.testing.assert_close(
        torch.tensor(got.probs), expected.topk(10).values, rtol=1e-5, atol=1e-6
    )
    centre = classifier.predict(image, top=10)
    assert not np.allclose(centre.probs, got.probs)


def test_the_api_refuses_what_the_command_line_refuses():
    """predict(top=0) returned no labels where `classify --top 0` is refused; a device that is
    not here was torch's RuntimeError where `--device cuda` is one line."""
    classifier = Classifier(load_network("digitnet"))
    image = np.zeros((8, 8), np.uint8)
    for top in (0, -1, True, 2.5):
        with pytest.raises(CnnkitError, match="top: a whole number of classes, 1 or more, got "):
            classifier.predict(image, top=top)
    assert len(classifier.predict(image, top=2).labels) == 2
    if not torch.cuda.is_available():
        with pytest.raises(CnnkitError, match="device: 'cuda' asked for, but no CUDA device"):
            Classifier(load_network("digitnet"), device="cuda")


@pytest.mark.parametrize("mode", ["squash", "shorter"])
def test_jpeg_crops_equal_the_folder_pipelines(tmp_path, mode):
    from cnnkit.data.augment import center_crop
    from cnnkit.data.decode import load_resized
    from cnnkit.infer.images import crops_of

    path = tmp_path / "photo.jpg"
    Image.fromarray(np.asarray(Image.open(_astronaut_png(tmp_path)))).save(path, quality=90)
    pre = Preprocess(
        channels=3, crop=56, resize=64, resize_mode=mode, mean=[0.0] * 3, std=[1.0] * 3
    )
    expected = center_crop(load_resized(path, 64, mode)[0][None], 56)
    assert torch.equal(crops_of(path, pre, tencrop=False), expected)


def _astronaut_png(folder: Path) -> Path:
    from skimage import data

    path = folder / "astronaut.png"
    Image.fromarray(data.astronaut()[:300, 50:500]).save(path)
    return path


def test_a_network_without_trained_weights_is_refused(tmp_path, capsys):
    """Fresh weights classify (and score) as noise: only a network file naming its weights is
    taken."""
    image = tmp_path / "x.png"
    Image.new("L", (8, 8)).save(image)
    code, _, err = run_cli(["classify", "digitnet", str(image)], capsys)
    assert code == 2 and "digitnet: a network without trained weights" in err
    export = tmp_path / "fresh.safetensors"  # its export says so, and is refused alike
    code, out, err = run_cli(["export", "digitnet", "-o", str(export)], capsys)
    assert code == 0 and out.startswith("wrote") and "note: digitnet has no trained weights" in err
    for argv in (["classify", str(export), str(image)], ["detect", str(export), str(image)],
                 ["eval", str(export), "--data", "digits"]):  # fmt: skip
        code, _, err = run_cli(argv, capsys)
        assert "export of a network without trained weights" in one_error_line(code, err, (2,))
    code, _, err = run_cli(["eval", "digitnet", "--data", "digits"], capsys)
    assert "digitnet: a network without trained weights" in one_error_line(code, err, (2,))


def test_a_runs_settings_beside_its_checkpoint_point_to_the_run(digits_run, tmp_path, capsys):
    """runs/X/config.yaml is a run file, whose network alone has random weights: where the
    run's checkpoint lies beside it, classify and export name the run, and write nothing."""
    settings, image, out = digits_run / "config.yaml", tmp_path / "x.png", tmp_path / "x.onnx"
    Image.new("L", (8, 8)).save(image)
    for argv in (
        ["classify", str(settings), str(image)],
        ["export", str(settings), "-o", str(out)],
    ):
        code, _, err = run_cli(argv, capsys)
        line = one_error_line(code, err, (2,))
        assert f"the settings of run {digits_run}, without its weights" in line
        assert f"give the run directory {digits_run}" in line
    assert not out.exists()
    copy = tmp_path / "config.yaml"  # elsewhere: the network with its random initial weights
    copy.write_text(settings.read_text())
    code, _, err = run_cli(["export", str(copy), "-o", str(out)], capsys)
    assert code == 0 and "has no trained weights" in err and out.is_file()
    net = load_network("digitnet").model
    torch.save(net.state_dict(), tmp_path / "w.pt")
    (tmp_path / "net.yaml").write_text(f"model: {json.dumps({**net.spec, 'weights': 'w.pt'})}\n")
    prediction = Classifier.load(tmp_path / "net.yaml").predict(str(image), top=3)
    expected = net(torch.zeros(1, 1, 8, 8)).softmax(1)[0].topk(3).values
    assert prediction.probs == pytest.approx(expected.tolist(), abs=1e-5)


def test_exports_of_fresh_weights_are_the_same_every_time(tmp_path, capsys):
    """Fresh weights are seeded: two exports of a network file hold the same weights and
    metadata (safetensors orders the metadata as it likes), and the caller's random stream is
    not consumed by loading one."""
    from safetensors import safe_open

    exports = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.safetensors"
        code, out, _ = run_cli(["export", "digitnet", "-o", str(path)], capsys)
        assert code == 0 and out.startswith("wrote")
        with safe_open(path, "pt") as f:
            exports.append((f.metadata(), {k: f.get_tensor(k) for k in f.keys()}))
    (meta_a, weights_a), (meta_b, weights_b) = exports
    assert meta_a == meta_b and weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    torch.manual_seed(1)
    load_network("digitnet")
    after = torch.rand(3)
    torch.manual_seed(1)
    assert torch.equal(after, torch.rand(3))


def test_fresh_weights_for_a_device_are_checked_against_its_memory(monkeypatch):
    """Seeded on the CPU, then moved: a network too big for the device is still one line, said
    before the copy (not a CUDA out-of-memory)."""
    from cnnkit.nn import memory

    seen = []

    def tiny(device):
        seen.append(str(device))
        return (1000, "free on cuda:0") if str(device).startswith("cuda") else None

    monkeypatch.setattr(memory, "available", tiny)
    with pytest.raises(
        CnnkitError, match=r"digitnet needs .* but 1.0 KB is available \(free on cuda:0\)"
    ):
        load_network("digitnet", "cuda:0")
    assert seen[-1] == "cuda:0"


@pytest.mark.parametrize("given", ["file", "array"])
def test_a_grey_network_sees_a_colour_image_resized_then_made_grey(tmp_path, given):
    """As evaluation reads a folder of colour images for a grey network (resize in RGB, then
    luma): the other order differed by 1-2 grey levels wherever a resize happens."""
    from cnnkit.infer.images import resized

    rgb = np.random.default_rng(2).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "a.png")
    image = str(tmp_path / "a.png") if given == "file" else rgb
    common = {"crop": 8, "resize": 12, "resize_mode": "shorter"}
    colour = resized(image, Preprocess(channels=3, **common)).permute(1, 2, 0).numpy()
    expected = np.array(Image.fromarray(np.ascontiguousarray(colour)).convert("L"))
    got = resized(image, Preprocess(channels=1, mean=[0.0], std=[255.0], **common))
    assert got.shape == (1, 12, 12) and torch.equal(got[0], torch.from_numpy(expected))


def test_luma_is_pillows_grey():
    from cnnkit.train.evaluation import luma

    rgb = np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    expected = np.array(Image.fromarray(rgb).convert("L"))
    got = luma(torch.from_numpy(rgb).permute(2, 0, 1)[None].float())[0, 0]
    assert torch.equal(got, torch.from_numpy(expected).float())


def test_a_network_file_declares_how_its_weights_read_images(tmp_path, capsys):
    """`preprocess:` in a network file (published weights want their own normalisation and
    resize); networks that do not read square grey or RGB images are one line in classify."""
    net = load_network("digitnet").model
    torch.save(net.state_dict(), tmp_path / "w.pt")
    given = {"mean": [100.0], "std": [50.0], "resize": 12}
    spec = {**net.spec, "weights": "w.pt", "preprocess": given}
    (tmp_path / "net.yaml").write_text(f"model: {json.dumps(spec)}\n")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (12, 12), dtype=np.uint8)).save(tmp_path / "x.png")
    prediction = Classifier.load(tmp_path / "net.yaml").predict(str(tmp_path / "x.png"), top=3)
    pixels = torch.from_numpy(np.array(Image.open(tmp_path / "x.png"))).float()
    x = ((pixels[2:10, 2:10] - 100.0) / 50.0)[None, None]  # resize 12 (as stored), centre 8
    with torch.no_grad():
        expected = net(x).softmax(1)[0].topk(3).values
    assert prediction.probs == pytest.approx(expected.tolist(), abs=1e-5)
    for bad, message in (({"mean": [1.0, 2.0]}, "preprocess.mean"),
                         ({"crop": 4}, "channels and crop are the input's"),
                         ({"resize": 6}, "preprocess.resize: 6 is smaller than the input (8 px)"),
                         ):  # fmt: skip
        (tmp_path / "bad.yaml").write_text(f"model: {json.dumps({**spec, 'preprocess': bad})}\n")
        code, _, err = run_cli(["classify", str(tmp_path / "bad.yaml"), str(tmp_path / "x.png")],
                               capsys)  # fmt: skip
        assert code == 2 and message in err and len(err.splitlines()) == 1, err
    wide = {"input": [3, 8, 6], "weights": "w2.pt",
            "layers": [{"type": "flatten"}, {"type": "linear", "out_features": 2}]}  # fmt: skip
    torch.save(build_model({k: v for k, v in wide.items() if k != "weights"}).state_dict(),
               tmp_path / "w2.pt")  # fmt: skip
    (tmp_path / "wide.yaml").write_text(f"model: {json.dumps(wide)}\n")
    code, _, err = run_cli(["classify", str(tmp_path / "wide.yaml"), str(tmp_path / "x.png")],
                           capsys)  # fmt: skip
    assert code == 2 and "takes 3 x 8 x 6 inputs" in err and len(err.splitlines()) == 1, err


def test_a_network_whose_output_is_not_class_scores_is_one_line(tmp_path, capsys):
    """A trained network file whose last layer is a convolution: its output (4 x 6 x 6) is no
    vector of class scores, so a softmax over it would classify nothing (it was an IndexError)."""
    spec = {"input": [1, 8, 8], "layers": [{"type": "conv", "out_channels": 4, "kernel_size": 3}]}
    torch.save(build_model(spec).state_dict(), tmp_path / "w.pt")
    (tmp_path / "net.yaml").write_text(json.dumps({"model": {**spec, "weights": "w.pt"}}))
    Image.new("L", (8, 8)).save(tmp_path / "a.png")
    code, _, err = run_cli(
        ["classify", str(tmp_path / "net.yaml"), str(tmp_path / "a.png")], capsys
    )
    assert code == 2 and err.splitlines() == [
        f"cnnkit: error: {tmp_path / 'net.yaml'}: classify needs a network whose output is a "
        "vector of class scores; this one gives 4 x 6 x 6"
    ]


class _ClosedPipe(io.StringIO):
    """stdout whose reader has gone (`| head`): each write says EPIPE, as a pipe's does."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_classify_whose_stdout_reader_goes_stops_quietly_not_as_a_failed_image(
    tmp_path, capsys, monkeypatch
):
    """`cnnkit classify ... | head`: typer made the EPIPE status 1, which classify documents as
    "an image failed"; the command stops with SIGPIPE's status (141), saying nothing."""
    import cnnkit.cli

    spec = {
        "input": [1, 8, 8],
        "layers": [{"type": "flatten"}, {"type": "linear", "out_features": 2}],
    }
    torch.save(build_model(spec).state_dict(), tmp_path / "w.pt")
    (tmp_path / "net.yaml").write_text(json.dumps({"model": {**spec, "weights": "w.pt"}}))
    Image.new("L", (8, 8)).save(tmp_path / "a.png")
    monkeypatch.setattr(cnnkit.cli, "to_devnull", lambda stream: None)  # pytest's own fd 1
    monkeypatch.setattr("sys.stdout", _ClosedPipe())
    code, _, err = run_cli(
        ["classify", str(tmp_path / "net.yaml"), str(tmp_path / "a.png")], capsys
    )
    assert (code, err) == (141, "")


def test_a_file_named_like_a_glob_is_that_file(tmp_path):
    """`photo [1].png` exists: it is the file classified, not `photo 1.png`, which the glob
    matches (a script that matches results by name got another image's label); a pattern that
    is not a file is still a glob."""
    from cnnkit.infer.images import find_images

    for name in "photo [1].png", "photo 1.png":
        Image.new("L", (8, 8)).save(tmp_path / name)
    assert find_images([str(tmp_path / "photo [1].png")]).files == [tmp_path / "photo [1].png"]
    both = find_images([str(tmp_path / "photo*.png")]).files
    assert sorted(both) == [tmp_path / "photo 1.png", tmp_path / "photo [1].png"]


def test_a_folder_given_again_is_no_failure_and_names_the_first_by_its_path(tmp_path):
    """`classify RUN d d/sub` (or a folder twice, or a link to it): each image read once, the
    second time skipped as the same file, by the path it was read as (its bare name before);
    the folder was said to hold no images, and classify exited 1 with every image read."""
    from cnnkit.infer.images import find_images

    (tmp_path / "d" / "sub").mkdir(parents=True)
    Image.new("L", (8, 8)).save(tmp_path / "d" / "sub" / "a.png")
    (tmp_path / "empty").mkdir()
    d, sub = tmp_path / "d", tmp_path / "d" / "sub"
    found = find_images([str(d), str(sub), str(sub), str(tmp_path / "empty")])
    assert found.files == [sub / "a.png"] and found.empty == [str(tmp_path / "empty")]
    assert found.skipped == [(str(sub / "a.png"), f"the same file as {sub / 'a.png'}")] * 2


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("suffix", [".png", ".jpg"])
def test_a_photos_exif_orientation_is_applied_as_viewers_show_it(tmp_path, orientation, suffix):
    """A phone stores the pixels as the sensor saw them and an orientation tag: classify and
    detect read the picture as every viewer shows it (PIL's exif_transpose)."""
    from PIL import ImageOps

    from cnnkit.infer.images import to_hwc

    rng = np.random.default_rng(orientation)
    pixels = np.kron(rng.integers(0, 256, (6, 10, 3)), np.ones((8, 8, 1))).astype(np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / f"photo{suffix}"
    Image.fromarray(pixels).save(path, exif=exif, **({"quality": 95} if suffix == ".jpg" else {}))
    expected = np.asarray(ImageOps.exif_transpose(Image.open(path)).convert("RGB"))
    got = to_hwc(path)
    assert got.shape == expected.shape
    assert np.abs(got.astype(int) - expected).max() <= (0 if suffix == ".png" else 2)


@pytest.mark.parametrize("orientation", range(2, 9))
@pytest.mark.parametrize("mode", ["squash", "shorter"])
def test_a_turned_jpeg_read_dct_scaled_gives_the_upright_ones_pixels(tmp_path, orientation, mode):
    """37 x 70 pixels read for an 8-pixel squash decode at 1/4, the last row and column
    covering part of a block: the file is resized as stored and then turned upright, so that
    partial pixel is mapped where it lies (turned first, it came first: the picture shifted,
    9-25 levels off on average). The centre square is the upright picture's, the odd column
    after it. As PIL's exif_transpose and torchvision's resize give, and the upright file."""
    from PIL import ImageOps

    from cnnkit.infer.images import UPRIGHT, resized

    y, x = np.mgrid[:37, :70]
    sines = 128 + 100 * np.sin(x / 9 + y / 7)
    upright = np.stack([x * 255 // 69, y * 255 // 36, sines], -1).astype(np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored = UPRIGHT[{6: 8, 8: 6}.get(orientation, orientation)](upright)  # the inverse turn
    Image.fromarray(np.ascontiguousarray(stored)).save(tmp_path / "turned.jpg", exif=exif)
    Image.fromarray(upright).save(tmp_path / "upright.jpg")
    pre = Preprocess(channels=3, crop=8, resize=8, resize_mode=mode, mean=[0.0], std=[1.0])
    got = resized(tmp_path / "turned.jpg", pre).float()
    full = TF.pil_to_tensor(ImageOps.exif_transpose(Image.open(tmp_path / "turned.jpg")))
    full = TF.center_crop(full, [37, 37]) if mode == "shorter" else full
    expected = TF.resize(full, [8, 8], antialias=True).float()
    for error in (got - expected).abs(), (got - resized(tmp_path / "upright.jpg", pre)).abs():
        assert error.mean() < 2.5 and error.max() < 20  # the DCT's filter: 1-2 and 4-10


@pytest.mark.parametrize(
    "argv", [["train", "--help"], ["train", "digits", "-h"], ["train", "digits", "--dry-run"]]
)
def test_train_help_whose_reader_goes_stops_quietly(argv, capsys, monkeypatch):
    """`cnnkit train --help | head -3` said "training goes on without printing its log": help
    (and a dry run) trains nothing, so it stops as any other command's output does."""
    import cnnkit.cli

    monkeypatch.setattr(cnnkit.cli, "to_devnull", lambda stream: None)  # pytest's own fd 1
    monkeypatch.setattr("sys.stdout", _ClosedPipe())
    code, _, err = run_cli(argv, capsys)
    assert (code, err) == (141, "")


def test_a_pngs_orientation_is_read_without_decoding_it(tmp_path, monkeypatch):
    """Pillow's getexif decodes a whole PNG to look for an eXIf chunk after the pixels: every
    PNG was decoded twice, and one over the pixel limit was decoded before it was refused.
    The chunk is found by the chunks' lengths, before the image data or after it."""
    import struct
    import zlib

    from PIL import PngImagePlugin

    from cnnkit.infer.images import _orientation

    exif = Image.Exif()
    exif[0x0112] = 6
    early = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(early, "PNG", exif=exif)
    plain = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(plain, "PNG")
    payload = exif.tobytes()[6:]  # the PNG spec's eXIf: the TIFF header first, no "Exif\0\0"
    chunk = struct.pack(">I", len(payload)) + b"eXIf" + payload
    chunk += struct.pack(">I", zlib.crc32(b"eXIf" + payload))
    at = plain.getvalue().rfind(b"IEND") - 4
    late = plain.getvalue()[:at] + chunk + plain.getvalue()[at:]
    assert Image.open(io.BytesIO(late)).getexif().get(0x0112) == 6  # as Pillow reads it

    def decodes(self):
        raise AssertionError("decoded to read the orientation")

    magick = io.BytesIO()  # ImageMagick's: the EXIF as hex in a text chunk, no eXIf chunk
    text = PngImagePlugin.PngInfo()
    hexed = exif.tobytes().hex()
    text.add_text("Raw profile type exif", f"\nexif\n{len(hexed) // 2:8d}\n{hexed}\n", zip=True)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(magick, "PNG", pnginfo=text)

    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", decodes)
    datas = (early.getvalue(), late, plain.getvalue(), magick.getvalue())
    assert [_orientation(d) for d in datas] == [6, 6, 1, 6]
    assert _orientation(plain.getvalue()[:40]) == 1  # a truncated file: as stored
