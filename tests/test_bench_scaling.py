"""cnnkit.bench's scaling study: its devices checked before any timing, its networks, and
the JSON and plot it writes (a quick run never over a full study)."""

import json

import pytest
import torch
from helpers import TINY_NET as TINY
from helpers import TINY_NET_MACS as TINY_MACS
from helpers import run_cli

from cnnkit.bench.scaling import (
    Entry,
    check_replaceable,
    lenet,
    parse_devices,
    run_scaling,
    study,
    write_outputs,
)
from cnnkit.bench.throughput import train_config
from cnnkit.distributed import resolve_device
from cnnkit.errors import ConfigError
from cnnkit.infer.images import drawn_by_cnnkit
from cnnkit.nn import build_model

CPU = torch.device("cpu")


def test_bad_device_and_precision_are_config_errors():
    with pytest.raises(ConfigError, match="--device"):
        resolve_device("tpu")
    with pytest.raises(ConfigError, match="fp16"):
        train_config(CPU, "fp16")
    with pytest.raises(ConfigError, match="--devices"):
        parse_devices("cpu,tpu")
    assert parse_devices("cpu, cpu")[0] == [CPU]  # (gpu.sh's SMOKE run: `cpu,$DEV`) timed once
    # `cpu:0` is the CPU by the name results are keyed by (the GPU/CPU speed-ups look up "cpu")
    assert [str(d) for d in parse_devices("cpu:0")[0]] == ["cpu"]
    assert parse_devices("cpu:0,cpu") == ([CPU], None)  # CPU only: no "no CUDA" note
    for text in ("cuda:abc", "cpu:1", "cuda:-1"):
        with pytest.raises(ConfigError, match="give a comma list of cpu, cuda, cuda:N"):
            parse_devices(text)
    if not torch.cuda.is_available():  # the CPU half alone where both are asked for; where
        # only a GPU is, refused (it timed the CPU and exited 0), as bench loader --device cuda
        devices, note = parse_devices("cpu,cuda")
        assert devices == [CPU] and note.startswith("no CUDA device on this machine")
        with pytest.raises(ConfigError, match=r"^--devices: 'cuda' asked for, but no CUDA"):
            parse_devices("cuda")


def test_scaling_devices_are_checked_against_the_gpus_there(monkeypatch):
    """(CUDA faked: one GPU.) A GPU the machine lacks is refused before minutes of timing, and
    `cuda` and `cuda:0` name one GPU, timed once."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ConfigError, match="'cuda:5': this machine has 1 CUDA device"):
        parse_devices("cpu,cuda:5")
    assert parse_devices("cuda,cuda:0,cpu") == ([torch.device("cuda"), CPU], None)
    from cnnkit.bench.scaling import _speedup

    devices, _ = parse_devices("cpu:0,cuda")  # the speed-up's keys: "cpu:0" had none
    times = {"train_ms_per_image": 4.0, "infer_ms_per_image": 2.0}
    results = {str(d): {k: v / (1 + 3 * (d.type == "cuda")) for k, v in times.items()}
               for d in devices}  # fmt: skip
    assert _speedup(results) == {"train": 4.0, "infer": 4.0}


def test_study_families_and_lenet_sizes():
    entries = study()
    lenets = [e for e in entries if e.family == "lenet5"]
    assert [e.spec["input"] for e in lenets] == [[1, s, s] for s in range(32, 105, 8)]
    assert [e.size for e in entries if e.family == "smallcnn"] == [
        f"width x{w}" for w in (1, 2, 4, 8)
    ]
    assert entries[-1].family == "alexnet"
    assert build_model(lenet(104), device="meta").table[6].output_shape == (120, 19, 19)


def test_scaling_writes_json_and_png(tmp_path):
    devices = ([CPU], "CPU only")
    entries = [Entry("tiny", "x1", TINY, 2), Entry("lenet5", "input 40", lenet(40), 2)]
    report = run_scaling(devices, "fp32", quick=True, entries=entries)
    paths = write_outputs(report, tmp_path / "out")
    data = json.loads(paths[0].read_text())
    assert [n["name"] for n in data["networks"]] == ["tiny", "lenet5-40"]
    assert data["networks"][0]["macs"] == TINY_MACS and data["note"] == "CPU only"
    cpu = data["networks"][1]["results"]["cpu"]
    assert cpu["train_ms_per_image"] > 0 and cpu["infer_ms_per_image"] > 0
    assert all(n["speedup"] is None for n in data["networks"])
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn_by_cnnkit(paths[1])  # marked: the next run may replace it, as it does here
    assert write_outputs(report, tmp_path / "out") == paths
    assert data["quick"] is True  # a smoke run says so, in the file and its table's title
    from io import StringIO

    from rich.console import Console

    from cnnkit.bench.scaling import print_scaling

    console = Console(file=StringIO(), width=200)
    print_scaling(report, console)
    assert "QUICK: a smoke run, not figures" in console.file.getvalue()


@pytest.mark.parametrize("quick", [True, False])
def test_the_picture_names_the_hardware_the_batch_and_a_smoke_run(tmp_path, monkeypatch, quick):
    """scaling.png alone said only `cnnkit scaling study (fp32): cpu`: a --quick smoke run's
    (three repeats of tiny networks) looked like a study's figures."""
    from matplotlib.figure import Figure

    from cnnkit.bench.scaling import plot_scaling

    titles, suptitle = [], Figure.suptitle
    monkeypatch.setattr(Figure, "suptitle",
                        lambda fig, text, **kw: titles.append(text) or suptitle(fig, text, **kw))  # fmt: skip
    times = {"cpu": {"train_ms_per_image": 2.0, "infer_ms_per_image": 1.0}}
    rows = [{"family": "lenet5", "batch": 8, "macs": m, "results": times, "speedup": None}
            for m in (1e5, 1e6)]  # fmt: skip
    report = {"precision": "fp32", "devices": {"cpu": "Intel Xeon (2 cores)"}, "quick": quick,
              "networks": rows}  # fmt: skip
    plot_scaling(report, tmp_path / "s.png")
    assert titles[0].startswith("cnnkit scaling study (fp32, batch 8): cpu (Intel Xeon (2 cores))")
    assert ("QUICK: a smoke run, not figures" in titles[0]) is quick


def test_a_failed_write_keeps_the_last_pair_or_writes_neither(tmp_path, monkeypatch):
    """scaling.json and scaling.png are one study: a JSON that cannot be written (a full disk)
    leaves the last run's pair as it was, or an empty folder, never a new drawing beside it."""
    from cnnkit.bench import scaling

    entries = [Entry("tiny", "x1", TINY, 2)]
    report = run_scaling(([CPU], "CPU only"), "fp32", quick=True, entries=entries)
    real = scaling.write_atomic

    def full(path, data, private=False):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(scaling, "write_atomic", full)
    with pytest.raises(OSError):
        write_outputs(report, tmp_path / "fresh")
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == []
    monkeypatch.setattr(scaling, "write_atomic", real)
    json_path, png_path = write_outputs(report, tmp_path / "out")
    before = json_path.read_bytes(), png_path.read_bytes()
    monkeypatch.setattr(scaling, "write_atomic", full)
    with pytest.raises(OSError):
        write_outputs({**report, "note": "another study"}, tmp_path / "out")
    assert (json_path.read_bytes(), png_path.read_bytes()) == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["scaling.json", "scaling.png"]


def test_a_full_disk_names_scaling_png_and_still_shows_the_figures(tmp_path, monkeypatch,
                                                                    capsys):  # fmt: skip
    """The error named the hidden `.scaling.png.<pid>.new`, and the study's figures were
    never printed: a full study's hour lost. It names scaling.png; the table is shown."""
    from cnnkit.bench import scaling

    report = run_scaling(([CPU], "CPU only"), "fp32", quick=True,
                         entries=[Entry("tiny", "x1", TINY, 2)])  # fmt: skip

    def full(report, path):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(scaling, "plot_scaling", full)
    with pytest.raises(OSError) as error:
        write_outputs(report, tmp_path / "out")
    assert error.value.filename == str(tmp_path / "out" / "scaling.png")
    monkeypatch.setattr(scaling, "run_scaling", lambda *a, **k: report)
    code, out, err = run_cli(["bench", "scaling", "--devices", "cpu", "--quick", "-o",
                              str(tmp_path / "cli")], capsys)  # fmt: skip
    assert code == 1 and "tiny" in out and "QUICK" in out
    assert f"{tmp_path / 'cli' / 'scaling.png'}: No space left on device" in err


def test_cli_scaling_refuses_what_it_cannot_do_before_any_timing(capsys):
    code, out, err = run_cli(["bench", "scaling", "--devices", "cpu", "--out", "/proc"], capsys)
    assert code == 2 and not out and err.startswith("cnnkit: error: --out: cannot write in /proc")
    code, _, err = run_cli(["bench", "scaling", "--devices", "cpu", "-p", "auto"], capsys)
    assert code == 2 and "'auto' is not one of fp32, bf16, fp16" in err


@pytest.mark.parametrize("recorded", [{"quick": False}, {}], ids=["full", "unmarked"])
def test_a_quick_scaling_run_never_replaces_a_full_study(recorded, tmp_path, capsys):
    """A study written before `quick` was recorded (benchmarks/results/scaling-cpu.json) is a
    full one too: --quick wrote over it."""
    study = json.dumps({**recorded, "networks": [{}] * 15})
    (tmp_path / "scaling.json").write_text(study)
    code, out, err = run_cli(["bench", "scaling", "--devices", "cpu", "--quick", "-o",
                              str(tmp_path)], capsys)  # fmt: skip
    assert code == 2 and not out and "holds a full study (15 networks)" in err, err
    assert (tmp_path / "scaling.json").read_text() == study
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scaling.json"]


@pytest.mark.parametrize(
    ("name", "content", "why"),
    [("scaling.png", None, "is not a picture cnnkit drew"),
     ("scaling.json", b"notes\n", "is not a study cnnkit wrote")],
    ids=["photo", "notes"],
)  # fmt: skip
def test_scaling_never_replaces_a_file_cnnkit_did_not_write(name, content, why, tmp_path, capsys):
    """-o DIR (by default the current folder) wrote over any scaling.png or scaling.json
    there, a picture of the user's too; now refused with one line, before any timing."""
    from PIL import Image

    path = tmp_path / name
    if content is None:
        Image.new("RGB", (10, 10)).save(path)
    else:
        path.write_bytes(content)
    before = path.read_bytes()
    code, out, err = run_cli(["bench", "scaling", "--devices", "cpu", "--quick", "-o",
                              str(tmp_path)], capsys)  # fmt: skip
    assert code == 2 and not out and err.count("\n") == 1, err
    assert err.startswith(f"cnnkit: error: --out: {path} exists and {why}"), err
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [name]


def test_scaling_replaces_its_own_outputs_and_refuses_a_file_as_out(tmp_path, capsys):
    """A study cnnkit wrote and the picture beside it (drawn before pictures were marked) are
    replaced; --out naming a file says so (it said `cannot create ...: File exists`)."""
    from PIL import Image

    (tmp_path / "scaling.json").write_text(json.dumps({"quick": True, "networks": []}))
    Image.new("RGB", (10, 10)).save(tmp_path / "scaling.png")
    check_replaceable(tmp_path, quick=True)  # no error
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, out, err = run_cli(["bench", "scaling", "--devices", "cpu", "-o", str(afile)], capsys)
    assert (
        code == 2
        and not out
        and err == f"cnnkit: error: --out {afile}: is a file; --out names a folder\n"
    )
