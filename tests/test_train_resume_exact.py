"""Exact resume: a deterministic run killed with SIGKILL mid-epoch, or mid-save on the writer
thread, and resumed ends bitwise equal to an uninterrupted run; timed saves, optimizer
state across memory formats and weight decays, and the settings a resume keeps."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import RESUME_RUN as RUN

from cnnkit.checkpoint import load_checkpoint
from cnnkit.config import validate_run
from cnnkit.train.run import fit, resume_state

ROOT = Path(__file__).resolve().parents[1]


KILL_AT = 13  # global step: epoch 2 (index 1), step 5; the last save was at step 12 (4 in it)


CHILD = """
import os, signal, sys
sys.path.insert(0, {root!r})
from cnnkit.config import validate_run
from cnnkit.train.run import fit

def kill(epoch, step, global_step):
    if global_step == {kill_at}:
        os.kill(os.getpid(), signal.SIGKILL)

fit(validate_run({run!r}), {out!r}, quiet=True, on_step=kill)
"""


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    out = dict(state["model"]) | {f"ema.{k}": v for k, v in (state.get("ema") or {}).items()}
    for pid, s in state["optimizer"]["state"].items():
        out |= {f"{name}.{pid}": v for name, v in s.items() if isinstance(v, torch.Tensor)}
    return out


# every option that keeps state or draws random numbers in a step (found exact by a review)
RICH = copy.deepcopy(RUN)
RICH["data"] |= {"mixup": 0.2, "cutmix": 1.0}
RICH["train"] |= {"optimizer": "adamw", "lr": 0.01, "ema": 0.9, "accumulate": 2,
                  "grad_clip": 1.0, "schedule": "plateau"}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("run", [RUN, RICH], ids=["sgd", "adamw-ema-mixing-accumulate"])
def test_sigkill_mid_epoch_then_resume_is_bitwise_equal(tmp_path, run):
    killed = tmp_path / "killed"
    script = CHILD.format(root=str(ROOT), kill_at=KILL_AT, run=run, out=str(killed))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    state = resume_state(killed)
    assert (state["epoch"], state["step"], state["global_step"]) == (1, 4, 12)
    assert len(state["history"]) == 1

    fit(validate_run(run), killed, resume=state, quiet=True)
    fit(validate_run(run), tmp_path / "straight", quiet=True)

    resumed = load_checkpoint(killed / "last.pt")
    straight = load_checkpoint(tmp_path / "straight" / "last.pt")
    a, b = _tensors(resumed), _tensors(straight)
    assert a.keys() == b.keys() and any(k.startswith("ema.") for k in a) == (run is RICH)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed["global_step"] == straight["global_step"] == 16
    rows = (killed / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 2  # header + exactly one row per epoch
    for a_row, b_row in zip(resumed["history"], straight["history"], strict=True):
        for key in ("train_loss", "train_top1", "val_loss", "val_top1"):  # to the bit
            assert a_row[key] == b_row[key], key


KILL_IN_WRITE = """
import os, signal, sys
sys.path.insert(0, {root!r})
import cnnkit.train.saver as saver
from cnnkit.config import validate_run
from cnnkit.train.run import fit

saver.BACKGROUND_BYTES = 0  # every save on the writer thread, as a large network's
real, calls = saver.save_checkpoint, []

def dying_save(state, path):  # the 3rd save dies half-way through writing its temporary file
    calls.append(path)
    if len(calls) == 3:
        tmp = path.with_name(f".{{path.name}}.{{os.getpid()}}.tmp")
        tmp.write_bytes(b"half a checkpoint")
        os.kill(os.getpid(), signal.SIGKILL)
    real(state, path)

saver.save_checkpoint = dying_save
fit(validate_run({run!r}), {out!r}, quiet=True)
"""


@pytest.mark.slow
def test_kill_during_a_background_save_leaves_the_last_one_and_resumes_exactly(tmp_path):
    """Saves on the writer thread: a kill mid-write leaves the previous last.pt loadable, and
    the run resumed from it ends bitwise equal to an uninterrupted one."""
    killed = tmp_path / "killed"
    script = KILL_IN_WRITE.format(root=str(ROOT), run=RUN, out=str(killed))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    state = resume_state(killed)  # saves at steps 3 and 6; the one at step 9 died
    assert state["global_step"] == 6
    fit(validate_run(RUN), killed, resume=state, quiet=True)
    fit(validate_run(RUN), tmp_path / "straight", quiet=True)
    a = _tensors(load_checkpoint(killed / "last.pt"))
    b = _tensors(load_checkpoint(tmp_path / "straight" / "last.pt"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_timed_saves_come_at_steps_every_rank_agrees_on(monkeypatch):
    """checkpoint_minutes becomes a step interval from the measured step time: here 0.5 s a
    step and a 1-minute interval -> a save every 120 steps after the measurement."""
    from cnnkit.distributed import Local
    from cnnkit.train import saver

    now = [0.0]
    monkeypatch.setattr(saver.time, "perf_counter", lambda: now[0])
    saves, due = saver.MidEpochSaves(every=0, minutes=1.0, dist=Local()), []
    for g in range(1, 400):
        now[0] = g * 0.5  # the clock after step g
        if saves.due(g, step=1, steps=1000):
            due.append(g)
    assert saves.interval == 120 and due == [150, 270, 390]
    counted = saver.MidEpochSaves(every=50, minutes=0.0, dist=Local())
    assert [g for g in range(1, 160) if counted.due(g, 1, 1000)] == [50, 100, 150]
    assert not counted.due(200, step=1000, steps=1000)  # the epoch's own save comes next


OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
              "adam": lambda ps: torch.optim.Adam(ps, lr=0.01)}  # fmt: skip


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_optimizer_state_takes_the_resumed_models_memory_format(optimizer):
    """Momenta saved from a channels_last model load into an NCHW one (another device's
    choice) with the parameters' strides, and the next step equals one without the trip."""
    from cnnkit.nn import build_model
    from cnnkit.train.state import match_param_layout

    def model_and_optimizer(fmt):
        torch.manual_seed(0)
        model = build_model("digitnet", num_classes=4).to(memory_format=fmt).eval()
        return model, OPTIMIZERS[optimizer](model.parameters())

    def step(model, opt):
        x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(1))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    saved, opt = model_and_optimizer(torch.channels_last)
    step(saved, opt)
    model, resumed = model_and_optimizer(torch.contiguous_format)
    model.load_state_dict(saved.state_dict())
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))  # as torch.load gives it
    loaded = {(i, k): v.clone() for i, p in enumerate(model.parameters())
              for k, v in resumed.state[p].items()}  # fmt: skip
    assert any(v.stride() != p.stride() for p in model.parameters()
               for v in resumed.state[p].values() if v.dim())  # fmt: skip
    match_param_layout(resumed)
    for i, p in enumerate(model.parameters()):
        for k, v in resumed.state[p].items():
            assert torch.equal(v, loaded[i, k]) and (v.stride() == p.stride() or not v.dim())
    as_loaded, optimizer_as_loaded = model_and_optimizer(torch.contiguous_format)
    as_loaded.load_state_dict(saved.state_dict())
    optimizer_as_loaded.load_state_dict(copy.deepcopy(opt.state_dict()))
    step(model, resumed), step(as_loaded, optimizer_as_loaded)  # the same step either way
    for a, b in zip(model.parameters(), as_loaded.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("before, after", [(5e-4, 0.0), (0.0, 5e-4)])
def test_weight_decay_to_or_from_zero_on_resume_keeps_the_groups(before, after):
    """Groups are one per (lr_mult, decay_mult): a decay of 0 merged `decay_mult: {bias: 0}`'s
    two groups into one, and a resume with train.weight_decay=0 (or from 0) was refused as a
    checkpoint that does not match."""
    from cnnkit.nn import build_model
    from cnnkit.train.optim import build_optimizer
    from cnnkit.train.state import load_optimizer

    spec = {"input": [1, 8, 8], "num_classes": 4, "layers": [
        {"type": "conv", "out_channels": 4, "kernel_size": 3, "decay_mult": {"bias": 0}},
        {"type": "linear"}]}  # fmt: skip

    def optimizer(decay):
        cfg = validate_run({**RUN, "train": {**RUN["train"], "weight_decay": decay}})
        return build_optimizer(build_model(spec), cfg.train)

    saved, resumed = optimizer(before), optimizer(after)
    load_optimizer(resumed, copy.deepcopy(saved.state_dict()))
    assert [g["weight_decay"] for g in resumed.param_groups] == [after, 0.0]
    assert [len(g["params"]) for g in resumed.param_groups] == [3, 1]  # conv0.bias alone


def test_a_resume_keeps_the_settings_the_run_began_with(tmp_path, capsys):
    """Another thread count alone changes the weights: a resume (on a machine whose measured
    or cached choice differs) runs with the checkpoint's settings unless it sets them anew."""
    run = tmp_path / "run"
    fit(validate_run({**RUN, "train": {**RUN["train"], "epochs": 1}}), run, quiet=True)
    state = load_checkpoint(run / "last.pt")
    assert state["settings"]["device"] == "cpu"
    state["settings"] = {**state["settings"], "threads": 1, "how": "measured"}
    torch.save(state, run / "last.pt")
    threads = []
    more = validate_run({**RUN, "train": {**RUN["train"], "epochs": 2}})
    fit(more, run, resume=resume_state(run), on_step=lambda *a: threads.append(
        torch.get_num_threads()))  # fmt: skip
    assert "1 thread: as the run began (kept for an exact resume)" in capsys.readouterr().out
    assert set(threads) == {1} and load_checkpoint(run / "last.pt")["settings"]["threads"] == 1
    again = validate_run({**RUN, "train": {**RUN["train"], "epochs": 3, "threads": 2}})
    fit(again, run, resume=resume_state(run), on_step=lambda *a: threads.append(
        torch.get_num_threads()))  # fmt: skip
    assert "2 threads: static rules" in capsys.readouterr().out and threads[-1] == 2
    # in another number of processes (--nproc 2 of a one-process run): chosen afresh
    from cnnkit.train.build import resumed_settings

    state, cpu = load_checkpoint(run / "last.pt"), torch.device("cpu")
    assert resumed_settings(state, again, cpu, ranks=1).threads == 2
    assert resumed_settings(state, again, cpu, ranks=2) is None


def test_a_dry_run_of_nproc_n_chooses_settings_for_one_of_n_ranks(monkeypatch, capsys):
    """Each rank takes its share of the batch and of the cores: the dry run measures (and
    caches) the choice for that, not for one process with the whole batch and every core."""
    from helpers import run_cli

    import cnnkit.train.build as build_module
    from cnnkit.train.settings import Settings

    asked = []

    def spy(network, cfg, device, batch, *args, **kwargs):
        asked.append((batch, torch.get_num_threads()))
        return Settings("fp32", False, torch.get_num_threads(), "set")

    monkeypatch.setattr(build_module, "choose_settings", spy)
    monkeypatch.setattr(build_module, "available_cores", lambda: 4)
    code, out, err = run_cli(["train", "digits", "--nproc", "2", "--dry-run"], capsys)
    assert code == 0, err
    assert asked == [(32, 2)] and "2 processes" in out
