"""The scripts under benchmarks/: bad input refused in one line before any work,
gpu_summary.py's figures, gpu.sh on a machine without CUDA, and ddp_scaling.py under
weight averaging."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.parametrize("script,args,says", [
    ("classify_vs_onnxruntime.py", ["--net", "nonet"],
     "cnnkit: error: 'nonet' is neither a zoo network"),
    ("loader_vs_torchvision.py", ["--device", "foo", "--work", "WORK"],
     "error: --device: 'foo' is not a device"),
    ("loader_vs_torchvision.py", ["--device", "cuda:99", "--work", "WORK"],
     "error: --device: 'cuda:99'"),
    ("policy_vs_torchvision.py", ["--device", "foo"], "error: --device: 'foo' is not a device"),
    ("policy_vs_torchvision.py", ["--size", "4"], "error: --batch and --rounds must be >= 1"),
])  # fmt: skip
def test_benchmark_scripts_refuse_bad_input_in_one_line(script, args, says, tmp_path, capsys,
                                                        monkeypatch):  # fmt: skip
    """A bad --net or --device is the one line that says so, exit status 2, no traceback, and
    before any work (a GPU asked for where there is none failed after minutes of packing)."""
    import runpy

    if script.startswith("classify"):
        pytest.importorskip("onnxruntime")
    path = Path(__file__).parents[1] / "benchmarks" / script
    work = tmp_path / "w"
    monkeypatch.setattr(sys, "argv", [str(path), *(str(work) if a == "WORK" else a for a in args)])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(path), run_name="__main__")
    err = capsys.readouterr().err
    assert done.value.code == 2 and says in err.splitlines()[-1] and "Traceback" not in err, err
    assert not work.exists()  # nothing made


def test_gpu_summary_tells_steps_cut_by_the_budget_from_failures(tmp_path):
    """A step stopped at its own limit failed; one stopped at a limit the budget shortened was
    cut: listed apart, so steps_failed holds only the steps that are broken or too slow."""
    (tmp_path / "steps.txt").write_text("a: rc=0 3s\nb: rc=1 4s\nc: rc=124 40s cut by the budget\n"
                                        "d: rc=124 90s\n")  # fmt: skip
    (tmp_path / "skipped.txt").write_text("e: skipped (20s of the budget left)\n")
    script = Path(__file__).parents[1] / "benchmarks" / "gpu_summary.py"
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, capture_output=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_failed"] == ["b", "d"] and summary["steps_cut_by_budget"] == ["c"]
    assert summary["steps_skipped"] == ["e"] and summary["train_images_per_second"] is None
    assert summary["complete"] is False and summary["summary_errors"] == {}
    assert summary["steps_missing"][:2] == ["synth_shapes", "pack_raw"]  # gpu.sh's, never run


def test_gpu_summary_keeps_every_figure_it_can_read(tmp_path):
    """A step killed by a signal is a failure, one malformed result loses only its own section,
    the GPU trace gives the peaks, and torch.compile's step is set against the same settings."""
    (tmp_path / "steps.txt").write_text("train_owt_256_explore: rc=0 50s\n"
                                        "train_owt_compile: rc=0 80s\nlayers_owt: rc=143 interrupted\n")  # fmt: skip
    row = {"precision": "bf16", "channels_last": True, "threads": 1}
    explore = {"batch": 256, "compile": False, "settings": row, "explore": [
        {**row, "images_per_second": 1000.0}, {**row, "precision": "fp16", "images_per_second": 1100.0}]}  # fmt: skip
    (tmp_path / "train_owt_256_explore.json").write_text(json.dumps(explore))
    compiled = {"batch": 256, "compile": True, **row, "images_per_second": 1500.0}
    (tmp_path / "train_owt_compile.json").write_text(json.dumps(compiled))
    (tmp_path / "loader_raw.json").write_text('{"no figures": 1}')
    (tmp_path / "train_owt_1024_bf16.json").write_text('{"error": "x"}')  # no settings in it
    (tmp_path / "nvidia-smi-trace.csv").write_text(
        "timestamp, utilization.gpu [%], clocks.current.sm [MHz], clocks.current.memory [MHz], "
        "memory.used [MiB], power.draw [W], temperature.gpu, clocks_throttle_reasons.active\n"
        "2026/12/02 10:00:00.000, 0, 345, 3201, 500, 80.5, 30, 0x0000000000000000\n"
        "2026/12/02 10:00:02.000, 97, 1980, 3201, 70000, 650.25, 60, 0x0000000000000000\n"
        "2026/12/02 10:00:04.000, 95, 1900, 3201, 71000, 640.0, 61, 0x0000000000000004\n"
    )
    script = Path(__file__).parents[1] / "benchmarks" / "gpu_summary.py"
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, capture_output=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_failed"] == ["layers_owt"]
    assert summary["train"] if "train" in summary else "train" in summary["summary_errors"]
    assert summary["compile_speedup"] is None and summary["train_images_per_second"] is None
    assert summary["loader_images_per_second"] is None  # read, but holds no figure
    assert summary["gpu"] == {"samples": 3, "memory_used_mib_max": 71000.0, "power_w_max": 650.25,
                              "temperature_c_max": 61.0, "sm_clock_mhz_median_busy": 1940.0,
                              "throttle_reasons_seen": ["0x0000000000000004"]}  # fmt: skip
    (tmp_path / "train_owt_1024_bf16.json").unlink()
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, capture_output=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["summary_errors"] == {}
    assert summary["train_images_per_second"] == 1500.0
    assert summary["train_bf16_images_per_second"] == 1500.0 and summary["compile_speedup"] == 1.5
    assert summary["train_settings"]["step"] == "train_owt_compile"


@pytest.mark.parametrize("killed", [False, True])
def test_gpu_summary_names_the_cuda_tests_that_failed_even_when_pytest_was_killed(tmp_path, killed):
    """pytest -v's lines (under xdist, and without it) name each test as it ends: a pytest
    killed at its limit, with no summary line, still says which passed and which failed."""
    log = ("============ test session starts ============\n"
           "[gw0] [ 33%] PASSED tests/test_gpu.py::test_a \n"
           "[gw1] [ 66%] FAILED tests/test_gpu.py::test_b[nccl] \n"
           "tests/test_loader.py::test_c SKIPPED (needs CUDA)                  [ 80%]\n"
           "tests/test_loader.py::test_d PASSED                                [ 90%]\n")  # fmt: skip
    if not killed:
        log += ("FAILED tests/test_gpu.py::test_b[nccl] - AssertionError\n"
                "======= 1 failed, 2 passed, 1 skipped, 1400 deselected in 91.2s =======\n")  # fmt: skip
    (tmp_path / "gpu_tests.log").write_text(log)
    (tmp_path / "steps.txt").write_text(f"gpu_tests: rc={124 if killed else 1} 180s\n")
    script = Path(__file__).parents[1] / "benchmarks" / "gpu_summary.py"
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, capture_output=True)
    tests = json.loads((tmp_path / "summary.json").read_text())["gpu_tests"]
    assert tests == {"passed": 2, "failed": 1, "skipped": 1, "rc": 124 if killed else 1,
                     "ok": False, "failed_tests": ["tests/test_gpu.py::test_b[nccl]"],
                     "unfinished": killed}  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path of gpu.sh")
@pytest.mark.slow
def test_gpu_script_skips_cleanly_without_cuda(tmp_path):
    script = Path(__file__).parents[1] / "benchmarks" / "gpu.sh"
    out, back = tmp_path / "out", tmp_path / "back"
    for rerun in (False, True):  # a rerun into its own folder starts clean
        if rerun:
            (out / "stale.log").write_text("an earlier run's")
            (back / "summary.json").write_text("{}")
        proc = subprocess.run(  # relative paths, run from another folder
            ["bash", str(script), "out", "back"], capture_output=True, text=True, cwd=tmp_path
        )
        assert proc.returncode == 0, proc.stderr
        names = ["stopped.txt", "summary.json", "summary.txt"]
        assert sorted(p.name for p in out.iterdir()) == [".gpu-sh", "cuda_check.log", *names]
        assert sorted(p.name for p in back.iterdir()) == ["results.tgz", *names]
        summary = json.loads((back / "summary.json").read_text())
        assert summary["stopped"].startswith("no CUDA device on ")  # not a killed run:
        assert summary["steps_missing"] == summary["steps_skipped"] == []  # nothing went missing
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    proc = subprocess.run(["bash", str(script), str(tmp_path / "mine")], capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 2 and "not an earlier gpu.sh run" in proc.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


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
