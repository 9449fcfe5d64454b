"""Recipe pieces of the anchors (timm, torchvision's references): a moving average of the
weights evaluated and saved beside them, mixup / cutmix, RandAugment / TrivialAugment, random
erasing, early stopping, and callbacks of the Python API."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import cnnkit
from cnnkit.checkpoint import load_checkpoint
from cnnkit.config import TrainConfig, load_run
from cnnkit.nn import build_model
from cnnkit.train.engine import build_engine, train_step
from cnnkit.train.recipe import BatchRecipe, random_erasing
from cnnkit.train.run import fit

CPU = torch.device("cpu")


def test_ema_follows_the_exponential_average_of_the_weights():
    torch.manual_seed(0)
    engine = build_engine(build_model("facenet"), TrainConfig(ema=0.9, precision="fp32"), CPU)
    x, y = torch.randn(8, 1, 25, 25), torch.randint(0, 2, (8,))
    expected = None
    for _ in range(3):
        train_step(engine, x, y)
        w = engine.network.c1.weight.detach().clone()
        expected = w if expected is None else 0.9 * expected + 0.1 * w  # the first step copies
    torch.testing.assert_close(engine.ema.module.c1.weight, expected)


def test_ema_equals_torchs_averaged_model_to_the_bit_buffers_included():
    """cnnkit's EMA (no device sync per step) against torch's AveragedModel with
    get_ema_multi_avg_fn: every weight, BatchNorm statistic and count equal."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from cnnkit.train.recipe import EMA

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                              torch.nn.Flatten(), torch.nn.Linear(144, 5))  # fmt: skip
    theirs = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    ours = EMA(net, 0.9)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(4):
        net(torch.randn(4, 3, 8, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        theirs.update_parameters(net)
        ours.update_parameters(net)
    expected = theirs.state_dict()
    assert list(ours.state_dict()) == list(expected) and int(ours.n_averaged) == 4
    for key, value in ours.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_ema_is_evaluated_saved_and_resumed(tmp_path, capsys):
    class StopAfterFirstEpoch:
        def on_epoch_end(self, row):
            raise cnnkit.StopTraining

    base = ["train.ema=0.95", "train.epochs=2", "data.batch_size=128", "deterministic=true"]
    fit(load_run("digits", base), tmp_path / "straight", quiet=True)
    cnnkit.fit("digits", base, out=tmp_path / "r", quiet=True, callbacks=[StopAfterFirstEpoch()])
    cnnkit.fit(resume=tmp_path / "r", quiet=True)
    a, b = (
        load_checkpoint(tmp_path / "r" / "last.pt"),
        load_checkpoint(tmp_path / "straight" / "last.pt"),
    )
    assert a["ema_count"] == b["ema_count"] == 2 * 11
    for key in b["ema"]:
        torch.testing.assert_close(a["ema"][key], b["ema"][key])
    assert any(not torch.equal(b["ema"][k], b["model"][k]) for k in b["model"])
    rows = list(csv.DictReader((tmp_path / "straight" / "metrics.csv").open()))
    assert rows and all(0 <= float(r["val_top1_ema"]) <= 1 for r in rows)
    from helpers import run_cli

    capsys.readouterr()  # the runs' last lines (--quiet keeps them)
    code, out, err = run_cli(["eval", str(tmp_path / "straight"), "--ema", "--json"], capsys)
    assert code == 0, err
    # best_ema.pt: the epoch whose moving average scored best; eval --ema reads it (timm's pick)
    scores = [float(r["val_top1_ema"]) for r in rows]
    best = load_checkpoint(tmp_path / "straight" / "best_ema.pt")
    assert best["epoch"] == 1 + scores.index(max(scores))
    images = int(json.loads(out)["images"])
    assert json.loads(out)["top1"] == pytest.approx(max(scores), abs=1.5 / images)
    summary = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert summary["best_val_top1_ema"] == pytest.approx(max(scores), abs=1e-6)
    Image.fromarray(np.full((8, 8), 200, np.uint8)).save(tmp_path / "x.png")
    code, out, err = run_cli(["classify", str(tmp_path / "straight"), "--ema", "--json",
                              str(tmp_path / "x.png")], capsys)  # fmt: skip
    assert code == 0 and json.loads(out)["label"], err
    classifier = cnnkit.Classifier.load(tmp_path / "straight", ema=True)
    for key, value in classifier.model.state_dict().items():
        torch.testing.assert_close(value, best["ema"][key])
    code, _, err = run_cli(["export", str(tmp_path / "straight"), "--ema", "-o",
                            str(tmp_path / "e.safetensors")], capsys)  # fmt: skip
    assert code == 0, err
    exported = load_file(tmp_path / "e.safetensors")
    for key, value in best["ema"].items():
        torch.testing.assert_close(exported[key], value)
    code, _, err = run_cli(["eval", str(tmp_path / "e.safetensors"), "--ema"], capsys)
    assert code == 2 and "the moving average itself" in err
    named = cnnkit.Classifier.load(tmp_path / "straight" / "best_ema.pt")  # as --ema picks it
    for key, value in named.model.state_dict().items():  # (was: the raw weights of that epoch)
        torch.testing.assert_close(value, best["ema"][key])
    code, out, err = run_cli(["eval", str(tmp_path / "straight" / "best_ema.pt"), "--json"], capsys)
    assert code == 0 and json.loads(out)["top1"] == pytest.approx(max(scores), abs=1.5 / images)
    from cnnkit.nn.weights import read_state_dict

    for key, value in read_state_dict(tmp_path / "straight" / "best_ema.pt").items():
        torch.testing.assert_close(value, best["ema"][key])  # as model.weights: to fine-tune


def test_ema_with_an_export_is_one_usage_error_in_every_command(tmp_path, capsys):
    """An export holds one set of weights (the moving average itself, exported with --ema):
    eval, classify and export say so alike, exit status 2, not "export with --ema"."""
    from helpers import one_error_line, run_cli

    export = str(tmp_path / "n.safetensors")
    assert run_cli(["export", "digitnet", "-o", export], capsys)[0] == 0
    Image.fromarray(np.full((8, 8), 200, np.uint8)).save(tmp_path / "x.png")
    for command in (["eval", export, "--ema", "--data", "digits"],
                    ["classify", export, str(tmp_path / "x.png"), "--ema"],
                    ["export", export, "--ema", "-o", str(tmp_path / "again.onnx")]):  # fmt: skip
        code, _, err = run_cli(command, capsys)
        line = one_error_line(code, err, codes=(2,))
        assert line.startswith(f"cnnkit: error: --ema: {export} is an export"), command
        assert "the moving average itself" in line and "without --ema" in line


def test_mixing_gives_soft_labels_and_trains(tmp_path):
    torch.manual_seed(0)
    recipe = BatchRecipe(mixup=0.4, cutmix=1.0, mean=(0.0,), std=(1.0,))
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    mixed, soft = recipe(x, y, 10)
    assert mixed.shape == x.shape and soft.shape == (16, 10)
    torch.testing.assert_close(soft.sum(1), torch.ones(16))
    assert not torch.equal(mixed, x)
    summary = fit(load_run("digits", ["train.epochs=2", "data.mixup=0.2", "data.cutmix=1.0"]),
                  tmp_path / "m", quiet=True)  # fmt: skip
    assert summary["val_top1"] > 0.5  # it learns from soft labels


@pytest.mark.parametrize("policy", ["randaugment", "trivialaugment", "autoaugment", "augmix"])
def test_policies_change_images_not_their_shape_or_range(policy):
    torch.manual_seed(0)
    images = torch.randint(0, 256, (20, 3, 24, 24), dtype=torch.uint8)
    mean, std = (120.0, 110.0, 100.0), (60.0, 55.0, 50.0)
    x = (images.float() - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    same, _ = BatchRecipe(mean=mean, std=std)(x, torch.zeros(20, dtype=torch.long), 2)
    assert torch.equal(same, x)  # nothing asked: nothing done
    out, _ = BatchRecipe(policy=policy, mean=mean, std=std)(x, torch.zeros(20, dtype=torch.long), 2)
    back = out * torch.tensor(std).view(1, 3, 1, 1) + torch.tensor(mean).view(1, 3, 1, 1)
    assert out.shape == x.shape and back.min() > -0.5 and back.max() < 255.5
    changed = [(out[i] - x[i]).abs().max() > 1e-4 for i in range(20)]
    assert sum(changed) >= 10  # most images drew an op that changes pixels


def test_random_erasing_boxes_per_image():
    torch.manual_seed(0)
    x = torch.zeros(64, 3, 32, 32)
    out = random_erasing(x, p=1.0)
    erased = (out != 0).any(1)  # (B, H, W): noise where erased
    area = erased.flatten(1).float().mean(1)
    assert (area > 0.015).all() and (area < 0.34).all()  # scale 0.02-1/3, every image
    assert len({tuple(erased[i].nonzero()[0].tolist()) for i in range(64)}) > 32  # boxes differ
    assert torch.equal(random_erasing(x, p=0.0), x)


def test_random_erasing_redraws_boxes_too_large_as_torchvision_does():
    """A box as tall or wide as the image is drawn again (up to 10 times, then the image is
    left alone), never clamped into a full-height or full-width strip."""
    from torchvision.transforms import RandomErasing

    torch.manual_seed(0)
    x = torch.zeros(4000, 1, 16, 16)
    erased = (random_erasing(x, p=1.0) != 0)[:, 0]
    rows, cols = erased.any(2).sum(1), erased.any(1).sum(1)
    assert ((rows == 16) | (cols == 16)).sum() == 0  # were about 1% of the boxes
    ours = erased.flatten(1).float().mean(1).mean().item()
    theirs = torch.stack([
        RandomErasing(p=1.0, value="random")(x[0]).ne(0)[0].float().mean() for _ in range(2000)])  # fmt: skip
    assert ours == pytest.approx(theirs.mean().item(), abs=0.01)  # the same boxes on average
    big = random_erasing(x[:50], p=1.0, scale=(0.9, 1.0), ratio=(3.0, 3.3))
    assert torch.equal(big, x[:50])  # no box fits: left as they are (as torchvision's)


def test_a_policy_with_a_mean_image_is_refused():
    from cnnkit.data import data_config
    from cnnkit.errors import ConfigError

    with pytest.raises(ConfigError, match="data: policy: trivialaugment takes normalize: channel"):
        data_config({"source": "packed", "path": "p", "normalize": "mean_image",
                     "policy": "trivialaugment"})  # fmt: skip


def test_early_stop_ends_a_run_that_stopped_improving(tmp_path, capsys):
    run = {"name": "flat", "model": "digitnet", "seed": 0,
           "data": {"source": "synthetic", "shape": [1, 8, 8], "num_classes": 10,
                    "train_size": 128, "val_size": 64, "batch_size": 32},
           "train": {"epochs": 30, "lr": 1e-6, "early_stop": 2}}  # fmt: skip
    from cnnkit.config import validate_run

    summary = fit(validate_run(run), tmp_path / "r", quiet=False)
    assert (
        summary["epochs"] < 30
        and "early stop: no held-out gain for 2 epochs" in capsys.readouterr().out
    )
    assert (tmp_path / "r" / "curves.png").is_file()  # drawn when the run ends, early or not


def test_callbacks_see_steps_and_epochs_and_can_stop(tmp_path, capsys):
    class Recorder:
        def __init__(self):
            self.steps, self.rows = 0, []

        def on_step_end(self, epoch, step, global_step):
            self.steps += 1
            self.epoch = epoch  # counted from 1, as on_epoch_end's row["epoch"]

        def on_epoch_end(self, row):
            self.rows.append(row)
            if row["epoch"] == 2:
                raise cnnkit.StopTraining

    seen = Recorder()
    summary = cnnkit.fit("digits", ["train.epochs=10"], out=tmp_path / "r", callbacks=[seen])
    assert "stopped by a callback after epoch 2\n" in capsys.readouterr().out
    assert [r["epoch"] for r in seen.rows] == [1, 2] and seen.steps == 2 * 22 and seen.epoch == 2
    assert summary["epochs"] == 2 and load_checkpoint(tmp_path / "r" / "last.pt")["epoch"] == 2
    assert (tmp_path / "r" / "curves.png").is_file()


def test_fits_overrides_and_callbacks_are_checked_before_anything_is_written(tmp_path):
    """A string of overrides was read a character at a time ("override 't': expected
    key=value"); callbacks=5 was a TypeError after the run directory was made, which a new run
    there then refused. One callback alone is taken as a list of one."""

    class Epochs:
        def __init__(self):
            self.rows = []

        def on_epoch_end(self, row):
            self.rows.append(row["epoch"])

    for kwargs, message in (
        ({"overrides": "train.epochs=1"}, r"overrides: a list of key=value strings \(\["),
        ({"callbacks": 5}, r"callbacks: objects with an on_step_end\(epoch, step, global_step\)"),
        ({"callbacks": [object()]}, "callbacks: objects with"),
        ({"on_step": 3}, r"on_step: a function of \(epoch, step, global_step\), got 3"),
        ({"callbacks": [Epochs]}, r"callbacks: objects, not classes: give Epochs\(\)"),
        ({"callbacks": Epochs}, r"callbacks: objects, not classes: give Epochs\(\)"),
        ({"run": 5}, r"run: a zoo run, a run file or a mapping, got 5$"),
        ({"run": ["train.epochs=1"]}, r"overrides go second: fit\(RUN, \[...\]\)"),
    ):
        run = kwargs.pop("run", "digits")
        with pytest.raises(cnnkit.CnnkitError, match=message):
            cnnkit.fit(run, out=tmp_path / "r", **kwargs)
        assert not (tmp_path / "r").exists()
    seen = Epochs()
    cnnkit.fit("digits", ["train.epochs=1"], out=tmp_path / "r", quiet=True, callbacks=seen)
    assert seen.rows == [1]


def test_fit_refuses_a_run_or_out_given_with_resume_and_counts_on_steps_epochs_from_1(tmp_path):
    """fit(resume=R, out=O) trained on in R while its summary said so, and fit(RUN, resume=R)
    ignored RUN: both refused, as `cnnkit train --resume` refuses them. on_step's epoch was
    counted from 0, on_step_end's from 1: both from 1, as logged. The caller's random
    generators are left as they were (fit reseeded them all)."""
    import random

    from cnnkit.errors import ConfigError

    heard = []
    torch.manual_seed(123), np.random.seed(5), random.seed(7)  # a notebook's own seeds
    before = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    cnnkit.fit("digits", ["train.epochs=1", "train.calibrate=false", "data.batch_size=512"],
               out=tmp_path / "r", quiet=True, on_step=lambda *a: heard.append(a))  # fmt: skip
    assert heard[0] == (1, 1, 1) and heard[-1][0] == 1
    assert torch.equal(torch.get_rng_state(), before[0]) and torch.initial_seed() == 123
    assert (np.random.get_state()[1] == before[1]).all() and random.getstate() == before[2]
    with pytest.raises(ConfigError, match=r"continues that run in its own directory: out=\S+z "):
        cnnkit.fit(resume=tmp_path / "r", out=tmp_path / "z")
    with pytest.raises(ConfigError, match="the run digits cannot be given with it"):
        cnnkit.fit("digits", resume=tmp_path / "r")
    assert not (tmp_path / "z").exists()


def test_fit_keeps_the_callers_deterministic_warn_only_and_runs_one_at_a_time(monkeypatch):
    """fit restored use_deterministic_algorithms' on/off but not its warn_only; and two fits in
    threads drew from each other's seeds (their runs differed): they now run one after the
    other."""
    import threading

    import cnnkit.train.run as run_module

    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())  # fmt: skip
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        cnnkit.fit("digits", ["train.epochs=1"], dry_run=True, quiet=True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    inside, most, real = [0], [0], run_module.launch

    def counted(*args, **kwargs):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        try:
            return real(*args, **kwargs)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(run_module, "launch", counted)
    runs = [threading.Thread(target=cnnkit.fit, args=("digits", ["train.epochs=1"]),
                             kwargs={"dry_run": True, "quiet": True}) for _ in range(2)]  # fmt: skip
    for t in runs:
        t.start()
    for t in runs:
        t.join(120)
    assert most[0] == 1 and inside[0] == 0
