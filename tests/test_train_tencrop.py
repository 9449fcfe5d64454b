"""`cnnkit eval --tencrop`: 10-crop figures equal a hand-made reference (torchvision's TenCrop
over the stored images, softmax averaged), for a folder and its packed copy; clear refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF
import yaml
from helpers import cli_ok as main

from cnnkit.checkpoint import load_trained
from cnnkit.data.decode import load_resized
from cnnkit.errors import ConfigError, DataError
from cnnkit.train.evaluation import evaluate_checkpoint

NET = Path(__file__).parent / "data" / "tiny_alexnet.yaml"  # input 20x20; images stored 24x24


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 1-epoch tiny net on synth shapes (folder), a separate val folder and its packed copy."""
    tmp = tmp_path_factory.mktemp("tencrop")
    main(["synth", "shapes", str(tmp / "train"), "--classes", "6", "--per-class", "6",
          "--size", "24"])  # fmt: skip
    main(["synth", "shapes", str(tmp / "val"), "--classes", "6", "--per-class", "4",
          "--size", "24", "--seed", "7"])  # fmt: skip
    main(["pack", str(tmp / "val"), str(tmp / "val_packed"), "--size", "24"])
    run = {"name": "t", "model": str(NET), "seed": 3,
           "data": {"source": "folder", "path": str(tmp / "train"), "val_path": str(tmp / "val"),
                    "size": 24, "crop": 20, "batch_size": 12, "workers": 0},
           "train": {"epochs": 2, "optimizer": "adam", "lr": 0.003, "device": "cpu",
                     "precision": "fp32"}}  # fmt: skip
    (tmp / "run.yaml").write_text(json.dumps(run))
    main(["train", str(tmp / "run.yaml"), "--out", str(tmp / "run"), "--quiet"])
    return tmp


def reference(tmp: Path, folder: str = "val", count: int = 24) -> dict[str, dict[str, float]]:
    """By hand: every val image decoded as its source does (the folder pipeline and pack decode
    alike), normalised, torchvision's ten_crop, softmax averaged."""
    network, meta = load_trained(tmp / "run")
    pre, classes = meta["preprocess"], meta["classes"]
    mean, std = torch.tensor(pre["mean"]).view(3, 1, 1), torch.tensor(pre["std"]).view(3, 1, 1)
    rows = {"centre": [], "tencrop": []}
    paths = sorted((tmp / folder).rglob("*.JPEG"))
    assert len(paths) == count
    for path in paths:
        image = load_resized(path, 24, "squash")[0]  # (3, 24, 24) uint8: as stored
        x = (image.float() - mean) / std
        with torch.no_grad():
            logits = network(torch.stack(TF.ten_crop(x, [20, 20])))  # (10, K)
        y = classes.index(path.parent.name)
        rows["centre"].append((logits[4].log_softmax(0), y))
        rows["tencrop"].append((logits.softmax(1).mean(0).log(), y))
    return {name: _figures(r) for name, r in rows.items()}


def _figures(rows: list) -> dict[str, float]:
    loss = np.mean([-lp[y].item() for lp, y in rows])
    top1 = np.mean([lp.argmax().item() == y for lp, y in rows])
    top5 = np.mean([y in lp.topk(5).indices.tolist() for lp, y in rows])
    return {"loss": loss, "top1": top1, "top5": top5}


def test_tencrop_equals_torchvision_reference_folder_and_packed(trained, capsys):
    for data in (None, str(trained / "val_packed")):
        expected = reference(trained)
        assert expected["centre"] != expected["tencrop"]  # the 10 crops change the figures
        result = evaluate_checkpoint(trained / "run", data, device="cpu", tencrop=True)
        assert result["images"] == 24
        for name, got in (("centre", result), ("tencrop", result["tencrop"])):
            for key in ("loss", "top1", "top5"):
                assert got[key] == pytest.approx(expected[name][key], abs=1e-5), (data, name, key)
    plain = evaluate_checkpoint(trained / "run", device="cpu")  # the usual centre-crop stream
    expected = reference(trained)
    assert plain["top1"] == expected["centre"]["top1"]
    assert plain["loss"] == pytest.approx(expected["centre"]["loss"], abs=1e-5)
    main(["eval", str(trained / "run"), "--tencrop", "--json"])
    out = json.loads(capsys.readouterr().out)
    keys = {"loss", "top1", "top5"}
    assert keys <= out.keys() and keys <= out["tencrop"].keys()
    main(["eval", str(trained / "run"), "--tencrop"])
    text = capsys.readouterr().out
    assert "centre crop" in text and "10 crops" in text


def test_tencrop_refuses_data_without_margin(trained, digits_run, capsys):
    """A network trained at its input size (digits: no resize) has no margin in any data; one
    trained with a resize has none in a source stored at its input size."""
    with pytest.raises(ConfigError, match=r"trained on images of its input size \(8x8, no resize"):
        evaluate_checkpoint(digits_run, device="cpu", tencrop=True)
    with pytest.raises(SystemExit) as e:  # on the command line: one line, exit status 2
        main(["eval", str(digits_run), "--tencrop"])
    assert e.value.code == 2
    with pytest.raises(ConfigError, match=r"synthetic is read at 20x20 \(use a folder or packed"):
        evaluate_checkpoint(trained / "run", "synthetic", device="cpu", tencrop=True)


def test_eval_maps_the_data_classes_to_the_network_by_name(trained, tmp_path, capsys):
    """A set holding some of the classes (their sorted indices differ from training's) is
    scored against the right outputs; an empty class folder, even one the network never saw,
    is skipped and named on stderr (training refuses it); a class of images the network never
    saw is one clear error."""
    classes = sorted(p.name for p in (trained / "val").iterdir())
    part = tmp_path / "part"
    for name in (classes[3], classes[5]):  # indices 0 and 1 in the subset
        shutil.copytree(trained / "val" / name, part / name)
    shutil.copytree(part, trained / "part", dirs_exist_ok=True)
    expected = reference(trained, "part", 8)["centre"]
    got = evaluate_checkpoint(trained / "run", str(part), device="cpu")
    assert got["images"] == 8 and got["top1"] == expected["top1"]
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    capsys.readouterr()
    for empty in (classes[0], "Unseen"):
        (part / empty).mkdir()
    again = evaluate_checkpoint(trained / "run", str(part), device="cpu")
    assert (again["images"], again["top1"], again["loss"]) == (8, got["top1"], got["loss"])
    err = capsys.readouterr().err
    for empty in (classes[0], "Unseen"):
        assert f"skipped {part / empty}: class folder with no images (classes are matched" in err
    (part / classes[3]).rename(part / "Renamed")
    with pytest.raises(DataError, match="class 'Renamed' is not one the network was trained on"):
        evaluate_checkpoint(trained / "run", str(part), device="cpu")


def test_a_data_class_the_network_names_twice_is_refused_not_guessed():
    """ImageNet's published names hold 'crane' twice: by name, its images were scored against
    the last of the two outputs, silently. A `classes:` file name with a NUL is one line."""
    from cnnkit.infer.load import class_names
    from cnnkit.train.evaluation import class_map

    trained = ["bird", "crane", "dog", "crane"]
    assert class_map(["bird", "dog"], trained, "v").tolist() == [0, 2]
    with pytest.raises(DataError, match=r"^--data v: class 'crane' names 2 of the network's "
                       r"outputs \(1, 3\), so matching by name cannot say"):  # fmt: skip
        class_map(["bird", "crane"], trained, "v")
    with pytest.raises(ConfigError, match=r"^n.yaml: classes: .*: not a file name \(a NUL byte\)"):
        class_names("c\0.txt", 3, "n.yaml")


def test_a_data_yaml_is_evaluated_at_the_size_and_crop_the_network_trained_at(trained, tmp_path):
    """What a --data YAML leaves unsaid (size, crop, resize) is the checkpoint's, as for a
    directory; before, a folder was read at 256 / 227 and a 24 px pack refused."""
    as_dir = evaluate_checkpoint(trained / "run", str(trained / "val"), device="cpu")
    for section in ({"source": "folder", "path": str(trained / "val"),
                     "val_path": str(trained / "val")},
                    {"source": "packed", "path": str(trained / "val_packed"),
                     "val_path": str(trained / "val_packed")}):  # fmt: skip
        (tmp_path / "data.yaml").write_text(yaml.safe_dump({"data": section}))
        got = evaluate_checkpoint(trained / "run", str(tmp_path / "data.yaml"), device="cpu")
        assert got["images"] == as_dir["images"] and got["top1"] == as_dir["top1"]
        assert got["loss"] == pytest.approx(as_dir["loss"], abs=1e-3)
