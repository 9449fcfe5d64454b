"""`cnnkit bench scaling`: the second seed's study, redone. Network families of growing size
(LeNet-5 with input 32 -> 104, a small CNN at widths x1..x8, AlexNet) timed for training and
classification on every device, with the GPU/CPU speed-up per network against its multiply-adds.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cnnkit.bench.model_setup import load_network, synthetic_batch
from cnnkit.bench.throughput import make_infer_step, make_train_step, train_config
from cnnkit.bench.timing import check_precision, measure
from cnnkit.errors import ConfigError
from cnnkit.nn import read_spec
from cnnkit.runtime import atomic, cannot_write, machine_name, temporary_name, write_atomic

MODES = ("train", "infer")


@dataclass(frozen=True)
class Entry:
    """One network of the study: its family, a label of its size, its spec and batch size."""

    family: str
    size: str
    spec: dict[str, Any]
    batch: int


def lenet(side: int) -> dict[str, Any]:
    """The zoo LeNet-5 with a square input of `side` pixels (the fully connected part grows)."""
    spec = read_spec("lenet5")
    spec["input"] = [1, side, side]
    spec["name"] = f"lenet5-{side}"
    return spec


def small_cnn(width: int) -> dict[str, Any]:
    """A small CIFAR-style CNN (two conv + pool stages, two linear layers) at `width` x channels."""
    conv = {"type": "conv", "kernel_size": 5}
    return {
        "name": f"smallcnn-x{width}",
        "input": [3, 32, 32],
        "num_classes": 10,
        "layers": [
            {**conv, "name": "conv1", "out_channels": 8 * width},  # (8w, 28, 28)
            {"type": "relu"},
            {"type": "maxpool", "kernel_size": 2},  # (8w, 14, 14)
            {**conv, "name": "conv2", "out_channels": 16 * width},  # (16w, 10, 10)
            {"type": "relu"},
            {"type": "maxpool", "kernel_size": 2},  # (16w, 5, 5)
            {"name": "fc1", "type": "linear", "out_features": 64 * width},
            {"type": "relu"},
            {"name": "fc2", "type": "linear"},
        ],
    }


def study(quick: bool = False) -> list[Entry]:
    """The networks of the study in order of family and size (quick: a few small ones)."""
    sides = (32, 104) if quick else tuple(range(32, 105, 8))
    widths = (1, 2) if quick else (1, 2, 4, 8)
    batch = 8 if quick else 64
    entries = [Entry("lenet5", f"input {s}", lenet(s), batch) for s in sides]
    entries += [Entry("smallcnn", f"width x{w}", small_cnn(w), batch) for w in widths]
    if not quick:
        alexnet = copy.deepcopy(read_spec("alexnet"))
        entries.append(Entry("alexnet", "227 px, 1000 classes", alexnet, 32))
    return entries


def parse_devices(text: str | None) -> tuple[list[torch.device], str | None]:
    """Devices to time (default: cpu and cuda when present) and a note when CUDA is absent;
    ConfigError where none of those asked for is here."""
    names = ["cpu", "cuda"] if not text else [n.strip() for n in text.split(",") if n.strip()]
    try:
        parsed = [torch.device(n) for n in names]
    except (RuntimeError, TypeError):
        parsed = []
    if not parsed or any(
        d.type not in ("cpu", "cuda") or d.type == "cpu" and d.index for d in parsed
    ):
        raise ConfigError(f"--devices: {text!r}: give a comma list of cpu, cuda, cuda:N")
    has_cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if has_cuda else 0
    for name, d in zip(names, parsed, strict=True):
        if d.type == "cuda" and has_cuda and (d.index or 0) >= count:
            raise ConfigError(f"--devices: {name!r}: this machine has {count} CUDA device(s)")
    current = torch.cuda.current_device() if has_cuda else 0  # what a bare `cuda` means
    unique: dict[tuple, torch.device] = {}  # each device timed once (`cuda,cuda:0`: once)
    for d in parsed:  # `cpu:0` is `cpu`, the name the results and speed-ups are keyed by
        d = torch.device("cpu") if d.type == "cpu" else d
        unique.setdefault(
            (d.type, (current if d.index is None else d.index) if d.type == "cuda" else None), d
        )
    devices = [d for d in unique.values() if d.type == "cpu" or has_cuda]
    if not devices:  # `--devices cuda` alone: nothing it asked for can be timed here
        raise ConfigError(f"--devices: {text!r} asked for, but no CUDA device is available "
                          "(--devices cpu times the CPU)")  # fmt: skip
    note = None
    if not has_cuda and any(d.type != "cpu" for d in parsed):  # the default, or cpu,cuda
        note = "no CUDA device on this machine: timing the CPU half only (no speed-ups)"
    return devices, note


def time_network(
    entry: Entry, device: torch.device, precision: str, repeats: int, budget: float
) -> dict[str, Any]:
    """Training and classification time per image of one network on one device."""
    model = load_network(entry.spec, device)
    x, y = synthetic_batch(model, entry.batch, device)
    result: dict[str, Any] = {}
    for mode in MODES:
        if mode == "train":  # the engine's step; fp32 keeps NCHW, like `cnnkit train`
            step, engine = make_train_step(model, x, y, train_config(device, precision))
            x = engine.prepare(x)
        else:
            step = make_infer_step(model.eval(), x, device, precision)
        # small networks: many short repeats within a second; large ones: at least 3
        timing = measure(step, device, warmup=1, repeats=repeats, max_seconds=budget, min_repeats=3)
        result[f"{mode}_ms_per_image"] = timing.median * 1e3 / entry.batch
        result[mode] = timing.to_dict()
    del model, x, y
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def run_scaling(
    devices: tuple[list[torch.device], str | None],
    precision: str = "fp32",
    quick: bool = False,
    entries: list[Entry] | None = None,
) -> dict[str, Any]:
    """Time every network of the study on every device; a JSON-ready report with speed-ups."""
    device_list, note = devices
    for device in device_list:
        check_precision(precision, device, auto=False)
    entries = entries if entries is not None else study(quick)
    rows = []
    for entry in entries:
        model = load_network(entry.spec, torch.device("meta"))
        results = {
            str(d): time_network(entry, d, precision, *((3, 0.2) if quick else (30, 1.5)))
            for d in device_list
        }
        row = {
            "family": entry.family,
            "name": model.name,
            "size": entry.size,
            "batch": entry.batch,
            "macs": sum(r.macs for r in model.table),
            "params": sum(r.params for r in model.table),
            "results": results,
        }
        rows.append({**row, "speedup": _speedup(results)})
    return {
        "precision": precision,
        "devices": {str(d): machine_name(d) for d in device_list},
        "note": note,
        "torch": torch.__version__,
        "quick": quick,  # a smoke run: few networks, 3 repeats of 0.2 s at most, not figures
        "networks": rows,
    }


def _speedup(results: dict[str, dict[str, Any]]) -> dict[str, float] | None:
    """GPU/CPU speed-up per mode: CPU time per image over the first GPU's."""
    gpu = next((r for d, r in results.items() if d.startswith("cuda")), None)
    if gpu is None or "cpu" not in results:
        return None
    cpu = results["cpu"]
    return {m: cpu[f"{m}_ms_per_image"] / gpu[f"{m}_ms_per_image"] for m in MODES}


def print_scaling(report: dict[str, Any], console: Any = None) -> None:
    """The study's table: time per image on each device and the GPU/CPU speed-up per network."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from cnnkit.tables import wide_console

    console = console or wide_console()
    devices = list(report["devices"])
    hardware = "; ".join(f"{d}: {name}" for d, name in report["devices"].items())
    smoke = "  QUICK: a smoke run, not figures" if report.get("quick") else ""
    title = f"scaling study, {report['precision']}, ms per image  ({hardware}){smoke}"
    table = Table(title=Text(title), title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("family", "network", "mult-adds"):
        table.add_column(column, justify="right" if column == "mult-adds" else "left")
    for d in devices:
        table.add_column(f"{d} train", justify="right")
        table.add_column(f"{d} classify", justify="right")
    if any(row["speedup"] for row in report["networks"]):
        table.add_column("speed-up train", justify="right")
        table.add_column("speed-up classify", justify="right")
    for row in report["networks"]:
        cells = [row["family"], row["name"], f"{row['macs'] / 1e6:,.1f} M"]
        for d in devices:
            r = row["results"][d]
            cells += [f"{r['train_ms_per_image']:.4f}", f"{r['infer_ms_per_image']:.4f}"]
        if row["speedup"]:
            cells += [f"{row['speedup']['train']:.1f}x", f"{row['speedup']['infer']:.1f}x"]
        table.add_row(*cells)
    console.print(table)


def ensure_dir(out: str | Path) -> Path:
    """The output folder, created if needed (a ConfigError naming it if it cannot be)."""
    out = Path(out)
    if out.exists() and not out.is_dir():  # (mkdir: "File exists")
        from cnnkit.data.decode import file_kind

        kind = "a file" if out.is_file() else file_kind(out.stat().st_mode)
        raise ConfigError(f"--out {out}: is {kind}; --out names a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out: cannot create {out}: {e.strerror}") from None
    reason = cannot_write(out)
    if reason is not None:  # an existing folder that refuses files: before the timing too
        raise ConfigError(f"--out: cannot write in {out} ({reason})")
    return out


STUDY_MAX_BYTES = 16 << 20  # far more than any study's JSON: a larger file is not one


def read_study(path: Path) -> dict[str, Any] | None:
    """The study in `path` where it is a scaling.json cnnkit wrote (a regular file holding an
    object with its `networks`), else None."""
    try:
        if not path.is_file() or path.stat().st_size > STUDY_MAX_BYTES:  # (a FIFO: never read)
            return None
        there = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return there if isinstance(there, dict) and isinstance(there.get("networks"), list) else None


def check_replaceable(out: Path, quick: bool) -> None:
    """ConfigError, before any timing, where `out` holds a scaling.json or scaling.png cnnkit
    did not write (only a study, and a picture cnnkit drew or one beside its study, are
    replaced), or a full study a --quick run (a smoke test) would replace: that took tens of
    minutes of timing."""
    from cnnkit.infer.images import drawn_by_cnnkit

    json_path, png_path = Path(out) / "scaling.json", Path(out) / "scaling.png"
    there = read_study(json_path)
    png_ours = png_path.is_file() and (there is not None or drawn_by_cnnkit(png_path))
    for path, ours, what in ((json_path, there is not None, "a study cnnkit wrote"),
                             (png_path, png_ours, "a picture cnnkit drew")):  # fmt: skip
        if os.path.lexists(path) and not ours:
            raise ConfigError(f"--out: {path} exists and is not {what}, which this would "
                              "replace: give --out another folder")  # fmt: skip
    if quick and there is not None and there.get("quick") is not True:
        count = len(there["networks"])  # (a study written before `quick` was: a full one)
        raise ConfigError(f"--out: {json_path} holds a full study ({count} networks); a "
                          "--quick run would replace it: give --out another folder")  # fmt: skip


def write_outputs(report: dict[str, Any], out: Path) -> list[Path]:
    """Write scaling.json and scaling.png into `out` (created if needed; check_replaceable)."""
    out = ensure_dir(out)
    check_replaceable(out, report.get("quick") is True)
    json_path, png_path = out / "scaling.json", out / "scaling.png"
    staged = out / temporary_name(png_path.name, private=True, kind="new")
    try:  # the pair or neither: the drawing waits beside them until the figures are written
        plot_scaling(report, staged)
        write_atomic(json_path, (json.dumps(report, indent=1) + "\n").encode(), private=True)
        os.replace(staged, png_path)
    except OSError as e:
        if e.filename == str(staged):  # the file the user asked for, not the hidden one
            e.filename = str(png_path)
        raise
    finally:
        staged.unlink(missing_ok=True)
    return [json_path, png_path]


def plot_scaling(report: dict[str, Any], path: Path) -> None:
    """Time per image (left) and GPU/CPU speed-up (right) against multiply-adds, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cnnkit.infer.images import figure_metadata

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    families = list(dict.fromkeys(row["family"] for row in report["networks"]))
    markers = dict(zip(families, "osD^v", strict=False))
    for device in report["devices"]:
        for mode, style in (("train", "-"), ("infer", "--")):
            for family in families:
                rows = [r for r in report["networks"] if r["family"] == family]
                xs = [r["macs"] for r in rows]
                ys = [r["results"][device][f"{mode}_ms_per_image"] for r in rows]
                label = f"{device} {'classify' if mode == 'infer' else mode} {family}"
                left.plot(xs, ys, style, marker=markers[family], label=label)
    _axes(left, "time per image (ms)", "time per image")
    left.legend(fontsize=7)
    _plot_speedup(right, report, families, markers)
    batches = sorted({row["batch"] for row in report["networks"]})
    on = ", ".join(f"{d} ({name})" for d, name in report["devices"].items())
    smoke = "\nQUICK: a smoke run, not figures" if report.get("quick") else ""
    fig.suptitle(f"cnnkit scaling study ({report['precision']}, batch "
                 f"{'/'.join(map(str, batches))}): {on}{smoke}", fontsize=11)  # fmt: skip
    fig.tight_layout()
    with atomic(Path(path), private=True) as f:
        fig.savefig(f, dpi=110, format="png", metadata=figure_metadata("png"))  # marked ours
    plt.close(fig)


def _plot_speedup(ax: Any, report: dict[str, Any], families: list[str], markers: dict) -> None:
    rows = [r for r in report["networks"] if r["speedup"]]
    if not rows:
        ax.text(0.5, 0.5, "CPU only: no GPU speed-up measured", ha="center", va="center")
        ax.set_axis_off()
        return
    for mode, style in (("train", "-"), ("infer", "--")):
        for family in families:
            fam = [r for r in rows if r["family"] == family]
            xs = [r["macs"] for r in fam]
            ys = [r["speedup"][mode] for r in fam]
            label = f"{'classify' if mode == 'infer' else mode} {family}"
            ax.plot(xs, ys, style, marker=markers[family], label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    _axes(ax, "GPU / CPU speed-up", "speed-up")
    ax.legend(fontsize=7)


def _axes(ax: Any, ylabel: str, title: str) -> None:
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("multiply-adds per image")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
