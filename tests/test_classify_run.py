"""cnnkit classify and eval on a real (short) digits run: evaluation's preprocessing and
predictions, every accepted image form, eval --data's folders and packs, and bad files
and inputs in one line."""

from __future__ import annotations

import io
import json
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import CLI, ROOT, one_error_line, run_cli
from PIL import Image

from cnnkit import CnnkitError, DataError
from cnnkit.data.base import Preprocess
from cnnkit.data.bundled import DigitsConfig
from cnnkit.data.holdout import holdout_split
from cnnkit.infer import Classifier


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
    rgb = np.stack([grey] * 3, -1)
    forms = [path, str(path), Image.open(path), Image.open(path).convert("RGB"), grey, rgb,
             torch.from_numpy(grey)[None], torch.from_numpy(rgb)]  # fmt: skip
    results = [classifier.predict(form, top=np.int64(10)) for form in forms]  # (numpy's top)
    for r in results[1:]:  # (a torch (H, W, C) tensor was refused, named (W, C, H))
        assert r.labels == results[0].labels
        assert np.allclose(r.probs, results[0].probs, atol=1e-6)
    assert len(classifier.predict(iter([grey, rgb]))) == 2  # (was taken as one image)
    with pytest.raises(CnnkitError, match=r"uint8 \(0-255\), got float32 \(0-1 floats: "):
        classifier.predict(grey.astype(np.float32))
    with pytest.raises(CnnkitError, match=r"got \(2, 8, 8, 3\) \(a batch: give list\(batch\)\)"):
        classifier.predict(np.stack([rgb, rgb]))


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


def test_classify_help_names_every_target_it_takes(capsys, monkeypatch):
    """The help listed a run directory, checkpoint and .safetensors export, not the network
    file with weights: that classify takes as well (and names when it refuses an untrained one)."""
    monkeypatch.setenv("COLUMNS", "400")
    code, out, _ = run_cli(["classify", "--help"], capsys)
    takes = ("A run directory, checkpoint (.pt), .safetensors export, or network file with "
             "weights: (a YAML file naming trained weights).")  # fmt: skip
    assert code == 0 and takes in " ".join(out.split()), out


def test_cli_missing_inputs_are_one_line_errors(digits_run, tmp_path, capsys):
    code, _, err = run_cli(["classify", str(tmp_path / "nope"), "x.png"], capsys)
    assert code == 1 and "no such run directory" in err
    code, _, err = run_cli(["classify", str(digits_run), str(tmp_path / "*.jpg")], capsys)
    assert code == 1 and "*.jpg: no file matches this pattern" in err and len(err.splitlines()) == 1
    code, _, err = run_cli(["classify", str(digits_run), str(tmp_path / "gone.png")], capsys)
    assert code == 1 and "gone.png: no such file or folder" in err


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
    assert code == 1 and "1 entry skipped" in line and "a.gif: not a supported image type" in line
    # beside images, files that are not images are named and skipped: no failure
    (gifs / "0.png").write_bytes(digit_pngs[0][0].read_bytes())
    code, out, err = run_cli(["classify", str(digits_run), str(gifs)], capsys)
    assert code == 0 and len(out.splitlines()) == 1
    assert err.splitlines() == [
        f"cnnkit: skipped {gifs / 'a.gif'}: not a supported image type (.gif), passed over in "
        "a folder or pattern: name the file itself to read it"
    ]
    code, out, err = run_cli(["classify", str(digits_run), str(gifs / "a.gif")], capsys)
    assert code == 0 and out.startswith(f"{gifs / 'a.gif'}: ")  # named itself: read by its data


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


def test_a_checkpoint_or_export_whose_tensors_do_not_fit_names_them(digits_run, digit_pngs,
                                                                   tmp_path, capsys):  # fmt: skip
    """Weights edited or damaged in a checkpoint or an export: each key that does not fit is
    named with both shapes, as a weights file's are (not torch's load_state_dict text)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from cnnkit.infer.load import load_for_inference, save_safetensors

    state = torch.load(digits_run / "best.pt", weights_only=False)
    state["model"]["conv1.weight"] = torch.zeros(3)
    state["model"]["extra.bias"] = torch.zeros(2)
    torch.save(state, tmp_path / "edited.pt")
    save_safetensors(load_for_inference(digits_run), tmp_path / "m.safetensors")
    weights = load_file(tmp_path / "m.safetensors")
    with safe_open(tmp_path / "m.safetensors", framework="pt") as f:  # its metadata, kept
        meta = f.metadata()
    del weights["fc3.bias"]
    save_file(weights, tmp_path / "cut.safetensors", metadata=meta)
    for target, said in [
        ("edited.pt", "1 unexpected (extra.bias); 1 mis-shaped (conv1.weight: file (3), network "
         "(32, 1, 3, 3))"),
        ("cut.safetensors", "1 missing (fc3.bias)"),
    ]:  # fmt: skip
        code, out, err = run_cli(["classify", str(tmp_path / target), str(digit_pngs[0][0])],
                                 capsys)  # fmt: skip
        assert (code, out) == (1, "") and err == (
            f"cnnkit: error: {tmp_path / target}: does not fit digitnet: {said}\n"
        ), err


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
    assert line.startswith("cnnkit: note: classify subtracts the training mean image's per-channel")


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


def test_an_empty_image_is_one_error(digits_run):
    with pytest.raises(CnnkitError, match=r"an empty image \(0 x 8 pixels\)"):
        Classifier.load(digits_run).predict(np.zeros((0, 8), np.uint8))


def test_eval_data_odd_cases_are_clear(digits_run, tmp_path, capsys, monkeypatch):
    """A packed set at another size than the network's images is refused (it would be cropped,
    not resized); a directory named `packed` is that directory; --tencrop on images stored at
    the input size names the network as the reason."""
    from cnnkit.data.pack import pack_folder
    from cnnkit.data.synth import synth_shapes
    from cnnkit.train.eval_data import check_pack_fits
    from cnnkit.train.evaluation import evaluate_checkpoint

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
    from cnnkit.train.eval_data import eval_data
    from cnnkit.train.evaluation import luma

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


def test_eval_says_which_epochs_weights_it_scored(digits_run, capsys):
    """A run is scored from best.pt, chosen on the held-out split it is scored on: the line
    says so, and which epoch (the run's own last line gives the last epoch's figure)."""
    from cnnkit.checkpoint import load_checkpoint

    best, last = (load_checkpoint(digits_run / name)["epoch"] for name in ("best.pt", "last.pt"))
    code, out, _ = run_cli(["eval", str(digits_run)], capsys)
    assert code == 0
    assert out.startswith(f"{digits_run / 'best.pt'} (epoch {best}, the best held-out top-1): ")
    code, out, _ = run_cli(["eval", str(digits_run / "last.pt"), "--json"], capsys)
    assert code == 0 and json.loads(out)["epoch"] == last and json.loads(out)["step"] == 0


def test_eval_of_a_mid_epoch_checkpoint_says_how_far_into_its_epoch(digits_run, tmp_path, capsys):
    """A last.pt saved 5 steps into epoch 2 was labelled '(epoch 1)', the epochs it had done."""
    from cnnkit.checkpoint import load_checkpoint, save_checkpoint

    state = load_checkpoint(digits_run / "last.pt")
    save_checkpoint({**state, "epoch": 1, "step": 5}, tmp_path / "last.pt")
    code, out, _ = run_cli(["eval", str(tmp_path / "last.pt")], capsys)
    assert code == 0 and out.startswith(f"{tmp_path / 'last.pt'} (epoch 2, 5 steps of it done): ")


def test_probabilities_and_the_constructor_refuse_what_they_do_not_take(digits_run):
    """Classifier.probabilities took 0-1 floats (confident, wrong), crops of another size, and
    raised torch's broadcast error for a (B, C, H, W) batch; Classifier("runs/d") raised an
    AttributeError. Each is one line saying what is taken."""
    from cnnkit.errors import ConfigError

    classifier = Classifier.load(digits_run)
    c, s = classifier.preprocess.channels, classifier.preprocess.crop
    good = torch.randint(0, 256, (2, 1, c, s, s), dtype=torch.uint8)
    assert classifier.probabilities(good).shape == (2, 10)
    for bad in (good.float() / 255, good[:, 0], good[..., :-1, :-1], good.numpy()):
        with pytest.raises(
            ConfigError, match=rf"^probabilities: uint8 crops \(B, N, {c}, {s}, {s}\)"
        ):
            classifier.probabilities(bad)
    with pytest.raises(ConfigError, match=r"Classifier.load\(PATH\) loads a run"):
        Classifier(str(digits_run))


def test_a_run_checkpoint_as_a_network_files_weights_keeps_the_runs_preprocessing(
    digits_run, digit_pngs, tmp_path, capsys
):
    """`weights: RUN/best.pt` beside its network took the network's default scaling and class
    names (class0...): other figures than the run's, exit 0; now the checkpoint's records are
    read as an export's are, and a damaged one is refused by its checksums."""
    from cnnkit.infer.load import load_for_inference

    wrapped = tmp_path / "net.yaml"
    wrapped.write_text(f"network: digitnet\nweights: {digits_run / 'best.pt'}\n")
    run, net = load_for_inference(digits_run), load_for_inference(wrapped)
    assert net.trained and net.classes == run.classes and net.preprocess == run.preprocess
    paths, _ = digit_pngs
    got = Classifier(net).predict(paths[:8], top=2)
    expected = Classifier(run).predict(paths[:8], top=2)
    assert [p.labels for p in got] == [p.labels for p in expected]
    damaged = bytearray((digits_run / "best.pt").read_bytes())
    start = damaged.index(b"archive/data/0") + 200  # inside the first tensor's record
    damaged[start : start + 64] = bytes(b ^ 0xFF for b in damaged[start : start + 64])
    (tmp_path / "flipped.pt").write_bytes(damaged)
    for target, what in ((tmp_path / "flipped.pt", "checkpoint"), (wrapped, "weights file")):
        if target == wrapped:
            wrapped.write_text(f"network: digitnet\nweights: {tmp_path / 'flipped.pt'}\n")
        code, out, err = run_cli(["classify", str(target), str(paths[0])], capsys)
        assert code == 1 and not out and f"a damaged {what}: its record " in err, err
        assert "fails its checksum" in err and len(err.splitlines()) == 1


def test_an_export_of_fresh_weights_is_refused_through_a_network_file_too(
    digits_run, digit_pngs, tmp_path, capsys
):
    """An export of untrained weights is refused by classify; named as a network file's
    weights: it went through, scoring noise."""
    code, _, _ = run_cli(["export", "digitnet", "--num-classes", "10", "-o",
                          str(tmp_path / "fresh.safetensors")], capsys)  # fmt: skip
    assert code == 0
    (tmp_path / "net.yaml").write_text("network: digitnet\nweights: fresh.safetensors\n")
    code, out, err = run_cli(["classify", str(tmp_path / "net.yaml"), str(digit_pngs[0][0])],
                             capsys)  # fmt: skip
    assert code == 2 and not out
    assert "fresh.safetensors: the export of a network without trained weights" in err


def test_a_checkpoint_or_export_named_otherwise_is_read_by_its_contents(
    digits_run, digit_pngs, tmp_path
):
    """m.PT, model.ckpt or M.SAFETENSORS were taken for network files ('not a text file')."""
    import shutil

    from cnnkit.infer.load import load_for_inference, save_safetensors

    run = load_for_inference(digits_run)
    save_safetensors(run, tmp_path / "m.safetensors")
    shutil.copy(digits_run / "best.pt", tmp_path / "m.PT")
    shutil.copy(digits_run / "best.pt", tmp_path / "model.ckpt")
    shutil.copy(tmp_path / "m.safetensors", tmp_path / "M.SAFETENSORS")
    shutil.copy(tmp_path / "m.safetensors", tmp_path / "weights")
    expected = Classifier(run).predict(digit_pngs[0][:4])
    for name in ("m.PT", "model.ckpt", "M.SAFETENSORS", "weights"):
        loaded = load_for_inference(tmp_path / name)
        assert loaded.trained and loaded.classes == run.classes, name
        got = Classifier(loaded).predict(digit_pngs[0][:4])
        assert [p.labels for p in got] == [p.labels for p in expected], name


def test_eval_data_naming_the_runs_own_bundled_set_scores_its_own_split(tmp_path, capsys,
                                                                       monkeypatch):  # fmt: skip
    """--data digits for a run trained on digits with another split scored the default split,
    most of which the run trained on; it scores the run's own held-out split now."""
    from helpers import cli_ok

    run = tmp_path / "seeded"
    cli_ok(["train", "digits", "--out", str(run), "train.epochs=1", "data.split_seed=1",
            "data.val_fraction=0.1", "--quiet"])  # fmt: skip
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)  # (no ./digits here)
    code, own, _ = run_cli(["eval", str(run), "--json"], capsys)
    code2, named, err = run_cli(["eval", str(run), "--data", "digits", "--json"], capsys)
    assert code == code2 == 0 and "--data digits: the run's own data set" in err
    own, named = json.loads(own[own.index("{") :]), json.loads(named[named.index("{") :])
    assert named["images"] == own["images"] == 180 and named["top1"] == own["top1"]


def test_loading_leaves_the_callers_generator_and_a_stack_of_grey_images_is_refused(
    digits_run, tmp_path
):
    """Classifier.load of a run advanced the caller's torch generator (a network built with
    fresh weights, then replaced) where a network file's did not; predict(X[:3]) on a grey
    network read three digits as one (C, H, W) colour image, one answer; build_model's
    device='gpu' was torch's own RuntimeError."""
    from cnnkit import ConfigError, build_model
    from cnnkit.infer.load import load_for_inference, save_safetensors

    save_safetensors(load_for_inference(digits_run), tmp_path / "m.safetensors")
    for target in (digits_run, digits_run / "best.pt", tmp_path / "m.safetensors"):
        torch.manual_seed(0)
        expected = torch.rand(3)
        torch.manual_seed(0)
        clf = Classifier.load(target)
        assert torch.equal(torch.rand(3), expected), target
    stack, _ = held_out_digits(4)
    with pytest.raises(ConfigError, match=r"a \(3, 8, 8\) array for a 1-channel network: one "
                                          r"colour image \(C, H, W\) or 3 grey images\?"):  # fmt: skip
        clf.predict(stack[:3])
    assert len(clf.predict(list(stack[:3]))) == 3 and clf.predict(stack[0]).label
    with pytest.raises(ConfigError, match=r"device: 'gpu' is not a device"):
        build_model("digitnet", device="gpu")


def test_eval_data_naming_the_runs_own_folder_or_pack_says_it_holds_training_images(
    shapes, tmp_path, capsys
):
    """--data DIR, the run's own data.path (a folder or its pack), scores every image in it,
    most of them trained on, as 'the best held-out top-1', without a word; a note says so."""
    from helpers import cli_ok

    from cnnkit.data.pack import pack_folder

    pack_folder(shapes, tmp_path / "pk", size=32, workers=1, progress=False)
    for path in (shapes, tmp_path / "pk"):
        run = tmp_path / f"run-{path.name}"
        size = [] if path.name == "pk" else ["data.size=32"]  # (a pack's: packed at 32)
        cli_ok(["train", "lenet5", f"data.path={path}", "model.input=[3,32,32]", *size,
                "data.crop=32", "data.batch_size=4", "data.val_fraction=0.2", "train.epochs=1",
                "data.workers=0", "--out", str(run), "--quiet"])  # fmt: skip
        capsys.readouterr()
        code, out, err = run_cli(["eval", str(run), "--data", str(path), "--json"], capsys)
        assert code == 0 and json.loads(out[out.index("{") :])["images"] == 15
        assert "the run's own data.path, every image in it scored, the ones it trained on " in err
