"""Fixtures shared across test modules."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import CLI, ROOT


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory from `cnnkit train digits` (2 epochs), made once per test session."""
    run = tmp_path_factory.getbasetemp() / "digits-run"
    cmd = [*CLI, "train", "digits", "--out", str(run), "train.epochs=2", "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    return run


@pytest.fixture(autouse=True)
def own_settings_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    """Measured training settings are cached per test session, not in the user's ~/.cache."""
    from cnnkit import tuning

    monkeypatch.setattr(tuning, "CACHE", tmp_path_factory.getbasetemp() / "settings.json")
