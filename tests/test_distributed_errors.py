"""A group's mistakes in one line, not a traceback: GPUs it lacks, torchrun's variables set
wrong, peers that never join or are lost, more processes than cores, an error every rank
meets; and which rank says it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import DDP_RUN as BASE

from cnnkit.config import TrainConfig, validate_run

ROOT = Path(__file__).resolve().parents[1]


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
    monkeypatch.setattr(
        cnnkit.agent, "start_local", lambda n, argv, r=0, d="": started.append(n) or 0
    )
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


@pytest.mark.slow
def test_nproc_errors_are_one_line_with_the_ranks_exit_status(tmp_path):
    """Every rank meets the same data error (one class in the folder): one line (rank 0's),
    exit status 1, and no torchrun failure table (a configuration error every rank meets goes
    the same way, tested in-process above); a rank killed by a signal is one line too. The
    three commands run side by side (each is mostly process start-up and ranks waiting on one
    another), each in a folder of its own."""
    from PIL import Image

    data, proc_x, killed = (tmp_path / name for name in ("data", "proc-x", "killed"))
    for folder in (data, proc_x, killed):
        folder.mkdir()
    (data / "imgs" / "a").mkdir(parents=True)
    for i in range(3):
        Image.new("L", (12, 12), i * 80).save(data / "imgs" / "a" / f"{i}.png")
    shutil.copytree(data / "imgs", data / "val")
    run = {"name": "one", "model": "digitnet", "train": {"epochs": 1, "device": "cpu"},
           "data": {"source": "folder", "path": "imgs", "val_path": "val", "size": 8,
                    "crop": 8, "grey": True, "batch_size": 4}}  # fmt: skip
    (data / "run.yaml").write_text(yaml.safe_dump(run))
    (killed / "die.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    commands = [  # (the command, where it runs, its environment)
        ([sys.executable, "-m", "cnnkit", "train", "run.yaml", "--nproc", "2"], data, env),
        # an error only rank 0 can meet (the run directory is its): the other rank stops with it
        ([sys.executable, "-m", "cnnkit", "train", "digits", "--nproc", "2", "--out", "/proc/x"],
         proc_x, env),
        ([sys.executable, "-m", "cnnkit.agent", "--standalone", "--nproc_per_node=1",
          str(killed / "die.py")], ROOT, None),
    ]  # fmt: skip
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=cwd, env=env) for cmd, cwd, env in commands]  # fmt: skip
    try:
        done = [(p.communicate(timeout=240)[1], p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    (data_err, data_code), (proc_err, proc_code), (killed_err, killed_code) = done
    assert data_code == 1 and data_err.splitlines() == [
        f"cnnkit: error: data: 1 class (a) in {data / 'imgs'}: a classifier needs at least 2 "
        "(is data.path the folder above the class folders?)"
    ], data_err
    assert not (data / "runs").exists()  # the default directory made for it is gone again
    assert proc_code == 2 and proc_err.splitlines() == [
        "cnnkit: error: run directory /proc/x: cannot write in /proc (a special filesystem, "
        "which takes no new files)"
    ], proc_err
    assert killed_code == 1
    assert killed_err.splitlines() == ["cnnkit: error: rank 0 was killed by SIGKILL"]


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
