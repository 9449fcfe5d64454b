"""A pack checked where it is read, made and made again: labels against its classes, DST in a
folder reached through a symlink, an unreadable class folder, a shard cut short after packing
or before a resume."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from data_images import all_images
from helpers import interrupt_pack_after, run_cli

from cnnkit.data import data_config
from cnnkit.data.pack import pack_folder
from cnnkit.data.packed import PackedImages
from cnnkit.data.scan import scan_images
from cnnkit.errors import ConfigError, DataError, Interrupted


def _edit_index(pack: Path, key: str, position: int, value: int) -> None:
    with np.load(pack / "index.npz") as z:
        index = {k: z[k] for k in z.files}
    index[key][position] = value
    np.savez(pack / "index.npz", **index)


def test_labels_outside_the_classes_are_one_line_and_a_rerun_mends_them(shapes, tmp_path,
                                                                         capsys):  # fmt: skip
    pack_folder(shapes, tmp_path / "p", size=16, shard_size=4, workers=1, progress=False)
    meta = json.loads((tmp_path / "p/meta.json").read_text())
    fewer = {**meta, "classes": meta["classes"][:2]}
    damaged = {
        "past the end": (lambda p: _edit_index(p, "labels", 2, 57), "image 2 has label 57"),
        "negative": (lambda p: _edit_index(p, "labels", 3, -1), "image 3 has label -1"),
        "classes cut": (lambda p: (p / "meta.json").write_text(json.dumps(fewer)),
                        "image 10 has label 2, not one of meta.json's 2 classes, 0 to 1"),
        "shard": (lambda p: _edit_index(p, "shard", 1, 9), "image 1 has shard 9"),
        "offset": (lambda p: _edit_index(p, "offset", 1, -5), "image 1 has offset -5, below 0"),
    }  # fmt: skip
    for name, (damage, words) in damaged.items():
        shutil.copytree(tmp_path / "p", tmp_path / name)
        damage(tmp_path / name)
        with pytest.raises(DataError) as e:
            PackedImages(tmp_path / name)
        message = str(e.value)
        assert message.startswith(f"{tmp_path / name}/index.npz: damaged ({words}"), message
        assert message.endswith("; pack the set again"), message
        code, _, err = run_cli(["bench", "loader", str(tmp_path / name), "--workers", "0",
                                "--batch", "4", "--batches", "1", "--crop", "12"],
                               capsys)  # fmt: skip
        (line,) = err.splitlines()
        assert code == 1 and line == f"cnnkit: error: {message}", err
    # the same cnnkit pack again writes the index and meta.json again from the shards
    code, out, err = run_cli(["pack", str(shapes), str(tmp_path / "past the end"), "--size", "16"],
                             capsys)  # fmt: skip
    note = "(image 2 has label 57, not one of meta.json's 3 classes, 0 to 2): written again from"
    assert code == 0 and f"{note} the shards" in err, err
    torch.testing.assert_close(all_images(tmp_path / "past the end"), all_images(tmp_path / "p"))


def test_a_pack_into_a_folder_reached_through_a_symlink_is_refused(shapes, tmp_path, capsys):
    """DST inside a class folder that SRC links to (or a folder linked below a class): its
    shards would become images of that class."""
    classes = sorted(p.name for p in shapes.iterdir())
    elsewhere, src = tmp_path / "elsewhere", tmp_path / "src"
    shutil.copytree(shapes / classes[0], elsewhere / "a")
    shutil.copytree(shapes / classes[1], elsewhere / "deep")
    src.mkdir()
    shutil.copytree(shapes / classes[1], src / classes[1])
    shutil.copytree(shapes / classes[2], src / classes[2])
    os.symlink(elsewhere / "a", src / "ext")
    os.symlink(elsewhere / "deep", src / classes[2] / "more")
    code, _, err = run_cli(["pack", str(src), str(elsewhere / "a"), "--size", "16"], capsys)
    assert code == 2 and f"{elsewhere / 'a'}: holds images, and is not a pack" in err, err
    for dst, link in ((elsewhere / "a/pk", "ext"), (elsewhere / "deep/x/pk", f"{classes[2]}/more")):
        before = [sorted(os.listdir(elsewhere / name)) for name in ("a", "deep")]
        code, _, err = run_cli(["pack", str(src), str(dst), "--size", "16"], capsys)
        (line,) = err.splitlines()
        assert code == 2 and line.startswith(f"cnnkit: error: {dst}: inside a folder being "
                                             f"packed ({src / link}, which is "), line  # fmt: skip
        assert line.endswith("through a symlink); pack into a folder outside it"), line
        assert [sorted(os.listdir(elsewhere / name)) for name in ("a", "deep")] == before
    with pytest.raises(ConfigError, match="inside a folder being packed"):
        pack_folder(src, elsewhere / "a/pk", size=16, progress=False)
    assert pack_folder(src, tmp_path / "out", size=16, workers=1, progress=False).images == 20


def test_an_unreadable_class_folder_is_said_so_by_pack_training_and_eval(shapes, tmp_path,
                                                                         monkeypatch,
                                                                         capsys):  # fmt: skip
    src = tmp_path / "src"
    shutil.copytree(shapes, src)
    locked = src / sorted(os.listdir(src))[1]
    real = os.scandir

    def denied(path="."):
        if Path(path) == locked:  # as for a folder of mode 000, without root's override
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", denied)
    words = (f"{locked}: class folder cannot be read (Permission denied); give this user read "
             f"access to it, or move it out of {src}")  # fmt: skip
    code, _, err = run_cli(["pack", str(src), str(tmp_path / "p"), "--size", "16"], capsys)
    assert code == 1 and err.splitlines() == [f"cnnkit: error: {words}"], err
    assert not (tmp_path / "p").exists()
    classes = sorted(os.listdir(src))
    for options in ({}, {"skip_empty": True}, {"classes": classes}):  # training, eval, val set
        with pytest.raises(DataError) as e:
            scan_images(src, **options)
        assert str(e.value) == words
    cfg = data_config({"source": "folder", "path": str(src), "size": 16, "crop": 12,
                       "workers": 0})  # fmt: skip
    with pytest.raises(DataError, match="class folder cannot be read"):
        cfg.build(torch.device("cpu"))


def test_a_shard_cut_short_after_packing_is_packed_again_by_the_same_command(shapes, tmp_path,
                                                                             capsys):  # fmt: skip
    pack_folder(shapes, tmp_path / "fresh", size=16, shard_size=4, workers=1, progress=False)
    pack_folder(shapes, tmp_path / "p", size=16, shard_size=4, workers=1, progress=False)
    os.truncate(tmp_path / "p/shards/00001.u8", 100)
    with pytest.raises(DataError, match=r"00001.u8: 100 bytes, the index needs 3,072 \(an "
                       r"incomplete copy\?\); copy the set again, or run the cnnkit pack that "
                       "made it again"):  # fmt: skip
        PackedImages(tmp_path / "p")
    argv = ["pack", str(shapes), str(tmp_path / "p"), "--size", "16", "-j", "1"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0 and "already packed" not in out and "(3 resumed)" in out, out
    assert err.splitlines() == [f"cnnkit: note: {tmp_path / 'p/shards/00001.u8'}: 100 bytes, "
                                "its records need 3,072: packed again"], err  # fmt: skip
    torch.testing.assert_close(all_images(tmp_path / "p"), all_images(tmp_path / "fresh"))
    code, out, err = run_cli(argv, capsys)
    assert code == 0 and out.startswith("already packed") and err == "", (out, err)


def test_a_resumed_pack_packs_again_a_shard_cut_short_before_it(shapes, tmp_path, monkeypatch,
                                                                capsys):  # fmt: skip
    interrupt_pack_after(monkeypatch, 2)
    options = {"size": 16, "format": "jpeg", "workers": 1, "progress": False}
    with pytest.raises(Interrupted, match="2 shards done"):
        pack_folder(shapes, tmp_path / "p", shard_size=4, **options)
    monkeypatch.undo()
    os.truncate(tmp_path / "p/shards/00000.jpg", 100)  # a crash before the shard reached the disk
    (tmp_path / "p/shards/00001.npz").write_bytes(b"PK\x03\x04 not a zip")  # packed again too
    s = pack_folder(shapes, tmp_path / "p", **options)
    assert s.resumed_shards == 0 and s.images == 15
    note = capsys.readouterr().err
    assert f"{tmp_path / 'p/shards/00000.jpg'}: 100 bytes, its records need " in note
    assert "(and 1 more): packed again" in note, note
    pack_folder(shapes, tmp_path / "fresh", shard_size=4, **options)
    torch.testing.assert_close(all_images(tmp_path / "p"), all_images(tmp_path / "fresh"))
