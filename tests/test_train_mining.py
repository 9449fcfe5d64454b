"""Hard-negative mining run by the trainer: mined windows become non-face training patches and
cut the false positives on a face-free picture none was mined from; face pictures are refused; balanced loss; a
mining run resumes where it stopped, callbacks reach every round."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import cnnkit
from cnnkit import mining
from cnnkit.cli.train import train as train_command
from cnnkit.config import dump_run, load_run
from cnnkit.data import data_config
from cnnkit.data.bundled import face_free_picture
from cnnkit.errors import ConfigError, Interrupted
from cnnkit.infer.detect import detect
from cnnkit.infer.load import load_for_inference
from cnnkit.mining import fit_rounds
from cnnkit.nn import build_model
from cnnkit.train.engine import balanced_weights, build_engine

MINING = {"images": ["brick", "grass"], "held_out": ["gravel"], "rounds": 1, "per_image": 20,
          "threshold": 0.5, "max_side": 160}  # fmt: skip


def small_run(**mining) -> dict:
    return {"name": "faces", "model": "facenet", "seed": 0,
            "data": {"source": "faces", "batch_size": 16, "mirror": True,
                     "hard_negatives": {**MINING, **mining}},
            "train": {"epochs": 8, "optimizer": "nesterov", "lr": 0.02, "schedule": "cosine",
                      "class_weights": "balanced", "device": "cpu"}}  # fmt: skip


def test_mining_adds_non_faces_and_cuts_false_positives(tmp_path, capsys):
    summary = fit_rounds(load_run(small_run()), tmp_path / "run", quiet=True)
    said = capsys.readouterr().out.splitlines()  # quiet: the mining run's last line alone
    assert (
        len(said) == 1
        and said[0].startswith("kept round ")
        and said[0].endswith(f"-> {tmp_path / 'run'}")
    ), said
    first, second = summary["rounds"]
    assert first["negatives"] == 0 and second["negatives"] > 0
    mined = np.load(tmp_path / "run" / "negatives-1.npy")
    assert mined.dtype == np.uint8 and mined.shape == (second["negatives"], 25, 25)
    config = yaml.safe_load((tmp_path / "run" / "round-1" / "config.yaml").read_text())
    assert config["data"]["negatives"].endswith("negatives-1.npy")  # a plain run of its own
    gravel = face_free_picture("gravel", 160)  # held out: never mined, only scored
    hits = [len(detect(load_for_inference(tmp_path / "run" / f"round-{r}"), gravel, threshold=0.5))
            for r in (0, 1)]  # fmt: skip
    assert hits[0] > 0 and hits[1] < hits[0], hits
    assert summary["chosen_round"] in (0, 1) and (tmp_path / "run" / "best.pt").is_file()
    assert summary["rounds"][1]["seconds"] > 0 and summary["val_images"] == 50


def test_negatives_file_adds_non_face_training_patches(tmp_path):
    patches = np.full((10, 25, 25), 7, np.uint8)
    np.save(tmp_path / "neg.npy", patches)
    plain = data_config({"source": "faces"}).build(torch.device("cpu"))
    more = data_config({"source": "faces", "negatives": str(tmp_path / "neg.npy")})
    bundle = more.build(torch.device("cpu"))
    assert len(bundle.train.labels) == len(plain.train.labels) + 10
    assert (bundle.train.labels == 0).sum() == (plain.train.labels == 0).sum() + 10
    assert bundle.val.num_samples == plain.val.num_samples == 50  # held-out split unchanged
    assert bundle.preprocess.mean == plain.preprocess.mean  # statistics of the LFW patches


@pytest.mark.parametrize("name", ["astronaut", "camera", "coins"])
def test_pictures_with_faces_are_refused(name):
    with pytest.raises(ConfigError, match="not a face-free picture"):
        data_config({"source": "faces", "hard_negatives": {"images": [name]}})


def test_balanced_loss_equals_weighted_cross_entropy():
    labels = torch.tensor([0] * 30 + [1] * 10)
    cfg = load_run(small_run()).train
    engine = build_engine(build_model("facenet"), cfg, torch.device("cpu"),
                          class_weights=balanced_weights(labels, 2))  # fmt: skip
    logits, y = torch.randn(8, 2), torch.tensor([0, 1, 1, 0, 0, 1, 0, 0])
    weight = torch.tensor([40 / (2 * 30), 40 / (2 * 10)])
    expected = torch.nn.functional.cross_entropy(logits, y, weight=weight)
    torch.testing.assert_close(engine.loss_fn(logits, y), expected)


# resumable mining: small enough for seconds (one picture to mine, one held out, 64 px)
QUICK = {"images": ["brick"], "held_out": ["gravel"], "per_image": 10, "max_side": 64}


def quick_run(rounds: int = 2, epochs: int = 2) -> dict:
    run = small_run(**QUICK, rounds=rounds)
    run["train"].update(epochs=epochs, calibrate=False, threads=1, precision="fp32")
    return run


def interrupt_at(n: int):
    """An on_step hook that presses Ctrl-C at its n-th call (the run stops a step later)."""
    calls = [0]

    def hook(epoch, step, global_step):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGINT)

    return hook, calls


def same_weights(a, b) -> bool:
    first, second = (torch.load(p, weights_only=True)["model"] for p in (a, b))
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def without_seconds(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]


def test_interrupted_mining_run_resumes_to_the_uninterrupted_result(tmp_path, capsys):
    """Ctrl-C in round 1, then `--resume RUN` (here deciding on one round more, 0-2): round 0
    is read back, round 1 goes on from its last.pt, round 2 runs, and RUN ends bitwise as an
    uninterrupted run of rounds 0-2."""
    whole_hook, whole_calls = interrupt_at(0)
    whole = cnnkit.fit(quick_run(), out=tmp_path / "whole", quiet=True, on_step=whole_hook)
    run = tmp_path / "run"
    press, calls = interrupt_at(25)  # round 0 takes 18 steps (150 images, batch 16)
    after_round_0 = []

    def hook(*args):
        if calls[0] == 18:  # round 1's first step next: round 0's time written
            after_round_0.append(json.loads((run / "rounds.json").read_text())["seconds"])
        press(*args)

    with pytest.raises(Interrupted, match=r"round 1: interrupted at epoch 1 step 8 \(saved\)") as e:
        cnnkit.fit(quick_run(rounds=1), out=run, quiet=True, on_step=hook)
    assert str(e.value).endswith(f"resume with `cnnkit train --resume {run}`")
    # the interrupted round's time so far counts too (the resumed run's total was short of it)
    assert json.loads((run / "rounds.json").read_text())["seconds"] > after_round_0[0]
    with pytest.raises(ConfigError, match="already holds a run"):
        cnnkit.fit(quick_run(), out=run, quiet=True)
    with pytest.raises(ConfigError, match="a round of the mining run"):
        cnnkit.fit(resume=run / "round-1", quiet=True)
    before = sorted(p.name for p in run.rglob("*"))
    plan = cnnkit.fit(resume=run, dry_run=True, quiet=True)
    assert plan["rounds_done"] == 1 and plan["resumes_round"]
    assert sorted(p.name for p in run.rglob("*")) == before  # a dry run writes nothing

    resume_hook, resumed_calls = interrupt_at(0)
    more = ["data.hard_negatives.rounds=2"]  # not one of round 1's own settings
    summary = cnnkit.fit(None, more, resume=run, quiet=True, on_step=resume_hook)
    assert calls[0] + resumed_calls[0] == whole_calls[0] - 1  # round 0 not trained again
    assert summary["chosen_round"] == whole["chosen_round"]
    assert without_seconds(summary["rounds"]) == without_seconds(whole["rounds"])
    for name in ("best.pt", "last.pt"):
        assert same_weights(run / name, tmp_path / "whole" / name), name
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["hard_negatives"]

    capsys.readouterr()
    done_hook, done_calls = interrupt_at(0)
    again = cnnkit.fit(resume=run, on_step=done_hook)
    said = capsys.readouterr().out
    assert f"{run}: all 3 mining rounds done, round {summary['chosen_round']} kept" in said
    assert again == json.loads((run / "summary.json").read_text()) and done_calls[0] == 0
    (run / "summary.json").write_text('{"rounds": [')  # killed while the best was kept
    (run / "best.pt").write_bytes(b"half a checkpoint")
    repaired = cnnkit.fit(resume=run, quiet=True, on_step=done_hook)
    assert repaired["rounds"] == again["rounds"] and done_calls[0] == 0  # kept again, no training
    assert same_weights(run / "best.pt", tmp_path / "whole" / "best.pt")


def test_finished_mining_run_resumes_with_more_rounds(tmp_path, monkeypatch):
    """data.hard_negatives.rounds=N on a finished run mines on (later rounds take the other
    overrides too); its finished rounds stay as they were. summary.json's run_dir is
    absolute, as a round's is (given as `run`, it said `run`)."""
    monkeypatch.chdir(tmp_path)
    run = Path("run")
    first = fit_rounds(load_run(quick_run(rounds=1, epochs=1)), run, quiet=True)
    assert first["run_dir"] == str(tmp_path / "run")
    more = cnnkit.fit(None, ["data.hard_negatives.rounds=2", "train.epochs=2"], resume=run,
                      quiet=True)  # fmt: skip
    assert more["rounds"][:2] == first["rounds"] and len(more["rounds"]) == 3
    assert json.loads((run / "round-2" / "summary.json").read_text())["epochs"] == 2
    assert json.loads((run / "round-1" / "summary.json").read_text())["epochs"] == 1
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["data"]["hard_negatives"]["rounds"] == 2 and saved["train"]["epochs"] == 2


def test_callbacks_reach_every_round_and_the_run_stays_locked(tmp_path, capsys):
    """A callback's StopTraining ends that round's training (the mining goes on); while the
    rounds train, the mining run's folder is locked: a resume of it is refused."""
    run, heard = tmp_path / "run", []

    class Stop:
        def on_step_end(self, epoch, step, global_step):
            heard.append((epoch, step, global_step))
            with pytest.raises(ConfigError, match="in use by another run"):
                cnnkit.fit(resume=run, quiet=True)
            raise cnnkit.StopTraining

        def on_epoch_end(self, row):
            heard.append(row)

    summary = cnnkit.fit(quick_run(rounds=1), out=run, callbacks=[Stop()])
    assert heard == [(1, 1, 1), (1, 1, 1)] and summary["chosen_round"] in (0, 1)
    assert "round 1: 10 mined negatives, no epoch trained" in capsys.readouterr().out
    assert [json.loads((run / f"round-{r}" / "summary.json").read_text())["epochs"]
            for r in (0, 1)] == [0, 0]  # fmt: skip


def test_ctrl_c_while_mining_names_the_mining_run(tmp_path, monkeypatch):
    """A Ctrl-C outside a training step (here while scanning for false positives) says how
    to resume the mining run, and the resume mines again and goes on."""
    run = tmp_path / "run"

    def pressed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(mining, "_mine", pressed)
    with pytest.raises(Interrupted, match="interrupted in round 1") as e:
        fit_rounds(load_run(quick_run(rounds=1, epochs=1)), run, quiet=True)
    assert str(e.value).endswith(f"resume with `cnnkit train --resume {run}`")
    monkeypatch.undo()
    summary = cnnkit.fit(resume=run, quiet=True)
    assert [row["round"] for row in summary["rounds"]] == [0, 1] and (run / "best.pt").is_file()

    class Trained(Exception):
        pass

    def first_step(epoch, step, global_step):
        raise Trained(global_step)

    with pytest.raises(Trained, match="^1$"):  # a new run in its folder reads nothing back
        fit_rounds(load_run(quick_run(rounds=1, epochs=1)), run, quiet=True, on_step=first_step)


def test_mining_run_resumed_on_several_processes_is_refused(tmp_path):
    """`cnnkit train --resume RUN --nproc 2` of a mining run: one line, no processes started."""
    run = tmp_path / "run"
    (run).mkdir()
    dump_run(load_run(quick_run()), run / "config.yaml")
    with pytest.raises(ConfigError, match="mining runs in one process"):
        train_command(None, [], None, run, True, 2, 0, False)


def test_a_newly_kept_round_leaves_none_of_the_old_rounds_files(tmp_path):
    """A resume whose best round differs from the one kept before: the run's files are then the
    new round's only (no stale best_ema.pt). TensorBoard's events stay in their rounds' folders
    (a copy made `tensorboard --logdir RUN` show the kept round twice); one an older cnnkit
    copied up goes."""
    for r, files in (
        (0, ("events.out.tfevents.1.a", "best_ema.pt")),
        (1, ("events.out.tfevents.2.b",)),
    ):
        folder = tmp_path / f"round-{r}"
        folder.mkdir()
        for name in (*files, "metrics.csv", "config.yaml"):
            (folder / name).write_text(f"{r}")
        (folder / "summary.json").write_text(json.dumps({"round_made": r}))
    rows = [
        {"round": r, "val_top1": 0.99, "faces_over_clutter": beat}
        for r, beat in ((0, 0.9), (1, 0.1))
    ]
    mining._keep_best(tmp_path, rows, 1.0)
    assert (tmp_path / "best_ema.pt").exists() and not (
        tmp_path / "events.out.tfevents.1.a"
    ).exists()
    (tmp_path / "events.out.tfevents.1.a").write_text("0")  # an older cnnkit's copy
    rows[1]["faces_over_clutter"] = 0.95  # the resumed run's rounds: round 1 now wins
    summary = mining._keep_best(tmp_path, rows, 2.0)
    assert summary["chosen_round"] == 1 and (tmp_path / "metrics.csv").read_text() == "1"
    files = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert files == ["metrics.csv", "summary.json"]


@pytest.mark.parametrize("change,message", [
    ({"held_out": ["brick"]}, "'brick' is mined too"),
    ({"held_out": []}, "mining rounds need held-out face-free pictures"),
])  # fmt: skip
def test_held_out_pictures_are_apart_from_the_mined_ones_and_needed(change, message):
    """A held-out picture also mined would have its false positives trained away and then
    score the round; without any, every round scored 0 and round 0 was always kept."""
    with pytest.raises(ConfigError, match=message):
        load_run(small_run(**change))
    load_run(small_run(held_out=[], rounds=0))  # no rounds: nothing to choose between


@pytest.mark.parametrize("mining_options", [{}, {"random_per_image": 3}])
def test_pictures_shrunk_under_the_smallest_face_are_refused_before_training(tmp_path,
                                                                             mining_options):  # fmt: skip
    """max_side too small for the detector's smallest face: one ConfigError before round 0
    trains (it had trained, then failed with detect's advice; random windows: numpy's
    ValueError), and no run folder."""
    config = load_run(small_run(max_side=30, **mining_options))
    with pytest.raises(ConfigError, match=r"max_side: 30 shrinks the held-out picture gravel to "
                       r"30x30, under the smallest face searched on it \(38 px\); give 38"):  # fmt: skip
        fit_rounds(config, tmp_path / "run", quiet=True)
    assert not (tmp_path / "run").exists()


def test_mined_pictures_need_one_window_and_the_advice_is_enough():
    """Mining scans from one window (25 px), the held-out measure from 1.5 (38): text at 80x31
    was refused; and the max_side advised passes (it had been computed from the shrunk
    picture's rounded aspect: 95 advised, then 101)."""
    from cnnkit.mining import Rounds

    config = load_run(small_run(images=["text"], held_out=["brick"], max_side=80))
    Rounds(config, Path("unused"), True, None, (), resumed=False)  # text 80x31: fine
    config = load_run(small_run(images=["text"], held_out=["brick"], max_side=30))
    with pytest.raises(
        ConfigError, match=r"the mined picture text to 30x12.*give (\d+) or more"
    ) as e:
        Rounds(config, Path("unused"), True, None, (), resumed=False)
    advised = int(re.search(r"give (\d+) or more", str(e.value))[1])
    ok = load_run(small_run(images=["text"], held_out=["brick"], max_side=advised))
    Rounds(ok, Path("unused"), True, None, (), resumed=False)
    short = load_run(small_run(images=["text"], held_out=["brick"], max_side=advised - 1))
    with pytest.raises(ConfigError):
        Rounds(short, Path("unused"), True, None, (), resumed=False)


def test_a_mining_runs_dry_run_says_the_rounds(tmp_path, capsys):
    cnnkit.fit(small_run(), out=tmp_path / "run", dry_run=True)
    out = capsys.readouterr().out
    assert "note: that is round 0 of 2: each later round first scans 2 face-free pictures" in out
    assert "1 held-out picture chooses the round kept" in out and not (tmp_path / "run").exists()
