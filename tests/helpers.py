"""Helpers the test modules share: the CLI run in this process, the checkout's CLI, and the
runs, networks and prototxt text that the tests of one area, in several modules, all use."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]  # subprocesses run the checkout's cnnkit, not an installed copy
CLI = [sys.executable, "-m", "cnnkit"]


def sigint_default() -> None:
    """preexec_fn for a subprocess a test sends Ctrl-C to: SIGINT at its default, as a shell
    starts a program. A suite started in the background of a script (`pytest &`) has SIGINT
    and SIGQUIT ignored, as POSIX shells start background jobs (conftest sets SIGINT back), and
    cnnkit keeps an inherited SIG_IGN, as POSIX programs do."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def shared_dir(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """The folder every pytest-xdist worker of this session sees (the workers' common parent
    of their own base folders); the base folder itself when the suite runs in one process."""
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent


def run_cli(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """Run `cnnkit ARGS` in this process: (exit status, stdout, stderr)."""
    from cnnkit.cli import main

    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def cli_ok(argv: list[str]) -> None:
    """Run `cnnkit ARGV` in this process; raise SystemExit only if it failed."""
    from cnnkit.cli import main

    try:
        main(argv)
    except SystemExit as e:
        if e.code:
            raise


def one_error_line(code: int, err: str, codes=(1, 2)) -> str:
    """The one `cnnkit: error:` line a user mistake gives (no traceback), its status checked;
    `cnnkit: note:` warnings said before it aside."""
    lines = [line for line in err.strip().splitlines() if not line.startswith("cnnkit: note: ")]
    assert code in codes, (code, err[-800:])
    assert "Traceback" not in err and len(lines) == 1, err[-800:]
    assert lines[0].startswith("cnnkit: error: ") and len(lines[0]) < 400, lines[0]
    return lines[0]


# The bench tests' network (test_bench_*.py) and its multiply-adds
TINY_NET = {
    "name": "tiny",
    "input": [1, 8, 8],
    "num_classes": 3,
    "layers": [
        {"name": "pool0", "type": "maxpool", "kernel_size": 1},  # no params, reads the input
        {"name": "c1", "type": "conv", "out_channels": 4, "kernel_size": 3},  # (4, 6, 6)
        {"name": "r1", "type": "relu"},
        {"name": "fc", "type": "linear"},  # 144 -> 3
    ],
}
TINY_NET_MACS = 6 * 6 * 4 * 1 * 3 * 3 + 4 * 6 * 6 * 3  # conv + linear, by hand


# The run of the distributed tests (test_distributed_*.py), in one process and in a group of 2
DDP_RUN = {
    "name": "ddp",
    "model": "facenet",
    "data": {"source": "synthetic", "shape": [1, 25, 25], "num_classes": 4, "train_size": 64,
             "val_size": 21, "batch_size": 16},
    "train": {"epochs": 2, "lr": 0.05, "precision": "fp32", "channels_last": False,
              "checkpoint_every": 2, "timeout_s": 60},  # a rank left waiting fails in a minute
    "seed": 5,
    "deterministic": True,
}  # fmt: skip


# The deterministic run of the resume tests (test_train_resume_*.py)
RESUME_RUN = {
    "name": "tiny",
    "model": "digitnet",
    "data": {"source": "synthetic", "shape": [1, 8, 8], "num_classes": 4, "train_size": 128,
             "val_size": 21, "batch_size": 16},
    "train": {"epochs": 2, "lr": 0.05, "schedule": "cosine", "warmup_epochs": 0.5,
              "checkpoint_every": 3, "label_smoothing": 0.1},
    "seed": 3,
    "deterministic": True,
}  # fmt: skip


# Prototxt text of the import-caffe tests (test_caffe_*.py)
CAFFE_INPUT = 'input: "data"\ninput_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8\n'
CAFFE_CONV = "convolution_param {{ num_output: {} kernel_size: 1 }}"


def caffe_layer(name, kind, bottoms, top, params=""):
    """One `layer { ... }` of a prototxt, with PARAMS (text) inside."""
    bottom = " ".join(f'bottom: "{b}"' for b in bottoms)
    return f'layer {{ name: "{name}" type: "{kind}" {bottom} top: "{top}" {params} }}\n'


def interrupt_pack_after(monkeypatch, done: int = 2) -> tuple[list[int], Callable]:
    """cnnkit pack's shard jobs (run in this process: workers=1) raise KeyboardInterrupt once
    `done` shards are packed: (the shards packed, in order; the real pack_shard)."""
    import cnnkit.data.pack as pack

    real, calls = pack.pack_shard, []

    def dies(job):
        if len(calls) == done:
            raise KeyboardInterrupt
        calls.append(job.shard)
        return real(job)

    monkeypatch.setattr(pack, "pack_shard", dies)
    return calls, real
