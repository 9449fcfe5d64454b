"""The odd-image corpus (tests/data_images.write_corpus: 30+ odd entries beside good images under
odd names) through decoding, `cnnkit pack`, `cnnkit classify` and `cnnkit detect`, in process:
every converted image has numpy's expected pixels, every refusal is one `cnnkit: error:` line
(or one report line) with no traceback and no hang, nothing is written unless the command
succeeds, and every good input beside them is processed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from data_images import snapshot, within, write_corpus
from helpers import run_cli
from PIL import Image

from cnnkit.data import decode
from cnnkit.data.batch import BatchJob
from cnnkit.data.decode import BadImage, read_image
from cnnkit.data.packed import PackedImages
from cnnkit.data.resize import resize_uint8
from cnnkit.data.scan import printable
from cnnkit.infer.images import to_hwc

LONGEST_ERROR = 300  # characters of the one error line


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return root, write_corpus(root)


def test_the_corpus_is_what_the_issue_asks_for(corpus):
    _, cases = corpus
    odd = [c for c in cases if c.status != "good"]
    assert len(odd) >= 25
    names = {c.rel.split("/")[1] for c in cases}
    assert {"bomb.jpg", "grey16.png", "float01.tif", "loop", "fifo.jpg", "anim.gif"} <= names


@pytest.mark.parametrize("backend", ["turbo", "pillow"])
def test_each_image_decodes_to_numpys_pixels_or_is_refused(corpus, backend, monkeypatch):
    root, cases = corpus
    if backend == "pillow":
        monkeypatch.setattr(decode, "simplejpeg", None)
    for case in cases:
        if case.status in ("good", "converted"):
            with within(10):
                array, note = read_image(root / case.rel)
            np.testing.assert_array_equal(array, case.expect, err_msg=case.rel)
            assert note == case.note or (case.status == "good" and note is None), case.rel
        elif case.status == "skipped":
            with within(10), pytest.raises(BadImage) as error:
                read_image(root / case.rel)
            assert case.expect in str(error.value), (case.rel, str(error.value))


def test_pil_images_are_scaled_like_files(corpus):
    root, cases = corpus
    for case in cases:
        if case.status == "converted" and case.rel.endswith((".png", ".tif", ".pgm")):
            from_pil = to_hwc(Image.open(root / case.rel))
            np.testing.assert_array_equal(from_pil[..., 0], case.expect[..., 0], err_msg=case.rel)


def test_pack_takes_every_good_image_once_and_lists_the_rest(corpus, tmp_path, capsys):
    root, cases = corpus
    before = snapshot(root)
    with within(60):
        code, out, err = run_cli(["pack", str(root), str(tmp_path / "p"), "--size", "16"], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert snapshot(root) == before
    taken = [c for c in cases if c.status in ("good", "converted")]
    assert f"packed {len(taken)} images of 2 classes" in out
    files = (tmp_path / "p/files.txt").read_text().splitlines()
    assert sorted(files) == sorted(printable(c.rel) for c in taken)  # each once: no link copies
    rows = [line.split("\t") for line in (tmp_path / "p/bad_images.tsv").read_text().splitlines()]
    assert rows[0] == ["path", "status", "reason"] and all(len(r) == 3 for r in rows)
    report = {path: (status, reason) for path, status, reason in rows[1:]}
    for case in cases:
        if case.status == "good":
            assert case.rel not in report
        elif case.status == "converted":
            assert report[case.rel] == ("converted", case.note)
        else:
            status, reason = report[case.rel]
            # with --size 16 the 60000x60000 JPEG decodes at 1/8 scale, within the limit: then
            # its made-up data ends
            words = "truncated JPEG" if case.rel == "odd/bomb.jpg" else case.expect
            assert status == "skipped" and words in reason, (case.rel, reason)
    assert len(report) == len(cases) - sum(c.status == "good" for c in cases)
    packed = PackedImages(tmp_path / "p")
    pixels = packed[BatchJob(list(range(len(files))))].pixels
    expected = {printable(c.rel): c.expect for c in taken}
    for i, rel in enumerate(files):  # the stored pixels are numpy's, resized once
        torch.testing.assert_close(pixels[i], resize_uint8(expected[rel], 16), rtol=0, atol=0)


def test_classify_each_file_by_name(corpus, digits_run, capsys):
    root, cases = corpus
    before = snapshot(root)
    for case in cases:
        if case.rel.endswith("loop"):
            continue  # a folder: scanned, see the folder test
        with within(20):
            code, out, err = run_cli(["classify", str(digits_run), str(root / case.rel)], capsys)
        assert "Traceback" not in err, err
        if case.named is None:
            assert code == 0 and len(out.splitlines()) == 1 and not err, (case.rel, err)
        else:
            (line,) = err.splitlines()
            assert code == 1 and not out, case.rel
            # read as a folder is (at the network's 8 px): the bomb decodes at 1/8, then ends
            named = "truncated JPEG" if case.rel == "odd/bomb.jpg" else case.named
            assert line.startswith("cnnkit: error: ") and named in line, (case.rel, line)
            assert len(line) <= LONGEST_ERROR + len(str(root)), line
    assert snapshot(root) == before


def test_classify_the_corpus_folder(corpus, digits_run, capsys):
    root, cases = corpus
    with within(60):
        code, out, err = run_cli(["classify", str(digits_run), str(root), "--json"], capsys)
    rows = [json.loads(line) for line in out.splitlines()]
    classified = {r["image"] for r in rows if "error" not in r}
    failed = {r["image"] for r in rows if "error" in r}
    assert code == 1 and "Traceback" not in err  # the refused images are failures
    assert classified == {printable(str(root / c.rel)) for c in cases
                          if c.status in ("good", "converted")}  # fmt: skip
    assert failed == {printable(str(root / c.rel)) for c in cases if c.status == "skipped"}
    skipped = [line for line in err.splitlines() if line.startswith("cnnkit: skipped ")]
    assert len(skipped) == sum(c.status == "scan" for c in cases) == len(err.splitlines())


def test_detect_refuses_the_bomb_before_allocating(corpus, digits_run, capsys):
    root, _ = corpus
    with within(20):
        code, out, err = run_cli(["detect", str(digits_run), str(root / "odd/bomb.jpg")], capsys)
    (line,) = err.splitlines()
    assert code == 1 and not out and line.startswith("cnnkit: error: ") and "huge image" in line


def test_jpeg_limit_is_on_the_decoded_size(tmp_path, monkeypatch):
    from data_images import jpeg_bytes, photo

    path = tmp_path / "a.jpg"
    path.write_bytes(jpeg_bytes(photo(480, 640)))
    monkeypatch.setattr(decode, "MAX_PIXELS", 480 * 640 - 1)
    with pytest.raises(BadImage, match="huge image"):  # whole: one pixel too many
        read_image(path)
    assert read_image(path, 60)[0].shape == (120, 160, 3)  # DCT-scaled 1/4: allowed
    monkeypatch.setattr(decode, "MAX_PIXELS", 120 * 160 - 1)
    with pytest.raises(BadImage, match="huge image"):  # the scaled size is checked too
        read_image(path, 60)
    monkeypatch.setattr(decode, "MAX_PIXELS", 480 * 640)
    assert read_image(path)[0].shape == (480, 640, 3)  # exactly the limit is allowed


def test_fifo_in_a_folder_is_never_opened(tmp_path, monkeypatch):
    """A FIFO is refused from its type: reading it would block until a writer comes."""
    from cnnkit.data.scan import scan_images

    (tmp_path / "a").mkdir()
    os.mkfifo(tmp_path / "a/fifo.jpg")
    Image.new("RGB", (8, 8)).save(tmp_path / "a/real.png")
    opened = []
    real_open = os.open
    monkeypatch.setattr(
        os, "open", lambda p, *a, **k: (opened.append(str(p)), real_open(p, *a, **k))[1]
    )
    with within(10):
        scan = scan_images(tmp_path)
        with pytest.raises(BadImage, match="FIFO"):
            read_image(tmp_path / "a/fifo.jpg")
    assert scan.files == [os.path.join("a", "real.png")]
    assert ("a/fifo.jpg", "not a regular file (a FIFO)") in scan.skipped
    assert not any(p.endswith("fifo.jpg") for p in opened)


def test_eval_counts_the_images_it_evaluated(tmp_path, capsys):
    """Unreadable images are skipped (and named) by the loader: the count leaves them out."""
    from helpers import cli_ok

    from cnnkit.train.evaluation import evaluate_checkpoint

    cli_ok(["synth", "shapes", str(tmp_path / "train"), "--classes", "3", "--per-class", "4",
            "--size", "24"])  # fmt: skip
    run = {"name": "t", "model": str(Path(__file__).parent / "data" / "tiny_alexnet.yaml"),
           "data": {"source": "folder", "path": str(tmp_path / "train"), "size": 24,
                    "crop": 20, "batch_size": 6, "workers": 0, "val_fraction": 0.25},
           "train": {"epochs": 1, "device": "cpu", "precision": "fp32"}}  # fmt: skip
    (tmp_path / "run.yaml").write_text(json.dumps(run))
    cli_ok(["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run"), "--quiet"])
    clean = evaluate_checkpoint(tmp_path / "run", str(tmp_path / "train"), device="cpu")
    for folder in (tmp_path / "train").iterdir():
        (folder / "broken.JPEG").write_bytes(b"\xff\xd8\xff not a JPEG")
    (folder / "notes.txt").write_text("not an image")
    capsys.readouterr()
    result = evaluate_checkpoint(tmp_path / "run", str(tmp_path / "train"), device="cpu")
    err = capsys.readouterr().err
    assert (clean["images"], clean["skipped"]) == (12, 0)
    assert (result["images"], result["skipped"]) == (12, 3)
    assert result["top1"] == clean["top1"] and result["loss"] == pytest.approx(clean["loss"])
    assert err.count("broken.JPEG") == 3 and "notes.txt: not a supported image type" in err
    ten = evaluate_checkpoint(tmp_path / "run", str(tmp_path / "train"), device="cpu",
                              tencrop=True)  # fmt: skip
    assert (ten["images"], ten["skipped"]) == (12, 3)


def test_folder_training_scans_like_pack(corpus, tmp_path, capfd):
    from cnnkit.data import data_config
    from cnnkit.errors import DataError

    root, cases = corpus
    section = {"source": "folder", "path": str(root), "size": 16, "crop": 12, "workers": 0,
               "batch_size": 64, "val_fraction": 0.0}  # fmt: skip
    with within(30):
        bundle = data_config(section).build(torch.device("cpu"))
        bundle.train.set_epoch(0)
        seen = sum(len(y) for _, y in bundle.train)
    err = capfd.readouterr().err
    assert seen == sum(c.status in ("good", "converted") for c in cases)
    assert all(f"{root / c.rel}: " in err for c in cases if c.status == "scan")
    (tmp_path / "src/a").mkdir(parents=True)
    (tmp_path / "src/b").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "src/a/x.png")
    with pytest.raises(DataError, match="src/b: class folder with no images"):
        data_config({**section, "path": str(tmp_path / "src")}).build(torch.device("cpu"))
