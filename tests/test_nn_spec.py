"""The network file: blocks, repeat, inputs, defaults, num_classes, and every error it reports."""

import re
import textwrap

import pytest
import torch

from cnnkit import ConfigError, build_model
from cnnkit.data.base import Preprocess
from cnnkit.nn.yamlio import layer_line


def net(*layers, **extra):
    return {"input": [3, 8, 8], "layers": list(layers), **extra}


def conv(name=None, **kw):
    layer = {"type": "conv", "out_channels": 4, "kernel_size": 3, "padding": 1, **kw}
    return {"name": name, **layer} if name else layer


def test_blocks_repeat_with_parameters_and_names():
    spec = net(
        conv("stem"),
        {"name": "stage", "block": "res", "channels": 4, "repeat": 3},
        {"name": "head", "type": "linear", "out_features": 2},
        blocks={
            "res": {
                "params": {"channels": None},
                "layers": [
                    {
                        "name": "c",
                        "type": "conv",
                        "out_channels": "$channels",
                        "kernel_size": 3,
                        "padding": 1,
                    },
                    {"name": "sum", "type": "add", "inputs": ["c", "input"]},
                ],
            }
        },
    )
    model = build_model(spec)
    names = [row.name for row in model.table]
    assert names[:3] == ["stem", "stage.0.c", "stage.0.sum"] and "stage.2.sum" in names
    assert model.table[2].inputs == ("stage.0.c", "stem")
    assert model.table[4].inputs == ("stage.1.c", "stage.0.sum")  # repetitions chain
    assert "stage.1.c.weight" in model.state_dict()
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 2)


def test_residual_dag_computes_what_it_says():
    spec = net(conv("a"), conv("b"), {"name": "sum", "type": "add", "inputs": ["b", "a"]})
    model = build_model(spec).eval()
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model.b(model.a(x)) + model.a(x))


def test_num_classes_from_argument_and_defaults_by_type():
    spec = net(conv(), {"type": "linear"}, defaults={"conv": {"bias": False}})
    model = build_model(spec, num_classes=7)
    assert model.output_shape == (7,) and model.conv0.bias is None


def test_init_rules():
    spec = net(
        conv("a", init={"weight": {"normal": 0.5}, "bias": 0.25}),
        conv("b", init={"weight": "zeros", "bias": {"uniform": [1, 2]}}),
    )
    torch.manual_seed(0)
    model = build_model(spec)
    assert abs(model.a.weight.std().item() - 0.5) < 0.1 and torch.all(model.a.bias == 0.25)
    assert torch.all(model.b.weight == 0) and torch.all((model.b.bias >= 1) & (model.b.bias <= 2))
    # reset_parameters: every layer anew, PyTorch's default where no rule is given
    model = build_model(net(conv("a", init={"bias": 0.25}), conv("b"), {"type": "batchnorm"}))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7)
    model.reset_parameters()
    assert not any((p == 7).any() for p in model.parameters())
    assert torch.all(model.a.bias == 0.25) and torch.all(model.batchnorm2.weight == 1)


def test_kaimings_a_is_torchs_leaky_relu_slope():
    """`{kaiming_uniform: {a: sqrt(5)}}` is torch's own default for Conv2d written out: the
    same bound, as nn.init.kaiming_uniform_(w, a=sqrt(5)) gives (its nonlinearity defaults to
    leaky_relu, whose slope `a` is)."""
    import math

    spec = net(
        conv("a", out_channels=64, init={"weight": {"kaiming_uniform": {"a": math.sqrt(5)}}})
    )
    weight = build_model(spec).a.weight
    bound = 1 / math.sqrt(3 * 3 * 3)  # torch's Conv2d default: U(+-1 / sqrt(fan_in))
    assert bound * 0.9 < weight.abs().max().item() <= bound


BAD = [
    (
        net({"type": "convv", "out_channels": 4, "kernel_size": 3}),
        "layer 0: type: unknown type 'convv' (did you mean 'conv'?)",
    ),
    (net({"type": None}), "layer 0: type: missing"),  # (not `layer 0 (None0)`)
    (net({"typ": "conv"}), "layer 0: type: missing (is 'typ' meant to be type?)"),
    (net({"name": "x", "type": "convv"}), "layer 0 (x): type: unknown type 'convv'"),
    (net({"type": "conv", "kernel_size": 3}), "layer 0 (conv0): out_channels: Field required"),
    (net(conv(kernal_size=3)), "layer 0 (conv0): kernal_size: unknown field"),
    (  # the typo, not the required field it left out, and the field meant
        net({"type": "conv", "out_channels": 4, "kernal_size": 3}),
        "layer 0 (conv0): kernal_size: unknown field (did you mean 'kernel_size'?)",
    ),
    (net(conv(stirde=2)), "layer 0 (conv0): stirde: unknown field (did you mean 'stride'?)"),
    (net(conv(), num_clases=3), "model: num_clases: unknown field (did you mean 'num_classes'?)"),
    (  # a list where a number or a pair goes: what is wrong with it as a pair
        net(conv(padding=[1, 2, 3])),
        "layer 0 (conv0): padding: takes 2 values, not 3 (got [1, 2, 3])",
    ),
    (net(conv(padding=[1])), "layer 0 (conv0): padding: takes 2 values, not 1 (got [1])"),
    (  # or with an item of it
        net(conv(stride=[0, 1])),
        "layer 0 (conv0): stride.0: Input should be greater than 0 (got 0)",
    ),
    (
        net(conv(out_channels="four")),
        "layer 0 (conv0): out_channels: Input should be a valid integer",
    ),
    (
        net(conv("big", kernel_size=11, padding=0)),
        "layer 0 (big): kernel_size: kernel 11 is larger than its input 8",
    ),
    (
        net(
            {"name": "p", "type": "maxpool", "kernel_size": 2, "stride": 2},
            {"name": "q", "type": "maxpool", "kernel_size": 2, "stride": 4},
            {"name": "r", "type": "maxpool", "kernel_size": 3, "padding": 1, "stride": 9},
            {"name": "s", "type": "maxpool", "kernel_size": 2},
        ),
        "layer 3 (s): kernel_size: kernel 2 is larger than its input 1",
    ),
    (net(conv("a", inputs=["nope"])), "layer 0 (a): inputs: unknown layer 'nope'"),
    (
        net(conv("a", inputs=["b"]), conv("b")),
        "layer 0 (a): inputs: 'b' comes later; inputs may only name earlier layers",
    ),
    (net(conv("a", inputs=["a"])), "layer 0 (a): inputs: names itself (a cycle)"),
    (
        net(
            conv("a"), conv("b", out_channels=5), {"name": "s", "type": "add", "inputs": ["a", "b"]}
        ),
        "layer 2 (s): inputs: shapes differ: (4, 8, 8) vs (5, 8, 8)",
    ),
    (
        net(
            conv("a"),
            {"name": "f", "type": "flatten"},
            {"name": "c", "type": "concat", "inputs": ["a", "f"]},
        ),
        "layer 2 (c): inputs: only channels may differ",
    ),
    (net(conv("a"), conv("a")), "layer 1 (a): name: 'a' is used twice"),
    (
        net(conv("a", groups=3)),
        "layer 0 (a): groups: groups=3 must divide both in_channels=3 and out_channels=4",
    ),
    (
        net({"type": "linear"}),
        "layer 0 (linear0): out_features: is not set and the network has no num_classes",
    ),
    (
        net({"name": "l", "type": "lrn", "size": 5}),
        "layer 0 (l): convention: required: paper or caffe",
    ),
    (net({"name": "u", "block": "nope"}), "layer 0 (u): block: unknown block 'nope'"),
    (
        net(conv("a", init={"weight": {"gaussian": 1}})),
        "layer 0 (a): init: unknown init 'gaussian'",
    ),
    (
        net(conv("a", init={"weight": {"kaiming_normal": {"mode": 5}}})),
        "layer 0 (a): init: init 'kaiming_normal': mode is fan_in or fan_out, not 5",
    ),
    (
        net(conv("a", init={"weight": {"kaiming_uniform": {"nonlinearity": "gelu"}}})),
        "layer 0 (a): init: init 'kaiming_uniform': nonlinearity 'gelu' is not one of torch's",
    ),
    (net(conv("a", lr_mult={"bais": 2})), "layer 0 (a): lr_mult: names ['bais']"),
    (  # numbers become float32: a larger one overflowed when the layer was built or run
        net({"name": "r", "type": "leaky_relu", "negative_slope": 1e300}),
        "layer 0 (r): negative_slope: 1e+300 is beyond float32's range (+-3.4e38)",
    ),
    (
        net(conv("a", init={"weight": 1e300})),
        "layer 0 (a): init: init 'constant': value 1e+300 is beyond float32's range",
    ),
    ({"input": [3, 8], "layers": [conv()]}, "model: input: give [C, H, W]"),
    ({"input": [3, 8, 8], "layers": []}, "model: layers: must not be empty"),
    ({"input": [3, 8, 8]}, "no 'layers' list"),
]


@pytest.mark.parametrize("spec, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_network_gives_one_clear_line(spec, message):
    with pytest.raises(ConfigError) as e:
        build_model(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_block_parameter():
    spec = net(
        {"name": "b", "block": "blk", "chanels": 4},
        blocks={"blk": {"params": {"channels": 4}, "layers": [conv(out_channels="$channels")]}},
    )
    with pytest.raises(
        ConfigError, match="block 'blk' has no parameter 'chanels' \\(it takes channels\\)"
    ):
        build_model(spec)


def test_bad_files(tmp_path):
    not_yaml = tmp_path / "net.yaml"
    not_yaml.write_text("model: {input: [3, 8, 8], layers: [\n")
    with pytest.raises(ConfigError, match="net.yaml: not valid YAML \\(line"):
        build_model(not_yaml)
    binary = tmp_path / "img.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(ConfigError, match="img.yaml"):
        build_model(binary)
    with pytest.raises(ConfigError, match="neither a zoo network"):
        build_model(str(tmp_path / "missing.yaml"))
    for text in ("", "# a network, one day\n", "---\n"):  # said "got NoneType"
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        with pytest.raises(ConfigError) as e:
            build_model(str(empty))
        assert (
            str(e.value)
            == f"{empty}: the file is empty (a network file has model: {{input, layers}}, or "
            "input and layers at its top)"
        )


def test_the_reserved_names_cover_every_network_attribute():
    """A layer named like one of the Network's own attributes would replace it: every
    attribute a built network sets is reserved (graph.Network and expand must agree)."""
    from cnnkit.nn.graph import Network
    from cnnkit.nn.names import reserved_name

    net = Network({"input": [3, 8, 8], "layers": [{"name": "c", "type": "conv", "out_channels": 2,
                                                   "kernel_size": 3}]})  # fmt: skip
    own = {k for k in vars(net) if not k.startswith("_")} | set(dir(Network))
    assert all(reserved_name(k) for k in own - {"c"}), sorted(
        k for k in own if not reserved_name(k)
    )
    assert not reserved_name("conv1") and not reserved_name("name", top=False)


def test_init_rules_that_cannot_fill_their_tensor_fail_validation_on_meta_too():
    spec = net(conv("c"), {"name": "bn", "type": "batchnorm", "init": {"weight": "kaiming_normal"}})
    for device in ("meta", None):  # `cnnkit info` builds on meta and must say what building will
        with pytest.raises(ConfigError) as e:
            build_model(spec, device=device)
        assert str(e.value).startswith("layer 1 (bn): init: weight (4): ") and "\n" not in str(
            e.value
        )
    fits = net(conv("c", init={"weight": "kaiming_normal"}), {"type": "batchnorm"})
    assert build_model(fits, device="meta").c.weight.is_meta


@pytest.mark.parametrize(
    "preprocess, message",
    [
        ({"mean": [1, 2, 3], "sdt": [1, 1, 1]}, "model: preprocess.sdt: unknown field"),
        ({"std": [0, 1, 1]}, "model: preprocess.std: must be > 0"),
        ({"resize": "big"}, "model: preprocess.resize: Input should be a number"),
        ({"mean": "123"}, "model: preprocess.mean: Input should be a valid list (got '123')"),
        ({"std": 0.2}, "model: preprocess.std: [0.2] is on a 0-1 scale"),  # a traceback
        ({"mean": True}, "model: preprocess.mean: Input should be a valid list (got true)"),
    ],
)
def test_preprocess_fields_are_validated_by_info(preprocess, message, tmp_path, capsys):
    """`cnnkit info` checks a network file's preprocess: as classify and export read it."""
    import yaml
    from helpers import run_cli

    path = tmp_path / "net.yaml"
    path.write_text(yaml.safe_dump({"model": net(conv("c"), preprocess=preprocess)}))
    code, _, err = run_cli(["info", str(path)], capsys)
    assert code == 2 and f"{path}: {message}" in err and len(err.splitlines()) == 1, err
    torchvision_like = {"mean": [123.675, 116.28, 103.53], "std": [58.395, 57.12, 57.375],
                        "resize": 256, "resize_mode": "shorter"}  # fmt: skip
    path.write_text(yaml.safe_dump({"model": net(conv("c"), preprocess=torchvision_like)}))
    assert run_cli(["info", str(path)], capsys)[0] == 0
    one_for_all = {"mean": 120, "std": 58}  # one number: every channel's (it was a traceback)
    path.write_text(yaml.safe_dump({"model": net(conv("c"), preprocess=one_for_all)}))
    assert run_cli(["info", str(path)], capsys)[0] == 0
    assert Preprocess.from_dict({"channels": 3, "crop": 8, **one_for_all}).std == [58.0]


def test_init_reads_numbers_yaml_gives_as_strings_as_other_numeric_fields_do():
    import yaml

    layer = yaml.safe_load("{name: a, type: conv, out_channels: 4, kernel_size: 3, "
                           "init: {weight: {normal: 1e-2}, bias: 1e-3}}")  # fmt: skip
    assert layer["init"] == {"weight": {"normal": "1e-2"}, "bias": "1e-3"}  # YAML 1.1: strings
    torch.manual_seed(0)
    model = build_model(net(layer))
    assert torch.all(model.a.bias == 1e-3) and abs(model.a.weight.std().item() - 1e-2) < 3e-3
    ruled = build_model(net(conv("a", init={"weight": {"normal": {"std": "2e-1", "mean": "1"}}})))
    assert abs(ruled.a.weight.mean().item() - 1) < 0.1
    with pytest.raises(ConfigError, match="unknown init 'le-3'"):
        build_model(net(conv("a", init={"bias": "le-3"})))


@pytest.mark.parametrize("classes", [0, -1, 2.5, True, "10"])
def test_num_classes_given_to_build_model_is_checked_as_the_files_is(classes):
    with pytest.raises(ConfigError, match=r"^model: num_classes: Input should be"):
        build_model(net(conv(), {"type": "linear"}), num_classes=classes)


def test_a_word_a_field_does_not_take_lists_the_words_it_does():
    """padding takes numbers or 'same' / 'valid': a wrong word is told those, not 'integer'."""
    spec = {"input": [3, 8, 8],
            "layers": [{"type": "conv", "out_channels": 4, "kernel_size": 3, "padding": "full"}]}  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"padding: Input should be 'same' or 'valid' \(got 'full'\)"
    ):
        build_model(spec, device="meta")


def test_a_convolution_after_global_avgpool_is_told_what_keeps_the_map():
    """A squeeze-and-excitation gate written with global_avgpool (a vector)."""
    spec = {"input": [16, 8, 8], "layers": [{"type": "global_avgpool"},
            {"type": "conv", "out_channels": 16, "kernel_size": 1}]}  # fmt: skip
    with pytest.raises(ConfigError, match=r"adaptive_avgpool, output_size: 1, keeps \(C, 1, 1\)"):
        build_model(spec, device="meta")


def _net(tmp_path, text: str, name: str = "net.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


TINY = (
    "  input: [4, 4, 4]\n  layers:\n    - {type: conv, name: c, out_channels: 2, kernel_size: 1}\n"
)


def test_a_network_field_beside_model_is_refused_not_dropped(tmp_path):
    """A mis-indented `weights:` would train from scratch without a word."""
    stray = _net(tmp_path, "model:\n" + TINY + "weights: pretrained.safetensors\n")
    with pytest.raises(ConfigError, match=r"net.yaml: weights: a network field beside model: "
                       r"\(indent it under model:\)"):  # fmt: skip
        build_model(str(stray))
    typo = _net(tmp_path, "model:\n" + TINY + "trian: {epochs: 1}\n")
    with pytest.raises(ConfigError, match=r"trian: unknown key .*\(did you mean 'train'\?\)"):
        build_model(str(typo))
    run = _net(tmp_path, "name: r\nmodel:\n" + TINY + "data: {source: digits}\nseed: 1\n")
    assert build_model(str(run)).c.out_channels == 2  # a run file's own keys are fine


def test_run_keys_are_run_configs_fields():
    from cnnkit.config import RunConfig
    from cnnkit.nn.spec import RUN_KEYS

    assert set(RUN_KEYS) == set(RunConfig.model_fields)


def test_defaults_fields_are_checked_where_written(tmp_path):
    spec = {"input": [1, 8, 8], "defaults": {"conv": {"bais": False}},
            "layers": [{"type": "relu"}, {"type": "conv", "out_channels": 4, "kernel_size": 3}]}  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"defaults: conv.bais: unknown field \(did you mean 'bias'"
    ):
        build_model(spec)
    spec["defaults"] = {"maxpool": {"kernal_size": 2}}  # no maxpool layer: still a mistake
    with pytest.raises(ConfigError, match=r"maxpool.kernal_size: unknown field"):
        build_model(spec)


def test_a_head_sized_through_defaults_is_a_head(tmp_path):
    spec = {"input": [4], "num_classes": 5, "defaults": {"linear": {"out_features": "$num_classes"}},
            "layers": [{"type": "linear", "name": "fc"}]}  # fmt: skip
    assert build_model(spec).heads == ("fc",)
    torch.save(build_model(spec).state_dict(), tmp_path / "h5.pth")
    tuned = build_model(spec, num_classes=3, weights=tmp_path / "h5.pth")  # a fresh 3-way head
    assert tuned.fc.out_features == 3
    nested = {"input": [2, 6, 6], "num_classes": 3,
              "layers": [{"type": "conv", "name": "k", "out_channels": 2,
                          "kernel_size": ["$num_classes", 1]}]}  # fmt: skip
    assert build_model(nested).heads == ("k",)


def test_default_names_never_take_a_name_the_file_gives(tmp_path):
    conv = {"type": "conv", "out_channels": 2, "kernel_size": 1}
    model = build_model(
        {"input": [2, 4, 4], "layers": [conv, conv, {"type": "relu"}, {**conv, "name": "conv1"}]}
    )
    assert [row.name for row in model.table] == ["conv0", "conv1_1", "relu2", "conv1"]
    model = build_model(
        {"input": [2, 4, 4], "layers": [{**conv, "name": "relu1"}, {"type": "relu"}]}
    )
    assert [row.name for row in model.table] == ["relu1", "relu1_1"]


def test_layer_errors_name_the_line_of_their_layer(tmp_path):
    """Errors naming a top-level layer (cnnkit's `layer N`, pydantic's `layers.N`) name its line
    too: flow or block style, a block's line for the layers it makes, a file with or without
    `model:`; a network given as a dict has no lines to name."""
    text = textwrap.dedent("""\
        model:
          input: [3, 16, 16]
          num_classes: 4
          blocks:
            pair:
              params: {out: null}
              layers:
                - {type: conv, out_channels: $out, kernel_size: 3, padding: 1}
                - {type: relu}
          layers:
            - {type: conv, out_channels: 8, kernel_size: 3}
            - {name: stage, block: pair, out: 8, repeat: 2}
            - type: global_avgpool
            - type: linear
        """)  # fmt: skip
    cases = {
        "kernel_size: 3}": ("kernel_size: 3, bogus: 1}", 11, r"layer 0 \(conv0\): bogus"),
        "- type: linear": ("- {type: linear, bogus: 1}", 14, r"layer 3 \(linear3\): bogus"),
        "kernel_size: 3, padding: 1}": ("kernel_size: 99, padding: 1}", 12,
                                        r"layer 1 \(stage\.0\.conv0\): kernel_size: kernel 99"),
        "- type: global_avgpool": ("- relu", 13, r"model: layers\.2: Input should be"),
    }  # fmt: skip
    for old, (new, line, words) in cases.items():
        path = tmp_path / "net.yaml"
        path.write_text(text.replace(old, new, 1))
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: line {line}: {words}"):
            build_model(str(path))
    flat = tmp_path / "flat.yaml"  # no model: at the top
    flat.write_text("input: [3, 8, 8]\nlayers:\n  - type: conv\n    out_channels: 2\n"
                    "    kernel_sise: 3\n")  # fmt: skip
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(flat))}: line 3: layer 0 \(conv0\)"):
        build_model(str(flat))
    with pytest.raises(ConfigError, match=r"^layer 0 \(conv0\): kernel_sise"):
        build_model({"input": [3, 8, 8], "layers": [{"type": "conv", "kernel_sise": 3}]})
    flat.write_text("blocks: {b: {layers: [&c {type: relu}]}}\nlayers:\n  - *c\n  - *c\n")
    assert layer_line(flat, "layer 1 (relu1): ...") is None  # an alias: its anchor's line misleads
    assert layer_line(flat, "layer 2 (x): ...") is None and layer_line(flat, "model: x") is None


def test_errors_name_the_network_file_a_run_file_names(tmp_path):
    _net(
        tmp_path,
        "model:\n  input: [1, 8, 8]\n  layers:\n    - {type: conv, out_channels: 2, kernel_size: 30}\n",
        "bad.yaml",
    )
    run = _net(tmp_path, "model: bad.yaml\ndata: {source: digits}\n", "run.yaml")
    with pytest.raises(
        ConfigError, match=r"^\S*bad.yaml: line 4: layer 0 \(conv0\): kernel_size: kernel 30"
    ):
        build_model(str(run))
    with pytest.raises(ConfigError, match=r"^\S*bad.yaml: line 4: layer 0"):  # one prefix, not two
        build_model(str(tmp_path / "bad.yaml"))
    with pytest.raises(ConfigError, match=r"^lenet5: model: num_classes"):  # a zoo net: its name
        build_model("lenet5", num_classes=2**40)


def test_a_class_count_no_layer_takes_is_refused_not_dropped(tmp_path):
    fixed = net({"type": "global_avgpool"}, {"name": "fc", "type": "linear", "out_features": 5})
    with pytest.raises(ConfigError, match=r"^num_classes=3: no layer of net is sized by "
                       r"num_classes: the last layer fc \(linear\) gives \[5\] \(a linear layer "
                       "that leaves out out_features, or a layer given .num_classes, takes the "
                       "class count"):  # fmt: skip
        build_model(fixed, num_classes=3)
    assert build_model(fixed, num_classes=5).output_shape == (5,)  # what it gives: no matter
    path = _net(tmp_path, "model:\n  input: [3, 8, 8]\n  num_classes: 10\n  layers:\n"
                "    - {type: flatten}\n    - {type: linear, out_features: 5}\n")  # fmt: skip
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(str(path))}: num_classes: 10: no layer "
        r"is sized by num_classes: the last layer linear1 \(linear\) gives \[5\]",
    ):
        build_model(str(path))
    assert build_model(str(path), num_classes=5).output_shape == (5,)  # the file's, overridden
    headed = build_model(net({"type": "flatten"}, {"type": "linear"}, num_classes=10), 3)
    assert headed.output_shape == (3,) and headed.heads == ("linear1",)
    fcn = net({"type": "conv", "out_channels": 10, "kernel_size": 8}, num_classes=10)
    assert build_model(fcn).output_shape == (10, 1, 1)  # ten scores, fully convolutional
    with pytest.raises(ConfigError, match=r"gives \[10, 1, 1\] \(a linear layer that leaves "
                       r"out out_features, or a layer given \$num_classes, takes"):  # fmt: skip
        build_model({**fcn, "num_classes": 7})


def test_a_run_files_own_network_errors_name_their_line(tmp_path):
    from cnnkit.config.load import load_run

    run = _net(tmp_path, "data: {source: digits}\nmodel:\n  input: [1, 8, 8]\n  layers:\n"
               "    - {type: relu}\n    - {type: conv, out_channels: 2, kernel_size: 30}\n",
               "run.yaml")  # fmt: skip
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(run))}: line 6: layer 1 \(conv1\)"):
        build_model(load_run(str(run)).model.spec())


def test_missing_num_classes_and_contradicting_init_are_said(tmp_path):
    spec = {
        "input": [2, 4, 4],
        "layers": [
            {"type": "conv", "name": "cls", "out_channels": "$num_classes", "kernel_size": 1}
        ],
    }
    with pytest.raises(ConfigError, match=r"\$num_classes: the network has no num_classes"):
        build_model(spec)
    own = {"type": "conv", "out_channels": 2, "kernel_size": 1, "bias": False, "init": {"bias": 0}}
    with pytest.raises(ConfigError, match=r"init: bias: this layer has no bias \(bias: false\)"):
        build_model({"input": [2, 4, 4], "layers": [own]})
    bn = {"type": "batchnorm", "affine": False, "init": {"weight": 1}}
    with pytest.raises(
        ConfigError, match=r"init: weight: this layer has no weight \(affine: false\)"
    ):
        build_model({"input": [2, 4, 4], "layers": [bn]})
    shared = {"input": [2, 4, 4], "defaults": {"conv": {"init": {"bias": 0}}},  # from defaults: fine
              "layers": [{k: v for k, v in own.items() if k != "init"}]}  # fmt: skip
    assert build_model(shared).conv0.bias is None


def test_a_blocks_init_beside_a_bias_parameter_that_is_false_is_skipped():
    block = {"params": {"bias": True}, "layers": [
        {"name": "conv", "type": "conv", "out_channels": 2, "kernel_size": 1, "bias": "$bias",
         "init": {"weight": "kaiming_normal", "bias": 0}}]}  # fmt: skip
    model = build_model({"input": [2, 4, 4], "blocks": {"b": block},
                         "layers": [{"name": "a", "block": "b"}, {"name": "n", "block": "b", "bias": False}]})  # fmt: skip
    assert model.a.conv.bias is not None and model.n.conv.bias is None


def test_default_names_in_a_block_avoid_its_given_names_and_inputs():
    conv = {"type": "conv", "out_channels": 2, "kernel_size": 1}
    block = {"layers": [conv, {**conv, "name": "conv0"}]}
    model = build_model(
        {"input": [2, 4, 4], "blocks": {"b": block}, "layers": [{"name": "s", "block": "b"}]}
    )
    assert [r.name for r in model.table] == ["s.conv0_1", "s.conv0"]
    skip = {"inputs": ["input", "relu1"], "layers": [conv, {"type": "relu"}, {"name": "sum", "type": "add", "inputs": ["previous", "relu1"]}]}  # fmt: skip
    model = build_model({"input": [2, 4, 4], "blocks": {"b": skip},
                         "layers": [{"name": "x", **conv}, {"name": "s", "block": "b", "inputs": ["x", "x"]}]})  # fmt: skip
    assert [r.name for r in model.table] == ["x", "s.conv0", "s.relu1_1", "s.sum"]
    assert model.table[-1].inputs == ("s.relu1_1", "x")  # the block's input, not its own relu


def test_default_names_avoid_the_names_inline_blocks_and_index_copies_give():
    """A default name (conv1) took a name an inline block's layer (or a `conv$index` copy)
    gives further on, and the error then blamed the name the user wrote."""
    conv = {"type": "conv", "out_channels": 2, "kernel_size": 1}
    named = {"layers": [{**conv, "name": "conv1"}]}
    outer = {"layers": [{"block": "named", "inline": True}]}  # spliced in two deep
    for line in ({"block": "named", "inline": True}, {"block": "outer", "inline": True},
                 {"block": "plain", "inline": True, "first": {"block": "named"}}):  # fmt: skip
        spec = {"input": [2, 4, 4], "layers": [conv, conv, line],
                "blocks": {"named": named, "outer": outer, "plain": {"layers": [conv]}}}  # fmt: skip
        assert [r.name for r in build_model(spec).table] == ["conv0", "conv1_1", "conv1"], line
    inside = {"layers": [conv, conv, {"block": "named", "inline": True}]}  # in a block too
    spec = {"input": [2, 4, 4], "layers": [{"name": "s", "block": "inside"}],
            "blocks": {"named": named, "inside": inside}}  # fmt: skip
    assert [r.name for r in build_model(spec).table] == ["s.conv0", "s.conv1_1", "s.conv1"]
    copies = {"name": "conv$index", "block": "named", "repeat": 2}
    spec = {"input": [2, 4, 4], "layers": [conv, conv, copies], "blocks": {"named": named}}
    assert [r.name for r in build_model(spec).table] == [
        "conv0_1", "conv1_1", "conv0.conv1", "conv1.conv1"]  # fmt: skip


@pytest.mark.parametrize("name, word", [("in", "in"), ("class", "class"), ("None", "None"),
                                        ("b.def", "def"), ("NoneType", "NoneType")])  # fmt: skip
def test_python_keywords_are_refused_as_layer_names_naming_layer_and_file(tmp_path, name, word):
    """torch.export's and TorchScript's code names each layer: a keyword there would not
    compile, so ONNX export failed and a .pt2 or TorchScript file was written unloadable."""
    import yaml

    *block, short = name.split(".")
    layer = {"name": short, "type": "relu"}
    layers = [{"name": block[0], "block": "b"}] if block else [dict(layer)]  # (no YAML alias)
    spec = net(conv("c"), *layers, blocks={"b": {"layers": [layer]}})
    path = tmp_path / "net.yaml"
    path.write_text(yaml.safe_dump({"model": spec}))
    with pytest.raises(ConfigError) as e:
        build_model(str(path))
    lines = path.read_text().splitlines()
    start = lines.index("  layers:")  # the second item of the top-level list: layer 1
    line = [i + 1 for i in range(start, len(lines)) if lines[i].startswith("  - ")][1]
    assert str(e.value).startswith(
        f"{path}: line {line}: layer 1 ({name}): name: {word!r} is a Python keyword"
    )


def test_an_empty_name_and_a_network_both_named_and_described_say_what_they_are(tmp_path):
    """`name:` left empty read 'not a name: None'; a model: with both network: and layers:
    read 'network: unknown field' (info) or 'model.layers: unknown field' (train)."""
    from cnnkit.config import validate_run

    with pytest.raises(ConfigError, match=r"layer 0: name: empty \(null\); give a name, or "
                                          r"leave name: out"):  # fmt: skip
        build_model(net({"name": None, "type": "relu"}))
    both = tmp_path / "both.yaml"
    both.write_text("model:\n  network: digitnet\n  layers:\n    - {type: relu}\n")
    with pytest.raises(ConfigError, match=r"both.yaml: model: both network: .* and layers: "
                                          r".*give one of the two"):  # fmt: skip
        build_model(str(both))
    with pytest.raises(ConfigError, match=r"model: both network: .* and layers: .*give one"):
        validate_run({"model": {"network": "digitnet", "layers": [{"type": "relu"}]},
                      "data": {"source": "digits"}})  # fmt: skip
