"""Two corpora through the CLI in this process: bad overrides (exit 2, nothing written) and
tampered checkpoints (exit 1 or 2, one line, no traceback); and the command line's own
mistakes in one line, its notes, and `--help` without torch."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import CLI, ROOT, one_error_line, run_cli

from cnnkit.config import load_run
from cnnkit.errors import ConfigError, plural
from cnnkit.train.run import fit

OVERRIDES = [  # (override, a piece of the message)
    ("train.lr=-1", "train.lr: Input should be greater than 0"),
    ("train.lr=inf", "train.lr: Input should be a finite number"),
    ("train.lr=nan", "train.lr: Input should be a finite number"),
    ("train.lr=fast", "train.lr: Input should be a valid number"),
    ("train.lr=[1, 2]", "train.lr: Input should be a valid number"),
    ("train.epochs=0", "train.epochs: Input should be greater than 0"),
    ("train.epochs=1.5", "train.epochs: Input should be a valid integer"),
    ("train.optimizer=sgdd", "train.optimizer: Input should be 'sgd'"),
    ("train.betas=[2, 3]", "train.betas: each beta must be in [0, 1)"),
    ("train.betas=[0.9]", "train.betas"),
    ("train.min_lr=10", "min_lr 10.0 is above lr"),
    ("train.momentum=1", "train.momentum: Input should be less than 1"),
    ("train.schedule=multistep", "needs train.milestones"),
    ("train.device=tpu", "train.device: 'tpu' is not one of"),
    ("train.precision=fp8", "train.precision: Input should be"),
    ("train.threads=0", "train.threads: Input should be greater than 0"),
    ("train.lrr=0.1", "train.lrr: unknown field (did you mean 'lr'?)"),
    ("train.deterministic=true", "train.deterministic: unknown field (it belongs at the top level"),
    ("train.mixup=0.2", "train.mixup: unknown field (it belongs in data: data.mixup)"),
    ("train.accumulate=1000", "train.accumulate: 1000 micro-batches of a batch of 64 images"),
    ("trian.lr=0.1", "trian: unknown field (did you mean 'train'?)"),
    ("data.batch_size=0", "data.batch_size: Input should be greater than 0"),
    ("data.batch_size=100000", "data.batch_size: 100000 is larger than the training set"),
    ("data.source=imagenet", "data.source: unknown source 'imagenet'"),
    ("data.source=folder", "data.path: Field required"),
    ("data.shift=2", "data.shift: Input should be less than or equal to 0.5"),
    ("data.shfit=0.1", "data.shfit: unknown field (did you mean 'shift'?)"),
    ("name=../../x", "name: use letters, digits"),
    (
        "name=",
        "override 'name=': the value is empty (an unset shell variable?): give one, or "
        "name=null for none",
    ),
    ("data.path=", "override 'data.path=': the value is empty (an unset shell variable?)"),
    ("model=nosuchnet", "'nosuchnet' is neither a zoo network"),
    ("model.weights=missing.pt", "'missing.pt': no such weights file"),
    ("seed=-1", "seed: Input should be greater than or equal to 0"),
    ("deterministic=maybe", "deterministic: Input should be a valid boolean"),
    ("=5", "expected key=value"),
    ("train", "expected key=value"),
    ("train..lr=1", "expected key=value"),
    (
        "train.norm-weight-decay=0",
        "underscores where command-line flags take dashes: train.norm_weight_decay=0",
    ),
    ("data=5", "override 'data=5': data is a section: set its settings one by one (data.KEY"),
    ("train=5", "override 'train=5': train is a section: set its settings one by one"),
    ("train.lr.x=1", "lr is not a section"),
]


def test_a_section_left_empty_in_a_run_file_takes_its_defaults_and_overrides(tmp_path):
    """`train:` with nothing under it (YAML's null) is the section's defaults, set key by key
    as any other (it was pydantic's 'valid dictionary', then 'train is not a section')."""
    run = tmp_path / "run.yaml"
    run.write_text("model: digitnet\ndata: {source: digits}\ntrain:\n")
    assert load_run(run).train.lr == 0.01
    assert load_run(run, ["train.lr=0.1"]).train.lr == 0.1


@pytest.mark.parametrize("override,expected", OVERRIDES, ids=[o for o, _ in OVERRIDES])
def test_bad_override_is_one_line_and_writes_nothing(override, expected, tmp_path, capsys,
                                                     monkeypatch):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    started = time.perf_counter()
    code, _, err = run_cli(["train", "digits", override, "--quiet"], capsys)
    line = one_error_line(code, err, (2,))
    assert expected in line, line
    assert time.perf_counter() - started < 20 and not list(tmp_path.iterdir())  # no runs/


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("tamper") / "run"
    fit(load_run("digits", ["train.epochs=1"]), run, quiet=True)
    return run


def _tampered(state: dict) -> dict[str, dict | bytes]:
    import copy

    def edit(**changes):
        out = copy.copy(state)
        for k, v in changes.items():
            if v is KeyError:
                out.pop(k)
            else:
                out[k] = v
        return out

    pre, cfg = state["preprocess"], state["config"]
    variants = {f"no {k}": edit(**{k: KeyError}) for k in
                ("model_spec", "num_classes", "model", "classes", "preprocess", "config")}  # fmt: skip
    variants.update({
        "epoch a string": edit(epoch="two"), "negative step": edit(step=-3),
        "unknown preprocess key": edit(preprocess={**pre, "gamma": 2.2}),
        "preprocess resize 60000": edit(preprocess={**pre, "resize": 60000}),
        "preprocess std 0": edit(preprocess={**pre, "std": [0.0]}),
        "classes too few": edit(classes=state["classes"][:4]),
        "num_classes 0": edit(num_classes=0), "empty model": edit(model={}),
        "model not tensors": edit(model={"conv1.weight": [1, 2, 3]}),
        "config without data": edit(config={k: v for k, v in cfg.items() if k != "data"}),
        "history of text": edit(history=[{"epoch": "one"}]),
        "wrong format": edit(format="other/1"),
        "weights of another net": edit(model={"x.weight": torch.zeros(2)}),
        "damaged rng": edit(rng={"torch": "x"}, rng_ranks=[{"torch": "x"}]),
        "damaged optimizer": edit(optimizer={"state": {}, "param_groups": "x"}),
        "preprocess channels 2": edit(preprocess={**pre, "channels": 2, "mean": [0.0], "std": [1.0]}),
        "preprocess crop 16": edit(preprocess={**pre, "crop": 16}),
        "train epochs text": edit(config={**cfg, "train": {**cfg.get("train", {}), "epochs": "x"}}),
        "a weight missing": edit(model={k: v for k, v in list(state["model"].items())[1:]}),
        "a nan weight": edit(model={k: v.clone().fill_(float("nan")) if i == 2 else v
                                    for i, (k, v) in enumerate(state["model"].items())}),
    })  # fmt: skip
    buf = io.BytesIO()
    torch.save({"format": "cnnkit-checkpoint/1", "payload": io.BytesIO}, buf)  # a pickled class
    variants.update({"pickled object": buf.getvalue(), "random bytes": os.urandom(4096)})
    return variants


READS = {"damaged rng": ("train",), "damaged optimizer": ("train",),  # the commands that read
         "train epochs text": ("train", "eval"), "preprocess channels 2": ("eval", "classify"),
         "preprocess crop 16": ("eval", "classify")}  # fmt: skip


def test_tampered_checkpoints_are_one_line_never_a_traceback(good_run, tmp_path, capsys):
    state = torch.load(good_run / "last.pt", weights_only=True)
    image = tmp_path / "digit.png"
    from PIL import Image

    Image.new("L", (8, 8), 128).save(image)
    variants = _tampered(state)
    assert len(variants) >= 20
    for name, content in variants.items():
        folder = tmp_path / name.replace(" ", "-")
        folder.mkdir()
        shutil.copy(good_run / "config.yaml", folder / "config.yaml")
        target = folder / "last.pt"
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            torch.save(content, target)
        before = sorted(p.name for p in folder.iterdir())
        for args in (["eval", str(target)], ["classify", str(target), str(image)],
                     ["train", "--resume", str(folder), "--quiet"]):  # fmt: skip
            if name in READS and args[0] not in READS[name]:  # this command reads none of it
                if args[0] != "train":  # (a resume would write: it is not run)
                    code, _, err = run_cli(args, capsys)
                    assert code == 0, (name, args[0], err)
                continue
            code, _, err = run_cli(args, capsys)
            line = one_error_line(code, err)
            assert str(target) in line or "last.pt" in line, (name, line)
            if name == "a weight missing":  # the key is named, not only "Error(s) in loading"
                assert next(iter(state["model"])) in line, line
            if name == "a nan weight":  # named, not predictions of nan (or a run diverging)
                assert f"{list(state['model'])[2]} holds nan or inf" in line, line
        assert sorted(p.name for p in folder.iterdir()) == before, name  # nothing written


@pytest.mark.parametrize("content,said", [
    (b"hello\n", "a text file, not a checkpoint (torch.save writes a zip archive)"),
    (b"caf\xc3\xa9 au lait\n", "a text file, not a checkpoint (torch.save writes a zip archive)"),
    (b"", "an empty file, not a checkpoint"),
    (bytes(range(1, 256)), "not a checkpoint (torch.save writes a zip archive, or a pickle in its "
                           "older format; this file is neither)"),
    (b"\x80\x02", "not a readable checkpoint (a pickle, but truncated or damaged)"),
])  # fmt: skip
def test_a_file_that_is_no_checkpoint_says_what_it_is(tmp_path, capsys, content, said):
    """Said from the file's first bytes, never torch.load's raw text (a text file's was '101',
    a pickle opcode; one starting with 'c' read as a pickled object named after its words)."""
    (tmp_path / "x.pt").write_bytes(content)
    code, _, err = run_cli(["eval", str(tmp_path / "x.pt")], capsys)
    assert one_error_line(code, err, (1,)) == f"cnnkit: error: {tmp_path / 'x.pt'}: {said}"


def test_config_errors_suggest_the_field_meant():
    with pytest.raises(ConfigError, match=r"train.lrr: unknown field \(did you mean 'lr'\?\)"):
        load_run("digits", ["train.lrr=0.1"])


def test_messages_count_in_the_plural_but_for_one():
    assert [plural(n, "epoch") for n in (0, 1, 2)] == ["0 epochs", "1 epoch", "2 epochs"]
    assert [plural(n, "class", "classes") for n in (1, 3)] == ["1 class", "3 classes"]


def test_eval_takes_a_safetensors_export_with_data(tmp_path, capsys):
    """A .safetensors export records no data section: eval asks for --data, then evaluates."""
    run = tmp_path / "r"
    fit(load_run("digits", ["train.epochs=1"]), run, quiet=True)
    export = tmp_path / "d.safetensors"
    code, _, err = run_cli(
        ["export", str(run), "--format", "safetensors", "-o", str(export)], capsys
    )
    assert code == 0, err
    code, _, err = run_cli(["eval", str(export)], capsys)
    assert "give --data" in one_error_line(code, err, (2,))
    code, out, err = run_cli(["eval", str(export), "--data", "digits", "--json"], capsys)
    from_export = json.loads(out)
    code, out, _ = run_cli(["eval", str(run), "--json"], capsys)
    assert (
        from_export["top1"] == pytest.approx(json.loads(out)["top1"])
        and from_export["images"] == 359
    )


def test_help_and_zoo_start_without_torch():
    """`cnnkit --help` and `cnnkit zoo` stay fast (0.5 s, not 4): the command line imports the
    library only inside the commands that need it."""
    code = ("import sys, contextlib, io, cnnkit.cli as c\n"
            "with contextlib.redirect_stdout(io.StringIO()): c.app(['zoo'], standalone_mode=False)\n"
            "print('torch' in sys.modules)")  # fmt: skip
    done = subprocess.run([*CLI[:1], "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.strip() == "False", done.stderr[-500:]


@pytest.mark.parametrize("args", [["classify", "digitnet", "x.png", "--top", "0"],
                                  ["info", "digitnet", "--num-classes", "abc"],
                                  ["train", "digits", "--no-such-option"], ["no-such-command"],
                                  ["info"], ["info", "digitnet", "--num-classes", "-1"],
                                  ["bench", "train", "digitnet", "--repeats", "0"],
                                  ["bench", "layers", "digitnet", "--threads", "0"],
                                  ["pack", "a", "b", "--workers", "-1"]])  # fmt: skip
def test_a_bad_option_or_command_is_one_line_naming_the_help(args, capsys):
    line = one_error_line(*run_cli(args, capsys)[::2], codes=(2,))
    assert line.endswith("--help)")


@pytest.mark.parametrize("group", [[], ["bench"], ["show"]])
def test_a_command_group_alone_shows_its_help_once(group, capsys):
    code, out, _ = run_cli(group, capsys)
    assert code == 2 and out.count("Usage: cnnkit") == 1


def test_end_of_input_inside_a_command_is_one_line_not_an_interrupt(monkeypatch, capsys):
    """typer turns an EOFError (a benchmark peer lost) into Abort: an error, exit 1."""
    from cnnkit.infer import load

    def lost(*args, **kwargs):
        raise EOFError

    monkeypatch.setattr(load, "network_of", lost)
    code, _, err = run_cli(["info", "digitnet"], capsys)
    assert "aborted" in one_error_line(code, err, (1,))


def test_a_source_that_is_not_a_name_is_one_line(capsys):
    code, _, err = run_cli(["train", "digits", "data.source=[a]"], capsys)
    assert code == 2 and err.strip() == (
        "cnnkit: error: data.source: a name (digits, faces, synthetic, folder, packed), not ['a']"
    )


def test_schedules_this_run_never_reaches_are_said(tmp_path, capsys):
    code, out, err = run_cli(["train", "digits", "train.warmup_epochs=30", "train.schedule=multistep",
                              "train.milestones=[2,25]", "train.calibrate=false", "--dry-run"], capsys)  # fmt: skip
    notes = [
        line for line in err.splitlines() if line.startswith("cnnkit: note:")
    ]  # warnings: stderr
    assert (
        code == 0
        and not [line for line in out.splitlines() if "note:" in line]
        and notes
        == [
            "cnnkit: note: train.warmup_epochs 30 of 25 epochs: the lr never reaches train.lr 0.05",
            "cnnkit: note: train.milestones [25] at or past the last epoch (25): no drop there",
        ]
    ), out + err
    code, out, err = run_cli(["train", "digits", "train.calibrate=false", "--dry-run"], capsys)
    assert code == 0 and "note:" not in out + err
    code, out, err = run_cli(["train", "digits", "train.warmup_epochs=30", "train.epochs=2",
                              "train.step_size=1", "--dry-run", "--quiet"], capsys)  # fmt: skip
    assert code == 0 and "cnnkit: note: train.warmup_epochs 30 of 2 epochs" in err  # --quiet too
    assert ("cnnkit: note: train.schedule cosine does not use train.step_size (train.schedule="
            "step would use it)\n") in err  # a setting the run's schedule never reads  # fmt: skip
    code, _, said = run_cli(["config", "digits", "train.step_size=1"], capsys)
    assert code == 0 and "train.schedule cosine does not use train.step_size" in said  # as train


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_full_standard_output_is_named_as_such(tmp_path):
    """print()'s error names no file: `cnnkit zoo > log` on a full disk said only 'No space
    left on device', as if a file of its own had failed."""
    import sys

    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "cnnkit", "zoo"], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr == "cnnkit: error: standard output: No space left on device\n"
