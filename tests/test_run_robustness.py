"""Runs that must not lose or corrupt anything: one writer per run directory (a second one is
refused, a dead one's lock taken over), a run killed before its first checkpoint resumed from
the start, divergence stopped before it is saved, a full disk in one line; and two corpora
through the CLI in this process: bad overrides (exit 2, nothing written) and tampered
checkpoints (exit 1 or 2, one line, no traceback)."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import CLI, ROOT, one_error_line, run_cli, sigint_default

from cnnkit.checkpoint import load_checkpoint
from cnnkit.config import load_run
from cnnkit.errors import ConfigError
from cnnkit.train.run import fit

QUICK = ["train.epochs=1", "--quiet"]


@pytest.mark.slow
def test_two_runs_into_one_directory_one_is_refused(tmp_path):
    out = tmp_path / "same"
    cmd = [*CLI, "train", "digits", "--out", str(out), "train.epochs=1", "--quiet"]
    procs = [subprocess.Popen([*cmd, f"seed={s}"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
             for s in (1, 2)]  # fmt: skip
    results = [(p.wait(timeout=240), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    refusals = (
        "in use by another run",
        "already holds a run",  # locked, or finished first
        "another run wrote there while this one was starting",
    )  # finished while it built
    assert any(words in loser for words in refusals), loser
    winner_seed = next(s for (code, _), s in zip(results, (1, 2), strict=True) if code == 0)
    saved = load_checkpoint(out / "last.pt")["config"]
    assert saved["seed"] == winner_seed  # every file is the winner's
    assert f"seed: {winner_seed}" in (out / "config.yaml").read_text()
    assert not (out / ".lock").exists()


def test_a_second_resume_is_refused_and_a_dead_ones_lock_is_taken_over(tmp_path, capsys):
    run = tmp_path / "r"
    fit(load_run("digits", ["train.epochs=1"]), run, quiet=True)
    live = subprocess.Popen(["sleep", "60"])
    try:
        (run / ".lock").write_text(json.dumps({"pid": live.pid, "host": os.uname().nodename,
                                               "start": _start(live.pid), "since": "now"}))  # fmt: skip
        code, _, err = run_cli(["train", "--resume", str(run), "train.epochs=2", "--quiet"], capsys)
        assert "in use by another run" in one_error_line(code, err, (2,))
        code, _, err = run_cli(["train", "digits", "--out", str(run), "--quiet"], capsys)
        assert "in use by another run" in one_error_line(code, err, (2,))  # not "--resume it"
    finally:
        live.kill()
        live.wait()
    # the holder is gone now: its lock is stale and taken over
    code, _, err = run_cli(["train", "--resume", str(run), "train.epochs=2", "--quiet"], capsys)
    assert code == 0, err
    assert load_checkpoint(run / "last.pt")["epoch"] == 2 and not (run / ".lock").exists()


def _start(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def test_killed_before_the_first_checkpoint_resumes_from_the_start(tmp_path, capsys):
    run = tmp_path / "dead"
    fit(load_run("digits", ["train.epochs=1"]), run, quiet=True)
    for name in ("last.pt", "best.pt", "metrics.csv", "summary.json"):
        (run / name).unlink()
    (run / f".last.pt.{os.getpid() + 99999}.tmp").write_bytes(b"")  # an orphan of the kill
    (run / "metrics.csv.tmp").write_bytes(b"")
    (run / f".best_ema.pt.{os.getpid() + 99999}.tmp").write_bytes(b"")
    for mine in ("draft.tmp", ".session.tmp", ".last.pt.notes.tmp"):  # the user's own: kept
        (run / mine).write_text("mine")
    code, _, err = run_cli(["train", "--out", str(run), "digits", "--quiet"], capsys)
    assert code == 2 and "--resume" in err  # the directory holds a run: resume it
    code, _, err = run_cli(["train", "--resume", str(run), "--quiet"], capsys)
    assert code == 0, err
    assert load_checkpoint(run / "last.pt")["epoch"] == 1
    left = sorted(p.name for p in run.glob("*.tmp"))
    assert left == [".last.pt.notes.tmp", ".session.tmp", "draft.tmp"]


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


OVERRIDES = [  # (override, a piece of the message)
    ("train.lr=-1", "train.lr: Input should be greater than 0"),
    ("train.lr=inf", "train.lr: Input should be a finite number"),
    ("train.lr=nan", "train.lr: Input should be a finite number"),
    ("train.lr=fast", "train.lr: Input should be a valid number"),
    ("train.lr=[1, 2]", "train.lr: Input should be a valid number"),
    ("train.epochs=0", "train.epochs: Input should be greater than 0"),
    ("train.epochs=1.5", "train.epochs: Input should be a valid integer"),
    ("train.optimizer=sgdd", "train.optimizer: Input should be 'sgd'"),
    ("train.betas=[2, 3]", "train.betas: each beta must be in [0, 1)"),
    ("train.betas=[0.9]", "train.betas"),
    ("train.min_lr=10", "min_lr 10.0 is above lr"),
    ("train.momentum=1", "train.momentum: Input should be less than 1"),
    ("train.schedule=multistep", "needs train.milestones"),
    ("train.device=tpu", "train.device: 'tpu' is not one of"),
    ("train.precision=fp8", "train.precision: Input should be"),
    ("train.threads=0", "train.threads: Input should be greater than 0"),
    ("train.lrr=0.1", "train.lrr: unknown field (did you mean 'lr'?)"),
    ("train.deterministic=true", "train.deterministic: unknown field (it belongs at the top level"),
    ("train.mixup=0.2", "train.mixup: unknown field (it belongs in data: data.mixup)"),
    ("train.accumulate=1000", "train.accumulate: 1000 micro-batches of a batch of 64 images"),
    ("trian.lr=0.1", "trian: unknown field (did you mean 'train'?)"),
    ("data.batch_size=0", "data.batch_size: Input should be greater than 0"),
    ("data.batch_size=100000", "data.batch_size: 100000 is larger than the training set"),
    ("data.source=imagenet", "data.source: unknown source 'imagenet'"),
    ("data.source=folder", "data.path: Field required"),
    ("data.shift=2", "data.shift: Input should be less than or equal to 0.5"),
    ("data.shfit=0.1", "data.shfit: unknown field (did you mean 'shift'?)"),
    ("name=../../x", "name: use letters, digits"),
    ("name=", "name: use letters, digits"),
    ("model=nosuchnet", "'nosuchnet' is neither a zoo network"),
    ("model.weights=missing.pt", "'missing.pt': no such weights file"),
    ("seed=-1", "seed: Input should be greater than or equal to 0"),
    ("deterministic=maybe", "deterministic: Input should be a valid boolean"),
    ("=5", "expected key=value"),
    ("train", "expected key=value"),
    ("train..lr=1", "expected key=value"),
    ("data=5", "data: Input should be a valid dictionary"),
    ("train.lr.x=1", "lr is not a section"),
]


@pytest.mark.parametrize("override,expected", OVERRIDES, ids=[o for o, _ in OVERRIDES])
def test_bad_override_is_one_line_and_writes_nothing(override, expected, tmp_path, capsys,
                                                     monkeypatch):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    started = time.perf_counter()
    code, _, err = run_cli(["train", "digits", override, "--quiet"], capsys)
    line = one_error_line(code, err, (2,))
    assert expected in line, line
    assert time.perf_counter() - started < 20 and not list(tmp_path.iterdir())  # no runs/


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("tamper") / "run"
    fit(load_run("digits", ["train.epochs=1"]), run, quiet=True)
    return run


def _tampered(state: dict) -> dict[str, dict | bytes]:
    import copy

    def edit(**changes):
        out = copy.copy(state)
        for k, v in changes.items():
            if v is KeyError:
                out.pop(k)
            else:
                out[k] = v
        return out

    pre, cfg = state["preprocess"], state["config"]
    variants = {f"no {k}": edit(**{k: KeyError}) for k in
                ("model_spec", "num_classes", "model", "classes", "preprocess", "config")}  # fmt: skip
    variants.update({
        "epoch a string": edit(epoch="two"), "negative step": edit(step=-3),
        "unknown preprocess key": edit(preprocess={**pre, "gamma": 2.2}),
        "preprocess resize 60000": edit(preprocess={**pre, "resize": 60000}),
        "preprocess std 0": edit(preprocess={**pre, "std": [0.0]}),
        "classes too few": edit(classes=state["classes"][:4]),
        "num_classes 0": edit(num_classes=0), "empty model": edit(model={}),
        "model not tensors": edit(model={"conv1.weight": [1, 2, 3]}),
        "config without data": edit(config={k: v for k, v in cfg.items() if k != "data"}),
        "history of text": edit(history=[{"epoch": "one"}]),
        "wrong format": edit(format="other/1"),
        "weights of another net": edit(model={"x.weight": torch.zeros(2)}),
        "damaged rng": edit(rng={"torch": "x"}, rng_ranks=[{"torch": "x"}]),
        "damaged optimizer": edit(optimizer={"state": {}, "param_groups": "x"}),
        "preprocess channels 2": edit(preprocess={**pre, "channels": 2, "mean": [0.0], "std": [1.0]}),
        "preprocess crop 16": edit(preprocess={**pre, "crop": 16}),
        "train epochs text": edit(config={**cfg, "train": {**cfg.get("train", {}), "epochs": "x"}}),
        "a weight missing": edit(model={k: v for k, v in list(state["model"].items())[1:]}),
        "a nan weight": edit(model={k: v.clone().fill_(float("nan")) if i == 2 else v
                                    for i, (k, v) in enumerate(state["model"].items())}),
    })  # fmt: skip
    buf = io.BytesIO()
    torch.save({"format": "cnnkit-checkpoint/1", "payload": io.BytesIO}, buf)  # a pickled class
    variants.update({"pickled object": buf.getvalue(), "random bytes": os.urandom(4096)})
    return variants


READS = {"damaged rng": ("train",), "damaged optimizer": ("train",),  # the commands that read
         "train epochs text": ("train", "eval"), "preprocess channels 2": ("eval", "classify"),
         "preprocess crop 16": ("eval", "classify")}  # fmt: skip


def test_tampered_checkpoints_are_one_line_never_a_traceback(good_run, tmp_path, capsys):
    state = torch.load(good_run / "last.pt", weights_only=True)
    image = tmp_path / "digit.png"
    from PIL import Image

    Image.new("L", (8, 8), 128).save(image)
    variants = _tampered(state)
    assert len(variants) >= 20
    for name, content in variants.items():
        folder = tmp_path / name.replace(" ", "-")
        folder.mkdir()
        shutil.copy(good_run / "config.yaml", folder / "config.yaml")
        target = folder / "last.pt"
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            torch.save(content, target)
        before = sorted(p.name for p in folder.iterdir())
        for args in (["eval", str(target)], ["classify", str(target), str(image)],
                     ["train", "--resume", str(folder), "--quiet"]):  # fmt: skip
            if name in READS and args[0] not in READS[name]:  # this command reads none of it
                if args[0] != "train":  # (a resume would write: it is not run)
                    code, _, err = run_cli(args, capsys)
                    assert code == 0, (name, args[0], err)
                continue
            code, _, err = run_cli(args, capsys)
            line = one_error_line(code, err)
            assert str(target) in line or "last.pt" in line, (name, line)
            if name == "a weight missing":  # the key is named, not only "Error(s) in loading"
                assert next(iter(state["model"])) in line, line
            if name == "a nan weight":  # named, not predictions of nan (or a run diverging)
                assert f"{list(state['model'])[2]} holds nan or inf" in line, line
        assert sorted(p.name for p in folder.iterdir()) == before, name  # nothing written


def test_config_errors_suggest_the_field_meant():
    with pytest.raises(ConfigError, match=r"train.lrr: unknown field \(did you mean 'lr'\?\)"):
        load_run("digits", ["train.lrr=0.1"])


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
    cmd = [*CLI, "train", "digits", "--out", str(out), "train.epochs=200"]
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


def test_eval_takes_a_safetensors_export_with_data(tmp_path, capsys):
    """A .safetensors export records no data section: eval asks for --data, then evaluates."""
    run = tmp_path / "r"
    fit(load_run("digits", ["train.epochs=1"]), run, quiet=True)
    export = tmp_path / "d.safetensors"
    code, _, err = run_cli(
        ["export", str(run), "--format", "safetensors", "-o", str(export)], capsys
    )
    assert code == 0, err
    code, _, err = run_cli(["eval", str(export)], capsys)
    assert "give --data" in one_error_line(code, err, (2,))
    code, out, err = run_cli(["eval", str(export), "--data", "digits", "--json"], capsys)
    from_export = json.loads(out)
    code, out, _ = run_cli(["eval", str(run), "--json"], capsys)
    assert (
        from_export["top1"] == pytest.approx(json.loads(out)["top1"])
        and from_export["images"] == 359
    )


@pytest.mark.parametrize("command", [["export", "digitnet", "--format", "onnx"],
                                     ["show", "net", "digitnet"]])  # fmt: skip
def test_output_that_is_a_folder_is_one_line(command, tmp_path, capsys):
    code, _, err = run_cli([*command, "-o", str(tmp_path)], capsys)
    assert "is a folder" in one_error_line(code, err, (2,)) and not list(tmp_path.iterdir())


def test_help_and_zoo_start_without_torch():
    """`cnnkit --help` and `cnnkit zoo` stay fast (0.5 s, not 4): the command line imports the
    library only inside the commands that need it."""
    code = ("import sys, contextlib, io, cnnkit.cli as c\n"
            "with contextlib.redirect_stdout(io.StringIO()): c.app(['zoo'], standalone_mode=False)\n"
            "print('torch' in sys.modules)")  # fmt: skip
    done = subprocess.run([*CLI[:1], "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.strip() == "False", done.stderr[-500:]


@pytest.mark.parametrize("args", [["classify", "digitnet", "x.png", "--top", "0"],
                                  ["info", "digitnet", "--num-classes", "abc"],
                                  ["train", "digits", "--no-such-option"], ["no-such-command"],
                                  ["info"], ["info", "digitnet", "--num-classes", "-1"],
                                  ["bench", "train", "digitnet", "--repeats", "0"],
                                  ["bench", "layers", "digitnet", "--threads", "0"],
                                  ["pack", "a", "b", "--workers", "-1"]])  # fmt: skip
def test_a_bad_option_or_command_is_one_line_naming_the_help(args, capsys):
    line = one_error_line(*run_cli(args, capsys)[::2], codes=(2,))
    assert line.endswith("--help)")


def test_unwritable_places_are_one_line(tmp_path, capsys):
    """A path under a file, and a folder nothing can be created in (/proc), before any work."""
    (tmp_path / "afile").write_text("x")
    code, _, err = run_cli(["train", "digits", "--out", str(tmp_path / "afile" / "run")], capsys)
    assert "afile" in one_error_line(code, err)
    if Path("/proc/self").is_dir():
        code, _, err = run_cli(["export", "digitnet", "--format", "onnx", "-o", "/proc/x.onnx"],
                               capsys)  # fmt: skip
        assert "cannot write in /proc" in one_error_line(code, err)
        code, _, err = run_cli(["synth", "shapes", "/proc/cnnkit-synth"], capsys)
        assert "/proc/cnnkit-synth" in one_error_line(code, err)


@pytest.mark.parametrize("group", [[], ["bench"], ["show"]])
def test_a_command_group_alone_shows_its_help_once(group, capsys):
    code, out, _ = run_cli(group, capsys)
    assert code == 2 and out.count("Usage: cnnkit") == 1


def test_end_of_input_inside_a_command_is_one_line_not_an_interrupt(monkeypatch, capsys):
    """typer turns an EOFError (a benchmark peer lost) into Abort: an error, exit 1."""
    from cnnkit.infer import load

    def lost(*args, **kwargs):
        raise EOFError

    monkeypatch.setattr(load, "network_of", lost)
    code, _, err = run_cli(["info", "digitnet"], capsys)
    assert "aborted" in one_error_line(code, err, (1,))


def test_summary_and_config_are_written_whole_or_not_at_all(tmp_path):
    """A write that fails (here: its temporary name is taken by a folder) keeps the old file."""
    import errno

    from cnnkit.config import dump_run
    from cnnkit.runtime import atomic
    from cnnkit.train.metrics import write_summary

    for name, write in (("summary.json", lambda p: write_summary(p, {"a": 1})),
                        ("config.yaml", lambda p: dump_run(load_run("digits"), p))):  # fmt: skip
        path = tmp_path / name
        path.write_text("the good one")
        (tmp_path / f"{name}.tmp").mkdir()
        with pytest.raises(OSError):
            write(path)
        assert path.read_text() == "the good one"
        (tmp_path / f"{name}.tmp").rmdir()
        write(path)
        assert path.read_text() != "the good one"
    with pytest.raises(OSError) as failed, atomic(tmp_path / "x.bin") as f:
        f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert failed.value.filename == str(tmp_path / "x.bin")  # the error line names the file
    assert not list(tmp_path.glob("x.bin*"))


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    """A default run directory is made when chosen (a sweep started in the background does not
    share one), removed again if the run fails before writing; a run that finds another's
    checkpoint in its directory when it takes the lock is refused."""
    from cnnkit.train.run import launch
    from cnnkit.train.rundir import new_run_dir

    monkeypatch.chdir(tmp_path)
    first, second = (new_run_dir("sweep", None, reserve=True) for _ in range(2))
    assert first != second and first.is_dir() and second.is_dir()
    assert second.name.startswith(first.name) and second.name.endswith("-2")
    with pytest.raises(ConfigError, match="does not match the data"):
        launch("digits", ["model=lenet5"], quiet=True)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(
        [first.name, second.name]
    )
    (first / "last.pt").write_bytes(b"another run's")
    with pytest.raises(ConfigError, match="another run wrote there"):
        fit(load_run("digits", ["train.epochs=1"]), first, quiet=True, fresh=True)
    assert (first / "last.pt").read_bytes() == b"another run's"


def test_a_background_sweep_runs_side_by_side(tmp_path):
    cmd = [*CLI, "train", "digits", "train.epochs=1", "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    errors = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all((r / "summary.json").is_file() for r in runs)


def test_a_resume_keeps_an_optimizer_that_can_continue_the_saved_state(digits_run):
    from cnnkit.train.rundir import resume_config

    state = load_checkpoint(digits_run / "last.pt")  # nesterov's momenta
    assert resume_config(state, ["train.optimizer=sgd"]).train.optimizer == "sgd"  # the same
    with pytest.raises(ConfigError, match="train.optimizer=adam cannot continue nesterov's"):
        resume_config(state, ["train.optimizer=adam"])


def test_a_source_that_is_not_a_name_is_one_line(capsys):
    code, _, err = run_cli(["train", "digits", "data.source=[a]"], capsys)
    assert code == 2 and err.strip() == (
        "cnnkit: error: data.source: a name (digits, faces, synthetic, folder, packed), not ['a']"
    )


def _slow_holder(run_dir, said):  # (forked) a run whose lock text takes a second to make
    import cnnkit.train.rundir as rundir

    class Slow:
        loads = staticmethod(json.loads)

        @staticmethod
        def dumps(obj):
            time.sleep(1.0)
            return json.dumps(obj)

        @staticmethod
        def dump(obj, f):
            time.sleep(1.0)
            json.dump(obj, f)

    rundir.json = Slow
    try:
        with rundir.run_lock(run_dir):
            said.put("A holds")
            time.sleep(1.5)
    except ConfigError:
        said.put("A refused")


def test_a_lock_being_written_is_never_taken_for_a_dead_runs(tmp_path):
    """A lock file appears with its owner in it: a second run that meets it while the first is
    still writing it must not read it as empty, call it stale and take it too."""
    import multiprocessing as mp

    from cnnkit.train.rundir import run_lock

    said = mp.get_context("fork").Queue()
    first = mp.get_context("fork").Process(target=_slow_holder, args=(tmp_path, said))
    first.start()
    time.sleep(0.3)
    try:
        with run_lock(tmp_path):
            said.put("B holds")
            time.sleep(1.5)
    except ConfigError:
        said.put("B refused")
    first.join(10)
    events = sorted(said.get(timeout=5) for _ in range(2))
    assert len([e for e in events if e.endswith("holds")]) == 1, events
    assert not list(tmp_path.glob(".lock*")), list(tmp_path.iterdir())


def test_a_batch_of_one_through_a_vector_batchnorm_is_one_line(tmp_path, capsys):
    net = tmp_path / "bn.yaml"
    net.write_text("model:\n  input: [1, 8, 8]\n  layers:\n    - {type: flatten}\n"
                   "    - {type: linear, out_features: 8}\n    - {name: bn, type: batchnorm}\n"
                   "    - {type: linear}\n")  # fmt: skip
    run = tmp_path / "run.yaml"
    run.write_text(f"model: {net}\ndata: {{source: digits, batch_size: 4}}\n"
                   "train: {epochs: 1, calibrate: false}\n")  # fmt: skip
    from cnnkit.train.checks import smallest_chunk

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


def test_config_yaml_names_its_files_from_anywhere(tmp_path, monkeypatch, capsys):
    """A network file relative to the run file, and data folders relative to where training
    started, are written absolute: --resume and `cnnkit config` work from another directory."""
    (tmp_path / "sub").mkdir()
    shutil.copy(ROOT / "cnnkit/zoo/nets/digitnet.yaml", tmp_path / "sub/net.yaml")
    (tmp_path / "sub/run.yaml").write_text("model: net.yaml\ndata: {source: digits}\n"
                                           "train: {epochs: 1, calibrate: false}\n")  # fmt: skip
    monkeypatch.chdir(tmp_path)
    config = load_run("sub/run.yaml", ["train.epochs=1"])
    assert config.model.network == str(tmp_path / "sub/net.yaml")
    folder = load_run(
        {"model": "lenet5", "data": {"source": "folder", "path": "imgs", "val_path": "v"}}
    )
    assert (folder.data.path, folder.data.val_path) == (str(tmp_path / "imgs"), str(tmp_path / "v"))
    shutil.copy(tmp_path / "sub/net.yaml", tmp_path / "here.yaml")  # in the working directory
    assert load_run("digits", ["model=here.yaml"]).model.network == str(tmp_path / "here.yaml")
    faces = load_run("faces", ["data.negatives=neg.npy"])
    assert faces.data.negatives == str(tmp_path / "neg.npy")


def test_a_resume_makes_its_overrides_absolute_and_takes_an_older_runs_relative_folder(
    tmp_path, monkeypatch
):
    from cnnkit.train.rundir import resume_config

    monkeypatch.chdir(tmp_path)
    config = {"name": "r", "model": "lenet5", "data": {"source": "folder", "path": "imgs"}}
    state = {"config": config, "model_spec": "lenet5", "epoch": 1, "step": 0}  # an older run's
    resumed = resume_config(state, ["data.val_path=val", "train.epochs=9"])
    assert resumed.data.path == str(tmp_path / "imgs")
    assert resumed.data.val_path == str(tmp_path / "val")
    resumed = resume_config({**state, "step": 3}, ["train.epochs=9"])  # mid-epoch: the same folder
    assert resumed.data.path == str(tmp_path / "imgs")


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


def test_schedules_this_run_never_reaches_are_said(tmp_path, capsys):
    code, out, err = run_cli(["train", "digits", "train.warmup_epochs=30", "train.schedule=multistep",
                              "train.milestones=[2,25]", "train.calibrate=false", "--dry-run"], capsys)  # fmt: skip
    notes = [
        line for line in err.splitlines() if line.startswith("cnnkit: note:")
    ]  # warnings: stderr
    assert (
        code == 0
        and not [line for line in out.splitlines() if "note:" in line]
        and notes
        == [
            "cnnkit: note: train.warmup_epochs 30 of 25 epochs: the lr never reaches train.lr 0.05",
            "cnnkit: note: train.milestones [25] at or past the last epoch (25): no drop there",
        ]
    ), out + err
    code, out, err = run_cli(["train", "digits", "train.calibrate=false", "--dry-run"], capsys)
    assert code == 0 and "note:" not in out + err
    code, out, err = run_cli(["train", "digits", "train.warmup_epochs=30", "train.epochs=2",
                              "--dry-run", "--quiet"], capsys)  # fmt: skip
    assert (
        code == 0 and "cnnkit: note: train.warmup_epochs 30 of 2 epochs" in err
    )  # --quiet keeps them


def test_a_resume_cannot_end_inside_the_epoch_in_progress(tmp_path, capsys):
    from cnnkit.train.epochs import StopTraining

    def stop(epoch, step, global_step):
        if epoch == 1 and step == 5:
            raise StopTraining

    fit(
        load_run("digits", ["train.epochs=2", "train.calibrate=false"]),
        tmp_path / "r",
        quiet=True,
        on_step=stop,
    )
    assert load_checkpoint(tmp_path / "r/last.pt")["step"] == 5
    code, _, err = run_cli(
        ["train", "--resume", str(tmp_path / "r"), "train.epochs=1", "--quiet"], capsys
    )
    assert "is in the middle of epoch 2 (5 steps done): ask for at least 2" in one_error_line(
        code, err, (2,)
    )


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


def test_a_missing_run_name_points_to_its_newest_dated_run(tmp_path):
    """`cnnkit train digits` writes runs/digits-DATE-TIME: given runs/digits, the error names
    the newest of those (not one of another name)."""
    from cnnkit.errors import CheckpointError
    from cnnkit.infer.load import load_for_inference
    from cnnkit.train.run import resume_state

    for name in ("digits-20261203-101010", "digits-20261203-121010", "digits-20261203-121010-2",
                 "digits-20261203-121010-10", "digitsx-20261203-131010"):  # fmt: skip
        (tmp_path / "runs" / name).mkdir(parents=True)
    newest = tmp_path / "runs" / "digits-20261203-121010-10"  # (after -2: started later)
    for call in (load_for_inference, resume_state):
        with pytest.raises(CheckpointError, match=f"did you mean {newest}, the newest dated run"):
            call(tmp_path / "runs" / "digits")
    with pytest.raises(CheckpointError, match=r"not a run directory \(no last.pt or config.yaml"):
        resume_state(tmp_path / "runs")  # a folder, but not a run's
    with pytest.raises(CheckpointError) as caught:
        load_for_inference(tmp_path / "runs" / "faces")
    assert "did you mean" not in str(caught.value)


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


def test_a_static_rendezvous_run_that_fails_early_leaves_no_empty_run_directory(
    tmp_path, capsys, monkeypatch
):
    """Without --out and torchrun's job id (--rdzv-backend=static) rank 0 makes runs/NAME-TIME
    for every rank: a run that fails before writing there removes it again, as a run alone does."""
    from contextlib import contextmanager

    from PIL import Image

    from cnnkit import distributed

    class StaticRank0(distributed.Local):  # rank 0 of a group with no job id
        def job_value(self, key, make):
            return make()

    @contextmanager
    def group_for(train_cfg):
        yield StaticRank0()

    monkeypatch.setattr(distributed, "group_for", group_for)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    for i in range(3):
        Image.new("L", (12, 12), 80 * i).save(tmp_path / "imgs" / "a" / f"{i}.png")
    (tmp_path / "run.yaml").write_text(
        "name: one\nmodel: lenet5\ndata: {source: folder, path: imgs, val_path: imgs, size: 36, "
        "crop: 32, grey: true, batch_size: 2}\ntrain: {epochs: 1}\n"
    )
    code, _, err = run_cli(["train", "run.yaml"], capsys)
    assert "a classifier needs at least 2" in one_error_line(code, err)
    assert list((tmp_path / "runs").iterdir()) == []


def test_a_folder_or_file_that_is_not_a_checkpoint_says_what_it_is(tmp_path, capsys):
    """eval, classify and show at runs/ itself, a mining run still in its rounds, a run with no
    checkpoint yet, any other folder, or a run's metrics.csv: what it is and what to give."""
    from PIL import Image

    runs = tmp_path / "runs"
    done, mine, old = runs / "done", runs / "mine", runs / "old"
    for run in (done, mine, old, mine / "round-0"):
        run.mkdir(parents=True)
        (run / "config.yaml").write_text("name: x\n")
    for checkpoint in (done / "best.pt", mine / "round-0" / "best.pt"):
        checkpoint.write_bytes(b"")  # (only looked for here, never read)
    (old / "metrics.csv").write_text("epoch,train_loss\n1,0.5\n")
    (tmp_path / "images").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "pic.png")
    said = {
        runs: f"{runs}: holds run directories, not a run of its own: name one, e.g. {done}",
        mine: f"{mine}: a mining run whose rounds have not all finished (the best round's "
        f"checkpoints are copied here at its end): name a round, e.g. {mine / 'round-0'}",
        old: f"{old}: a run with no checkpoint yet (it stopped before saving its first; "
        f"`cnnkit train --resume {old}` continues it)",
        tmp_path / "images": f"{tmp_path / 'images'}: not a run directory (no best.pt or "
        "last.pt in it): give a run directory, a checkpoint (.pt) or a .safetensors export",
        old / "metrics.csv": f"{old / 'metrics.csv'}: a CSV file, not a checkpoint or network: "
        f"give its run directory {old}",
    }
    for target, line in said.items():
        picture = str(tmp_path / "images" / "pic.png")
        for command in (["eval", str(target)], ["classify", str(target), picture],
                        ["show", "filters", str(target), "-o", str(tmp_path / "f.png")]):  # fmt: skip
            code, _, err = run_cli(command, capsys)
            assert one_error_line(code, err) == f"cnnkit: error: {line}", command
