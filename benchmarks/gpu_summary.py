"""Summarise a benchmarks/gpu.sh run: OUT/summary.json (the headline figures with the settings
of each) and readable lines on stdout. Each section is read on its own: one that cannot be read
is None, with the reason in `summary_errors`, and the others are kept.

    python benchmarks/gpu_summary.py OUT_DIR
"""

from __future__ import annotations

import csv
import json
import os
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def steps(out: Path) -> tuple[dict[str, int], list[str], list[str]]:
    """{step: exit status} of the steps that ran to their own end or limit (or were stopped by
    a signal: rc 143), the steps skipped for the budget, and those stopped by the budget
    (started with less than their limit left)."""
    done, cut = {}, []
    for line in text(out / "steps.txt").splitlines():
        found = re.match(r"(\S+): rc=(\d+)", line)
        if found and line.endswith("cut by the budget"):
            cut.append(found.group(1))
        elif found:
            done[found.group(1)] = int(found.group(2))
    skipped = [m.group(1) for line in text(out / "skipped.txt").splitlines()
               if (m := re.match(r"(\S+): skipped", line))]  # fmt: skip
    return done, skipped, cut


def selected(out: Path) -> list[str] | None:
    """The steps gpu.sh's STEPS named (from the environment, else from hardware.txt, where
    gpu.sh wrote them); None: all."""
    named = os.environ.get("STEPS") or next(
        (line.split(":", 1)[1] for line in text(out / "hardware.txt").splitlines()
         if line.startswith("steps selected:")), "")  # fmt: skip
    return named.split() or None


def planned(chosen: list[str] | None) -> list[str]:
    """The steps gpu.sh runs (its `step NAME LIMIT` lines), in order, as STEPS narrows them."""
    names = re.findall(r"^\s*step\s+(\w+)\s+\d+", text(HERE / "gpu.sh"), re.MULTILINE)
    return [n for n in names if chosen is None or n in chosen]


def gpu_tests(out: Path, rc: int | None) -> dict | None:
    """pytest's counts (from its final summary line), the tests that failed, and whether the
    tests passed: exit status 0 and at least one passed (zero failures is not a pass); None
    where every test skipped (no CUDA: a SMOKE rehearsal). A pytest killed by its time limit
    prints no counts: those of its verbose lines (-v), each test as it ended, stand in, with
    `unfinished` saying so."""
    log = out / "gpu_tests.log"
    if not log.is_file():
        return None
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines()
             if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b", line)
             and not re.search(r"(PASSED|FAILED|SKIPPED|ERROR)", line)]  # fmt: skip
    final = lines[-1] if lines else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", final)}
    # -v's lines: `tests/x.py::t PASSED [ 50%]`, and under xdist `[gw1] [ 50%] PASSED tests/x.py::t`
    ended = re.findall(r"(?:(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)\b|"
                       r"\b(PASSED|FAILED|SKIPPED|ERROR) (\S+::\S+))", text)  # fmt: skip
    outcomes: dict[str, str] = {}
    for name, outcome, outcome2, name2 in ended:
        outcomes[name or name2] = outcome or outcome2
    failed_tests = sorted(n for n, o in outcomes.items() if o in ("FAILED", "ERROR"))
    if not final and outcomes:  # killed before its summary
        counts = {"passed": sum(o == "PASSED" for o in outcomes.values()),
                  "skipped": sum(o == "SKIPPED" for o in outcomes.values()),
                  "failed": len(failed_tests)}  # fmt: skip
    passed, skipped = counts.get("passed", 0), counts.get("skipped", 0)
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    ok = None if rc == 0 and not passed and not failed and skipped else rc == 0 and passed > 0
    return {"passed": passed, "failed": failed, "skipped": skipped, "rc": rc, "ok": ok,
            "failed_tests": failed_tests, "unfinished": not final}  # fmt: skip


def bench_rows(out: Path) -> list[dict]:
    """Every AlexNet-OWT training figure of the bench steps, with its settings."""
    rows = []
    for name in ("train_owt_256_explore", "train_owt_1024_bf16", "train_owt_compile"):
        r = load(out, name)
        if r is None:
            continue
        for row in r.get("explore") or [r]:
            rows.append({"step": name, "batch": r["batch"], "compile": r["compile"],
                         **{k: row[k] for k in ("precision", "channels_last", "threads",
                                                "images_per_second")}})  # fmt: skip
    return rows


def best(rows: list[dict]) -> tuple[float | None, dict]:
    if not rows:
        return None, {}
    top = max(rows, key=lambda r: r["images_per_second"])
    return top["images_per_second"], {k: v for k, v in top.items() if k != "images_per_second"}


def compile_speedup(rows: list[dict]) -> float | None:
    """torch.compile's step against the same settings uncompiled (the explore run's row)."""
    on = [r for r in rows if r["step"] == "train_owt_compile" and r["compile"]]
    off = [r for r in rows if r["step"] == "train_owt_256_explore" and not r["compile"]
           and on and (r["precision"], r["channels_last"]) == (on[0]["precision"],
                                                                on[0]["channels_last"])]  # fmt: skip
    return on[0]["images_per_second"] / off[0]["images_per_second"] if on and off else None


def run_figures(out: Path, run: str) -> tuple[float | None, dict]:
    """Steady-state images/s of a `cnnkit train` run (its best epoch after the first), with the
    median of those epochs and their share of time waiting for the loader."""
    folder = out / "runs" / run
    if not (folder / "metrics.csv").is_file():
        return None, {}
    rows = list(csv.DictReader((folder / "metrics.csv").open()))
    later = rows[1:] or rows
    rates = [float(r["images_per_second"]) for r in later]
    waits = [float(r["data_wait"]) for r in later if r.get("data_wait")]
    settings = {"epochs_counted": len(later), "median_images_per_second": statistics.median(rates),
                "data_wait_median": statistics.median(waits) if waits else None}  # fmt: skip
    batch = re.search(r"batch_size: (\d+)", text(out / "runs" / f"{run.split('-')[1]}.yaml"))
    settings["batch"] = int(batch.group(1)) if batch else None
    if not (folder / "summary.json").is_file():  # stopped by its time limit after an epoch
        return max(rates), {**settings, "finished": False}
    summary = json.loads((folder / "summary.json").read_text())
    keep = ("precision", "channels_last", "device", "world_size", "epochs", "train_images",
            "val_top1")  # fmt: skip
    return max(rates), {**settings, **{k: summary.get(k) for k in keep}}


def loader(out: Path, name: str) -> dict | None:
    r = load(out, f"loader_{name}")
    keep = ("images_per_second", "cpu_ms_per_image", "workers", "batch", "batches", "warmup",
            "mode", "decode", "input_shape", "train_crop")  # fmt: skip
    return {k: r.get(k) for k in keep} if r else None


def gpu_trace(out: Path) -> dict | None:
    """The peaks of nvidia-smi's 2-second trace, and the SM clock while the GPU was busy."""
    path = out / "nvidia-smi-trace.csv"
    if not path.is_file():
        return None
    rows = list(csv.reader(text(path).splitlines()))[1:]

    def col(i: int) -> list[float]:
        return [float(r[i]) for r in rows if len(r) > i and re.fullmatch(r"\s*[\d.]+\s*", r[i])]

    busy = [float(r[2]) for r in rows if len(r) > 2 and r[1].strip().isdigit()
            and int(r[1]) >= 50 and re.fullmatch(r"\s*[\d.]+\s*", r[2])]  # fmt: skip
    throttled = [
        r[7].strip() for r in rows if len(r) > 7 and r[7].strip() not in ("0x0000000000000000", "")
    ]
    return {"samples": len(rows), "memory_used_mib_max": max(col(4), default=None),
            "power_w_max": max(col(5), default=None), "temperature_c_max": max(col(6), default=None),
            "sm_clock_mhz_median_busy": statistics.median(busy) if busy else None,
            "throttle_reasons_seen": sorted(set(throttled))}  # fmt: skip


def main() -> None:
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        raise SystemExit(f"usage: {Path(__file__).name} OUT (the folder gpu.sh wrote; "
                         f"{' '.join(sys.argv[1:]) or 'none'} given is not one)")  # fmt: skip
    out = Path(sys.argv[1])
    errors: dict[str, str] = {}

    def section(name: str, read: Callable[[], Any], empty: Any = None) -> Any:
        try:
            return read()
        except Exception as e:  # noqa: BLE001 - one unreadable part leaves the others
            errors[name] = f"{type(e).__name__}: {e}"
            return empty

    done, skipped, cut = section("steps", lambda: steps(out), ({}, [], []))
    chosen = section("steps_selected", lambda: selected(out))
    plan = section("steps_planned", lambda: planned(chosen), [])
    rows = section("train", lambda: bench_rows(out), [])
    train, train_settings = best(rows)
    bf16, bf16_settings = best([r for r in rows if r["precision"] == "bf16"])
    e2e, e2e_settings = section("e2e", lambda: run_figures(out, "packed-raw"), (None, {}))
    e2e_jpeg, e2e_jpeg_settings = section("e2e_jpeg", lambda: run_figures(out, "packed-jpeg"),
                                          (None, {}))  # fmt: skip
    explore = section("explore", lambda: load(out, "train_owt_256_explore")) or {}
    tests = section("gpu_tests", lambda: gpu_tests(out, done.get("gpu_tests")))
    loaders = {k: section(f"loader_{k}", lambda k=k: loader(out, k))
               for k in ("raw", "jpeg_cpu", "jpeg_gpu")}  # fmt: skip
    summary = {
        "hardware": text(out / "hardware.txt").strip(),
        "complete": (out / "complete").is_file(),  # gpu.sh reached its end
        "train_images_per_second": train, "train_settings": train_settings,
        "train_bf16_images_per_second": bf16, "train_bf16_settings": bf16_settings,
        "compile_speedup": section("compile", lambda: compile_speedup(rows)),
        "train_e2e_images_per_second": e2e, "train_e2e_settings": e2e_settings,
        "train_e2e_jpeg_gpu_images_per_second": e2e_jpeg, "train_e2e_jpeg_gpu_settings": e2e_jpeg_settings,
        "loader_images_per_second": (loaders["raw"] or {}).get("images_per_second"),
        "loader_jpeg_cpu_images_per_second": (loaders["jpeg_cpu"] or {}).get("images_per_second"),
        "loader_jpeg_gpu_images_per_second": (loaders["jpeg_gpu"] or {}).get("images_per_second"),
        "loader_settings": loaders,
        "speedup_vs_torchvision_plain": explore.get("speedup_vs_baseline"),
        "speedup_vs_torchvision_careful": explore.get("speedup_vs_careful"),
        "peak_fraction": explore.get("peak_fraction"),
        "chosen_settings": explore.get("settings"),
        # torchvision's per-image RandAugment / TrivialAugment time over cnnkit's batched one
        "policy_speedup_vs_torchvision": (section("policy", lambda: load(out, "policy"))
                                          or {}).get("ratio"),
        "gpu": section("gpu_trace", lambda: gpu_trace(out)),
        "gpu_tests": tests,
        "gpu_tests_passed": tests["ok"] if tests else None,
        "steps_failed": sorted(name for name, rc in done.items() if rc != 0),
        "steps_skipped": skipped,
        "steps_cut_by_budget": cut,
        # gpu.sh ended before its steps, saying why (no CUDA, a missing wheel, torch broken)
        "stopped": text(out / "stopped.txt").strip() or None,
        "steps_missing": [] if (out / "stopped.txt").is_file() else
        [n for n in plan if n not in done and n not in skipped and n not in cut],  # fmt: skip
        "steps_selected": chosen or "all",  # gpu.sh's STEPS
        "summary_errors": errors,
    }  # fmt: skip
    tmp = out / f"summary.json.{os.getpid()}.tmp"  # (gpu.sh may run two at once)
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(out / "summary.json")
    for key, value in summary.items():
        if key != "hardware":
            print(f"{key:40s} {json.dumps(value)[:150]}")


if __name__ == "__main__":
    main()
