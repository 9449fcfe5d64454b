"""Each layer kind against the same torch.nn layer with the same weights."""

import pytest
import torch
from torch import nn

from cnnkit import ConfigError, build_model


def one_layer(layer: dict, input_shape: list[int]) -> torch.nn.Module:
    """A network holding just `layer`, named `x`."""
    return build_model({"input": input_shape, "layers": [{"name": "x", **layer}]}).eval()


CASES = [
    (
        {"type": "conv", "out_channels": 8, "kernel_size": 3, "stride": 2, "padding": 1},
        nn.Conv2d(4, 8, 3, 2, 1),
    ),
    (
        {"type": "conv", "out_channels": 8, "kernel_size": [3, 5], "groups": 2, "dilation": 2},
        nn.Conv2d(4, 8, (3, 5), dilation=2, groups=2),
    ),
    (
        {"type": "conv", "out_channels": 6, "kernel_size": 3, "padding": "same", "bias": False},
        nn.Conv2d(4, 6, 3, padding="same", bias=False),
    ),
    ({"type": "maxpool", "kernel_size": 3, "stride": 2}, nn.MaxPool2d(3, 2)),
    (
        {"type": "maxpool", "kernel_size": 3, "stride": 2, "ceil_mode": True},
        nn.MaxPool2d(3, 2, ceil_mode=True),
    ),
    (
        {"type": "avgpool", "kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True},
        nn.AvgPool2d(3, 2, 1, ceil_mode=True),
    ),
    ({"type": "adaptive_avgpool", "output_size": [2, 3]}, nn.AdaptiveAvgPool2d((2, 3))),
    (
        {"type": "global_avgpool"},
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()),
    ),
    (
        {"type": "lrn", "convention": "caffe", "size": 5, "alpha": 1e-2, "beta": 0.75},
        nn.LocalResponseNorm(5, 1e-2, 0.75, 1.0),
    ),
    ({"type": "batchnorm"}, nn.BatchNorm2d(4)),
    ({"type": "relu"}, nn.ReLU()),
    ({"type": "leaky_relu", "negative_slope": 0.2}, nn.LeakyReLU(0.2)),
    ({"type": "prelu"}, nn.PReLU(4)),
    ({"type": "tanh"}, nn.Tanh()),
    ({"type": "sigmoid"}, nn.Sigmoid()),
    ({"type": "gelu"}, nn.GELU()),
    ({"type": "silu"}, nn.SiLU()),
    ({"type": "dropout", "p": 0.3}, nn.Dropout(0.3)),
    ({"type": "identity"}, nn.Identity()),
    ({"type": "flatten"}, nn.Flatten()),
    ({"type": "linear", "out_features": 7}, nn.Sequential(nn.Flatten(), nn.Linear(4 * 11 * 13, 7))),
]


@pytest.mark.parametrize("layer, ref", CASES, ids=[c[0]["type"] for c in CASES])
def test_layer_matches_torch(layer, ref):
    torch.manual_seed(0)
    model = one_layer(layer, [4, 11, 13])
    x = torch.randn(3, 4, 11, 13)
    if isinstance(ref, nn.Sequential) and isinstance(ref[-1], nn.Linear):
        ref[-1].load_state_dict(model.x.state_dict())
    elif list(ref.state_dict()):
        ref.load_state_dict(model.x.state_dict())
    if isinstance(ref, nn.BatchNorm2d):  # non-trivial running statistics
        with torch.no_grad():
            model.x.running_mean.uniform_(-1, 1)
            model.x.running_var.uniform_(0.5, 2)
            ref.load_state_dict(model.x.state_dict())
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)
    assert tuple(model(x).shape[1:]) == model.output_shape


def test_lrn_paper_convention_is_the_2012_formula():
    model = one_layer(
        {"type": "lrn", "convention": "paper", "size": 5, "alpha": 1e-3, "beta": 0.75, "k": 2},
        [7, 3, 3],
    )
    a = torch.randn(2, 7, 3, 3) * 10
    squares = torch.nn.functional.pad(a.pow(2), (0, 0, 0, 0, 2, 2))  # pad channels by n//2
    window = sum(squares[:, i : i + 7] for i in range(5))
    expected = a / (2 + 1e-3 * window) ** 0.75
    torch.testing.assert_close(model(a), expected, rtol=1e-5, atol=1e-6)


def test_scaled_tanh_is_lecuns():
    model = one_layer({"type": "tanh", "scaled": True}, [3])
    x = torch.linspace(-3, 3, 12).view(4, 3)
    torch.testing.assert_close(model(x), 1.7159 * torch.tanh(2 * x / 3))


@pytest.mark.parametrize(
    "kind, op", [("add", torch.add), ("mul", torch.mul), ("max", torch.maximum)]
)
def test_elementwise_merges(kind, op):
    spec = {
        "input": [3, 4, 4],
        "layers": [
            {"name": "a", "type": "conv", "out_channels": 5, "kernel_size": 1},
            {"name": "b", "type": "conv", "out_channels": 5, "kernel_size": 1, "inputs": "input"},
            {"name": "m", "type": kind, "inputs": ["a", "b"]},
        ],
    }
    model = build_model(spec).eval()
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), op(model.a(x), model.b(x)))


def test_an_add_weighs_its_inputs_by_coeff():
    """Caffe's Eltwise coeff (Inception-ResNet's 0.17 residual scale), and how a wrong one is
    told: one number per input, never fewer than two, numbers only."""
    conv = {"name": "a", "type": "conv", "out_channels": 3, "kernel_size": 1}
    spec = {"input": [3, 4, 4], "layers": [conv, {"name": "m", "type": "add", "coeff": [1, -0.17],
                                                  "inputs": ["input", "a"]}]}  # fmt: skip
    model = build_model(spec).eval()
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), x - 0.17 * model.a(x))
    for coeff, words in [([1, 2, 3], "gives 3 numbers for 2 inputs"), ([1], "at least 2"),
                         (["a", 1], "number")]:  # fmt: skip
        bad = {**spec, "layers": [conv, {**spec["layers"][1], "coeff": coeff}]}
        with pytest.raises(ConfigError, match=words):
            build_model(bad)


def test_concat_joins_channels():
    spec = {
        "input": [3, 6, 6],
        "layers": [
            {"name": "a", "type": "conv", "out_channels": 2, "kernel_size": 1},
            {
                "name": "b",
                "type": "conv",
                "out_channels": 5,
                "kernel_size": 3,
                "padding": 1,
                "inputs": "input",
            },
            {"name": "c", "type": "concat", "inputs": ["a", "b"]},
        ],
    }
    model = build_model(spec).eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(model(x), torch.cat([model.a(x), model.b(x)], 1))
    assert model.output_shape == (7, 6, 6)


@pytest.mark.parametrize("size", [5, 4, 1])
@pytest.mark.parametrize("channels_last", [False, True])
def test_lrn_matches_torch_forward_and_backward_in_both_formats(size, channels_last):
    """cnnkit's LRN (a band matrix product, the backward written out) against
    nn.LocalResponseNorm: outputs, input gradients and memory formats; with grad and without."""
    from cnnkit.nn.modules import LocalResponseNorm

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(3, 10, 6, 7, generator=torch.Generator().manual_seed(size)) * 4
    x = x.contiguous(memory_format=fmt)
    ours, ref = (
        LocalResponseNorm(size, 1e-2, 0.75, 2.0),
        nn.LocalResponseNorm(size, 1e-2, 0.75, 2.0),
    )
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = ours(a), ref(b)
    grad = torch.randn_like(want)
    got.backward(grad), want.backward(grad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    assert got.stride() == want.stride() and a.grad.stride() == b.grad.stride()
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), want.detach(), rtol=1e-5, atol=1e-6)
    assert ours(x[:, :, ::2]).shape == ref(x[:, :, ::2]).shape  # neither format: made contiguous


def test_lrn_in_bf16_is_computed_in_fp32_and_exports_as_torch_nn():
    from cnnkit.nn.modules import LocalResponseNorm

    ours, ref = LocalResponseNorm(5, 1e-4, 0.75, 1.0), nn.LocalResponseNorm(5, 1e-4, 0.75, 1.0)
    x = torch.randn(2, 8, 5, 5) * 50
    half = ours(x.bfloat16())
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), ref(x.bfloat16().float()), rtol=1e-2, atol=1e-2)
    assert ours(x.to("meta")).shape == x.shape  # shape inference on the meta device
    graph = str(torch.export.export(ours, (x,)).graph)  # exports hold torch.nn's ops
    assert "baddbmm" not in graph and "avg_pool3d" in graph


@pytest.mark.parametrize("kind, ref", [("maxpool", nn.MaxPool2d), ("avgpool", nn.AvgPool2d)])
def test_ceil_mode_pooling_with_a_window_larger_than_its_input(kind, ref):
    """As torch and Caffe count it: one window overhanging a 2x2 input gives 1x1; floor mode,
    or a window that would start past the input, is refused with the layer's reason."""
    from cnnkit.errors import ConfigError

    net = one_layer({"type": kind, "kernel_size": 3, "stride": 2, "ceil_mode": True}, [4, 2, 2])
    x = torch.randn(2, 4, 2, 2)
    torch.testing.assert_close(net(x), ref(3, 2, ceil_mode=True)(x))
    assert net.output_shape == (4, 1, 1)
    for layer, shape in (({"kernel_size": 3, "stride": 2}, [4, 2, 2]),
                         ({"kernel_size": 7, "stride": 2, "ceil_mode": True}, [4, 5, 5])):  # fmt: skip
        with pytest.raises(ConfigError, match="kernel_size: kernel .* is larger than its input"):
            one_layer({"type": kind, **layer}, shape)


@pytest.mark.parametrize("p", [0.5, 0.1, 0.3])
def test_dropout_on_a_cpu_keeps_what_torchs_keeps_and_scales_it_exactly(p):
    """The CPU's 16-bit mask (nn/modules.Dropout) against torch.nn.Dropout's contract: each
    value kept with probability 1 - p, scaled so the mean is unchanged, gradients through the
    same mask, identity in eval, seeded by torch's generator."""
    from cnnkit.nn.modules import Dropout

    layer = Dropout(p).train()
    assert isinstance(layer, nn.Dropout) and repr(layer) == repr(nn.Dropout(p))
    x = torch.ones(400, 2500, requires_grad=True)  # 10^6 draws: the keep rate to ~0.1%
    torch.manual_seed(0)
    y = layer(x)
    kept = y != 0
    scale = 65536 / (65536 - round(p * 65536))
    assert abs(kept.float().mean().item() - (1 - p)) < 0.002
    assert torch.equal(y[kept], torch.full_like(y[kept], scale))  # one exact scale
    assert abs(y.mean().item() - 1) < 0.005
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # the gradient passes where the value did
    torch.manual_seed(0)
    assert torch.equal(layer(x), y)  # reproducible from the seed (exact resume)
    assert not torch.equal(layer(x), y)  # and a new mask at each call
    assert torch.equal(layer.eval()(x), x)
    lanes = (y != 0).float().flatten()  # the four 16-bit lanes of a word: independent draws
    for shift in (1, 2, 3, 4):
        corr = torch.corrcoef(torch.stack([lanes[:-shift], lanes[shift:]]))[0, 1]
        assert abs(corr.item()) < 0.01
    rows = layer.train()(torch.ones(7, 3, dtype=torch.bfloat16))  # any size, any float type
    assert rows.dtype == torch.bfloat16 and rows.shape == (7, 3)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace.*is deprecated:FutureWarning")
def test_dropout_a_16_bit_draw_cannot_make_is_torchs_and_tracing_sees_torchs():
    from cnnkit.nn.modules import Dropout

    x = torch.ones(1000, 1000)
    assert (Dropout(1e-6).train()(x) == 0).any()  # p under 2^-17: still drops (torch's)
    assert (Dropout(1 - 1e-6).train()(x) != 0).sum() < 100  # no division by a zero keep rate
    net = nn.Sequential(nn.Linear(8, 8), Dropout(0.5)).train()  # a model starts training
    traced = torch.jit.trace(net, torch.randn(4, 8), check_trace=False)
    assert traced(torch.randn(4, 8)).shape == (4, 8)
