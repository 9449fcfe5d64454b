"""End to end on the command line: synth shapes -> pack -> a short `cnnkit train` of a small
AlexNet-like net well above chance; a folder of bad images packs and trains; bench loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_images import write_bad_folder
from helpers import cli_ok as main

NET = Path(__file__).parent / "data" / "tiny_alexnet.yaml"


def write_run(path: Path, data: dict, epochs: int) -> Path:
    run = {"name": "e2e", "model": str(NET), "data": {"batch_size": 12, "crop": 20, "workers": 0, **data},
           "train": {"epochs": epochs, "optimizer": "adam", "lr": 0.005, "weight_decay": 0.0,
                     "device": "cpu", "precision": "fp32"}}  # fmt: skip
    path.write_text(json.dumps(run))  # JSON is YAML
    return path


def test_synth_pack_train_beats_chance(tmp_path, capsys):
    main(["synth", "shapes", str(tmp_path / "shapes"), "--classes", "4", "--per-class", "16",
          "--size", "24"])  # fmt: skip
    main(["pack", str(tmp_path / "shapes"), str(tmp_path / "packed"), "--size", "24",
          "--workers", "2"])  # fmt: skip
    out = capsys.readouterr().out
    assert "wrote 64 images of 4 classes" in out and "packed 64 images of 4 classes" in out
    data = {"source": "packed", "path": str(tmp_path / "packed"), "val_fraction": 0.25}
    main(["train", str(write_run(tmp_path / "run.yaml", data, epochs=12)), "--out",
          str(tmp_path / "run"), "--quiet"])  # fmt: skip
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["val_images"] == 16
    assert summary["best_val_top1"] >= 0.6  # chance is 0.25


@pytest.mark.parametrize("source", ["packed", "folder"])
def test_bad_images_folder_packs_and_trains(tmp_path, capsys, source):
    expected = write_bad_folder(tmp_path / "bad")
    data = {"source": "folder", "path": str(tmp_path / "bad"), "size": 24}
    if source == "packed":
        main(["pack", str(tmp_path / "bad"), str(tmp_path / "p"), "--size", "24"])
        out = capsys.readouterr().out
        assert "packed 11 images of 2 classes" in out and "converted 3, skipped 3" in out
        report = (tmp_path / "p" / "bad_images.tsv").read_text()
        assert all(rel in report for rel in expected)
        data = {"source": "packed", "path": str(tmp_path / "p")}
    main(["train", str(write_run(tmp_path / "run.yaml", {**data, "val_fraction": 0.2}, 1)),
          "--out", str(tmp_path / "run"), "--quiet"])  # fmt: skip
    assert (tmp_path / "run" / "last.pt").exists()


def test_bench_loader_json_last_line(tmp_path, capsys):
    main(
        [
            "synth",
            "shapes",
            str(tmp_path / "s"),
            "--classes",
            "2",
            "--per-class",
            "8",
            "--size",
            "20",
        ]
    )
    main(["pack", str(tmp_path / "s"), str(tmp_path / "p"), "--size", "20"])
    capsys.readouterr()
    main(["bench", "loader", str(tmp_path / "p"), "--workers", "1", "--batch", "4", "--batches", "3",
          "--crop", "16", "--device", "cpu", "--json"])  # fmt: skip
    said = capsys.readouterr()
    report = json.loads(said.out.strip().splitlines()[-1])
    assert said.err.startswith(
        "cnnkit: note: --workers 1: raw shards on the CPU are cropped in-process"
    )  # the --workers given is not silently dropped
    assert report["images"] == 12 and report["images_per_second"] > 0
    # raw shards on a CPU are cut in the main process: no worker starts, none prefetches; the
    # first batch is untimed too (it said "workers 1" and 3 + 1 * 2 untimed, and took one more)
    assert report["mode"] == "views" and report["workers"] == 0 and report["warmup"] == 3 + 1
    assert report["source"] == "packed" and report["input_shape"] == [3, 16, 16]
    assert report["largest_batch"] == 4 and report["cpu_seconds"] >= 0
    main(["bench", "loader", str(tmp_path / "p"), "--batch", "64", "--batches", "2", "--crop",
          "16", "--device", "cpu"])  # fmt: skip
    out, err = capsys.readouterr()
    assert err == ""  # no --workers given: nothing to say
    assert "batch 64 (of " in out and "images: the set is smaller)" in out
    assert "in-process (no workers)" in out and "after 4 untimed batches" in out
    assert "coarse: under 0.2 CPU s measured" in out
    main(
        [
            "bench",
            "loader",
            str(tmp_path / "p"),
            "--batch",
            "4",
            "--batches",
            "2",
            "--device",
            "cpu",
            "--json",
        ]
    )  # fmt: skip  (no --crop: AlexNet's 227 does not fit a 20 px pack)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["input_shape"] == [3, 17, 17]  # 7/8 of its side
    with pytest.raises(SystemExit) as done:  # the flags it was given, not data.* settings
        main(["bench", "loader", str(tmp_path / "p"), "--crop", "24"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "--crop: 24 is larger than the packed size 20" in err


def test_cli_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    (tmp_path / "afile").write_text("keep")
    (tmp_path / "half").mkdir()
    plan = {"params": {}, "files": [], "labels": [], "classes": [], "shard_size": 16}
    (tmp_path / "half/plan.json").write_text(json.dumps(plan))  # an interrupted pack's plan
    for argv, code in [
        (["pack", str(tmp_path / "missing"), str(tmp_path / "p")], 1),
        (["pack", str(tmp_path), str(tmp_path / "p"), "--resize", "stretch"], 2),
        (["synth", "shapes", str(tmp_path / "s"), "--classes", "0"], 2),
        (["synth", "shapes", str(tmp_path / "mine")], 2),  # not empty: never overwritten
        (["synth", "shapes", str(tmp_path / "s"), "--size", "0"], 2),
        (["synth", "shapes", str(tmp_path / "s"), "--seed", "-1"], 2),  # (was numpy's traceback)
        (["synth", "shapes", str(tmp_path / "s"), "--size", "100000"], 2),  # no pack would take it
        (["pack", str(tmp_path / "mine"), str(tmp_path / "afile")], 2),  # not a folder
        (["bench", "loader", str(tmp_path / "missing")], 1),
        (["bench", "loader", str(tmp_path), "--crop", "0"], 2),
        (["bench", "loader", str(tmp_path / "half")], 1),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == code
        err = capsys.readouterr().err
        assert err.startswith("cnnkit: error: ") and err.count("\n") == 1
        if "--size" in argv and "0" in argv:  # the option given, and only it
            assert err == "cnnkit: error: --size must be >= 8 (got 0)\n"
        if "half" in argv[-1]:
            assert "(interrupted? run cnnkit pack again to resume)" in err
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
    assert (tmp_path / "afile").read_text() == "keep"
    assert not (tmp_path / "s").exists()  # nothing made for a refused set: a retry may use it


def test_an_interrupted_synth_leaves_nothing(tmp_path, monkeypatch):
    """The set is written beside DST and renamed into place whole: a Ctrl-C leaves no half set
    that the same command then refuses as not empty."""
    from cnnkit.data import synth

    real = synth.draw_example

    def interrupted(rng, k, size):
        if k == 1:
            raise KeyboardInterrupt
        return real(rng, k, size)

    monkeypatch.setattr(synth, "draw_example", interrupted)
    with pytest.raises(KeyboardInterrupt):
        synth.synth_shapes(tmp_path / "s", classes=3, per_class=2, size=16, workers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.undo()
    if Path("/proc/self").exists():  # a folder where nothing can be made: named as given
        with pytest.raises(OSError) as e:
            synth.synth_shapes("/proc/cnnkit-x", classes=1, per_class=1, size=8, workers=1)
        assert str(e.value.filename).startswith("/proc/cnnkit-x")
    assert synth.synth_shapes(tmp_path / "s", classes=3, per_class=2, size=16, workers=1)
    assert len(list((tmp_path / "s").rglob("*.JPEG"))) == 6
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")  # "." cannot be renamed over: class by class
    assert synth.synth_shapes(".", classes=2, per_class=1, size=16, workers=1)
    assert len(list(Path(".").rglob("*.JPEG"))) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "s"]  # no scratch left


def test_the_synthetic_held_out_set_is_the_same_whatever_the_training_set():
    """Drawn by the host's generator apart from the training set (which the device draws), so
    eval of a run on another device, or with another train_size, scores the same images."""
    import torch

    from cnnkit.data import data_config

    def val(train_size):
        section = {"source": "synthetic", "shape": [1, 8, 8], "num_classes": 3,
                   "train_size": train_size, "val_size": 10, "batch_size": 8}  # fmt: skip
        return next(iter(data_config(section).build(torch.device("cpu")).val))

    (a, ya), (b, yb) = val(16), val(64)
    assert torch.equal(a, b) and torch.equal(ya, yb)
