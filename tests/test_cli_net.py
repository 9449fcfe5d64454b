"""CLI smoke tests of `cnnkit zoo` and `cnnkit info`, and the one-line error contract."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_cli

from cnnkit.cli import main
from cnnkit.errors import ConfigError


def test_zoo_lists_networks(capsys):
    code, out, _ = run_cli(["zoo"], capsys)
    assert code == 0 and "alexnet-owt" in out and "resnet18" in out
    assert not [line for line in out.splitlines() if line != line.rstrip()]  # piped: unpadded
    code, out, _ = run_cli(["info", "digitnet"], capsys)
    assert code == 0 and "conv1" in out and all(line == line.rstrip() for line in out.splitlines())


@pytest.mark.parametrize("name, total", [("alexnet", "60,965,224"), ("alexnet-owt", "61,100,840")])
def test_info_ends_with_parameter_total(name, total, capsys):
    code, out, _ = run_cli(["info", name], capsys)
    lines = out.strip().splitlines()
    assert code == 0 and f"parameters: {total}" in lines[-2]
    assert "(256, 6, 6)" not in out and "256x6x6" in out


def test_info_notes_layers_that_never_reach_the_output_and_sizes_small_counts(tmp_path, capsys):
    """A branch nothing reads is counted in the table but never trained: said in a note (the
    network knew, DDP is told); a small net's multiply-adds in K, not '(0.000 G)'; a pool's
    padding past half its kernel names both."""
    net = {"model": {"input": [3, 8, 8], "num_classes": 2, "layers": [
        {"name": "c1", "type": "conv", "out_channels": 4, "kernel_size": 3},
        {"name": "side", "type": "conv", "out_channels": 4, "kernel_size": 1, "inputs": ["c1"]},
        {"name": "p", "type": "maxpool", "kernel_size": 2, "inputs": ["c1"]},
        {"type": "flatten"}, {"type": "linear"}]}}  # fmt: skip
    (tmp_path / "n.json").write_text(json.dumps(net))
    code, out, _ = run_cli(["info", str(tmp_path / "n.json")], capsys)
    assert code == 0 and "multiply-adds: 4,536 (4.536 K) per image" in out
    assert "note: 1 layer with parameters never reaches the output (side)" in out
    net["model"]["layers"][2]["padding"] = 2
    (tmp_path / "n.json").write_text(json.dumps(net))
    code, _, err = run_cli(["info", str(tmp_path / "n.json")], capsys)
    assert code == 2 and "padding: 2 must be at most half of kernel_size 2" in err


def test_info_resnet50_counts_torchvisions_parameters(capsys):
    code, out, _ = run_cli(["info", "resnet50"], capsys)
    assert code == 0 and "parameters: 25,557,032" in out and "layer4.2.relu3" in out


def test_info_piped_cuts_no_layer_name(capsys):
    """Piped, the table was 120 columns: densenet121's layer names and a concat's inputs were
    cut to `features.denseblock1.den…`, every row alike."""
    code, out, _ = run_cli(["info", "densenet121"], capsys)
    assert code == 0 and "…" not in out
    assert "features.denseblock4.denselayer16.conv2" in out
    assert " \n" not in out  # (piped: no line padded to the width)


def test_info_reads_prototxts_runs_checkpoints_and_exports(digits_run, tmp_path, capsys):
    from helpers import cli_ok

    caffe = Path(__file__).parent / "data" / "caffe" / "alexnet.prototxt"
    code, out, _ = run_cli(["info", str(caffe)], capsys)
    assert code == 0 and "parameters: 60,965,224" in out
    export = tmp_path / "digits.safetensors"
    cli_ok(["export", str(digits_run), "--format", "safetensors", "-o", str(export)])
    capsys.readouterr()
    tables = []
    for target in (digits_run, digits_run / "last.pt", export):
        code, out, err = run_cli(["info", str(target)], capsys)
        assert code == 0, err
        tables.append(out)
    assert len(set(tables)) == 1 and "digitnet" in tables[0] and "output: 10" in tables[0]
    for target in (digits_run, export):  # as export refuses it: a trained head has its classes
        code, _, err = run_cli(["info", str(target), "--num-classes", "3"], capsys)
        assert code == 2 and "--num-classes 3: " in err and "trained for its own classes" in err
        assert run_cli(["info", str(target), "--num-classes", "10"], capsys)[0] == 0  # its own
    code, _, err = run_cli(["info", str(tmp_path)], capsys)
    assert code == 1 and "(no best.pt or last.pt in it)" in err and err.count("\n") == 1


def test_info_of_a_run_file_sizes_the_head_by_its_datas_classes(tmp_path, capsys, monkeypatch):
    """As training builds it: the classes of the run's data (synthetic's count, a folder's
    class folders), not the network file's; data that cannot be read here is a note."""
    import yaml

    monkeypatch.chdir(tmp_path)  # (data paths are the working directory's, as training's)
    (tmp_path / "imgs" / ".cache").mkdir(parents=True)
    for name in ("cat", "dog", "owl"):
        (tmp_path / "imgs" / name).mkdir()
    network = {"input": [1, 8, 8], "num_classes": 1000,
               "layers": [{"type": "conv", "out_channels": 4, "kernel_size": 3},
                          {"type": "global_avgpool"}, {"name": "fc", "type": "linear"}]}  # fmt: skip
    for data, output, note in [
        ({"source": "synthetic", "num_classes": 7, "shape": [1, 8, 8]}, 7, None),
        ({"path": "imgs", "crop": 8, "grey": True}, 3, None),
        ({"source": "folder", "path": "elsewhere", "crop": 8, "grey": True}, 1000,
         "its data's classes are not known here (data.path "),
    ]:  # fmt: skip
        run = tmp_path / "run.yaml"  # (a train section info does not read: not its business)
        run.write_text(yaml.safe_dump({"model": network, "data": data, "train": {"epochs": -1}}))
        code, out, err = run_cli(["info", str(run)], capsys)
        assert code == 0 and f"output: {output}" in out, err
        assert (note in err) if note else err == "", err
        code, _, err = run_cli(["show", "net", str(run), "-o", str(tmp_path / "net.svg")], capsys)
        assert code == 0 and f">linear {output}<" in (tmp_path / "net.svg").read_text(), err


def test_info_of_an_export_under_any_name_or_size_says_what_it_is(tmp_path, capsys):
    """`export -f torchscript -o d.ts` then `info d.ts` said `not a text file`, and an ONNX
    export over 16 MiB `larger than 16 MiB: not a network or run file`: each is said to be the
    export it is (a TorchScript by its contents), with what info takes instead."""
    from helpers import cli_ok

    script = tmp_path / "d.ts"
    cli_ok(["export", "digitnet", "-f", "torchscript", "-o", str(script)])
    big = tmp_path / "big.onnx"
    with big.open("wb") as f:
        f.write(b"\x08\x08\x12\x07pytorch")
        f.truncate(17 * 2**20)
    capsys.readouterr()
    for path, kind in ((script, "a TorchScript"), (big, "an ONNX")):
        for command in (["info", str(path)], ["eval", str(path), "--data", "digits"],
                        ["classify", str(path), str(path)]):  # fmt: skip
            code, _, err = run_cli(command, capsys)  # eval said: not a checkpoint (...neither)
            assert (
                code == 2  # a usage error in each (eval's was 1)
                and len(err.splitlines()) == 1
                and err.startswith(
                    f"cnnkit: error: {path}: {kind} export, which cnnkit writes but does not read "
                    "back: give the run"
                )
            ), err


def test_info_of_a_runs_metrics_names_the_run_directory(digits_run, capsys):
    """`info RUN/metrics.csv` said `expected a mapping with 'layers' (or 'model'), got str`: it
    says what the file is and to give its run directory, as classify does."""
    code, _, err = run_cli(["info", str(digits_run / "metrics.csv")], capsys)
    assert code == 1 and err.splitlines() == [
        f"cnnkit: error: {digits_run / 'metrics.csv'}: a CSV file, not a checkpoint or network: "
        f"give its run directory {digits_run}"
    ], err


def test_a_folder_named_like_a_zoo_network_does_not_hide_it(tmp_path, capsys, monkeypatch):
    """`cnnkit info lenet5` beside a folder lenet5/ of one's own (no checkpoint in it) reads the
    zoo's network; a folder that holds a run is the run."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lenet5").mkdir()
    code, out, err = run_cli(["info", "lenet5"], capsys)
    assert code == 0 and "parameters: 61,706" in out, err
    (tmp_path / "nonzoo").mkdir()
    code, _, err = run_cli(["info", "nonzoo"], capsys)
    assert code != 0 and "not a run directory (no best.pt" in err


def test_kernel_larger_than_input_exits_2_naming_the_layer(tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(
        "model:\n  input: [1, 8, 8]\n  layers:\n"
        "    - {name: c1, type: conv, out_channels: 4, kernel_size: 11}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "cnnkit", "info", str(spec)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"cnnkit: error: {spec}: line 4: layer 0 (c1): kernel_size: kernel 11 is larger than its input 8 "
        "(input (1, 8, 8))"
    ]


def test_debug_shows_the_traceback_and_keeps_the_exit_status(tmp_path, capsys):
    """--debug adds the traceback; a script sees the status the one line would have had."""
    with pytest.raises(SystemExit) as e:
        main(["--debug", "info", str(tmp_path / "missing.yaml")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback (most recent call last)" in err
    assert "ConfigError" in err and "missing.yaml" in err


def test_usage_error_exits_2(capsys):
    code, _, err = run_cli(["info"], capsys)
    assert code == 2 and "Missing argument" in err


def test_num_classes_for_a_network_that_does_not_size_by_it_is_one_line(tmp_path, capsys):
    net = tmp_path / "seven.yaml"
    net.write_text("model:\n  input: [3, 8, 8]\n  layers:\n    - {type: flatten}\n"
                   "    - {type: linear, out_features: 7}\n")  # fmt: skip
    code, out, err = run_cli(["info", str(net), "--num-classes", "3"], capsys)
    assert code == 2 and "no layer of" in err and "(its output is 7)" in err
    code, out, _ = run_cli(["info", "alexnet", "--num-classes", "3"], capsys)
    assert code == 0 and "output: 3" in out
    fcn = tmp_path / "fcn.yaml"  # a fully convolutional head sized by num_classes
    fcn.write_text("model:\n  input: [3, 8, 8]\n  num_classes: 2\n  layers:\n"
                   "    - {type: conv, out_channels: $num_classes, kernel_size: 1}\n")  # fmt: skip
    code, out, err = run_cli(["info", str(fcn), "--num-classes", "7"], capsys)
    assert code == 0 and "output: 7x8x8" in out, err


def test_show_net_and_export_size_a_network_without_a_class_count(tmp_path, capsys, digits_run):
    """A network file that leaves num_classes to the data: drawn and exported with
    --num-classes, as info describes it; a trained run keeps its own classes."""
    import onnx

    net = tmp_path / "small.yaml"
    net.write_text("model:\n  input: [3, 8, 8]\n  layers:\n    - {type: conv, out_channels: 4, "
                   "kernel_size: 3}\n    - {type: global_avgpool}\n    - {name: fc, type: linear}\n")  # fmt: skip
    code, _, err = run_cli(["show", "net", str(net), "-o", str(tmp_path / "net.svg")], capsys)
    assert code == 2 and "info, show net, export and bench take --num-classes N" in err
    code, out, err = run_cli(["show", "net", str(net), "-o", str(tmp_path / "net.svg"),
                              "--num-classes", "3"], capsys)  # fmt: skip
    assert code == 0 and "wrote" in out and ">linear 3</text>" in (tmp_path / "net.svg").read_text()
    code, out, err = run_cli(["export", str(net), "-o", str(tmp_path / "n.onnx"),
                              "--num-classes", "5"], capsys)  # fmt: skip
    assert code == 0, err
    graph = onnx.load(str(tmp_path / "n.onnx")).graph
    assert graph.output[0].type.tensor_type.shape.dim[1].dim_value == 5
    seven = tmp_path / "seven.yaml"
    seven.write_text("model:\n  input: [3, 8, 8]\n  layers:\n    - {type: flatten}\n"
                     "    - {type: linear, out_features: 7}\n")  # fmt: skip
    code, _, err = run_cli(["export", str(seven), "-o", str(tmp_path / "s.onnx"), "--num-classes",
                            "3"], capsys)  # fmt: skip
    assert code == 2 and "no layer of" in err and "(its output is 7)" in err
    assert not (tmp_path / "s.onnx").exists()
    named = tmp_path / "named.yaml"  # its class names, or weights trained for its own classes
    named.write_text(net.read_text().replace("model:\n", "model:\n  classes: [a, b, c]\n"))
    weighted = tmp_path / "weighted.yaml"
    weighted.write_text(net.read_text().replace("model:\n", "model:\n  weights: w.safetensors\n"))
    missing = tmp_path / "missing.yaml"  # its weights file named as missing, not as trained
    missing.write_text(weighted.read_text().replace("w.safetensors", "gone.safetensors"))
    (tmp_path / "w.safetensors").write_bytes(b"")
    folder = tmp_path / "photos"  # not a run: said as such, not as trained
    folder.mkdir()
    for target, said in [(named, f"--num-classes 5: {named} names 3 classes (classes:)"),
                         (weighted, f"--num-classes 5: {weighted} loads weights ({tmp_path}/w."
                          "safetensors), trained for its own classes"),
                         (missing, "gone.safetensors: no such weights file"),
                         (folder, f"{folder}: not a run directory")]:  # fmt: skip
        code, _, err = run_cli(["export", str(target), "-o", str(tmp_path / "x.onnx"),
                                "--num-classes", "5"], capsys)  # fmt: skip
        assert code in (1, 2) and said in err and not (tmp_path / "x.onnx").exists(), err
    from cnnkit.infer.load import load_for_inference, save_safetensors

    export = tmp_path / "digits.safetensors"
    save_safetensors(load_for_inference(digits_run), export)
    for trained in (digits_run, digits_run / "best.pt", export):
        code, _, err = run_cli(["export", str(trained), "-o", str(tmp_path / "r.onnx"),
                                "--num-classes", "3"], capsys)  # fmt: skip
        assert code == 2 and f"{trained} was trained for its own classes" in err, err


@pytest.mark.parametrize("size", [[1, 1, 16000], [1, 9000, 9000]])
def test_inputs_larger_than_an_evaluation_image_are_described(tmp_path, capsys, size):
    """A signal (1 x 16000) or a very large image is a network `info` describes; only classify,
    which resizes images to at most 8192 px, cannot feed it, and says so in one line."""
    net = tmp_path / "big.yaml"
    net.write_text(f"model: {{input: {size}, num_classes: 10, layers: [{{type: conv, "
                   "out_channels: 4, kernel_size: 1}, {type: global_avgpool}, {type: linear}]}\n")  # fmt: skip
    code, out, err = run_cli(["info", str(net)], capsys)
    assert code == 0 and "parameters: 58" in out, err
    from cnnkit.infer.classify import check_loaded
    from cnnkit.infer.load import load_network

    with pytest.raises(ConfigError) as e:
        check_loaded(load_network(str(net)))
    assert str(e.value) == (
        f"{net}: classify reads square grey or RGB images of at most 8192 px; this network "
        f"takes {' x '.join(map(str, size))} inputs"
    )


def test_a_network_name_with_markup_or_dollars_is_shown_as_written(tmp_path, capsys):
    """rich reads [..] as markup and matplotlib $..$ as mathtext: a name is plain text."""
    spec = tmp_path / "n.yaml"
    spec.write_text('model:\n  name: "cost $\\\\frac$ [red]net[/]"\n  input: [1, 8, 8]\n'
                    "  layers:\n    - {type: conv, out_channels: 2, kernel_size: 3}\n")  # fmt: skip
    code, out, err = run_cli(["info", str(spec)], capsys)
    assert code == 0 and out.splitlines()[0].startswith("cost $\\frac$ [red]net[/]  input"), err
    code, out, err = run_cli(["show", "net", str(spec), "-o", str(tmp_path / "n.svg")], capsys)
    assert code == 0 and (tmp_path / "n.svg").stat().st_size > 0, err


def _commands(typer_app, path=()):
    """(argv to the command, its docstring) of every command of the app, nested ones too."""
    for command in typer_app.registered_commands:
        yield [*path, command.name or command.callback.__name__], command.callback.__doc__ or ""
    for group in typer_app.registered_groups:
        yield from _commands(group.typer_instance, (*path, group.name))


def test_every_commands_help_wraps_its_docstrings_paragraphs(capsys, monkeypatch):
    """A docstring's line breaks are not the help's: on a wide terminal each paragraph is one
    line (typer's rich help kept them: 'skipped and' / 'named on stderr' on two lines)."""
    import inspect

    from cnnkit.cli import app

    monkeypatch.setenv("COLUMNS", "400")
    commands = list(_commands(app))
    assert len(commands) > 15 and ["bench", "loader"] in [argv for argv, _ in commands]
    for argv, doc in commands:
        code, out, _ = run_cli([*argv, "--help"], capsys)
        lines = [" ".join(line.split()) for line in out.splitlines()]
        for paragraph in inspect.cleandoc(doc).split("\n\n"):
            words = " ".join(paragraph.split())
            assert code == 0 and any(words in line for line in lines), (argv, words, out)


def test_info_of_a_checkpoint_reads_past_its_networks_own_preprocess(digits_run, tmp_path,
                                                                      capsys):  # fmt: skip
    """A run trained from `model: {network: resnet18, input: [1, ...]}` kept the zoo's three
    means in its network, and `info RUN` refused it: a run's preprocessing is its data's, kept
    beside the network, so the network's own is not checked there."""
    import torch

    state = torch.load(digits_run / "last.pt", map_location="cpu", weights_only=False)
    state["model_spec"] = {**state["model_spec"], "preprocess": {"mean": [1.0, 2.0, 3.0]}}
    torch.save(state, tmp_path / "grey.pt")
    code, out, err = run_cli(["info", str(tmp_path / "grey.pt")], capsys)
    assert (code, err) == (0, "") and "digitnet" in out


def test_info_of_a_network_file_notes_weights_that_are_not_there(tmp_path, capsys):
    """info described a network file whose `weights:` was missing without a word, and classify
    then refused it: the table is printed and a note names the file it lacks."""
    (tmp_path / "w").mkdir()
    for weights, what in (("missing.pt", "no such file"),
                          ("w", "a folder, not a weights file")):  # fmt: skip
        net = tmp_path / "net.yaml"
        layers = [{"type": "flatten"}, {"type": "linear", "out_features": 2}]
        net.write_text(json.dumps({"model": {"input": [1, 8, 8], "weights": weights,
                                             "layers": layers}}))  # fmt: skip
        code, out, err = run_cli(["info", str(net)], capsys)
        assert code == 0 and "parameters: 130" in out
        assert err == (f"cnnkit: note: {net}: weights: {tmp_path / weights}: {what} "
                       "(classify, eval and export need it)\n")  # fmt: skip


@pytest.mark.parametrize("argv", [
    ["classify", "{f}", "x.png"], ["show", "net", "{f}", "-o", "{d}/m.svg"],
    ["export", "{f}", "-o", "{d}/m.onnx"], ["eval", "{f}", "--data", "{d}"], ["info", "{f}"],
])  # fmt: skip
@pytest.mark.parametrize("name", ["missing.yaml", "missing.prototxt"])
def test_a_missing_network_file_is_a_usage_error_in_every_command(argv, name, tmp_path, capsys):
    """The README's exit 2 for a network or run file that is missing: info said so, classify,
    show, export and eval gave 1 (a checkpoint's status)."""
    net = str(tmp_path / name)
    code, out, err = run_cli([a.format(f=net, d=tmp_path) for a in argv], capsys)
    assert code == 2 and not out and err.count("\n") == 1 and name in err, err


def test_info_of_caffe_weights_points_to_import_caffe(tmp_path, capsys):
    """A .caffemodel is no network file: it was 'expected a mapping with layers, got str'."""
    (tmp_path / "w.caffemodel").write_bytes(b"\x0a\x05alexnet")
    code, _, err = run_cli(["info", str(tmp_path / "w.caffemodel")], capsys)
    assert (
        code == 2 and "Caffe's weights, not a network: `cnnkit import-caffe deploy.prototxt" in err
    )


def test_the_package_lists_its_lazy_attributes_without_importing_them():
    """dir(cnnkit) and tab completion show build_model, Classifier, Network and StopTraining,
    which load on first use (`import cnnkit` stays without torch)."""
    code = ("import sys, cnnkit; names = dir(cnnkit); "
            "assert {'build_model', 'Classifier', 'Network', 'StopTraining', 'fit'} <= set(names); "
            "assert 'torch' not in sys.modules, 'dir imported torch'")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)
