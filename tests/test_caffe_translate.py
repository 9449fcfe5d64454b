"""import-caffe's translation checked against torch.nn, a direct implementation of Caffe's
pooling and Caffe's published nets' sizes; the learning-rate and decay multipliers and the
fillers it keeps; and the command that writes the network file."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from helpers import CAFFE_CONV as CONV
from helpers import CAFFE_INPUT as INPUT
from helpers import caffe_layer as _layer
from torch import nn

from cnnkit import ConfigError, build_model
from cnnkit.caffe import import_caffe, network_yaml, parse_prototxt, translate
from cnnkit.caffe.translator import Translator

DATA = Path(__file__).parent / "data" / "caffe"


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def alexnet_reference(lrn_first: bool) -> nn.Sequential:
    """bvlc_alexnet (lrn_first) or CaffeNet written directly in torch.nn with Caffe's LRN."""

    def lrn() -> nn.Module:
        return nn.LocalResponseNorm(5, 1e-4, 0.75, 1.0)

    def stage(conv: nn.Conv2d) -> list[nn.Module]:
        pool = nn.MaxPool2d(3, 2, ceil_mode=True)
        return [conv, nn.ReLU(), *((lrn(), pool) if lrn_first else (pool, lrn()))]

    return nn.Sequential(
        *stage(nn.Conv2d(3, 96, 11, 4)),
        *stage(nn.Conv2d(96, 256, 5, 1, 2, groups=2)),
        nn.Conv2d(256, 384, 3, 1, 1), nn.ReLU(),
        nn.Conv2d(384, 384, 3, 1, 1, groups=2), nn.ReLU(),
        nn.Conv2d(384, 256, 3, 1, 1, groups=2), nn.ReLU(), nn.MaxPool2d(3, 2, ceil_mode=True),
        nn.Flatten(), nn.Linear(9216, 4096), nn.ReLU(), nn.Dropout(),
        nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(), nn.Linear(4096, 1000),
    )  # fmt: skip


@pytest.mark.parametrize("name,lrn_first", [("alexnet", True), ("caffenet", False)])
def test_alexnet_and_caffenet_match_torch_nn(name, lrn_first):
    net = build_model(import_caffe(DATA / f"{name}.prototxt")).eval()
    reference = alexnet_reference(lrn_first).eval()
    assert n_params(net) == n_params(reference) == 60_965_224
    for mine, theirs in zip(net.parameters(), reference.parameters(), strict=True):
        theirs.data.copy_(mine.data)
    x = torch.randn(1, 3, 227, 227) * 50
    with torch.no_grad():
        torch.testing.assert_close(net(x), reference(x), rtol=1e-4, atol=1e-4)


def test_lenet_v1_syntax_with_fillers():
    model = import_caffe(DATA / "lenet.prototxt")
    net = build_model(model)
    reference = nn.Sequential(
        nn.Conv2d(1, 20, 5), nn.MaxPool2d(2), nn.Conv2d(20, 50, 5), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(800, 500), nn.ReLU(), nn.Linear(500, 10),
    )  # fmt: skip
    assert n_params(net) == n_params(reference) == 431_080
    assert net.output_shape == (10,) and model["input"] == [1, 28, 28]
    assert model["layers"][0]["init"]["bias"] == 0.0
    assert float(net.conv1.bias.detach().abs().max()) == 0.0  # the constant filler was applied


def test_every_v1_type_name_reads_as_its_layer_type():
    """The old syntax's enum names, all of them: a Deconvolution imports (as the new syntax's),
    a train_val's DATA / SOFTMAX_LOSS get the deploy hint, others name the type by today's
    name."""
    v1 = 'input: "data"\ninput_dim: 1 input_dim: 2 input_dim: 4 input_dim: 4\n'
    deconv = ('layers { name: "up" type: DECONVOLUTION bottom: "data" top: "up" '
              "convolution_param { num_output: 3 kernel_size: 4 stride: 2 pad: 1 } }\n")  # fmt: skip
    net = build_model(translate(parse_prototxt(v1 + deconv)))
    assert isinstance(net.up, nn.ConvTranspose2d) and net.output_shape == (3, 8, 8)
    for kind, words in [("DATA", "a train_val prototxt?"), ("SOFTMAX_LOSS", "a train_val prototxt?"),
                        ("MVN", "type 'MVN', which cnnkit cannot import")]:  # fmt: skip
        layer = f'layers {{ name: "x" type: {kind} bottom: "data" top: "x" }}\n'
        with pytest.raises(ConfigError, match=re.escape(words)):
            translate(parse_prototxt(v1 + layer))


def caffe_pool(x: np.ndarray, k: int, s: int, pad: int, mode: str) -> np.ndarray:
    """Caffe's pooling_layer.cpp, loop for loop: ceil output size, windows clipped at H + pad."""
    c, h, w = x.shape

    def size(n: int) -> int:
        out = int(math.ceil((n + 2 * pad - k) / s)) + 1
        return out - 1 if pad and (out - 1) * s >= n + pad else out

    out = np.zeros((c, size(h), size(w)), dtype=np.float64)
    for i in range(out.shape[1]):
        for j in range(out.shape[2]):
            h0, w0 = i * s - pad, j * s - pad
            h1, w1 = min(h0 + k, h + pad), min(w0 + k, w + pad)
            count = (h1 - h0) * (w1 - w0)
            h0, w0, h1, w1 = max(h0, 0), max(w0, 0), min(h1, h), min(w1, w)
            window = x[:, h0:h1, w0:w1]
            if mode == "max":
                out[:, i, j] = window.max(axis=(1, 2))
            else:
                out[:, i, j] = window.sum(axis=(1, 2)) / count
    return out


@torch.no_grad()
def test_every_layer_type_against_functional_reference():
    net = build_model(import_caffe(DATA / "every_layer.prototxt")).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        net.bn1.running_mean.copy_(torch.randn(8))
        net.bn1.running_var.copy_(torch.rand(8) + 0.5)
    x = torch.randn(2, 4, 21, 19)
    bn = net.bn1
    y = F.conv2d(x, net.conv1.weight, None, 1, (1, 2), 1, 2)
    y = (y - bn.running_mean.view(1, -1, 1, 1)) / (bn.running_var.view(1, -1, 1, 1) + 1e-3).sqrt()
    y = F.leaky_relu(y * bn.weight.view(1, -1, 1, 1) + bn.bias.view(1, -1, 1, 1), 0.1)
    th = torch.tanh(y)
    mixed = torch.maximum(
        (F.conv2d(y, net.dil.weight, net.dil.bias, 1, 2, 2) + th) * y.sigmoid(), th
    )
    squares = F.pad(mixed.pow(2), (0, 0, 0, 0, 1, 1))  # Caffe LRN: k + alpha / n * window sum
    norm = mixed / (2 + 0.5 / 3 * (squares[:, :-2] + squares[:, 1:-1] + squares[:, 2:])) ** 0.75
    pools = []
    for sample in norm.double().numpy():
        pmax = caffe_pool(sample, 3, 2, 0, "max")
        pave = caffe_pool(caffe_pool(sample, 3, 2, 1, "ave"), 2, 1, 0, "ave")
        pools.append(np.concatenate([pmax, pave]))
    cat = torch.tensor(np.stack(pools), dtype=torch.float32)  # (2, 16, 10, 9)
    both = cat.amax(dim=(2, 3)) + cat.mean(dim=(2, 3))
    expected = F.linear(both, net.fc.weight, net.fc.bias)
    with torch.no_grad():
        torch.testing.assert_close(net(x), expected, rtol=1e-4, atol=1e-4)


# GoogLeNet's inception modules (Szegedy et al. 2014, table 1):
# 1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj
INCEPTION = {
    "3a": (64, 96, 128, 16, 32, 32), "3b": (128, 128, 192, 32, 96, 64),
    "4a": (192, 96, 208, 16, 48, 64), "4b": (160, 112, 224, 24, 64, 64),
    "4c": (128, 128, 256, 24, 64, 64), "4d": (112, 144, 288, 32, 64, 64),
    "4e": (256, 160, 320, 32, 128, 128), "5a": (256, 160, 320, 32, 128, 128),
    "5b": (384, 192, 384, 48, 128, 128),
}  # fmt: skip


def _conv(name, bottom, n, k, stride=1, pad=0):
    p = f"convolution_param {{ num_output: {n} kernel_size: {k} stride: {stride} pad: {pad} }}"
    return _layer(name, "Convolution", [bottom], name, p) + _layer(
        f"{name}_relu", "ReLU", [name], name
    )


def _pool(name, bottom, kind, k, stride, pad=0):
    p = f"pooling_param {{ pool: {kind} kernel_size: {k} stride: {stride} pad: {pad} }}"
    return _layer(name, "Pooling", [bottom], name, p)


def _lrn(name, bottom):
    return _layer(
        name, "LRN", [bottom], name, "lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 }"
    )


def googlenet_prototxt() -> str:
    """bvlc_googlenet's deploy definition, generated from the inception table."""
    text = 'name: "GoogleNet"\nlayer { name: "data" type: "Input" top: "data"\n'
    text += "  input_param { shape: { dim: 10 dim: 3 dim: 224 dim: 224 } } }\n"
    text += _conv("conv1/7x7_s2", "data", 64, 7, 2, 3) + _pool(
        "pool1/3x3_s2", "conv1/7x7_s2", "MAX", 3, 2
    )
    text += _lrn("pool1/norm1", "pool1/3x3_s2") + _conv("conv2/3x3_reduce", "pool1/norm1", 64, 1)
    text += _conv("conv2/3x3", "conv2/3x3_reduce", 192, 3, 1, 1) + _lrn("conv2/norm2", "conv2/3x3")
    bottom = "pool2/3x3_s2"
    text += _pool(bottom, "conv2/norm2", "MAX", 3, 2)
    for key, (c1, c3r, c3, c5r, c5, cp) in INCEPTION.items():
        m = f"inception_{key}"
        text += _conv(f"{m}/1x1", bottom, c1, 1) + _conv(f"{m}/3x3_reduce", bottom, c3r, 1)
        text += _conv(f"{m}/3x3", f"{m}/3x3_reduce", c3, 3, 1, 1)
        text += _conv(f"{m}/5x5_reduce", bottom, c5r, 1) + _conv(
            f"{m}/5x5", f"{m}/5x5_reduce", c5, 5, 1, 2
        )
        text += _pool(f"{m}/pool", bottom, "MAX", 3, 1, 1) + _conv(
            f"{m}/pool_proj", f"{m}/pool", cp, 1
        )
        branches = [f"{m}/1x1", f"{m}/3x3", f"{m}/5x5", f"{m}/pool_proj"]
        text += _layer(f"{m}/output", "Concat", branches, f"{m}/output")
        bottom = f"{m}/output"
        if key in ("3b", "4e"):
            text += _pool(f"pool{key[0]}/3x3_s2", bottom, "MAX", 3, 2)
            bottom = f"pool{key[0]}/3x3_s2"
    text += _pool("pool5/7x7_s1", bottom, "AVE", 7, 1)
    text += _layer(
        "pool5/drop",
        "Dropout",
        ["pool5/7x7_s1"],
        "pool5/7x7_s1",
        "dropout_param { dropout_ratio: 0.4 }",
    )
    text += _layer(
        "loss3/classifier",
        "InnerProduct",
        ["pool5/7x7_s1"],
        "loss3/classifier",
        "inner_product_param { num_output: 1000 }",
    )
    return text + _layer("prob", "Softmax", ["loss3/classifier"], "prob")


def torchvision_googlenet_as_caffe() -> int:
    """torchvision's GoogLeNet counted as Caffe's: conv biases instead of batch norm, and the
    5x5 branch really 5x5 (torchvision's is 3x3 for weight compatibility)."""
    tv = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False)
    total = n_params(tv.fc)
    for name, module in tv.named_modules():
        if isinstance(module, nn.Conv2d):
            weights = module.weight.numel() * (25 // 9 + (25 % 9) / 9 if "branch3.1" in name else 1)
            total += int(round(weights)) + module.out_channels
    return total


def test_googlenet_builds_with_its_true_size():
    model = translate(parse_prototxt(googlenet_prototxt()))
    net = build_model(model, device="meta")
    assert net.output_shape == (1000,)
    assert n_params(net) == torchvision_googlenet_as_caffe() == 6_998_552
    pool4 = next(row for row in net.table if row.name == "pool4_3x3_s2")
    assert pool4.output_shape == (832, 7, 7)  # Caffe's ceil rounding (floor would give 6)


def run_cli(args: list[str]) -> int:
    """Run `cnnkit ARGS` in this process; its exit status."""
    from cnnkit.cli import main

    try:
        main(args)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_cli_writes_a_network_file_and_reports_errors(tmp_path, capsys):
    out = tmp_path / "alexnet.yaml"
    assert run_cli(["import-caffe", str(DATA / "alexnet.prototxt"), "-o", str(out)]) == 0
    assert "60,965,224 parameters" in capsys.readouterr().out
    assert n_params(build_model(str(out), device="meta")) == 60_965_224
    assert network_yaml(import_caffe(DATA / "alexnet.prototxt")) in out.read_text()
    assert run_cli(["import-caffe", str(DATA / "unsupported.prototxt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'SPP'" in err
    assert run_cli(["import-caffe", str(out)]) == 2
    assert "alexnet.yaml: a cnnkit YAML file (info, train and classify" in capsys.readouterr().err
    assert run_cli(["import-caffe", str(tmp_path / "nosuch.yaml")]) == 2
    assert "nosuch.yaml" in (err := capsys.readouterr().err) and "cnnkit YAML" not in err
    assert run_cli(["import-caffe", str(DATA / "lenet.prototxt"), "--keep-bgr"]) == 0
    assert capsys.readouterr().err == ("cnnkit: note: --keep-bgr changes nothing without a "
        ".caffemodel: a network with fresh weights learns whichever order it is trained on\n")  # fmt: skip


def test_layers_named_like_module_attributes_are_renamed(tmp_path, capsys):
    names = ["train", "forward", "to", "training", "input", "train_caffe", "in"]
    text = INPUT + "".join(
        _layer(n, "Convolution", ["data" if i == 0 else names[i - 1]], n, CONV.format(4))
        for i, n in enumerate(names)
    )
    prototxt = tmp_path / "n.prototxt"
    prototxt.write_text(text)
    assert run_cli(["import-caffe", str(prototxt), "-o", str(tmp_path / "n.yaml")]) == 0
    net = build_model(str(tmp_path / "n.yaml"), device="meta")
    assert [r.name for r in net.table] == [
        "train_caffe", "forward_caffe", "to_caffe", "training_caffe", "input_caffe", "train_caffe_2",
        "in_caffe",
    ]  # fmt: skip
    header = (tmp_path / "n.yaml").read_text().split("model:")[0]
    assert "# layer train is train_caffe here: cnnkit, torch or Python holds that name" in header
    assert "layer to is to_caffe" in header and "train_caffe_2" not in header


@pytest.mark.parametrize("axis", ["axis: 1", "axis: -3", "concat_dim: 1"])
def test_concat_along_the_channels_however_caffe_names_the_axis(axis):
    text = INPUT + _conv("a", "data", 4, 1) + _conv("b", "data", 5, 1)
    text += _layer("cat", "Concat", ["a", "b"], "cat", f"concat_param {{ {axis} }}")
    net = build_model(translate(parse_prototxt(text)))
    assert net.output_shape == (9, 8, 8)
    with pytest.raises(ConfigError, match="channel axis"):
        translate(parse_prototxt(text.replace(axis, "axis: -1")))


def _pooled(params: str, side: int = 8) -> nn.Module:
    """A network of one Pooling over a (1, side, side) input, imported from its params."""
    text = INPUT.replace(
        "input_dim: 3 input_dim: 8 input_dim: 8",
        f"input_dim: 1 input_dim: {side} input_dim: {side}",
    )
    return build_model(
        translate(
            parse_prototxt(
                text + _layer("p", "Pooling", ["data"], "p", f"pooling_param {{ {params} }}")
            )
        )
    )


@pytest.mark.parametrize("fork,bvlc", [("ceil_mode: false", "round_mode: FLOOR"),
                                       ("ceil_mode: true", "round_mode: CEIL"),
                                       ("ceil_mode: true round_mode: CEIL", "")])  # fmt: skip
def test_the_forks_ceil_mode_reads_as_round_mode(fork, bvlc):
    """DenseNet's and ResNeXt's prototxts were written for forks that spell round_mode
    `ceil_mode`; the same network either way (8 px: the two roundings differ)."""
    pool = "pool: MAX kernel_size: 3 stride: 2"
    net = _pooled(f"{pool} {fork}")
    assert net.output_shape == _pooled(f"{pool} {bvlc}").output_shape
    assert net.output_shape == ((1, 3, 3) if "false" in fork else (1, 4, 4))
    x = torch.randn(1, 1, 8, 8)
    expected = caffe_pool(x[0].double().numpy(), 3, 2, 0, "max") if "true" in fork else None
    if expected is not None:
        torch.testing.assert_close(net(x)[0].double(), torch.from_numpy(expected))
    with pytest.raises(ConfigError, match="ceil_mode: false and round_mode: CEIL disagree"):
        _pooled(f"{pool} ceil_mode: false round_mode: CEIL")


def test_pooling_caffe_sizes_otherwise_is_one_line():
    """A kernel under its stride, rounding up without padding: Caffe computes one more output
    than torch's pooling where the last window starts past the input; refused, naming both
    counts (with padding, or rounding down, or where the windows fit, the sizes agree). A pad
    over half the kernel, which Caffe takes and torch's pooling does not, says so."""
    with pytest.raises(
        ConfigError, match=r"kernel 1 under stride 2.*Caffe computes 5 outputs.*cnnkit computes 4"
    ):
        _pooled("pool: AVE kernel_size: 1 stride: 2")
    assert _pooled("pool: AVE kernel_size: 1 stride: 2", side=7).output_shape == (1, 4, 4)
    assert _pooled("pool: AVE kernel_size: 1 stride: 2 round_mode: FLOOR").output_shape == (1, 4, 4)
    x = torch.randn(1, 1, 8, 8)
    net = _pooled("pool: MAX kernel_size: 2 stride: 3 pad: 1")
    torch.testing.assert_close(
        net(x)[0].double(), torch.from_numpy(caffe_pool(x[0].double().numpy(), 2, 3, 1, "max"))
    )
    with pytest.raises(
        ConfigError, match="Pooling pad 2 over half its kernel 3: Caffe pads that far"
    ):
        _pooled("pool: MAX kernel_size: 3 stride: 2 pad: 2")


@pytest.mark.parametrize(("params", "words"), [
    ("kernel_size: 3 stride: 0", "stride: Input should be greater than 0 (got 0)"),  # was a
    ("kernel_size: 3 stride_h: 0 stride_w: 2", "stride: Input should be greater than 0 (got 0)"),
    ("kernel_size: 0 stride: 1", "kernel_size: Input should be greater than 0 (got 0)"),
    ("kernel_size: -3", "kernel_size: Input should be greater than 0 (got -3)"),
    ("global_pooling: true kernel_size: 3", "global_pooling: true takes no kernel_size (its "
     "window is the whole input: Caffe refuses this too)"),
    ("global_pooling: true stride: 2", "global_pooling: true takes only stride 1 (as Caffe), got 2"),
    ("global_pooling: true pad_h: 1 pad_w: 0", "global_pooling: true takes only pad 0 (as Caffe), got 0x1"),
])  # fmt: skip
def test_pooling_sizes_caffe_refuses_are_one_line(params, words):
    """A zero stride or kernel is refused as a convolution's is (a stride of 0 was a
    ZeroDivisionError; a kernel of 0 or -3 blamed the rounding or the padding); a global
    pooling given a window is refused, as Caffe's LayerSetUp does."""
    with pytest.raises(ConfigError) as error:
        _pooled(f"pool: MAX {params}")
    assert words in str(error.value) and "\n" not in str(error.value)


def test_a_global_pooling_may_say_caffes_own_stride_and_pad():
    assert _pooled("pool: AVE global_pooling: true stride: 1 pad: 0").output_shape == (1,)


def test_a_reshape_imports_as_a_flatten_a_reshape_or_nothing():
    """TensorFlow ports end in `dim: 0 dim: 0` over (N, C, 1, 1) scores; `dim: 0 dim: -1`
    flattens anything; a reshape to the same shape is nothing; any other reshapes each image as
    Caffe does (0 copies a size, -1 takes the rest); one beyond (C, H, W) is one line."""
    pool = _layer("g", "Pooling", ["data"], "g", "pooling_param { pool: AVE global_pooling: true }")

    def reshaped(bottom: str, *dims: int) -> dict:
        shape = " ".join(f"dim: {d}" for d in dims)
        reshape = _layer("r", "Reshape", [bottom], "r", f"reshape_param {{ shape {{ {shape} }} }}")
        return translate(parse_prototxt(INPUT + (pool if bottom == "g" else "") + reshape))

    assert reshaped("g", 0, 0)["layers"][-1] == {"name": "r", "type": "flatten"}
    flat = reshaped("data", 0, -1)
    assert flat["layers"][-1]["type"] == "flatten" and build_model(flat).output_shape == (192,)
    kept = reshaped("g", 0, 0, 1, -1)["layers"]  # (then the flatten a (C, 1, 1) end gets)
    assert [layer["name"] for layer in kept] == ["g", "flatten"]
    net = build_model(reshaped("data", 0, 8, -1)).eval()
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(net(x), x.reshape(2, 8, 24))
    assert build_model(reshaped("data", -1, 8, 24)).output_shape == (8, 24)  # the batch as -1
    assert reshaped("data", 1, -1)["layers"][-1]["type"] == "flatten"  # or as 1 (deploy's N)
    axis1 = _layer(
        "r", "Reshape", ["data"], "r", "reshape_param { axis: 1 shape { dim: 0 dim: -1 } }"
    )
    assert build_model(translate(parse_prototxt(INPUT + axis1))).output_shape == (3, 64)
    for dims, words in [((0, 1, 3, 8, 8), r"Reshape of \(3, 8, 8\) to \[1, 3, 8, 8\]: "
                                         r"cnnkit's shapes are \(C, H, W\)"),
                        ((0, 5, -1), r"shape: \[5, -1\] does not hold the 192 values"),
                        ((2, -1), r"the first is the batch \(0: as it is, or -1 or 1\)"),
                        ((-1, 3, -1), "one -1 at most"),
                        ((0, 0, 0, 0, 0), r"dim 0 at axis 4 copies an axis the \(3, 8, 8\) bottom")]:  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            reshaped("data", *dims)
    two = _layer(
        "r", "Reshape", ["data", "data"], "r", "reshape_param { shape { dim: 0 dim: -1 } }"
    )
    with pytest.raises(
        ConfigError, match=r"prototxt:3: layer 'r': a Reshape takes one bottom, not 2"
    ):
        translate(parse_prototxt(INPUT + two))


def test_the_forks_depthwise_convolution_is_a_group_per_channel():
    dw = "convolution_param {{ num_output: {} kernel_size: 3 pad: 1 {} }}"
    net = build_model(
        translate(
            parse_prototxt(
                INPUT + _layer("d", "ConvolutionDepthwise", ["data"], "d", dw.format(3, ""))
            )
        )
    )
    assert net.d.groups == net.d.in_channels == net.d.out_channels == 3
    assert net.d.weight.shape == (3, 1, 3, 3)
    for kind in ("ConvolutionDepthwise", "DepthwiseConvolution"):  # each fork's own name
        given = Translator(parse_prototxt(INPUT + _layer("d", kind, ["data"], "d", dw.format(
            6, "group: 3"))), "t")  # fmt: skip
        assert given.run()["layers"][0]["out_channels"] == given.layers[0]["groups"] == 3
        assert given.notes == [f"layer 'd': a {kind} over 3 channels makes 3 (its fork reads no "
                               "num_output or group; given 6 and 3)"]  # fmt: skip
    none = "convolution_param { kernel_size: 3 }"  # the fork's layer needs no num_output
    left_out = Translator(parse_prototxt(INPUT + _layer("d", "ConvolutionDepthwise", ["data"],
                                                        "d", none)), "t")  # fmt: skip
    assert left_out.run()["layers"][0]["out_channels"] == 3 and not left_out.notes


def _mults(net: nn.Module, param: str) -> tuple[float, float]:
    """The (lr, weight decay) the optimizer gives `param` of a built network (lr 1, decay 1)."""
    target = net.get_parameter(param)
    (group,) = [g for g in net.param_groups(1.0, 1.0) if any(p is target for p in g["params"])]
    return group["lr"], group["weight_decay"]


def test_prelu_and_scale_keep_their_learning_rate_and_decay_multipliers():
    """Caffe's PReLU slopes and the BatchNorm + Scale pair are usually kept out of weight decay
    (`param { decay_mult: 0 }`): training the imported net from scratch must follow that."""
    slope = "param { lr_mult: 2 decay_mult: 0 }"
    frozen = "param { lr_mult: 0 decay_mult: 0 }"
    text = INPUT + _layer("bn", "BatchNorm", ["data"], "bn", 3 * frozen)  # its blobs: buffers
    text += _layer("sc", "Scale", ["bn"], "bn", "param { decay_mult: 0 } param { lr_mult: 3 } "
                   "scale_param { bias_term: true filler { value: 0.5 } }")  # fmt: skip
    text += _layer("pr", "PReLU", ["bn"], "pr", slope)
    text += _layer("bn2", "BatchNorm", ["pr"], "bn2")
    text += _layer(
        "g", "Scale", ["bn2"], "g", "param { lr_mult: 0 } scale_param { bias_filler { value: 3 } }"
    )  # x * gamma, its layer (a bias filler unused, as in Caffe)
    net = build_model(translate(parse_prototxt(text)))
    assert _mults(net, "bn.weight") == (1.0, 0.0) and _mults(net, "bn.bias") == (3.0, 1.0)
    assert _mults(net, "pr.weight") == (2.0, 0.0) and _mults(net, "g.weight") == (0.0, 1.0)
    assert torch.equal(net.bn.weight, torch.full((3,), 0.5))  # the Scale's filler
    with pytest.raises(ConfigError, match=r":3: 2 param specs for a layer with 1 learned blob"):
        translate(parse_prototxt(INPUT + _layer("pr", "PReLU", ["data"], "pr", 2 * slope)))


def test_a_scale_beside_another_reader_starts_as_the_identity():
    """BatchNorm + Scale (bias) whose BatchNorm output is also read elsewhere: a depthwise 1x1
    convolution computes the Scale, starting where Caffe's does (factor 1, bias 0)."""
    text = INPUT + _layer("bn", "BatchNorm", ["data"], "bn")
    text += _layer(
        "sc", "Scale", ["bn"], "sc", "param { lr_mult: 2 } scale_param { bias_term: true }"
    )
    text += _layer("sum", "Eltwise", ["bn", "sc"], "sum")
    net = build_model(translate(parse_prototxt(text))).eval()
    x = torch.randn(2, 3, 8, 8)
    assert torch.allclose(net(x), 2 * net.bn(x), atol=1e-6)
    assert _mults(net, "sc.weight") == (2.0, 1.0)


FAN_IN, FAN_OUT = 900, 400  # an InnerProduct from 900 inputs to 400 outputs


@pytest.mark.parametrize(
    ("kind", "norm", "std"),
    [
        ("xavier", "", math.sqrt(1 / FAN_IN)),  # U(+-sqrt(3 / n)): std sqrt(1 / n)
        ("xavier", "variance_norm: FAN_OUT", math.sqrt(1 / FAN_OUT)),
        ("xavier", "variance_norm: AVERAGE", math.sqrt(2 / (FAN_IN + FAN_OUT))),
        ("msra", "", math.sqrt(2 / FAN_IN)),  # N(0, sqrt(2 / n))
        ("msra", "variance_norm: FAN_OUT", math.sqrt(2 / FAN_OUT)),
        ("msra", "variance_norm: 2", math.sqrt(4 / (FAN_IN + FAN_OUT))),  # AVERAGE's number
    ],
)
def test_xavier_and_msra_fillers_follow_variance_norm(kind, norm, std):
    p = f"inner_product_param {{ num_output: {FAN_OUT} weight_filler {{ type: '{kind}' {norm} }} }}"
    head = f'input: "data"\ninput_dim: 1 input_dim: {FAN_IN}\n'
    torch.manual_seed(0)
    weight = build_model(
        translate(parse_prototxt(head + _layer("fc", "InnerProduct", ["data"], "fc", p)))
    ).fc.weight
    assert weight.std().item() == pytest.approx(std, rel=0.01)
    uniform = weight.abs().max().item() <= math.sqrt(3) * std * 1.0001
    assert uniform == (kind == "xavier")


@pytest.mark.parametrize("kind", ["Convolution", "InnerProduct"])
def test_a_layer_without_bias_takes_one_param_spec_as_caffe(kind):
    """With bias_term false two `param { lr_mult }` blocks had imported (lr_mult for a bias the
    layer does not have); Caffe refuses them. Its bias_filler Caffe leaves unused."""
    block = "convolution_param" if kind == "Convolution" else "inner_product_param"
    params = f"{block} {{ num_output: 2 {'kernel_size: 1 ' * (kind == 'Convolution')}"
    params += "bias_term: false bias_filler { value: 0.2 } }"
    one = _layer("x", kind, ["data"], "x", "param { lr_mult: 2 } " + params)
    layer = translate(parse_prototxt(INPUT + one))["layers"][0]
    assert layer["bias"] is False and layer["lr_mult"] == {"weight": 2.0} and "init" not in layer
    build_model(translate(parse_prototxt(INPUT + one)))
    two = _layer("x", kind, ["data"], "x", "param { lr_mult: 2 } param { lr_mult: 1 } " + params)
    with pytest.raises(ConfigError, match=r"^t:3: 2 param specs for a layer with 1 learned blob "
                       r"\(weight\), as Caffe refuses$"):  # fmt: skip
        translate(parse_prototxt(INPUT + two, "t"), "t")


@pytest.mark.parametrize(("kind", "bottoms"), [("Softmax", ["fc", "data"]), ("Softmax", []),
                                               ("Split", ["fc", "fc"]), ("Split", [])])  # fmt: skip
def test_a_softmax_or_split_takes_exactly_one_bottom(kind, bottoms):
    """A final Softmax of two bottoms had imported silently (its second bottom dropped)."""
    fc = _layer("fc", "InnerProduct", ["data"], "fc", "inner_product_param { num_output: 2 }")
    text = INPUT + fc + _layer("s", kind, bottoms, "s")
    words = f"a {kind} takes one bottom, not 2 \\(as Caffe\\)" if bottoms else "has no bottom"
    with pytest.raises(ConfigError, match=rf"^t:4: layer 's':? {words}$"):
        translate(parse_prototxt(text, "t"), "t")
    assert translate(parse_prototxt(INPUT + fc + _layer("s", kind, ["fc"], "s")))["layers"]


def test_scales_anywhere_and_squeeze_excitation_gates_import():
    """A Scale away from a BatchNorm is a `scale` (a depthwise convolution with its shift);
    SE-BN-Inception's Scale by a second bottom and SENet's Axpy are the gate's product with the
    map (after a reshape of linear outputs to (C, 1, 1)) and its sum with the shortcut."""
    gap = "pooling_param { pool: AVE global_pooling: true }"
    text = INPUT + "".join([
        _layer("c", "Convolution", ["data"], "c", CONV.format(4)),
        _layer("s1", "Scale", ["c"], "s1"),
        _layer("s2", "Scale", ["s1"], "s2", "scale_param { bias_term: true }"),
        _layer("g", "Pooling", ["s2"], "g", gap),
        _layer("fc", "InnerProduct", ["g"], "fc", "inner_product_param { num_output: 4 }"),
        _layer("fc_prob", "Sigmoid", ["fc"], "fc"),
        _layer("by", "Scale", ["s2", "fc"], "by", "scale_param { axis: 0 }"),
        _layer("q", "Convolution", ["g"], "q", CONV.format(4)),
        _layer("q_prob", "Sigmoid", ["q"], "q"),
        _layer("out", "Axpy", ["q", "by", "s2"], "out"),
    ])  # fmt: skip
    model = translate(parse_prototxt(text))
    vectors = INPUT + "".join([
        _layer("g", "Pooling", ["data"], "g", gap),
        _layer("a", "InnerProduct", ["g"], "a", "inner_product_param { num_output: 4 }"),
        _layer("x", "InnerProduct", ["g"], "x", "inner_product_param { num_output: 4 }"),
        _layer("y", "Axpy", ["a", "x", "a"], "y"),
    ])  # fmt: skip
    net = build_model(translate(parse_prototxt(vectors))).eval()
    with torch.no_grad():
        x = torch.randn(2, 3, 8, 8)
        a = net.a(x.mean((2, 3)))
        torch.testing.assert_close(net(x), a * net.x(x.mean((2, 3))) + a)
    assert [(n["name"], n["type"]) for n in model["layers"]] == [
        ("c", "conv"), ("s1", "scale"), ("s2", "conv"), ("g", "adaptive_avgpool"),
        ("fc", "linear"), ("fc_prob", "sigmoid"), ("by_factors", "reshape"), ("by", "mul"),
        ("q", "conv"), ("q_prob", "sigmoid"), ("out_ax", "mul"), ("out", "add")]  # fmt: skip
    net = build_model(model).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p))
        x = torch.randn(2, 3, 8, 8)
        s2 = net.s2(net.c(x) * net.s1.weight)
        assert net.s2.groups == 4 and net.s2.kernel_size == (1, 1)
        g = s2.mean((2, 3), keepdim=True)
        by = s2 * torch.sigmoid(net.fc(g.flatten(1)))[:, :, None, None]
        torch.testing.assert_close(net(x), torch.sigmoid(net.q(g)) * by + s2)
    for layer, words in [
        (_layer("b", "Scale", ["c", "fc"], "b", "scale_param { axis: 1 }"), "axis 0 only"),
        (_layer("b", "Scale", ["c", "fc"], "b", "scale_param { axis: 0 bias_term: true }"),
         "with bias_term is not imported"),
        (_layer("b", "Scale", ["c", "h"], "b", "scale_param { axis: 0 }"),
         r"Scale of \(4, 8, 8\) by \(3\): the factors' shape must be the first"),
        (_layer("b", "Axpy", ["q", "c"], "b"), r"an Axpy takes 3 bottoms \(a, x, y\), not 2"),
        (_layer("b", "Axpy", ["fc", "c", "data"], "b"), "a is one factor per channel of x, and y"),
        (_layer("b", "Axpy", ["fc", "fc", "h"], "b"), r"Axpy of a \(4\), x \(4\) and y \(3\)"),
        (_layer("bn", "BatchNorm", ["fc"], "bn") + _layer("s", "Scale", ["bn"], "s", "scale_param "
         "{ bias_term: true }") + _layer("e", "Eltwise", ["s", "bn"], "e"),
         r"Scale with bias_term of \(4\) features beside another reader of its BatchNorm's"),
        (_layer("s", "Scale", ["fc"], "s", "scale_param { bias_term: true }"),
         r"Scale with bias_term of \(4\) features not right after a BatchNorm"),
        (_layer("b", "Axpy", ["h", "c", "c"], "b"), r"Axpy of a \(3\), x \(4, 8, 8\)"),
    ]:  # fmt: skip
        head = INPUT + "".join([
            _layer("c", "Convolution", ["data"], "c", CONV.format(4)),
            _layer("g", "Pooling", ["c"], "g", gap),
            _layer("fc", "InnerProduct", ["g"], "fc", "inner_product_param { num_output: 4 }"),
            _layer("h", "InnerProduct", ["g"], "h", "inner_product_param { num_output: 3 }"),
            _layer("q", "Convolution", ["g"], "q", CONV.format(4)),
        ])  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            translate(parse_prototxt(head + layer))


def test_a_crop_is_fcns_alignment_of_a_score_map_with_the_image():
    """Caffe's Crop (axis 2): the first bottom cut to the second's height and width from the
    offsets (one for both sides, or top and left); other axes, or 3 offsets, one line."""
    up = ("convolution_param { num_output: 2 kernel_size: 4 stride: 2 bias_term: false "
          "weight_filler { type: 'bilinear' } }")  # fmt: skip
    for offsets, top, left in [
        ("", 0, 0),
        ("offset: 3", 3, 3),
        ("axis: -2 offset: 2 offset: 5", 2, 5),
    ]:
        text = INPUT + _layer("up", "Deconvolution", ["data"], "up", up) + _layer(
            "score", "Crop", ["up", "data"], "score", f"crop_param {{ {offsets} }}")  # fmt: skip
        model = translate(parse_prototxt(text))
        net = build_model(model).eval()
        x = torch.randn(2, 3, 8, 8)
        with torch.no_grad():
            assert torch.equal(net(x), net.up(x)[:, :, top : top + 8, left : left + 8])
        assert model["layers"][-1]["inputs"] == ["up", "input"]
    for params, words in [("crop_param { axis: 1 }", "Crop supports the height and width"),
                          ("crop_param { offset: 1 offset: 2 offset: 3 }", "3 offsets for 2 axes"),
                          ("crop_param { offset: 11 }", r"offset: \[11, 11\]: a 8 x 8 window")]:  # fmt: skip
        text = INPUT + _layer("up", "Deconvolution", ["data"], "up", up) + _layer(
            "score", "Crop", ["up", "data"], "score", params)  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            translate(parse_prototxt(text))
    with pytest.raises(ConfigError, match="a Crop takes 2 bottoms"):
        translate(parse_prototxt(INPUT + _layer("c", "Crop", ["data"], "c")))


def _bnll(x: torch.Tensor) -> torch.Tensor:
    """Caffe's BNLL as its layer computes it, overflow-free: log(1 + exp(x))."""
    return torch.where(x > 0, x + torch.log1p(torch.exp(-x)), torch.log1p(torch.exp(x)))


@pytest.mark.parametrize("kind, params, reference", [
    ("ELU", "elu_param { alpha: 0.5 }", lambda x: F.elu(x, 0.5)),
    ("ELU", "", F.elu),
    ("Swish", "swish_param { beta: 1 }", F.silu),
    ("BNLL", "", _bnll),
    ("Clip", "clip_param { min: 0 max: 6 }", F.relu6),
    ("ReLU6", "", F.relu6),
    ("Power", "power_param { power: 2 scale: 0.5 shift: 1 }", lambda x: (1 + 0.5 * x) ** 2),
    ("Power", "power_param { scale: -3 }", lambda x: -3 * x),
    ("Power", "power_param { power: 2 scale: 0 shift: 3 }", lambda x: torch.full_like(x, 9.0)),
    ("Power", "power_param { power: 0 scale: 2 }", torch.ones_like),
])  # fmt: skip
def test_activations_import_as_caffe_computes_them(kind, params, reference):
    net = build_model(translate(parse_prototxt(INPUT + _layer("a", kind, ["data"], "a", params))))
    x = torch.randn(2, 3, 8, 8) * 8
    with torch.no_grad():
        torch.testing.assert_close(net.eval()(x), reference(x))


@pytest.mark.parametrize("kind, params, words", [
    ("Swish", "swish_param { beta: 2 }", "Swish beta 2: only beta 1"),
    ("Clip", "clip_param { min: -1 max: 1 }", r"Clip from -1 to 1: only 0 to 6 \(ReLU6\)"),
    ("Clip", "clip_param { min: 0 }", r"Clip needs min and max \(as Caffe\)"),
    ("Power", "power_param { exponent: 2 }", "'exponent' is not a field of Caffe's power_param"),
])  # fmt: skip
def test_activations_caffe_computes_otherwise_are_one_line(kind, params, words):
    with pytest.raises(ConfigError, match=words):
        translate(parse_prototxt(INPUT + _layer("a", kind, ["data"], "a", params)))


def _caffe_shuffle(x: torch.Tensor, group: int) -> torch.Tensor:
    """ShuffleNet's Caffe ShuffleChannel as its layer's loop copies it: the input's channel
    row * columns + column (`group` rows) becomes the output's column * group + row."""
    out, columns = torch.empty_like(x), x.shape[1] // group
    for row in range(group):
        for column in range(columns):
            out[:, column * group + row] = x[:, row * columns + column]
    return out


def test_the_shufflenet_ports_shuffle_channel_is_torchs_channel_shuffle():
    """ShuffleNet v1 and v2's Caffe ports: ShuffleChannel after a Concat, then a Slice of the
    shuffled channels (v2's split); the output as Caffe's loop computes it and as torch's."""
    body = _layer("c", "Convolution", ["data"], "c", CONV.format(9)) + _layer(
        "cat", "Concat", ["c", "data"], "cat") + _layer(
        "shuffle", "ShuffleChannel", ["cat"], "shuffle", "shuffle_channel_param { group: 3 }") + (
        'layer { name: "split" type: "Slice" bottom: "shuffle" top: "a" top: "b" '
        "slice_param { slice_point: 6 } }\n") + _layer("add", "Eltwise", ["a", "b"], "y")  # fmt: skip
    model = translate(parse_prototxt(INPUT + body))
    assert model["layers"][2] == {"name": "shuffle", "type": "channel_shuffle", "groups": 3}
    net = build_model(model).eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        cat = torch.cat([net.c(x), x], 1)
        expected = _caffe_shuffle(cat, 3)
        torch.testing.assert_close(expected, nn.ChannelShuffle(3)(cat), rtol=0, atol=0)
        torch.testing.assert_close(net(x), expected[:, :6] + expected[:, 6:], rtol=0, atol=0)
    for params in ("", "shuffle_channel_param { group: 9 }"):  # 1 or 9 rows of 9: the same order
        same = INPUT + _layer("c", "Convolution", ["data"], "c", CONV.format(9)) + _layer(
            "s", "ShuffleChannel", ["c"], "s", params) + _layer("r", "ReLU", ["s"], "r")  # fmt: skip
        assert [layer["type"] for layer in translate(parse_prototxt(same))["layers"]] == [
            "conv", "relu"]  # fmt: skip


@pytest.mark.parametrize("params, words", [
    ("shuffle_channel_param { group: 2 }", r"groups: must divide the channels .* \(3, 8, 8\)"),
    ("shuffle_channel_param { group: 0 }", "ShuffleChannel group 0: must be 1 or more"),
    ("shuffle_channel_param { groups: 3 }", "'groups' is not a field of Caffe's "
     "shuffle_channel_param.*group"),
])  # fmt: skip
def test_a_shuffle_channel_caffe_would_refuse_is_one_line(params, words):
    with pytest.raises(ConfigError, match=words):
        translate(parse_prototxt(INPUT + _layer("s", "ShuffleChannel", ["data"], "s", params)))


def _hard_sigmoid(name: str, bottom: str) -> str:
    """MobileNet v3's Caffe ports' hard sigmoid: Power (+3), ReLU6, Power (/6); top NAME_c."""
    plus, by = "power_param { power: 1 scale: 1 shift: 3 }", "power_param { scale: 0.16666667 }"
    return (_layer(f"{name}_a", "Power", [bottom], f"{name}_a", plus)
            + _layer(f"{name}_b", "ReLU6", [f"{name}_a"], f"{name}_b")
            + _layer(f"{name}_c", "Power", [f"{name}_b"], f"{name}_c", by))  # fmt: skip


def test_mobilenet_v3_ports_hard_swish_and_gate_from_power_and_relu6_are_torchs():
    """MobileNet v3's Caffe ports: hard-swish as a hard sigmoid times its input (an Eltwise
    PROD); the squeeze-excitation gate a hard sigmoid between Concats of one bottom (which
    Caffe passes through), applied by a Scale of axis 0; the forks' DepthwiseConvolution."""
    depthwise = "convolution_param { num_output: 4 kernel_size: 3 pad: 1 bias_term: false }"
    pool = "pooling_param { pool: AVE global_pooling: true }"
    fc, prod = "inner_product_param { num_output: 4 }", "eltwise_param { operation: PROD }"
    body = (_layer("c", "Convolution", ["data"], "c", CONV.format(4)) + _hard_sigmoid("hs", "c")
            + _layer("swish", "Eltwise", ["c", "hs_c"], "swish", prod)
            + _layer("dw", "DepthwiseConvolution", ["swish"], "dw", depthwise)
            + _layer("pool", "Pooling", ["dw"], "pool", pool)
            + _layer("route1", "Concat", ["pool"], "route1")
            + _layer("fc", "InnerProduct", ["route1"], "fc", fc)
            + _hard_sigmoid("gate", "fc") + _layer("route2", "Concat", ["gate_c"], "route2")
            + _layer("se", "Scale", ["dw", "route2"], "se", "scale_param { axis: 0 }")
            + _layer("still", "Power", ["se"], "out", "power_param { power: 1 }"))  # fmt: skip
    model = translate(parse_prototxt(INPUT + body))
    kinds = [layer["type"] for layer in model["layers"]]
    assert kinds.count("power") == 4 and "concat" not in kinds and kinds[-1] == "mul"
    assert model["layers"][1] == {"name": "hs_a", "type": "power", "shift": 3.0}
    net = build_model(model).eval()
    x = torch.randn(2, 3, 8, 8) * 4
    with torch.no_grad():
        swish = F.hardswish(net.c(x))
        dw = F.conv2d(swish, net.dw.weight, None, 1, 1, 1, 4)
        gate = F.hardsigmoid(net.fc(dw.mean((2, 3))))
        torch.testing.assert_close(net(x), dw * gate[:, :, None, None])


def test_a_legacy_bare_input_is_stripped_and_a_placeholder_size_is_said():
    """`input: "data"` with no dims beside an Input layer is stripped, as Caffe's
    UpgradeNetInput does; OpenPose's 1 x 1 placeholder input gets a note, not a flatten."""
    layer = ('layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 '
             "dim: 8 dim: 8 } } }\n")  # fmt: skip
    body = _layer("c", "Convolution", ["data"], "c", CONV.format(4))
    assert translate(parse_prototxt('input: "data"\n' + layer + body))["input"] == [3, 8, 8]
    with pytest.raises(ConfigError, match=r"^t:2: input 'data' has no dims \(input_dim or "
                       r"input_shape\) and no Input layer gives it$"):  # fmt: skip
        translate(parse_prototxt('input: "data"\n' + body, "t"), "t")
    one = Translator(parse_prototxt(INPUT.replace("dim: 8 input_dim: 8", "dim: 1 input_dim: 1")
                                    + body), "t")  # fmt: skip
    assert [layer["type"] for layer in one.run()["layers"]] == ["conv"]  # (4, 1, 1): no flatten
    assert one.notes == ["input 1 x 1: a placeholder for the size the net runs at? Set input: "
                         "[C, H, W] here to that size (or import with --input-size H,W)"]  # fmt: skip


def test_input_size_replaces_a_placeholder_or_the_prototxts_size(tmp_path, capsys):
    """--input-size H,W: the net at the size it runs at (OpenPose's 1 x 1 placeholders, a fully
    convolutional net), said in the header; anything but one or two sides is one line."""
    proto = tmp_path / "fcn.prototxt"
    proto.write_text(INPUT.replace("dim: 8 input_dim: 8", "dim: 1 input_dim: 1")
                     + _layer("c", "Convolution", ["data"], "c", CONV.format(4)))  # fmt: skip
    out = tmp_path / "fcn.yaml"
    assert run_cli(["import-caffe", str(proto), "--input-size", "24,32", "-o", str(out)]) == 0
    assert "output 4x24x32" in capsys.readouterr().out
    text = out.read_text()
    assert (
        "# input 24 x 32 (--input-size; the prototxt's: 1 x 1)" in text
        and "placeholder" not in text
    )
    assert build_model(str(out), device="meta").input_shape == (3, 24, 32)
    for bad in ("3x4x5", "abc", "0", "9000"):
        assert run_cli(["import-caffe", str(proto), "--input-size", bad]) == 2
        assert f"--input-size '{bad}': expected H,W (or one side)" in capsys.readouterr().err


def test_a_prototxt_saved_with_a_byte_order_mark_is_read(tmp_path):
    """Windows editors save UTF-8 with a byte-order mark: it was read as part of the first
    field's name ("cannot read '\\ufeffname: ...'")."""
    text = (DATA / "lenet.prototxt").read_text()
    marked = tmp_path / "bom.prototxt"
    marked.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert import_caffe(marked) == import_caffe(DATA / "lenet.prototxt")
