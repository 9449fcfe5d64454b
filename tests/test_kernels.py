"""Kernels per layer: NNPACK convolutions (forward, input and weight gradients) and oneDNN's
linear layers against torch.nn's, per-layer memory formats leaving the network's results and
state_dict unchanged, and the measurement that picks them (only when faster, never when a kernel
disagrees with the plain one)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from cnnkit.config import TrainConfig
from cnnkit.nn import Network, kernel_plan, tuning
from cnnkit.nn.kernels import Conv2d, NnpackConv, nnpack_ready, options, set_kernel, set_kernels
from cnnkit.nn.modules import FlatLinear
from cnnkit.nn.onednn import freeze, onednn_ready
from cnnkit.train import settings as settings_module
from cnnkit.train.engine import build_engine, train_step
from cnnkit.train.settings import Settings

needs_nnpack = pytest.mark.skipif(not nnpack_ready(), reason="this torch build has no NNPACK")
needs_onednn = pytest.mark.skipif(not onednn_ready(), reason="torch without oneDNN linear")
CPU = torch.device("cpu")

SPEC = {
    "name": "tiny",
    "input": [3, 20, 20],
    "layers": [
        {"name": "c1", "type": "conv", "out_channels": 8, "kernel_size": 3, "stride": 2},
        {"type": "relu"},
        {"name": "c2", "type": "conv", "out_channels": 8, "kernel_size": 5, "padding": 2},
        {"name": "pool", "type": "maxpool", "kernel_size": 2},
        {"name": "c3", "type": "conv", "out_channels": 6, "kernel_size": 3, "padding": 1},
        {"type": "global_avgpool"},
        {"type": "linear", "out_features": 4},
    ],
}


def grads_of(fn, x, *params):
    """Output and the gradients of x and params for a fixed random output gradient."""
    for t in (x, *params):
        t.grad = None
    y = fn(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
    return [y.detach()] + [t.grad.clone() for t in (x, *params) if t.grad is not None]


@needs_nnpack
@pytest.mark.parametrize(
    "cin,cout,kernel,padding,size,bias",
    [
        (16, 24, 5, 2, (27, 27), True),  # the weight gradient cut into tiles (27 > 17 - 5)
        (12, 8, 3, 1, (13, 13), True),  # one tile
        (5, 7, (3, 5), (1, 2), (19, 23), False),  # non-square kernel and image, no bias
        (3, 4, 3, 0, (40, 9), True),  # no padding, a tall image
    ],
)
def test_nnpack_conv_matches_torch(cin, cout, kernel, padding, size, bias):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(cin, cout, kernel, padding=padding, bias=bias)
    x = torch.randn(6, cin, *size, requires_grad=True)
    params = [p for p in (conv.weight, conv.bias) if p is not None]
    want = grads_of(conv, x, *params)
    got = grads_of(lambda t: NnpackConv.apply(t, conv.weight, conv.bias, conv.padding), x, *params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item())


def test_kernels_apply_only_where_they_can():
    net = Network(SPEC)
    assert options(net.c1) == ("nchw", "nhwc")  # stride 2: not NNPACK
    assert options(net.c2) == (("nchw", "nhwc", "nnpack") if nnpack_ready() else ("nchw", "nhwc"))
    assert options(net.pool) == ("nchw", "nhwc")
    linear = net.get_submodule(net.table[-1].name)
    assert options(linear) == (("xwt", "wxt", "onednn") if onednn_ready() else ("xwt", "wxt"))
    assert options(net.get_submodule(net.table[1].name)) == ()  # relu follows its input
    with pytest.raises(ValueError, match="does not apply"):
        set_kernel(net.c1, "nnpack")


def test_a_planned_network_computes_the_same_and_saves_the_same():
    torch.manual_seed(0)
    plain = Network(SPEC)
    plan = {"c1": "nhwc", "pool": "nhwc", "c3": "nchw"}
    if nnpack_ready():
        plan["c2"] = "nnpack"
    planned = set_kernels(copy.deepcopy(plain), plan)
    again = copy.deepcopy(planned)  # a copy (an EMA, a DDP replica) keeps its kernels
    assert list(planned.state_dict()) == list(plain.state_dict())
    assert planned.c1.weight.is_contiguous(memory_format=torch.channels_last)
    assert isinstance(plain.c2, Conv2d) and again.c2.nnpack == nnpack_ready()
    x = torch.randn(4, 3, 20, 20, requires_grad=True)
    want = grads_of(plain, x, *plain.parameters())
    for model in (planned, again):
        got = grads_of(model, x, *model.parameters())
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@needs_nnpack
@pytest.mark.filterwarnings("ignore:`torch.jit.trace")
def test_nnpack_steps_aside_under_autocast_and_in_exports():
    conv = Conv2d(4, 6, 3, padding=1)
    set_kernel(conv, "nnpack")
    x = torch.randn(2, 4, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert conv(x).dtype == torch.bfloat16  # oneDNN's bf16 path, not fp32 NNPACK
    traced = torch.jit.trace(conv, x)
    assert "nnpack" not in str(traced.graph)  # an export holds the plain convolution
    torch.testing.assert_close(traced(x), F.conv2d(x, conv.weight, conv.bias, padding=1))


@needs_nnpack
def test_the_plan_takes_the_fastest_that_agrees(monkeypatch):
    net = Network(SPEC)
    x = torch.randn(4, 3, 20, 20)
    plan = kernel_plan.plan_kernels(net, x, threads=1)
    assert all(kernel in options(net.get_submodule(name)) for name, kernel in plan.items())
    plain = {name: options(net.get_submodule(name))[0] for name in plan}
    assert not plan or plan != plain  # all plain kernels is no plan at all
    monkeypatch.setattr(kernel_plan, "TOLERANCE", -1.0)  # every other kernel "disagrees"
    assert kernel_plan.plan_kernels(net, x, threads=1) == {}
    monkeypatch.setattr(kernel_plan, "BUDGET_S", 0.0)
    assert kernel_plan.plan_kernels(net, x, threads=1) == {}


@pytest.mark.parametrize("faster", [True, False])
def test_a_plan_is_kept_only_if_the_whole_step_is_faster(monkeypatch, faster):
    net = Network(SPEC)
    monkeypatch.setattr(settings_module, "plan_kernels", lambda *a: {"c2": "nhwc", "pool": "nhwc"})
    planned = ("fp32", False, 1, (("c2", "nhwc"), ("pool", "nhwc")))
    times = {("fp32", True, 1, ()): 1.0, planned: 0.8 if faster else 0.99}
    monkeypatch.setattr(tuning.CandidateTimer, "run", lambda self, cands: times)
    chosen, gain, _ = settings_module._with_kernels(net, CPU, 8, ("fp32", True, 1, ()))
    assert (chosen, gain) == ((planned, 1.25) if faster else (("fp32", True, 1, ()), 1.0))


def test_a_plan_is_measured_at_the_runs_batch_up_to_what_a_few_seconds_allow(monkeypatch):
    """At the run's batch up to PLAN_BATCH, and fewer (down to 8) where the steps that check
    the plan would take over PLAN_S at the speed the grid measured: a ResNet on 2 cores took
    a minute at 64 images."""
    plan_batch = settings_module.plan_batch
    assert settings_module.PLAN_BATCH == 64 and settings_module.PLAN_STEPS == 6
    assert [plan_batch(b, None) for b in (4, 64, 256)] == [4, 64, 64]
    monkeypatch.setattr(settings_module, "PLAN_S", 12.0)
    assert [plan_batch(256, s) for s in (0.001, 0.1, 0.2, 5.0)] == [64, 20, 10, 8]
    assert plan_batch(4, 5.0) == 4
    assert [plan_batch(256, s) for s in (0.0, -1.0, float("nan"), float("inf"), 1e-320)] == [
        64, 64, 64, 8, 64]  # fmt: skip
    net, timed = Network(SPEC), []
    monkeypatch.setattr(settings_module, "plan_kernels", lambda model, x, threads: timed.append(
        len(x)) or {})  # fmt: skip
    times = {("fp32", False, 1, ()): 0.1, ("fp32", True, 1, ()): 0.2}
    monkeypatch.setattr(tuning.CandidateTimer, "run", lambda self, cands: times)
    cfg = TrainConfig(precision="fp32", threads=1)
    assert settings_module.measure_settings(net, cfg, CPU, 128).kernels == ()
    assert timed == [20]  # 12 s / (6 steps x 0.1 s an image)


def test_settings_carry_the_plan_through_the_cache_and_the_start_line(tmp_path):
    plan = (("c2", "nnpack"), ("pool", "nhwc"), ("c3", "nnpack"))
    s = Settings("fp32", False, 2, "measured", 1.4, plan)
    assert s.describe() == (
        "fp32, kernels per layer (2 NNPACK, 1 NHWC), 2 threads: fastest measured, 1.40x fp32 NCHW"
    )
    cache = tmp_path / "c.json"
    tuning.write_cache(cache, "k", {k: v for k, v in s.__dict__.items() if k != "how"})
    back = Settings(**{**tuning.read_cache(cache)["k"], "how": "cached"})
    assert back.kernels == plan and hash(back)  # lists in JSON, tuples again when read


def test_the_engine_trains_with_the_plan_as_without():
    torch.manual_seed(0)
    net = Network(SPEC)
    x, y = torch.randn(8, 3, 20, 20), torch.randint(0, 4, (8,))
    kernel = "nnpack" if nnpack_ready() else "nhwc"
    linear = net.table[-1].name
    results = []
    for kernels in ((), (("c2", kernel), ("pool", "nhwc"), (linear, "onednn"))):
        engine = build_engine(copy.deepcopy(net), TrainConfig(lr=0.1), CPU,
                              settings=Settings("fp32", False, 1, "set", kernels=kernels))  # fmt: skip
        loss, _ = train_step(engine, x, y)
        weights = [engine.network.get_submodule(n).weight.detach().clone() for n in ("c2", linear)]
        results.append((loss.item(), weights))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    for want, got in zip(*(r[1] for r in results), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_first_layer_without_weights_is_timed_forward_only():
    spec = {
        **SPEC,
        "layers": [{"name": "p0", "type": "maxpool", "kernel_size": 2}, *SPEC["layers"]],
    }
    net = Network({**spec, "input": [3, 40, 40]})
    kernel = kernel_plan.fastest_kernel(net.p0, torch.randn(2, 3, 40, 40), grad_input=False)
    assert kernel in ("nchw", "nhwc")


def test_each_layer_is_timed_with_its_input_in_the_format_the_layer_before_leaves(monkeypatch):
    seen = []

    def fake(module, x, grad_input=True, forward_only=False):
        seen.append((x.is_contiguous(memory_format=torch.channels_last), grad_input))
        return "nhwc" if len(seen) == 1 else options(module)[0]

    monkeypatch.setattr(kernel_plan, "fastest_kernel", fake)
    net = Network(SPEC)
    plan = kernel_plan.plan_kernels(net, torch.randn(4, 3, 20, 20), threads=1)
    linear = net.table[-1].name
    assert list(plan) == ["c1", "c2", "pool", "c3", linear]  # in the order they run
    # c1 gets the batch (NCHW, no gradient); c2 gets c1's NHWC output; after c2 (NCHW), NCHW
    assert seen == [(False, False), (True, True), (False, True), (False, True), (False, True)]


def test_an_inference_plan_times_forward_passes_of_frozen_layers_in_inference_mode(monkeypatch):
    """Classification's kernel per layer: each kernel's forward alone, in inference mode (no
    gradient, no backward), on a frozen copy (oneDNN's packed linear weight), in the order the
    layers run; the plan's layers still compute what the plain ones do."""
    calls = []
    real = kernel_plan._time_forward

    def spy(module, x):
        took, out = real(module, x)
        calls.append((out[0].is_inference(), x.requires_grad, module.training))
        return took, out

    monkeypatch.setattr(kernel_plan, "_time_forward", spy)
    monkeypatch.setattr(kernel_plan, "_time_once", lambda *a: pytest.fail("a backward timed"))
    net = Network(SPEC).eval()
    x = torch.randn(4, 3, 20, 20)
    plan = kernel_plan.plan_kernels(net, x, threads=1, forward_only=True)
    assert calls and all(c == (True, False, False) for c in calls)
    assert set(plan) <= {"c1", "c2", "pool", "c3", net.table[-1].name}
    planned = set_kernels(copy.deepcopy(net), plan)
    with torch.inference_mode():
        torch.testing.assert_close(planned(x), net(x), rtol=1e-4, atol=1e-5)


@needs_onednn
def test_onednn_linear_packs_only_when_frozen_and_follows_the_weight():
    """A frozen layer (inference) packs its weight once, and again after an in-place change,
    a new weight or a new storage under the same one; copies and pickles start unpacked; one image runs unpacked; a forward pass
    that wants gradients drops the packed copy. Always as nn.Linear computes."""
    torch.manual_seed(0)
    plain = FlatLinear(48, 7)
    layer = copy.deepcopy(plain)
    set_kernel(layer, "onednn")
    x = torch.randn(5, 3, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), plain(x))
        assert "_packed" not in layer.__dict__  # not frozen: never packed
        freeze(layer)
        torch.testing.assert_close(layer(x[:1]), plain(x[:1]))
        assert layer._packed.source is None  # one image: unpacked
        torch.testing.assert_close(layer(x), plain(x))
        packed = layer._packed.packed
        layer(x)
        assert layer._packed.packed is packed  # packed once
        for m in (layer, plain):
            m.weight.mul_(-2)
        torch.testing.assert_close(layer(x), plain(x))
        state = {k: torch.randn_like(v) for k, v in plain.state_dict().items()}
        for m in (layer, plain):
            m.load_state_dict(state)
        torch.testing.assert_close(layer(x), plain(x))
        new = torch.randn_like(plain.weight)
        for m in (layer, plain):
            m.weight.data = new.clone()  # the same Parameter, no version bump: a new storage
        torch.testing.assert_close(layer(x), plain(x))
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert twin._packed.source is None and twin.product == "onednn"
        with torch.inference_mode():
            torch.testing.assert_close(twin(x), plain(x))
    layer(x).sum().backward()
    assert layer._packed.source is None and layer.weight.grad is not None


@needs_onednn
def test_onednn_linear_reads_weights_a_fused_step_changed():
    """A fused optimizer step changes the weight without bumping its version counter: the
    layer evaluated between training steps (unfrozen, as `cnnkit train` evaluates) reads the
    weight as it is now, not a packed copy of an earlier one."""
    torch.manual_seed(0)
    plain = FlatLinear(48, 7)
    layer = copy.deepcopy(plain)
    set_kernel(layer, "onednn")
    x = torch.randn(5, 48)
    for m in (plain, layer):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5, fused=True)
        for _ in range(2):
            with torch.no_grad():
                m(x)  # held-out figures between steps
            m.weight.grad = torch.ones_like(m.weight)
            m.bias.grad = torch.ones_like(m.bias)
            optimizer.step()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), plain(x))


@needs_onednn
def test_onednn_linear_in_inference_mode_and_on_an_empty_batch():
    """Weights made in inference mode (no version counter) pack; an empty batch gives F.linear's
    empty output and zero gradients."""
    with torch.inference_mode():
        plain = FlatLinear(20, 3)
        layer = copy.deepcopy(plain)
        set_kernel(layer, "onednn")
        freeze(layer)
        x = torch.randn(4, 20)
        torch.testing.assert_close(layer(x), plain(x))
    layer = FlatLinear(20, 3)
    set_kernel(layer, "onednn")
    empty = torch.randn(0, 20, requires_grad=True)
    y = layer(empty)
    y.sum().backward()
    assert y.shape == (0, 3) and not layer.weight.grad.any()


@needs_onednn
def test_onednn_linear_gradients_and_where_it_steps_aside():
    """Gradients of input, weight and bias as nn.Linear's, a frozen weight included; under
    autocast it is bf16 F.linear, and on non-fp32 inputs plain F.linear."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(300, 20)
    layer = FlatLinear(300, 20)
    layer.load_state_dict(plain.state_dict())
    set_kernel(layer, "onednn")
    x = torch.randn(9, 300, requires_grad=True)
    for frozen in (False, True):
        for m in (plain, layer):
            m.weight.requires_grad_(not frozen)
        want = grads_of(plain, x, *[p for p in plain.parameters() if p.requires_grad])
        got = grads_of(layer, x, *[p for p in layer.parameters() if p.requires_grad])
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(layer.double()(x.double()), plain.double()(x.double()))
