"""import-caffe: the prototxt parser, the translation of every layer type (checked against
torch.nn and a direct implementation of Caffe's pooling) and Caffe's published nets' sizes."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from cnnkit import ConfigError, build_model
from cnnkit.caffe import import_caffe, network_yaml, parse_prototxt, translate
from cnnkit.caffe.translate import read_caffe

DATA = Path(__file__).parent / "data" / "caffe"


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_parser_reads_nesting_lists_comments_and_lines():
    msg = parse_prototxt(
        'name: "n"  # comment\nlayer {\n  top: "a" top: \'b\'\n  p: { x: [1, 2.5e-1, -3] y: TRUE_ENUM }\n  flag: true\n}\n'
    )
    layer = msg.get("layer")
    assert msg.get("name") == "n" and layer.line == 2
    assert layer.all("top") == ["a", "b"] and layer.get("flag") is True
    assert layer.sub("p").all("x") == [1, 0.25, -3] and layer.sub("p").get("y") == "TRUE_ENUM"
    with pytest.raises(ConfigError, match=r"x:3: expected a value"):
        parse_prototxt("a: 1\nb {\n c: }\n}", "x")
    with pytest.raises(ConfigError, match="missing '}'"):
        parse_prototxt("a {\n b: 1\n")


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


def _layer(name, kind, bottoms, top, params=""):
    bottom = " ".join(f'bottom: "{b}"' for b in bottoms)
    return f'layer {{ name: "{name}" type: "{kind}" {bottom} top: "{top}" {params} }}\n'


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


@pytest.mark.parametrize("kind", ["Data", "Accuracy", "SoftmaxWithLoss"])
def test_a_train_val_prototxt_points_at_the_deploy_one(tmp_path, kind):
    prototxt = tmp_path / "train_val.prototxt"
    prototxt.write_text(f'layer {{ name: "x" type: "{kind}" top: "x" }}\n')
    with pytest.raises(ConfigError, match=r"'x' has type '\w+', which cnnkit cannot import \(a "
                                          r"train_val prototxt\? give the deploy.prototxt"):  # fmt: skip
        import_caffe(prototxt)


def test_eltwise_coefficients_are_refused_saying_so(tmp_path):
    prototxt = tmp_path / "el.prototxt"
    prototxt.write_text(
        'layer { name: "d" type: "Input" top: "d" input_param { shape { dim: 1 dim: 3 dim: 4 '
        'dim: 4 } } }\nlayer { name: "e" type: "Eltwise" bottom: "d" bottom: "d" top: "e" '
        "eltwise_param { coeff: 1 coeff: -1 } }\n"
    )
    with pytest.raises(ConfigError, match="coeff other than 1 is not imported"):
        import_caffe(prototxt)


def test_unsupported_type_names_type_and_line():
    with pytest.raises(ConfigError) as err:
        import_caffe(DATA / "unsupported.prototxt")
    assert "unsupported.prototxt:7:" in str(err.value) and "'Crop'" in str(err.value)


def test_softmax_in_the_middle_and_missing_bottom_are_errors():
    base = 'input: "data" input_dim: 1 input_dim: 3 input_dim: 4 input_dim: 4\n'
    soft = _layer("s", "Softmax", ["data"], "s") + _layer("f", "Flatten", ["s"], "f")
    with pytest.raises(ConfigError, match=":2: Softmax is supported only as the last"):
        translate(parse_prototxt(base + soft))
    with pytest.raises(ConfigError, match="bottom 'nope' is not produced"):
        translate(parse_prototxt(base + _layer("f", "Flatten", ["nope"], "f")))


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
    assert err.count("\n") == 1 and "'Crop'" in err


INPUT = 'input: "data"\ninput_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8\n'


def test_parser_caps_nesting_depth():
    with pytest.raises(ConfigError, match=r"x:1: blocks nested more than 100 deep"):
        parse_prototxt("a {" * 5000 + "}" * 5000, "x")
    with pytest.raises(ConfigError, match=r"x:1: a list inside a list"):
        parse_prototxt("a: " + "[" * 5000 + "]" * 5000, "x")
    assert parse_prototxt("a {" * 100 + "b: 1" + "}" * 100).sub("a").line == 1


def test_phase_rules_as_caffe_reads_them_for_deploy():
    def conv(name, n, rule=""):
        return _layer(name, "Convolution", ["data"], "feat", f"{rule} " + CONV.format(n))

    text = (
        INPUT + conv("a", 4, "exclude { phase: TEST }") + conv("b", 5, "exclude { phase: TRAIN }")
    )
    text += conv("c", 7, "include { phase: TRAIN }") + conv(
        "d", 9, "include { phase: TEST stage: 'x' }"
    )
    text += _layer("fc", "InnerProduct", ["feat"], "fc", "inner_product_param { num_output: 2 }")
    text += _layer("prob", "Softmax", ["fc"], "prob")  # last of the TEST phase: dropped
    text += _layer("loss", "SoftmaxWithLoss", ["fc", "label"], "loss", "include { phase: TRAIN }")
    layers = translate(parse_prototxt(text))["layers"]
    assert [(n["name"], n.get("out_channels")) for n in layers] == [("b", 5), ("fc", None)]
    with pytest.raises(ConfigError, match=r":3: give include or exclude rules, not both"):
        translate(parse_prototxt(INPUT + conv("a", 4, "include {} exclude { phase: TRAIN }")))


CONV = "convolution_param {{ num_output: {} kernel_size: 1 }}"
BAD_FIELDS = {
    "kernel_h: 3": r"kernel_h and kernel_w go together",
    'kernel_size: "abc"': r"kernel_size: expected an integer, got 'abc'",
    "kernel_size: 3 num_output: xyz": r"num_output: expected an integer, got 'xyz'",
    "kernel_size: 3 num_output: 4.7": r"num_output: expected an integer, got 4.7",
    "kernel_size: 3 num_output: 4 bias_term: 'false'": r"bias_term: expected true or false",
    "kernel_size: 3 num_output: 4 bias_term: 2": r"bias_term: expected true or false, got 2",
    "kernel_size: 3 num_output: 4 pad: -1": r"padding.* greater than or equal to 0 \(got -1\)",
    "kernel_size: 3 num_output: 0": r"out_channels: Input should be greater than 0 \(got 0\)",
}


@pytest.mark.parametrize("fields", BAD_FIELDS)
def test_bad_field_values_are_one_line(fields):
    text = INPUT + _layer("c", "Convolution", ["data"], "c", f"convolution_param {{ {fields} }}")
    with pytest.raises(ConfigError, match=BAD_FIELDS[fields]) as err:
        translate(parse_prototxt(text, "t"), "t")
    assert str(err.value).startswith("t:3: ") and "\n" not in str(err.value)


UNKNOWN_OR_UNFOLLOWED = {  # Caffe's parser refuses unknown fields: a typo must not import
    ("Convolution", "convolution_param { num_output: 4 kernel_size: 3 stirde: 2 }"):
        r"'stirde' is not a field of Caffe's convolution_param \(did you mean 'stride'\?\)",
    ("Convolution", "convolution_param { num_output: 4 kernel_size: 3 weight_filler { stdd: 1 } }"):
        r"'stdd' is not a field of Caffe's weight_filler \(did you mean 'std'\?\)",
    ("Convolution", "botom: 'x' convolution_param { num_output: 4 kernel_size: 3 }"):
        r"'botom' is not a field of Caffe's layer \(did you mean 'bottom'\?\)",
    ("Convolution", "param { lr_mul: 2 } convolution_param { num_output: 4 kernel_size: 3 }"):
        r"'lr_mul' is not a field of Caffe's param \(did you mean 'lr_mult'\?\)",
    ("Convolution", "param { name: 'w' } convolution_param { num_output: 4 kernel_size: 3 }"):
        r"param \{ name: 'w' \}: weights shared between layers are not imported",
    ("Pooling", "pooling_param { pool: MAX kernel_size: 2 strid: 2 }"):
        r"'strid' is not a field of Caffe's pooling_param",
    ("Dropout", "dropout_param { scale_train: false }"): r"scale_train: false scales at test time",
    ("BatchNorm", "batch_norm_param { use_global_stats: false }"):
        r"use_global_stats: false normalises with each test batch",
    ("LRN", "lrn_param { local_size: 4 }"): r"LRN local_size 4: Caffe takes odd sizes only",
    ("LRN", "lnr_param { local_size: 3 alpha: 0.5 }"):  # had imported Caffe's defaults
        r"'lnr_param' is not a field of Caffe's layer \(did you mean 'lrn_param'\?\)",
    ("ReLU", "rleu_param { negative_slope: 0.1 }"):  # had lost the leaky slope
        r"'rleu_param' is not a field of Caffe's layer \(did you mean 'relu_param'\?\)",
}  # fmt: skip


@pytest.mark.parametrize(("kind", "params"), UNKNOWN_OR_UNFOLLOWED)
def test_unknown_fields_and_unfollowed_values_are_one_line(kind, params):
    text = INPUT + _layer("c", kind, ["data"], "c", params)
    with pytest.raises(ConfigError, match=UNKNOWN_OR_UNFOLLOWED[kind, params]) as err:
        translate(parse_prototxt(text, "t"), "t")
    assert str(err.value).startswith("t:") and "\n" not in str(err.value)


def test_a_misspelled_top_level_field_is_refused_not_dropped():
    """`layr { }` had imported without the layer (a ReLU gone), exit 0."""
    relu = _layer("r", "ReLU", ["data"], "r").replace("layer {", "layr {", 1)
    with pytest.raises(ConfigError, match=r"'layr' is not a field of Caffe's NetParameter "
                       r"\(did you mean 'layer'\?\)"):  # fmt: skip
        translate(parse_prototxt(INPUT + relu, "t"), "t")
    with pytest.raises(ConfigError, match=r"'inptu_dim' is not a field"):
        translate(parse_prototxt(INPUT.replace("input_dim", "inptu_dim", 1) + relu, "t"), "t")
    fork = _layer("c", "ReLU", ["data"], "c", "my_fork_param { x: 1 }")  # a fork's own block
    assert translate(parse_prototxt(INPUT + fork, "t"), "t")["layers"][0]["type"] == "relu"
    up = _layer("u", "Upsample", ["data"], "u", "upsample_param { scale: 2 }")  # a fork's layer:
    with pytest.raises(ConfigError, match=r"has type 'Upsample', which cnnkit cannot import"):
        translate(parse_prototxt(INPUT + up, "t"), "t")  # its type, not 'did you mean scale_param'
    typo = _layer("r", "ReLU", ["data"], "r").replace("type:", "tpye:")
    with pytest.raises(ConfigError, match=r"'tpye' is not a field of Caffe's layer"):
        translate(parse_prototxt(INPUT + typo, "t"), "t")


def test_the_old_syntax_keeps_blobs_lr_and_weight_decay_and_refuses_shared_weights():
    head = 'input: "data" input_dim: 1 input_dim: 3 input_dim: 9 input_dim: 9\n'
    conv = ('layers {{ name: "c" type: CONVOLUTION bottom: "data" top: "c" {} '
            "convolution_param {{ num_output: 4 kernel_size: 3 }} }}\n")  # fmt: skip
    model = translate(
        parse_prototxt(
            head + conv.format("blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0")
        )
    )
    layer = model["layers"][0]
    assert layer["lr_mult"] == {"weight": 1.0, "bias": 2.0}
    assert layer["decay_mult"] == {"weight": 1.0, "bias": 0.0}
    with pytest.raises(ConfigError, match="shares weights between layers"):
        translate(parse_prototxt(head + conv.format('param: "w1" param: "b1"')))


CAFFE_SIZE_RULES = {  # Caffe's own checks (base_conv_layer.cpp, pooling_layer.cpp)
    ("Convolution", "stride_h: 2"): r"stride_h and stride_w go together",
    ("Convolution", "stride: 2 stride_h: 2 stride_w: 2"): r"give stride or stride_h \+ stride_w",
    ("Convolution", "kernel_size: 1 kernel_h: 3 kernel_w: 3"): r"give kernel_size or kernel_h",
    ("Pooling", "pad_h: 1"): r"pad_h and pad_w go together",
}


@pytest.mark.parametrize(("kind", "fields"), CAFFE_SIZE_RULES)
def test_caffe_size_fields_follow_caffes_rules(kind, fields):
    if kind == "Convolution":
        params = f"convolution_param {{ num_output: 4 kernel_size: 3 {fields} }}"
        params = params.replace("kernel_size: 3 kernel_size: 1", "kernel_size: 1")
    else:
        params = f"pooling_param {{ pool: MAX kernel_size: 2 stride: 2 {fields} }}"
    text = INPUT + _layer("x", kind, ["data"], "x", params)
    with pytest.raises(ConfigError, match=CAFFE_SIZE_RULES[kind, fields]):
        translate(parse_prototxt(text))
    # a convolution's pad_h alone is Caffe's (pad_w defaults to 0 there): (8+2-3)+1 x (8-3)+1
    conv = "convolution_param { num_output: 4 kernel_size: 3 pad_h: 1 }"
    model = translate(parse_prototxt(INPUT + _layer("c", "Convolution", ["data"], "c", conv)))
    assert model["layers"][0]["padding"] == [1, 0]
    assert build_model(model)(torch.zeros(1, 3, 8, 8)).shape == (1, 4, 8, 6)


@pytest.mark.parametrize("axes", ["", "axis: -3", "axis: 0", "num_axes: 2", "num_axes: 0"])
def test_scale_after_batchnorm_is_per_channel_only(axes):
    text = INPUT + _layer("bn", "BatchNorm", ["data"], "bn")
    text += _layer("sc", "Scale", ["bn"], "bn", f"scale_param {{ bias_term: true {axes} }}")
    if axes in ("", "axis: -3"):  # channel axis of (N, C, H, W), counted either way
        assert translate(parse_prototxt(text))["layers"][0]["affine"] is True
        return
    with pytest.raises(ConfigError, match=r":4: Scale supports one factor per channel only"):
        translate(parse_prototxt(text))


def test_bad_layers_and_inputs_are_one_line():
    sub = _layer("x", "Eltwise", ["data", "data"], "x", "eltwise_param { operation: SUB }")
    with pytest.raises(ConfigError, match=r":3: Eltwise operation 'SUB': SUM, PROD or MAX"):
        translate(parse_prototxt(INPUT + sub))
    flat = 'input: "data"\ninput_dim: 1 input_dim: 6\n'
    pool = _layer("p", "Pooling", ["data"], "p", "pooling_param { pool: MAX global_pooling: true }")
    with pytest.raises(ConfigError, match=r":3: global_pooling needs a \(C, H, W\) input"):
        translate(parse_prototxt(flat + pool))
    with pytest.raises(ConfigError, match=r":1: dim: expected an integer, got 3.5"):
        translate(parse_prototxt(INPUT.replace("input_dim: 3", "input_dim: 3.5") + pool))


NOT_BLOCKS = {
    'input: "data"\ninput_shape: 3\n': r"t:2: input_shape: expected a \{ ... \} block, got 3",
    INPUT + "layer: 3\n": r"t:3: layer: expected a \{ ... \} block, got 3",
    'layer { name: "d" type: "Input" top: "data" input_param { shape: 3 } }':
        r"t:1: shape: expected a \{ ... \} block, got 3",
    INPUT + _layer("p", "PReLU", ["data"], "p", "prelu_param { filler: 3 }"):
        r"t:3: filler: expected a \{ ... \} block, got 3",
    INPUT + _layer("p", "ReLU", ["data"], "p", "param: 3"):
        r"t:3: param: expected a \{ ... \} block, got 3",
}  # fmt: skip


@pytest.mark.parametrize("text", NOT_BLOCKS)
def test_a_value_where_caffe_declares_a_block_is_one_line(text):
    with pytest.raises(ConfigError, match=NOT_BLOCKS[text]):
        translate(parse_prototxt(text, "t"), "t")


def test_pooling_round_mode_is_caffes_or_refused():
    def ceil(mode):
        p = f"pooling_param {{ pool: MAX kernel_size: 3 stride: 2 round_mode: {mode} }}"
        layer = translate(parse_prototxt(INPUT + _layer("p", "Pooling", ["data"], "p", p)))
        return layer["layers"][0]["ceil_mode"]

    assert [ceil(m) for m in ("CEIL", "FLOOR", "0", "1")] == [True, False, True, False]
    with pytest.raises(ConfigError, match=r":3: pooling_param round_mode: 'CIEL' is not CEIL"):
        ceil("CIEL")  # a typo must not import as floor: the output would be smaller


def test_a_mistyped_pooling_or_layer_type_is_named_with_the_one_meant():
    def pooling(method, kind="Pooling"):
        p = f"pooling_param {{ pool: {method} kernel_size: 3 stride: 2 }}"
        translate(parse_prototxt(INPUT + _layer("p", kind, ["data"], "p", p)))

    with pytest.raises(ConfigError, match=r":3: pool: MAXX is not MAX or AVE$"):
        pooling("MAXX")
    with pytest.raises(ConfigError, match=r"is not MAX or AVE \(stochastic pooling is not imp"):
        pooling("STOCHASTIC")
    with pytest.raises(ConfigError, match=r"type 'Poolng', .* \(did you mean 'Pooling'\?\)$"):
        pooling("MAX", kind="Poolng")


def test_strings_are_utf8_with_c_escapes():
    names = [r'"conv_\303\251"', r'"conv_\x41"', '"conv_é"', r'"a\"b"']
    message = parse_prototxt(" ".join(f"name: {n}" for n in names))
    assert message.all("name") == ["conv_é", "conv_A", "conv_é", 'a"b']
    with pytest.raises(ConfigError, match=r"t:2: the string .* does not decode"):
        parse_prototxt('\nname: "\\xZZ"', "t")


def test_booleans_are_protobuf_identifiers_or_0_and_1():
    for value, bias in (("false", False), ("true", True), ("0", False), ("1", True)):
        p = f"convolution_param {{ num_output: 4 kernel_size: 3 bias_term: {value} }}"
        layers = translate(parse_prototxt(INPUT + _layer("c", "Convolution", ["data"], "c", p)))
        assert layers["layers"][0].get("bias", True) is bias


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


def test_a_sparse_gaussian_filler_is_dense_and_said_so(tmp_path):
    conv = "convolution_param {{ num_output: 4 kernel_size: 1 weight_filler {{ {} }} }}"
    prototxt = tmp_path / "n.prototxt"
    prototxt.write_text(INPUT + _layer("c", "Convolution", ["data"], "c",
                                       conv.format("type: 'gaussian' std: 0.1 sparse: 2")))  # fmt: skip
    notes = read_caffe(prototxt).notes
    assert notes == [f"{prototxt}:3: the gaussian filler's sparse 2 is not followed: dense here"]
    prototxt.write_text(INPUT + _layer("c", "Convolution", ["data"], "c",
                                       conv.format("type: 'uniform' sparse: 2")))  # fmt: skip
    with pytest.raises(ConfigError, match=r":3: filler sparse: 2 \(Caffe takes it for a gaussian"):
        read_caffe(prototxt)
