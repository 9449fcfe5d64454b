"""A held-out set that is the training set in disguise (links, hard links, a pack of the same
folder), a data set's split folders taken for classes, and a pack whose skipped images were
fixed since: each refused, or mended by the same command."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from helpers import run_cli
from PIL import Image

from cnnkit.data import data_config
from cnnkit.data.pack import pack_folder
from cnnkit.errors import DataError


@pytest.fixture
def splits(tmp_path):
    """ds/train and ds/val, two classes each (distinct random images)."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("val", 2)):
        for c in ("cat", "dog"):
            (tmp_path / "ds" / split / c).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 255, (20, 20, 3), np.uint8)
                Image.fromarray(pixels).save(tmp_path / "ds" / split / c / f"{split}{i}.png")
    return tmp_path / "ds"


def _build(path, val_path, source="folder"):
    cfg = {"source": source, "path": str(path), "val_path": str(val_path), "crop": 16,
           "batch_size": 4, "workers": 0, **({"size": 16} if source == "folder" else {})}  # fmt: skip
    return data_config(cfg).build(torch.device("cpu"))


def test_a_held_out_folder_of_links_to_the_training_images_is_refused(splits, tmp_path):
    _build(splits / "train", splits / "val")  # distinct files: taken
    (tmp_path / "links").mkdir()
    for c in ("cat", "dog"):
        os.symlink(splits / "train" / c, tmp_path / "links" / c)
    shutil.copytree(splits / "train", tmp_path / "hard", copy_function=os.link)
    (tmp_path / "one/cat").mkdir(parents=True)
    (tmp_path / "one/dog").mkdir()
    shutil.copy(splits / "val/cat/val0.png", tmp_path / "one/cat")
    shutil.copy(splits / "val/dog/val0.png", tmp_path / "one/dog")
    os.symlink(splits / "train/dog/train3.png", tmp_path / "one/dog/leak.png")
    for val, shared in (("links", 12), ("hard", 12), ("one", 1)):
        with pytest.raises(DataError, match=rf"{val}: {shared} of its \d+ images are data.path's "
                                            r"own files .*must not be trained on"):  # fmt: skip
            _build(splits / "train", tmp_path / val)
    cfg = {"source": "folder", "path": str(splits / "train"), "val_path": str(tmp_path / "links"),
           "size": 16, "crop": 16, "batch_size": 4, "workers": 0}  # fmt: skip
    data_config(cfg).drawn_as(None).build(torch.device("cpu"))  # a run resumed or evaluated


def test_a_val_pack_of_the_training_folder_is_refused(splits, tmp_path):
    for name, src in (("p", "train"), ("same", "train"), ("v", "val")):
        pack_folder(splits / src, tmp_path / name, size=16, workers=1, progress=False)
    _build(tmp_path / "p", tmp_path / "v", "packed")
    with pytest.raises(DataError, match=r"same: packed from the training pack's own folder .* "
                                        r"12 of its 12 images"):  # fmt: skip
        _build(tmp_path / "p", tmp_path / "same", "packed")
    cfg = {"source": "packed", "path": str(tmp_path / "p"), "val_path": str(tmp_path / "same"),
           "crop": 16, "batch_size": 4, "workers": 0}  # fmt: skip
    data_config(cfg).drawn_as(None).build(torch.device("cpu"))  # a run resumed or evaluated


def test_a_pack_into_an_image_folder_is_refused_untouched(splits, capsys):
    before = sorted(p.name for p in (splits / "val").rglob("*"))
    code, _, err = run_cli(["pack", str(splits / "train"), str(splits / "val")], capsys)
    assert code == 2 and "holds images, and is not a pack" in err, err
    assert sorted(p.name for p in (splits / "val").rglob("*")) == before


def test_a_pack_into_a_data_sets_root_is_refused_before_the_scan(splits, capsys, monkeypatch):
    import cnnkit.data.pack as pack

    monkeypatch.setattr(pack, "scan_images", lambda *a, **k: pytest.fail("scanned first"))
    code, _, err = run_cli(["pack", str(splits / "train"), str(splits)], capsys)
    assert code == 2 and "holds images, and is not a pack" in err, err  # (train/cat/x.png)


def test_split_folders_are_not_taken_for_classes(splits, tmp_path, capsys):
    code, _, err = run_cli(["pack", str(splits), str(tmp_path / "p")], capsys)
    assert code == 1 and "train, val are a data set's splits, not classes" in err, err
    assert str(splits / "train") in err and not (tmp_path / "p").exists()
    with pytest.raises(DataError, match="splits, not classes"):
        data_config({"source": "folder", "path": str(splits)}).build(torch.device("cpu"))


def test_fixed_images_are_taken_by_the_same_pack_run_again(splits, tmp_path, capsys, monkeypatch):
    src = splits / "train"
    for f in (src / "dog").iterdir():
        f.write_bytes(b"not an image")  # every dog unreadable: the class is empty
    argv = ["pack", str(src), str(tmp_path / "p"), "--size", "16", "-j", "1"]
    code, out, err = run_cli(argv, capsys)
    assert code == 1 and "class 'dog' has no usable image" in err and "same cnnkit pack" in err
    assert (tmp_path / "p/meta.json").exists()
    import cnnkit.data.pack_dst as pack_dst

    decoded, reads = [], pack_dst._reads
    monkeypatch.setattr(
        pack_dst, "_reads", lambda path, job: decoded.append(path) or reads(path, job)
    )
    code, _, err = run_cli(argv, capsys)
    assert code == 1 and decoded == []  # unchanged since packed: not decoded again
    monkeypatch.undo()
    shutil.rmtree(src / "dog")
    shutil.copytree(splits / "val/dog", src / "dog", dirs_exist_ok=True)  # (other names: gone)
    code, _, err = run_cli(argv, capsys)
    assert code == 1 and "changed since" in err  # added and gone files: a new pack
    shutil.rmtree(src / "dog")
    (src / "dog").mkdir()
    rng = np.random.default_rng(1)
    for i in range(6):
        Image.fromarray(rng.integers(0, 255, (20, 20, 3), np.uint8)).save(src / f"dog/train{i}.png")
    code, out, err = run_cli(argv, capsys)
    assert code == 0 and "now reads: packed again" in err and "packed 12 images" in out, (out, err)
    code, out, err = run_cli(argv, capsys)
    assert code == 0 and out.startswith("already packed: 12 images") and not err
