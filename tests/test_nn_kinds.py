"""The layer kinds the model families need, each against its torch / torchvision counterpart,
and every kind's parameter count (counted from the file) against the module it builds."""

import pytest
import torch
import torchvision
from torch import nn

from cnnkit import ConfigError, build_model
from cnnkit.nn.kinds import KINDS


def one_layer(layer: dict, input_shape: list[int]) -> torch.nn.Module:
    """A network holding just `layer`, named `x`."""
    return build_model({"input": input_shape, "layers": [{"name": "x", **layer}]}).eval()


class Chunk(nn.Module):
    """torch.tensor_split's part `part` of the channels: of 2 equal parts, or cut at `points`."""

    def __init__(self, part: int, points: list[int] | None = None):
        super().__init__()
        self.part, self.points = part, points

    def forward(self, x):
        return x.tensor_split(self.points or 2, dim=1)[self.part]


class ChannelsLast(nn.Module):
    """torch's Linear / LayerNorm over the channels, as ConvNeXt applies them (permute, op, back)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Affine(nn.Module):
    """Caffe's Power layer, written out: (shift + scale * x) ** power."""

    def __init__(self, power: float, scale: float, shift: float):
        super().__init__()
        self.power, self.scale, self.shift = power, scale, shift

    def forward(self, x):
        return torch.pow(self.shift + self.scale * x, self.power)


LayerNorm2d = torchvision.models.convnext.LayerNorm2d
CASES = [
    ({"type": "relu6"}, nn.ReLU6()),
    ({"type": "hardswish"}, nn.Hardswish()),
    ({"type": "hardsigmoid"}, nn.Hardsigmoid()),
    ({"type": "channel_shuffle", "groups": 2}, nn.ChannelShuffle(2)),
    ({"type": "channel_split", "part": 1}, Chunk(1)),
    ({"type": "channel_split", "points": [1, 5], "part": 1}, Chunk(1, [1, 5])),
    ({"type": "channel_split", "points": [4], "part": 1}, Chunk(1, [4])),
    ({"type": "reshape", "shape": [6, 35]}, nn.Sequential(nn.Flatten(1), nn.Unflatten(1, (6, 35)))),
    (
        {"type": "reshape", "shape": [-1, 7, 1]},
        nn.Sequential(nn.Flatten(1), nn.Unflatten(1, (30, 7, 1))),
    ),
    ({"type": "layernorm", "eps": 1e-6}, LayerNorm2d(6, eps=1e-6)),
    ({"type": "linear", "out_features": 5, "flatten": False}, ChannelsLast(nn.Linear(6, 5))),
    ({"type": "stochastic_depth", "p": 0.3}, torchvision.ops.StochasticDepth(0.3, "row")),
    ({"type": "groupnorm", "num_groups": 3}, nn.GroupNorm(3, 6)),
    ({"type": "instancenorm", "affine": True}, nn.InstanceNorm2d(6, affine=True)),
    ({"type": "elu", "alpha": 0.5}, nn.ELU(0.5)),
    ({"type": "softplus", "beta": 2.0}, nn.Softplus(2.0)),
    ({"type": "mish"}, nn.Mish()),
    ({"type": "power", "power": 2.0, "scale": 0.5, "shift": 3.0}, Affine(2.0, 0.5, 3.0)),
    ({"type": "power", "scale": -0.25, "shift": 1.5}, Affine(1.0, -0.25, 1.5)),
    ({"type": "power", "power": 3.0}, Affine(3.0, 1.0, 0.0)),
    ({"type": "softmax"}, nn.Softmax(dim=1)),
    ({"type": "pad", "padding": [1, 2, 0, 3]}, nn.ConstantPad2d((1, 2, 0, 3), 0.0)),
    ({"type": "pad", "padding": 2, "mode": "reflect"}, nn.ReflectionPad2d(2)),
    (
        {"type": "upsample", "scale_factor": 2, "mode": "bilinear"},
        nn.Upsample(scale_factor=2, mode="bilinear"),
    ),
    ({"type": "upsample", "size": [9, 4]}, nn.Upsample(size=(9, 4))),
    (
        {
            "type": "conv_transpose",
            "out_channels": 4,
            "kernel_size": 3,
            "stride": 2,
            "padding": 1,
            "output_padding": 1,
        },
        nn.ConvTranspose2d(6, 4, 3, 2, 1, 1),
    ),
    (
        {
            "type": "conv_transpose",
            "out_channels": 4,
            "kernel_size": [2, 3],
            "groups": 2,
            "dilation": 2,
        },
        nn.ConvTranspose2d(6, 4, (2, 3), groups=2, dilation=2),
    ),
    ({"type": "maxpool", "kernel_size": 3, "stride": 1, "dilation": 2}, nn.MaxPool2d(3, 1, 0, 2)),
]


@pytest.mark.parametrize(
    "layer, ref", CASES, ids=[f"{c[0]['type']}-{i}" for i, c in enumerate(CASES)]
)
def test_layer_matches_torch(layer, ref):
    torch.manual_seed(0)
    model = one_layer(layer, [6, 5, 7])
    target = ref.inner if isinstance(ref, ChannelsLast) else ref
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    if list(target.state_dict()):
        target.load_state_dict(model.x.state_dict())
    ref.eval()
    x = torch.randn(3, 6, 5, 7)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-6, atol=1e-6)
    assert tuple(model(x).shape[1:]) == model.output_shape


def test_power_with_scale_or_power_zero_is_caffes_constant_whatever_the_input():
    """Caffe's PowerLayer writes 1 (power 0) or shift ** power (scale 0) over every value."""
    x = torch.tensor([[[[float("inf"), float("nan"), -2.0]]]])
    with torch.no_grad():
        scaled = one_layer({"type": "power", "power": 2.0, "scale": 0.0, "shift": 3.0}, [1, 1, 3])
        assert torch.equal(scaled(x), torch.full_like(x, 9.0))
        assert torch.equal(one_layer({"type": "power", "power": 0.0}, [1, 1, 3])(x),
                           torch.ones_like(x))  # fmt: skip


def test_layernorm_and_linear_on_vectors_are_torchs():
    norm = one_layer({"type": "layernorm"}, [6])
    fc = one_layer({"type": "linear", "out_features": 3, "flatten": False}, [6])
    ref_norm, ref_fc = nn.LayerNorm(6), nn.Linear(6, 3)
    ref_norm.load_state_dict(norm.x.state_dict())
    ref_fc.load_state_dict(fc.x.state_dict())
    x = torch.randn(4, 6) * 3 + 1
    with torch.no_grad():
        torch.testing.assert_close(norm(x), ref_norm(x))
        torch.testing.assert_close(fc(x), ref_fc(x))


def test_scale_is_convnexts_layer_scale_under_its_own_name():
    spec = {
        "input": [4, 3, 3],
        "layers": [
            {"name": "block.layer_scale", "type": "scale", "init": {"weight": 1e-6}},
            {"name": "block.relu", "type": "relu"},
        ],
    }
    model = build_model(spec)
    assert list(model.state_dict()) == ["block.layer_scale"]
    assert model.state_dict()["block.layer_scale"].shape == (4, 1, 1)
    assert torch.all(model.state_dict()["block.layer_scale"] == 1e-6)
    gamma = torch.rand(4, 1, 1)
    model.load_state_dict({"block.layer_scale": gamma})  # strict, as torchvision names it
    x = torch.randn(2, 4, 3, 3)
    with torch.no_grad():
        torch.testing.assert_close(model(x), torch.relu(gamma * x))


def test_stochastic_depth_drops_rows_like_torchvision_and_keeps_the_mean():
    ours = one_layer({"type": "stochastic_depth", "p": 0.25}, [3, 2, 2]).train()
    ref = torchvision.ops.StochasticDepth(0.25, "row").train()
    x = torch.ones(4000, 3, 2, 2)
    torch.manual_seed(1)
    a = ours(x)
    torch.manual_seed(1)
    b = ref(x)
    torch.testing.assert_close(a, b)  # same draws, same rule
    kept = a[:, 0, 0, 0]
    assert torch.equal(kept.unique(), torch.tensor([0.0, 1 / 0.75]))  # rows dropped or scaled up
    assert torch.equal(a, kept.view(-1, 1, 1, 1).expand_as(a))
    assert abs(kept.mean().item() - 1.0) < 0.05 and abs((kept == 0).float().mean() - 0.25) < 0.03
    assert torch.equal(ours.eval()(x), x)


def test_merges_broadcast_an_excitation_over_the_feature_map():
    spec = {
        "input": [4, 5, 5],
        "layers": [
            {"name": "pool", "type": "adaptive_avgpool", "output_size": 1},
            {"name": "gate", "type": "sigmoid"},
            {"name": "scale", "type": "mul", "inputs": ["gate", "input"]},
        ],
    }
    model = build_model(spec)
    x = torch.randn(2, 4, 5, 5)
    assert model.output_shape == (4, 5, 5)
    torch.testing.assert_close(model(x), torch.sigmoid(x.mean((2, 3), keepdim=True)) * x)


def caffe_within_channel_lrn(x: torch.Tensor, size: int, alpha: float, beta: float) -> torch.Tensor:
    """Caffe's WITHIN_CHANNEL LRN, loop for loop: each square's sum of squares over the padded
    window, divided by the window's size clipped at H + pad (Caffe's AVE pooling rule)."""
    _, _, h, w = x.shape
    pad = (size - 1) // 2
    out = torch.empty_like(x)
    for i in range(h):
        for j in range(w):
            h0, w0 = i - pad, j - pad
            h1, w1 = min(h0 + size, h + pad), min(w0 + size, w + pad)
            count = (h1 - h0) * (w1 - w0)
            window = x[:, :, max(h0, 0) : min(h1, h), max(w0, 0) : min(w1, w)]
            scale = 1 + alpha * window.pow(2).sum((2, 3)) / count
            out[:, :, i, j] = x[:, :, i, j] / scale.pow(beta)
    return out


def test_lrn_within_channel_is_caffes():
    layer = {"type": "lrn", "convention": "caffe", "region": "within_channel", "size": 3,
             "alpha": 5e-2, "beta": 0.75}  # fmt: skip
    model = one_layer(layer, [2, 5, 6])
    x = torch.randn(2, 2, 5, 6) * 3
    with torch.no_grad():
        torch.testing.assert_close(model(x), caffe_within_channel_lrn(x, 3, 5e-2, 0.75))


EXAMPLES = {  # one layer of every kind that has parameters, with a (C, H, W) or (F,) input
    "conv": ({"out_channels": 6, "kernel_size": [3, 2], "groups": 2}, [4, 7, 7]),
    "linear": ({"out_features": 5}, [4, 3, 3]),
    "batchnorm": ({}, [4, 3, 3]),
    "layernorm": ({"affine": False}, [4]),
    "prelu": ({}, [4, 3, 3]),
    "scale": ({}, [4, 3, 3]),
    "conv_transpose": ({"out_channels": 6, "kernel_size": [3, 2], "groups": 2}, [4, 3, 3]),
    "groupnorm": ({"num_groups": 2}, [4, 3, 3]),
    "instancenorm": ({"affine": True}, [4, 3, 3]),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_parameter_counts_from_the_file_match_the_modules(kind):
    fields, shape = EXAMPLES.get(kind, ({}, [4, 3, 3]))
    fields = {**fields, "convention": "caffe"} if kind == "lrn" else fields
    fields = {**fields, "groups": 2} if kind == "channel_shuffle" else fields
    fields = {**fields, "part": 0} if kind == "channel_split" else fields
    fields = {**fields, "kernel_size": 2} if kind in ("maxpool", "avgpool") else fields
    fields = {**fields, "output_size": 2} if kind == "adaptive_avgpool" else fields
    fields = {**fields, "p": 0.1} if kind == "stochastic_depth" else fields
    fields = {**fields, "scale_factor": 2} if kind == "upsample" else fields
    fields = {**fields, "padding": 1} if kind == "pad" else fields
    fields = {**fields, "shape": [-1]} if kind == "reshape" else fields
    layers = [{"name": "x", "type": kind, **fields}]
    if KINDS[kind].many_inputs:
        layers = [
            {"name": "a", "type": "relu"},
            {"name": "x", "type": kind, "inputs": ["a", "input"]},
        ]
    model = build_model({"input": shape, "layers": layers}, device="meta")
    assert (
        model.param_count
        == sum(p.numel() for p in model.parameters())
        == sum(r.params for r in model.table)
    )
    if kind in EXAMPLES and EXAMPLES[kind][0].get("affine") is not False:
        assert model.param_count > 0


@pytest.mark.parametrize("fields, words", [
    ({"points": [4, 2], "part": 0}, "points: .4, 2. must rise and stay below the 6 channels"),
    ({"points": [6], "part": 0}, "points: .6. must rise and stay below the 6 channels"),
    ({"points": [2], "part": 2}, "part: is counted from 0 and must be below the 2 parts"),
    ({"points": [2], "parts": 3, "part": 0}, "parts: given with points: give one"),
    ({"parts": 4, "part": 0}, "parts: must divide the 6 channels"),
])  # fmt: skip
def test_a_channel_split_that_does_not_fit_its_input_is_refused(fields, words):
    with pytest.raises(ConfigError, match=words):
        one_layer({"type": "channel_split", **fields}, [6, 2, 2])


@pytest.mark.parametrize("shape, words", [
    ([7, -1], r"shape: \[7, -1\] does not hold the 24 values of \(6, 2, 2\)"),
    ([6, 2, 3], r"shape: \[6, 2, 3\] does not hold the 24 values"),
    ([-1, -1], "one -1 at most"),
    ([0, 24], "shape.0: "),
    ([1, 1, 2, 12], "shape: List should have at most 3 items"),
])  # fmt: skip
def test_a_reshape_that_does_not_hold_its_input_is_refused(shape, words):
    with pytest.raises(ConfigError, match=words):
        one_layer({"type": "reshape", "shape": shape}, [6, 2, 2])


def test_a_crop_takes_the_second_inputs_size_from_its_offset():
    """FCN's alignment: an upsampled map cut to the input's size, as slicing it would."""
    net = build_model({"input": [3, 10, 12], "layers": [
        {"name": "up", "type": "conv_transpose", "out_channels": 2, "kernel_size": 4, "stride": 2},
        {"name": "c", "type": "crop", "offset": [3, 5], "inputs": ["up", "input"]},
        {"name": "d", "type": "crop", "offset": 1, "inputs": ["up", "c"]}]}).eval()  # fmt: skip
    x = torch.randn(2, 3, 10, 12)
    with torch.no_grad():
        up = net.up(x)
        assert torch.equal(net(x), up[:, :, 1:11, 1:13]) and net.table[-2].output_shape == (
            2,
            10,
            12,
        )
        assert torch.equal(net.c(up, x), up[:, :, 3:13, 5:17])
    for layer, words in [
        ({"offset": [13, 0], "inputs": ["up", "input"]}, r"offset: \[13, 0\]: a 10 x 12 window from it leaves the 22 x 26 input"),
        ({"inputs": "up"}, r"inputs: takes 2 \(what to crop, and an input of the size to crop it to\), got 1"),
        ({"inputs": ["input", "up"]}, "leaves the 10 x 12 input"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            build_model({"input": [3, 10, 12], "layers": [
                {"name": "up", "type": "conv_transpose", "out_channels": 2, "kernel_size": 4, "stride": 2},
                {"name": "c", "type": "crop", **layer}]})  # fmt: skip


def test_a_pad_value_outside_constant_mode_is_refused():
    """reflect and replicate pad with the input's pixels: a `value` there would be ignored."""
    with pytest.raises(ConfigError, match="value: for mode constant only"):
        build_model(
            {
                "input": [3, 8, 8],
                "layers": [{"type": "pad", "padding": 1, "mode": "reflect", "value": 3}],
            }
        )
    build_model({"input": [3, 8, 8], "layers": [{"type": "pad", "padding": 1, "value": 3}]})


def test_transposed_conv_shapes_and_refusals_are_torchs():
    """Every combination of a small grid: cnnkit's declared shape is what torch gives, and a
    layer torch cannot make (or makes empty) is refused before anything is built."""
    from cnnkit import ConfigError

    checked = 0
    for size in (1, 2, 5):
        for k in (1, 2, 3):
            for s in (1, 2, 3):
                for pad in (0, 1, 2):
                    for op in (0, 1, 2):
                        for d in (1, 2):
                            layer = {"type": "conv_transpose", "out_channels": 2, "kernel_size": k,
                                     "stride": s, "padding": pad, "output_padding": op, "dilation": d}  # fmt: skip
                            try:
                                ref = nn.ConvTranspose2d(3, 2, k, s, pad, op, dilation=d)
                                want = tuple(ref(torch.zeros(1, 3, size, size)).shape[1:])
                            except RuntimeError:
                                want = None
                            if want is not None and min(want) < 1:
                                want = None
                            try:
                                got = one_layer(layer, [3, size, size]).output_shape
                            except ConfigError:
                                got = None
                            assert got == want, (size, layer)
                            checked += 1
    assert checked == 486


def test_a_decoder_of_the_new_kinds_exports_to_onnx_as_it_computes(tmp_path):
    from cnnkit.infer.export import check_export, export
    from cnnkit.infer.load import load_network

    spec = tmp_path / "decoder.yaml"
    spec.write_text("""model:
  input: [3, 16, 16]
  num_classes: 4
  layers:
    - {name: pad, type: pad, padding: [0, 1, 0, 1]}
    - {name: down, type: conv, out_channels: 8, kernel_size: 3, stride: 2}
    - {name: gn, type: groupnorm, num_groups: 4}
    - {name: keep, type: channel_split, points: [6], part: 0}
    - {name: dense, type: channel_split, points: [6], part: 1, inputs: gn}
    - {name: joined, type: concat, inputs: [dense, keep]}
    - {type: elu}
    - {name: up, type: conv_transpose, out_channels: 4, kernel_size: 2, stride: 2}
    - {name: inorm, type: instancenorm, affine: true}
    - {name: se_pool, type: global_avgpool}
    - {name: se_fc, type: linear, out_features: 4}
    - {name: se_gate, type: sigmoid}
    - {name: se_shape, type: reshape, shape: [-1, 1, 1]}
    - {name: se, type: mul, inputs: [inorm, se_shape]}
    - {type: mish}
    - {type: power, power: 2.0, scale: 0.5, shift: 1.0}
    - {name: big, type: upsample, scale_factor: 2, mode: bilinear}
    - {name: pool, type: maxpool, kernel_size: 3, stride: 2, dilation: 2}
    - {type: global_avgpool}
    - {name: fc, type: linear}
""")
    loaded = load_network(str(spec))
    assert loaded.model.output_shape == (4,)
    out = tmp_path / "decoder.onnx"
    export(loaded, "onnx", out)
    result = check_export(loaded, "onnx", out)
    assert result.ok, result


def test_a_bilinear_conv_transpose_upsamples_as_bilinear_interpolation():
    """FCN's upsampling: kernel 4, stride 2, padding 1, one channel a group, Caffe's bilinear
    kernel; inside the border it is torch's bilinear interpolation by 2."""
    layer = {"type": "conv_transpose", "out_channels": 3, "kernel_size": 4, "stride": 2, "padding": 1,
             "groups": 3, "bias": False, "init": {"weight": "bilinear"}}  # fmt: skip
    model = one_layer(layer, [3, 6, 7])
    x = torch.randn(2, 3, 6, 7)
    with torch.no_grad():
        y = model(x)
    reference = nn.functional.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
    torch.testing.assert_close(y[..., 1:-1, 1:-1], reference[..., 1:-1, 1:-1], rtol=1e-5, atol=1e-5)
    from cnnkit import ConfigError

    with pytest.raises(ConfigError, match="init: .*bilinear.*2-D kernels"):
        one_layer({**layer, "bias": True, "init": {"bias": "bilinear"}}, [3, 6, 7])


@pytest.mark.parametrize("k, axis", [(3, [0.5, 1, 0.5]), (4, [0.25, 0.75, 0.75, 0.25]), (2, [0.5, 0.5]),
                                     (7, [0.25, 0.5, 0.75, 1, 0.75, 0.5, 0.25])])  # fmt: skip
def test_the_bilinear_init_is_caffes_and_fcns_kernel(k, axis):
    from cnnkit.nn.init import bilinear_kernel

    axis = torch.tensor(axis)
    torch.testing.assert_close(bilinear_kernel((k, k)), torch.outer(axis, axis))
    from cnnkit import ConfigError

    with pytest.raises(ConfigError, match="bilinear.*2-D kernels"):  # not a linear's matrix
        one_layer({"type": "linear", "out_features": 4, "init": {"weight": "bilinear"}}, [4])
