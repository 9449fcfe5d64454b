"""What `cnnkit eval --data` scores: a folder or packed set whole, a source name or a data
YAML on its held-out split; and what it says where that differs from what the user meant."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from helpers import one_error_line, run_cli
from PIL import Image


@pytest.fixture
def untrained(tmp_path, monkeypatch, capsys) -> str:
    """An export of digitnet with weights of its own, fresh ones from a weights file (classes
    class0..class9, grey 8x8), made in the test's own directory, the current one; a folder
    `sm` of 2 classes x 10 images beside it."""
    import torch

    from cnnkit import build_model

    monkeypatch.chdir(tmp_path)
    torch.save(build_model("digitnet").state_dict(), "w.pt")
    (tmp_path / "n.yaml").write_text("model: {network: digitnet, weights: w.pt}\n")
    assert run_cli(["export", "n.yaml", "-o", "n.safetensors"], capsys)[0] == 0
    for k in range(2):
        (tmp_path / "sm" / f"class{k}").mkdir(parents=True)
        for i in range(10):
            pixels = np.full((8, 8, 3), 10 * i + 100 * k, np.uint8)
            Image.fromarray(pixels).save(tmp_path / "sm" / f"class{k}" / f"{i}.png")
    return "n.safetensors"


def test_a_data_yaml_is_scored_on_its_held_out_split(untrained, tmp_path, capsys):
    """The folder itself: every image; a YAML naming it: the val_fraction share, as a run
    draws it; with val_fraction 0 and no val_path the error says what to give instead."""
    (tmp_path / "dy.yaml").write_text("source: folder\npath: sm\n")
    (tmp_path / "dy0.yaml").write_text("source: folder\npath: sm\nval_fraction: 0\n")
    (tmp_path / "dyp.yaml").write_text("path: sm\n")  # no source: what the path holds
    scored = {}
    for data in ("sm", "dy.yaml", "dyp.yaml"):
        code, out, err = run_cli(["eval", untrained, "--data", data, "--json"], capsys)
        assert code == 0, err
        scored[data] = json.loads(out)["images"]
    assert scored == {"sm": 20, "dy.yaml": 2, "dyp.yaml": 2}
    code, _, err = run_cli(["eval", untrained, "--data", "dy0.yaml"], capsys)
    line = one_error_line(code, err)
    assert "give the folder itself (--data sm) to score every image" in line
    assert "give --data)" not in line  # --data was given
    code, out, _ = run_cli(["eval", "--help"], capsys)
    said = re.sub(r"[\s│]+", " ", out)
    assert "(every image in it is scored)" in said and "a data YAML (its held-out split" in said
    (tmp_path / "dyt.yaml").write_text("path: sm\nval_fracton: 0.5\n")  # as train says it
    code, _, err = run_cli(["eval", untrained, "--data", "dyt.yaml"], capsys)
    assert one_error_line(code, err) == (
        "cnnkit: error: data.val_fracton: unknown field (did you mean 'val_fraction'?)"
    )


def test_a_folder_named_as_a_bundled_set_is_read_as_a_folder(untrained, tmp_path, capsys):
    """`--data digits` with a folder ./digits here: the folder, as a path given to torchvision's
    ImageFolder is read (and as `--data packed` reads ./packed), with a note naming the set."""
    (tmp_path / "sm").rename(tmp_path / "digits")
    code, out, err = run_cli(["eval", untrained, "--data", "digits", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["images"] == 20  # the folder's, not the bundled set's 359
    assert "cnnkit: note: --data digits: the folder ./digits, not the bundled digits set" in err


def test_a_network_file_with_weights_is_scored_as_its_export(untrained, tmp_path, capsys):
    """`eval NET.yaml --data D` (torchvision's published weights, a Caffe import): the figures
    of its export. It names no classes: classes given by index are its outputs, as Caffe's
    val.txt gives them; named ones are taken in sorted order, as torchvision's ImageFolder
    numbers them, when the data holds as many as it has outputs, else one line."""

    def scored(target: str, data: str) -> tuple[dict, str]:
        code, out, err = run_cli(["eval", target, "--data", data, "--json"], capsys)
        assert code == 0, err
        return {k: v for k, v in json.loads(out).items() if k in ("loss", "top1", "images")}, err

    assert scored("n.yaml", "sm")[0] == scored(untrained, "sm")[0]
    for k in range(2):
        (tmp_path / "sm" / f"class{k}").rename(tmp_path / "sm" / str(k))  # by index
    assert scored("n.yaml", "sm") == (scored(untrained, "sm")[0], "")
    for k in range(2):
        (tmp_path / "sm" / str(k)).rename(tmp_path / "sm" / f"x{k}")
    code, _, err = run_cli(["eval", "n.yaml", "--data", "sm"], capsys)
    assert one_error_line(code, err) == (
        "cnnkit: error: --data sm: 2 classes, and the network names none of its 10 outputs: to "
        "be taken in order, as torchvision's ImageFolder numbers them, the data must hold every "
        "class"
    )
    for k in range(2, 10):  # as many classes as outputs: x0..x9 are outputs 0..9
        (tmp_path / "sm" / f"x{k}").mkdir()
        shutil.copy(tmp_path / "sm" / "x1" / "0.png", tmp_path / "sm" / f"x{k}" / "0.png")
    in_order, err = scored("n.yaml", "sm")
    assert err == (
        "cnnkit: note: --data sm: the network names no classes: the data's 10 classes, in "
        "sorted order, are its outputs 0-9, as torchvision's ImageFolder numbers them\n"
    )
    for k in range(10):
        (tmp_path / "sm" / f"x{k}").rename(tmp_path / "sm" / f"class{k}")
    assert in_order == scored(untrained, "sm")[0]


def test_a_network_files_classes_name_its_outputs(untrained, tmp_path, capsys):
    """`classes:` (a list, or a file of one name per line beside the network file) names the
    outputs for classify, eval (matched by name) and the export; a count that does not fit, a
    missing file, and a run file that trains with them are one line each."""
    names = [f"digit {k}" for k in range(10)]
    (tmp_path / "nets").mkdir()
    (tmp_path / "nets" / "names.txt").write_text("\n".join(names) + "\n\n")  # blank: skipped
    (tmp_path / "nets" / "n.yaml").write_text(
        f"model: {{network: digitnet, weights: {tmp_path / 'w.pt'}, classes: names.txt}}\n"
    )
    code, out, err = run_cli(["classify", "nets/n.yaml", "sm/class1/3.png", "--json"], capsys)
    assert code == 0 and {t["class"] for t in json.loads(out)["top"]} <= set(names), err
    for k in range(2):
        (tmp_path / "sm" / f"class{k}").rename(tmp_path / "sm" / f"digit {k}")
    code, out, err = run_cli(["eval", "nets/n.yaml", "--data", "sm", "--json"], capsys)
    assert code == 0 and err == "", err
    for k in range(2):
        (tmp_path / "sm" / f"digit {k}").rename(tmp_path / "sm" / f"class{k}")
    code, expected, _ = run_cli(["eval", untrained, "--data", "sm", "--json"], capsys)
    assert json.loads(out)["top1"] == json.loads(expected)["top1"]
    assert run_cli(["export", "nets/n.yaml", "-o", "named.safetensors"], capsys)[0] == 0
    code, out, _ = run_cli(["classify", "named.safetensors", "sm/class1/3.png", "--json"], capsys)
    assert {t["class"] for t in json.loads(out)["top"]} <= set(names)
    for given, said in (("[a, b]", "classes: 2 names for the network's 10 outputs"),
                        ("none.txt", "classes: none.txt: No such file or directory"),
                        ("[a, ' ', c]", "model.classes: name 2 of 3 is blank: each output's "
                                        "name is text on one line"),
                        ('[a, "b\\nc"]', "model.classes: name 2 of 2 holds a line break: each "
                                         "output's name is text on one line")):  # fmt: skip
        (tmp_path / "bad.yaml").write_text(
            f"model: {{network: digitnet, weights: w.pt, classes: {given}}}\n"
        )
        code, _, err = run_cli(["classify", "bad.yaml", "sm/class1/3.png"], capsys)
        assert one_error_line(code, err) == f"cnnkit: error: bad.yaml: {said}"
    (tmp_path / "digits.yaml").write_text(  # whole numbers: names as written
        f"model: {{network: digitnet, weights: w.pt, classes: {list(range(10))}}}\n"
    )
    code, out, err = run_cli(["classify", "digits.yaml", "sm/class1/3.png", "--json"], capsys)
    assert code == 0 and {t["class"] for t in json.loads(out)["top"]} <= set("0123456789"), err
    (tmp_path / "run.yaml").write_text(
        "model: {network: digitnet, classes: [a, b]}\ndata: {source: digits}\n"
    )
    code, _, err = run_cli(["train", "run.yaml", "--dry-run"], capsys)
    assert (
        "model: classes names a network's outputs for classify, eval and export; training "
        "takes the data's classes" in one_error_line(code, err)
    )
