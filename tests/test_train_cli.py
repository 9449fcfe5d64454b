"""Bad input to `cnnkit train` / `cnnkit eval`: one clear line, non-zero exit, no traceback, and
nothing in an existing run directory overwritten."""

from __future__ import annotations

import json

import pytest
from helpers import one_error_line, run_cli

from cnnkit.cli import main
from cnnkit.data.packfiles import PACK_FORMAT


def _fails(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return done.value.code, err


@pytest.mark.parametrize(
    "argv, code, words",
    [
        (["train", "nosuchrun"], 2, "neither a zoo run or network"),
        (["train", "digts"], 2, "nor a run file (did you mean 'digits'?)"),
        (
            ["train", "alexnet"],
            2,
            "a zoo network, not a run: give its data (`cnnkit train alexnet data.path=DIR`: a "
            "folder of class folders or a pack) or a run file with model: alexnet; zoo runs of "
            "it: alexnet-imagenet",
        ),  # fmt: skip
        (["info", "resnet-18"], 2, "nor a file (did you mean 'resnet18'?)"),
        (["train", "digits", "train.lr=-1"], 2, "train.lr"),
        (["train", "digits", "data.batch_size=0"], 2, "data.batch_size"),
        (["train", "digits", "train.optimizer=sgdd"], 2, "train.optimizer"),
        (["train", "digits", "train.lrr=0.1"], 2, "train.lrr: unknown field"),
        (["train", "digits", "train.momentum=0"], 2, "optimizer nesterov needs momentum > 0"),
        (["train", "digits", "data.source=nowhere"], 2, "data.source"),
        (["train", "digits", "train.device=gpu7"], 2, "train.device"),
        (["train", "digits", "lr"], 2, "key=value"),
        (["train", "--resume", "/no/such/run"], 1, "no such run directory"),
        (["train", "--resume", "/a/run", "--out", "/b"], 2, "--out /b cannot be given with it"),
        (["train", "digits", "--resume", "/a/run"], 2, "the run digits cannot be given with it"),
        (["train", "digits", "--nproc", "3", "--dry-run"], 2, "does not divide into 3"),
        (["train", "digits", "--lr", "0.1"], 2, "(settings are key=value overrides: train.lr=...)"),
        (["train", "digits", "--batch-size", "8"], 2, "overrides: data.batch_size=...)"),
        (["train", "digits", "--max-restarts", "2"], 2, "--max-restarts: restarts the processes"),
        (["train", "digits", "--oversubscribe"], 2, "--oversubscribe: allows more of the"),
        # a dry run of N checks what N processes check: mining, SyncBatchNorm's devices, cuda:N
        (["train", "faces", "--nproc", "2", "--dry-run"], 2, "mining runs in one process"),
        (
            [
                "train",
                "digits",
                "train.sync_bn=true",
                "train.device=cpu",
                "--nproc",
                "2",
                "--dry-run",
            ],
            2,
            "SyncBatchNorm runs on CUDA devices only",
        ),  # fmt: skip
        (
            ["train", "digits", "train.device=cuda:1", "--nproc", "2", "--dry-run"],
            2,
            "'cuda:1' names one GPU",
        ),  # fmt: skip
        (["eval", "/no/such/run"], 1, "no such checkpoint"),
        # the setting that fixes it, named
        (
            ["train", "digits", "data.source=synthetic", "--dry-run"],
            2,
            "data.shift: unknown field (a setting of data.source digits / faces, not synthetic",
        ),
    ],
)
def test_bad_input_is_one_clear_line(argv, code, words, capsys):
    got, err = _fails(argv, capsys)
    assert got == code and words in err and err.startswith("cnnkit: error:")


def test_a_binary_file_or_a_misspelled_model_key_is_named(tmp_path, capsys):
    onnx, blob, run = tmp_path / "m.onnx", tmp_path / "m.bin", tmp_path / "r.yaml"
    onnx.write_bytes(b"\x08\x07\x12\x07pytorch\xad\xff")
    blob.write_bytes(bytes(range(128, 256)))
    run.write_text("modell: digitnet\ndata: {source: digits}\n")
    network = tmp_path / "net.yaml"
    network.write_text("model:\n  input: [1, 8, 8]\n  layers: [{type: flatten}]\n")
    for argv, words in (
        (["train", str(network)], "data: Field required (a network file? a run file names it"),
        (["info", str(onnx)], "m.onnx: an ONNX export, which cnnkit writes but does not read"),
        (["classify", str(blob), str(blob)], "not a text file: give a zoo name, a network or run"),
        (["import-caffe", str(blob), "-o", str(tmp_path / "n.yaml")], "not a text file: a deploy"),
        (["train", str(run)], "('modell': a misspelled model?)"),
        # what continues a trained model's run, or starts one from it (not a zoo name or a
        # Caffe .prototxt); a run file given to --resume is no run directory (exit 1 before)
        (
            ["train", str(onnx)],
            "m.onnx: a trained model, not a run file: `cnnkit train --resume "
            "RUN_DIR` continues the run it came from, and a run file with "
            "model: {network: NET, weights: W.safetensors} starts",
        ),
        (["train", "--resume", str(run)], "r.yaml: a file, not a run directory: give the folder"),
    ):
        code, err = _fails(argv, capsys)
        assert code == 2 and words in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin", "m.onnx", "net.yaml", "r.yaml"]


def test_a_folder_given_as_the_run_says_what_it_is(tmp_path, capsys, monkeypatch):
    """A run directory where the run goes is continued with --resume, not a new zoo run (it was
    `did you mean 'digits'?`); a folder named like a YAML file never suggests itself."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "digits-20250101-120000"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("name: digits\n")
    (tmp_path / "dir.yaml").mkdir()
    (tmp_path / "imgs" / "cat").mkdir(parents=True)
    (tmp_path / "imgs" / "cat" / "1.JPEG").write_bytes(b"")
    for argv, line in (
        (["train", "runs/digits-20250101-120000"],
         "cnnkit: error: runs/digits-20250101-120000 is a run directory, not a run file: `cnnkit "
         "train --resume runs/digits-20250101-120000` continues it (runs/digits-20250101-120000/"
         "config.yaml starts a new run from its settings)"),
        (["train", "dir.yaml"],
         "cnnkit: error: dir.yaml is a folder, not a run file (a YAML file with model:, data: and "
         "train:)"),
        (["train", "imgs"],
         "cnnkit: error: imgs is a folder of images, not a run file (a YAML file with model:, "
         "data: and train:): `cnnkit train resnet18 data.path=imgs` trains ResNet-18 on it, "
         "holding out 10% (any network `cnnkit zoo` lists; README: Data)"),
    ):  # fmt: skip
        code, err = _fails(argv, capsys)
        assert code == 2 and err == line


def test_config_of_a_folder_of_runs_or_a_trained_model_says_what_to_give(tmp_path, capsys,
                                                                          monkeypatch):  # fmt: skip
    """`cnnkit config runs` names a run in it (it was `a folder of images`: the runs' curves),
    a checkpoint in a run directory shows that run's settings, and a trained model elsewhere
    says what reads it (it was `not a text file: give ... a trained model`)."""
    from cnnkit.config import dump_run, load_run

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "d1"
    run.mkdir(parents=True)
    dump_run(load_run("digits", ["train.epochs=3"]), run / "config.yaml")
    (run / "best.pt").write_bytes(b"PK\x03\x04")
    (run / "curves.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "d.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    for command in ("config", "train"):
        code, err = _fails([command, "runs"], capsys)
        assert code == 2 and err == ("cnnkit: error: runs: holds run directories, not a run of "
                                     "its own: name one, e.g. runs/d1")  # fmt: skip
    code, out, _ = run_cli(["config", "runs/d1/best.pt", "--changed"], capsys)
    assert code == 0 and "runs/d1/config.yaml" in out and "train.epochs" in out
    code, err = _fails(["config", "d.safetensors"], capsys)
    assert code == 2 and err.startswith("cnnkit: error: d.safetensors: a trained model outside "
                                        "a run directory: `cnnkit config` lists the settings of "
                                        "a run (give the run directory it came from), `cnnkit "
                                        "info d.safetensors` shows its network")  # fmt: skip


def test_data_paths_that_are_not_the_source_say_which_setting(tmp_path, capsys, monkeypatch):
    """A folder source's missing folders name their setting, as a pack's do (it was
    '/abs/imagenet-val: not a folder' for a val_path the user never wrote), and an image
    folder given as a pack says how to use it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "imgs" / "cat").mkdir(parents=True)
    (tmp_path / "imgs" / "cat" / "1.JPEG").write_bytes(b"")
    folder = ["train", "alexnet-imagenet", "data.source=folder", "data.normalize=channel"]
    (tmp_path / "packed").mkdir()
    (tmp_path / "packed" / "meta.json").write_text(json.dumps({"format": PACK_FORMAT}))
    for argv, line in (
        ([*folder, "data.path=imgs"],
         f"cnnkit: error: data.val_path {tmp_path / 'imagenet-val'}: no such folder (set "
         "data.val_path, or data.val_path=null to hold out data.val_fraction of data.path)"),
        ([*folder, "data.path=nowhere", "data.val_path=null"],
         f"cnnkit: error: data.path {tmp_path / 'nowhere'}: no such folder (set data.path)"),
        (["train", "alexnet-imagenet", "data.path=imgs"],
         f"cnnkit: error: data.path {tmp_path / 'imgs'}: not a packed data set, no meta.json "
         "(it holds images: `cnnkit pack` it first, or train from it with data.source=folder)"),
        ([*folder, "data.path=imgs", "data.val_path=packed"],  # was: no images in class folders
         f"cnnkit: error: data.val_path {tmp_path / 'packed'}: a packed data set, and data.path "
         "a folder: give the held-out images as a folder too, or train on a pack of data.path "
         "(cnnkit pack)"),
    ):  # fmt: skip
        code, err = _fails(argv, capsys)
        assert code == 1 and err == line, err


def test_quiet_keeps_the_last_line_naming_the_run_directory(tmp_path, capsys, monkeypatch):
    """--quiet leaves out the start, progress and epoch lines but not the last: without --out
    it is all that says which run directory was made."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["train", "digits", "train.epochs=1", "train.warmup_epochs=0",
                              "train.calibrate=false", "--quiet"], capsys)  # fmt: skip
    (made,) = (tmp_path / "runs").iterdir()
    assert code == 0 and err == "", err
    assert out.startswith("done: held-out top-1 ") and out.endswith(f" -> runs/{made.name}\n")
    assert len(out.splitlines()) == 1 and (made / "last.pt").is_file(), out


def test_failed_starts_overwrite_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    files = {"config.yaml": b"name: old\n", "last.pt": b"\x00truncated", "metrics.csv": b"epoch\n"}
    for name, content in files.items():
        (run / name).write_bytes(content)
    code, err = _fails(["train", "digits", "--out", str(run)], capsys)
    assert code == 2 and "already holds a run" in err
    data = tmp_path / "shapes"  # not a run: a data set's class folders, which a run would mix into
    (data / "cat").mkdir(parents=True)
    (data / ".hidden").write_text("")
    code, err = _fails(["train", "digits", "--out", str(data)], capsys)
    assert code == 2 and "holds files that are not a run's (cat): give a new or empty" in err
    assert sorted(p.name for p in data.iterdir()) == [".hidden", "cat"]
    killed = tmp_path / "killed"  # a first attempt killed as it wrote config.yaml: still ours
    killed.mkdir()
    (killed / "config.yaml.tmp").write_text("name: digits\n")
    assert run_cli(["train", "digits", "--out", str(killed), "--dry-run"], capsys)[0] == 0
    code, err = _fails(["train", "--resume", str(run)], capsys)
    assert code == 1 and "last.pt" in err
    code, err = _fails(["train", "digits", "train.lr=-1", "--out", str(tmp_path / "new")], capsys)
    assert code == 2 and not (tmp_path / "new").exists()
    assert {p.name: p.read_bytes() for p in run.iterdir()} == files


@pytest.mark.parametrize("classes", [2, 10])
def test_eval_prints_top5_only_above_five_classes(classes, capsys, monkeypatch):
    """As training's lines: with 5 classes or fewer top-5 is always 100%, so it is left out."""
    from cnnkit.train import evaluation

    figures = {"loss": 0.1, "top1": 0.9, "top5": 1.0}
    result = {**figures, "images": 7, "checkpoint": "r/best.pt", "classes": classes,
              "tencrop": figures}  # fmt: skip
    monkeypatch.setattr(evaluation, "evaluate_checkpoint", lambda *args: result)
    with pytest.raises(SystemExit) as done:
        main(["eval", "r", "--tencrop"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(("top-5 100.00%" in x) == (classes > 5) for x in lines)


def test_version_and_the_settings_of_a_run_directory(digits_run, capsys):
    code, out, _ = run_cli(["--version"], capsys)
    assert code == 0 and out.startswith("cnnkit 0.") and "torch" in out
    code, out, _ = run_cli(["config", str(digits_run), "--changed"], capsys)
    assert code == 0 and "train.epochs" in out and "config.yaml" in out  # its own settings


def test_a_run_whose_stdout_reader_goes_trains_on(tmp_path):
    """`cnnkit train ... | head -1`: the run does not die of its log (it ended with exit 1 and
    no word, mid-run); it says so once on stderr and finishes, its files whole."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "cnnkit", "train", "digits", "train.epochs=2",
           "--out", str(tmp_path / "run")]  # fmt: skip
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(root)})  # fmt: skip
    assert run.stdout.readline()  # the first line (a measuring note or the start line)
    run.stdout.close()  # the reader goes, as `head -1` does
    err = run.stderr.read()
    assert run.wait(timeout=240) == 0, err
    assert "stdout's reader has gone: training goes on" in err and "Traceback" not in err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["epochs"] == 2


@pytest.mark.parametrize("data,hint", [
    ("{source: synthetic}", "(set data.shape=[3, 32, 32])"),
    ("{source: folder, path: FOLDER, val_fraction: 0.5, crop: 40, size: 46}", "(set data.crop=32, and data.size the side images are"),
    (None, "data: Field required (a run file's data: names its source: one of digits, faces"),
    ("{path: FOLDER, val_fraction: 0.5, crop: 40, size: 46}\nmodel: lenet5",
     "(data.grey: true gives the images' luma; set data.crop=32, and data.size the side"),
    ("{path: FOLDER, val_fraction: 0.5}\nmodel: lenet5", "[3, 32, 32] (data.grey: true gives the images' luma)"),
])  # fmt: skip
def test_a_mismatch_of_network_and_data_names_the_setting(tmp_path, capsys, data, hint):
    for name in ("a", "b"):  # an image folder of two classes
        (tmp_path / "images" / name).mkdir(parents=True)
        from PIL import Image

        for i in range(5):
            Image.new("RGB", (40, 40), name == "a" and "red" or "blue").save(
                tmp_path / "images" / name / f"{i}.png"
            )
    text = "name: r\n"
    if data:
        text += f"data: {data.replace('FOLDER', str(tmp_path / 'images'))}\n"
    if "model:" not in text:
        text += "model: inception-small\n"
    (tmp_path / "run.yaml").write_text(text)
    got, err = _fails(["train", str(tmp_path / "run.yaml"), "--dry-run"], capsys)
    assert got == 2 and hint in err, err


def test_data_settings_a_training_run_leaves_unused_are_said(tmp_path, capsys, monkeypatch):
    """A validation set that is the training folder is refused (its 'held-out' figures were of
    training images); a label file without its flat folder, a held-out fraction beside a
    validation set, and a small crop of a large data.size are said at the start, not
    silently ignored."""
    monkeypatch.chdir(tmp_path)
    for k in range(2):
        (tmp_path / "imgs" / f"c{k}").mkdir(parents=True)
    base = ["train", "alexnet-imagenet", "data.source=folder", "data.normalize=channel",
            "data.path=imgs", "--dry-run"]  # fmt: skip
    code, err = _fails([*base, "data.val_path=./imgs/"], capsys)
    assert code == 2 and err == (
        "cnnkit: error: data.val_path: the training set itself (data.path), so the held-out "
        "figures would be of training images (leave data.val_path out to hold out "
        "data.val_fraction of data.path)"
    )
    notes = [
        (["data.val_path=null", "data.val_labels=v.txt"],
         "cnnkit: note: data.val_labels is not used: it labels a flat data.val_path, and none is "
         "given"),
        (["data.val_path=other", "data.val_fraction=0.2"],
         "cnnkit: note: data.val_fraction 0.2 is not used: data.val_path holds the held-out "
         "images"),
        (["data.val_path=null", "data.crop=32", "model.network=inception-small"],
         "cnnkit: note: data.crop 32 of data.size 256: images are resized to 256 x 256 first, so "
         "a crop sees 12% of their side (torchvision's 224 of 256: 88%); data.size=37 would be "
         "that"),
    ]  # fmt: skip
    for extra, note in notes:
        with pytest.raises(SystemExit):  # (the empty class folders end it, after the notes)
            main([*base, *extra])
        assert note in capsys.readouterr().err.splitlines()


def test_compiling_without_a_cpp_compiler_is_one_line(capsys, monkeypatch):
    """torch.compile on a CPU builds kernels with a C++ compiler, which slim containers lack:
    a traceback from inductor at the first step, now one line before any work (bench too)."""
    from torch._inductor import cpp_builder, exc

    def none():
        raise exc.InvalidCxxCompiler()

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", none)
    for argv in (["train", "digits", "train.compile=true", "--dry-run"],
                 ["bench", "infer", "digitnet", "--compile", "--batch", "2"]):  # fmt: skip
        code, _, err = run_cli(argv, capsys)
        line = one_error_line(code, err)
        assert line.startswith(
            "cnnkit: error: train.compile: torch.compile needs a C++ "
            "compiler, and none works here (No working C++ compiler"
        ), line


def test_a_compiled_runs_torch_log_lines_that_say_nothing_are_left_out():
    """Under --nproc every rank printed dynamo's "Profiler record function ... will be
    ignored" (DDP's forward) and, on a CPU machine with a CUDA_HOME, inductor's "No CUDA
    runtime is found": those two lines alone are left out, once set, however often."""
    import logging

    from cnnkit.runtime import quiet_compile_logs

    quiet_compile_logs()
    quiet_compile_logs()
    dynamo = logging.getLogger("torch._dynamo.variables.ctx_manager")
    builder = logging.getLogger("torch.utils.cpp_extension")
    assert len(dynamo.filters) == len(builder.filters) == 1
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    for logger in (dynamo, builder):  # (torch's loggers do not propagate to the root's)
        logger.addHandler(handler)
    try:
        dynamo.warning("Profiler record function %s will be ignored", "<class 'x'>")
        builder.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local")
        dynamo.warning("Graph break: something a user may want to see")
        builder.warning("Profiler record function from another logger")
    finally:
        for logger in (dynamo, builder):
            logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == [
        "Graph break: something a user may want to see",
        "Profiler record function from another logger",
    ]


def test_the_start_line_says_an_image_sets_crops(shapes, tmp_path, capsys, monkeypatch):
    """The crop and the size it is cut from, which the network may have given (left out of
    the run): a resnet18 on a folder trained at 224 of 256 without a word of it."""
    monkeypatch.chdir(tmp_path)
    argv = ["train", "lenet5", f"data.path={shapes}", "data.grey=true", "--dry-run"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0 and ", crops 32 of 37 px, " in out, err
    code, out, err = run_cli([*argv, "data.train_crop=resized"], capsys)
    assert code == 0 and ", random-resized crops 32 of 37 px, " in out, err
    code, out, err = run_cli(["train", "digits", "--dry-run"], capsys)
    assert code == 0 and "crops" not in out, err  # (images at the network's size)
    from cnnkit.data.pack import pack_folder

    pack_folder(shapes, tmp_path / "p64", size=64, progress=False)  # a pack too large: noted
    code, out, err = run_cli(["train", "lenet5", "data.path=p64", "data.grey=true", "--dry-run"],
                             capsys)  # fmt: skip
    assert code == 0 and ", crops 32 of 64 px, " in out, err
    assert "cnnkit: note: data.crop 32 of a set packed at 64 px: a crop sees 50%" in err
    assert "`cnnkit pack SRC DST --size 37` packs it for this network" in err


def test_a_pack_class_whose_every_file_was_unreadable_is_refused(tmp_path, capsys):
    """`cnnkit pack` keeps such a class (with a warning), and training gave the network an
    output that never learns, without a word; an empty class folder is refused alike."""
    import numpy as np
    from PIL import Image

    from cnnkit.data.pack import pack_folder

    for name in ("a", "b", "c"):
        (tmp_path / "src" / name).mkdir(parents=True)
    for name in ("a", "b"):
        for i in range(3):
            pixels = np.full((20, 20, 3), 40 * i, np.uint8)
            Image.fromarray(pixels).save(tmp_path / "src" / name / f"{i}.png")
    (tmp_path / "src" / "c" / "x.jpg").write_bytes(b"")
    (tmp_path / "src" / "c" / "y.png").write_text("junk")
    pack_folder(tmp_path / "src", tmp_path / "p", size=16, workers=1, progress=False)
    code, err = _fails(["train", "digitnet", f"data.path={tmp_path / 'p'}",
                        "model.input=[3,16,16]", "--out", str(tmp_path / "r")], capsys)  # fmt: skip
    assert code == 1 and err.startswith(f"cnnkit: error: data.path {tmp_path / 'p'}: class 'c' "
                                        "has no image to train on"), err  # fmt: skip
    assert not (tmp_path / "r").exists()


def test_an_error_whose_stderr_reader_has_gone_keeps_its_exit_status(tmp_path):
    """`cnnkit ... 2>&1 | head -1` after the reader has gone: printing the error line failed
    and the status became 1 (a usage error's 2, a Ctrl-C's 130, lost)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "cnnkit", "info", str(tmp_path / "missing.yaml")]
    run = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           env={**os.environ, "PYTHONPATH": str(root)})  # fmt: skip
    run.stderr.close()  # gone before the command says anything (its imports take seconds)
    assert run.wait(timeout=120) == 2
