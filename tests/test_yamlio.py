"""The one YAML reader: duplicate keys, alias bombs, deep nesting and huge files are refused in
one line with the line and column, before anything big is built."""

import re
from pathlib import Path

import pytest
import yaml

from cnnkit import ConfigError
from cnnkit.nn import yamlio
from cnnkit.nn.yamlio import MAX_DEPTH, MAX_NODES, load_yaml, read_yaml

LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
)  # 9^9 = 387,420,489 values once expanded, in 410 bytes


def test_plain_documents_and_merge_keys_read_as_safe_load_does():
    text = "base: &b {x: 1, y: [1, 2]}\nd: {<<: *b, x: 2}\nlist: [*b, *b]\n"
    assert load_yaml(text) == yaml.safe_load(text)
    assert load_yaml("- 1\n- {a: null}\n") == [1, {"a": None}]


@pytest.mark.parametrize(
    "text, problem, line",
    [
        ("model:\n  input: [3, 8, 8]\n  input: [1, 8, 8]\n", "duplicate key 'input'", 3),
        ("a: {b: 1, b: 2}\n", "duplicate key 'b'", 1),
        (LAUGHS, f"more than {MAX_NODES:,} values once aliases are expanded", None),
        ("x: " + "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5), "nested more than", 1),
        ("x: &x [1, *x]\n", "an alias refers to itself", 1),
        ("a: [1, 2\n", "expected ',' or ']'", None),
    ],
    ids=["duplicate", "duplicate-flow", "alias-bomb", "deep", "recursive", "syntax"],
)
@pytest.mark.parametrize("parser", ["pyyaml", "libyaml"])
def test_bad_documents_are_one_line_naming_line_and_column(
    tmp_path, monkeypatch, text, problem, line, parser
):
    if parser == "libyaml":  # what a document over FAST_FROM characters is parsed by
        monkeypatch.setattr(yamlio, "FAST_FROM", 0)
    path = tmp_path / "net.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_yaml(path)
    message = str(e.value)
    assert message.startswith(f"{path}: not valid YAML (line ") and problem in message
    assert "\n" not in message and len(message) < 300
    if line is not None:
        assert f"(line {line}, column" in message


@pytest.mark.parametrize("parser", ["pyyaml", "libyaml"])
def test_values_are_counted_while_reading_not_once_all_is_read(monkeypatch, parser):
    """A large flat document (no aliases) stops at the bound while it is composed: a 16 MiB
    one is refused in seconds, not after minutes of building every node."""
    monkeypatch.setattr(yamlio, "MAX_NODES", 1000)
    monkeypatch.setattr(yamlio, "FAST_FROM", 0 if parser == "libyaml" else 2**20)
    with pytest.raises(yamlio.LimitError) as e:
        load_yaml("model: [" + ", ".join(["0"] * 5000) + "]\n")
    assert e.value.problem == "more than 1,000 values"  # (not "once aliases are expanded")
    assert e.value.problem_mark.line == 0 and e.value.problem_mark.column > 1000


def test_libyaml_reads_every_zoo_file_as_pyyaml_does(monkeypatch):
    import cnnkit.zoo

    zoo = Path(cnnkit.zoo.__file__).parent
    texts = [path.read_text() for path in sorted(zoo.rglob("*.yaml"))]
    assert len(texts) > 20
    plain = [load_yaml(text) for text in texts]
    monkeypatch.setattr(yamlio, "FAST_FROM", 0)
    assert [load_yaml(text) for text in texts] == plain


def test_load_yaml_raises_yaml_errors_so_callers_keep_their_fallbacks():
    with pytest.raises(yaml.YAMLError):
        load_yaml("{a: 1, a: 2}")
    with pytest.raises(yaml.YAMLError):
        load_yaml(LAUGHS)


def test_files_too_large_or_unreadable(tmp_path):
    big = tmp_path / "big.yaml"
    with big.open("w") as f:
        f.seek(17 * 2**20)
        f.write("\n")
    with pytest.raises(ConfigError, match="larger than 16 MiB"):
        read_yaml(big)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff")
    with pytest.raises(ConfigError, match="bin.yaml: not a text file: give a zoo name"):
        read_yaml(binary)


def test_integers_past_pythons_digit_limit_are_a_yaml_error_line(tmp_path):
    path = tmp_path / "net.yaml"
    path.write_text("model:\n  out: " + "7" * 5000 + "\n")
    with pytest.raises(ConfigError) as e:
        read_yaml(path)
    message = str(e.value)
    assert message.startswith(f"{path}: not valid YAML (line 2, column 8): an integer of 5,000")
    assert "\n" not in message and len(message) < 300
    assert load_yaml("a: " + "7" * 4000) == {"a": int("7" * 4000)}  # under the limit: read


def test_aliases_nesting_past_the_depth_bound_are_refused(tmp_path):
    """Each anchor nests 45 levels (under the bound) and holds the one before: 1,100 levels
    once expanded, in 2.6 KB, which would overflow the stack of whatever walks it."""
    lines = ["a0: &a0 " + "[" * 45 + "1" + "]" * 45]
    lines += [f"a{i}: &a{i} " + "[" * 45 + f"*a{i - 1}" + "]" * 45 for i in range(1, 25)]
    path = tmp_path / "net.yaml"
    path.write_text("\n".join(lines) + "\nmodel: {input: [3], layers: [{type: relu, x: *a24}]}\n")
    with pytest.raises(ConfigError) as e:
        read_yaml(path)
    message = str(e.value)
    assert message.startswith(f"{path}: not valid YAML (line ")
    assert f"nested more than {MAX_DEPTH} levels deep once aliases are expanded" in message
    shallow = "a: &a [[1]]\nb: &b [*a, *a]\nc: [*b, *b]\n"  # 5 levels expanded: fine
    assert load_yaml(shallow) == yaml.safe_load(shallow)


@pytest.mark.parametrize("value, read", [("032", 26), ("-064", -52), ("1:0", 60), ("0b10", 2)])
def test_yaml_1_1_integers_that_are_not_what_they_look_are_refused(tmp_path, value, read):
    path = tmp_path / "net.yaml"
    path.write_text(f"model:\n  input: [3, {value}, 8]\n")
    with pytest.raises(
        ConfigError, match=rf"line 2, .*{value} is read by YAML 1.1 as {read}, not as"
    ):
        read_yaml(path)
    path.write_text("a: [0, -0, 10, 0x10, 1_000, '032']\n")
    assert read_yaml(path) == {"a": [0, 0, 10, 16, 1000, "032"]}


@pytest.mark.parametrize("fast", [False, True], ids=["python", "libyaml"])
@pytest.mark.parametrize("value", ["!!float abc", "!!float .", "!!bool maybe", '!!bool ""',
                                   '!!int ""', '!!int "-"', "!!int 0b", "!!int abc", "!!int 0o9",
                                   "!!map abc", "!!map [1, 2]"])  # fmt: skip
def test_a_tag_that_does_not_fit_its_value_is_named_at_its_line(tmp_path, monkeypatch, value,
                                                                 fast):  # fmt: skip
    """PyYAML's constructors let `!!float abc` out as a bare ValueError (`!!bool maybe` a
    KeyError, `!!int ""` an IndexError): a traceback from any file or override, where it is
    one line; `!!int abc` said it was too long. Tags that fit still read."""
    monkeypatch.setattr(yamlio, "FAST_FROM", 0 if fast else 2**20)
    path = tmp_path / "net.yaml"
    path.write_text(f"model:\n  input: [3, 8, 8]\n  x: {value}\n")
    told = value.split(" ", 1)[1].strip('"')
    told = "a list" if told.startswith("[") else repr(told)
    with pytest.raises(ConfigError) as e:
        read_yaml(path)
    assert str(e.value) == (f"{path}: not valid YAML (line 3, column 6): {told} is not a "
                            f"valid {value.split()[0]}")  # fmt: skip
    assert load_yaml("a: [!!float 1, !!int '7', !!bool yes]") == {"a": [1.0, 7, True]}


def test_a_tagged_override_that_does_not_fit_is_one_line(capsys):
    from helpers import one_error_line, run_cli

    code, _, err = run_cli(["config", "digits", "train.lr=!!float abc"], capsys)
    assert one_error_line(code, err, (2,)).startswith("cnnkit: error: train.lr: ")


def test_utf16_files_read_and_other_encodings_are_named(tmp_path):
    path = tmp_path / "net.yaml"
    path.write_bytes("# réseau\na: [1, 2]\n".encode("utf-16"))  # Notepad's "Unicode"
    assert read_yaml(path) == {"a": [1, 2]}
    path.write_bytes("# réseau\na: 1\n".encode("latin-1"))
    with pytest.raises(
        ConfigError, match=r"net.yaml: not UTF-8 text \(byte 0xe9 at line 1, column 4\)"
    ):
        read_yaml(path)
    path.write_bytes(b"\xff\xfe garbage\n")  # a UTF-16 mark on what is not UTF-16
    with pytest.raises(ConfigError, match="not a text file"):
        read_yaml(path)


def test_yaml_1_1_base_60_floats_are_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 1:30.5\n")
    with pytest.raises(ConfigError, match=r"1:30.5 is read by YAML 1.1 as 90.5, not as written"):
        read_yaml(path)


DATED_NET = """model:
  input: [1, 6, 6]
  num_classes: 2
  defaults: {conv: {kernel_size: 3}}
  blocks:
    b:
      params:
        tag: 2024-01-01
        out: 2
      layers:
        - {type: conv, out_channels: $out}
  layers:
    - {name: b1, block: b, tag: 2024-01-02 10:00:00}
    - {type: global_avgpool}
    - {type: linear}
"""


@pytest.mark.parametrize("parser", ["pyyaml", "libyaml"])
def test_dates_and_times_read_as_the_text_written(monkeypatch, parser):
    """A date-like value (a tag, a version) is the string written, a type JSON and a checkpoint
    read with weights_only hold, never a datetime that training keeps and eval then refuses."""
    monkeypatch.setattr(yamlio, "FAST_FROM", 0 if parser == "libyaml" else 2**20)
    text = "a: 2024-01-01\nb: 2001-12-14 21:59:43.10 -5\n2024-01-02: x\nc: !!timestamp 2020-1-1\n"
    assert load_yaml(text) == {"a": "2024-01-01", "b": "2001-12-14 21:59:43.10 -5",
                               "2024-01-02": "x", "c": "2020-1-1"}  # fmt: skip


def test_a_network_with_dates_in_its_params_round_trips_through_a_checkpoint(tmp_path):
    import io
    import json

    import torch

    from cnnkit import build_model

    path = tmp_path / "net.yaml"
    path.write_text(DATED_NET)
    network = build_model(str(path))
    buffer = io.BytesIO()
    torch.save({"model_spec": network.spec}, buffer)
    buffer.seek(0)
    spec = torch.load(buffer, weights_only=True)["model_spec"]  # as eval and --resume read it
    assert spec["blocks"]["b"]["params"]["tag"] == "2024-01-01"
    again = build_model(json.loads(json.dumps(spec)))  # as an export's metadata holds it
    assert [row.name for row in again.table] == [row.name for row in network.table]


def test_a_network_given_as_python_objects_reads_as_its_file_would(tmp_path):
    """The Python API's dates, NumPy numbers, tuples and paths become what a YAML file gives, so
    the network a run saves in its checkpoint loads with weights_only (a date used to be kept
    as an object, and eval then refused the checkpoint)."""
    import datetime
    import enum
    import io

    import numpy as np
    import torch

    from cnnkit import build_model
    from cnnkit.config import load_run

    network = load_yaml(DATED_NET)
    network["model"]["blocks"]["b"]["params"]["tag"] = datetime.date(2024, 1, 1)
    network["model"]["input"] = tuple(np.int64(v) for v in network["model"]["input"])
    mode = enum.Enum("Mode", {"FAST": "fast"}, type=str)  # a str Enum (StrEnum: 3.11+)
    network["model"]["blocks"]["b"]["params"].update(
        rate=np.float64(0.5), word=np.str_("x"), flag=np.bool_(True),
        kind=enum.IntEnum("Kind", "A B").B, mode=mode.FAST)  # fmt: skip
    network["model"]["weights_keys"] = [{"match": "x", "to": Path("y")}]
    spec = build_model(network).spec
    buffer = io.BytesIO()
    torch.save({"model_spec": spec}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["model_spec"]
    plain = build_model(load_yaml(DATED_NET)).spec
    plain["blocks"]["b"]["params"].update(rate=0.5, word="x", flag=True, kind=2, mode="fast")
    assert loaded == spec == plain | {"weights_keys": [{"match": "x", "to": "y"}]}
    assert type(loaded["input"][0]) is int
    kept = loaded["blocks"]["b"]["params"]  # NumPy's float64 and str_ subclass float and str
    assert [(type(kept[k]), kept[k]) for k in ("rate", "word", "flag", "kind", "mode")] == [
        (float, 0.5), (str, "x"), (bool, True), (int, 2), (str, "fast")]  # fmt: skip
    run = {
        "model": network["model"],
        "data": {"source": "digits"},
        "name": datetime.date(2024, 1, 1),
    }
    assert load_run(run).name == "2024-01-01"
    with pytest.raises(ConfigError, match=r"^the top level: a key of type tuple: keys are text"):
        load_run({(1, 2): 3, **run})


@pytest.mark.parametrize("where, value, problem", [
    ("blocks.b.params.tag", object(), "model.blocks.b.params.tag: object is not a value"),
    ("blocks.b.params.tag", b"x", "model.blocks.b.params.tag: bytes is not a value"),
    ("blocks.b.params", {(1, 2): 3}, "model.blocks.b.params: a key of type tuple: keys are"),
])  # fmt: skip
def test_python_objects_of_no_file_type_are_one_line_naming_the_key(where, value, problem):
    from cnnkit import build_model
    from cnnkit.config import load_run

    network = load_yaml(DATED_NET)
    *path, last = where.split(".")
    holder = network["model"]
    for key in path:
        holder = holder[key]
    holder[last] = value
    with pytest.raises(ConfigError, match="^" + re.escape(problem)):
        build_model(network["model"])
    with pytest.raises(ConfigError, match="^" + re.escape(problem)):
        load_run({**network, "data": {"source": "digits"}})


@pytest.mark.parametrize("value", ["!!binary aGVsbG8=", "!!set {x, y}", "!!omap [a: 1]"])
def test_values_of_no_json_type_are_refused_at_their_line(tmp_path, value):
    path = tmp_path / "net.yaml"
    path.write_text(f"model:\n  input: {value}\n")
    with pytest.raises(ConfigError) as e:
        read_yaml(path)
    tag = value.split()[0]
    assert str(e.value).startswith(f"{path}: not valid YAML (line 2, column 10): {tag} is not")
