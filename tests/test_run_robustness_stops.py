"""Runs that stop without corrupting anything: divergence stopped before it is saved, a full
disk or a place it cannot write in one line, Ctrl-C saved at a step, and data or networks
it cannot train on refused in one line."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import CLI, ROOT, one_error_line, run_cli, sigint_default

from cnnkit.checkpoint import load_checkpoint
from cnnkit.config import load_run
from cnnkit.train.run import fit

QUICK = ["train.epochs=1", "--quiet"]


def test_divergence_stops_before_anything_diverged_is_saved(tmp_path, capsys):
    good = tmp_path / "good"
    fit(load_run("digits", ["train.epochs=1"]), good, quiet=True)
    before = (good / "last.pt").read_bytes()
    code, _, err = run_cli(["train", "--resume", str(good), "train.epochs=3", "train.lr=1e30",
                            "--quiet"], capsys)  # fmt: skip
    assert "training diverged at epoch 2" in one_error_line(code, err, (1,))
    assert (good / "last.pt").read_bytes() == before  # the last good checkpoint, untouched
    state = load_checkpoint(good / "last.pt")
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    code, _, err = run_cli(["train", "digits", "train.lr=1e30", "--out", str(tmp_path / "b"),
                            "--quiet"], capsys)  # fmt: skip
    assert "diverged" in one_error_line(code, err, (1,))
    assert not (tmp_path / "b" / "last.pt").exists() and not (tmp_path / "b" / "best.pt").exists()


def test_a_network_that_does_not_end_in_class_scores_is_refused_at_build(tmp_path, capsys):
    net = tmp_path / "net.yaml"
    net.write_text("model: {input: [1, 8, 8], layers: [{name: c1, type: conv, out_channels: 4, "
                   "kernel_size: 3}, {name: last, type: relu}]}\n")  # fmt: skip
    code, _, err = run_cli(["train", "digits", f"model={net}", "--out", str(tmp_path / "o"),
                            "--quiet"], capsys)  # fmt: skip
    line = one_error_line(code, err, (2,))
    assert "last layer last (relu) gives [4, 6, 6]" in line and "10 classes" in line


def test_a_full_disk_is_one_line(tmp_path, capsys, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")  # a write() names no file

    monkeypatch.setattr(torch, "save", full)
    code, _, err = run_cli(["train", "digits", "--out", str(tmp_path / "r"), *QUICK], capsys)
    line = one_error_line(code, err, (1,))
    assert "No space left on device" in line and f"{tmp_path / 'r'}/" in line  # names the file
    assert not list((tmp_path / "r").glob("*.pt")) and not list((tmp_path / "r").glob(".*.tmp"))


@pytest.mark.parametrize("background", [False, True])
def test_a_first_epoch_whose_last_pt_cannot_be_written_leaves_a_run_to_start_again(
    tmp_path, capsys, monkeypatch, background
):
    """best.pt is written before last.pt: a full disk at the first last.pt left best.pt alone,
    and `--resume` then refused a run that 'trained' yet had nothing to resume from. Saved in
    the background too (as ResNet-18's and larger are), where the epoch's metrics row was
    written while the save still ran."""
    from cnnkit.train import saver

    if background:
        monkeypatch.setattr(saver, "BACKGROUND_BYTES", 0)
    save = torch.save

    def full_at_last(obj, f, *args, **kwargs):
        if "last.pt" in str(getattr(f, "name", f)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_at_last)
    run = tmp_path / "r"
    code, _, err = run_cli(["train", "digits", "--out", str(run), *QUICK], capsys)
    assert "No space left on device" in one_error_line(code, err, (1,))
    assert not list(run.glob("*.pt"))  # the save as a whole failed: none of its files kept
    assert not (run / "metrics.csv").exists()
    monkeypatch.setattr(torch, "save", save)  # room again
    code, _, err = run_cli(["train", "--resume", str(run), "--quiet"], capsys)
    assert code == 0 and "no checkpoint yet: the run starts again" in err, err
    assert (run / "best.pt").is_file() and (run / "last.pt").is_file()


@pytest.mark.parametrize("command", [["info"], ["train"], ["config"], ["pack", "{}", "out"]])
def test_a_name_too_long_or_a_link_loop_is_one_line(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for name in ("a" * 300 + ".yaml", "loop/x.yaml"):
        args = [a.format(name) for a in command] if len(command) > 1 else [*command, name]
        code, _, err = run_cli(args, capsys)
        line = one_error_line(code, err, (1, 2))
        assert "loop" in line or "File name too long" in line and len(line) < 300, line


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="needs root to mount")
def test_a_real_full_disk_is_one_line(tmp_path, capsys):
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(disk)],
                      capture_output=True).returncode:  # fmt: skip
        pytest.skip("cannot mount a tmpfs here")
    try:
        code, _, err = run_cli(["train", "digits", "--out", str(disk / "r"), *QUICK], capsys)
        line = one_error_line(code, err, (1,))
        assert "No space left on device" in line or "File too large" in line
        assert f"{disk / 'r'}/" in line  # which file could not be written
        assert not list((disk / "r").glob(".*.tmp"))
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_a_run_started_with_ctrl_c_ignored_keeps_it_ignored():
    """As POSIX programs do: a background job of a script (SIGINT ignored) is not stopped by the
    terminal's Ctrl-C; otherwise the run takes it, and gives it back at the end."""
    from cnnkit.train.epochs import stop_on_interrupt

    before = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with stop_on_interrupt():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with stop_on_interrupt() as stop:
            signal.raise_signal(signal.SIGINT)  # the first Ctrl-C: a request, no exception
            assert stop.requested
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.slow
def test_ctrl_c_stops_at_a_step_saved_and_says_how_to_resume(tmp_path):

    out = tmp_path / "r"
    # (train.calibrate=false: measuring digitnet's settings first is no part of the Ctrl-C)
    cmd = [*CLI, "train", "digits", "--out", str(out), "train.epochs=200", "train.calibrate=false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_default)  # fmt: skip
    deadline = time.time() + 120
    while not (out / "metrics.csv").exists() and time.time() < deadline:  # an epoch done
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 130, err[-1500:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("cnnkit: interrupted at epoch") and f"--resume {out}" in last
    assert "Traceback" not in err
    state = load_checkpoint(out / "last.pt")
    assert state["step"] > 0 or state["epoch"] > 0
    assert not (out / ".lock").exists()


@pytest.mark.parametrize("command", [["export", "digitnet", "--format", "onnx"],
                                     ["show", "net", "digitnet"]])  # fmt: skip
def test_output_that_is_a_folder_is_one_line(command, tmp_path, capsys):
    code, _, err = run_cli([*command, "-o", str(tmp_path)], capsys)
    assert "is a folder" in one_error_line(code, err, (2,)) and not list(tmp_path.iterdir())


def test_unwritable_places_are_one_line(tmp_path, capsys):
    """A path under a file, a dangling link, and a folder nothing can be created in (/proc),
    before any work; /proc's refusal (ENOENT) said as what it is, not `No such file or
    directory` of a folder that is there."""
    (tmp_path / "afile").write_text("x")
    code, _, err = run_cli(["train", "digits", "--out", str(tmp_path / "afile" / "run")], capsys)
    assert "afile" in one_error_line(code, err)
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")  # it said "File exists"
    code, _, err = run_cli(["train", "digits", "--out", str(tmp_path / "dangling")], capsys)
    assert one_error_line(code, err).endswith(f"a link to {tmp_path / 'gone'}, which is not "
                                              "there: make that folder, or give another")  # fmt: skip
    if Path("/proc/self").is_dir():
        code, _, err = run_cli(["export", "digitnet", "--format", "onnx", "-o", "/proc/x.onnx"],
                               capsys)  # fmt: skip
        line = one_error_line(code, err)
        assert line.endswith("cannot write in /proc (a special filesystem, which takes no new "
                             "files)"), line  # fmt: skip
        code, _, err = run_cli(["synth", "shapes", "/proc/cnnkit-synth"], capsys)
        assert "/proc/cnnkit-synth" in one_error_line(code, err)


def test_a_run_directory_inside_its_image_folder_is_refused(shapes, tmp_path, capsys,
                                                           monkeypatch):  # fmt: skip
    """A run written inside data.path became a class of its next run (its curves.png an image),
    so its own resume and eval refused it; the default runs/ of a train started in the image
    folder likewise, and its dry run said it would work. Refused before any work, as pack
    refuses its output inside its source."""
    shutil.copytree(shapes, tmp_path / "s")
    net = {
        "input": [3, 16, 16],
        "layers": [
            {"type": "conv", "out_channels": 4, "kernel_size": 3},
            {"type": "global_avgpool"},
            {"type": "linear"},
        ],
    }
    data = {"source": "folder", "path": ".", "size": 16, "crop": 16, "batch_size": 4}
    (tmp_path / "s" / "run.yaml").write_text(yaml.safe_dump({"model": net, "data": data}))
    monkeypatch.chdir(tmp_path / "s")  # (data.path is relative to the run file)
    for out in (["--out", "run"], ["--dry-run"]):  # the default runs/ here, too
        code, _, err = run_cli(["train", "run.yaml", *out], capsys)
        assert one_error_line(code, err).endswith(
            f"inside data.path ({tmp_path / 's'}), whose subfolders are classes of images; give "
            "--out a folder outside it"
        )
    (tmp_path / "s" / "run.yaml").unlink()
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == sorted(
        p.name for p in shapes.iterdir()
    )


def test_a_batch_of_one_through_a_vector_batchnorm_is_one_line(tmp_path, capsys):
    net = tmp_path / "bn.yaml"
    net.write_text("model:\n  input: [1, 8, 8]\n  layers:\n    - {type: flatten}\n"
                   "    - {type: linear, out_features: 8}\n    - {name: bn, type: batchnorm}\n"
                   "    - {type: linear}\n")  # fmt: skip
    run = tmp_path / "run.yaml"
    run.write_text(f"model: {net}\ndata: {{source: digits, batch_size: 4}}\n"
                   "train: {epochs: 1, calibrate: false}\n")  # fmt: skip
    from cnnkit.train.engine import smallest_chunk

    assert [smallest_chunk(b, a) for b, a in ((10, 4), (8, 4), (7, 3), (9, 4), (5, 1))] == [
        1,
        2,
        1,
        3,
        5,
    ]
    for override, field in (
        ("train.accumulate=4", "train.accumulate"),
        ("data.batch_size=1", "data.batch_size"),
        ("data.batch_size=10 train.accumulate=4", "train.accumulate"),
    ):  # 3, 3, 3, 1
        argv = ["train", str(run), *override.split(), "--out", str(tmp_path / "r"), "--quiet"]
        code, _, err = run_cli(argv, capsys)
        assert code == 2 and err.startswith(f"cnnkit: error: {field}: micro-batches of 1 image"), (
            err
        )
        assert "BatchNorm layer bn (8)" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_a_batch_that_unreadable_images_shrank_below_batchnorms_need_trains_on_none():
    """data.batch_size 2 passes the check above; a batch whose other image was unreadable (the
    loader skips it, and says so) held one: torch's ValueError, a traceback. It trains on none,
    as an all-unreadable batch; the next batch trains."""
    from cnnkit.config import TrainConfig
    from cnnkit.distributed import Local
    from cnnkit.nn import build_model
    from cnnkit.train.engine import build_engine
    from cnnkit.train.loop import Progress, train_one_epoch
    from cnnkit.train.metrics import Console
    from cnnkit.train.optim import Schedule

    class Shrunk:  # a batch of 1 (its other image unreadable), then a whole one
        num_samples = 4

        def __len__(self):
            return 2

        def set_epoch(self, epoch, skip_batches=0):
            pass

        def __iter__(self):
            for n in (1, 2):
                yield torch.rand(n, 1, 8, 8), torch.zeros(n, dtype=torch.long)

    net = {"input": [1, 8, 8], "layers": [{"type": "flatten"}, {"type": "linear",
           "out_features": 8}, {"type": "batchnorm"}, {"type": "linear"}]}  # fmt: skip
    cfg = TrainConfig(precision="fp32", channels_last=False, epochs=1)
    engine = build_engine(build_model(net, num_classes=2), cfg, torch.device("cpu"))
    assert [engine.takes(n) for n in (0, 1, 2)] == [False, False, True]
    stats = train_one_epoch(engine, Shrunk(), Schedule(cfg), Progress(), Console(True),
                            lambda *a: None, Local())  # fmt: skip
    assert stats["seen"] == 2
    engine.accumulate = 2  # micro-batches of 2 and 1 from a batch of 3
    assert [engine.takes(n) for n in (3, 4)] == [False, True]


@pytest.mark.parametrize("ending", ["error", "callback"])
def test_the_progress_bar_stops_however_the_epoch_ends(tmp_path, monkeypatch, ending):
    """The bar's refresh thread and hidden cursor never outlive the run: an error, Ctrl-C or a
    callback's stop mid-epoch ends them before anything else is said."""
    import cnnkit.train.run as run_module
    from cnnkit.train.epochs import StopTraining
    from cnnkit.train.metrics import Console

    started = []

    class OnATerminal(Console):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.terminal = True

        def start_epoch(self, *args):
            super().start_epoch(*args)
            started.append(self)

    def stop(epoch, step, global_step):
        if step == 3:
            raise RuntimeError("boom") if ending == "error" else StopTraining

    monkeypatch.setattr(run_module, "Console", OnATerminal)
    config = load_run("digits", ["train.epochs=1", "train.calibrate=false"])
    if ending == "error":
        with pytest.raises(RuntimeError, match="boom"):
            fit(config, tmp_path / "r", on_step=stop)
    else:
        fit(config, tmp_path / "r", on_step=stop)
    assert started and all(console.progress is None for console in started)


def test_a_single_class_folder_is_refused_not_trained_to_100_percent(tmp_path, capsys):
    """data.path at one class folder (not the folder above): a one-output network scores 100%
    whatever it learns, so training refuses it in one line; pack notes it."""
    import numpy as np
    from PIL import Image

    for i in range(6):
        Image.fromarray(np.full((12, 12, 3), 40 * i, np.uint8)).save(tmp_path / f"cat{i}.png")
    folder = tmp_path / "one"
    (folder / "cat").mkdir(parents=True)
    for path in tmp_path.glob("cat*.png"):
        path.rename(folder / "cat" / path.name)
    run = tmp_path / "run.yaml"
    run.write_text(f"name: one\nmodel: lenet5\ndata: {{source: folder, path: {folder}, "
                   "batch_size: 2, size: 36, crop: 32, grey: true}\ntrain: {epochs: 1}\n")  # fmt: skip
    code, _, err = run_cli(["train", str(run), "--out", str(tmp_path / "r")], capsys)
    assert one_error_line(code, err) == (
        f"cnnkit: error: data: 1 class (cat) in {folder}: a classifier needs at least 2 "
        "(is data.path the folder above the class folders?)"
    )
    assert not (tmp_path / "r" / "last.pt").exists()
    code, out, err = run_cli(["pack", str(folder), str(tmp_path / "p"), "--size", "16"], capsys)
    assert code == 0 and "6 images of 1 class " in out and "cnnkit: note: one class only" in err


def test_a_data_set_of_unreadable_images_stops_within_16_batches(tmp_path, capsys):
    """Every image unreadable (text named .jpg): one line after the first 16 batches read
    nothing, not a whole epoch of empty steps before validation says so."""
    for label in ("a", "b"):
        (tmp_path / "bad" / label).mkdir(parents=True)
        for i in range(30):
            (tmp_path / "bad" / label / f"{i}.jpg").write_text("not a picture")
    run = tmp_path / "run.yaml"
    run.write_text(f"name: bad\nmodel: lenet5\ndata: {{source: folder, path: {tmp_path / 'bad'}, "
                   "batch_size: 2, size: 36, crop: 32, grey: true, workers: 0}\n"
                   "train: {epochs: 1}\n")  # fmt: skip
    code, _, err = run_cli(["train", str(run), "--out", str(tmp_path / "r")], capsys)
    assert code == 1 and err.splitlines()[-1] == (
        "cnnkit: error: no training image of the first 16 batches of epoch 1 could be read "
        "(each was skipped, as said above): is the data set readable?"
    ), err
