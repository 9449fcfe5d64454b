"""Checkpoints and --resume on a finished one-epoch run: checkpoints are data, never code,
loaded or refused clearly; what a resume keeps (config, summary, the optimizer settings
given, each rank's stream) and what it refuses in one line, writing nothing."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import RESUME_RUN as RUN
from helpers import run_cli

from cnnkit.checkpoint import FORMAT, load_checkpoint, load_trained, save_checkpoint
from cnnkit.config import validate_run
from cnnkit.errors import CheckpointError, ConfigError
from cnnkit.train.run import fit, resume_state


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    fit(validate_run({**RUN, "train": {**RUN["train"], "epochs": 1}}), run, quiet=True)
    return run


def test_checkpoint_holding_a_pickled_object_is_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("this must never run",))

    torch.save({"format": FORMAT, "model": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="refused"):
        load_checkpoint(tmp_path / "evil.pt")


def test_truncated_and_foreign_checkpoints_are_clear_errors(tmp_path, finished_run):
    run = finished_run
    data = (run / "last.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match="a zip archive, but truncated, damaged"):
        load_checkpoint(tmp_path / "cut.pt")
    torch.save({"weights": torch.zeros(3)}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a cnnkit checkpoint .*: a bare state_dict, as "
                                              "torchvision and timm publish: give it as weights:"):  # fmt: skip
        load_checkpoint(tmp_path / "foreign.pt")
    torch.save({"epoch": 3}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match=r"not a cnnkit checkpoint \(expected .*/1'\)$"):
        load_checkpoint(tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="no such run directory"):
        resume_state(tmp_path / "nowhere")


def test_load_trained_gives_the_trained_network(finished_run):
    run = finished_run
    network, meta = load_trained(run)
    state = load_checkpoint(run / "best.pt")
    assert not network.training and meta["classes"] == state["classes"]
    for k, v in network.state_dict().items():
        assert torch.equal(v, state["model"][k])
    assert meta["preprocess"]["crop"] == 8 and meta["config"]["name"] == "tiny"


def test_save_is_atomic_and_leaves_no_temporary(tmp_path):
    save_checkpoint({"x": torch.ones(2)}, tmp_path / "a.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]


@pytest.mark.parametrize("before, after", [("sgd", "nesterov"), ("adam", "adamw")])
def test_a_resume_trains_with_the_overridden_optimizer_settings(finished_run, before, after):
    """train.weight_decay / momentum / betas / optimizer given on --resume are the ones used
    (torch's load_state_dict put the saved ones back); the saved moments carry over."""
    from cnnkit.nn import build_model
    from cnnkit.train.optim import build_optimizer
    from cnnkit.train.state import load_optimizer

    def optimizer(kind, **train):
        cfg = validate_run({**RUN, "train": {**RUN["train"], "optimizer": kind, **train}})
        torch.manual_seed(0)
        return build_optimizer(build_model("digitnet", num_classes=4), cfg.train)

    saved = optimizer(before)
    for p in saved.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    saved.step()
    resumed = optimizer(after, weight_decay=0.05, momentum=0.5, betas=[0.8, 0.9])
    load_optimizer(resumed, copy.deepcopy(saved.state_dict()))
    group = resumed.param_groups[0]
    assert group["weight_decay"] == 0.05
    if after == "nesterov":
        assert group["nesterov"] and group["momentum"] == 0.5
    else:
        assert group["betas"] == (0.8, 0.9) and group["decoupled_weight_decay"]
    p = group["params"][0]
    assert resumed.state[p].keys() == saved.state[saved.param_groups[0]["params"][0]].keys()


def test_a_resume_with_nothing_left_leaves_config_yaml_as_last_pt_has_it(finished_run, tmp_path):
    """Nothing is trained, so no checkpoint takes the overrides: config.yaml must not either
    (the next resume runs with last.pt's config and would quietly write it back)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = (run / "config.yaml").read_text()
    again = validate_run({**RUN, "train": {**RUN["train"], "epochs": 1, "lr": 0.3}})
    wall = json.loads((run / "summary.json").read_text())["wall_seconds"]
    summary = fit(again, run, resume=resume_state(run), quiet=True)
    assert (run / "config.yaml").read_text() == before
    assert summary["wall_seconds"] == wall  # nothing trained: no time added


def test_a_dry_run_of_a_finished_run_says_it_would_train_nothing(finished_run, capsys):
    """The dry run said '... steps an epoch from epoch 2; would write RUN' where the resume
    itself trains nothing (all epochs done); with more epochs it says where it would start."""
    code, out, err = run_cli(["train", "--resume", str(finished_run), "--dry-run"], capsys)
    assert code == 0 and "its 1 epoch done: would train nothing (train.epochs=N for more)" in out
    assert "from epoch" not in out, out
    code, out, _ = run_cli(["train", "--resume", str(finished_run), "--dry-run",
                            "train.epochs=2"], capsys)  # fmt: skip
    assert code == 0 and "an epoch from epoch 2; would write" in out, out


def test_a_resumed_session_that_does_not_finish_leaves_no_stale_summary(finished_run, tmp_path):
    """summary.json is a finished session's: one that trains on and stops early (Ctrl-C, an
    error) must not leave the earlier session's figures beside its newer metrics and last.pt."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    assert (run / "summary.json").is_file()

    def fail(epoch, step, global_step):
        if global_step == 12:
            raise RuntimeError("stopped")

    more = validate_run({**RUN, "train": {**RUN["train"], "epochs": 2}})
    with pytest.raises(RuntimeError, match="stopped"):
        fit(more, run, resume=resume_state(run), quiet=True, on_step=fail)
    assert not (run / "summary.json").exists()
    fit(more, run, resume=resume_state(run), quiet=True)
    assert (run / "summary.json").is_file()


def test_a_mid_epoch_resume_refuses_what_changes_the_epochs_order(finished_run):
    from cnnkit.errors import ConfigError
    from cnnkit.train.rundir import resume_config

    state = {**load_checkpoint(finished_run / "last.pt"), "epoch": 1, "step": 4}
    for override, name in (("data.batch_size=8", "data.batch_size"), ("seed=4", "seed"),
                           ("data.train_size=64", "data.train_size")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"--resume: {name} changes the order of the epoch "
                                              r"in progress \(epoch 2, 4 steps of it done\)"):  # fmt: skip
            resume_config(state, [override])
    assert resume_config(state, ["data.eval_batch_size=7", "train.epochs=3"]).train.epochs == 3
    assert resume_config(state, ["data.mixup=0.2"]).data.mixup == 0.2  # each batch's: same order
    digits = {**state, "config": {**state["config"], "data": {"source": "digits",
                                                              "batch_size": 16}}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"--resume: data.split_seed changes the run's held-out "
                                          r"images: .*resume with the data as it was"):  # fmt: skip
        resume_config(digits, ["data.split_seed=1"])
    for override in ("model.network=lenet5", "model=digitnet"):  # it said 'model.name: unknown'
        with pytest.raises(ConfigError, match="cannot change: a resumed run keeps its network"):
            resume_config(state, [override])
    assert resume_config({**state, "step": 0}, ["data.batch_size=8"]).data.batch_size == 8
    damaged = {**state, "step": 1_000_000, "global_step": 1_000_000}
    with pytest.raises(CheckpointError, match="step 1000000 of epoch 2 .* 8 steps an epoch"):
        fit(validate_run({**RUN, "train": {**RUN["train"], "epochs": 3}}), finished_run.parent /
            "again", resume=damaged, quiet=True)  # fmt: skip


def test_a_resume_asking_for_fewer_epochs_than_done_is_refused_writing_nothing(finished_run,
                                                                                tmp_path):  # fmt: skip
    """It said 'all 2 epochs done' and rewrote config.yaml to 2 while last.pt and
    summary.json held more."""
    import shutil

    from cnnkit.errors import ConfigError

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    state = {**load_checkpoint(run / "last.pt"), "epoch": 3}  # as if 3 epochs were done
    with pytest.raises(ConfigError, match=r"train.epochs=2: .*run has done 3 epochs already"):
        fit(validate_run({**RUN, "train": {**RUN["train"], "epochs": 2}}), run, resume=state,
            quiet=True)  # fmt: skip
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_resuming_a_finished_run_adds_no_tensorboard_file(finished_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = sorted(p.name for p in run.glob("events.out.tfevents.*"))
    state = load_checkpoint(run / "last.pt")
    fit(validate_run({**RUN, "train": {**RUN["train"], "epochs": 1}}), run, resume=state,
        quiet=True)  # fmt: skip
    assert sorted(p.name for p in run.glob("events.out.tfevents.*")) == before


def test_a_dry_run_of_nproc_n_takes_a_mid_epoch_checkpoint_of_n(finished_run, tmp_path, capsys):
    """It ran as one process and refused, asking for the --nproc it was given."""
    import shutil

    from helpers import run_cli

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    state = load_checkpoint(run / "last.pt")
    state.update(epoch=0, step=3, global_step=3, rng_ranks=[state["rng"]] * 2)
    save_checkpoint(state, run / "last.pt")
    code, out, err = run_cli(["train", "--resume", str(run), "--nproc", "2", "--dry-run"], capsys)
    assert code == 0 and "2 processes" in out, err
    code, _, err = run_cli(["train", "--resume", str(run), "--dry-run"], capsys)
    assert code == 2 and "saved by 2 process(es) in the middle of epoch 1" in err


def test_a_resume_on_more_processes_gives_each_rank_a_stream_of_its_own(finished_run):
    """A 1-process checkpoint resumed by 2 ranks: torch's generator differs between the ranks
    (mixup, dropout), and each rank's is the same from one resume to the next."""
    from types import SimpleNamespace

    from cnnkit.train.loop import Progress
    from cnnkit.train.run import _restore_rank

    state = load_checkpoint(finished_run / "last.pt")
    assert len(state["rng_ranks"]) == 1

    def first_draws(rank: int, world: int = 2) -> torch.Tensor:
        _restore_rank(state, SimpleNamespace(rank=rank, world_size=world), Progress(),
                      SimpleNamespace(ema=None))  # fmt: skip
        return torch.rand(4)

    zero, one = first_draws(0), first_draws(1)
    assert not torch.equal(zero, one)
    assert torch.equal(first_draws(1), one) and torch.equal(first_draws(0), zero)
    torch.set_rng_state(state["rng"]["torch"])
    saved = torch.rand(4)
    assert torch.equal(first_draws(0, world=1), saved)  # one process: exactly the saved one


@pytest.mark.parametrize("rank,said", [("0", True), ("1", False)])
def test_the_no_checkpoint_yet_notice_is_rank_0s_alone(finished_run, tmp_path, capsys,
                                                       monkeypatch, rank, said):  # fmt: skip
    """A run that died before its first checkpoint starts over: said once, by rank 0 (under
    --nproc every rank reads the same run directory)."""
    import shutil

    from helpers import run_cli

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(finished_run / "config.yaml", run / "config.yaml")
    monkeypatch.setenv("RANK", rank)  # this rank alone: its group is not what is checked here
    monkeypatch.setattr("cnnkit.distributed.group.launched", lambda: False)
    code, _, err = run_cli(["train", "--resume", str(run), "--dry-run"], capsys)
    assert code == 0, err
    assert ("no checkpoint yet: the run starts again from the beginning" in err) == said


def _copy_run(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to)
    return to


def test_a_run_that_lost_its_last_pt_is_refused_not_started_over(finished_run, tmp_path, capsys):
    """Its best.pt and metrics would be overwritten by a run from epoch 1 (exit 0, a line on
    stdout): refused with one line, nothing touched."""
    from helpers import one_error_line, run_cli

    run = _copy_run(finished_run, tmp_path / "run")
    (run / "last.pt").unlink()
    before = {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()}
    code, _, err = run_cli(["train", "--resume", str(run), "--quiet"], capsys)
    assert code == 1 and "last.pt is missing, yet the run trained (best.pt, summary.json, " \
        "metrics.csv: 1 epoch)" in one_error_line(code, err)  # fmt: skip
    assert {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()} == before


def test_resume_names_what_to_give_for_a_checkpoint_file(finished_run, tmp_path):
    with pytest.raises(CheckpointError, match=r"best.pt: give the run directory \(.*\); to train "
                                              r"on from these weights as a new run, give it "
                                              r"model.weights=.*best.pt$"):  # fmt: skip
        resume_state(finished_run / "best.pt")
    run = _copy_run(finished_run, tmp_path / "run")
    (run / "best.pt").replace(run / "last.pt")  # weights alone, where last.pt should be
    with pytest.raises(CheckpointError, match="last.pt: holds the weights alone"):
        resume_state(run)


def test_a_resume_on_other_classes_or_another_held_out_split_is_refused(finished_run, tmp_path,
                                                                        capsys):  # fmt: skip
    """A renamed class folder would shift the labels after it; another split would count images
    the run trained on as held out: both refused before anything is written."""
    from helpers import one_error_line, run_cli

    from cnnkit.train.checks import check_same_data

    state = load_checkpoint(finished_run / "last.pt")
    data = SimpleNamespace(classes=list(state["classes"]), holdout=None)
    check_same_data(state, data, finished_run)  # the same: fine
    renamed = SimpleNamespace(classes=[*state["classes"][:-1], "kitty"], holdout=None)
    with pytest.raises(ConfigError, match=rf"4 classes are not the 4 the run trained on \(gone: "
                                          rf"{state['classes'][-1]}; new: kitty\)"):  # fmt: skip
        check_same_data(state, renamed, finished_run)
    run = _copy_run(finished_run, tmp_path / "run")
    state["holdout"] = "0123456789abcdef"  # as a split drawn from a folder's images records
    save_checkpoint(state, run / "last.pt")
    before = (run / "metrics.csv").read_bytes()
    code, _, err = run_cli(["train", "--resume", str(run), "train.epochs=2"], capsys)
    assert code == 2 and "the held-out images differ from the run's" in \
        one_error_line(code, err)  # fmt: skip
    assert (run / "metrics.csv").read_bytes() == before


def test_resuming_a_finished_run_keeps_its_summary(finished_run, tmp_path, capsys):
    """Nothing trains: summary.json keeps the run's wall time (last.pt's stops short of it)."""
    import json

    from helpers import run_cli

    run = _copy_run(finished_run, tmp_path / "run")
    before = json.loads((run / "summary.json").read_text())
    code, out, err = run_cli(["train", "--resume", str(run)], capsys)
    assert code == 0 and "its 1 epoch done (train.epochs=N for more)" in out, err
    assert json.loads((run / "summary.json").read_text()) == {**before, "run_dir": str(run)}


@pytest.mark.parametrize("packed", [False, True], ids=["folder", "packed"])
def test_a_resume_that_trades_val_path_for_a_drawn_split_is_refused(packed, tmp_path, capsys):
    """A run evaluated on data.val_path kept no split to compare: `--resume RUN
    data.val_path=null` held out images of data.path, which it had trained on, and chose its
    best.pt across the two. Refused in one line, nothing written; the run's own eval agrees."""
    from helpers import one_error_line, run_cli

    from cnnkit.data.synth import synth_shapes

    for name in ("train", "val"):
        synth_shapes(tmp_path / name, classes=2, per_class=6, size=24, workers=1)
        if packed:
            assert run_cli(["pack", str(tmp_path / name), str(tmp_path / f"{name}.pack"),
                            "--size", "24"], capsys)[0] == 0  # fmt: skip
    suffix = ".pack" if packed else ""
    data = {"source": "packed" if packed else "folder", "path": str(tmp_path / f"train{suffix}"),
            "val_path": str(tmp_path / f"val{suffix}"), "crop": 16, "batch_size": 4,
            "workers": 0, **({} if packed else {"size": 24})}  # fmt: skip
    run = tmp_path / "run"
    config = {"name": "v", "model": {"input": [3, 16, 16], "layers": [
        {"type": "conv", "out_channels": 4, "kernel_size": 3}, {"type": "global_avgpool"},
        {"type": "linear"}]}, "data": data, "train": {"epochs": 1}}  # fmt: skip
    fit(validate_run(config), run, quiet=True)
    assert load_checkpoint(run / "last.pt")["holdout"] == "val_path"
    before = (run / "metrics.csv").read_bytes()
    code, _, err = run_cli(["train", "--resume", str(run), "train.epochs=2",
                            "data.val_path=null"], capsys)  # fmt: skip
    assert code == 2 and "the run was evaluated on data.val_path, and the data now holds out " \
        "images of data.path, which it trained on" in one_error_line(code, err)  # fmt: skip
    assert (run / "metrics.csv").read_bytes() == before
    code, _, err = run_cli(["train", "--resume", str(run), "train.epochs=2", "--quiet"], capsys)
    assert code == 0, err  # the same val_path: resumed


def test_a_resume_refused_for_shared_memory_leaves_the_run_as_it_was(shapes, tmp_path, monkeypatch):
    """A /dev/shm too small for the loader's ring (a container's 64 MB) is found when the data
    is built, before the run directory is touched: it was found when the first epoch started,
    after config.yaml had taken the refused settings and the finished summary.json was gone."""
    import os

    from cnnkit.errors import DataError

    run = {"name": "f", "model": {"input": [3, 16, 16], "layers": [
        {"type": "conv", "out_channels": 4, "kernel_size": 3}, {"type": "global_avgpool"},
        {"type": "linear"}]}, "data": {"source": "folder", "path": str(shapes), "size": 16,
        "crop": 16, "batch_size": 4, "workers": 1}, "train": {"epochs": 1}}  # fmt: skip
    fit(validate_run(run), tmp_path / "r", quiet=True)
    before = {f.name: f.read_bytes() for f in (tmp_path / "r").iterdir() if f.is_file()}
    real = os.statvfs

    class Tiny:
        f_bavail, f_frsize = 16, 4096  # 64 KiB free

    monkeypatch.setattr(os, "statvfs", lambda p: Tiny() if p == "/dev/shm" else real(p))
    state = resume_state(tmp_path / "r")
    with pytest.raises(DataError, match=r"needs .* MiB of shared memory .*--shm-size"):
        fit(validate_run({**run, "train": {"epochs": 2}}), tmp_path / "r", resume=state)
    after = {f.name: f.read_bytes() for f in (tmp_path / "r").iterdir() if f.is_file()}
    assert after == before


def test_cnnkit_config_of_a_run_directory_says_what_an_edit_changed(finished_run, tmp_path,
                                                                    capsys):  # fmt: skip
    """`cnnkit config RUN_DIR` names an edit as a resume would refuse it; an edit that changes
    no setting (a comment) is no note; a last.pt unreadable here leaves the edit alone said."""
    import shutil

    from helpers import run_cli

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text + "# tried lr 0.5 on 2026-12-07\n")
    code, _, err = run_cli(["config", str(run)], capsys)
    assert code == 0 and err == ""
    lr = load_checkpoint(run / "last.pt")["config"]["train"]["lr"]
    (run / "config.yaml").write_text(text.replace(f"  lr: {lr}\n", "  lr: 0.5\n"))
    code, _, err = run_cli(["config", str(run)], capsys)
    assert code == 0 and err == (
        f"cnnkit: note: {run / 'config.yaml'}: edited since the run wrote it (train.lr: 0.5 there, "
        f"{lr} in last.pt): a resume continues last.pt's settings, changed by key=value overrides "
        "only: give train.lr=0.5, or undo the edit (shown as edited below)\n")  # fmt: skip
    (run / "last.pt").write_bytes(b"not a checkpoint")
    code, _, err = run_cli(["config", str(run)], capsys)
    assert code == 0 and err.startswith(
        f"cnnkit: note: {run / 'config.yaml'} was edited since the run wrote it: shown as edited"
    )


def test_an_edit_of_config_yaml_is_refused_until_given_as_an_override(finished_run, tmp_path,
                                                                       capsys):  # fmt: skip
    """A resume takes last.pt's settings: an edited config.yaml was silently not used, then
    written over. The edit is named with the override that makes it; given, the run goes on."""
    import shutil

    from helpers import run_cli

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    text = (run / "config.yaml").read_text()
    lr = load_checkpoint(run / "last.pt")["config"]["train"]["lr"]
    (run / "config.yaml").write_text(text.replace(f"  lr: {lr}\n", "  lr: 0.5\n"))
    argv = ["train", "--resume", str(run), "train.epochs=2", "--quiet"]
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and err.strip() == (
        f"cnnkit: error: {run / 'config.yaml'}: edited since the run wrote it (train.lr: 0.5 "
        f"there, {lr} in last.pt): a resume continues last.pt's settings, changed by key=value "
        "overrides only: give train.lr=0.5, or undo the edit")  # fmt: skip
    seed = load_checkpoint(run / "last.pt")["config"]["seed"]
    (run / "config.yaml").write_text(text.replace(f"  lr: {lr}\n", "  lr: 0.5\n").replace(
        f"seed: {seed}\n", "seed: 11\n"))  # fmt: skip
    code, _, err = run_cli(argv, capsys)  # every edit in one line, not one a try
    assert code == 2 and "(seed: 11 there, " in err and "; train.lr: 0.5 there, " in err, err
    assert "give seed=11 train.lr=0.5, or undo the edit" in err
    assert load_checkpoint(run / "last.pt")["epoch"] == 1  # nothing trained, nothing written
    code, out, err = run_cli(["config", str(run)], capsys)  # the edit named, as resume names it
    assert code == 0 and err.startswith(
        f"cnnkit: note: {run / 'config.yaml'}: edited since the run wrote it (seed: 11 there, "
    )
    assert "give seed=11 train.lr=0.5, or undo the edit (shown as edited below)" in err
    assert " 0.5 " in out  # the table shows the edit
    (run / "config.yaml").write_text(text.replace(f"  lr: {lr}\n", "  lr: 1e-2\n"))
    code, _, err = run_cli(argv, capsys)  # read as a run file reads it: the number 0.01
    assert code == 2 and "edited since the run wrote it (train.lr: 0.01 there" in err, err
    assert "give train.lr=0.01, or undo the edit" in err
    code, _, err = run_cli([*argv[:-1], "train.lr=1e-2", "--dry-run"], capsys)  # as advised
    assert code == 0, err
    code, _, err = run_cli([*argv, "train.lr=0.3"], capsys)  # an override given wins
    assert code == 0, err
    assert load_checkpoint(run / "last.pt")["config"]["train"]["lr"] == 0.3
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace(
        "model:", "model: resnet18\nx:", 1))  # fmt: skip
    code, _, err = run_cli([*argv[:-2], "train.epochs=3"], capsys)
    assert code == 2 and "model: edited since the run wrote it, but a resumed run keeps" in err


def test_a_last_pt_of_another_run_is_refused(finished_run, tmp_path):
    """A last.pt copied in from another run trained on, replacing this run's best.pt and
    metrics; one an epoch behind its own best.pt (a kill between the two writes) resumes."""
    import shutil

    run, other = tmp_path / "run", tmp_path / "other"
    shutil.copytree(finished_run, run)
    fit(validate_run({**RUN, "train": {**RUN["train"], "epochs": 1}}), other, quiet=True)  # alike
    behind = (run / "last.pt").read_bytes()
    shutil.copy(other / "last.pt", run / "last.pt")
    with pytest.raises(CheckpointError, match="last.pt: not this run's checkpoint"):
        resume_state(run)
    (run / "last.pt").write_bytes(behind)
    config = validate_run({**RUN, "train": {**RUN["train"], "epochs": 2}})
    fit(config, run, resume=resume_state(run), quiet=True)
    ahead = load_checkpoint(run / "last.pt")  # as if epoch 2 were the best, and then trained
    ahead["history"][-1]["seconds"] += 1.0  # again after a kill, a little slower
    save_checkpoint(ahead, run / "best.pt")
    (run / "last.pt").write_bytes(behind)  # the epoch-1 state beside it
    assert resume_state(run)["epoch"] == 1
    for state in (ahead, load_checkpoint(run / "last.pt")):  # an older run's: no run ids
        del state["run_id"]
    save_checkpoint(ahead, run / "best.pt")
    assert resume_state(run)["epoch"] == 1


def test_a_ctrl_c_once_the_last_step_is_done_lets_the_run_finish(tmp_path, monkeypatch):
    """A Ctrl-C after the last epoch's save, while the curves and summary.json are written,
    ended the run at once ("interrupted", no summary.json, no resume hint); the first one
    there lets it finish, as one during the epochs lets it save and stop."""
    import os
    import signal

    import cnnkit.train.run as run_module

    finish = run_module.finish

    def pressed_first(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # (the handler runs before the next line)
        return finish(*args, **kwargs)

    monkeypatch.setattr(run_module, "finish", pressed_first)
    monkeypatch.chdir(tmp_path)
    result = fit(validate_run({**RUN, "train": {**RUN["train"], "epochs": 1}}), "r", quiet=True)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["epochs"] == result["epochs"] == 1 and summary["val_top1"] == result["val_top1"]
    assert summary["run_dir"] == str(tmp_path / "r")  # absolute, as config.yaml's paths are
