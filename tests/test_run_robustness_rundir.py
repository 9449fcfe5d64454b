"""Run directories that never lose or mix up a run: one writer each (a second one is refused,
a dead one's lock taken over), files written whole or not at all, a run killed before its
first checkpoint resumed from the start, paths kept absolute, and a path that is no run's
said for what it is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest
import yaml
from helpers import CLI, RESUME_RUN, ROOT, one_error_line, run_cli

from cnnkit.checkpoint import load_checkpoint
from cnnkit.config import load_run
from cnnkit.errors import ConfigError
from cnnkit.train.run import fit


@pytest.mark.slow
def test_two_runs_into_one_directory_one_is_refused(tmp_path):
    out = tmp_path / "same"
    # (train.calibrate=false: both measured the same settings first, seconds each)
    cmd = [*CLI, "train", "digits", "--out", str(out), "train.epochs=1", "--quiet",
           "train.calibrate=false"]  # fmt: skip
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


def test_a_run_record_that_cannot_be_replaced_is_named_and_leaves_no_temporary(tmp_path):
    """metrics.csv and curves.png as a folder: the error named metrics.csv.tmp and left it."""
    from cnnkit.train.metrics import COLUMNS, plot_curves, write_csv

    row = {**dict.fromkeys(COLUMNS, 0.5), "epoch": 1}
    for name, write in (("metrics.csv", lambda p: write_csv(p, [row])),
                        ("curves.png", lambda p: plot_curves([row], p))):  # fmt: skip
        (tmp_path / name).mkdir()
        with pytest.raises(OSError) as failed:
            write(tmp_path / name)
        assert failed.value.filename == str(tmp_path / name)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            n for n in ("metrics.csv", "curves.png") if (tmp_path / n).exists()
        )


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


@pytest.mark.slow
def test_a_background_sweep_runs_side_by_side(tmp_path):
    run = {
        **RESUME_RUN,
        "name": "sweep",
        "train": {"epochs": 1, "calibrate": False},
        "deterministic": False,
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    cmd = [*CLI, "train", "run.yaml", "--quiet"]
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
    # norm / bias decay given where it was not: other parameter groups than last.pt's
    with pytest.raises(ConfigError, match=r"train.norm_weight_decay=0 regroups the optimizer's "
                       r"state in last.pt, saved with it left out"):  # fmt: skip
        resume_config(state, ["train.norm_weight_decay=0"])
    assert resume_config(state, ["train.weight_decay=0"]).train.weight_decay == 0  # the same


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


def test_a_live_run_keeps_its_lock_from_a_job_of_the_same_id(tmp_path):
    """A second torchrun given the run's --rdzv-id (a README example's fixed ax1) took over the
    lock of a run still training on this host, and both wrote the directory; it is refused
    now. A dead holder's lock, of the same job or not, is taken over, and another host's of
    the same job too (an elastic restart there, a requeued job: its pid cannot be checked)."""
    import socket

    from cnnkit.train.rundir import LOCK, in_use, run_lock

    with run_lock(tmp_path, job="ax1"):
        assert "in use by another run" in in_use(tmp_path, job="ax1")
        with pytest.raises(ConfigError, match="in use by another run"), run_lock(tmp_path, "ax1"):
            pass
    holder = {"pid": 2**22 + 7, "host": socket.gethostname(), "start": "1", "job": "ax1"}
    (tmp_path / LOCK).write_text(json.dumps(holder))  # a dead process's
    assert in_use(tmp_path, job="ax1") is None and in_use(tmp_path) is None
    (tmp_path / LOCK).write_text(json.dumps({**holder, "host": "elsewhere", "pid": 1}))
    assert in_use(tmp_path, job="ax1") is None and "in use" in in_use(tmp_path, job="ax2")


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


def test_a_resume_cannot_end_inside_the_epoch_in_progress(tmp_path, capsys):
    from cnnkit.train.epochs import StopTraining

    def stop(epoch, step, global_step):
        if epoch == 2 and step == 5:  # (from 1, as logged)
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
    shutil.copytree(tmp_path / "imgs", tmp_path / "val")
    (tmp_path / "run.yaml").write_text(
        "name: one\nmodel: lenet5\ndata: {source: folder, path: imgs, val_path: val, size: 36, "
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
        old: f"{old}: best.pt and last.pt are missing, yet the run trained (metrics.csv: 1 "
        "epoch): put them back (`--resume` refuses the run too: starting it again would "
        "overwrite them)",
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


def test_eval_judges_a_run_without_checkpoints_as_resume_does(tmp_path, capsys):
    """A run that trained and lost best.pt and last.pt: eval does not advise the `--resume` that
    refuses it; one stopped before its first checkpoint: eval's advice is what --resume does."""
    from cnnkit.errors import CheckpointError
    from cnnkit.train.rundir import resume_state

    trained, stopped = tmp_path / "trained", tmp_path / "stopped"
    for run in (trained, stopped):
        run.mkdir()
        (run / "config.yaml").write_text("name: x\n")
    (trained / "summary.json").write_text("{}")
    code, _, err = run_cli(["eval", str(trained)], capsys)
    assert "yet the run trained (summary.json)" in one_error_line(code, err)
    assert "`--resume` refuses the run too" in err
    with pytest.raises(CheckpointError, match="yet the run trained"):
        resume_state(trained)
    code, _, err = run_cli(["eval", str(stopped)], capsys)
    assert f"`cnnkit train --resume {stopped}` starts it again" in one_error_line(code, err)
    assert resume_state(stopped) is None  # started again, as eval said
