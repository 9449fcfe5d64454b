"""Ctrl-C and SIGTERM under --nproc: the ranks agree on a step (checked about every 5 s),
save it and stop; one line says how to resume, and no process outlives cnnkit or its agent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cnnkit.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]


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


# A run that trains on until stopped, with the static settings: measuring the fastest ones
# first (seconds, while the other rank waits) is no part of what these tests stop
NO_MEASURING = ("train.epochs=100", "train.calibrate=false")


def _second_epoch(proc) -> None:
    for line in proc.stdout:  # (not a terminal: a line per epoch)
        if line.startswith("epoch 2/"):
            return


@pytest.mark.slow
@pytest.mark.parametrize("to", ["group", "parent"])
def test_ctrl_c_under_nproc_saves_where_the_ranks_agree_and_says_how_to_resume(tmp_path, to):
    """torchrun's agent passes the Ctrl-C on, the ranks agree on a step, save it and stop; one
    line, exit status 130, resumable. A `kill -INT` of cnnkit's pid alone does the same."""
    code, err = _ctrl_c_under_nproc(tmp_path, _second_epoch, *NO_MEASURING, to=to)
    assert code == 130 and len(err.splitlines()) == 1, err
    (line,) = err.splitlines()
    assert line.startswith("cnnkit: interrupted at epoch ") and "(saved); resume with" in line
    assert line.endswith(f"`cnnkit train --resume {tmp_path / 'run'} --nproc 2`")
    state = load_checkpoint(tmp_path / "run" / "last.pt")
    assert state["epoch"] >= 2 and f"epoch {state['epoch'] + 1} step {state['step']} " in line


@pytest.mark.slow
def test_sigterm_to_cnnkit_under_nproc_ends_every_process(tmp_path):
    """A scheduler's SIGTERM to cnnkit's pid: the agent and the ranks end with it (they trained
    on, holding the run folder, when it was not passed on); one line, status 143."""
    import signal

    ranks: list[int] = []

    def started(proc) -> None:
        _second_epoch(proc)
        ranks.extend(p for p in _descendants(proc.pid))

    # (with the settings measured, as a run has them: rank 0 measures while rank 1 waits, then
    # broadcasts them; the one --nproc training that goes through it)
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
        assert cnnkit.agent.start_local(2, ["train", "digits"], 0, "runs/digits-1") == 130
        err = capsys.readouterr().err
        assert err.startswith(said) and (err == "") == (presses == 1), err
        assert presses == 1 or "`cnnkit train --resume runs/digits-1 --nproc 2` continues" in err


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


def test_leaving_the_group_after_the_run_takes_a_ctrl_c_and_a_lost_peer_quietly(tmp_path,
                                                                                monkeypatch):  # fmt: skip
    """A Ctrl-C just after `done:` under --nproc reached the ranks in their farewell barrier:
    one rank's KeyboardInterrupt inside gc's weakref callbacks, the other's gloo 'Connection
    closed by peer', both as tracebacks. The run is saved by then: the barrier's failure is
    no error, and a Ctrl-C there comes once the group is left (one line, from the CLI)."""
    import torch.distributed as dist

    from cnnkit.distributed.group import Group

    group = object.__new__(Group)  # (close reads only torch.distributed's state)
    for farewell in ("peer", "ctrl-c"):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / farewell}", rank=0,
                                world_size=1)  # fmt: skip

        def barrier(*args, farewell=farewell, **kwargs) -> None:
            if farewell == "peer":
                raise RuntimeError("[pair.cc:561] Connection closed by peer [127.0.0.1]:3793")
            os.kill(os.getpid(), signal.SIGINT)  # held while the group is left
            time.sleep(0.05)

        monkeypatch.setattr(dist, "barrier", barrier)
        if farewell == "peer":
            group.close(ok=True)
        else:
            with pytest.raises(KeyboardInterrupt):
                group.close(ok=True)
        assert not dist.is_initialized()  # left either way
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
