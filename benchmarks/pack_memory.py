"""Peak memory of `cnnkit pack`: N images packed at 256 px, summed over the packing processes.

    python benchmarks/pack_memory.py --images 10000 --workers 2

Builds (once) N ~500x375 photo JPEGs (the loader benchmark's folder), then runs `cnnkit pack`
as a child process and samples every 50 ms the proportional set size (PSS: shared pages such
as torch's libraries counted once across processes) of it and all its children. Reports the
peak of that sum and of the plain RSS sum (an upper bound). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loader_vs_torchvision import build_photo_folder, claim_work  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORK = Path("/tmp/cnnkit-pack-bench")


def _tree(pid: int) -> list[int]:
    """pid and all its descendants (from /proc)."""
    children, pids = {}, [pid]
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(status.parent.name))
    for p in pids:
        pids += children.get(p, [])
    return pids


def _memory_kb(pid: int) -> tuple[int, int]:
    """(PSS, RSS) in kB of one process, (0, 0) if it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0, 0
    values = {line.split(":")[0]: int(line.split()[1]) for line in text.splitlines()[1:]}
    return values.get("Pss", 0), values.get("Rss", 0)


def measure_pack(src: Path, dst: Path, workers: int, fmt: str) -> dict:
    """Run cnnkit pack in a child process; peak PSS/RSS sums over its process tree."""
    shutil.rmtree(dst, ignore_errors=True)  # (in a --work claim_work owns)
    cmd = [sys.executable, "-m", "cnnkit", "pack", str(src), str(dst), "--size", "256",
           "--workers", str(workers), "--format", fmt]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peak_pss = peak_rss = 0
    while proc.poll() is None:
        pss, rss = map(sum, zip(*(_memory_kb(p) for p in _tree(proc.pid)), strict=True))
        peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        time.sleep(0.05)
    output = proc.stdout.read().decode()
    if proc.returncode:
        raise SystemExit(f"pack failed:\n{output}")
    return {"seconds": time.perf_counter() - start, "peak_pss_mb": peak_pss / 1024,
            "peak_rss_mb": peak_rss / 1024, "output": output.strip().splitlines()[-1]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--images", type=int, default=10000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--format", default="raw", choices=["raw", "jpeg"])
    parser.add_argument("--work", type=Path, default=WORK)
    args = parser.parse_args()
    claim_work(args.work, WORK)
    photos = build_photo_folder(args.work / "photos", args.images)
    result = measure_pack(photos, args.work / "packed", args.workers, args.format)
    print(f"pack of {args.images} images at 256 px ({args.format}, {args.workers} workers): "
          f"{result['seconds']:.1f} s, peak memory {result['peak_pss_mb']:.0f} MB PSS "
          f"({result['peak_rss_mb']:.0f} MB RSS sum)")  # fmt: skip
    print(json.dumps({**vars(args), "work": str(args.work), **result}))


if __name__ == "__main__":
    main()
