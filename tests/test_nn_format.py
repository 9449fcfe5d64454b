"""The network file's composition: stages, nested and sequential blocks, arithmetic on
parameters, `$in_channels`, conditional layers, and the one-line errors each one gives."""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from cnnkit import ConfigError, build_model
from cnnkit.nn.yamlio import load_yaml


def net(*layers, blocks=None, **extra):
    return {"input": [4, 8, 8], "layers": list(layers), "blocks": blocks or {}, **extra}


def conv(name=None, **kw):
    layer = {"type": "conv", "out_channels": 4, "kernel_size": 3, "padding": 1, **kw}
    return {"name": name, **layer} if name else layer


UNIT = {  # conv, optional 1x1 projection where the width or stride changes, add
    "params": {"out": None, "stride": 1},
    "layers": [
        conv("c", out_channels="$out", stride="$stride"),
        {"name": "proj", "block": "proj", "out": "$out", "stride": "$stride", "inputs": "input",
         "if": "$stride != 1 or $in_channels != $out"},
        {"name": "sum", "type": "add", "inputs": ["c", "proj"]},
    ],
}  # fmt: skip
PROJ = {
    "sequential": True,
    "params": {"out": None, "stride": 1},
    "layers": [
        {"type": "conv", "out_channels": "$out", "kernel_size": 1, "stride": "$stride"},
        {"type": "batchnorm"},
    ],
}


def test_a_stage_is_one_line_with_a_different_first_copy():
    spec = net(
        {"name": "stage", "block": "unit", "out": 6, "repeat": 3, "first": {"stride": 2}},
        blocks={"unit": UNIT, "proj": PROJ},
    )
    model = build_model(spec).eval()
    names = [row.name for row in model.table]
    assert names == [
        "stage.0.c", "stage.0.proj.0", "stage.0.proj.1", "stage.0.sum",
        "stage.1.c", "stage.1.sum", "stage.2.c", "stage.2.sum",
    ]  # fmt: skip
    assert model.table[0].output_shape == (6, 4, 4) and model.output_shape == (6, 4, 4)
    assert model.table[5].inputs == ("stage.1.c", "stage.0.sum")  # absent proj: its input
    x = torch.randn(2, 4, 8, 8)
    stage = model.stage
    with torch.no_grad():
        proj = stage.get_submodule("0.proj")
        y = stage.get_submodule("0.c")(x) + proj.get_submodule("1")(proj.get_submodule("0")(x))
        for i in (1, 2):
            y = stage.get_submodule(f"{i}.c")(y) + y
        torch.testing.assert_close(model(x), y)


def test_start_and_index_name_copies_and_parameters():
    block = {"params": {"k": None}, "layers": [conv("c", out_channels="$k")]}
    spec = net(
        {"name": "dense.layer$index", "block": "b", "repeat": 2, "start": 1, "k": "$index * 2"},
        {"name": "after", "block": "b", "repeat": 2, "start": 3, "k": "$in_channels"},
        blocks={"b": block},
    )
    model = build_model(spec, device="meta")
    rows = [(row.name, row.output_shape[0]) for row in model.table]
    assert rows == [
        ("dense.layer1.c", 2),
        ("dense.layer2.c", 4),
        ("after.3.c", 4),
        ("after.4.c", 4),
    ]


def test_nested_sequential_and_inline_blocks_number_like_nn_sequential():
    blocks = {
        "cbr": {
            "sequential": True,
            "params": {"out": None, "act": "relu"},
            "layers": [conv(out_channels="$out"), {"type": "batchnorm"}, {"type": "$act"}],
        },
        "body": {
            "sequential": True,
            "params": {"expand": False},
            "layers": [
                {"block": "cbr", "out": 8, "if": "$expand"},
                {"block": "cbr", "out": 4, "act": "relu6", "inline": True},
                {"type": "maxpool", "kernel_size": 2},
            ],
        },
    }
    spec = net(
        {"name": "a", "block": "body", "expand": True},
        {"name": "b", "block": "body"},
        blocks=blocks,
    )
    model = build_model(spec, device="meta")
    names = [row.name for row in model.table]
    assert names == [
        "a.0.0", "a.0.1", "a.0.2", "a.1", "a.2", "a.3", "a.4",
        "b.0", "b.1", "b.2", "b.3",
    ]  # fmt: skip
    assert isinstance(model.get_submodule("a.3"), nn.ReLU6)
    assert model.table[3].inputs == ("a.0.2",) and model.table[7].inputs == ("a.4",)


def test_integer_names_in_inputs_read_the_layers_those_names_give():
    """`name: 1` was a name and `inputs: [1]` was refused ("not a layer name"): a sequential
    block names its layers 0, 1, 2, and YAML reads `[0, 2]` as integers."""
    blocks = {"res": {"sequential": True, "layers": [
        conv(), {"type": "relu"}, conv(), {"type": "add", "inputs": [0, 2]}]}}  # fmt: skip
    model = build_model(net({"name": "r", "block": "res"}, blocks=blocks), device="meta")
    assert model.table[-1].inputs == ("r.0", "r.2")
    skip = {"inputs": ["input", "skip"], "layers": [{"type": "add", "inputs": ["input", "skip"]}]}
    spec = net(conv(1), conv(2), {"name": "s", "block": "skip", "inputs": [2, 1]},
               {"type": "relu", "inputs": 1}, blocks={"skip": skip})  # fmt: skip
    model = build_model(spec, device="meta")
    assert [row.inputs for row in model.table[2:]] == [("2", "1"), ("1",)]
    with pytest.raises(ConfigError, match=r"inputs: True is not a layer name"):
        build_model(net(conv(1), {"type": "relu", "inputs": [True]}), device="meta")


def test_arithmetic_and_in_channels_make_a_depthwise_conv():
    dw = {"type": "conv", "out_channels": "$in_channels", "kernel_size": 3,
          "padding": "($in_height - $in_height + 3) // 2", "groups": "$in_channels"}  # fmt: skip
    block = {
        "params": {"width": None, "wide": "$width * 4 // 2 - (1 + 1)"},
        "layers": [conv("pw", out_channels="$wide"), {"name": "dw", **dw}],
    }
    model = build_model(net({"name": "m", "block": "blk", "width": 3}, blocks={"blk": block}))
    pw, dw_module = model.m.pw, model.m.dw
    assert pw.out_channels == 4 and dw_module.groups == 4 and dw_module.in_channels == 4
    assert dw_module.padding == (1, 1)
    reference = nn.Conv2d(4, 4, 3, padding=1, groups=4)
    reference.load_state_dict(dw_module.state_dict())
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(pw(x)))


def test_a_repeat_count_and_first_may_be_parameters():
    outer = {"params": {"n": None, "s": 1}, "layers": [
        {"block": "unit", "out": 6, "repeat": "$n", "first": {"stride": "$s"}}]}  # fmt: skip
    spec = net(
        {"name": "o", "block": "outer", "n": 2, "s": 2},
        blocks={"outer": outer, "unit": UNIT, "proj": PROJ},
    )
    names = [row.name for row in build_model(spec, device="meta").table]
    assert names[0] == "o.unit0.0.c" and names[-1] == "o.unit0.1.sum"


def test_defaults_may_use_arithmetic_and_the_input_shape():
    spec = net(
        conv("c", out_channels="$in_channels * 2"),
        defaults={"conv": {"kernel_size": 1, "padding": 0}},
    )
    assert build_model(spec, device="meta").output_shape == (8, 8, 8)


def test_an_absent_last_entry_stands_for_its_input_as_the_output():
    """The network's output is its last entry's value: when that entry is absent (`if:` false)
    it is the entry's input, even though an earlier layer of the block was computed."""
    block = {"params": {"res": True},
             "layers": [conv("conv"), {"name": "add", "type": "add", "inputs": ["input", "conv"],
                                       "if": "$res"}]}  # fmt: skip
    spec = net(conv("stem", kernel_size=1, padding=0), {"name": "b", "block": "unit", "res": False},
               blocks={"unit": block})  # fmt: skip
    model = build_model(spec).eval()
    x = torch.randn(2, 4, 8, 8)
    torch.testing.assert_close(model(x), model.stem(x))
    with_add = build_model(
        {**spec, "layers": [spec["layers"][0], {**spec["layers"][1], "res": True}]}
    )
    assert [row.name for row in with_add.table][-1] == "b.add"


def test_a_block_may_hold_itself_only_to_a_bounded_depth():
    spec = net(
        {"name": "r", "block": "loop"},
        blocks={"loop": {"layers": [{"name": "again", "block": "loop"}]}},
    )
    with pytest.raises(ConfigError, match="blocks nest more than 16 deep .does 'loop' hold itself"):
        build_model(spec)
    shrink = {"params": {"n": None}, "layers": [
        conv("c"), {"name": "more", "block": "shrink", "n": "$n - 1", "if": "$n > 1"}]}  # fmt: skip
    names = [
        row.name
        for row in build_model(
            net({"name": "s", "block": "shrink", "n": 3}, blocks={"shrink": shrink})
        ).table
    ]
    assert names == ["s.c", "s.more.c", "s.more.more.c"]


BAD = [
    (net(conv("a", out_channels="$in_channels * ")), "layer 0 (a): out_channels: the expression ends where a value should be"),
    (net(conv("a", out_channels="$w")), "layer 0 (a): out_channels: $w is not a parameter here"),
    (net(conv("a", out_channels="$in_channels // 0")), "layer 0 (a): out_channels: division by zero"),
    (net(conv("a", out_channels="$in_channels / 2")), "layer 0 (a): out_channels: Input should be a valid integer"),
    (net(conv("a", out_channels="__import__('os')")), "layer 0 (a): out_channels: Input should be a valid integer"),
    (net(conv("a", out_channels="$in_channels + __class__")), "layer 0 (a): out_channels: cannot read '__class__'"),
    (net(conv("a", out_channels=True)), "layer 0 (a): out_channels: Input should be a valid integer"),
    (net(conv("a", out_channels=1e30)), "layer 0 (a): out_channels: Input should be a valid integer"),
    (net(conv("a", out_channels=0)), "layer 0 (a): out_channels: Input should be greater than 0"),
    (net(conv("a", out_channels=-4)), "layer 0 (a): out_channels: Input should be greater than 0"),
    (net(conv("a", bias="yes")), "layer 0 (a): bias: Input should be a valid boolean"),
    (net({"name": "d", "type": "dropout", "p": True}), "layer 0 (d): p: Input should be a number, not true or false"),
    (net(conv("a", **{"if": "$in_channels"})), "layer 0 (a): if: must be true or false, got 4"),
    (net(conv("a", **{"if": "$in_channels and true"})), "layer 0 (a): if: and / or / not need true or false"),
    (net(conv("a", kernal_size=1, **{"if": False})), "layer 0 (a): kernal_size: unknown field (did you mean 'kernel_size'?)"),
    (net(conv("a"), blocks={"unused": {"layers": [conv(kernal_size=1)]}}),
     "model: blocks.unused.layers[0]: kernal_size: unknown field (did you mean 'kernel_size'?)"),
    (net(conv("a"), blocks={"unused": {"layers": [{"type": "convv"}]}}),
     "model: blocks.unused.layers[0]: type: unknown type 'convv' (did you mean 'conv'?)"),
    (net(conv("a"), blocks={"unused": {"layers": [{"block": "nosuch"}]}}),
     "model: blocks.unused.layers[0]: block: unknown block 'nosuch'"),
    (net(conv("a"), blocks={"unused": {"params": {"stride": 1}, "layers": [conv()]},
                            "user": {"layers": [{"block": "unused", "strde": 2}]}}),
     "model: blocks.user.layers[0]: block 'unused' has no parameter 'strde' (did you mean 'stride'?)"),
    (net(conv("a"), {"name": "d", "block": "b", "strde": 2, "if": False},
         blocks={"b": {"params": {"stride": 1}, "layers": [conv(stride="$stride")]}}),
     "layer 1 (d): block 'b' has no parameter 'strde' (it takes stride) (did you mean 'stride'?)"),
    (net(conv("a"), defaults={"convv": {"bias": False}}), "model: defaults: unknown type 'convv' (did you mean 'conv'?)"),
    (net({"name": "s", "block": "b", "repeat": 10_000_000}, blocks={"b": {"layers": [conv()]}}),
     "layer 0 (s): repeat: must be a whole number from 1 to 20,000"),
    (net({"name": "s", "block": "b", "repeat": 200}, blocks={"b": {"layers": [{"block": "c", "repeat": 200}]},
                                                          "c": {"layers": [{"type": "relu"}]}}),
     "the network expands to more than 20,000 layers"),
    (net({"name": "s", "block": "b", "first": 3}, blocks={"b": {"layers": [conv()]}}),
     "layer 0 (s): first: a mapping of the first copy's parameters, got 3"),
    (net({"name": "s", "block": "b", "inline": True}, blocks={"b": {"layers": [conv()]}}),
     "layer 0 (s): inline: true puts the block's layers in this list under their own names, so "
     "the line takes no name: (drop one of the two)"),
    (net({"block": "b", "inline": "yes"}, blocks={"b": {"layers": [conv()]}}),
     "inline: true or false, got 'yes'"),
    (net({"name": "s", "block": "b"}, blocks={"b": {"params": {"in_channels": 3}, "layers": [conv()]}}),
     "model: blocks.b.params: 'in_channels' is set by cnnkit"),
    (net({"name": "s", "block": "b", "start": 0}, blocks={"b": {"params": {"start": 1}, "layers": [conv()]}}),
     "model: blocks.b.params: 'start' is a keyword of the line that uses a block"),  # (was copy numbering)
    (net({"name": "x" * 5000, "type": "relu"}), "makes a name of 5000 characters (at most 200)"),
    (net({"name": "ñandú", "type": "relu"}), "is not a usable name (ASCII letters"),
    (net({"name": "c\n", "type": "relu"}), "is not a usable name"),  # ($ matches before a \n)
    (net({"type": "x" * 5000}), "type: unknown type 'xxxxxxxx"),
    (net(conv("a"), conv("b", inputs=["a", "a"])), "layer 1 (b): inputs: a conv layer takes one input"),
    (net(conv("a"), {"name": "a.b", "type": "relu"}), "layer 1 (a.b): name: 'a.b' clashes with 'a'"),
    (net({"name": "a.b", "type": "relu"}, {"name": "a", "type": "relu"}), "layer 1 (a): name: 'a' clashes with 'a.b'"),
]  # fmt: skip


@pytest.mark.parametrize("spec, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_each_mistake_is_one_short_line_naming_layer_and_field(spec, message):
    with pytest.raises(ConfigError) as e:
        build_model(spec, device="meta")
    text = str(e.value)
    assert message in text and "\n" not in text and len(text) < 300, text


def test_absurd_sizes_are_refused_naming_the_memory():
    huge = net({"name": "fc", "type": "linear", "out_features": 10**7}, input=[10**7])
    with pytest.raises(
        ConfigError, match=r"model: net needs 400.0 TB \(100,000,010,000,000 parameters"
    ):
        build_model(huge, device="meta")
    with pytest.raises(ConfigError, match=r"available \(MemAvailable in /proc/meminfo\)"):
        build_model(net({"name": "fc", "type": "linear", "out_features": 10**6}, input=[10**6]))
    wide = net(
        {"name": "c", "type": "conv", "out_channels": 10**6, "kernel_size": 1},
        input=[3, 2**15, 2**15],
    )
    with pytest.raises(ConfigError, match="activation values per image"):
        build_model(wide, device="meta")


def test_the_readme_example_builds_as_it_says():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    example = re.search(r"```yaml\n(.*?)```", readme.split("## The network file")[1], re.S)
    model = build_model(load_yaml(example.group(1))["model"])
    names = [row.name for row in model.table]
    assert "layer2.0.downsample.0" in names and "layer2.0.downsample.1" in names
    assert not any(n.startswith(("layer1.0.downsample", "layer2.1.downsample")) for n in names)
    assert model.get_submodule("layer2.0.dw").groups == 128  # $in_channels: conv1's 2 x 64
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_expansion_work_is_bounded_even_where_copies_make_no_layers():
    """Copies of a block whose layers are all absent make no layer, yet cost work: the work
    itself is bounded, so a file of 4 * 10^8 empty copies is an error line, not an hour's hang."""
    blocks = {
        "nothing": {"layers": [{"type": "relu", "if": False}]},
        "many": {"layers": [{"block": "nothing", "repeat": 2000}]},
    }
    with pytest.raises(ConfigError) as e:
        build_model(
            net({"name": "x", "block": "many", "repeat": 100}, blocks=blocks), device="meta"
        )
    assert "entries" in str(e.value) and "check repeat" in str(e.value)
    assert str(e.value).startswith("layer 0 (x") and "\n" not in str(e.value)


def test_an_inline_block_inside_a_block_names_its_layers_there_as_at_the_top_level():
    pair = {"layers": [conv("c"), {"name": "r", "type": "relu"}]}
    outer = {"layers": [{"block": "pair", "inline": True},
                        {"name": "s", "type": "add", "inputs": ["c", "input"]}]}  # fmt: skip
    model = build_model(net({"name": "o", "block": "outer"}, blocks={"pair": pair, "outer": outer}))
    assert [row.name for row in model.table] == ["o.c", "o.r", "o.s"]
    assert model.table[2].inputs == ("o.c", "input")
    x = torch.randn(2, 4, 8, 8)
    torch.testing.assert_close(model(x), model.o.c(x) + x)


def test_a_single_copy_whose_first_block_takes_the_lines_parameters_builds():
    """repeat: 1 with first: {block: down}: the one copy is down's, so the line's stride is
    down's parameter (the check of a line left out by if: refused it as plain's)."""
    blocks = {"plain": {"params": {"out": 4}, "layers": [conv(out_channels="$out")]},
              "down": {"params": {"out": 4, "stride": 1},
                       "layers": [conv(out_channels="$out", stride="$stride")]}}  # fmt: skip
    line = {"name": "s", "block": "plain", "repeat": 1, "first": {"block": "down"}, "stride": 2}
    assert build_model(net(line, blocks=blocks), device="meta").output_shape == (4, 4, 4)
    unused = {**blocks, "user": {"layers": [{k: v for k, v in line.items() if k != "name"}]}}
    assert build_model(net(conv("a"), blocks=unused), device="meta").output_shape == (4, 8, 8)


def test_a_first_block_with_other_parameters_is_named_in_the_error():
    blocks = {
        "unit": {"params": {"out": None, "p": 0.0}, "layers": [conv("c", out_channels="$out")]},
        "down": {"params": {"out": None}, "layers": [conv("c", out_channels="$out", stride=2)]},
    }
    line = {"name": "st", "block": "unit", "out": 6, "repeat": 3, "first": {"block": "down"}}
    with pytest.raises(ConfigError) as e:
        build_model(net({**line, "p": 0.1}, blocks=blocks), device="meta")
    assert "first: block 'down' has no parameter 'p' (it takes out; the line's" in str(e.value)
    assert "'unit'" not in str(e.value)
    model = build_model(net(line, blocks=blocks), device="meta")
    assert model.output_shape == (6, 4, 4)


def test_and_or_do_not_evaluate_the_side_the_left_decides_as_in_python():
    guard = {"params": {"g": 0}, "layers": [
        conv("c", **{"if": "$g == 0 or $in_channels % $g == 0"})]}  # fmt: skip
    model = build_model(net({"name": "x", "block": "b"}, blocks={"b": guard}), device="meta")
    assert [row.name for row in model.table] == ["x.c"]
    model = build_model(
        net({"name": "x", "block": "b", "g": 3}, blocks={"b": guard}), device="meta"
    )
    assert model.table == []  # 4 % 3 != 0: absent
    from cnnkit.nn.expr import ExprError, evaluate

    params = {"z": 0, "t": True}
    assert evaluate("$z != 0 and 1 // $z == 1", params) is False
    assert evaluate("not ($z == 0 or $missing)", params) is False
    assert evaluate("$t and ($z == 0 or 1 // $z > 0) and not false", params) is True
    with pytest.raises(ExprError, match="division by zero"):
        evaluate("$z == 0 and 1 // $z == 1", params)
    with pytest.raises(ExprError, match="unexpected"):  # the skipped side is still read
        evaluate("true or 1 2", params)


def test_huge_numbers_in_expressions_are_one_line():
    n = int("9" * 150)
    product = " * ".join(["$n"] * 33)  # about 5,000 digits: past Python's int-string limit
    block = {"params": {"n": None}, "layers": [conv(out_channels=product)]}
    spec = net({"name": "x", "block": "b", "n": n}, blocks={"b": block})
    with pytest.raises(ConfigError) as e:
        build_model(spec, device="meta")
    assert "too large" in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 300
    block = {"params": {"n": None}, "layers": [conv(out_channels="$n")]}
    spec = net({"name": "x", "block": "b", "n": 10**5000}, blocks={"b": block})
    with pytest.raises(ConfigError) as e:
        build_model(spec, device="meta")
    assert "an integer of about 5,001 digits" in str(e.value) and len(str(e.value)) < 300


UP = {  # a U-Net decoder step: upsample the path, concatenate the encoder's skip, convolve
    "inputs": ["input", "skip"],
    "params": {"out": None},
    "layers": [
        {"name": "up", "type": "conv_transpose", "out_channels": "$out", "kernel_size": 2, "stride": 2},
        {"name": "cat", "type": "concat", "inputs": ["up", "skip"]},
        {"name": "conv", "type": "conv", "out_channels": "$out", "kernel_size": 3, "padding": 1},
    ],
}  # fmt: skip


def test_a_block_with_a_skip_input_computes_the_decoder_it_describes():
    model = build_model(net(
        conv("e1", out_channels=6), {"name": "p1", "type": "maxpool", "kernel_size": 2},
        conv("e2", out_channels=8), {"name": "p2", "type": "maxpool", "kernel_size": 2},
        conv("mid", out_channels=8),
        {"name": "d2", "block": "up", "inputs": ["mid", "e2"], "out": 8},
        {"name": "d1", "block": "up", "inputs": ["d2", "e1"], "out": 4},
        blocks={"up": UP})).eval()  # fmt: skip
    assert model.output_shape == (4, 8, 8)
    assert [r.name for r in model.table][-6:] == [
        "d2.up",
        "d2.cat",
        "d2.conv",
        "d1.up",
        "d1.cat",
        "d1.conv",
    ]
    m = model
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        e1 = m.e1(x)
        e2 = m.e2(m.p1(e1))
        d2 = m.d2.conv(torch.cat([m.d2.up(m.mid(m.p2(e2))), e2], 1))
        d1 = m.d1.conv(torch.cat([m.d1.up(d2), e1], 1))
        torch.testing.assert_close(model(x), d1)


def test_repeated_copies_chain_the_first_input_and_share_the_others():
    add = {
        "inputs": ["input", "bias"],
        "layers": [{"name": "s", "type": "add", "inputs": ["input", "bias"]}],
    }
    model = build_model(net(conv("b"), {"name": "r", "block": "add", "inputs": ["b", "b"], "repeat": 3},
                            blocks={"add": add})).eval()  # fmt: skip
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model.b(x) * 4)  # ((b + b) + b) + b


@pytest.mark.parametrize("line, message", [
    ({"name": "d", "block": "up", "out": 4}, r"layer 1 \(d\): inputs: block 'up' takes 2 input\(s\) \(input, skip\), got 1"),
    ({"name": "d", "block": "up", "inputs": ["c", "c", "c"], "out": 4}, r"takes 2 input\(s\) \(input, skip\), got 3"),
])  # fmt: skip
def test_a_block_given_the_wrong_number_of_inputs_is_one_line(line, message):
    with pytest.raises(ConfigError, match=message):
        build_model(net(conv("c"), line, blocks={"up": UP}))
    clash = {**UP, "layers": [*UP["layers"], {"name": "skip", "type": "relu"}]}
    with pytest.raises(ConfigError, match="'skip' names an input and a layer"):
        build_model(
            net(conv("c"), {"block": "up", "inputs": ["c", "c"], "out": 4}, blocks={"up": clash})
        )


def _one_block(*layers, **line):
    """A network of a conv `stem`, then block `b` of `layers` used once (the line's fields)."""
    return net(conv("stem"), {"name": "x", "block": "b", **line},
               blocks={"b": {"params": {"c": 8, "s": 1}, "layers": list(layers)}})  # fmt: skip


@pytest.mark.parametrize("spec, message", [
    (_one_block(conv(out_channels="$c / 2")),
     r"x.conv0\): out_channels: Input should be a valid integer \(got 4.0\) \('\$c / 2' is "
     r"4.0, a real number: // divides to a whole one, / to a real one\)"),
    (_one_block(conv(out_channels="$s"), s="$in_channels / 2"), r"\('\$s' is 2.0, a real"),
    (_one_block(conv(out_channels="$c * 1.5")),  # no division to blame
     r"\('\$c \* 1.5' is 12.0, a real number: a real factor makes one; sizes are whole"),
    (_one_block(conv(stride="$in_channels - 3.0")),  # neither division nor a factor
     r"\('\$in_channels - 3.0' is 1.0, a real number: sizes are whole numbers\)"),
    (_one_block({"type": "channel_split", "points": ["$in_channels / 8"], "part": 0}),
     r"points.0: .*\(got 0.5\) \('\$in_channels / 8' is 0.5, a real number"),
    (_one_block(conv("c1", inputs="stem")), r"inputs: 'stem' is outside this block, whose "
     r"layers read `input` and one another \(give the block line `inputs: stem`\)"),
    (_one_block(conv("c1", inputs="c2"), conv("c2")), r"inputs: 'c2' comes later"),
    (_one_block(conv("c1", **{"if": "s == 2"})),
     r"if: must be true or false, got 's == 2' \(parameters are read with \$: '\$s == 2'\)"),
    (_one_block(conv("c1", **{"if": "yes"})), r"got 'yes' \(a condition is true, false or an "
     r"expression of \$parameters\)"),
    (_one_block(conv("c1", out_channels="$index")),
     r"x.c1\): out_channels: \$index is the copy's number on the parameters of a block line "
     r"that repeats \(`\{block: b, repeat: N, k: \$index\}`\), not inside the block"),
    (net({"block": None}), r"^layer 0: block: the name of a block under model.blocks, got None$"),
])  # fmt: skip
def test_what_a_network_file_gets_wrong_in_blocks_is_said_with_the_fix(spec, message):
    with pytest.raises(ConfigError, match=message):
        build_model(spec)
    assert build_model(_one_block(conv(out_channels="$c // 2"))).x.conv0.out_channels == 4


def test_a_folder_given_for_a_network_says_so(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "last.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"run' is a folder, not a network file \(a trained "
                                          r"run's: model: \{network: NET, weights: FILE\}\)$"):  # fmt: skip
        build_model(str(tmp_path / "run"))
