"""A `normalize: mean_image` run (the 2012 recipe's) keeps its mean image: classify, eval on a
folder and a safetensors export subtract the image itself, exactly as training did."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import cli_ok as main

from cnnkit.checkpoint import load_checkpoint, load_trained
from cnnkit.data.base import Preprocess
from cnnkit.infer import Classifier
from cnnkit.infer.images import resized
from cnnkit.train.evaluation import evaluate_checkpoint

NET = Path(__file__).parent / "data" / "tiny_alexnet.yaml"


@pytest.fixture(scope="module")
def mean_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mean_image")
    main(["synth", "shapes", str(root / "shapes"), "--classes", "3", "--per-class", "6",
          "--size", "24"])  # fmt: skip
    main(["pack", str(root / "shapes"), str(root / "packed"), "--size", "24", "--workers", "1"])
    run = {"name": "mean", "model": str(NET),
           "data": {"source": "packed", "path": str(root / "packed"), "normalize": "mean_image",
                    "batch_size": 6, "crop": 20, "workers": 0, "val_fraction": 0.34},
           "train": {"epochs": 2, "optimizer": "adam", "lr": 0.003, "weight_decay": 0.0,
                     "device": "cpu", "precision": "fp32"}}  # fmt: skip
    (root / "run.yaml").write_text(json.dumps(run))
    main(["train", str(root / "run.yaml"), "--out", str(root / "run"), "--quiet"])
    return root


def by_hand(network: torch.nn.Module, image: Path, pre: Preprocess, mean: torch.Tensor):
    """The run's evaluation, written out: resize, subtract the mean image, centre crop."""
    x = resized(str(image), pre).float() - mean
    top = (x.shape[-1] - pre.crop) // 2
    x = x[:, top : top + pre.crop, top : top + pre.crop]
    with torch.no_grad():
        return network(x[None]).softmax(1)[0]


def test_detect_says_it_subtracts_the_mean_images_averages(mean_run, capsys):
    """A sliding window has no place in the mean image: detect subtracts its per-channel
    averages, and says so (classify, which crops as training did, subtracts the image)."""
    from helpers import run_cli

    image = sorted((mean_run / "shapes").rglob("*.JPEG"))[0]
    label = image.parent.name
    code, _, err = run_cli(["detect", str(mean_run / "run"), str(image), "--class", label,
                            "--threshold", "0", "--min-size", "20"], capsys)  # fmt: skip
    assert code == 0, err
    assert "detect subtracts the training mean image's per-channel averages" in err
    assert "(each window of a picture)" in err


def test_the_checkpoint_keeps_the_packs_mean_image(mean_run):
    state = load_checkpoint(mean_run / "run" / "best.pt")
    expected = torch.from_numpy(np.load(mean_run / "packed" / "mean.npy"))
    torch.testing.assert_close(state["mean_image"], expected)
    assert expected.std() > 1  # a real image, not a flat colour: the averages would differ


def test_classify_subtracts_the_mean_image(mean_run, capsys):
    network, meta = load_trained(mean_run / "run")
    pre = Preprocess.from_dict(meta["preprocess"])
    classifier = Classifier.load(mean_run / "run")
    assert capsys.readouterr().err == ""  # nothing approximated: no note
    image = sorted((mean_run / "shapes").rglob("*.JPEG"))[0]
    expected = by_hand(network, image, pre, meta["mean_image"])
    got = classifier.predict(str(image), top=3)
    assert got.probs == pytest.approx(expected.topk(3).values.tolist(), abs=1e-5)
    averaged = by_hand(network, image, pre, meta["mean_image"].mean(dim=(1, 2), keepdim=True))
    assert (averaged - expected).abs().max() > 1e-4  # the test tells the two apart


def test_ten_crops_subtract_the_mean_image_at_each_crop(mean_run):
    from cnnkit.data.augment import ten_crop

    network, meta = load_trained(mean_run / "run")
    pre = Preprocess.from_dict(meta["preprocess"])
    image = sorted((mean_run / "shapes").rglob("*.JPEG"))[1]
    x = resized(str(image), pre).float() - meta["mean_image"]
    with torch.no_grad():
        expected = network(ten_crop(x[None], pre.crop)[0]).softmax(1).mean(0)
    got = Classifier.load(mean_run / "run").predict(str(image), top=3, tencrop=True)
    assert got.probs == pytest.approx(expected.topk(3).values.tolist(), abs=1e-5)


def test_eval_on_the_folder_equals_eval_on_the_pack(mean_run, capsys):
    folder = evaluate_checkpoint(mean_run / "run", data=str(mean_run / "shapes"))
    packed = evaluate_checkpoint(mean_run / "run", data=str(mean_run / "packed"))
    assert folder["images"] == packed["images"] == 18
    assert folder["loss"] == pytest.approx(packed["loss"], rel=1e-5)
    assert folder["top1"] == packed["top1"]
    assert capsys.readouterr().err.count("mean image") == 0


def test_a_safetensors_export_keeps_the_mean_image(mean_run, tmp_path, capsys):
    main(["export", str(mean_run / "run"), "-o", str(tmp_path / "m.safetensors")])
    image = str(sorted((mean_run / "shapes").rglob("*.JPEG"))[2])
    exported = Classifier.load(tmp_path / "m.safetensors").predict(image, top=3)
    original = Classifier.load(mean_run / "run").predict(image, top=3)
    assert exported.probs == pytest.approx(original.probs, abs=1e-6)
    assert exported.labels == original.labels
    capsys.readouterr()
    main(["export", str(mean_run / "run"), "-o", str(tmp_path / "m.pt2")])
    assert "the torch-export file records only its per-channel averages" in capsys.readouterr().err
    main(["export", str(mean_run / "run"), "-o", str(tmp_path / "m.onnx")])
    err = capsys.readouterr().err  # a note, as every note is said
    assert err.startswith("cnnkit: note: the network subtracts a mean image; the onnx file "
                          "records only its per-channel averages"), err  # fmt: skip


def test_eval_says_how_other_data_is_normalised(mean_run, tmp_path, capsys):
    """A bundled source is normalised by its own statistics (the note said the checkpoint
    lacked the image, which it holds); a folder read at another size than the mean image is
    normalised by its averages, and the note says why."""
    from helpers import run_cli

    run = str(mean_run / "run")
    _, _, err = run_cli(["eval", run, "--data", "synthetic"], capsys)  # (its classes differ)
    assert ("cnnkit: note: --data synthetic: a bundled source, normalised by its own mean and "
            "std, not by the run's mean image") in err  # fmt: skip
    assert "does not hold it" not in err
    (tmp_path / "at28.yaml").write_text(f"source: folder\npath: {mean_run / 'shapes'}\nsize: 28\n")
    code, _, err = run_cli(["eval", run, "--data", str(tmp_path / "at28.yaml")], capsys)
    assert code == 0, err
    assert (
        "cnnkit: note: --data" in err and "(it is 24 px, these images are stored at 28 px)" in err
    )
