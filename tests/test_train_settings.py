"""Precision, memory format and threads: measured on this machine (each candidate timed,
interleaved), cached per machine / torch / network / batch, explicit settings winning, static
rules when measuring is off; the benchmark uses exactly what training uses."""

from __future__ import annotations

import json

import pytest
import torch

from cnnkit import runtime
from cnnkit.bench.throughput import bench_throughput
from cnnkit.config import TrainConfig
from cnnkit.nn import build_model, tuning
from cnnkit.nn.onednn import onednn_ready
from cnnkit.runtime import available_cores
from cnnkit.train import settings as settings_module
from cnnkit.train.settings import MARGIN, Settings, _fastest, choose_settings, static_settings

CPU = torch.device("cpu")


@pytest.mark.parametrize(("quota", "expected"), [("max 100000", None), ("150000 100000", 2),
                                                 ("50000 100000", 1), ("garbage", None)])  # fmt: skip
def test_cores_respect_the_containers_cpu_quota(quota, expected, tmp_path, monkeypatch):
    """`docker run --cpus=1.5` on a bigger host: 2 cores for workers and threads, not the
    host's; no quota (or none readable): the affinity mask alone."""
    import os

    from cnnkit import runtime

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    (tmp_path / "cpu.max").write_text(quota + "\n")
    monkeypatch.setattr(runtime, "CPU_QUOTA", str(tmp_path / "cpu.max"))
    assert available_cores() == (expected or 16)


def test_explicit_settings_win_and_no_measuring_uses_the_rules(tmp_path):
    net = build_model("digitnet")
    cfg = TrainConfig(precision="fp32", channels_last=True, threads=1)
    s = choose_settings(net, cfg, CPU, 64, cache=tmp_path / "c.json")
    assert (s.precision, s.channels_last, s.threads, s.how) == ("fp32", True, 1, "set")
    assert not (tmp_path / "c.json").exists()  # nothing measured
    rules = choose_settings(net, TrainConfig(calibrate=False), CPU, 64, cache=tmp_path / "c.json")
    assert rules.how == "rules" and rules == static_settings(net, TrainConfig(), CPU, 64)
    assert choose_settings(net, TrainConfig(), CPU, 64, deterministic=True).how == "rules"


def test_measured_once_then_cached_per_batch(tmp_path, monkeypatch):
    net, cache = build_model("digitnet"), tmp_path / "c.json"
    timed = []
    real = tuning.CandidateTimer.run
    monkeypatch.setattr(tuning.CandidateTimer, "run",
                        lambda self, c: timed.append(len(c)) or real(self, c))  # fmt: skip
    rng = torch.get_rng_state()
    first = choose_settings(net, TrainConfig(), CPU, 64, cache=cache)
    assert torch.equal(rng, torch.get_rng_state())  # calibration draws from its own generators
    measured = len(timed)  # the grid, then (if a kernel plan was found) plan against none
    again = choose_settings(net, TrainConfig(), CPU, 64, cache=cache)
    assert first.how == "measured" and again.how == "cached" and len(timed) == measured
    assert again == Settings(**{**first.__dict__, "how": "cached"})
    choose_settings(net, TrainConfig(), CPU, 32, cache=cache)  # another batch: measured anew
    assert len(timed) > measured and len(json.loads(cache.read_text())) == 2
    grid = timed[0]  # every combination: precisions x 2 formats x thread counts
    assert grid == len(settings_module.precisions(CPU)) * 2 * len(
        {1, max(1, torch.get_num_threads() // 2), torch.get_num_threads()}
    )
    threads = torch.get_num_threads()
    try:  # a rank of --nproc, with its share of the cores: its own choice, not this one's
        torch.set_num_threads(max(1, threads // 2) if threads > 1 else 2)
        share = choose_settings(net, TrainConfig(), CPU, 64, cache=cache)
    finally:
        torch.set_num_threads(threads)
    assert share.how == "measured" and len(json.loads(cache.read_text())) == 3


def test_no_speed_up_is_claimed_where_fp32_nchw_was_not_timed(tmp_path):
    """A precision or format set in the run leaves fp32 NCHW out of the grid: no ratio to it."""
    net = build_model("digitnet")
    for cfg in (
        TrainConfig(precision="bf16", threads=1),
        TrainConfig(channels_last=True, threads=1),
    ):
        s = choose_settings(net, cfg, CPU, 16, cache=tmp_path / "c.json")
        assert s.how == "measured" and s.speedup is None and "x fp32 NCHW" not in s.describe(1)
    s = choose_settings(net, TrainConfig(threads=1), CPU, 16, cache=tmp_path / "c.json")
    assert s.speedup is not None and s.speedup > 0


def test_a_damaged_cache_entry_is_measured_anew(tmp_path):
    """An entry edited by hand or half-written by another version (a field gone, a value not
    of its kind, a precision or kernel this machine lacks, a layer the network lacks) is
    measured anew, as a missing one: it was a TypeError or KeyError traceback at the start of
    every run, training and classification alike."""
    from cnnkit.nn.tuning import choose_inference_kernels, valid_plan

    net, cache = build_model("digitnet"), tmp_path / "c.json"
    choose_settings(net, TrainConfig(), CPU, 8, cache=cache)
    choose_inference_kernels(net, CPU, 8, cache=cache)
    (train_key, entry), (infer_key, infer) = json.loads(cache.read_text()).items()
    assert settings_module._cached(entry, net, CPU) is not None and valid_plan(
        net, infer["kernels"]
    )
    damaged = [{k: v for k, v in entry.items() if k != "threads"}, "x", {**entry, "threads": "x"},
               {**entry, "precision": "fp64"}, {**entry, "kernels": [["conv9", "nhwc"]]},
               {**entry, "kernels": [["features.0", "fast"]]}, {**entry, "channels_last": "yes"},
               {**entry, "kernels": 3}, {**entry, "speedup": "fast"}, {**entry, "busy": "1"}]  # fmt: skip
    assert [settings_module._cached(bad, net, CPU) for bad in damaged] == [None] * len(damaged)
    assert not any(valid_plan(net, k) for k in (3, None, [["x", "nhwc"]], [["features.0"]]))
    cache.write_text(json.dumps({train_key: damaged[0], infer_key: {**infer, "kernels": 3}}))
    assert choose_settings(net, TrainConfig(), CPU, 8, cache=cache).how == "measured"
    assert isinstance(choose_inference_kernels(net, CPU, 8, cache=cache)[0], bool)
    assert choose_settings(net, TrainConfig(), CPU, 8, cache=cache).how == "cached"


def test_the_fastest_wins_reduced_precision_only_when_clearly_faster():
    times = {("fp32", False, 1): 1.0, ("fp32", True, 1): 0.9, ("bf16", True, 1): 0.89}
    assert _fastest(times) == ("fp32", True, 1)  # bf16 under MARGIN faster: fp32 keeps accuracy
    times[("bf16", True, 1)] = 0.9 / MARGIN / 1.01
    assert _fastest(times) == ("bf16", True, 1)
    times[("fp32", False, 2)] = 0.5
    assert _fastest(times) == ("fp32", False, 2)


def test_fp16_only_when_clearly_faster_than_bf16():
    """On a GPU where bf16 and fp16 run at one rate, timing noise must not pick fp16 (narrower
    range, loss scaling); it wins only by MARGIN, and still must beat fp32 by MARGIN."""
    times = {("fp32", True, 1): 2.0, ("bf16", True, 1): 1.0, ("fp16", True, 1): 0.99}
    assert _fastest(times) == ("bf16", True, 1)
    times[("fp16", True, 1)] = 1.0 / MARGIN / 1.01
    assert _fastest(times) == ("fp16", True, 1)
    times = {("fp32", True, 1): 1.0, ("fp16", True, 1): 0.5}  # a GPU without bf16
    assert _fastest(times) == ("fp16", True, 1)


def test_describe_says_what_and_why():
    s = Settings("bf16", True, 2, "measured", speedup=1.4)
    assert (
        s.describe() == "bf16 autocast, channels_last, 2 threads: fastest measured, 1.40x fp32 NCHW"
    )
    assert Settings("fp32", False, 1, "rules").describe() == "fp32, 1 thread: static rules"
    cores = available_cores()  # train.threads above the cores here is said, not silently cut
    assert f"{cores} threads (64 asked; {cores} cores here)" in Settings(
        "fp32", False, cores, "set").describe(threads_asked=64)  # fmt: skip
    assert "asked" not in Settings("fp32", False, 1, "set").describe(threads_asked=1)


def test_bench_runs_what_train_would_choose(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "CACHE", tmp_path / "c.json")
    net = build_model("digitnet")
    chosen = choose_settings(net, TrainConfig(device="cpu"), CPU, 16)
    r = bench_throughput("digitnet", "train", 16, CPU, repeats=2, quick_peak=True, explore=True)
    assert (r["precision"], r["channels_last"], r["threads"]) == (
        chosen.precision, chosen.channels_last, chosen.threads)  # fmt: skip
    assert r["settings"]["how"] == "cached" and r["settings"]["as"] == "cnnkit train"
    marked = [row for row in r["explore"] if row["chosen"]]
    assert len(marked) == 1 and len(r["explore"]) > 1
    assert marked[0] == {**{k: r[k] for k in ("precision", "channels_last", "threads", "kernels")},
                         "images_per_second": r["images_per_second"], "chosen": True}  # fmt: skip


def test_bench_infer_runs_what_classify_would_choose(monkeypatch):
    """On a CPU in fp32 `bench infer` times classification's measured kernels."""
    chosen = (True, {"fc3": "wxt"})
    monkeypatch.setattr(settings_module, "choose_inference_kernels",
                        lambda net, dev, batch, cache=True: chosen)  # fmt: skip
    r = bench_throughput("digitnet", "infer", 16, CPU, precision="fp32", repeats=2, quick_peak=True)
    assert (r["precision"], r["channels_last"], r["kernels"]) == ("fp32", True, {"fc3": "wxt"})
    assert r["settings"]["as"] == "cnnkit classify" and "(W x^T)^T" in r["settings"]["describe"]
    fixed = bench_throughput("digitnet", "infer", 16, CPU, precision="fp32", channels_last=False,
                                repeats=2, quick_peak=True)  # fmt: skip
    assert fixed["settings"]["as"] == "cnnkit classify" and not fixed["kernels"]  # fp32 still
    # precision auto on a CPU whose rules train in bf16: classify still runs (and is timed in) fp32
    monkeypatch.setattr(settings_module, "precisions", lambda device: ["fp32", "bf16"])
    auto = bench_throughput("digitnet", "infer", 16, CPU, repeats=2, quick_peak=True)
    assert (auto["precision"], auto["settings"]["as"]) == ("fp32", "cnnkit classify")
    bf16 = bench_throughput("digitnet", "infer", 16, CPU, precision="bf16", repeats=2,
                            quick_peak=True)  # fmt: skip
    assert (bf16["precision"], bf16["settings"]["as"]) == ("bf16", "cnnkit train")


@pytest.mark.parametrize("threads", [None, 1])
def test_train_prints_the_choice_on_its_start_line(tmp_path, capsys, threads):
    from helpers import cli_ok

    extra = [f"train.threads={threads}"] if threads else []
    cli_ok(["train", "digits", "--out", str(tmp_path / "r"), "train.epochs=1", *extra])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("training digits"))
    assert "fastest measured" in line or "as set" in line or "static rules" in line
    assert ("1 thread" in line) if threads == 1 else True


def test_a_compiled_run_has_settings_of_its_own():
    """Kernels per layer are measured for eager steps only: a compiled run's settings are
    cached apart, not taken from an eager run's entry."""
    from cnnkit.train.settings import _cache_key

    net = build_model("digitnet")
    eager, compiled = TrainConfig(), TrainConfig(compile=True)
    assert _cache_key(net, compiled, CPU, 64) != _cache_key(net, eager, CPU, 64)


def test_inference_kernels_are_timed_forward_only_once_then_cached(tmp_path, monkeypatch):
    """Classification's kernels: NCHW / channels_last x the linear layers' products (F.linear's,
    its transpose, oneDNN's where torch has it), and the kernel per layer the layers' own
    timings pick, forward passes timed in inference mode at the batch (up to INFER_BATCH), the
    answer cached apart from the training settings."""
    from cnnkit.nn.kernels import options
    from cnnkit.nn.tuning import INFER_BATCH, choose_inference_kernels

    net, cache = build_model("digitnet"), tmp_path / "c.json"
    timed = []
    real = tuning.CandidateTimer._call

    def spy(self, candidate):
        timed.append((self.batch, self.forward_only, candidate[1], candidate[3]))
        return real(self, candidate)

    layer_plans = []
    real_plan = tuning.plan_kernels

    def plan_spy(network, x, threads, forward_only=False):
        assert forward_only and len(x) == INFER_BATCH
        layer_plans.append(tuple(real_plan(network, x, threads, forward_only).items()))
        return dict(layer_plans[-1])

    monkeypatch.setattr(tuning.CandidateTimer, "_call", spy)
    monkeypatch.setattr(tuning, "plan_kernels", plan_spy)
    first = choose_inference_kernels(net, CPU, 500, cache=cache)
    assert {t[0] for t in timed} == {INFER_BATCH} and all(t[1] for t in timed)
    plans = [(), *((("fc3", p), ("output", p)) for p in options(net.fc3)[1:])]
    assert len(plans) == (3 if onednn_ready() else 2)
    grid = {(cl, p) for cl in (False, True) for p in plans}
    (per_layer,) = layer_plans  # measured once; a candidate unless it is the plain network
    assert {(t[2], t[3]) for t in timed} == grid | ({(False, per_layer)} if per_layer else set())
    plans.append(per_layer)
    measured = len(timed)
    assert choose_inference_kernels(net, CPU, 500, cache=cache) == first and len(timed) == measured
    entry = next(iter(json.loads(cache.read_text()).values()))
    assert entry["precision"] == "fp32" and entry["channels_last"] == first[0]
    assert set(first[1].items()) in [set(p) for p in plans]
    choose_settings(net, TrainConfig(), CPU, INFER_BATCH, cache=cache)  # training: its own entry
    assert len(json.loads(cache.read_text())) == 2
    flat = build_model({"input": [10], "layers": [{"type": "linear", "out_features": 3}]})
    assert choose_inference_kernels(flat, CPU, 8, cache=cache) == (False, {})  # as trained


@pytest.mark.parametrize("product", ["wxt", "onednn"])
def test_flattening_linear_layers_products_equal_f_linear(product):
    """Output and gradients as nn.Linear's (oneDNN's by its own path, or F.linear where torch
    lacks it); exports see F.linear."""
    from cnnkit.nn.kernels import set_kernel
    from cnnkit.nn.modules import FlatLinear

    for bias in (True, False):
        layer = FlatLinear(12, 5, bias=bias)
        x = torch.randn(3, 3, 2, 2, requires_grad=True)
        want = layer(x)
        (want_x,) = torch.autograd.grad(want.square().sum(), x)
        set_kernel(layer, product)
        got = layer(x)
        torch.testing.assert_close(got, want)
        got.square().sum().backward()
        torch.testing.assert_close(x.grad, want_x)
        assert layer.weight.grad is not None
        graph = str(torch.export.export(layer, (x.detach(),)).graph)
        assert "aten.linear" in graph and "addmm" not in graph  # exports: F.linear


def test_eval_on_the_cpu_runs_in_the_runs_precision_with_classifications_kernels(
    digits_run, monkeypatch
):
    """`cnnkit eval` on the CPU evaluates in the precision the run's steps ran in (its
    checkpoint's settings, where `auto` might resolve otherwise now), and in fp32 with the
    measured inference kernels; the figures are the same in either kernel choice."""
    from cnnkit.train import evaluation

    real = evaluation.load_trained

    def ran_in(precision):
        def load(*args, **kwargs):
            network, meta = real(*args, **kwargs)
            return network, {**meta, "settings": {**meta["settings"], "precision": precision}}

        return load

    asked, results = [], {}
    monkeypatch.setattr(settings_module, "choose_inference_kernels",
                        lambda *args, **kwargs: asked.append(args) or (False, {}))  # fmt: skip
    monkeypatch.setattr(settings_module, "precisions", lambda device: ["fp32", "bf16"])
    monkeypatch.setattr(evaluation, "load_trained", ran_in("bf16"))
    evaluation.evaluate_checkpoint(digits_run, device="cpu")
    assert asked == []  # bf16 autocast: the training rules, nothing measured
    monkeypatch.setattr(evaluation, "load_trained", ran_in("fp32"))  # bf16 here, but not used
    product = "onednn" if onednn_ready() else "wxt"
    for choice in ((False, {}), (True, {"fc3": product, "output": product})):
        monkeypatch.setattr(settings_module, "choose_inference_kernels",
                            lambda net, dev, batch, cache=True, c=choice: asked.append(batch) or c)  # fmt: skip
        results[choice[0]] = evaluation.evaluate_checkpoint(digits_run, device="cpu")
    assert len(asked) == 2 and all(b > 0 for b in asked)
    assert results[True]["images"] == results[False]["images"] > 0
    assert results[True]["top1"] == pytest.approx(results[False]["top1"])
    assert results[True]["loss"] == pytest.approx(results[False]["loss"], rel=1e-5)


class _Busy:
    """OtherLoad as it reads beside a busy neighbour: one core's worth taken by others."""

    cores: float | None = 1.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_a_choice_timed_beside_other_work_is_timed_again_once_the_machine_is_idle(
    tmp_path, monkeypatch
):
    """Candidates timed while another process takes the CPU rank by luck (AlexNet on a busy
    2-core Zen 4 cached fp32 where bf16 ran 2x faster). Such a choice says so, is kept while
    the machine stays busy, and is timed again once it is idle; training and classification
    alike. A checkpoint keeps the settings, not the machine's load."""
    from cnnkit.nn.tuning import choose_inference_kernels

    net, cache, cores = build_model("digitnet"), tmp_path / "c.json", runtime.affinity_cores()
    monkeypatch.setattr(tuning, "OtherLoad", _Busy)
    monkeypatch.setattr(_Busy, "cores", float(cores))  # others took every core
    first = choose_settings(net, TrainConfig(), CPU, 8, cache=cache)
    choose_inference_kernels(net, CPU, 8, cache=cache)
    assert first.how == "measured" and first.busy == cores and "busy" not in first.saved()
    assert f"measured while other processes took {cores:.1f} cores' worth of CPU" in (
        first.describe()
    ) and first.describe().endswith("measured again once the machine is idle")
    timed = []
    real = tuning.CandidateTimer.run
    monkeypatch.setattr(tuning.CandidateTimer, "run",
                        lambda self, c: timed.append(len(c)) or real(self, c))  # fmt: skip
    kept = choose_settings(net, TrainConfig(), CPU, 8, cache=cache)  # still busy: kept
    choose_inference_kernels(net, CPU, 8, cache=cache)
    assert kept.how == "cached" and kept.busy == cores and not timed
    monkeypatch.setattr(tuning, "idle_machine", lambda: True)
    monkeypatch.setattr(_Busy, "cores", 0.0)  # the machine alone now
    said = []
    again = choose_settings(net, TrainConfig(), CPU, 8, cache=cache, notify=said.append)
    assert again.how == "measured" and again.busy == 0.0 and len(timed) >= 1
    assert said[0].endswith(
        "(again: the cached choice was timed while other processes took the CPU)"
    )
    assert "other processes" not in again.describe()
    measured = len(timed)
    choose_inference_kernels(net, CPU, 8, cache=cache)
    assert len(timed) > measured
    assert [e["busy"] for e in json.loads(cache.read_text()).values()] == [0.0, 0.0]
    measured = len(timed)  # timed on an idle machine: kept from now on
    assert choose_settings(net, TrainConfig(), CPU, 8, cache=cache).how == "cached"
    choose_inference_kernels(net, CPU, 8, cache=cache)
    assert len(timed) == measured


def test_other_processes_cpu_time_is_counted_and_this_ones_is_not(monkeypatch):
    """OtherLoad: the busy time of this process's cores less its own CPU time, per second of
    wall time. A child spinning while we wait counts; the arithmetic is checked exactly."""
    import subprocess
    import sys
    import types

    with runtime.OtherLoad() as load:
        spin = "import time\nt = time.time()\nwhile time.time() - t < 0.8: pass"
        subprocess.run([sys.executable, "-c", spin], check=True)
    if load.cores is None:
        pytest.skip("no per-core /proc/stat here")
    assert load.cores >= 0.5  # the child's core (and whatever else ran)
    clock = iter([10.0, 12.0])  # perf_counter: 2 s of wall time
    own = iter([5.0, 6.0])  # this process: 1 s of CPU
    busy = iter([100.0, 104.0])  # the cores: 4 s busy in all
    fake = types.SimpleNamespace(perf_counter=lambda: next(clock), process_time=lambda: next(own))
    monkeypatch.setattr(runtime, "time", fake)
    monkeypatch.setattr(runtime, "_busy_seconds", lambda: next(busy))
    with runtime.OtherLoad() as load:
        pass
    assert load.cores == pytest.approx(1.5)  # (4 - 1) / 2
    monkeypatch.setattr(runtime, "affinity_cores", lambda: 2)  # (the bar: a quarter of a core)
    for others, idle in ((0.1, True), (1.5, False), (None, False)):  # None: the system says not
        clock, own, busy = iter([0.0, 1.0]), iter([0.0, 0.0]), iter([0.0, others])
        fake = types.SimpleNamespace(perf_counter=clock.__next__, process_time=own.__next__,
                                     sleep=lambda s: None)  # fmt: skip
        monkeypatch.setattr(runtime, "time", fake)
        monkeypatch.setattr(runtime, "_busy_seconds", busy.__next__)
        assert runtime.idle_machine() is idle
