"""`cnnkit pack` and the packed source refusing in one line: bad folders and options, a
destination that is not a pack, a changed source, a damaged pack or meta.json."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from helpers import run_cli
from PIL import Image

from cnnkit.data import data_config
from cnnkit.data.batch import BatchJob
from cnnkit.data.pack import pack_folder
from cnnkit.data.packed import PackedImages
from cnnkit.errors import ConfigError, DataError


def test_pack_errors_are_one_line(tmp_path):
    with pytest.raises(DataError, match="not a folder"):
        pack_folder(tmp_path / "missing", tmp_path / "p")
    (tmp_path / "src/a").mkdir(parents=True)
    with pytest.raises(ConfigError, match="inside the folder being packed"):
        pack_folder(tmp_path / "src", tmp_path / "src" / "packed")
    assert not (tmp_path / "src" / "packed").exists()
    (tmp_path / "empty/a").mkdir(parents=True)
    with pytest.raises(DataError, match="no images"):
        pack_folder(tmp_path / "empty", tmp_path / "p")
    assert not (tmp_path / "p").exists()


def test_folders_that_would_change_the_classes_are_refused_and_nothing_is_written(tmp_path, capsys):
    for name, build, code, words in [
        ("empty class", lambda s: (s / "a").mkdir(), 1, "class folder with no images"),
        ("gif only", lambda s: (s / "a").mkdir() or (s / "a/x.gif").write_bytes(b"GIF89a"), 1,
         "not a supported image type (.gif)"),
        ("linked class", lambda s: os.symlink("b", s / "a"), 1, "already a class"),
        ("unreadable only", lambda s: (s / "a").mkdir() or (s / "a/x.jpg").write_bytes(b"x"), 1,
         "none of the 2 images could be read"),
    ]:  # fmt: skip
        src = tmp_path / name
        (src / "b").mkdir(parents=True)
        (src / "b/ok.png").write_bytes(b"not really") if name == "unreadable only" else \
            Image.new("RGB", (8, 8)).save(src / "b/ok.png")  # fmt: skip
        build(src)
        code_got, out, err = run_cli(["pack", str(src), str(tmp_path / "dst")], capsys)
        (line,) = err.splitlines()
        assert code_got == code and line.startswith("cnnkit: error: ") and words in line, line
        assert "Traceback" not in err and not (tmp_path / "dst").exists(), name
    Image.new("RGB", (8, 8)).save(tmp_path / "empty class/a/ok.png")
    code, _, err = run_cli(["pack", str(tmp_path / "empty class"), str(tmp_path / "dst"),
                            "--size", "8193"], capsys)  # fmt: skip
    assert code == 2 and "over the limit of 8192 px" in err and not (tmp_path / "dst").exists()
    for option, words in ((["--format", "png"], "--format: 'png' is not raw or jpeg"),
                          (["--resize", "fit"], "--resize: 'fit' is not squash or shorter")):  # fmt: skip
        code, _, err = run_cli(["pack", str(tmp_path / "empty class"), str(tmp_path / "dst"),
                                *option], capsys)  # fmt: skip
        assert code == 2 and words in err and not (tmp_path / "dst").exists(), err
    from cnnkit.data.pack import pack_folder  # either name of the mode, from Python too

    pack_folder(tmp_path / "empty class", tmp_path / "dst", size=8, resize="shorter-side-crop",
                progress=False)  # fmt: skip
    assert json.loads((tmp_path / "dst/meta.json").read_text())["resize"] == "shorter"


def test_a_failed_pack_keeps_the_users_own_files(tmp_path, capsys):
    (tmp_path / "bad/a").mkdir(parents=True)
    (tmp_path / "bad/a/x.jpg").write_bytes(b"not an image")
    dst = tmp_path / "mine"
    (dst / "shards").mkdir(parents=True)
    for name in ("shards/notes.txt", "shards/12.u8", "draft.tmp", "readme.txt"):
        (dst / name).write_text("precious")
    code, _, err = run_cli(["pack", str(tmp_path / "bad"), str(dst), "--size", "16"], capsys)
    assert code == 1 and "could be read" in err
    left = sorted(str(p.relative_to(dst)) for p in dst.rglob("*"))
    assert left == ["draft.tmp", "readme.txt", "shards", "shards/12.u8", "shards/notes.txt"]


def test_bench_loader_on_a_folder_of_unreadable_images_is_one_line(tmp_path, capsys):
    for cls in ("a", "b"):
        (tmp_path / "bad" / cls).mkdir(parents=True)
        (tmp_path / "bad" / cls / "x.jpg").write_bytes(b"not an image")
    for workers in ("0", "1"):
        code, _, err = run_cli(["bench", "loader", str(tmp_path / "bad"), "--crop", "16",
                                "--workers", workers, "--batches", "2"], capsys)  # fmt: skip
        assert code == 1 and "Traceback" not in err, err
        assert err.splitlines()[-1].startswith("cnnkit: error: bench loader: an epoch"), err


def test_a_folder_holding_a_packs_file_names_is_refused_untouched(shapes, tmp_path, capsys):
    """A folder of the user's with a files.txt or meta.json (not a pack): a pack would have
    overwritten them, and a failed one deleted them; a plan.json not of a pack, JSON or not,
    is one line that never says to delete the folder."""
    for name, text in [("files.txt", "my list"), ("meta.json", "{}"), ("plan.json", '{"a": 1}'),
                       ("plan.json", "[1, 2]"), ("plan.json", "my plan: not JSON")]:  # fmt: skip
        dst = tmp_path / f"mine-{len(list(tmp_path.iterdir()))}"
        dst.mkdir()
        (dst / name).write_text(text)
        code, _, err = run_cli(["pack", str(shapes), str(dst), "--size", "16"], capsys)
        (line,) = err.splitlines()
        assert code in (1, 2) and line.startswith("cnnkit: error: "), err
        assert ("not a pack" in line) if name != "plan.json" else ("not a cnnkit pack's" in line)
        assert "delete" not in line, line
        assert [p.name for p in dst.iterdir()] == [name] and (dst / name).read_text() == text


def test_a_pack_rerun_on_a_changed_folder_or_label_file_is_refused(shapes, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(shapes, src)
    flat = tmp_path / "flat"
    flat.mkdir()
    classes = sorted(p.name for p in src.iterdir())
    for k, cls in enumerate(classes):
        shutil.copy(next((src / cls).iterdir()), flat / f"v{k}.png")
    (tmp_path / "labels.txt").write_text("".join(f"v{k}.png {c}\n" for k, c in enumerate(classes)))
    (tmp_path / "swapped.txt").write_text(f"v0.png {classes[1]}\nv1.png {classes[0]}\n"
                                          f"v2.png {classes[2]}\n")  # fmt: skip
    pack_folder(flat, tmp_path / "val", size=16, labels_file=tmp_path / "labels.txt",
                progress=False)  # fmt: skip
    before = (tmp_path / "val/index.npz").read_bytes()
    with pytest.raises(DataError, match=r"changed since .* \(2 relabelled\); delete"):
        pack_folder(flat, tmp_path / "val", size=16, labels_file=tmp_path / "swapped.txt",
                    progress=False)  # fmt: skip
    assert (tmp_path / "val/index.npz").read_bytes() == before  # the finished pack untouched
    s = pack_folder(flat, tmp_path / "val", size=16, labels_file=tmp_path / "labels.txt",
                    progress=False)  # fmt: skip
    assert s.images == 3 and s.resumed_shards == s.shards  # unchanged: already packed
    pack_folder(src, tmp_path / "train", size=16, progress=False)
    shutil.copy(next((src / classes[0]).iterdir()), src / classes[0] / "new.png")
    (src / classes[1] / sorted(os.listdir(src / classes[1]))[0]).unlink()
    with pytest.raises(DataError, match=r"\(1 added, 1 gone\)"):
        pack_folder(src, tmp_path / "train", size=16, progress=False)


def test_a_damaged_packed_set_is_one_line_or_skips_the_damaged_image(shapes, tmp_path, capsys):
    pack_folder(shapes, tmp_path / "raw", size=16, shard_size=4, progress=False)
    pack_folder(shapes, tmp_path / "jpeg", size=16, shard_size=4, format="jpeg", progress=False)
    damaged = {
        "cut": lambda p: os.truncate(p / "shards/00001.u8", 100),
        "meta": lambda p: (p / "meta.json").write_text('{"format": '),
        "index": lambda p: (p / "index.npz").write_bytes(b"PK\x03\x04 not a zip"),
        "gone": lambda p: (p / "shards/00003.u8").unlink(),
    }
    words = {"cut": "00001.u8: 100 bytes, the index needs 3,072", "meta": "unreadable",
             "index": "index.npz: unreadable", "gone": "00003.u8: missing"}  # fmt: skip
    for name, damage in damaged.items():
        shutil.copytree(tmp_path / "raw", tmp_path / name)
        damage(tmp_path / name)
        code, _, err = run_cli(["bench", "loader", str(tmp_path / name), "--workers", "0",
                                "--batch", "4", "--batches", "1", "--crop", "12"], capsys)  # fmt: skip
        (line,) = err.splitlines()
        assert code == 1 and line.startswith("cnnkit: error: ") and words[name] in line, line
    # a JPEG record with damaged bytes: that image is skipped and named, the others are kept
    index = np.load(tmp_path / "jpeg/index.npz")
    shard, offset = int(index["shard"][5]), int(index["offset"][5])
    with open(tmp_path / f"jpeg/shards/{shard:05d}.jpg", "r+b") as f:
        f.seek(offset + 2)
        f.write(b"\xff\x00" * 40)  # over its headers
    ds = PackedImages(tmp_path / "jpeg")
    for job in (BatchJob(list(range(15))), BatchJob(list(range(15)), crops=None)):
        batch = ds[job]
        assert len(batch) == 14 and batch.pixels.shape[0] == 14
        ((name, reason),) = batch.bad
        assert name.startswith(f"{tmp_path / 'jpeg'} image 5 (packed from ") and "damaged" in reason
        assert batch.labels.tolist() == np.delete(index["labels"], 5).tolist()
    code, out, err = run_cli(["bench", "loader", str(tmp_path / "jpeg"), "--workers", "1",
                              "--batch", "4", "--batches", "4", "--crop", "12"], capsys)  # fmt: skip
    assert code == 0 and "Traceback" not in err and "image 5" in err and "skipped" in err, err


def test_a_hand_edited_meta_json_is_one_line_naming_the_field(shapes, tmp_path):
    """A meta.json missing what the readers take, or holding it as another type, is damaged
    (one DataError naming the field), never a KeyError or TypeError traceback."""
    pack_folder(shapes, tmp_path / "p", size=16, workers=1, progress=False)
    meta = json.loads((tmp_path / "p/meta.json").read_text())
    edits = {"no rgb_cov": ("rgb_cov", None, "rgb_cov: Field required"),
             "no classes": ("classes", None, "classes: Field required"),
             "no size": ("size", None, "size: Field required"),
             "no storage": ("storage", None, "storage: Field required"),
             "text size": ("size", "32", "size: Input should be a valid integer (got '32')"),
             "two stds": ("std", [1.0, 2.0], "std: List should have at least 3 items"),
             "a path": ("shards", ["../../x.u8"], "shards.0: String should match")}  # fmt: skip
    for name, (key, value, words) in edits.items():
        edited = {k: v for k, v in meta.items() if k != key or value is not None}
        edited.update({key: value} if value is not None else {})
        shutil.copytree(tmp_path / "p", tmp_path / name)
        (tmp_path / name / "meta.json").write_text(json.dumps(edited))
        cfg = data_config({"source": "packed", "path": str(tmp_path / name), "crop": 12,
                           "workers": 0})  # fmt: skip
        with pytest.raises(DataError) as e:
            cfg.build(torch.device("cpu"))
        message = str(e.value)
        assert message.startswith(f"{tmp_path / name}/meta.json: damaged ({words}"), message
        assert message.endswith("); pack the set again") and "\n" not in message, message
