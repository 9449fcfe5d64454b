"""cnnkit.bench's measurements: the timing method, per-layer timing, throughput with the
engine's step and its peaks, and the plain loops it is compared with. Tiny networks and
tiny repeat counts: correctness, not speed."""

import json
import signal
import time

import pytest
import torch
from helpers import TINY_NET as TINY
from helpers import TINY_NET_MACS as TINY_MACS

from cnnkit.bench.baseline import PlainProcess, _sigint_ignored, amp_dtype, peer_label, plain_model
from cnnkit.bench.layers import bench_layers
from cnnkit.bench.peak import Kernel
from cnnkit.bench.throughput import (
    bench_throughput,
    make_train_step,
    print_throughput,
    train_config,
)
from cnnkit.bench.timing import measure
from cnnkit.errors import CnnkitError
from cnnkit.nn import build_model
from cnnkit.train.settings import precisions

CPU = torch.device("cpu")


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
    """(and the bench runs with cuDNN's autotuner and TF32 matmuls, as training does, then
    gives the process its own settings back)"""
    before = torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.fp32_precision
    r = bench_throughput(TINY, "train", 4, CPU, warmup=1, repeats=2, quick_peak=True)
    assert (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.fp32_precision) == before
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


def test_a_step_on_fewer_threads_is_set_against_a_peak_on_as_many(monkeypatch):
    """The peak kernels run on the step's threads, and the paper peak counts its cores: a
    1-thread step against a peak of every core read as a fraction of that core count."""
    import cnnkit.bench.peak as peak
    import cnnkit.bench.throughput as throughput

    monkeypatch.setattr(peak, "available_cores", lambda: 4)
    on_paper = peak.theoretical_peak(CPU, "fp32")
    if on_paper is not None:  # (a CPU whose paper peak is known)
        assert peak.theoretical_peak(CPU, "fp32", 1)[0] == pytest.approx(on_paper[0] / 4)
        assert "1 core x" in peak.theoretical_peak(CPU, "fp32", 1)[1]
    seen, real = [], throughput.peak_kernels

    def kernels(*args):
        return [Kernel(k.name, k.precision, k.flops,
                       lambda x, run=k.run: (seen.append(torch.get_num_threads()), run(x))[1])
                for k in real(*args)]  # fmt: skip

    monkeypatch.setattr(throughput, "peak_kernels", kernels)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the process's own count is not the step's (xdist sets 1)
    try:
        r = bench_throughput(TINY, "infer", 4, CPU, precision="fp32", threads=1, repeats=1,
                             warmup=0, quick_peak=True, cache=False)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert r["threads"] == 1 and seen and set(seen) == {1}


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
    ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA H100 NVL", "H100 NVL"),
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


@pytest.mark.parametrize("probe_s, side", [(0.2e-3, 2048), (0.02, 512), (0.3, 256)])
def test_a_cpus_peak_matmul_is_sized_to_what_its_units_do_in_time(monkeypatch, probe_s, side):
    """bf16 on a CPU without bf16 units (AVX2 only: 1 GFLOP/s) took a minute a call at 2048,
    whatever --max-seconds said: the side is the largest whose call takes ~0.25 s, from one
    timed call at 256 (here, calls that take probe_s x (n / 256)^3 on a clock of the test's
    own: a sleep of 0.2 ms ran past 0.49 ms on a loaded machine, and the test failed)."""
    import types

    from cnnkit.bench import peak

    clock = [0.0]

    def slow(device, precision, n):
        def run(_):
            clock[0] += probe_s * (n / 256) ** 3

        return peak.Kernel(f"matmul {n}", precision, 2.0 * n**3, run)

    monkeypatch.setattr(peak, "_matmul", slow)
    monkeypatch.setattr(peak, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    assert peak._matmul_side(CPU, "bf16", 2048) == side
    assert peak._matmul_side(CPU, "bf16", 512) == min(side, 512)  # quick: 512 at most


def test_train_step_is_a_real_sgd_step_of_the_engine():
    model = build_model(TINY)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))
    before = [p.detach().clone() for p in model.parameters()]
    step, engine = make_train_step(model, x, y, train_config(CPU, "fp32"))
    step(None)
    assert isinstance(engine.optimizer, torch.optim.SGD)
    assert engine.optimizer.param_groups[0]["momentum"] == 0.9
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


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
    status = open(f"/proc/{peer._process.pid}/status").read()
    caught, ignored = (int(status.split(f"{k}:")[1].split()[0], 16) for k in ("SigCgt", "SigIgn"))
    bit = 1 << (signal.SIGINT - 1)  # started: Ctrl-C ends the child at once, quietly
    assert caught & bit and not ignored & bit
    with _sigint_ignored():  # while one starts (its imports): ignored, inherited
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the parent's kept
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


def test_a_busy_machine_is_named_on_a_terminal(monkeypatch, capsys):
    """Other programs' load sampled from /proc/stat as a benchmark starts, said on a terminal
    (figures come out lower than on an idle machine); nothing where stderr is no terminal."""
    import io
    import os
    import sys

    from cnnkit.bench import timing

    if os.path.exists("/proc/stat"):
        used = timing.busy_cores(0.05)
        assert used is not None and 0 <= used <= os.cpu_count() + 0.5
    monkeypatch.setattr(timing, "busy_cores", lambda: 1.7)
    timing.say_if_busy(2)
    assert capsys.readouterr().err == ""  # (captured: no terminal)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for load, said in ((1.7, True), (0.2, False)):
        monkeypatch.setattr(timing, "busy_cores", lambda load=load: load)
        monkeypatch.setattr(sys, "stderr", Terminal())
        timing.say_if_busy(2)
        text = sys.stderr.getvalue()
        assert ("other programs keep 1.7 of this machine's cores busy (2 for this process)"
                in text) is said and (text == "") is not said  # fmt: skip
