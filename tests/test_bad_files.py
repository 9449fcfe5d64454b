"""A corpus of bad network and run files, each through the CLI in this process (`cnnkit info`
for networks, `cnnkit train` for runs): exit status 2, exactly one short `cnnkit: error:` line
naming the problem, no traceback, and nothing written."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import run_cli

NET = """model:
  input: [3, 16, 16]
  num_classes: 4
  layers:
    - {name: c1, type: conv, out_channels: 8, kernel_size: 3}
    - {name: fc, type: linear}
"""
LAYER = "    - {name: c1, type: conv, out_channels: 8, kernel_size: 3}\n"
BLOCKS = "  blocks:\n    b: {params: {w: 4}, layers: [{name: c, type: conv, out_channels: $w, kernel_size: 1}]}\n"
LAUGHS = "".join(
    f"  {n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n"
    for p, n in zip("abcdefgh", "bcdefghi", strict=True)
)


def layer(text: str) -> str:
    """The small network with its first layer replaced."""
    return NET.replace(LAYER, f"    - {text}\n")


def block_line(text: str) -> str:
    """The small network with a block, its first layer replaced by a line using it."""
    return layer(text).replace("  layers:\n", BLOCKS + "  layers:\n")


NETWORKS = [  # (what is wrong, file text, a piece of the expected message)
    ("unclosed bracket", NET.replace("kernel_size: 3}", "kernel_size: 3"), "not valid YAML (line 6, column"),
    ("tab indent", NET.replace("  input", "\tinput"), "not valid YAML (line 2, column 1)"),
    ("duplicate key", NET + "  layers: []\n", "duplicate key 'layers'"),
    ("duplicate field", layer("{name: c1, name: c2, type: conv, out_channels: 8, kernel_size: 3}"), "duplicate key 'name'"),
    ("alias bomb", "model:\n  a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + LAUGHS, "values once aliases are expanded"),
    ("deep nesting", "model: " + "[" * 500 + "]" * 500, "nested more than 50 levels deep"),
    ("recursive alias", "model: &m {layers: *m}\n", "an alias refers to itself"),
    ("empty file", "", "net.yaml: the file is empty"),
    ("a list", "- 1\n- 2\n", "expected a mapping with 'layers'"),
    ("no layers", NET.split("  layers")[0], "no 'layers' list"),
    ("layers empty", NET.split("  layers")[0] + "  layers: []\n", "model: layers: must not be empty"),
    ("input 2-D", NET.replace("[3, 16, 16]", "[3, 16]"), "input: give [C, H, W]"),
    ("input zero", NET.replace("[3, 16, 16]", "[3, 0, 16]"), "input.1: Input should be greater than 0"),
    ("input true", NET.replace("[3, 16, 16]", "[3, true, 16]"), "input.1: Input should be a valid integer"),
    ("input huge", NET.replace("[3, 16, 16]", "[3, 1.0e+30, 16]"), "input.1: Input should be a valid integer"),
    ("num_classes 0", NET.replace("num_classes: 4", "num_classes: 0"), "num_classes: Input should be greater than 0"),
    ("num_classes text", NET.replace("num_classes: 4", "num_classes: four"), "num_classes: Input should be a valid integer"),
    ("top-level typo", NET.replace("  layers:", "  layer: []\n  layers:"), "model: layer: unknown field"),
    ("defaults unknown type", NET.replace("  layers:", "  defaults: {convv: {bias: false}}\n  layers:"), "defaults: unknown type 'convv' (did you mean 'conv'?)"),
    ("defaults not a mapping", NET.replace("  layers:", "  defaults: {conv: 3}\n  layers:"), "defaults.conv: Input should be a valid dictionary"),
    ("empty block", NET.replace("  layers:", "  blocks: {b: {layers: []}}\n  layers:"), "blocks.b.layers: must not be empty"),
    ("reserved block param", NET.replace("  layers:", "  blocks: {b: {params: {index: 1}, layers: [{type: relu}]}}\n  layers:"), "'index' is set by cnnkit"),
    ("unknown type", layer("{name: c1, type: convv, out_channels: 8, kernel_size: 3}"), "type: unknown type 'convv' (did you mean 'conv'?)"),
    ("missing type", layer("{name: c1, out_channels: 8, kernel_size: 3}"), "layer 0 (c1): type: missing"),
    ("count true", layer("{name: c1, type: conv, out_channels: true, kernel_size: 3}"), "out_channels: Input should be a valid integer"),
    ("count 1e30 text", layer("{name: c1, type: conv, out_channels: 1e30, kernel_size: 3}"), "out_channels: Input should be a valid integer"),
    ("count 1e30 float", layer("{name: c1, type: conv, out_channels: 1.0e+30, kernel_size: 3}"), "out_channels: Input should be a valid integer"),
    ("count zero", layer("{name: c1, type: conv, out_channels: 0, kernel_size: 3}"), "out_channels: Input should be greater than 0"),
    ("count negative", layer("{name: c1, type: conv, out_channels: -8, kernel_size: 3}"), "out_channels: Input should be greater than 0"),
    ("count past 2^31", layer("{name: c1, type: conv, out_channels: 1099511627776, kernel_size: 3}"), "out_channels: Input should be less than or equal to 2147483647"),
    ("kernel too large", layer("{name: c1, type: conv, out_channels: 8, kernel_size: 33}"), "kernel_size: kernel 33 is larger than its input 16"),
    ("padding negative", layer("{name: c1, type: conv, out_channels: 8, kernel_size: 3, padding: -1}"), "layer 0 (c1): padding: Input should be greater than or equal to 0 (got -1)"),
    ("field typo", layer("{name: c1, type: conv, out_channels: 8, kernel_size: 3, strid: 2}"), "strid: unknown field"),
    ("flag as text", layer("{name: c1, type: conv, out_channels: 8, kernel_size: 3, bias: 'yes'}"), "bias: Input should be a valid boolean"),
    ("groups", layer("{name: c1, type: conv, out_channels: 8, kernel_size: 3, groups: 3}"), "groups: groups=3 must divide both"),
    ("input later", layer("{name: c1, type: conv, out_channels: 8, kernel_size: 3, inputs: fc}"), "inputs: 'fc' comes later"),
    ("input itself", layer("{name: c1, type: conv, out_channels: 8, kernel_size: 3, inputs: c1}"), "inputs: names itself (a cycle)"),
    ("input unknown", layer("{name: c1, type: conv, out_channels: 8, kernel_size: 3, inputs: c9}"), "inputs: unknown layer 'c9'"),
    ("input a list", layer("{name: c1, type: add, inputs: [[input], {a: 1}]}"), "inputs: ['input'] is not a layer name"),
    ("input a mapping", layer("{name: c1, type: add, inputs: [input, {a: 1}]}"), "inputs: {'a': 1} is not a layer name"),
    ("name twice", NET.replace("name: fc", "name: c1"), "layer 1 (c1): name: 'c1' is used twice"),
    ("name with space", layer("{name: 'c 1', type: relu}"), "name: 'c 1' is not a usable name"),
    ("name reserved", layer("{name: input, type: relu}"), "name: 'input' is not a usable name"),
    ("name ending in a dot", layer("{name: x., type: relu}"), "(ASCII letters, digits, _ and -, dots between parts as in layer4.1;"),
    ("name 5000 long", layer("{name: " + "n" * 5000 + ", type: relu}"), "makes a name of 5000 characters (at most 200)"),
    ("name of a Module attribute", layer("{name: training, type: relu}"), "name: 'training' is taken by torch's nn.Module"),
    ("name of a Network attribute", layer("{name: num_classes, type: relu}"), "name: 'num_classes' is taken by"),
    ("dotted name part", layer("{name: layer1.eval, type: relu}"), "name: 'eval' is taken by"),
    ("layer not a mapping", layer("relu"), "layers.0: Input should be a valid dictionary"),
    ("unknown block", block_line("{name: s, block: bb}"), "block: unknown block 'bb' (did you mean 'b'?)"),
    ("torch's in_channels", layer("{name: c1, type: conv, in_channels: 3, out_channels: 8, kernel_size: 3}"), "in_channels: unknown field (cnnkit reads it from the layer's input: leave it out)"),  # not 'did you mean out_channels?'
    ("torch's num_parameters", layer("{name: c1, type: prelu, num_parameters: 1}"), "num_parameters: unknown field (channelwise: true is torch's num_parameters=C"),
    ("unknown block param", block_line("{name: s, block: b, ww: 3}"), "block 'b' has no parameter 'ww' (it takes w)"),
    ("block line keyword typo", block_line("{name: s, block: b, reapeat: 2}"), "has no parameter 'reapeat' (it takes w) (did you mean 'repeat'?)"),
    ("default before its parameter", block_line("{name: s, block: b}").replace("params: {w: 4}", "params: {v: '$w + 1', w: 4}"), "blocks.b.params: the default of v uses $w, a parameter after it: defaults are read in order, so list w first"),
    ("repeat 10^7", block_line("{name: s, block: b, repeat: 10000000}"), "repeat: must be a whole number from 1 to 20,000"),
    ("repeat 0", block_line("{name: s, block: b, repeat: 0}"), "repeat: must be a whole number from 1 to 20,000, got 0"),
    ("repeat true", block_line("{name: s, block: b, repeat: true}"), "repeat: must be a whole number"),
    ("repeats past 20,000 layers", block_line("{name: s, block: b, repeat: 20000}").replace("out_channels: $w, kernel_size: 1", "out_channels: $w, kernel_size: 1}, {type: relu"), "expands to more than 20,000 layers"),
    ("block holds itself", NET.replace("  layers:", "  blocks: {r: {layers: [{block: r}]}}\n  layers:").replace(LAYER, "    - {name: s, block: r}\n"), "blocks nest more than 16 deep"),
    ("expression cut short", layer("{name: c1, type: conv, out_channels: '$in_channels *', kernel_size: 3}"), "out_channels: the expression ends where a value should be"),
    ("unknown parameter", layer("{name: c1, type: conv, out_channels: $width, kernel_size: 3}"), "out_channels: $width is not a parameter here"),
    ("division by zero", layer("{name: c1, type: conv, out_channels: '$in_channels // 0', kernel_size: 3}"), "out_channels: division by zero"),
    ("overflow", block_line("{name: s, block: b, w: 1" + "0" * 400 + "}").replace("$w,", "'$w / 3',"), "out_channels: '/': the result is too large"),
    ("code in an expression", layer("{name: c1, type: conv, out_channels: '$in_channels.__class__', kernel_size: 3}"), "out_channels: cannot read '.__class__'"),
    ("condition not boolean", layer("{name: c1, type: conv, out_channels: 8, kernel_size: 3, if: $in_channels}"), "if: must be true or false, got 3"),
    ("400 TB linear", NET.replace("[3, 16, 16]", "[10000000]").replace(LAYER, "    - {name: fc0, type: linear, out_features: 10000000}\n"), "needs 400.0 TB"),
    ("huge activations", NET.replace("[3, 16, 16]", "[3, 100000, 100000]").replace("out_channels: 8", "out_channels: 1000, padding: 1"), "activation values per image"),
    ("lrn convention", layer("{name: n, type: lrn}"), "layer 0 (n): convention: required: paper or caffe"),
    ("dropout p", layer("{name: d, type: dropout, p: 1.5}"), "p: Input should be less than 1"),
    ("init rule", layer("{name: c1, type: conv, out_channels: 8, kernel_size: 3, init: {weight: gaussian}}"), "init: unknown init 'gaussian'"),
    ("init std < 0", layer("{name: c1, type: conv, out_channels: 8, kernel_size: 3, init: {weight: {normal: -1}}}"), "init 'normal': std -1 is negative"),
    ("init range", layer("{name: c1, type: conv, out_channels: 8, kernel_size: 3, init: {weight: {uniform: [1, 0]}}}"), "init 'uniform': the range [1, 0] is upside down"),
    ("init text std", layer("{name: c1, type: conv, out_channels: 8, kernel_size: 3, init: {weight: {normal: {std: x}}}}"), "init 'normal': std must be a finite number, not 'x'"),
    ("lr_mult name", layer("{name: c1, type: conv, out_channels: 8, kernel_size: 3, lr_mult: {bais: 2}}"), "lr_mult: names ['bais']"),
    ("concat shapes", NET.replace("{name: fc, type: linear}", "{name: p, type: maxpool, kernel_size: 2, inputs: input}\n    - {name: cat, type: concat, inputs: [c1, p]}"), "inputs: only channels may differ"),
    ("no class count", NET.replace("  num_classes: 4\n", ""), "layer 1 (fc): out_features: is not set and the network has no num_classes (set model.num_classes: N, which classes: does not count; training takes it from the data; info, show net, export and bench take --num-classes N)"),
    ("huge unknown type", layer("{name: c1, type: " + "t" * 100_000 + "}"), "type: unknown type 'tttt"),
    ("model names itself", "model: self.yaml\n", "files name each other more than 8 deep"),
]  # fmt: skip

RUN = """name: bad
model: {model}
data: {{source: digits, batch_size: 64}}
train: {{epochs: 1, device: cpu}}
"""
INLINE = "{input: [1, 8, 8], num_classes: 10, layers: [{name: c, type: conv, out_channels: 8, kernel_size: 3}, {name: fc, type: linear}]}"
RUNS = [
    ("syntax", RUN.format(model="digitnet").replace("batch_size: 64}", "batch_size: 64"), "not valid YAML (line 4, column 6)"),
    ("duplicate section", RUN.format(model="digitnet") + "train: {epochs: 2}\n", "duplicate key 'train'"),
    ("duplicate field", RUN.format(model="digitnet").replace("epochs: 1,", "epochs: 1, epochs: 2,"), "duplicate key 'epochs'"),
    ("alias bomb", RUN.format(model="digitnet") + "x:\n  a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + LAUGHS, "values once aliases are expanded"),
    ("deep nesting", RUN.format(model="digitnet") + "x: " + "[" * 500 + "]" * 500 + "\n", "nested more than 50 levels deep"),
    ("unknown zoo network", RUN.format(model="nonet"), "'nonet' is neither a zoo network"),
    ("bad inline layer", RUN.format(model=INLINE.replace("out_channels: 8", "out_channels: true")), "layer 0 (c): out_channels: Input should be a valid integer"),
    ("inline repeat 10^7", RUN.format(model=INLINE.replace("layers: [", "blocks: {b: {layers: [{type: relu}]}}, layers: [{name: s, block: b, repeat: 10000000}, ")), "repeat: must be a whole number from 1 to 20,000"),
    ("inline 400 TB", RUN.format(model=INLINE.replace("out_features", "x").replace("[{name: c, type: conv, out_channels: 8, kernel_size: 3}, ", "[{name: big, type: linear, out_features: 10000000}, {name: big2, type: linear, out_features: 10000000}, ")), "available (MemAvailable in /proc/meminfo)"),
    ("input mismatch", RUN.format(model=INLINE.replace("[1, 8, 8]", "[3, 8, 8]")), "does not match the data's images"),
    ("zoo net, other images", RUN.format(model="resnet18"), "model resnet18: input [3, 224, 224] does not match the data's images [1, 8, 8] (model.input=[1, 8, 8] builds the network for the data's images"),
    ("a NUL in a data path", RUN.format(model="digitnet").replace("{source: digits,", '{source: folder, path: "a\\0b", grey: true, crop: 8,'), "data.path: a NUL character (\\0) names no file or setting"),
    ("a prototxt for the model", RUN.format(model=Path(__file__).parent / "data" / "caffe" / "alexnet.prototxt"), "alexnet.prototxt: a Caffe prototxt: `cnnkit import-caffe"),
    ("no classifier at the end", RUN.format(model=INLINE.replace(", {name: fc, type: linear}", "")), "run.yaml: model: the last layer c (conv) gives [8, 6, 6], not scores for the data's 10 classes"),
    ("negative lr", RUN.format(model="digitnet").replace("epochs: 1,", "epochs: 1, lr: -1,"), "train.lr: Input should be greater than 0"),
    ("zero epochs", RUN.format(model="digitnet").replace("epochs: 1", "epochs: 0"), "train.epochs: Input should be greater than 0"),
    ("section typo", RUN.format(model="digitnet") + "trian: {}\n", "trian: unknown field"),
    ("no model", RUN.format(model="digitnet").replace("model: digitnet\n", ""), "a run file is a mapping with model:"),
    ("a list", "- model\n- data\n", "a run file is a mapping with model:"),
    ("empty", "", "a run file is a mapping with model:"),
]  # fmt: skip


def _write(tmp_path, name: str, text: str):
    path = tmp_path / "files" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def _check_one_line(code: int, out: str, err: str, expected: str, started: float) -> None:
    lines = err.strip().splitlines()
    assert code == 2, (code, err[-500:])
    assert len(lines) == 1 and lines[0].startswith("cnnkit: error: "), err[-500:]
    assert expected in lines[0], lines[0]
    assert len(lines[0]) <= 400 and "Traceback" not in err + out
    assert time.perf_counter() - started < 20, "took too long"  # a hang guard, not a benchmark


@pytest.mark.parametrize("what, text, expected", NETWORKS, ids=[n[0] for n in NETWORKS])
def test_bad_network_file(tmp_path, monkeypatch, capsys, what, text, expected):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, "self.yaml" if what == "model names itself" else "net.yaml", text)
    started = time.perf_counter()
    code, out, err = run_cli(["info", str(path)], capsys)
    _check_one_line(code, out, err, expected, started)
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(["files", path.name])


@pytest.mark.parametrize("what, text, expected", RUNS, ids=[r[0] for r in RUNS])
def test_bad_run_file(tmp_path, monkeypatch, capsys, what, text, expected):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, "run.yaml", text)
    started = time.perf_counter()
    code, out, err = run_cli(
        ["train", str(path), "--out", str(tmp_path / "out"), "--quiet"], capsys
    )
    _check_one_line(code, out, err, expected, started)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["files", "run.yaml"]  # nothing written


def test_binary_and_huge_files(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    files = tmp_path / "files"
    files.mkdir()
    (files / "picture.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    with (files / "huge.yaml").open("w") as f:
        f.seek(20 * 2**20)
        f.write("\n")
    for name, expected in (
        ("picture.yaml", "not a text file"),
        ("huge.yaml", "larger than 16 MiB"),
    ):
        for command in (["info"], ["train"]):
            started = time.perf_counter()
            code, out, err = run_cli([*command, str(files / name)], capsys)
            _check_one_line(code, out, err, expected, started)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["files", "huge.yaml", "picture.yaml"]


def test_the_corpus_is_large():
    assert len(NETWORKS) + len(RUNS) + 2 >= 60
