"""cnnkit export: ONNX checked in ONNX Runtime (dynamic batch, preprocessing metadata),
torch.export (.pt2) round trip, TorchScript, safetensors round trip; a check that can fail;
nets with LRN and groups."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import yaml
from helpers import CLI, ROOT, one_error_line, run_cli

import cnnkit.runtime
from cnnkit import CheckpointError
from cnnkit.checkpoint import load_checkpoint
from cnnkit.infer import Classifier
from cnnkit.infer.export import check_export, export
from cnnkit.infer.load import load_for_inference, load_network, load_safetensors
from cnnkit.runtime import write_atomic

CAFFE = Path(__file__).parent / "data" / "caffe"


def test_onnx_export_of_the_digits_run(digits_run, tmp_path, capsys):
    out = tmp_path / "digits.onnx"
    code, stdout, err = run_cli(["export", str(digits_run), "-o", str(out), "--check"], capsys)
    assert code == 0, err
    assert "ONNX Runtime vs PyTorch" in stdout and "passed" in stdout
    proto = onnx.load(str(out))
    props = {p.key: p.value for p in proto.metadata_props}
    loaded = load_for_inference(digits_run)
    assert json.loads(props["mean"]) == loaded.preprocess.mean
    assert json.loads(props["std"]) == loaded.preprocess.std
    assert json.loads(props["classes"]) == [str(d) for d in range(10)]
    assert int(props["crop"]) == 8 and int(props["channels"]) == 1
    assert props["interpolation"] == "bilinear"  # the resize a reader of the file repeats
    batch = proto.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch.dim_param and not batch.dim_value  # symbolic: any batch size
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = torch.randn(7, 1, 8, 8)
    with torch.no_grad():
        expected = loaded.model(x).numpy()
    np.testing.assert_allclose(session.run(None, {"image": x.numpy()})[0], expected, atol=1e-4)


def test_alexnet_with_lrn_and_groups_passes_the_onnx_check(tmp_path):
    loaded = load_network("alexnet")
    out = tmp_path / "alexnet.onnx"
    export(loaded, "onnx", out)
    result = check_export(loaded, "onnx", out)
    assert result.ok, result


def test_the_check_fails_when_the_export_differs(tmp_path):
    loaded = load_network("lenet5")
    out = tmp_path / "lenet.onnx"
    export(loaded, "onnx", out)
    with torch.no_grad():
        next(loaded.model.parameters()).add_(1e-2)  # the file no longer matches
    result = check_export(loaded, "onnx", out)
    assert not result.ok and result.max_diff > 1e-4


def test_the_check_fails_an_export_of_zeros_where_the_logits_are_tiny(tmp_path, monkeypatch):
    """Fresh torchvision-style weights can give logits of 1e-13: a tolerance on the absolute
    difference alone passed an export that outputs zeros."""
    import cnnkit.infer.export as export_module

    loaded = load_network("lenet5")
    with torch.no_grad():
        for p in loaded.model.parameters():
            p.mul_(1e-5)  # logits around 1e-6
    out = tmp_path / "lenet.onnx"
    export(loaded, "onnx", out)
    assert check_export(loaded, "onnx", out).ok  # the real export passes
    monkeypatch.setattr(export_module, "run_exported", lambda fmt, path: lambda x: np.zeros(
        (x.shape[0], 10), np.float32))  # fmt: skip
    result = check_export(loaded, "onnx", out)
    assert not result.ok and result.max_diff < 1e-4, result  # under the old absolute bound


def test_safetensors_round_trip_and_classify(digits_run, tmp_path, capsys):
    out = tmp_path / "digits.safetensors"
    code, stdout, err = run_cli(
        ["export", str(digits_run), "-f", "safetensors", "-o", str(out), "--check"], capsys
    )
    assert code == 0, err
    original, copy = load_for_inference(digits_run), load_safetensors(out)
    assert copy.classes == original.classes and copy.preprocess == original.preprocess
    assert copy.model.spec == original.model.spec
    mine, theirs = original.model.state_dict(), copy.model.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    image = np.arange(64, dtype=np.uint8).reshape(8, 8) * 3
    a = Classifier.load(digits_run).predict(image, top=10)
    b = Classifier.load(out).predict(image, top=10)
    assert a.labels == b.labels and a.probs == b.probs
    (tmp_path / "x.png").write_bytes(b"")
    code, stdout, _ = run_cli(["classify", str(out), str(tmp_path / "x.png"), "--json"], capsys)
    assert code == 1 and json.loads(stdout)["error"].endswith("empty file")
    # the export as a network file's weights: its preprocess and classes with it (were: 0-1
    # pixels and class numbers, without a word), unless the file gives its own
    spec = {**copy.model.spec, "weights": out.name}
    (tmp_path / "net.yaml").write_text(yaml.safe_dump({"model": spec}))
    named = load_for_inference(tmp_path / "net.yaml")
    assert named.preprocess == original.preprocess and named.classes == original.classes
    assert Classifier.load(tmp_path / "net.yaml").predict(image, top=10).probs == a.probs
    own = {**spec, "preprocess": {"mean": [100], "std": [50]}, "classes": list("abcdefghij")}
    (tmp_path / "own.yaml").write_text(yaml.safe_dump({"model": own}))
    mine = load_for_inference(tmp_path / "own.yaml")
    assert (list(mine.preprocess.mean), mine.classes[0]) == ([100.0], "a")


def test_eval_of_an_export_computes_in_its_runs_precision_else_fp32(digits_run, tmp_path):
    """The export records the precision the run's steps ran in; eval of an export without it
    computes in fp32 as classify does, never in the bf16 that `auto` picks on such a CPU. On
    a GPU it takes the run's memory format too, as classify does there."""
    from cnnkit.train.evaluation import _eval_settings

    out = tmp_path / "d.safetensors"
    export(load_for_inference(digits_run), "safetensors", out)
    ran = load_checkpoint(digits_run / "best.pt")["settings"]
    back = load_safetensors(out).ran
    assert (back["device"], back["precision"]) == (ran["device"], ran["precision"])
    cpu = torch.device("cpu")
    assert _eval_settings({}, "cpu", cpu, out, None).precision == "fp32"
    for precision in ("fp32", "bf16"):
        cpu_run = {**ran, "device": "cpu", "precision": precision}
        assert _eval_settings({}, "cpu", cpu, out, cpu_run).precision == precision
    gpu_run = {**ran, "device": "cuda", "precision": "bf16"}
    assert _eval_settings({}, "cpu", cpu, out, gpu_run).precision == "fp32"
    cuda = torch.device("cuda")  # (a name only: nothing runs there)
    for memory in (True, False):  # on a GPU, its memory format too, as classify runs it
        gpu_run = {**ran, "device": "cuda", "precision": "bf16", "channels_last": memory}
        assert _eval_settings({}, "cuda", cuda, out, gpu_run).channels_last is memory
    cpu_run = {**ran, "device": "cpu", "channels_last": True}  # a CPU measures its own kernels
    assert _eval_settings({}, "cpu", cpu, out, cpu_run).channels_last is None


def test_safetensors_without_cnnkit_metadata_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(CheckpointError, match="no cnnkit metadata"):
        load_safetensors(path)


def test_the_format_comes_from_the_name_and_a_mismatch_is_refused(tmp_path, capsys):
    from cnnkit.infer.export import export_format

    assert [export_format(Path(f"m{s}"), None) for s in (".onnx", ".pt2", ".safetensors")] == [
        "onnx", "torch-export", "safetensors"]  # fmt: skip
    assert export_format(Path("m.pt"), "torchscript") == "torchscript"  # no format's own suffix
    out = tmp_path / "lenet.safetensors"
    code, stdout, err = run_cli(["export", "lenet5", "-o", str(out)], capsys)
    assert code == 0 and "(safetensors," in stdout, err
    assert load_safetensors(out).model.input_shape == (1, 32, 32)  # LeNet-5 as published
    for argv, why in ((["-f", "safetensors", "-o", "x.onnx"], "a .onnx name for --format safetensors"),
                      (["-f", "onnx", "-o", "x.pt2"], "a .pt2 name for --format onnx"),
                      (["-o", "x.pt"], "its name does not say the format: give --format")):  # fmt: skip
        code, _, err = run_cli(["export", "lenet5", *argv], capsys)
        assert code == 2 and why in err and len(err.splitlines()) == 1, err
    assert not Path("x.onnx").exists() and not Path("x.pt").exists()
    (tmp_path / "run.yaml").write_text("name: mine\n")  # not an export: never replaced
    code, _, err = run_cli(["export", "lenet5", "-f", "onnx", "-o", str(tmp_path / "run.yaml")],
                           capsys)  # fmt: skip
    assert code == 2 and "exists, and is not an earlier export of this format (onnx)" in err, err
    assert (tmp_path / "run.yaml").read_text() == "name: mine\n"


def test_format_names_are_taken_in_any_case_and_by_their_suffixes(tmp_path, capsys):
    """--format ONNX and --format pt2 (the help's `torch-export (.pt2)`) were refused."""
    from cnnkit.infer.export import export_format

    given = ("ONNX", "pt2", ".PT2", "Torch-Export", "SafeTensors", "torchscript")
    assert [export_format(Path("m.bin"), f) for f in given] == [
        "onnx", "torch-export", "torch-export", "torch-export", "safetensors", "torchscript"]  # fmt: skip
    out = tmp_path / "lenet.pt2"
    code, stdout, err = run_cli(["export", "lenet5", "--format", "pt2", "-o", str(out)], capsys)
    assert code == 0 and "(torch-export," in stdout, err
    code, _, err = run_cli(["export", "lenet5", "-f", "ONNX", "-o", str(out)], capsys)
    assert code == 2 and "a .pt2 name for --format onnx" in err, err


def test_an_export_replaces_only_an_earlier_export_of_its_format(tmp_path, capsys):
    """A legacy torch.save file (pickle, torch's magic number) is a checkpoint; an array, a
    pickle or another format's export is no earlier export: none is replaced."""
    import pickle

    torch.save({"w": torch.ones(3)}, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    np.save(tmp_path / "mean.npy", np.zeros(3))
    np.savez(tmp_path / "arrays.npz", a=np.zeros(3))
    (tmp_path / "obj.pkl").write_bytes(pickle.dumps({"a": 1}))
    code, _, err = run_cli(["export", "lenet5", "-f", "safetensors", "-o", str(tmp_path / "w.bin")],
                           capsys)  # fmt: skip
    assert code == 0, err
    kept = {p: p.read_bytes() for p in tmp_path.iterdir()}
    for name, fmt in (("legacy.pth", "safetensors"), ("mean.npy", "onnx"),
                      ("arrays.npz", "torchscript"), ("obj.pkl", "safetensors"), ("w.bin", "onnx")):  # fmt: skip
        code, _, err = run_cli(["export", "lenet5", "-f", fmt, "-o", str(tmp_path / name)], capsys)
        words = ("is a checkpoint (a torch.save file)" if name == "legacy.pth" else
                 f"is not an earlier export of this format ({fmt})")  # fmt: skip
        assert words in one_error_line(code, err, (2,)), err
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == kept
    code, _, err = run_cli(["export", "lenet5", "-f", "safetensors", "-o", str(tmp_path / "w.bin")],
                           capsys)  # fmt: skip
    assert code == 0, err  # an earlier export of the format: replaced


def test_an_export_never_replaces_a_checkpoint_or_its_input(digits_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(digits_run, run)
    (tmp_path / "net.yaml").write_text("model: digitnet\n")
    code, _, err = run_cli(["export", str(run), "-o", str(tmp_path / "w.safetensors")], capsys)
    assert code == 0, err  # weights a network file reads (it must not export over them)
    spec = {**load_checkpoint(run / "best.pt")["model_spec"], "weights": "w.safetensors"}
    (tmp_path / "weighted.yaml").write_text(yaml.safe_dump({"model": spec}))
    shutil.copy(run / "last.pt", tmp_path / "ck.pt")
    kept = {p: p.read_bytes() for p in (run / "best.pt", run / "last.pt", tmp_path / "net.yaml",
                                        tmp_path / "w.safetensors", run / "config.yaml",
                                        tmp_path / "ck.pt",
                                        run / "metrics.csv")}  # fmt: skip
    for target, argv, words in (
        (run / "best.pt", ["-f", "safetensors", "-o", str(run / "best.pt")], "is the input"),
        (run, ["-f", "onnx", "-o", str(tmp_path / "ck.pt")], "is a checkpoint (a torch.save file)"),
        (run, ["-f", "onnx", "-o", str(run / "last.pt")], "is a file of the run in"),
        (tmp_path / "net.yaml", ["-f", "onnx", "-o", str(tmp_path / "net.yaml")], "is the input"),
        (run, ["-o", str(tmp_path)], "is a folder"),
        (run, ["-f", "onnx", "-o", str(run / "config.yaml")], "is a file of the run in"),
        (run / "best.pt", ["-f", "onnx", "-o", str(run / "metrics.csv")], "is a file of the run"),
        (tmp_path / "weighted.yaml", ["-o", str(tmp_path / "w.safetensors")], "is the input"),
        (run, ["-f", "onnx", "-o", str(tmp_path / "pipe.onnx")], "is a FIFO, not a file"),
    ):
        if "pipe" in argv[-1]:  # read as a checkpoint, it hung; renamed over, a device was lost
            os.mkfifo(argv[-1])
        code, _, err = run_cli(["export", str(target), *argv], capsys)
        assert code == 2 and words in err and len(err.splitlines()) == 1, err
    assert all(p.read_bytes() == data for p, data in kept.items())
    (run / "curves.png").write_bytes(b"the run's")
    for argv in (["show", "net", str(run)], ["show", "filters", str(run)]):
        code, _, err = run_cli([*argv, "-o", str(run / "curves.png")], capsys)
        assert code == 2 and "is a file of the run in" in err, err
    assert (run / "curves.png").read_bytes() == b"the run's"
    with pytest.raises(OSError, match="not a regular file"):  # and below the commands too
        write_atomic(tmp_path / "pipe.onnx", b"x")
    assert stat.S_ISFIFO(os.stat(tmp_path / "pipe.onnx").st_mode)


def test_a_long_legal_name_is_written_and_a_too_long_one_is_named(tmp_path, capsys):
    """A 245-character name is legal, but its hidden temporary (.NAME.<pid>.tmp) was not:
    the export failed naming that file. A name past the limit names the user's file."""
    name = "a" * 245 + ".onnx"
    code, out, err = run_cli(["export", "lenet5", "-o", str(tmp_path / name)], capsys)
    assert code == 0 and (tmp_path / name).is_file(), err
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporary left
    with pytest.raises(OSError) as caught:
        write_atomic(tmp_path / ("b" * 260), b"x", private=True)
    assert caught.value.filename == str(tmp_path / ("b" * 260))
    assert [p.name for p in tmp_path.iterdir()] == [name]
    for private in (False, True):  # multi-byte names are cut by characters, never by bytes
        write_atomic(tmp_path / ("é" * 126 + ".x"), b"y", private=private)
    assert (tmp_path / ("é" * 126 + ".x")).read_bytes() == b"y"


def test_torchscript_export_matches(tmp_path, capsys):
    out = tmp_path / "net.pt"
    code, stdout, err = run_cli(
        ["export", "lenet5", "-f", "torchscript", "-o", str(out), "--check"], capsys
    )
    assert code == 0 and "passed" in stdout, err
    code, _, err = run_cli(["export", "lenet5", "-f", "keras", "-o", str(out)], capsys)
    assert code == 2 and "keras" in err
    code, _, err = run_cli(["info", str(out)], capsys)  # torch's weights_only advice: not ours
    assert code != 0 and "a TorchScript export, which cnnkit writes but does not read" in err, err
    assert "weights_only" not in err


def test_torch_export_of_the_digits_run(digits_run, tmp_path, capsys):
    out = tmp_path / "digits.pt2"
    code, stdout, err = run_cli(
        ["export", str(digits_run), "-f", "torch-export", "-o", str(out), "--check"], capsys
    )
    assert code == 0, err
    assert "torch.export.load vs PyTorch" in stdout and "passed" in stdout
    extra = {"cnnkit.json": ""}
    program = torch.export.load(str(out), extra_files=extra)
    meta = json.loads(extra["cnnkit.json"])
    loaded = load_for_inference(digits_run)
    assert json.loads(meta["classes"]) == loaded.classes
    assert json.loads(meta["preprocess"]) == loaded.preprocess.to_dict()
    x = torch.randn(7, 1, 8, 8)  # a batch size the export never saw: the batch is dynamic
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), loaded.model(x), atol=1e-5, rtol=1e-5)


def test_torch_export_of_a_net_with_groups_lrn_and_branches(tmp_path):
    loaded = load_network(str(CAFFE / "every_layer.prototxt"))  # groups, LRN, BN, concat, ...
    assert any(getattr(m, "groups", 1) > 1 for m in loaded.model.modules())
    out = tmp_path / "every.pt2"
    export(loaded, "torch-export", out)
    result = check_export(loaded, "torch-export", out)
    assert result.ok and result.batch_sizes[:2] == (1, 3), result
    with torch.no_grad():
        next(loaded.model.parameters()).add_(1e-2)  # the check can fail
    assert not check_export(loaded, "torch-export", out).ok


@pytest.mark.parametrize("fmt,suffix", [("onnx", "onnx"), ("safetensors", "safetensors")])
def test_a_network_on_feature_vectors_exports_and_round_trips(fmt, suffix, tmp_path, capsys):
    """input: [64] (more features than an image has channels): no image preprocessing."""
    net = tmp_path / "vec.yaml"
    net.write_text("model: {name: vec, input: [64], num_classes: 10, layers: [{name: fc1, "
                   "type: linear, out_features: 32}, {type: relu}, {name: fc2, type: linear}]}\n")  # fmt: skip
    out = tmp_path / f"vec.{suffix}"
    code, stdout, err = run_cli(["export", str(net), "-f", fmt, "-o", str(out), "--check"], capsys)
    assert code == 0 and "passed" in stdout, err
    tried = "on random inputs (batch 1 and 3; the network reads feature vectors, not images);"
    assert tried in stdout and "real images" not in stdout, stdout  # not `on 0 real images`
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    assert out.stat().st_mode == plain.stat().st_mode  # the usual mode (umask), not 0600
    if fmt == "safetensors":
        loaded = load_safetensors(out)
        assert loaded.model.input_shape == (64,) and loaded.preprocess.std == [1.0]


@pytest.mark.parametrize("fmt", ["onnx", "torch-export", "torchscript", "safetensors"])
def test_a_full_disk_leaves_no_partial_export(digits_run, tmp_path, capsys, monkeypatch, fmt):
    """Every format is written whole to a temporary file and renamed: a full disk is one line
    and leaves nothing at the destination (an earlier export stays as it was)."""
    out = tmp_path / f"digits.{'pt2' if fmt == 'torch-export' else fmt}"  # the format's own name
    out.write_bytes(b"the earlier export")

    class Full(io.FileIO):  # half of each write lands, then the disk is full
        def write(self, data):
            super().write(bytes(data)[: len(data) // 2])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(cnnkit.runtime, "open", Full, raising=False)
    code, _, err = run_cli(["export", str(digits_run), "-f", fmt, "-o", str(out)], capsys)
    monkeypatch.undo()
    assert code == 1 and len(err.splitlines()) == 1 and "No space left" in err, err
    assert out.read_bytes() == b"the earlier export"
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    (tmp_path / f"{out.name}.tmp").write_text("the user's own notes")  # never the scratch file
    code, _, err = run_cli(["export", str(digits_run), "-f", fmt, "-o", str(out)], capsys)
    assert code == 0 and (tmp_path / f"{out.name}.tmp").read_text() == "the user's own notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name, f"{out.name}.tmp"]


@pytest.mark.parametrize("shape", [[3, 8, 12], [4, 8, 8], [6, 8, 8]])
def test_safetensors_of_inputs_that_are_not_square_images_load_back(tmp_path, shape):
    spec = {"input": shape, "layers": [{"type": "conv", "out_channels": 2, "kernel_size": 1},
                                       {"type": "flatten"}, {"type": "linear", "out_features": 3}]}  # fmt: skip
    (tmp_path / "net.yaml").write_text(f"model: {json.dumps(spec)}\n")
    loaded = load_network(str(tmp_path / "net.yaml"))
    export(loaded, "safetensors", tmp_path / "n.safetensors")
    back = load_safetensors(tmp_path / "n.safetensors")
    x = torch.randn(2, *shape)
    torch.testing.assert_close(back.model(x), loaded.model(x))


@pytest.mark.parametrize("suffix", [".onnx", ".pt2", ".torchscript"])
def test_a_layer_named_by_a_python_keyword_is_refused_before_any_export(tmp_path, capsys, suffix):
    """ONNX export tracebacked, and .pt2 and TorchScript files were written that would not
    load: the name is refused in one line, naming the file and layer, and nothing written."""
    net = tmp_path / "net.yaml"
    net.write_text("model:\n  input: [3, 8, 8]\n  layers:\n"
                   "    - {name: in, type: conv, out_channels: 2, kernel_size: 3}\n"
                   "    - {type: global_avgpool}\n")  # fmt: skip
    out = tmp_path / f"net{suffix}"
    code, _, err = run_cli(["export", str(net), "-o", str(out), "--check"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{net}: line 4: layer 0 (in): name: 'in' is a Python keyword" in err
    assert not out.exists()


CEIL_NET = """model:
  input: [3, 5, 5]
  num_classes: 3
  layers:
    - {name: c, type: conv, out_channels: 4, kernel_size: 1}
    - {name: p, type: POOL, kernel_size: 2, stride: 2, padding: 1, ceil_mode: true}
    - {name: q, type: conv, out_channels: 4, kernel_size: 3, stride: 2, padding: 1, inputs: c}
    - AFTER
    - {type: flatten}
    - {type: linear}
"""
AFTER = {"lrn": "{type: lrn, size: 3, convention: caffe, inputs: p}",
         "add": "{type: add, inputs: [p, q]}", "concat": "{type: concat, inputs: [p, q]}"}  # fmt: skip


def onnx_and_torch(loaded, x: torch.Tensor, tmp_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The ONNX export of `loaded` run in ONNX Runtime on `x`, and the network itself."""
    out = tmp_path / "net.onnx"
    export(loaded, "onnx", out)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        return session.run(None, {"image": x.numpy()})[0], loaded.model(x).numpy()


@pytest.mark.parametrize("pool", ["maxpool", "avgpool"])
@pytest.mark.parametrize("after", list(AFTER))
def test_a_ceil_mode_pool_that_drops_its_last_window_exports_what_torch_computes(
    tmp_path, pool, after
):
    """Torch drops a ceil_mode window that would start in the padding (5x5, kernel 2, stride 2,
    padding 1: 3x3), ONNX's shape inference does not (4x4): ONNX Runtime refused the model
    where an LRN, add or concat followed."""
    net = tmp_path / "net.yaml"
    net.write_text(CEIL_NET.replace("POOL", pool).replace("AFTER", AFTER[after]))
    loaded = load_network(str(net))
    got, expected = onnx_and_torch(loaded, torch.randn(3, 3, 5, 5), tmp_path)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    pools = [
        m for m in loaded.model.modules() if isinstance(m, (torch.nn.MaxPool2d, torch.nn.AvgPool2d))
    ]
    assert all(m.ceil_mode for m in pools)  # the network itself is as built


@pytest.mark.parametrize("pool", ["maxpool", "avgpool"])
def test_a_ceil_mode_pool_whose_axes_round_apart_exports_what_torch_computes(tmp_path, pool):
    """8 x 9, kernel 3, stride 3, padding 1: the rows drop their last window (it would start in
    the padding: 3, as floor mode), the columns keep theirs (4, as ceil mode); neither mode
    gives ONNX both, so the pool is exported as an end padding and a floor-mode pool."""

    net = tmp_path / "net.yaml"
    net.write_text(f"""model:
  input: [2, 8, 9]
  layers:
    - {{name: p, type: {pool}, kernel_size: 3, stride: 3, padding: 1, ceil_mode: true}}
    - {{name: n, type: lrn, size: 3, convention: caffe}}
""")
    loaded = load_network(str(net))
    assert loaded.model.output_shape == (2, 3, 4)
    got, expected = onnx_and_torch(loaded, torch.randn(3, 2, 8, 9), tmp_path)
    assert got.shape == expected.shape == (3, 2, 3, 4)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert loaded.model.p.ceil_mode and "forward" not in vars(loaded.model.p)  # as built


def test_an_onnx_model_onnx_runtime_cannot_load_is_never_written(tmp_path, capsys, monkeypatch):
    import cnnkit.infer.pools as pools

    net = tmp_path / "net.yaml"
    net.write_text(CEIL_NET.replace("POOL", "maxpool").replace("AFTER", AFTER["add"]))
    monkeypatch.setattr(pools, "_ceil_pools", lambda model, example: ([], {}))  # as before
    out = tmp_path / "net.onnx"
    code, _, err = run_cli(["export", str(net), "-o", str(out)], capsys)
    assert code == 1 and len(err.splitlines()) == 1, err
    assert f"{out}: ONNX Runtime cannot load the export, so it was not written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.yaml"]


@pytest.mark.parametrize("failure", ["raises", "differs"])
def test_a_failed_check_is_one_line_and_leaves_the_earlier_file(tmp_path, capsys, monkeypatch,
                                                               failure):  # fmt: skip
    """--check runs the export before it is written: a runtime that cannot run it (an error of
    its own, which tracebacked) or logits that differ leave no file and an earlier one as it was."""
    import cnnkit.infer.export as export_module

    def broken(fmt, path):
        if failure == "raises":
            raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Node (add)\nIncompatible dims")
        return lambda x: np.zeros((x.shape[0], 10), np.float32)

    monkeypatch.setattr(export_module, "run_exported", broken)
    out = tmp_path / "lenet.onnx"
    out.write_bytes(b"the earlier export")
    code, _, err = run_cli(["export", "lenet5", "-o", str(out), "--check"], capsys)
    assert code == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    why = "ONNX Runtime cannot run the export" if failure == "raises" else "export check failed"
    assert f"{out}: {why}" in err and "so it was not written" in err, err
    assert out.read_bytes() == b"the earlier export"
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_an_exports_network_says_the_classes_it_was_built_with(tmp_path):
    """A zoo file says num_classes 1000; a network built for 5 classes (a run's data set it)
    is exported with a model_spec that says 5, as its num_classes field does: a reader that
    rebuilds the network from model_spec alone gets the weights' shapes."""
    from cnnkit.data.base import Preprocess
    from cnnkit.infer.load import Loaded, metadata
    from cnnkit.nn import build_model
    from cnnkit.nn.spec import read_spec

    spec = read_spec("inception-small")
    model = build_model(spec, num_classes=5)
    pre = Preprocess(channels=3, crop=model.input_shape[-1])
    meta = metadata(Loaded(model.eval(), list("abcde"), pre, "test"))
    assert json.loads(meta["num_classes"]) == 5 != spec.get("num_classes", 1000)
    rebuilt = build_model(json.loads(meta["model_spec"]))
    assert rebuilt.state_dict().keys() == model.state_dict().keys()
    assert all(rebuilt.state_dict()[k].shape == v.shape for k, v in model.state_dict().items())


@pytest.mark.parametrize("fmt", ["onnx", "torch-export"])
def test_an_even_kernel_with_same_padding_exports_without_torchs_warning(tmp_path, fmt):
    """torch warns once a process that padding 'same' with an even kernel may copy the input:
    its multi-line UserWarning came out between cnnkit's lines (a ceil_mode pool's probe ran the
    model outside the export's filter). A process of its own: the warning is torch's once."""
    net = tmp_path / "even.yaml"
    net.write_text("model: {input: [1, 8, 8], num_classes: 3, layers: [{type: conv, "
                   "out_channels: 4, kernel_size: 2, padding: same}, {type: maxpool, "
                   "kernel_size: 3, stride: 2, ceil_mode: true}, {type: linear}]}\n")  # fmt: skip
    out = tmp_path / "even.out"
    cmd = [*CLI, "export", str(net), "-f", fmt, "-o", str(out), "--check"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert done.returncode == 0 and out.is_file(), done.stderr[-2000:]
    assert all(line.startswith("cnnkit: note: ") for line in done.stderr.splitlines()), done.stderr
