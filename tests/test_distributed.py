"""Two gloo processes under torchrun against one process: DDP and weight averaging give the same
parameters, evaluation counts each image once, a killed worker is restarted and the run ends.
Every check but the restart shares one torchrun (each costs seconds of imports per process)."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from cnnkit.checkpoint import load_checkpoint
from cnnkit.config import TrainConfig, validate_run
from cnnkit.data import data_config
from cnnkit.nn import build_model
from cnnkit.train.engine import build_engine
from cnnkit.train.loop import evaluate
from cnnkit.train.run import fit

ROOT = Path(__file__).resolve().parents[1]
BASE = {
    "name": "ddp",
    "model": "facenet",
    "data": {"source": "synthetic", "shape": [1, 25, 25], "num_classes": 4, "train_size": 64,
             "val_size": 21, "batch_size": 16},
    "train": {"epochs": 2, "lr": 0.05, "precision": "fp32", "channels_last": False,
              "checkpoint_every": 2, "timeout_s": 60},  # a rank left waiting fails in a minute
    "seed": 5,
    "deterministic": True,
}  # fmt: skip
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
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    script = WORKER.format(root=str(ROOT), base=BASE, scenarios=SCENARIOS, out=str(out))
    proc = _torchrun(out, script)
    assert proc.returncode == 0, "\n".join(
        line for line in proc.stderr.splitlines() if not line.startswith("[rank0]:   ")
    )[-4000:]
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


def test_sync_batchnorm_conversion_keeps_the_network_running_its_layers():
    from cnnkit.distributed import convert_sync_batchnorm

    torch.manual_seed(0)
    network = build_model("digitnet")
    x = torch.randn(8, 1, 8, 8)
    torch.manual_seed(1)  # the same dropout mask for both forwards
    expected = network(x)
    convert_sync_batchnorm(network)
    kinds = {type(m).__name__ for m in network.modules()}
    assert "SyncBatchNorm" in kinds and "BatchNorm2d" not in kinds
    ran = []
    network.bn1.register_forward_hook(lambda *_: ran.append(True))
    torch.manual_seed(1)
    torch.testing.assert_close(network(x), expected)  # no process group: plain batch norm maths
    assert ran  # the converted layer is the one that runs


def test_sync_batchnorm_on_cpus_is_one_line():
    from cnnkit.distributed import Local
    from cnnkit.errors import ConfigError

    class TwoOnCpus(Local):  # the check comes before any collective
        world_size = 2

    config = validate_run({**BASE, "train": {**BASE["train"], "sync_bn": True}})
    with pytest.raises(ConfigError, match="sync_bn: SyncBatchNorm runs on CUDA devices only"):
        fit(config, Path("/nonexistent/never-written"), quiet=True, dist=TwoOnCpus())


def test_a_step_on_an_all_unreadable_batch_leaves_batchnorms_statistics_alone():
    """Under sync: average a rank whose batch was all unreadable steps on blank stand-ins,
    weighted 0: their forward pass (training mode) must not move the running statistics of
    the network or of its moving average."""
    from cnnkit.distributed import Local
    from cnnkit.train.loop import Progress, train_one_epoch
    from cnnkit.train.metrics import Console
    from cnnkit.train.optim import Schedule

    class TwoRanks(Local):  # collectives as no-ops, world_size 2
        world_size = 2

        def agree(self, flags, every=1):  # the other rank: its loss finite, its batch read
            return [a or b for a, b in zip(flags, (False, True), strict=True)], every

    class OneEmpty:  # this rank's only batch: every image unreadable
        num_samples = 8

        def __len__(self):
            return 1

        def set_epoch(self, epoch, skip_batches=0):
            pass

        def __iter__(self):
            yield torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long)

    cfg = TrainConfig(sync="average", precision="fp32", channels_last=False, ema=0.9, epochs=1)
    engine = build_engine(build_model("digitnet"), cfg, torch.device("cpu"))
    before = {k: v.clone() for k, v in engine.network.named_buffers()}
    ema_before = {k: v.clone() for k, v in engine.ema.module.named_buffers()}
    train_one_epoch(engine, OneEmpty(), Schedule(cfg), Progress(), Console(True),
                    lambda *a: None, TwoRanks())  # fmt: skip
    for name, value in engine.network.named_buffers():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)
    for name, value in engine.ema.module.named_buffers():
        torch.testing.assert_close(value, ema_before[name], rtol=0, atol=0, msg=name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_nproc_with_a_cuda_device_there_is_not_is_refused_before_any_rank_starts(capsys):
    """Checked once by cnnkit, not by every rank and again at each of --max-restarts."""
    from helpers import run_cli

    args = ["train", "digits", "--nproc", "2", "--max-restarts", "2", "train.device=cuda"]
    code, out, err = run_cli(args, capsys)
    assert code == 2 and err == (
        "cnnkit: error: train.device: 'cuda' asked for, but no CUDA device is available\n"
    )


def test_a_group_refuses_one_named_gpu_for_every_rank():
    """Each rank of a group takes cuda:LOCAL_RANK: a device with an index would have been
    silently ignored."""
    from types import SimpleNamespace

    from cnnkit.distributed import Group
    from cnnkit.errors import ConfigError

    rank = SimpleNamespace(use_cuda=True, local_rank=0)
    with pytest.raises(ConfigError, match="'cuda:1' names one GPU, but each process of a group"):
        Group.device(rank, "cuda:1")


def test_more_processes_than_gpus_is_one_line(monkeypatch):
    """Two processes on a machine with one GPU: every rank says so before touching CUDA (not
    an "invalid device ordinal" traceback from the second)."""
    from cnnkit.distributed import Group
    from cnnkit.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("set_device"))
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match="2 processes on this machine but 1 GPU: one process"):
        Group(validate_run({**BASE, "train": {**BASE["train"], "device": "cuda"}}).train)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, world_size: int = 2) -> dict[str, str]:
    """torchrun's variables for one rank of a group whose others never start."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}  # fmt: skip


def test_peers_that_never_join_are_one_line(tmp_path, capsys, monkeypatch):
    """Rank 0 waits train.timeout_s for the others, then says who did not come and where
    (not DistStoreError's traceback), exit status 1, and leaves no run directory."""
    from helpers import run_cli

    env = _rank_env(0)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    args = ["train", "digits", "train.timeout_s=1", "train.device=cpu", "--out", str(out)]
    code, _, err = run_cli(args, capsys)
    assert code == 1 and err == (
        "cnnkit: error: rank 0: the other processes did not join within 1s at "
        f"127.0.0.1:{env['MASTER_PORT']} (start all 2 with the same MASTER_ADDR and "
        "MASTER_PORT, each with its own RANK; train.timeout_s=N waits longer)\n"
    )
    assert not out.exists() and not torch.distributed.is_initialized()


def test_a_rank_whose_master_never_comes_is_one_line(tmp_path):
    """Rank 1 with no rank 0 to connect to: one line, without torch's C++ retry log."""
    env = {**os.environ, **_rank_env(1), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "cnnkit", "train", "digits", "train.timeout_s=1", "--out",
           str(tmp_path / "run")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        f"cnnkit: error: rank 1: the other processes did not join within 1s at 127.0.0.1:"
        f"{env['MASTER_PORT']} (start all 2 with the same MASTER_ADDR and MASTER_PORT, each "
        "with its own RANK; train.timeout_s=N waits longer)"
    ]


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc': expected a whole number of 1 or more"),
        ({"RANK": "2"}, "RANK='2': expected a whole number from 0 to 1"),
        ({"MASTER_PORT": "x"}, "MASTER_PORT='x': expected a whole number from 1 to 65535"),
        ({"MASTER_ADDR": None}, "MASTER_ADDR is not set: a process of a group needs RANK, "),
    ],
)
def test_torchrun_variables_set_wrong_are_one_line(change, said, tmp_path, capsys, monkeypatch):
    """A variable of a hand-made group missing or not a number: one line naming it (exit 2),
    not KeyError 'MASTER_ADDR' or int()'s ValueError."""
    from helpers import run_cli

    for key, value in {**_rank_env(0), **change}.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    code, _, err = run_cli(["train", "digits", "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and err.startswith(f"cnnkit: error: {said}") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("env", "name"), [({"RANK": "1"}, "RANK"), ({"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE")]
)
def test_some_of_a_groups_variables_alone_are_refused(env, name, tmp_path, capsys, monkeypatch):
    """RANK without WORLD_SIZE (or WORLD_SIZE=2 without LOCAL_RANK) is not a process alone:
    one line, not a run training as if it were the whole group; what a process alone would
    have (RANK=0, WORLD_SIZE=1) trains alone."""
    from helpers import run_cli

    from cnnkit.distributed import launched

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, _, err = run_cli(["train", "digits", "--out", str(tmp_path / "run")], capsys)
    missing = " and ".join(k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k not in env)
    assert code == 2 and err == (
        f"cnnkit: error: {name}={env[name]!r} is set but {missing} not: a process of a group "
        f"needs RANK, WORLD_SIZE and LOCAL_RANK (torchrun sets them all); unset {name} to train "
        "alone\n"
    )
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert launched() is False


GLOO_PEER_LOST = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by "
    "peer [127.0.0.1]:64128. This is typically caused by a remote worker crashing. Check the "
    "logs of the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f"
)  # what this torch's gloo says in a collective whose peer died


def test_a_lost_peer_is_said_without_gloos_advice(monkeypatch):
    """gloo's message cut to what happened: no source file, no "This is typically caused by
    ... GLHF!"."""
    from types import SimpleNamespace

    from cnnkit import distributed
    from cnnkit.distributed import group as process_group
    from cnnkit.errors import CnnkitError

    monkeypatch.setattr(process_group, "launched", lambda: True)
    closed = []
    group = SimpleNamespace(rank=1, timeout_s=60, close=closed.append)
    monkeypatch.setattr(process_group, "Group", lambda cfg: group)
    with pytest.raises(CnnkitError) as caught:
        with distributed.group_for(TrainConfig()):
            raise RuntimeError(GLOO_PEER_LOST)
    assert str(caught.value) == (
        "rank 1: lost a peer process (Connection closed by peer [127.0.0.1]:64128)"
    )
    assert closed == [False]


def test_more_cpu_processes_than_cores_is_refused_unless_asked_for(tmp_path, capsys, monkeypatch):
    """`--nproc 64` on a machine of 2 cores is one line before any process starts (a dry run
    of 64 too); --oversubscribe starts them all the same. No process is started here."""
    from helpers import run_cli

    import cnnkit.agent

    started = []
    monkeypatch.setattr("cnnkit.runtime.available_cores", lambda: 2)
    monkeypatch.setattr(cnnkit.agent, "start_local", lambda n, argv, r=0: started.append(n) or 0)
    for dry in ([], ["--dry-run"]):
        args = ["train", "digits", "train.device=cpu", "--nproc", "64", *dry]
        code, _, err = run_cli([*args, "--out", str(tmp_path / "run")], capsys)
        assert code == 2 and err == (
            "cnnkit: error: --nproc 64: more processes than the 2 CPU cores this may run on; "
            "give --nproc 2 or fewer (or --oversubscribe to start them all the same)\n"
        )
    assert started == [] and not (tmp_path / "run").exists()
    args = ["train", "digits", "train.device=cpu", "--nproc", "64", "--oversubscribe"]
    code, _, err = run_cli([*args, "--out", str(tmp_path / "run")], capsys)
    assert code == 0 and started == [64], err


def test_nproc_errors_are_one_line_with_the_ranks_exit_status(tmp_path):
    """Every rank meets the same data error (one class in the folder): one line (rank 0's),
    exit status 1, and no torchrun failure table (a configuration error every rank meets goes
    the same way, tested in-process above); a rank killed by a signal is one line too."""
    from PIL import Image

    (tmp_path / "imgs" / "a").mkdir(parents=True)
    for i in range(3):
        Image.new("L", (12, 12), i * 80).save(tmp_path / "imgs" / "a" / f"{i}.png")
    run = {"name": "one", "model": "digitnet", "train": {"epochs": 1, "device": "cpu"},
           "data": {"source": "folder", "path": "imgs", "val_path": "imgs", "size": 8,
                    "crop": 8, "grey": True, "batch_size": 4}}  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    cmd = [sys.executable, "-m", "cnnkit", "train", "run.yaml", "--nproc", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert done.returncode == 1 and done.stderr.splitlines() == [
        f"cnnkit: error: data: 1 class (a) in {tmp_path / 'imgs'}: a classifier needs at least 2 "
        "(is data.path the folder above the class folders?)"
    ], done.stderr
    assert not (tmp_path / "runs").exists()  # the default directory made for it is gone again
    # an error only rank 0 can meet (the run directory is its): the other rank stops with it
    cmd = [sys.executable, "-m", "cnnkit", "train", "digits", "--nproc", "2", "--out", "/proc/x"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "cnnkit: error: run directory /proc/x: cannot write in /proc (No such file or directory)"
    ], done.stderr
    (tmp_path / "die.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    cmd = [sys.executable, "-m", "cnnkit.agent", "--standalone", "--nproc_per_node=1",
           str(tmp_path / "die.py")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr.splitlines() == ["cnnkit: error: rank 0 was killed by SIGKILL"]


def _ctrl_c_under_nproc(tmp_path: Path, wait, *overrides: str, to: str = "group",
                        sig: int = 2) -> tuple[int, str]:  # fmt: skip
    """`cnnkit train digits --nproc 2` in a session of its own, SIGINT (or `sig`) to the whole
    group (a terminal's Ctrl-C), or `to="parent"`: to cnnkit's pid alone (`kill -INT PID`, a
    scheduler), once `wait(proc)` returns: (exit status, stderr)."""
    import signal

    cmd = [sys.executable, "-m", "cnnkit", "train", "digits", "--nproc", "2", "--out",
           str(tmp_path / "run"), *overrides]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)  # fmt: skip
    try:
        wait(proc)
        (os.killpg if to == "group" else os.kill)(proc.pid, sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err


def _second_epoch(proc) -> None:
    for line in proc.stdout:  # (not a terminal: a line per epoch)
        if line.startswith("epoch 2/"):
            return


@pytest.mark.parametrize("to", ["group", "parent"])
def test_ctrl_c_under_nproc_saves_where_the_ranks_agree_and_says_how_to_resume(tmp_path, to):
    """torchrun's agent passes the Ctrl-C on, the ranks agree on a step, save it and stop; one
    line, exit status 130, resumable. A `kill -INT` of cnnkit's pid alone does the same."""
    code, err = _ctrl_c_under_nproc(tmp_path, _second_epoch, "train.epochs=100", to=to)
    assert code == 130, err
    (line,) = err.splitlines()
    assert line.startswith("cnnkit: interrupted at epoch ") and "(saved); resume with" in line
    assert line.endswith(f"`cnnkit train --resume {tmp_path / 'run'} --nproc 2`")
    state = load_checkpoint(tmp_path / "run" / "last.pt")
    assert state["epoch"] >= 2 and f"epoch {state['epoch'] + 1} step {state['step']} " in line


def test_sigterm_to_cnnkit_under_nproc_ends_every_process(tmp_path):
    """A scheduler's SIGTERM to cnnkit's pid: the agent and the ranks end with it (they trained
    on, holding the run folder, when it was not passed on); one line, status 143."""
    import signal

    ranks: list[int] = []

    def started(proc) -> None:
        _second_epoch(proc)
        ranks.extend(p for p in _descendants(proc.pid))

    code, err = _ctrl_c_under_nproc(tmp_path, started, "train.epochs=100", to="parent",
                                    sig=signal.SIGTERM)  # fmt: skip
    assert code == 143 and err.splitlines()[-1] == "cnnkit: terminated (SIGTERM)", err
    assert len(ranks) >= 3  # the agent and two ranks (and their helpers)
    for pid in ranks:
        _wait_gone(pid)


def _descendants(pid: int) -> list[int]:
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        children.setdefault(int(status.split("PPid:")[1].split()[0]), []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _wait_gone(pid: int, seconds: float = 30) -> None:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state == "Z":  # ended, not yet reaped by its (ended) parent's reaper
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} still runs {seconds} s after the SIGTERM")


def test_a_second_ctrl_c_under_nproc_is_said(monkeypatch, capsys):
    """The second Ctrl-C stops the ranks at once, before rank 0 can say where the run stands:
    cnnkit says it (it printed nothing, exit 130). One Ctrl-C is rank 0's to report."""
    import cnnkit.agent

    class Agent:  # torchrun's agent: gets the forwarded signals, ends as torchrun does (130)
        def __init__(self, cmd, env, start_new_session):
            self.got = []

        def send_signal(self, signum):
            self.got.append(signum)

        def wait(self):
            for _ in range(presses):
                os.kill(os.getpid(), signal.SIGINT)  # the terminal's Ctrl-C, to cnnkit
            return 130

    monkeypatch.setattr(cnnkit.agent.subprocess, "Popen", Agent)
    for presses, said in ((1, ""), (2, "cnnkit: interrupted again: the processes stopped at once")):
        assert cnnkit.agent.start_local(2, ["train", "digits"]) == 130
        err = capsys.readouterr().err
        assert err.startswith(said) and (err == "") == (presses == 1), err
        assert presses == 1 or "`cnnkit train --resume RUN_DIR --nproc 2` continues" in err


def test_a_rank_of_nproc_ends_with_its_agent(tmp_path):
    """The agent killed outright (SIGKILL: the OOM killer's): its ranks do not train on,
    orphaned, writing the run directory."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CNNKIT_NPROC": "2", "LOCAL_RANK": "0"}
    rank = (f"{sys.executable} -m cnnkit train digits train.epochs=1000 --quiet "
            f"--out {tmp_path / 'run'}")  # fmt: skip
    agent = subprocess.Popen(["sh", "-c", f"{rank} & echo $! ; wait"], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # fmt: skip
    pid = int(agent.stdout.readline())
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "config.yaml").exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # training has started
    agent.kill()
    agent.wait()
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
            break  # ended, not yet reaped
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the rank trained on after its agent was killed")


def test_ctrl_c_while_the_nproc_agent_starts_is_one_line(tmp_path):
    """Before any rank runs (torchrun's agent importing torch): 'cnnkit: interrupted', 130."""
    import signal
    import time

    def agent_listening(proc) -> None:  # started, SIGINT no longer ignored (SigIgn's bit 1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    line = Path(f"/proc/{pid}/cmdline").read_bytes()
                    status = Path(f"/proc/{pid}/status").read_text()
                    parent = int(status.split("PPid:")[1].split()[0])
                    if b"cnnkit.agent" in line and parent == proc.pid:
                        ignored = int(status.split("SigIgn:")[1].split()[0], 16)
                        if not ignored & (1 << (signal.SIGINT - 1)):
                            return
                except (OSError, IndexError):
                    continue
            time.sleep(0.02)

    code, err = _ctrl_c_under_nproc(tmp_path, agent_listening)
    assert code == 130, err
    assert err.splitlines()[-1].startswith("cnnkit: interrupted") and "Traceback" not in err


def test_nproc_ranks_start_with_ctrl_c_held(tmp_path, monkeypatch):
    """torchrun's agent (cnnkit.agent) starts each rank with SIGINT blocked, so a Ctrl-C during
    the rank's Python start-up is not a traceback (it waits for cnnkit's main)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as handler,
    )

    from cnnkit.agent import _ranks_start_with_interrupts_held

    monkeypatch.setattr(handler.SubprocessHandler, "_popen", handler.SubprocessHandler._popen)
    _ranks_start_with_interrupts_held()
    probe = "import signal; print(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))"
    out = tmp_path / "rank.out"
    rank = handler.SubprocessHandler(sys.executable, ("-c", probe), {}, str(out), None, 0, None)
    assert rank.proc.wait(timeout=60) == 0
    assert out.read_text().strip() == "True"
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the agent hears it


def test_a_ctrl_c_held_while_a_rank_started_is_one_line(tmp_path):
    """A rank whose start-up got a Ctrl-C (pending, SIGINT held) ends with 'interrupted' and 130
    as soon as cnnkit's main runs, instead of carrying on with the run."""
    script = (
        "import os, signal\n"
        "os.kill(os.getpid(), signal.SIGINT)  # held: pending until cnnkit unblocks it\n"
        "from cnnkit.cli import main\n"
        "main(['zoo'])\n"
    )
    env = dict(os.environ, CNNKIT_NPROC="2", LOCAL_RANK="0", RANK="0")

    def held() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, preexec_fn=held)  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == "cnnkit: interrupted" and proc.stdout == ""


def test_only_nproc_ranks_leave_a_configuration_error_to_rank_0(capsys, monkeypatch):
    """RANK alone (a pod or job that exports it) never hides an error line."""
    from helpers import run_cli

    monkeypatch.setenv("RANK", "1")
    code, _, err = run_cli(["train", "digits", "train.epochs=-1"], capsys)
    assert code == 2 and "train.epochs" in err
    monkeypatch.setenv("CNNKIT_NPROC", "2")  # what --nproc gives its ranks
    code, _, err = run_cli(["train", "digits", "train.epochs=-1"], capsys)
    assert code == 2 and err == ""


def test_plain_torchrun_ranks_leave_a_configuration_error_to_the_first_rank(capsys, monkeypatch):
    """Under torchrun's own agent too (TORCHELASTIC_RUN_ID): one line per machine, said by
    its first rank (LOCAL_RANK 0, on another machine RANK 2), each rank exiting 2."""
    from helpers import run_cli

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "4")
    for rank, local_rank, said in (("1", "1", False), ("2", "0", True)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        code, _, err = run_cli(["train", "digits", "train.epochs=-1"], capsys)
        assert code == 2 and ("train.epochs" in err) == said, err
        assert said or err == ""


def test_another_ranks_data_error_is_left_to_the_first_rank_for_a_while(monkeypatch):
    """A data set or checkpoint each rank reads at its own pace: a rank other than the first
    waits for the agent to end it (the first rank failing with the same error, said), and says
    the error itself only if still running after; errors of its own are said at once."""
    import cnnkit.cli as cli
    from cnnkit.errors import CheckpointError, CnnkitError, ConfigError, DataError

    slept = []
    monkeypatch.setattr(cli.time, "sleep", slept.append)
    monkeypatch.setenv("CNNKIT_NPROC", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cli._said_by_first_rank(ConfigError("x")) and slept == []
    assert not cli._said_by_first_rank(DataError("x")) and slept == [cli.PEER_SAYS_IT_S]
    assert not cli._said_by_first_rank(CheckpointError("x")) and len(slept) == 2
    assert not cli._said_by_first_rank(CnnkitError("rank 1: a collective timed out"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not cli._said_by_first_rank(DataError("x")) and len(slept) == 2


def test_an_error_every_rank_agreed_on_is_said_by_rank_0_only(tmp_path, capsys, monkeypatch):
    """A diverged loss (or no readable image) ends every rank of --nproc alike: one line, rank
    0's, not one per rank."""
    from helpers import run_cli

    argv = ["train", "digits", "train.lr=1e30", "train.epochs=1", "train.warmup_epochs=0"]
    monkeypatch.setenv("CNNKIT_NPROC", "2")  # what --nproc gives its ranks
    monkeypatch.setattr("cnnkit.distributed.group.launched", lambda: False)  # each rank alone here
    for rank, said in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        code, _, err = run_cli([*argv, "--out", str(tmp_path / rank)], capsys)
        assert code == 1 and ("training diverged at epoch 1" in err) == said, err
        assert said or err == ""


def test_a_ctrl_c_typer_caught_is_said(capsys, monkeypatch):
    """typer returns 130 for a Ctrl-C outside a training step (info, bench, eval, ...): one
    line, as everywhere else; a rank of --nproc leaves it to rank 0."""
    from helpers import run_cli

    import cnnkit.cli

    monkeypatch.setattr(cnnkit.cli, "app", lambda **kwargs: 130)
    code, _, err = run_cli(["info", "alexnet"], capsys)
    assert code == 130 and err == "cnnkit: interrupted\n"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("CNNKIT_NPROC", "2")
    code, _, err = run_cli(["info", "alexnet"], capsys)
    assert code == 130 and err == ""


@pytest.mark.slow
def test_the_scaling_benchmark_runs_under_averaging(tmp_path):
    """(It passed the network where after_step takes the engine: a crash under average.)"""
    sync = "average"
    script = Path(__file__).parents[1] / "benchmarks" / "ddp_scaling.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--model", "digitnet", "--batch", "16", "--steps", "3",
         "--repeats", "1", "--nproc", "1", "--sync", sync, "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads((tmp_path / "r.json").read_text())
    assert row["nproc"] == 1 and row["images_per_second"] > 0


def test_ranks_check_for_a_ctrl_c_about_every_five_seconds(monkeypatch):
    """Every step at first, then every K steps with K from the step time (slow steps: each
    one; fast ones: at most 16 apart), so the agreed step comes well inside torchrun's 30 s."""
    from cnnkit.train import epochs

    clock = [0.0]
    monkeypatch.setattr(epochs.time, "perf_counter", lambda: clock[0])

    class Ranks:  # records what this rank proposes
        def __init__(self):
            self.calls = []

        def agree(self, flags, every=1):
            self.calls.append(every)
            return list(flags), every

    def run(seconds_per_step, steps, stop_at=None):
        agreement, ranks, request = epochs.Agreement(), Ranks(), epochs.StopRequest()
        for step in range(1, steps + 1):
            clock[0] += seconds_per_step
            request.requested = stop_at is not None and step >= stop_at
            if agreement.stop(ranks, request, step, False)[0]:
                return step, ranks.calls
        return None, ranks.calls

    _, calls = run(2.0, 20)  # 2 s steps: checked every 2 steps (every 4 s)
    assert calls[1:4] == [2, 2, 2]
    _, calls = run(0.01, 100)  # 10 ms steps: at most 16 apart
    assert set(calls[1:]) == {16}
    stopped, _ = run(10.0, 20, stop_at=5)  # 10 s steps: every step, stopped where asked
    assert stopped == 5


def test_the_resume_hint_names_the_process_count(monkeypatch, tmp_path):
    """A mid-epoch checkpoint of N processes resumes in N only: the hint says how."""
    from cnnkit.distributed import resume_command

    monkeypatch.delenv("CNNKIT_NPROC", raising=False)
    assert resume_command(tmp_path, 1) == f"`cnnkit train --resume {tmp_path}`"
    assert resume_command(tmp_path, 4).endswith("under the same torchrun (4 processes)")
    monkeypatch.setenv("CNNKIT_NPROC", "4")
    assert resume_command(tmp_path, 4) == f"`cnnkit train --resume {tmp_path} --nproc 4`"
