"""Summarise a benchmarks/gpu.sh run: OUT/summary.json (the headline figures with the settings
of each) and readable lines on stdout.

    python benchmarks/gpu_summary.py OUT_DIR
"""

from __future__ import annotations

import csv
import json
import os
import re
import sys
from pathlib import Path


def load(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def steps(out: Path) -> tuple[dict[str, int], list[str], list[str]]:
    """{step: exit status} of the steps that ran to their own end or limit, the steps skipped
    for the budget, and those stopped by the budget (started with less than their limit left)."""
    done, cut = {}, []
    for line in (
        (out / "steps.txt").read_text().splitlines() if (out / "steps.txt").is_file() else []
    ):
        found = re.match(r"(\S+): rc=(\d+)", line)
        if found and line.endswith("cut by the budget"):
            cut.append(found.group(1))
        elif found:
            done[found.group(1)] = int(found.group(2))
    skipped = []
    if (out / "skipped.txt").is_file():
        skipped = [line.split(":")[0] for line in (out / "skipped.txt").read_text().splitlines()]
    return done, skipped, cut


def gpu_tests(out: Path, rc: int | None) -> dict | None:
    """pytest's counts (from its final summary line), and whether the tests passed: exit status
    0 and at least one passed (a pytest killed by its time limit prints no counts, and zero
    failures is not a pass); None where every test skipped (no CUDA: a SMOKE rehearsal)."""
    log = out / "gpu_tests.log"
    if not log.is_file():
        return None
    lines = [line for line in log.read_text(errors="replace").splitlines()
             if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b", line)]  # fmt: skip
    final = lines[-1] if lines else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", final)}
    passed, skipped = counts.get("passed", 0), counts.get("skipped", 0)
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    ok = None if rc == 0 and not passed and not failed and skipped else rc == 0 and passed > 0
    return {"passed": passed, "failed": failed, "skipped": skipped, "rc": rc, "ok": ok}


def model_only(out: Path) -> tuple[float | None, dict]:
    """The best AlexNet-OWT training figure of the bench steps, with its settings."""
    best, where = None, {}
    for name in ("train_owt_256_explore", "train_owt_1024_bf16", "train_owt_compile"):
        r = load(out, name)
        if r is None:
            continue
        rows = r.get("explore") or [{k: r[k] for k in ("precision", "channels_last", "threads")}
                                    | {"images_per_second": r["images_per_second"]}]  # fmt: skip
        for row in rows:
            if best is None or row["images_per_second"] > best:
                best = row["images_per_second"]
                where = {"step": name, "batch": r["batch"], "compile": r["compile"],
                         **{k: row[k] for k in ("precision", "channels_last", "threads")}}  # fmt: skip
    return best, where


def run_figures(out: Path, run: str) -> tuple[float | None, dict]:
    """Steady-state images/s of a `cnnkit train` run: its best epoch after the first."""
    folder = out / "runs" / run
    if not (folder / "metrics.csv").is_file():
        return None, {}
    rows = list(csv.DictReader((folder / "metrics.csv").open()))
    later = rows[1:] or rows
    rate = max(float(r["images_per_second"]) for r in later)
    if not (folder / "summary.json").is_file():  # stopped by its time limit after an epoch
        return rate, {"finished": False}
    summary = json.loads((folder / "summary.json").read_text())
    keep = ("precision", "channels_last", "device", "world_size", "epochs", "val_top1")
    return rate, {k: summary.get(k) for k in keep}


def main() -> None:
    out = Path(sys.argv[1])
    done, skipped, cut = steps(out)
    train, train_settings = model_only(out)
    e2e, e2e_settings = run_figures(out, "packed-raw")
    e2e_jpeg, e2e_jpeg_settings = run_figures(out, "packed-jpeg")
    explore = load(out, "train_owt_256_explore") or {}
    tests = gpu_tests(out, done.get("gpu_tests"))
    loaders = {k: load(out, f"loader_{k}") for k in ("raw", "jpeg_cpu", "jpeg_gpu")}
    hardware = (
        (out / "hardware.txt").read_text().strip() if (out / "hardware.txt").is_file() else ""
    )
    summary = {
        "hardware": hardware,
        "train_images_per_second": train, "train_settings": train_settings,
        "train_e2e_images_per_second": e2e, "train_e2e_settings": e2e_settings,
        "train_e2e_jpeg_gpu_images_per_second": e2e_jpeg, "train_e2e_jpeg_gpu_settings": e2e_jpeg_settings,
        "loader_images_per_second": (loaders["raw"] or {}).get("images_per_second"),
        "loader_jpeg_cpu_images_per_second": (loaders["jpeg_cpu"] or {}).get("images_per_second"),
        "loader_jpeg_gpu_images_per_second": (loaders["jpeg_gpu"] or {}).get("images_per_second"),
        "loader_settings": {k: {f: (v or {}).get(f) for f in ("workers", "batch", "mode", "decode")}
                            for k, v in loaders.items()},  # fmt: skip
        "speedup_vs_torchvision_plain": explore.get("speedup_vs_baseline"),
        "speedup_vs_torchvision_careful": explore.get("speedup_vs_careful"),
        "peak_fraction": explore.get("peak_fraction"),
        "chosen_settings": explore.get("settings"),
        "gpu_tests": tests,
        "gpu_tests_passed": tests["ok"] if tests else None,
        "steps_failed": sorted(name for name, rc in done.items() if rc != 0),
        "steps_skipped": skipped,
        "steps_cut_by_budget": cut,
        "steps_selected": os.environ.get("STEPS", "").split() or "all",  # gpu.sh's STEPS
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for key, value in summary.items():
        if key != "hardware":
            print(f"{key:40s} {json.dumps(value)[:150]}")


if __name__ == "__main__":
    main()
