"""`cnnkit bench train/infer/layers`: the settings a run gives, what it takes as a network,
its JSON line, and bad batches, devices and out-of-memory errors in one line."""

import json

import pytest
import torch
import yaml
from helpers import TINY_NET as TINY
from helpers import run_cli

from cnnkit.nn import build_model
from cnnkit.train.settings import precisions

CPU = torch.device("cpu")


def test_bench_of_a_run_takes_its_train_settings(tmp_path, capsys):
    """The faces run sets fp32: `bench train faces` times fp32, as `cnnkit train faces` runs
    (it timed bf16 where that was faster, and said `cnnkit train` chose it); -p still wins."""
    from cnnkit.cli.bench import _as_the_run_sets

    def sets(net, *options):
        chosen = _as_the_run_sets(net, *options)
        return tuple(chosen[k] for k in ("batch", "precision", "channels_last", "threads"))

    assert sets("faces", None, "auto", None, None) == (16, "fp32", False, 1)  # all fixed
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


def test_bench_of_a_run_times_its_own_step(tmp_path, capsys, monkeypatch):
    """`bench train RUN` builds the step from the run's whole `train:` section (it timed a
    default SGD step whatever the run's optimizer, micro-batches, EMA or loss) and says what
    that step does beyond the peers' plain SGD."""
    import cnnkit.bench.throughput as throughput

    built, build = [], throughput.build_engine
    monkeypatch.setattr(throughput, "build_engine",
                        lambda *a, **k: built.append(build(*a, **k)) or built[-1])  # fmt: skip
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"model": TINY, "data": {"source": "digits", "batch_size": 4},
                                   "train": {"optimizer": "adamw", "accumulate": 2, "ema": 0.9,
                                             "label_smoothing": 0.1, "precision": "fp32",
                                             "class_weights": "balanced", "threads": 1}}))  # fmt: skip
    args = ["bench", "train", str(run), "--repeats", "1", "--warmup", "0", "--quick", "--json"]
    code, out, err = run_cli(args, capsys)
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 0, err
    assert (report["optimizer"], report["accumulate"]) == ("adamw", 2)
    assert report["step_extras"] == ["adamw", "2 micro-batches", "EMA 0.9", "label smoothing 0.1",
                                     "balanced class weights"]  # fmt: skip
    assert "the run's step: adamw, 2 micro-batches, EMA 0.9, label smoothing 0.1, balanced" in out
    assert built and all(isinstance(e.optimizer, torch.optim.AdamW) and e.accumulate == 2
                         and e.ema is not None for e in built)  # fmt: skip
    assert built[0].loss_fn.label_smoothing == 0.1 and built[0].loss_fn.weight is not None
    built.clear()
    code, out, err = run_cli([*args[:2], "lenet5", *args[3:], "--batch", "2"], capsys)
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and (report["optimizer"], report["step_extras"]) == ("sgd", []), err
    assert type(built[0].optimizer) is torch.optim.SGD and "the run's step" not in out


def test_bench_of_a_run_checks_its_micro_batches_as_train_does(tmp_path, capsys):
    """The step splits --batch into the run's `accumulate` micro-batches: too few images, or
    micro-batches of one through a BatchNorm on vectors, are one line (a traceback from
    torch's BatchNorm once the step ran them)."""
    net = {"input": [1, 8, 8], "layers": [{"type": "flatten"}, {"type": "linear",
           "out_features": 16}, {"type": "batchnorm"}, {"type": "relu"}, {"type": "linear"}]}  # fmt: skip
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"model": net, "data": {"source": "digits", "batch_size": 8},
                                   "train": {"accumulate": 4, "threads": 1}}))  # fmt: skip
    code, _, err = run_cli(["bench", "train", str(run), "--batch", "4", "--quick"], capsys)
    assert (code, err) == (2, "cnnkit: error: --batch: micro-batches of 1 image(s), and "
                              "BatchNorm layer batchnorm2 (16) needs at least 2 values per "
                              "channel to train: use larger batches\n")  # fmt: skip
    code, _, err = run_cli(["bench", "train", str(run), "--batch", "2", "--quick"], capsys)
    assert code == 2 and "splits it into 4 micro-batches: give at least 4 images" in err


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
    targets = (
        ("infer", run),
        ("infer", run / "best.pt"),
        ("layers", export),
        ("train", run / "best.pt"),
        ("layers", run / "best.pt"),
    )  # (no config.yaml beside)
    for command, target in targets:
        extra = ["--warmup", "0", "--quick"] if command != "layers" else ["--warmup", "0"]
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


def test_cli_a_batch_past_any_machine_reads_as_a_power_of_ten(capsys):
    """--batch 10**23 said `6250400000000.0 PB`, and 10**400 was a traceback (an OverflowError
    formatting the bytes): past 1000 PB the figure is a power of ten."""
    from cnnkit.nn.memory import format_bytes

    for batch, needs in ((10**23, "6.3e+27 bytes"), (10**400, "6.3e+404 bytes")):
        code, _, err = run_cli(["bench", "layers", "lenet5", "-b", str(batch), "-d", "cpu"], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert f"lenet5 needs at least {needs} (15,626 activation values" in err, err
    assert [format_bytes(n) for n in (999, 1536, 999.9e15, 1e18)] == [
        "999 B", "1.5 KB", "999.9 PB", "1.0e+18 bytes"]  # fmt: skip


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


def test_layers_header_says_where_layers_run_in_their_own_layouts():
    """A plan of kernels per layer runs some layers channels-last whatever the input's layout:
    the header says so, not NCHW alone (a plan in the input's own layout changes nothing)."""
    from rich.console import Console

    from cnnkit.bench.layers import bench_layers, print_layers

    cpu = torch.device("cpu")
    planned = bench_layers({"model": TINY}, 2, cpu, repeats=1, kernels={"c1": "nhwc"})
    assert (planned["memory_format"], planned["layouts_per_layer"]) == ("NCHW", True)
    for kernels in ({}, {"c1": "nchw", "fc": "onednn"}):
        plain = bench_layers({"model": TINY}, 2, cpu, repeats=1, kernels=kernels)
        assert (plain["memory_format"], plain["layouts_per_layer"]) == ("NCHW", False)
    console = Console(width=200, record=True)
    print_layers(planned, console)
    assert "fp32  NCHW input, layouts per layer  median of 1" in console.export_text()


BN_ON_VECTORS = {"name": "bn2", "input": [3, 16, 16], "num_classes": 3, "layers": [
    {"name": "c1", "type": "conv", "out_channels": 8, "kernel_size": 3},
    {"name": "pool", "type": "adaptive_avgpool", "output_size": 1},
    {"name": "bn", "type": "batchnorm"}, {"type": "flatten"}, {"name": "fc", "type": "linear"},
]}  # fmt: skip


def test_a_batchnorm_on_one_value_per_channel_is_benched_or_refused_in_one_line(tmp_path, capsys):
    """A BatchNorm over 1 x 1 maps: the peak's look at the convolutions runs it in eval mode
    (it crashed at any --batch); a training batch of 1 is refused as `cnnkit train` refuses it."""
    net = tmp_path / "bn2.yaml"
    net.write_text(yaml.safe_dump({"model": BN_ON_VECTORS}))
    for command in ("infer", "train"):
        args = ["bench", command, str(net), "--batch", "2", "--repeats", "1", "--quick"]
        code, _, err = run_cli(args, capsys)
        assert code == 0, err
    for command in ("train", "layers"):
        code, _, err = run_cli(["bench", command, str(net), "--batch", "1"], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith("cnnkit: error: --batch: micro-batches of 1 image(s), and "
                              "BatchNorm layer bn (8x1x1) needs at least 2 values per channel")  # fmt: skip


def test_a_run_files_mistakes_are_its_one_line_and_its_data_sizes_the_head(tmp_path, capsys):
    """bench reads a run file as `cnnkit train` does: a mistyped field is refused (it was
    dropped, and the run's batch with it), and the head has the data's classes (info's)."""
    run = tmp_path / "r.yaml"
    run.write_text(yaml.safe_dump({"name": "m", "model": "lenet5",
                                   "data": {"source": "synthetic", "batch_size": 8},
                                   "train": {"epochs": 1, "precison": "fp32"}}))  # fmt: skip
    code, _, err = run_cli(["bench", "train", str(run), "--repeats", "1", "--quick"], capsys)
    assert (code, err) == (2, "cnnkit: error: train.precison: unknown field (did you mean "
                              "'precision'?)\n")  # fmt: skip
    run.write_text(yaml.safe_dump({"model": TINY, "data": {"source": "synthetic",
                                                            "num_classes": 5, "batch_size": 16,
                                                            "shape": [1, 8, 8]}}))  # fmt: skip
    code, out, err = run_cli(["bench", "layers", str(run), "--repeats", "1", "--json"], capsys)
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and report["batch"] == 16, err
    from cnnkit.cli.bench import _network_of

    assert _network_of(str(run), None) == (str(run), 5)  # the data's, not the file's 3


def test_bench_reads_what_info_reads_and_refuses_what_info_refuses(tmp_path, capsys, monkeypatch):
    """A run's metrics.csv, a --num-classes that sizes no layer and runs/NAME for a dated run
    are each info's one line (bench built the zoo's run, or timed without a word)."""
    (tmp_path / "run" / "x").mkdir(parents=True)
    (tmp_path / "run" / "metrics.csv").write_text("epoch,train_loss\n")
    code, _, err = run_cli(["bench", "layers", str(tmp_path / "run" / "metrics.csv")], capsys)
    assert code == 1 and "a CSV file, not a checkpoint or network: give " in err
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(yaml.safe_dump({"model": {"input": [4], "layers": [
        {"type": "linear", "out_features": 5}]}}))  # fmt: skip
    for command in (["info"], ["bench", "train"]):
        code, _, err = run_cli([*command, str(fixed), "--num-classes", "3"], capsys)
        assert (code, err) == (2, f"cnnkit: error: --num-classes 3: no layer of {fixed} is "
                                  "sized by num_classes (its output is 5)\n")  # fmt: skip
    code, out, err = run_cli(["info", str(fixed), "--num-classes", "5"], capsys)
    assert (code, err) == (0, "") and "output: 5" in out  # the count it gives: asked, given
    code, _, err = run_cli(["info", str(fixed), "--num-classes", str(2**31)], capsys)
    assert code == 2 and "'--num-classes': Input should be less than or equal to 2147483647" in err
    (tmp_path / "runs" / "digits-20261207-090000").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for command in (["info"], ["bench", "layers"], ["show", "net", "-o", "n.png"]):
        code, _, err = run_cli([*command[:2], "runs/digits", *command[2:]], capsys)
        assert code == 1 and err.endswith("(did you mean runs/digits-20261207-090000, the "
                                          "newest dated run of that name?)\n"), (command, err)  # fmt: skip
    for command in ("config", "train"):  # (a run file's place: a usage error)
        code, _, err = run_cli([command, "runs/digits"], capsys)
        assert (code, err) == (2, "cnnkit: error: runs/digits: no such run file or run directory "
                                  "(did you mean runs/digits-20261207-090000, the newest dated "
                                  "run of that name?)\n")  # fmt: skip


def test_bench_blames_what_was_given(tmp_path, capsys):
    """A run's fp16 on a CPU is the run's train.precision (bench said --precision, not given);
    threads over the cores say so as train's start line does; a network whose parameters alone
    do not fit is refused as such, not as a --batch that none could lower."""
    run = tmp_path / "r5.yaml"
    run.write_text(yaml.safe_dump({"model": "lenet5", "data": {"source": "synthetic"},
                                   "train": {"precision": "fp16"}}))  # fmt: skip
    for command in ("train", "layers"):
        code, _, err = run_cli(["bench", command, str(run), "--repeats", "1"], capsys)
        assert (code, err) == (2, f"cnnkit: error: {run}: train.precision: fp16 needs a CUDA "
                                  "device (give --precision bf16 or fp32 to time it on the "
                                  "CPU)\n")  # fmt: skip
    args = ["bench", "train", "lenet5", "--batch", "2", "--threads", "100000", "--repeats", "1",
            "--quick", "--json"]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert "(100000 asked; " in json.loads(out.strip().splitlines()[-1])["settings"]["describe"]
    big = tmp_path / "big.yaml"
    big.write_text(yaml.safe_dump({"model": {"name": "big", "input": [300000], "layers": [
        {"type": "linear", "out_features": 300000}]}}))  # fmt: skip  # 360 GB: no machine here
    code, _, err = run_cli(["bench", "infer", str(big), "--batch", "1"], capsys)
    assert code == 2 and err.startswith("cnnkit: error: big does not fit here at any batch: its "
                                        "90,000,300,000 parameters and one image's "
                                        "activations need at least 360.0 GB but "), err  # fmt: skip
