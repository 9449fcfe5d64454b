"""Fixtures shared across test modules."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from filelock import FileLock
from helpers import cli_ok, shared_dir


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C as at a terminal, in this process and each xdist worker: a suite started in the
    background of a script (`pytest &`) inherits SIGINT ignored, which the tests that press
    Ctrl-C (in process, or in the cnnkit processes they start, which inherit it) would not see.
    And the cores shared among the xdist workers, as torchrun shares them among its ranks."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        from cnnkit.runtime import available_cores

        threads = max(1, available_cores() // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the cnnkit processes the tests start
        import torch

        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """A run directory from `cnnkit train digits` (2 epochs), made once per test session: by
    the first pytest-xdist worker that needs it, the others waiting on its lock (the tests
    only read it; each worker training its own cost a run's CPU on a 2-core machine). The
    command runs in this process, as the tests' run_cli does: a process of its own cost its
    start-up (torch's and torch._dynamo's imports, seconds) while the other worker waited."""
    shared = shared_dir(tmp_path_factory, worker_id)
    run, made = shared / "digits-run", shared / "digits-run.made"
    with FileLock(shared / "digits-run.lock"):
        if not made.exists():
            cli_ok(["train", "digits", "--out", str(run), "train.epochs=2", "--quiet"])
            made.touch()
    return run


@pytest.fixture(scope="session")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 classes of 5 synthetic shapes (24 px), the pack tests' source, made once per test
    session (test_gpu.py has a larger set of its own by this name)."""
    from cnnkit.data.synth import synth_shapes

    root = tmp_path_factory.mktemp("shapes")
    synth_shapes(root, classes=3, per_class=5, size=24)
    return root


@pytest.fixture(scope="session", autouse=True)
def own_home(tmp_path_factory: pytest.TempPathFactory, worker_id: str):
    """The `cnnkit` subprocesses the tests start cache measured settings under this session's
    HOME, not in the user's ~/.cache. One HOME for every pytest-xdist worker, as the suite in
    one process has: a network's settings are measured once a session, not once per worker
    (and matplotlib's font cache is built once). The cache is replaced whole, so a worker
    never reads half a file; two writing at once may lose one entry, measured again."""
    home = shared_dir(tmp_path_factory, worker_id) / "home"
    home.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        yield home


@pytest.fixture(autouse=True)
def own_settings_cache(own_home: Path, monkeypatch) -> None:
    """And so does this process (a test may patch it further)."""
    from cnnkit.nn import tuning

    monkeypatch.setattr(tuning, "CACHE", own_home / ".cache" / "cnnkit" / "settings.json")
    # the suite's workers keep the machine busy, so a choice measured beside them is marked so;
    # a load average that lags them must not have it measured again mid-test
    monkeypatch.setattr(tuning, "idle_machine", lambda: False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long end-to-end checks (marked slow) first: pytest-xdist (3.8) hands each worker a
    first chunk of consecutive tests, a quarter of its share, so the first worker starts them
    all at once while the others take the short ones; none is left to run alone at the end
    while the others wait."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
