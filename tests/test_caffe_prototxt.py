"""The prototxt parser and Caffe's rules as import-caffe follows them (phases, the old syntax,
size fields, strings and booleans); unknown fields, bad values and layers it cannot import
refused in one line naming the line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import CAFFE_CONV as CONV
from helpers import CAFFE_INPUT as INPUT
from helpers import caffe_layer as _layer
from helpers import run_cli

from cnnkit import ConfigError, build_model
from cnnkit.caffe import import_caffe, parse_prototxt, translate
from cnnkit.caffe.translate import read_caffe
from cnnkit.nn.stages import MAX_LAYERS

DATA = Path(__file__).parent / "data" / "caffe"


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


@pytest.mark.parametrize("kind", ["Data", "Accuracy", "SoftmaxWithLoss"])
def test_a_train_val_prototxt_points_at_the_deploy_one(tmp_path, kind):
    prototxt = tmp_path / "train_val.prototxt"
    prototxt.write_text(f'layer {{ name: "x" type: "{kind}" top: "x" }}\n')
    with pytest.raises(ConfigError, match=r"'x' has type '\w+', which cnnkit cannot import \(a "
                                          r"train_val prototxt\? give the deploy.prototxt"):  # fmt: skip
        import_caffe(prototxt)


def test_eltwise_coefficients_weigh_the_sum_as_caffes(tmp_path):
    """Inception-ResNet's scaled residual: Eltwise SUM with a coeff per bottom is an add with
    coeff; coefficients on a PROD or MAX, or not one per bottom, Caffe refuses, and so does the
    import."""
    head = ('layer { name: "d" type: "Input" top: "d" input_param { shape { dim: 1 dim: 3 dim: 4 '
            'dim: 4 } } }\nlayer { name: "c" type: "Convolution" bottom: "d" top: "c" '
            "convolution_param { num_output: 3 kernel_size: 1 } }\n")  # fmt: skip
    eltwise = 'layer {{ name: "e" type: "Eltwise" bottom: "d" bottom: "c" top: "e" eltwise_param {{ {} }} }}\n'
    net = build_model(
        translate(parse_prototxt(head + eltwise.format("coeff: 1 coeff: -0.17")))
    ).eval()
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(net(x), x - 0.17 * net.c(x))
    assert (
        "coeff"
        not in translate(parse_prototxt(head + eltwise.format("coeff: 1 coeff: 1")))["layers"][1]
    )
    for params, words in [("operation: PROD coeff: 1 coeff: 2", "Eltwise PROD takes no coeff"),
                          ("coeff: 0.5", "coeff: 1 given for 2 bottoms")]:  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            translate(parse_prototxt(head + eltwise.format(params)))


def test_slice_cuts_the_channels_as_caffes(tmp_path):
    """DPN's Slice: one channel_split per top, named after it, cut at the slice_points (or into
    equal parts without them); another axis, or points not one fewer than the tops, refused."""
    head = ('layer { name: "d" type: "Input" top: "d" input_param { shape { dim: 1 dim: 6 dim: 2 '
            'dim: 2 } } }\n')  # fmt: skip
    cut = 'layer {{ name: "s" type: "Slice" bottom: "d" {} slice_param {{ {} }} }}\n'
    join = 'layer {{ name: "j" type: "Concat" {} top: "j" }}\n'
    x = torch.randn(2, 6, 2, 2)
    for tops, params, parts in [(["res/1", "dense"], "slice_point: 4", [4]),
                                (["p", "q", "r"], "axis: -3", 3),
                                (["p", "q", "r"], "slice_dim: 1 slice_point: 1 slice_point: 3", [1, 3])]:  # fmt: skip
        tops_text = " ".join(f'top: "{t}"' for t in tops)
        bottoms = " ".join(f'bottom: "{t}"' for t in reversed(tops))
        model = translate(
            parse_prototxt(head + cut.format(tops_text, params) + join.format(bottoms))
        )
        assert [n["name"] for n in model["layers"]] == [t.replace("/", "_") for t in tops] + ["j"]
        net = build_model(model).eval()
        with torch.no_grad():
            assert torch.equal(net(x), torch.cat(x.tensor_split(parts, dim=1)[::-1], dim=1))
    for tops, params, words in [('top: "a" top: "b"', "slice_point: 1 slice_point: 2",
                                 "2 slice_point for 2 tops"),
                                ('top: "a" top: "b"', "axis: 2", "Slice axis 2: only the channel"),
                                ('top: "a"', "", "without slice_point needs 2 tops"),
                                ('top: "a" top: "b"', "slice_point: 6", "points: .6. must rise"),
                                ('top: "a" top: "b"', "slice_pont: 2", "'slice_pont' is not a field"),
                                ('top: "a" top: "b" top: "c" top: "e"', "",
                                 "Slice of 6 channels into 4 equal tops: 4 does not divide 6")]:  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            translate(parse_prototxt(head + cut.format(tops, params) + join.format('bottom: "a"')))


def test_a_silenced_top_is_computed_and_dropped():
    """DPN-style: a Slice whose second top a Silence takes; the network's output is the first."""
    text = ('layer { name: "d" type: "Input" top: "d" input_param { shape { dim: 1 dim: 6 dim: 2 '
            'dim: 2 } } }\nlayer { name: "s" type: "Slice" bottom: "d" top: "a" top: "b" '
            'slice_param { slice_point: 2 } }\nlayer { name: "q" type: "Silence" bottom: "b" }\n')  # fmt: skip
    net = build_model(translate(parse_prototxt(text))).eval()
    x = torch.randn(2, 6, 2, 2)
    with torch.no_grad():
        assert torch.equal(net(x), x[:, :2])


def test_unsupported_type_names_type_and_line():
    with pytest.raises(ConfigError) as err:
        import_caffe(DATA / "unsupported.prototxt")
    assert "unsupported.prototxt:7:" in str(err.value) and "'SPP'" in str(err.value)


def test_a_softmax_inside_the_net_is_a_layer_and_a_missing_bottom_an_error():
    """A Softmax over the channels inside the net (the colorization net's colour bins) is a
    `softmax` layer; the last one is dropped; one before an Accuracy names a train_val file."""
    base = 'input: "data" input_dim: 1 input_dim: 3 input_dim: 4 input_dim: 4\n'
    soft = _layer("s", "Softmax", ["data"], "s") + _layer("f", "Flatten", ["s"], "f")
    model = translate(parse_prototxt(base + soft))
    assert [layer["type"] for layer in model["layers"]] == ["softmax", "flatten"]
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(build_model(model)(x), torch.softmax(x, 1).flatten(1))
    scored = _layer("s", "Softmax", ["data"], "s") + _layer("a", "Accuracy", ["s", "label"], "a")
    with pytest.raises(ConfigError, match=":3: layer 'a' has type 'Accuracy'.*a train_val proto"):
        translate(parse_prototxt(base + scored))
    with pytest.raises(ConfigError, match="bottom 'nope' is not produced"):
        translate(parse_prototxt(base + _layer("f", "Flatten", ["nope"], "f")))


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


def test_the_files_own_state_stages_are_kept_as_caffe_net_keeps_them():
    """caffe.Net(file, caffe.TEST) overrides the file's phase and level but keeps its stages."""

    def relu(name, rule):
        return _layer(name, "ReLU", ["fc"], "fc", rule)

    text = INPUT + _layer(
        "fc", "InnerProduct", ["data"], "fc", "inner_product_param { num_output: 2 }"
    )
    text += relu("staged", "include { stage: 'deploy' }") + relu("other", "include { stage: 'x' }")
    text += relu("barred", "include { not_stage: 'deploy' }") + relu(
        "free", "include { not_stage: 'x' }"
    )
    text += relu("excluded", "exclude { stage: 'deploy' }") + relu(
        "high", "include { min_level: 1 }"
    )
    names = [[n["name"] for n in translate(parse_prototxt(state + text))["layers"]]
             for state in ("", "state { phase: TRAIN level: 2 stage: 'deploy' }\n")]  # fmt: skip
    assert names == [["fc", "barred", "free", "excluded"], ["fc", "staged", "free"]]
    for bad, words in (("state { stag: 'deploy' }", r":1: 'stag' is not a field of Caffe's "
                        r"NetState \(did you mean 'stage'\?\)"),
                       ("state: 3", r":1: state: expected a \{ ... \} block, got 3"),
                       ("", r"'not_stag' is not a field of Caffe's NetStateRule")):  # fmt: skip
        rule = relu("r", "include { not_stag: 'x' }") if not bad else ""
        with pytest.raises(ConfigError, match=words):
            translate(parse_prototxt(bad + "\n" + text + rule))


BAD_FIELDS = {
    "kernel_h: 3": r"kernel_h and kernel_w go together",
    'kernel_size: "abc"': r"kernel_size: expected an integer, got 'abc'",
    "kernel_size: 3 num_output: xyz": r"num_output: expected an integer, got 'xyz'",
    "kernel_size: 3 num_output: 4.7": r"num_output: expected an integer, got 4.7",
    "kernel_size: 3 num_output: 4 bias_term: 'false'": r"bias_term: expected true or false",
    "kernel_size: 3 num_output: 4 bias_term: 2": r"bias_term: expected true or false, got 2",
    "kernel_size: 3 num_output: 4 pad: -1": r"padding.* greater than or equal to 0 \(got -1\)",
    "kernel_size: 3 num_output: 0": r"Convolution needs num_output, a whole number above 0 "
    r"\(in its convolution_param; got 0\)",
    "kernel_size: 3": r"Convolution needs num_output",  # Caffe's own name, not out_channels
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


@pytest.mark.parametrize(("kind", "params", "twice"), [
    ("InnerProduct", "inner_product_param { num_output: 3 } inner_product_param { num_output: 5 }",
     "inner_product_param is given twice in layer"),
    ("InnerProduct", "inner_product_param { num_output: 3 num_output: 5 }",
     "num_output is given twice in inner_product_param"),
    ("Pooling", "pooling_param { pool: MAX kernel_size: 2 kernel_size: 3 }",
     "kernel_size is given twice in pooling_param"),  # (a convolution's is repeated)
    ("InnerProduct", "inner_product_param { num_output: 3 weight_filler { type: 'gaussian' "
     "std: 0.1 std: 0.2 } }", "std is given twice in weight_filler"),
    ("ReLU", 'name: "again"', "name is given twice in layer"),
])  # fmt: skip
def test_a_field_caffe_declares_once_given_twice_is_refused(kind, params, twice):
    """protobuf's text parser refuses a non-repeated field given twice ("specified multiple
    times"), so Caffe does; here the last had silently won (num_output 5 of two blocks)."""
    text = INPUT + _layer("c", kind, ["data"], "c", params)
    with pytest.raises(ConfigError) as err:
        translate(parse_prototxt(text, "t"), "t")
    assert str(err.value) == (f"t:3: {twice} (caffe.proto declares it once, and Caffe's parser "
                              "refuses the second)")  # fmt: skip
    repeated = INPUT + _layer("c", "Convolution", ["data"], "c",  # repeated fields: each kept
                              "convolution_param { num_output: 2 kernel_size: 3 kernel_size: 1 "
                              "pad: 1 pad: 0 }")  # fmt: skip
    layer = translate(parse_prototxt(repeated, "t"), "t")["layers"][0]
    assert layer["kernel_size"] == [3, 1] and layer["padding"] == [1, 0]


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
    with pytest.raises(ConfigError, match=r":2: dim: expected an integer, got 3.5"):  # its line
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


@pytest.mark.parametrize("params", ["convolution_param {{ num_output: {} kernel_size: 1 }}",
                                    "foo_param {{ a: {} }}"])  # fmt: skip
def test_an_integer_beyond_64_bits_is_one_line_naming_the_line(tmp_path, capsys, params):
    """Python refuses to read an integer of over 4,300 digits: that had been a traceback."""
    prototxt = tmp_path / "big.prototxt"
    huge = "1" + "0" * 5000
    prototxt.write_text(INPUT + _layer("c", "Convolution", ["data"], "c", params.format(huge)))
    code, _, err = run_cli(["import-caffe", str(prototxt)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{prototxt}:3: the integer 100000000000...000000 (5,001 digits) is out of range" in err
    with pytest.raises(ConfigError, match=r"t:1: the integer 18446744073709551616 is out of"):
        parse_prototxt("a: 18446744073709551616", "t")  # 2**64
    parsed = parse_prototxt("a: 18446744073709551615 b: -9223372036854775808 c: -0007")
    assert [parsed.get(k) for k in "abc"] == [2**64 - 1, -(2**63), -7]


ENUMS_AS_NUMBERS = {  # True == 1 and 1.0 == 1: round_mode FLOOR, variance_norm FAN_OUT had been
    "Pooling": "pooling_param {{ pool: MAX kernel_size: 2 round_mode: {} }}",
    "Convolution": "convolution_param {{ num_output: 2 kernel_size: 1 "
                   "weight_filler {{ type: 'xavier' variance_norm: {} }} }}",
    "LRN": "lrn_param {{ norm_region: {} }}",
    "Eltwise": "eltwise_param {{ operation: {} }}",
}  # fmt: skip


@pytest.mark.parametrize("value", ["true", "false", "1.0", "0.0", "{ }"])
@pytest.mark.parametrize("kind", ENUMS_AS_NUMBERS)
def test_an_enum_is_a_name_or_a_number_never_a_bool_or_a_float(kind, value):
    params = ENUMS_AS_NUMBERS[kind].format(value)
    field = params.split(":")[-2].split()[-1]
    layer = _layer("x", kind, ["data", "data"] if kind == "Eltwise" else ["data"], "x", params)
    got = re.escape("a { ... } block" if value == "{ }" else value)
    pattern = rf"^t:3: {field}: expected [A-Z_, ]+ or \w+ \(or its number\), got {got}$"
    with pytest.raises(ConfigError, match=pattern):
        translate(parse_prototxt(INPUT + layer, "t"), "t")
    rule = _layer("r", "ReLU", ["data"], "r", "include { phase: 1 }")  # TEST, by its number
    assert translate(parse_prototxt(INPUT + rule))["layers"][0]["type"] == "relu"


MISLEADING = {  # each had named something else than what the prototxt says
    INPUT + _layer("bn", "BatchNorm", ["data"], "bn", "batch_norm_param { moving_average_fraction: 5 }"):
        r"t:3: batch_norm_param moving_average_fraction: 5 is not within 0 to 1 \(each step .*",
    'input: "data"\ninput_shape { dim { } }\n':
        r"t:2: dim: expected an integer, got a \{ ... \} block",  # was <...Message object at 0x..>
    INPUT + _layer("p", "Pooling", [], "p", "pooling_param { pool: AVE global_pooling: true }"):
        r"t:3: layer 'p' has no bottom",  # was `bottom None is not produced by an earlier layer`
    INPUT + _layer("bn", "BatchNorm", ["data"], "bn") + _layer("s", "Scale", [], "s"):
        r"t:4: layer 's' has no bottom",
    INPUT.replace("input_dim: 8 input_dim: 8", "input_dim: 0 input_dim: 8") + _layer("r", "ReLU", ["data"], "r"):
        r"t:2: input dims \(1, 3, 0, 8\): C, H and W must be 1 or more",  # was `model: input.1`
    'layer { name: "d" type: "Input" top: "data" input_param { shape { dim: 1 dim: -6 } } }\n':
        r"t:1: input dims \(1, -6\): F must be 1 or more",
}  # fmt: skip


@pytest.mark.parametrize("text", MISLEADING)
def test_errors_name_the_caffe_field_and_the_values_as_written(text):
    with pytest.raises(ConfigError, match=f"^{MISLEADING[text]}$"):  # (momentum -4 had been)
        translate(parse_prototxt(text, "t"), "t")


def test_a_prototxt_of_more_layers_than_cnnkit_builds_names_the_file_and_line():
    """It had said `the network expands to more than 20,000 layers (check repeat)`, no file."""
    relu = 'layer {{ name: "r{}" type: "ReLU" bottom: "data" top: "data" }}\n'
    text = 'input: "data" input_dim: 1 input_dim: 4\n'
    text += "".join(relu.format(i) for i in range(MAX_LAYERS + 1))
    with pytest.raises(ConfigError, match=rf"^t:{MAX_LAYERS + 2}: the network has more than "
                       r"20,000 layers, more than cnnkit builds$"):  # fmt: skip
        translate(parse_prototxt(text, "t"), "t")


def test_an_inner_product_without_num_output_names_caffes_field():
    """It said 'out_features: Input should be greater than 0 (got 0)': cnnkit's name for a
    field the prototxt never wrote."""
    text = INPUT + _layer("fc", "InnerProduct", ["data"], "fc", "inner_product_param { }")
    with pytest.raises(ConfigError, match=r"t:3: InnerProduct needs num_output, a whole number "
                                          r"above 0 \(in its inner_product_param; got 0\)"):  # fmt: skip
        translate(parse_prototxt(text, "t"), "t")
