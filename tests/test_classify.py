"""cnnkit classify and the Classifier API on a real (short) digits run: evaluation's
preprocessing, every accepted image form, 10 crops, bad files and the CLI."""

from __future__ import annotations

import io
import json
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from helpers import CLI, ROOT, one_error_line, run_cli
from PIL import Image

from cnnkit import CnnkitError, DataError, build_model
from cnnkit.data.base import Preprocess, holdout_split
from cnnkit.data.bundled import DigitsConfig
from cnnkit.infer import Classifier
from cnnkit.infer.load import load_network


def held_out_digits(n: int) -> tuple[np.ndarray, list[str]]:
    """The first n held-out digit images (uint8 (n, 8, 8)) and their class names."""
    images, labels, classes = DigitsConfig().load()
    _, val = holdout_split(labels, 0.2, 0)
    return images[val[:n]], [classes[i] for i in labels[val[:n]]]


@pytest.fixture(scope="module")
def digit_pngs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[str]]:
    folder = tmp_path_factory.mktemp("digit-pngs")
    images, names = held_out_digits(40)
    paths = []
    for i, image in enumerate(images):
        paths.append(folder / f"{i:02d}.png")
        Image.fromarray(image).save(paths[-1])
    return paths, names


def test_classifies_digit_pngs_like_evaluation(digits_run, digit_pngs):
    paths, truth = digit_pngs
    classifier = Classifier.load(digits_run)
    preds = classifier.predict(paths, top=3)
    accuracy = np.mean([p.label == t for p, t in zip(preds, truth, strict=True)])
    assert accuracy >= 0.8, accuracy
    # the same numbers as the model on the data set's own tensors, normalised as evaluation does
    images, _ = held_out_digits(40)
    x = classifier.preprocess.normalize(torch.from_numpy(images)[:, None])
    with torch.no_grad():
        expected = classifier.model(x).softmax(1)
    got = torch.tensor([p.probs[0] for p in preds])
    torch.testing.assert_close(got, expected.max(1).values, rtol=1e-5, atol=1e-6)
    assert all(len(p.labels) == 3 and p.probs == sorted(p.probs, reverse=True) for p in preds)


@pytest.mark.parametrize("channels_last,product", [(False, "xwt"), (True, "wxt"), (True, "onednn")])
def test_either_measured_format_gives_the_same_predictions(digits_run, digit_pngs, monkeypatch,
                                                           channels_last, product):  # fmt: skip
    """NCHW or channels_last, and each linear product (oneDNN's with its weights packed: a
    classifier's weights are frozen), predict the same."""
    from cnnkit.nn import tuning

    paths, _ = digit_pngs
    plain = Classifier.load(digits_run)
    plain.channels_last = False  # as measured: NCHW
    plan = {"fc3": product, "output": product} if product != "xwt" else {}  # digitnet's linear
    monkeypatch.setattr(tuning, "choose_inference_kernels", lambda *a, **k: (channels_last, plan))
    chosen = Classifier.load(digits_run)
    want, got = plain.predict(paths[:9], top=2), chosen.predict(paths[:9], top=2)
    assert chosen.channels_last is channels_last
    conv = next(m for m in chosen.model.modules()
                if isinstance(m, torch.nn.Conv2d) and m.in_channels > 1)  # fmt: skip
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) is channels_last
    fc3 = chosen.model.get_submodule("fc3")
    assert fc3.product == product and ("_packed" in fc3.__dict__) == (product == "onednn")
    assert [p.labels for p in got] == [p.labels for p in want]
    for a, b in zip(got, want, strict=True):
        assert a.probs == pytest.approx(b.probs, rel=1e-5, abs=1e-6)


def test_predict_accepts_paths_pil_arrays_and_tensors(digits_run, digit_pngs):
    path = digit_pngs[0][0]
    classifier = Classifier.load(digits_run)
    grey = np.array(Image.open(path))
    forms = [path, str(path), Image.open(path), Image.open(path).convert("RGB"), grey,
             np.stack([grey] * 3, -1), torch.from_numpy(grey)[None]]  # fmt: skip
    results = [classifier.predict(form, top=10) for form in forms]
    for r in results[1:]:
        assert r.labels == results[0].labels
        assert np.allclose(r.probs, results[0].probs, atol=1e-6)
    with pytest.raises(CnnkitError, match="uint8"):
        classifier.predict(grey.astype(np.float32))


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


def test_cli_folder_with_a_corrupt_file(digits_run, digit_pngs, tmp_path):
    for path in digit_pngs[0][:5]:
        (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    done = subprocess.run(
        [*CLI, "classify", str(digits_run), str(tmp_path)], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 1
    assert len(done.stdout.splitlines()) == 5 and "Traceback" not in done.stderr
    (error,) = done.stderr.splitlines()
    assert "broken.png" in error and error.startswith("cnnkit: error:")
    as_json = [*CLI, "classify", str(digits_run), str(tmp_path / "0*.png"), "--json", "--top", "2"]
    done = subprocess.run(as_json, capture_output=True, text=True, cwd=ROOT)
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0 and len(rows) == 5
    assert all(len(r["top"]) == 2 and r["label"] == r["top"][0]["class"] for r in rows)


def _tiff_with_tags_past_its_end() -> bytes:
    """A TIFF whose width tag claims 1000 values stored past the end of the file: Pillow warns
    (UserWarning, 'Tag data larger than file') and then cannot read it."""
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buffer, "TIFF")
    data = bytearray(buffer.getvalue())
    ifd = struct.unpack_from("<I", data, 4)[0]
    for k in range(struct.unpack_from("<H", data, ifd)[0]):
        if struct.unpack_from("<H", data, ifd + 2 + 12 * k)[0] == 256:
            struct.pack_into("<II", data, ifd + 2 + 12 * k + 4, 1000, 10**6)
    return bytes(data)


def test_a_damaged_tiff_is_one_line_without_pillows_warnings(digits_run, tmp_path):
    (tmp_path / "tags.tif").write_bytes(_tiff_with_tags_past_its_end())
    done = subprocess.run([*CLI, "classify", str(digits_run), str(tmp_path / "tags.tif")],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert done.returncode == 1 and done.stderr.startswith("cnnkit: error:"), done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_cli_missing_inputs_are_one_line_errors(digits_run, tmp_path, capsys):
    code, _, err = run_cli(["classify", str(tmp_path / "nope"), "x.png"], capsys)
    assert code == 1 and "no such run directory" in err
    code, _, err = run_cli(["classify", str(digits_run), str(tmp_path / "*.jpg")], capsys)
    assert code == 1 and "*.jpg: no file matches this pattern" in err and len(err.splitlines()) == 1
    code, _, err = run_cli(["classify", str(digits_run), str(tmp_path / "gone.png")], capsys)
    assert code == 1 and "gone.png: no such file or folder" in err


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


def test_cli_nothing_to_classify_is_one_error(digits_run, digit_pngs, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, out, err = run_cli(["classify", str(digits_run), str(tmp_path / "empty")], capsys)
    assert code == 1 and not out and err.startswith("cnnkit: error: no images to classify")
    assert len(err.splitlines()) == 1
    gifs = tmp_path / "gifs"
    gifs.mkdir()
    Image.new("P", (8, 8)).save(gifs / "a.gif")
    code, out, err = run_cli(["classify", str(digits_run), str(gifs)], capsys)
    (line,) = err.splitlines()
    assert code == 1 and "1 entries skipped" in line and "a.gif: not a supported image type" in line
    # beside images, files that are not images are named and skipped: no failure
    (gifs / "0.png").write_bytes(digit_pngs[0][0].read_bytes())
    code, out, err = run_cli(["classify", str(digits_run), str(gifs)], capsys)
    assert code == 0 and len(out.splitlines()) == 1
    assert err.splitlines() == [
        f"cnnkit: skipped {gifs / 'a.gif'}: not a supported image type (.gif)"
    ]


@pytest.mark.parametrize("change", ["fewer classes", "more classes", "huge resize"])
def test_exports_that_cannot_classify_are_refused_on_load(digits_run, digit_pngs, tmp_path,
                                                         capsys, change):  # fmt: skip
    from cnnkit.infer.load import load_for_inference, save_safetensors

    loaded = load_for_inference(digits_run)
    if change == "fewer classes":
        loaded.classes = loaded.classes[:7]
    elif change == "more classes":
        loaded.classes = [*loaded.classes, "extra"]
    else:  # 60000 x 60000 x 3 bytes per image; Preprocess refuses it, so bypass its checks
        loaded.preprocess = type(loaded.preprocess).model_construct(
            **{**loaded.preprocess.to_dict(), "resize": 60000}
        )
    save_safetensors(loaded, tmp_path / "m.safetensors")
    code, out, err = run_cli(["classify", str(tmp_path / "m.safetensors"), str(digit_pngs[0][0])],
                             capsys)  # fmt: skip
    (line,) = err.splitlines()
    assert code == 1 and not out and line.startswith("cnnkit: error: ")
    if change == "huge resize":
        assert "resize" in line and (
            "over the limit" in line or "less than or equal to 8192" in line
        )
    else:
        assert f"{len(loaded.classes)} class names for the network's 10 outputs" in line
    with pytest.raises(CnnkitError):
        Classifier(loaded)


def test_a_network_without_trained_weights_is_refused(tmp_path, capsys):
    """Fresh weights classify as noise: only a network file naming its weights is taken."""
    image = tmp_path / "x.png"
    Image.new("L", (8, 8)).save(image)
    code, _, err = run_cli(["classify", "digitnet", str(image)], capsys)
    assert code == 2 and "digitnet: a network without trained weights" in err
    export = tmp_path / "fresh.safetensors"  # its export says so, and is refused alike
    code, out, err = run_cli(["export", "digitnet", "-o", str(export)], capsys)
    assert code == 0 and out.startswith("wrote") and "note: digitnet has no trained weights" in err
    for argv in (["classify", str(export), str(image)], ["detect", str(export), str(image)]):
        code, _, err = run_cli(argv, capsys)
        assert "export of a network without trained weights" in one_error_line(code, err, (2,))
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


def test_a_mean_image_run_says_its_mean_is_approximated(digits_run, capsys, monkeypatch):
    """A checkpoint from before they kept the mean image has its channel averages only:
    classifying with such a run says so; a per-channel run (and drawing one) says nothing."""
    from cnnkit.checkpoint import uses_mean_image
    from cnnkit.infer import load

    assert not uses_mean_image({"data": {"source": "packed", "normalize": "channel"}})
    assert uses_mean_image({"data": {"source": "packed", "normalize": "mean_image"}})
    Classifier.load(digits_run)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(load, "uses_mean_image", lambda config: True)
    load.load_for_inference(digits_run)  # export, show, detect: no line
    assert capsys.readouterr().err == ""
    Classifier.load(digits_run)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("cnnkit: classify subtracts the training mean image's per-channel")


def test_eval_of_a_grey_network_on_an_rgb_folder_agrees_with_classify(digits_run, tmp_path):
    """Folders and packed sets are RGB: eval --data makes them grey as classify does."""
    from cnnkit.train.evaluation import evaluate_checkpoint

    images, names = held_out_digits(30)
    rng = np.random.default_rng(0)
    paths = []
    for i, (image, name) in enumerate(zip(images, names, strict=True)):
        (tmp_path / name).mkdir(exist_ok=True)
        tint = rng.integers(0, 60, 3)  # a coloured image: luma, not a channel, is what counts
        rgb = np.clip(image[:, :, None].astype(int) + tint - 30, 0, 255).astype(np.uint8)
        paths.append(tmp_path / name / f"{i:02d}.png")
        Image.fromarray(rgb).save(paths[-1])
    result = evaluate_checkpoint(digits_run, data=str(tmp_path))
    classifier = Classifier.load(digits_run)
    preds = classifier.predict(paths, top=10)
    truth = [p.parent.name for p in paths]
    correct = np.mean([p.label == t for p, t in zip(preds, truth, strict=True)])
    loss = -np.mean([np.log(dict(zip(p.labels, p.probs, strict=True))[t])
                     for p, t in zip(preds, truth, strict=True)])  # fmt: skip
    # eval runs in the run's precision (bf16 where it trained in bf16), classify in fp32
    assert result["images"] == 30 and result["top1"] == pytest.approx(correct, abs=1.5 / 30)
    assert result["loss"] == pytest.approx(loss, rel=2e-2)


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


def test_an_empty_image_is_one_error(digits_run):
    with pytest.raises(CnnkitError, match=r"an empty image \(0 x 8 pixels\)"):
        Classifier.load(digits_run).predict(np.zeros((0, 8), np.uint8))


def test_eval_data_odd_cases_are_clear(digits_run, tmp_path, capsys, monkeypatch):
    """A packed set at another size than the network's images is refused (it would be cropped,
    not resized); a directory named `packed` is that directory; --tencrop on images stored at
    the input size names the network as the reason."""
    from cnnkit.data.pack import pack_folder
    from cnnkit.data.synth import synth_shapes
    from cnnkit.train.evaluation import check_pack_fits, evaluate_checkpoint

    synth_shapes(tmp_path / "src", classes=2, per_class=3, size=16)
    pack_folder(tmp_path / "src", tmp_path / "packed", size=16, workers=1, progress=False)
    with pytest.raises(CnnkitError, match="packed at 16 px, but the network was trained on 8 px"):
        evaluate_checkpoint(digits_run, data=str(tmp_path / "packed"))
    squashed = Preprocess(3, 12, 16, "squash", [0.0] * 3, [1.0] * 3)  # a run on squashed images
    with pytest.raises(DataError, match=r"packed by --resize shorter-side-crop, but the network "
                       r"was trained on images resized by squash \(pack it again with --resize "
                       r"squash\)"):  # fmt: skip
        check_pack_fits("val/", {"size": 16, "resize": "shorter"}, squashed)
    check_pack_fits("val/", {"size": 16, "resize": "squash"}, squashed)  # as trained: fine
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["eval", str(digits_run), "--data", "packed"], capsys)
    assert code == 1 and "packed at 16 px" in err  # the directory, not the source name
    for data in ([], ["--data", str(tmp_path / "src")]):  # 16 px images, read at 8 px
        code, _, err = run_cli(["eval", str(digits_run), *data, "--tencrop"], capsys)
        line = one_error_line(code, err, (2,))  # the network is why, not the data's size
        assert "this network was trained on images of its input size (8x8, no resize)" in line
    (tmp_path / "packed/meta.json").rename(tmp_path / "half")  # as an interrupted pack leaves it
    code, _, err = run_cli(["eval", str(digits_run), "--data", str(tmp_path / "packed")], capsys)
    assert code == 1 and "(interrupted? run cnnkit pack again to resume)" in err
    image = sorted((tmp_path / "src").rglob("*.JPEG"))[0]
    (tmp_path / "dup.yaml").write_text("data: {source: digits}\ndata: {source: faces}\n")
    for given, words in ((image, "an image; eval takes a folder"),
                         (tmp_path / "dup.yaml", "duplicate key"),
                         (digits_run / "best.pt", "not a text file: eval takes a folder")):  # fmt: skip
        code, _, err = run_cli(["eval", str(digits_run), "--data", str(given)], capsys)
        assert code == 2 and words in err and len(err.splitlines()) == 1, err
        assert err.startswith(f"cnnkit: error: --data {given}: "), err  # names --data
    image = str(sorted((tmp_path / "src").rglob("*.JPEG"))[0])
    code, out, err = run_cli(["classify", str(digits_run), image, "--tencrop"], capsys)
    assert code == 2 and not out  # 5 copies and 5 mirrors of the 8 px image, not 10 crops
    assert "--tencrop: 10-crop needs images resized larger than the network's input (8x8)" in err


def test_classify_reads_a_large_jpeg_as_eval_reads_its_folder(digits_run, tmp_path):
    """Both decode at the network's size (DCT-scaled where the file is 2x larger or more), so
    classify's input is eval --data's to the grey level."""
    from cnnkit.infer.images import crops_of
    from cnnkit.train.evaluation import eval_data, luma

    images, names = held_out_digits(6)
    for i, (image, name) in enumerate(zip(images, names, strict=True)):
        (tmp_path / name).mkdir(exist_ok=True)
        big = Image.fromarray(image).resize((40, 40), Image.BILINEAR).convert("RGB")
        big.save(tmp_path / name / f"{i}.jpg", quality=90)
    classifier = Classifier.load(digits_run)
    pre = classifier.preprocess
    cfg = eval_data(str(tmp_path), {}, pre).model_copy(
        update={"mean": (0.0,) * 3, "std": (1.0,) * 3, "workers": 0}
    )
    bundle = cfg.build(torch.device("cpu"))
    streamed = torch.cat([luma(x) for x, _ in bundle.val])
    files = sorted(tmp_path.glob("*/*.jpg"), key=lambda p: (p.parent.name, p.name))
    direct = torch.cat([crops_of(str(f), pre, False).float() for f in files])
    assert torch.equal(streamed, direct)


def test_eval_reads_a_flat_folder_with_its_label_file(digits_run, digit_pngs, tmp_path, capsys):
    """ImageNet's validation layout: `--data DIR --labels FILE` scores as the same images in
    class folders do; --labels without a folder is one line."""
    import shutil

    paths, truth = digit_pngs
    lines = []
    for path, name in zip(paths, truth, strict=True):
        (tmp_path / "flat").mkdir(exist_ok=True)
        (tmp_path / "classes" / name).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, tmp_path / "flat" / path.name)
        shutil.copy(path, tmp_path / "classes" / name / path.name)
        lines.append(f"{path.name} {name}")
    (tmp_path / "val.txt").write_text("\n".join(lines) + "\n")
    code, out, _ = run_cli(["eval", str(digits_run), "--data", str(tmp_path / "flat"), "--labels",
                            str(tmp_path / "val.txt"), "--json"], capsys)  # fmt: skip
    flat = json.loads(out)
    code2, out, _ = run_cli(["eval", str(digits_run), "--data", str(tmp_path / "classes"),
                             "--json"], capsys)  # fmt: skip
    classes = json.loads(out)
    assert code == code2 == 0 and flat["images"] == 40 and flat["top1"] > 0.8
    assert (flat["top1"], flat["loss"]) == (classes["top1"], pytest.approx(classes["loss"]))
    code, _, err = run_cli(["eval", str(digits_run), "--labels", str(tmp_path / "val.txt")], capsys)
    assert code == 2 and "--labels: the label file of a flat image folder given as --data" in err


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
    monkeypatch.setattr(cnnkit.cli, "_stdout_to_devnull", lambda: None)  # pytest's own fd 1
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
