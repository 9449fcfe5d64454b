"""The data errors a new user meets, each one line that names the way this command takes what
is missing: a flat folder's label file (pack --labels, eval --labels, data.val_labels, or none:
bench loader and data.path read class folders)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import one_error_line, run_cli
from PIL import Image

from cnnkit.data import data_config
from cnnkit.errors import DataError


def write_images(folder: Path, names: list[str], seed: int = 0) -> None:
    """Small RGB JPEGs of these names in `folder` (made with its parents)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name in names:
        Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(folder / name)


@pytest.fixture
def flat(tmp_path: Path) -> Path:
    """A flat folder of 4 images, as ImageNet's val/ comes (VAL_00000001.JPEG ...)."""
    write_images(tmp_path / "flat", [f"VAL_{i:08d}.JPEG" for i in range(1, 5)])
    return tmp_path / "flat"


def folder_section(tmp_path: Path, **data) -> dict:
    """A folder source's data: section: 3 classes of 2 images under tmp_path/tree, and `data`."""
    for k, name in enumerate(("cat", "dog", "green-cross")):
        write_images(tmp_path / "tree" / name, ["a.jpg", "b.jpg"], seed=k)
    return {"source": "folder", "path": str(tmp_path / "tree"), "size": 8, "crop": 8,
            "workers": 0, "batch_size": 2, **data}  # fmt: skip


def test_a_flat_folder_names_how_each_command_takes_its_label_file(flat, tmp_path, capsys):
    code, _, err = run_cli(["bench", "loader", str(flat), "--crop", "8", "--batches", "1"], capsys)
    line = one_error_line(code, err)  # bench loader takes no label file: what it reads instead
    assert "no class subfolders (an ImageFolder tree is read here: one subfolder per class" in line
    assert "needs a label file" not in line
    code, _, err = run_cli(["pack", str(flat), str(tmp_path / "packed")], capsys)
    assert "no class subfolders (a flat folder needs a label file: give --labels FILE)" in (
        one_error_line(code, err)
    )
    cfg = data_config(folder_section(tmp_path, val_path=str(flat)))
    with pytest.raises(DataError, match=r"needs a label file: set data\.val_labels\)$"):
        cfg.build(torch.device("cpu"))
    cfg = data_config(folder_section(tmp_path, path=str(flat)))  # training reads class folders
    with pytest.raises(DataError, match="an ImageFolder tree is read here"):
        cfg.build(torch.device("cpu"))


def test_eval_of_a_flat_folder_names_its_labels_option(digits_run, flat, capsys):
    code, _, err = run_cli(["eval", str(digits_run), "--data", str(flat)], capsys)
    assert "no class subfolders (a flat folder needs a label file: give --labels FILE)" in (
        one_error_line(code, err)
    )


def test_a_missing_label_file_names_its_setting(flat, tmp_path, capsys):
    cfg = data_config(folder_section(tmp_path, val_path=str(flat), val_labels=str(tmp_path / "no")))
    with pytest.raises(DataError, match=r"^data\.val_labels .*/no: label file not found$"):
        cfg.build(torch.device("cpu"))
    code, _, err = run_cli(["pack", str(flat), str(tmp_path / "p"), "--labels", "nosuch"], capsys)
    assert one_error_line(code, err) == "cnnkit: error: --labels nosuch: label file not found"
    code, _, err = run_cli(["pack", str(flat), str(tmp_path / "p"), "--labels", str(flat)], capsys)
    assert one_error_line(code, err).endswith(f"--labels {flat}: a folder, not a label file")


def test_eval_names_its_labels_option_for_a_missing_label_file(digits_run, flat, capsys):
    code, _, err = run_cli(["eval", str(digits_run), "--data", str(flat), "--labels", "no.txt"],
                           capsys)  # fmt: skip
    assert one_error_line(code, err) == "cnnkit: error: --labels no.txt: label file not found"


def test_a_validation_class_the_training_set_lacks_is_explained(flat, tmp_path):
    """A near match is named (a folder's case changed); Caffe's integer labels are said to be
    indices where the training classes are names; else the classes there are listed."""
    from cnnkit.data.pack import pack_folder

    for k, name in enumerate(("cat", "Green-Cross")):
        write_images(tmp_path / "val" / name, ["v.jpg"], seed=k)
    (tmp_path / "val.txt").write_text("".join(f"VAL_{i:08d}.JPEG {i % 3}\n" for i in range(1, 5)))
    near = "class 'Green-Cross' is not among the training classes (did you mean 'green-cross'?)"
    index = ("class '0' is not among the training classes (the classes are given by index, as "
             "in Caffe's val.txt; cnnkit expects class names, the training folders': 'cat', "
             "'dog', 'green-cross')")  # fmt: skip
    section = folder_section(tmp_path)
    for val, labels, words in ((tmp_path / "val", None, near), (flat, tmp_path / "val.txt", index)):
        cfg = data_config({**section, "val_path": str(val), "val_labels": labels and str(labels)})
        with pytest.raises(DataError) as caught:
            cfg.build(torch.device("cpu"))
        assert str(caught.value).endswith(words), caught.value
        pack_folder(val, tmp_path / f"p-{val.name}", size=8, labels_file=labels, progress=False)
    pack_folder(tmp_path / "tree", tmp_path / "p-tree", size=8, progress=False)
    packed = {"source": "packed", "path": str(tmp_path / "p-tree"), "crop": 8, "workers": 0}
    for val, words in (("p-val", near), ("p-flat", index)):  # a packed validation set alike
        cfg = data_config({**packed, "val_path": str(tmp_path / val)})
        with pytest.raises(DataError) as caught:
            cfg.build(torch.device("cpu"))
        assert str(caught.value).endswith(words), caught.value
    from cnnkit.data.scan import unknown_classes

    assert unknown_classes(["zebra"], ["cat", "dog"]) == " (2 classes: 'cat', 'dog')"
    assert unknown_classes(["12"], ["3", "7"]) == " (2 classes: '3', '7')"  # numbers both


def test_counts_of_one_are_singular(flat, tmp_path, capsys):
    """'no label for 1 images', '1 epochs', '1 more entries' read as English: 1 image."""
    from cnnkit.config import TrainConfig
    from cnnkit.config.sections import train_notes
    from cnnkit.data.scan import REPORTED_LINES, report_skipped, scan_images

    (tmp_path / "val.txt").write_text("".join(f"VAL_{i:08d}.JPEG cat\n" for i in range(1, 4)))
    with pytest.raises(DataError, match=r"no label for 1 image in .*VAL_00000004.JPEG\)$"):
        scan_images(flat, tmp_path / "val.txt")
    notes = train_notes(TrainConfig(epochs=1, warmup_epochs=1, schedule="step", step_size=1))
    assert any("train.warmup_epochs 1 of 1 epoch: the lr never" in note for note in notes), notes
    assert "train.step_size 1 of 1 epoch: the lr never drops" in notes, notes
    report_skipped([(f"x{i}", "hidden file") for i in range(REPORTED_LINES + 1)])
    assert capsys.readouterr().err.splitlines()[-1] == "cnnkit: skipped 1 more entry"
    write_images(tmp_path / "tree" / "a", ["a.jpg"])
    (tmp_path / "tree" / "b").mkdir()
    (tmp_path / "tree" / "b" / "notes.txt").write_text("")
    with pytest.raises(DataError, match=r"b: class folder with no images \(1 other entry skipped"):
        scan_images(tmp_path / "tree")


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux's /proc")
def test_synth_and_pack_into_proc_say_what_proc_is(tmp_path, capsys):
    """`cnnkit synth shapes /proc/x` and `cnnkit pack SRC /proc/x` said "No such file or
    directory" of a folder the user asked them to make: /proc refuses new entries so."""
    from cnnkit.data.synth import synth_shapes

    synth_shapes(tmp_path / "src", classes=2, per_class=1, size=16, workers=1)
    special = "/proc is a special filesystem, which takes no new files"
    code, _, err = run_cli(["synth", "shapes", "/proc/cnnkit-x", "--per-class", "1"], capsys)
    assert (code, err) == (1, f"cnnkit: error: /proc/cnnkit-x: {special}\n")
    code, _, err = run_cli(["pack", str(tmp_path / "src"), "/proc/cnnkit-x/y"], capsys)
    assert code == 1 and err.endswith(f": cannot write /proc/cnnkit-x ({special})\n"), err
    import errno

    from cnnkit.runtime import os_reason

    missing = FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "a"))
    assert os_reason(missing) == "No such file or directory"  # a real folder: a missing file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # (its probe file gone)


def test_an_empty_argument_is_refused_never_read_as_the_current_folder(tmp_path, capsys,
                                                                       monkeypatch):  # fmt: skip
    """`cnnkit pack src "$DST"` with DST unset packed into the current folder, exit 0; eval
    `--data ""` read it as the validation set. An empty argument is one line, nothing made."""
    write_images(tmp_path / "src" / "a", ["x.jpg"])
    monkeypatch.chdir(tmp_path)
    for argv, what in ((["pack", "src", ""], "the argument after src"),
                       (["eval", "digits", "--data", ""], "--data's value"),
                       (["", "info"], "the command")):  # fmt: skip
        code, _, err = run_cli(argv, capsys)
        assert one_error_line(code, err) == (
            f"cnnkit: error: {what} is empty (an unset shell variable?): give a value"
        )
        assert code == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_bench_loader_names_its_own_flags_when_shared_memory_is_short(tmp_path, capsys,
                                                                      monkeypatch):  # fmt: skip
    """bench loader said the advice meant for `cnnkit train` ("lower data.workers, data.prefetch
    or data.batch_size"): it has --workers and --batch, and no --prefetch. Train's words stay."""
    import os

    real = os.statvfs

    class Tiny:
        f_bavail, f_frsize = 16, 4096  # 64 KiB free

    monkeypatch.setattr(os, "statvfs", lambda p: Tiny() if p == "/dev/shm" else real(p))
    section = folder_section(tmp_path, workers=1)
    code, _, err = run_cli(["bench", "loader", section["path"], "--workers", "1", "--batch", "2",
                            "--crop", "8", "--batches", "1"], capsys)  # fmt: skip
    line = one_error_line(code, err)
    assert line.startswith("cnnkit: error: --workers 1 ") and "data." not in line, line
    assert line.endswith("or lower --workers or --batch"), line
    with pytest.raises(DataError, match=r"^data\.workers=1 .*lower data\.workers, data\.prefetch "
                                        r"or data\.batch_size$"):  # fmt: skip
        next(iter(data_config(section).build(torch.device("cpu")).train))
    from cnnkit.bench.loader import as_flags

    died = "data.workers=2: a loader worker process died (x): lower data.workers or data.prefetch"
    assert as_flags(died) == "--workers 2: a loader worker process died (x): lower --workers"


def test_a_file_where_a_folder_belongs_and_a_full_disk_are_said_of_their_paths(tmp_path, capsys,
                                                                              monkeypatch):  # fmt: skip
    """synth under a file (mine.svg/sub) said "mine.svg: File exists", show -o there that the
    folder "does not exist"; a worker's full disk named no path at all; synth's counts read
    as English (1 image of 1 class)."""
    from cnnkit.data import synth

    (tmp_path / "mine.svg").write_text("<svg/>")
    code, _, err = run_cli(["synth", "shapes", str(tmp_path / "mine.svg" / "sub")], capsys)
    assert (code, err) == (2, f"cnnkit: error: {tmp_path / 'mine.svg' / 'sub'}: "
                              f"{tmp_path / 'mine.svg'} is a file, not a folder\n")  # fmt: skip
    out = tmp_path / "mine.svg" / "x.png"
    code, _, err = run_cli(["show", "net", "lenet5", "-o", str(out)], capsys)
    assert (code, err) == (2, f"cnnkit: error: -o {out}: the folder {out.parent} is a file, "
                              "not a folder\n")  # fmt: skip

    def full(job):
        raise OSError(28, "No space left on device")  # as a pool hands a worker's back

    monkeypatch.setattr(synth, "_write_class", full)
    code, _, err = run_cli(["synth", "shapes", str(tmp_path / "s"), "--per-class", "1"], capsys)
    assert (code, err) == (1, f"cnnkit: error: {tmp_path / 's'}: No space left on device "
                              "(nothing half-written was kept)\n")  # fmt: skip
    monkeypatch.undo()
    code, out, _ = run_cli(["synth", "shapes", str(tmp_path / "one"), "--classes", "1",
                            "--per-class", "1", "--size", "16"], capsys)  # fmt: skip
    assert code == 0 and out.startswith("wrote 1 image of 1 class to ")


def test_a_crop_no_size_could_hold_is_said_so(tmp_path, capsys):
    """--crop 100000 said it was larger than data.size 256, as if a size could hold it."""
    from cnnkit.data.synth import synth_shapes

    synth_shapes(tmp_path / "src", classes=2, per_class=2, size=16, workers=1)
    code, _, err = run_cli(["bench", "loader", str(tmp_path / "src"), "--crop", "100000"], capsys)
    assert (code, err) == (2, "cnnkit: error: --crop: 100000 is over the largest side a network "
                              "may read (8192)\n")  # fmt: skip


def test_a_crop_area_range_or_a_mean_beside_a_mean_image_is_said_to_be_unused(tmp_path):
    """data.scale with plain random crops, and data.mean / data.std with normalize: mean_image,
    changed nothing and said nothing; a run's config.yaml (every field written) says nothing."""
    from cnnkit.data import data_config

    section = {"source": "folder", "path": str(tmp_path), "crop": 24, "size": 32}
    notes = data_config({**section, "scale": [0.5, 1.0]}).training_notes()
    assert any(n.startswith("data.scale [0.5, 1.0] is not used: it is the area range of "
                            "random-resized crops") for n in notes), notes  # fmt: skip
    assert not any("scale" in n for n in data_config(
        {**section, "scale": [0.5, 1.0], "train_crop": "resized"}).training_notes())  # fmt: skip
    notes = data_config({**section, "normalize": "mean_image", "mean": [100, 100, 100]}
                        ).training_notes()  # fmt: skip
    assert any(n.startswith("data.mean not used: data.normalize: mean_image") for n in notes)
    dumped = data_config(section).model_dump()
    assert not any("scale" in n or "mean" in n for n in data_config(dumped).training_notes())
