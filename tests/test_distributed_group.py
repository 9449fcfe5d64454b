"""Two gloo processes under torchrun against one process: DDP and weight averaging give the same
parameters, evaluation counts each image once, a killed worker is restarted and the run ends.
Every check but the restart shares one torchrun (each costs seconds of imports per process)."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from filelock import FileLock
from helpers import DDP_RUN as BASE

from cnnkit.checkpoint import load_checkpoint
from cnnkit.config import validate_run
from cnnkit.data import data_config
from cnnkit.nn import build_model
from cnnkit.train.engine import build_engine
from cnnkit.train.loop import evaluate
from cnnkit.train.run import fit

ROOT = Path(__file__).resolve().parents[1]


SCENARIOS = {
    "ddp": {},
    "ddp_acc2": {"accumulate": 2},  # no_sync micro-batches: static_graph must be off
    "avg1": {"sync": "average"},
    "avg3": {"sync": "average", "average_every": 3},
    # 4 steps an epoch, averaged at steps 3, 4 (the epoch's end), 6, 8: checkpoints (every 2)
    # wait for those; the moving average is averaged with the weights
    "avg3ema": {"sync": "average", "average_every": 3, "ema": 0.9},
}


WORKER = """
import json, os, shutil, signal, sys
sys.path.insert(0, {root!r})
import torch
from cnnkit import distributed
from cnnkit.checkpoint import load_checkpoint
from cnnkit.train.rundir import resume_config
from cnnkit.config import validate_run
from cnnkit.data import data_config
from cnnkit.errors import ConfigError
from cnnkit.nn import build_model
from cnnkit.train.engine import build_engine
from cnnkit.train.loop import evaluate
from cnnkit.train.run import fit
from cnnkit.train.loop import StopTraining

from cnnkit.config import TrainConfig
from cnnkit.train.engine import train_step


def averaging():  # three Adam steps in channels_last, sync: average, each rank its own batches
    cfg = TrainConfig(optimizer="adam", lr=0.01, precision="fp32", channels_last=True,
                      sync="average")
    group = distributed.Group(cfg)
    torch.manual_seed(0)
    engine = build_engine(build_model("digitnet"), cfg, torch.device("cpu"), wrap=group.wrap)
    torch.manual_seed(1 + group.rank)
    for step in range(1, 4):
        train_step(engine, torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,)))
        group.after_step(engine, step)
    net, opt = engine.network, engine.optimizer
    moments = [s[k].flatten()[:3].tolist() for s in opt.state.values()
               for k in ("exp_avg", "exp_avg_sq")]
    return {{"conv": net.conv1.weight.is_contiguous(memory_format=torch.channels_last),
             "bn": net.bn1.running_mean[:4].tolist(), "var": net.bn2.running_var[:4].tolist(),
             "w": net.fc3.weight[0, :4].tolist(), "moments": moments}}


base, scenarios, out = {base!r}, {scenarios!r}, {out!r}
group = None
for name, change in scenarios.items():
    cfg = validate_run({{**base, "train": {{**base["train"], **change}}}})
    group = distributed.Group(cfg.train)
    fit(cfg, os.path.join(out, name), quiet=True, dist=group)


class Killed(Exception):
    pass


def kill_at_7(epoch, step, global_step):  # after the mid-epoch save at step 6, before the end
    if global_step == 7:
        raise Killed


killed = os.path.join(out, "avg3ema-killed")
try:
    fit(cfg, killed, quiet=True, dist=group, on_step=kill_at_7)
except Killed:
    pass
group.broadcast_object(None)  # rank 0 has read nothing yet: no rank copies before the save
if group.is_main:
    shutil.copy(os.path.join(killed, "last.pt"), os.path.join(out, "mid-epoch.pt"))
state = group.broadcast_object(load_checkpoint(os.path.join(killed, "last.pt")) if group.is_main else None)
fit(resume_config(state), killed, resume=state, quiet=True, dist=group)

# DDP + moving average + BatchNorm: each rank's average follows its own batches' statistics
bn_cfg = validate_run({{**base, "model": "digitnet",
                       "data": {{**base["data"], "shape": [1, 8, 8], "num_classes": 10}},
                       "train": {{**base["train"], "ema": 0.9}}}})
bn_group = distributed.Group(bn_cfg.train)
fit(bn_cfg, os.path.join(out, "ddpema"), quiet=True, dist=bn_group)
bn_killed = os.path.join(out, "ddpema-killed")
try:
    fit(bn_cfg, bn_killed, quiet=True, dist=bn_group, on_step=kill_at_7)
except Killed:
    pass
bn_group.broadcast_object(None)
bn_state = bn_group.broadcast_object(
    load_checkpoint(os.path.join(bn_killed, "last.pt")) if bn_group.is_main else None)
fit(resume_config(bn_state), bn_killed, resume=bn_state, quiet=True, dist=bn_group)
torch.manual_seed(0)
data = data_config(base["data"]).build(torch.device("cpu"), group.rank, 2, 0)
engine = build_engine(build_model("facenet", num_classes=4), cfg.train, torch.device("cpu"))
result = {{"eval": evaluate(engine, data.val, group), "val_len": len(data.val)}}
try:
    fit(validate_run({{**base, "data": {{**base["data"], "batch_size": 15}}}}), out + "/bad", dist=group)
except ConfigError as e:
    result["bad"] = str(e)
result["averaging"] = averaging()
from cnnkit.data.memory import TensorBatches
plain_iter = TensorBatches.__iter__
def one_empty(self):  # rank 1's second batch of each epoch: every image unreadable
    for i, (x, y) in enumerate(plain_iter(self)):
        yield (x[:0], y[:0]) if self.train and group.rank == 1 and i == 1 else (x, y)
TensorBatches.__iter__ = one_empty
ddp = validate_run({{**base, "train": {{**base["train"], "checkpoint_every": 0}}}})
group = distributed.Group(ddp.train)  # (the last scenario's group averages: no DDP)
result["empty"] = fit(ddp, os.path.join(out, "empty"), quiet=True, dist=group)["epochs"]

def first_empty(self):  # sync: average, rank 1's very first batch unreadable (no optimizer
    for i, (x, y) in enumerate(plain_iter(self)):  # state yet: the averaging must still pair)
        yield (x[:0], y[:0]) if self.train and group.rank == 1 and i == 0 else (x, y)
TensorBatches.__iter__ = first_empty
avg = validate_run({{**base, "train": {{**base["train"], "sync": "average", "optimizer": "adam",
                                        "checkpoint_every": 0}}}})
result["avg_empty"] = fit(avg, os.path.join(out, "avg_empty"), quiet=True, dist=group)["epochs"]

def nan_on_rank1(self):  # sync: average, rank 1's replica diverges alone
    for i, (x, y) in enumerate(plain_iter(self)):
        yield (x.float() * float("nan"), y) if self.train and group.rank == 1 else (x, y)
TensorBatches.__iter__ = nan_on_rank1
far = validate_run({{**base, "train": {{**base["train"], "sync": "average", "average_every": 100,
                                        "checkpoint_every": 0}}}})
try:
    fit(far, os.path.join(out, "diverged"), quiet=True, dist=group)
except Exception as e:
    result["diverged"] = str(e)
TensorBatches.__iter__ = plain_iter

class StopOnRank0:  # a callback that stops one rank only (a wall-clock budget, say)
    def on_step_end(self, epoch, step, global_step):
        if group.rank == 0 and global_step == 2:
            raise StopTraining
group = distributed.Group(ddp.train)
summary = fit(ddp, os.path.join(out, "stopped"), quiet=True, dist=group, callbacks=[StopOnRank0()])
group.broadcast_object(None)  # rank 0's save is done before it reads last.pt
if group.is_main:
    result["stopped"] = load_checkpoint(os.path.join(out, "stopped", "last.pt"))["global_step"]

class CtrlCOnRank0:  # a Ctrl-C that reaches rank 0's machine only
    def on_step_end(self, epoch, step, global_step):
        if group.rank == 0 and global_step == 2:
            os.kill(os.getpid(), signal.SIGINT)
from cnnkit.errors import Interrupted
try:
    fit(ddp, os.path.join(out, "ctrl-c"), quiet=True, dist=group, callbacks=[CtrlCOnRank0()])
except Interrupted as e:
    result["ctrl_c"] = [type(e).__name__, e.exit_code, str(e)]

# DDP: each rank's BatchNorm statistics (its own batches) averaged at the epoch's end
engine = build_engine(build_model("digitnet"), ddp.train, torch.device("cpu"), wrap=group.wrap)
torch.manual_seed(1 + group.rank)
for step in (1, 2):
    train_step(engine, torch.randn(8, 1, 8, 8) + group.rank, torch.randint(0, 10, (8,)))
    group.after_step(engine, step, epoch_end=step == 2)
result["ddp_bn"] = engine.network.bn1.running_mean[:4].tolist()

# a branch nothing reads, accumulating micro-batches (DDP without static_graph)
side = {{"input": [1, 8, 8], "layers": [
    {{"name": "a", "type": "conv", "out_channels": 4, "kernel_size": 3}},
    {{"name": "side", "type": "conv", "out_channels": 4, "kernel_size": 1}},
    {{"type": "flatten", "inputs": ["a"]}}, {{"type": "linear", "out_features": 3}}]}}
acc = validate_run({{**base, "train": {{**base["train"], "accumulate": 2}}}}).train
group = distributed.Group(acc)
engine = build_engine(build_model(side), acc, torch.device("cpu"), wrap=group.wrap)
for step in range(3):
    train_step(engine, torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,)))
result["unreached"] = engine.network.a.weight.grad is not None

# --resume: each rank read last.pt from its own disk; rank 1's copy is stale
from cnnkit.train.run import _rank0_state
own = load_checkpoint(os.path.join(killed, "last.pt"))
if group.rank == 1:
    own = {{**own, "global_step": own["global_step"] - 2,
            "model": {{k: v + 1 for k, v in own["model"].items()}}}}
same = _rank0_state(own, group)
result["rank0_state"] = [same["global_step"], float(next(iter(same["model"].values())).sum())]
json.dump(result, open(os.path.join(out, f"rank{{group.rank}}.json"), "w"))
group.close()
"""


def _torchrun(tmp_path: Path, script: str, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "worker.py").write_text(textwrap.dedent(script))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--monitor-interval=0.2", *extra, str(tmp_path / "worker.py")]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, worker_id):
    """The torchrun's folder, made once per test session: by the first pytest-xdist worker
    that runs a test of this module, the other waiting on its lock (xdist hands a module's
    tests out in chunks, and a module split between the workers ran the torchrun twice)."""
    from helpers import shared_dir

    shared = shared_dir(tmp_path_factory, worker_id)
    out, made = shared / "ddp", shared / "ddp.made"
    with FileLock(shared / "ddp.lock"):
        if not made.exists():
            shutil.rmtree(out, ignore_errors=True)  # (a failed try's)
            out.mkdir()
            script = WORKER.format(root=str(ROOT), base=BASE, scenarios=SCENARIOS, out=str(out))
            proc = _torchrun(out, script)
            assert proc.returncode == 0, "\n".join(
                line for line in proc.stderr.splitlines() if not line.startswith("[rank0]:   ")
            )[-4000:]
            made.touch()
    return out


def _params(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["model"]


@pytest.mark.parametrize("name", ["ddp", "ddp_acc2", "avg1"])
def test_two_processes_match_one(name, two_processes, tmp_path):
    one = fit(
        validate_run({**BASE, "train": {**BASE["train"], **SCENARIOS[name]}}),
        tmp_path / "one",
        quiet=True,
    )
    two, single = _params(two_processes / name / "last.pt"), _params(tmp_path / "one" / "last.pt")
    for key in single:
        torch.testing.assert_close(two[key], single[key], rtol=1e-4, atol=1e-5)
    summary = json.loads((two_processes / name / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["val_images"] == 21
    assert summary["val_top1"] == pytest.approx(one["val_top1"])
    rows = (two_processes / name / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + BASE["train"]["epochs"]


def test_averaging_every_three_steps_trains(two_processes):
    state = load_checkpoint(two_processes / "avg3" / "last.pt")
    first, last = state["history"][0], state["history"][-1]
    assert state["global_step"] == 8 and last["train_loss"] < first["train_loss"] * 1.5
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def _scored(state: dict, weights: str) -> dict[str, float]:
    """The held-out figures of a checkpoint's weights (or moving average), in one process."""
    data = data_config(BASE["data"]).build(torch.device("cpu"), 0, 1, BASE["seed"])
    engine = build_engine(build_model("facenet", num_classes=4), validate_run(BASE).train,
                          torch.device("cpu"))  # fmt: skip
    engine.network.load_state_dict(state[weights])
    return evaluate(engine, data.val)


def test_averaged_replicas_are_what_is_scored_and_saved(two_processes):
    """average_every 3 does not divide the 4 steps of an epoch: the replicas are averaged at
    its end too, so each epoch's figures are those of the saved weights (and moving average)."""
    state = load_checkpoint(two_processes / "avg3ema" / "last.pt")
    row = state["history"][-1]
    for weights, suffix in (("model", ""), ("ema", "_ema")):
        scored = _scored(state, weights)
        assert scored["loss"] == pytest.approx(row[f"val_loss{suffix}"], rel=1e-5)
        assert scored["top1"] == pytest.approx(row[f"val_top1{suffix}"])


def test_a_mid_epoch_resume_under_averaging_ends_as_the_straight_run(two_processes):
    """Killed after the checkpoint of step 6 (a save due at an averaging step) and resumed:
    the same weights, moving average and epoch statistics (each rank's partial sums kept)."""
    straight = load_checkpoint(two_processes / "avg3ema" / "last.pt")
    resumed = load_checkpoint(two_processes / "avg3ema-killed" / "last.pt")
    mid = load_checkpoint(two_processes / "mid-epoch.pt")
    assert (mid["epoch"], mid["step"], len(mid["partial_ranks"])) == (1, 2, 2)
    for weights in ("model", "ema"):
        for key, value in straight[weights].items():
            torch.testing.assert_close(resumed[weights][key], value, rtol=0, atol=0)
    for a, b in zip(straight["history"], resumed["history"], strict=True):
        for key in ("train_loss", "train_top1", "val_loss", "val_top1", "val_loss_ema"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), key


def test_a_mid_epoch_resume_under_ddp_keeps_each_ranks_moving_average(two_processes):
    """Under DDP each rank's moving average takes its BatchNorm statistics from the rank's own
    batches until the epoch's end averages them: a mid-epoch checkpoint keeps every rank's, and
    the resumed run ends bitwise as the straight one (it took rank 0's for every rank)."""
    straight = load_checkpoint(two_processes / "ddpema" / "last.pt")
    resumed = load_checkpoint(two_processes / "ddpema-killed" / "last.pt")
    assert any("running_var" in k for k in straight["ema"])
    for weights in ("model", "ema"):
        for key, value in straight[weights].items():
            torch.testing.assert_close(resumed[weights][key], value, rtol=0, atol=0)
    assert resumed["history"][-1]["val_loss_ema"] == straight["history"][-1]["val_loss_ema"]


def test_a_mid_epoch_checkpoint_resumes_only_in_its_number_of_processes(two_processes):
    from cnnkit.errors import ConfigError
    from cnnkit.train.rundir import resume_config

    state = load_checkpoint(two_processes / "mid-epoch.pt")
    with pytest.raises(ConfigError, match=r"saved by 2 process.*--nproc 2"):
        fit(resume_config(state), two_processes / "one-process", resume=state, quiet=True)


def test_a_rank_whose_batch_was_all_unreadable_still_steps_with_the_others(two_processes):
    """Under DDP the other ranks' all-reduces wait for this one: it steps on its last batch
    weighted 0 rather than skipping (skipping shifted every later all-reduce by one step, and
    the epoch's end paired an evaluation sum with a gradient bucket)."""
    ranks = [json.loads((two_processes / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["empty"] for r in ranks] == [2, 2]
    with open(two_processes / "empty" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(math.isfinite(float(r["train_loss"])) for r in rows)


def test_distributed_evaluation_counts_each_image_once(two_processes):
    torch.manual_seed(0)
    data = data_config(BASE["data"]).build(torch.device("cpu"), 0, 1, 0)
    cfg = validate_run(BASE).train
    engine = build_engine(build_model("facenet", num_classes=4), cfg, torch.device("cpu"))
    alone = evaluate(engine, data.val)
    ranks = [json.loads((two_processes / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["eval"] == ranks[1]["eval"]
    assert ranks[0]["eval"]["top1"] == pytest.approx(alone["top1"])
    assert ranks[0]["eval"]["loss"] == pytest.approx(alone["loss"], rel=1e-5)
    assert sum(r["val_len"] for r in ranks) == 2  # 11 + 10 images: one batch each, no padding


def test_every_rank_stops_together(two_processes):
    """A replica diverging alone (sync: average, between averagings), a callback stopping one
    rank, a first batch unreadable on one rank before any optimizer state exists: every rank
    acts alike at the same step, none left waiting in a collective the others never reach."""
    ranks = [json.loads((two_processes / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert "training diverged at epoch 1 step 4" in rank["diverged"]
        assert rank["avg_empty"] == 2
    assert 2 <= ranks[0]["stopped"] <= 4  # the agreed step, within the first epoch (of 4)
    # a Ctrl-C on one machine: its ranks exit 130; the others 0 (their torchrun, not
    # interrupted, would otherwise restart them and wait for machines that have gone)
    assert ranks[0]["ctrl_c"][:2] == ["Interrupted", 130]
    assert ranks[1]["ctrl_c"][:2] == ["StoppedWithGroup", 0]
    assert "stopped with the group's interrupted processes at epoch 1" in ranks[1]["ctrl_c"][2]


def test_ddp_averages_batchnorm_statistics_and_finds_unreached_layers(two_processes):
    """Each rank updates its BatchNorm statistics from its own batches; at the epoch's end they
    are averaged, so evaluation and the checkpoint see one model. A layer whose output nothing
    reads trains under DDP with accumulate > 1 (no static_graph to learn it)."""
    ranks = [json.loads((two_processes / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["ddp_bn"] == ranks[1]["ddp_bn"] and ranks[0]["ddp_bn"] != [0.0] * 4
    assert ranks[0]["unreached"] and ranks[1]["unreached"]


def test_a_resumed_group_starts_from_rank_0s_checkpoint(two_processes):
    """A rank whose own copy of last.pt is stale takes rank 0's, not its own."""
    ranks = [json.loads((two_processes / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["rank0_state"] == ranks[1]["rank0_state"]


def test_bad_world_size_and_batch_is_a_clear_error(two_processes):
    message = json.loads((two_processes / "rank0.json").read_text())["bad"]
    assert "15 does not divide into 2 processes" in message


ELASTIC = """
import os, signal, sys
sys.path.insert(0, {root!r})
from cnnkit import distributed
from cnnkit.train.run import launch

def kill_once(epoch, step, global_step):
    if distributed.restart_count() == 0 and int(os.environ["RANK"]) == 1 and global_step == 5:
        os.kill(os.getpid(), signal.SIGKILL)

launch({run!r}, out={out!r}, quiet=True, on_step=kill_once)
"""


@pytest.mark.slow
def test_killed_worker_restarts_and_the_run_finishes(tmp_path):
    """A rank killed mid-run: torchrun restarts the group, which continues from last.pt and
    ends as an uninterrupted run. Started as multi-machine runs are (--rdzv-backend=static: no
    job id) and without --out: every rank and the restart share the directory rank 0 named."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({**BASE, "train": {**BASE["train"], "epochs": 3}}))
    (tmp_path / "worker.py").write_text(ELASTIC.format(root=str(ROOT), run=str(run), out=None))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}",
           "--node-rank=0", "--monitor-interval=0.2", "--max-restarts=1", "worker.py"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restart" in proc.stderr.lower() or "failed" in proc.stderr.lower()
    made = list((tmp_path / "runs").iterdir())
    assert len(made) == 1, made  # one directory, not one per rank and attempt
    out = made[0]
    rows = (out / "metrics.csv").read_text().strip().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3"]  # continued, not restarted
    summary = json.loads((out / "summary.json").read_text())
    state = load_checkpoint(out / "last.pt")
    assert summary["epochs"] == 3 and state["global_step"] == 12 and len(state["rng_ranks"]) == 2
    fit(validate_run(yaml.safe_load(run.read_text())), tmp_path / "alone", quiet=True)
    alone = _params(tmp_path / "alone" / "last.pt")
    for key in alone:  # the restarted group continued exactly where it left off
        torch.testing.assert_close(state["model"][key], alone[key], rtol=1e-4, atol=1e-5)


def test_weight_averaging_keeps_channels_last_and_averages_buffers_and_moments(two_processes):
    """sync: average leaves the weights in channels_last and makes every replica's weights,
    BatchNorm statistics and Adam moments the same."""
    ranks = [json.loads((two_processes / f"rank{r}.json").read_text())["averaging"] for r in (0, 1)]
    assert ranks[0]["conv"] and ranks[1]["conv"]
    for key in ("bn", "var", "w", "moments"):
        torch.testing.assert_close(torch.tensor(ranks[0][key]), torch.tensor(ranks[1][key]))
    assert ranks[0]["bn"] != [0.0] * 4  # trained: the statistics moved
