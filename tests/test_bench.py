"""cnnkit.bench: timing method, per-layer timing, throughput with the engine's step, the scaling
study and the CLI's JSON. Tiny networks and tiny repeat counts: correctness, not speed."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import run_cli

from cnnkit.bench.baseline import PlainProcess, amp_dtype, peer_label, plain_model
from cnnkit.bench.layers import bench_layers
from cnnkit.bench.scaling import Entry, lenet, parse_devices, run_scaling, study, write_outputs
from cnnkit.bench.throughput import (
    bench_throughput,
    make_train_step,
    print_throughput,
    train_config,
)
from cnnkit.bench.timing import measure
from cnnkit.distributed import resolve_device
from cnnkit.errors import CnnkitError, ConfigError
from cnnkit.nn import build_model
from cnnkit.train.settings import precisions

CPU = torch.device("cpu")
TINY = {
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
TINY_MACS = 6 * 6 * 4 * 1 * 3 * 3 + 4 * 6 * 6 * 3  # conv + linear, by hand


def test_measure_counts_repeats_and_never_times_setup():
    calls = []
    timing = measure(
        lambda arg: calls.append(arg), CPU, setup=lambda: time.sleep(0.02) or 7, warmup=2, repeats=3
    )
    assert calls == [7] * 5 and len(timing.seconds) == 3
    assert timing.max < 0.01  # the 20 ms sleep of setup is outside the timed region
    assert timing.min <= timing.median <= timing.max


def test_measure_stops_at_the_time_budget_after_min_repeats():
    timing = measure(lambda _: time.sleep(0.01), CPU, warmup=0, repeats=50, max_seconds=0.001)
    assert len(timing.seconds) == 2


def test_a_step_that_times_itself_counts_its_own_seconds():
    """A peer in its own process reports the seconds its steps took there: the pipe's round
    trip around it is not the peer's time (it biased small CPU steps against the peer)."""
    from cnnkit.bench.timing import measure_interleaved

    def peer(_=None):
        time.sleep(0.01)  # the round trip, say
        return 0.5  # its steps, timed there

    peer.times_itself = True
    timings = measure_interleaved({"here": lambda _: None, "peer": peer}, CPU, warmup=1, repeats=2)
    assert timings["peer"].seconds == (0.5, 0.5) and timings["here"].max < 0.01


def test_layers_report_every_layer_and_both_totals():
    report = bench_layers(TINY, batch=2, device=CPU, repeats=2)
    json.dumps(report)  # JSON-ready
    names = [layer["name"] for layer in report["layers"]]
    assert names == ["pool0", "c1", "r1", "fc", "loss"]
    by_name = {layer["name"]: layer for layer in report["layers"]}
    assert by_name["pool0"]["backward_ms"] is None  # nothing to differentiate before c1
    assert all(by_name[n]["backward_ms"] > 0 for n in ("c1", "r1", "fc", "loss"))
    assert by_name["c1"]["macs"] == 6 * 6 * 4 * 9
    forward_sum = sum(layer["forward_ms"] for layer in report["layers"])
    assert report["forward_sum_ms"] == pytest.approx(forward_sum)
    # the whole passes are separate measurements, not the sums
    assert report["forward_whole_ms"] > 0 and report["backward_whole_ms"] > 0
    assert report["step_ms"] == report["step"]["median_ms"] > 0
    assert report["measurements_in_sums"] == 5 + 4


def test_layers_time_each_call_as_a_training_step_makes_it(monkeypatch):
    """Every timed forward enters autocast afresh (its weight casts are cached only inside one
    context: a step pays for them), and every timed backward finds no gradient to add to."""
    import contextlib

    import cnnkit.bench.layers as layers

    entered, found = [], []
    plain = layers.autocast

    @contextlib.contextmanager
    def counted(device, precision):
        entered.append(precision)
        with plain(device, precision):
            yield

    monkeypatch.setattr(layers, "autocast", counted)
    runner = layers.Runner(CPU, "bf16", warmup=1, repeats=3)
    linear = torch.nn.Linear(8, 4)
    linear.weight.register_hook(lambda g: found.append(linear.weight.grad is None))
    forward, backward = layers.time_layer(linear, [torch.randn(2, 8)], False, runner)
    assert len(forward.seconds) == 3 and len(entered) >= 4  # warm-up + repeats, each its own
    assert len(found) >= 4 and all(found)
    model = build_model(TINY)
    found.clear()
    model.fc.weight.register_hook(lambda g: found.append(model.fc.weight.grad is None))
    layers.time_whole(model, torch.randn(2, 1, 8, 8), torch.tensor([0, 1]), runner)
    assert len(found) >= 8 and all(found)  # the backward's and the step's timed calls


def test_train_throughput_fields_are_consistent():
    r = bench_throughput(TINY, "train", 4, CPU, warmup=1, repeats=2, quick_peak=True)
    assert r["flops_per_image"] == 3 * 2 * TINY_MACS
    assert r["images_per_second"] == pytest.approx(4 / (r["step_ms"] / 1e3))
    assert r["flops_per_second"] == pytest.approx(r["flops_per_image"] * r["images_per_second"])
    peak = r["peak_flops_per_second"]  # the best kernel, or the step itself if it was faster
    assert peak >= r["peak"][r["precision"]]["flops_per_second"]
    assert (
        r["peak_fraction"] == pytest.approx(r["flops_per_second"] / peak)
        and r["peak_fraction"] <= 1
    )
    assert 0 < r["peak_fraction"] and set(precisions(CPU)) <= set(r["peak"])  # those it computes in
    assert r["step"]["min_ms"] <= r["step_ms"] <= r["step"]["max_ms"]


def test_infer_counts_forward_flops_only():
    r = bench_throughput(TINY, "infer", 4, CPU, precision="fp32", repeats=2, quick_peak=True)
    assert r["flops_per_image"] == 2 * TINY_MACS and r["precision"] == "fp32"


def test_infer_with_a_forced_memory_format_stays_classifys_fp32(monkeypatch):
    """--channels-last / --no-channels-last on a CPU: still `cnnkit classify`'s fp32 forward
    pass (it fell back to training's choice with precision auto, bf16 where that was faster)."""
    import cnnkit.bench.throughput as throughput

    asked, choose = [], throughput.choose_settings

    def recorded(model, cfg, *args, **kwargs):
        asked.append(cfg.precision)
        return choose(model, cfg, *args, **kwargs)

    monkeypatch.setattr(throughput, "choose_settings", recorded)
    r = bench_throughput(TINY, "infer", 4, CPU, channels_last=False, threads=1,
                         warmup=0, repeats=1, quick_peak=True, cache=False)  # fmt: skip
    assert asked == ["fp32"] and r["precision"] == "fp32"
    assert r["channels_last"] is False and r["settings"]["as"] == "cnnkit classify"


@pytest.mark.parametrize("ratio", [0.5, 2.0])
def test_a_cpu_estimate_under_the_measured_peak_says_why(ratio):
    """Under a hypervisor /proc/cpuinfo gives the nominal clock, and boosting cores beat the
    estimate made from it: the report says so rather than show a paper peak below the measured."""
    from rich.console import Console

    r = bench_throughput(TINY, "infer", 4, CPU, precision="fp32", repeats=2, quick_peak=True)
    r["settings"]["as"] = "cnnkit classify"
    r["theoretical_peak"] = {"flops_per_second": ratio * r["peak_flops_per_second"],
                             "source": "estimate"}  # fmt: skip
    console = Console(record=True, width=200)
    print_throughput(r, console)
    line = next(x for x in console.export_text().splitlines() if "on paper" in x)
    assert ("above the clock the OS reports" in line) == (ratio < 1)


@pytest.mark.parametrize("name,sheet", [
    ("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA L4", "L4"), ("NVIDIA L40S", None),
    ("NVIDIA L40", None),
])  # fmt: skip
def test_a_gpus_data_sheet_is_matched_by_whole_words(name, sheet):
    from cnnkit.bench.peak import data_sheet

    found = data_sheet(name)
    assert (found and found[0]) == sheet


def test_zen4s_avx512_counts_at_half_the_rate_of_512_bit_units():
    from cnnkit.bench.peak import _cpu_flops_per_cycle

    flags = {"avx2", "fma", "avx512f", "avx512_bf16"}
    assert _cpu_flops_per_cycle(flags, "fp32")[0] == 64
    assert _cpu_flops_per_cycle(flags, "fp32", half_width=True)[0] == 32
    assert _cpu_flops_per_cycle(flags, "bf16", half_width=True) == (
        64, "AVX-512 BF16 dot products on 256-bit units, 2 units")  # fmt: skip


def test_train_step_is_a_real_sgd_step_of_the_engine():
    model = build_model(TINY)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))
    before = [p.detach().clone() for p in model.parameters()]
    step, engine = make_train_step(model, x, y, train_config(CPU, "fp32"))
    step(None)
    assert isinstance(engine.optimizer, torch.optim.SGD)
    assert engine.optimizer.param_groups[0]["momentum"] == 0.9
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


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
    assert data["quick"] is True  # a smoke run says so, in the file and its table's title
    from io import StringIO

    from rich.console import Console

    from cnnkit.bench.scaling import print_scaling

    console = Console(file=StringIO(), width=200)
    print_scaling(report, console)
    assert "QUICK: a smoke run, not figures" in console.file.getvalue()


def test_cli_scaling_refuses_what_it_cannot_do_before_any_timing(capsys):
    code, out, err = run_cli(["bench", "scaling", "--devices", "cpu", "--out", "/proc"], capsys)
    assert code == 2 and not out and err.startswith("cnnkit: error: --out: cannot write in /proc")
    code, _, err = run_cli(["bench", "scaling", "--devices", "cpu", "-p", "auto"], capsys)
    assert code == 2 and "'auto' is not one of fp32, bf16, fp16" in err


def test_bench_of_a_run_takes_its_train_settings(tmp_path, capsys):
    """The faces run sets fp32: `bench train faces` times fp32, as `cnnkit train faces` runs
    (it timed bf16 where that was faster, and said `cnnkit train` chose it); -p still wins."""
    from cnnkit.cli.bench import _as_the_run_sets

    def sets(net, *options):
        chosen = _as_the_run_sets(net, *options)
        return tuple(chosen[k] for k in ("batch", "precision", "channels_last", "threads"))

    assert sets("faces", None, "auto", None, None) == (16, "fp32", None, None)
    assert sets("faces", 8, "bf16", True, 2) == (8, "bf16", True, 2)  # options win
    assert sets("lenet5", None, "auto", None, None) == (64, "auto", None, None)  # a network
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"model": TINY, "data": {"source": "digits"},
                                   "train": {"channels_last": False, "threads": 1}}))  # fmt: skip
    assert sets(str(run), None, "auto", None, None) == (64, "auto", False, 1)
    compiled = tmp_path / "compiled.yaml"  # train.compile too, unless --compile/--no-compile
    compiled.write_text(yaml.safe_dump({"model": TINY, "data": {"source": "digits"},
                                        "train": {"compile": True}}))  # fmt: skip
    assert _as_the_run_sets(str(compiled), None, "auto", None, None)["compile"] is True
    assert _as_the_run_sets(str(compiled), None, "auto", None, None, False)["compile"] is False
    assert _as_the_run_sets("lenet5", None, "auto", None, None)["compile"] is False
    args = ["bench", "train", "faces", "--batch", "4", "--repeats", "2", "--quick", "--json"]
    code, out, _ = run_cli(args, capsys)
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["precision"] == "fp32"
    if "bf16" in precisions(torch.device("cpu")):
        code, out, _ = run_cli([*args, "-p", "bf16"], capsys)
        assert code == 0 and json.loads(out.strip().splitlines()[-1])["precision"] == "bf16"


@pytest.mark.parametrize("sets", [{"train": {"calibrate": False}}, {"deterministic": True}])
def test_bench_of_a_run_keeps_its_calibration_determinism_and_batch(sets, tmp_path, capsys):
    """A run with `train.calibrate: false` or `deterministic: true` trains with the static
    rules, at its data.batch_size: `bench train RUN` times that (it measured settings at
    batch 64)."""
    from cnnkit.config import TrainConfig
    from cnnkit.train.settings import static_settings

    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"model": TINY, "data": {"source": "digits", "batch_size": 4},
                                   **sets}))  # fmt: skip
    args = ["bench", "train", str(run), "--repeats", "1", "--warmup", "0", "--quick", "--json"]
    code, out, err = run_cli(args, capsys)
    report = json.loads(out.strip().splitlines()[-1])
    rules = static_settings(build_model(TINY), TrainConfig(), CPU, 4)
    assert code == 0 and report["batch"] == 4 and report["settings"]["how"] == "rules", err
    assert (report["precision"], report["channels_last"]) == (rules.precision, rules.channels_last)
    from cnnkit.cli.bench import _as_the_run_sets  # a run directory, or a checkpoint in one

    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "config.yaml").write_text(run.read_text())
    for given in ("r", "r/best.pt"):
        sets_of = _as_the_run_sets(str(tmp_path / "runs" / given), None, "auto", None, None)
        assert sets_of["batch"] == 4 and not (sets_of["calibrate"] and not sets_of["deterministic"])


def test_a_quick_scaling_run_never_replaces_a_full_study(tmp_path, capsys):
    study = json.dumps({"quick": False, "networks": [{}] * 15})
    (tmp_path / "scaling.json").write_text(study)
    code, out, err = run_cli(["bench", "scaling", "--devices", "cpu", "--quick", "-o",
                              str(tmp_path)], capsys)  # fmt: skip
    assert code == 2 and not out and "holds a full study (15 networks)" in err, err
    assert (tmp_path / "scaling.json").read_text() == study
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scaling.json"]


def test_cli_train_json_is_the_last_line(tmp_path, capsys):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump({"model": TINY}))
    args = ["bench", "train", str(spec), "--batch", "2", "--repeats", "2", "--quick", "--json"]
    code, out, _ = run_cli(args, capsys)
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and "images/s" in out
    for key in ("images_per_second", "step_ms", "flops_per_second", "peak_fraction"):
        assert report[key] > 0


def test_max_seconds_reaches_the_interleaved_timing(tmp_path, capsys, monkeypatch):
    """--max-seconds bounds the repeats, so a caller's own time limit (gpu.sh's per step) still
    gets the figures measured so far."""
    from cnnkit.bench import throughput

    seen = []
    real = throughput.measure_interleaved

    def recorded(*args, **kwargs):
        seen.append(kwargs["max_seconds"])
        return real(*args, **kwargs)

    monkeypatch.setattr(throughput, "measure_interleaved", recorded)
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump({"model": TINY}))
    for mode in ("train", "infer"):
        args = ["bench", mode, str(spec), "--batch", "2", "--repeats", "1", "--quick",
                "--max-seconds", "7.5"]  # fmt: skip
        code, out, err = run_cli(args, capsys)
        assert code == 0, err
    assert seen == [7.5, 7.5]
    code, _, err = run_cli(["bench", "train", str(spec), "--max-seconds", "0"], capsys)
    assert code == 2 and "--max-seconds" in err


def test_bench_takes_a_run_directory_checkpoint_or_export_as_info_does(tmp_path, capsys):
    """The network of a run, a .pt checkpoint or a .safetensors export (the weights do not
    change the speed): each was refused as 'not a text file' or 'not a file'."""
    from cnnkit.checkpoint import FORMAT, save_checkpoint

    run = tmp_path / "run"
    run.mkdir()
    save_checkpoint({"format": FORMAT, "model_spec": TINY, "num_classes": 3,
                     "model": build_model(TINY).state_dict(), "classes": ["a", "b", "c"],
                     "preprocess": {"channels": 1, "crop": 8, "mean": [0.0], "std": [1.0]},
                     "config": {"data": {}}}, run / "best.pt")  # fmt: skip
    export = tmp_path / "tiny.safetensors"
    assert (
        run_cli(["export", str(run), "--format", "safetensors", "-o", str(export)], capsys)[0] == 0
    )
    quick = ["-b", "2", "--repeats", "1", "-p", "fp32", "--no-channels-last", "--threads", "1"]
    for command, target in (("infer", run), ("infer", run / "best.pt"), ("layers", export)):
        extra = ["--warmup", "0", "--quick"] if command == "infer" else ["--warmup", "0"]
        code, out, err = run_cli(["bench", command, str(target), *quick, *extra, "--json"], capsys)
        report = json.loads(out.strip().splitlines()[-1]) if code == 0 else {}
        assert code == 0 and report["net"] == "tiny" and report["batch"] == 2, err


def test_cli_bad_batch_exits_2_in_one_line(capsys):
    code, _, err = run_cli(["bench", "infer", "lenet5", "--batch", "0"], capsys)
    assert code == 2 and err.strip() == "cnnkit: error: --batch: must be >= 1, got 0"


def test_cli_a_batch_that_cannot_fit_is_one_line_before_any_timing(capsys):
    for command in ("infer", "layers"):
        code, _, err = run_cli(["bench", command, "lenet5", "-b", str(10**8), "-d", "cpu"], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith("cnnkit: error: --batch 100000000: lenet5 needs at least 6.3 TB")


@pytest.mark.parametrize("error,size", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                  "memory: you tried to allocate 409600000000 bytes. Error code 12"), "409.6 GB"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                            "capacity of 139.8 GiB"), "20.00 GiB"),
    (MemoryError(), "an allocation"),
])  # fmt: skip
def test_cli_out_of_memory_anywhere_is_one_line(error, size, capsys, monkeypatch):
    import cnnkit.bench.throughput

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(cnnkit.bench.throughput, "bench_throughput", fail)
    code, _, err = run_cli(["bench", "infer", "lenet5", "-b", "4", "-d", "cpu"], capsys)
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"out of memory: {'a tensor of ' * (size[0] != 'a')}{size} did not fit" in err
    assert err.rstrip().endswith("a smaller batch needs less")


def test_cli_detect_out_of_memory_advises_its_own_option(tmp_path, capsys, monkeypatch):
    import cnnkit.infer.images

    def fail(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(cnnkit.infer.images, "to_hwc", fail)  # detect has no batch to shrink
    code, _, err = run_cli(["detect", "faces", str(tmp_path / "any.png")], capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert err.rstrip().endswith("a larger --min-size needs less"), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cli_cuda_without_gpu_exits_2(capsys):
    code, _, err = run_cli(["bench", "layers", "lenet5", "--device", "cuda"], capsys)
    assert code == 2 and "no CUDA device" in err and "Traceback" not in err


@pytest.mark.slow
def test_baseline_is_timed_in_the_same_run_and_compared():
    r = bench_throughput(TINY, "train", 4, CPU, repeats=2, quick_peak=True, baseline=True,
                         threads=1)  # fmt: skip
    b = r["baseline"]
    assert r["threads"] == b["threads"] == r["careful"]["threads"] == 1  # as cnnkit's side runs
    assert b["name"] == "plain tiny fp32 NCHW" and b["step"]["repeats"] == r["step"]["repeats"]
    assert r["speedup_vs_baseline"] == pytest.approx(b["step_ms"] / r["step_ms"])
    c = r["careful"]
    assert c["name"] == f"plain tiny {peer_label('careful', CPU)}"
    assert c["name"].endswith("channels_last") and ("bfloat16" in c["name"]) == (
        amp_dtype(CPU) is not None
    )
    assert r["speedup_vs_careful"] == pytest.approx(c["step_ms"] / r["step_ms"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a device that fails")
def test_a_comparison_loop_that_fails_is_one_error_never_a_hang():
    """The peer's own error comes back as one line (here: CUDA on a machine without it); a peer
    that dies mid-run is an error at the next step, not a parent waiting forever."""
    model = build_model(TINY)
    with pytest.raises(CnnkitError, match="comparison loop failed: .*(CUDA|NVIDIA)"):
        PlainProcess(model, "train", 4, torch.device("cuda"))
    peer = PlainProcess(model, "train", 4, CPU)
    assert 0 < peer() < 60  # one step runs: its seconds, timed there
    peer._process.kill()
    with pytest.raises(CnnkitError, match="exit code -9"):
        peer()
    peer.close()  # a dead one is only reaped


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_the_careful_peer_runs_a_vector_network(mode):
    """channels_last only for image batches: a network of `input: [F]` got a (B, F) batch
    made channels_last, and --baseline failed."""
    from cnnkit.bench.baseline import plain_infer_step, plain_train_step

    spec = {"input": [5], "num_classes": 3, "layers": [{"type": "linear"}]}
    module, _ = plain_model(build_model(spec), CPU, "careful")
    x, y = torch.randn(2, 5), torch.tensor([0, 2])
    step = plain_train_step(module, x, y, "careful") if mode == "train" else plain_infer_step(
        module, x, "careful")  # fmt: skip
    step()


def test_alexnet_owt_baseline_is_torchvision_alexnet():
    model = build_model("alexnet-owt", device="meta")
    peer, name = plain_model(model, CPU)
    assert name == "torchvision alexnet fp32 NCHW"
    # on a GPU the plain loop keeps torch's defaults, unlike cnnkit's fp32 (TF32 matmuls too)
    assert peer_label("plain", torch.device("cuda")).endswith("(TF32 convolutions, fp32 matmuls)")
    assert sum(p.numel() for p in peer.parameters()) == sum(r.params for r in model.table)


def test_cli_layers_json_is_the_last_line(tmp_path, capsys):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump({"model": TINY}))
    args = ["bench", "layers", str(spec), "-b", "2", "--repeats", "1", "-p", "fp32", "--json"]
    code, out, _ = run_cli(args, capsys)
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and "per-layer sum" in out and "whole pass" in out
    table = " ".join(out.strip().rsplit("\n", 1)[0].split())  # the human part, unwrapped
    assert " ".join(report["settings"].split()) in table and " thread" in report["settings"]
    assert [layer["name"] for layer in report["layers"]][-1] == "loss"
    assert report["precision"] == "fp32" and report["forward_whole_ms"] > 0


@pytest.mark.parametrize("script,args,says", [
    ("classify_vs_onnxruntime.py", ["--net", "nonet"],
     "cnnkit: error: 'nonet' is neither a zoo network"),
    ("loader_vs_torchvision.py", ["--device", "foo", "--work", "WORK"],
     "error: --device: 'foo' is not a device"),
    ("loader_vs_torchvision.py", ["--device", "cuda:99", "--work", "WORK"],
     "error: --device: 'cuda:99'"),
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
