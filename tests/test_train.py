"""The training step against a plain PyTorch loop, optimisers and their per-layer groups,
precision, and a whole tiny run with every file of its run directory."""

from __future__ import annotations

import copy
import csv
import json
import time

import pytest
import torch

from cnnkit import build_model
from cnnkit.checkpoint import load_checkpoint
from cnnkit.cli import main
from cnnkit.config import TrainConfig, load_run, validate_run
from cnnkit.distributed import resolve_device
from cnnkit.errors import ConfigError, DataError
from cnnkit.train.engine import build_engine, train_step
from cnnkit.train.evaluation import evaluate_ten_crops
from cnnkit.train.loop import evaluate
from cnnkit.train.metrics import best_epoch, tied_after
from cnnkit.train.optim import build_optimizer
from cnnkit.train.run import fit

CPU = torch.device("cpu")
FP32 = {"precision": "fp32", "channels_last": False}


def _batch(n=32, shape=(1, 25, 25), classes=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=gen), torch.randint(0, classes, (n,), generator=gen)


def test_one_step_lowers_the_loss():
    torch.manual_seed(0)
    engine = build_engine(build_model("facenet"), TrainConfig(lr=0.05, **FP32), CPU)
    x, y = _batch()
    before, _ = train_step(engine, x, y)
    for _ in range(3):
        after, _ = train_step(engine, x, y)
    assert after.item() < before.item()


def test_train_step_equals_a_plain_pytorch_loop():
    torch.manual_seed(0)
    network = build_model("facenet")
    reference = copy.deepcopy(network)
    cfg = TrainConfig(lr=0.1, momentum=0.9, weight_decay=1e-3, optimizer="nesterov", **FP32)
    engine = build_engine(network, cfg, CPU)
    opt = torch.optim.SGD(
        reference.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True
    )
    for seed in range(3):
        x, y = _batch(seed=seed)
        train_step(engine, x, y)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()
    for a, b in zip(network.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("weighted", [False, True])
def test_accumulation_equals_the_whole_batch(weighted):
    """Also with class weights (the loss normalises by the batch's weights, not its images):
    micro-batches of mostly one class must not lose the weighting."""
    torch.manual_seed(0)
    whole = build_model("facenet")
    parts = copy.deepcopy(whole)
    x, _ = _batch()
    y = torch.tensor([0] * 24 + [1] * 8)  # micro-batches of 8: three of class 0, one of 1
    weights = torch.tensor([0.25, 3.0]) if weighted else None
    cfg = TrainConfig(lr=0.5, momentum=0.0, weight_decay=0.0, **FP32)
    loss, _ = train_step(build_engine(whole, cfg, CPU, class_weights=weights), x, y)
    engine = build_engine(parts, cfg.model_copy(update={"accumulate": 4}), CPU,
                          class_weights=weights)  # fmt: skip
    loss_parts, _ = train_step(engine, x, y)
    torch.testing.assert_close(loss_parts, loss)
    for a, b in zip(whole.parameters(), parts.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gradient_clipping_bounds_the_update():
    torch.manual_seed(0)
    network = build_model("facenet")
    before = torch.cat([p.detach().flatten().clone() for p in network.parameters()])
    cfg = TrainConfig(lr=1.0, momentum=0.0, weight_decay=0.0, grad_clip=0.01, **FP32)
    train_step(build_engine(network, cfg, CPU), *_batch())
    after = torch.cat([p.detach().flatten() for p in network.parameters()])
    assert (after - before).norm().item() == pytest.approx(0.01, rel=1e-3)


def test_alexnet_biases_learn_twice_as_fast_without_decay():
    network = build_model("alexnet", device="meta")
    opt = build_optimizer(network, TrainConfig(lr=0.01, weight_decay=5e-4))
    groups = {(g["lr"], g["weight_decay"]): len(g["params"]) for g in opt.param_groups}
    assert groups == {(0.01, 5e-4): 8, (0.02, 0.0): 8}  # 8 weights, 8 biases


def test_norm_and_bias_decay_are_torchvisions():
    """train.norm_weight_decay / bias_weight_decay as torchvision's reference scripts'
    --norm-weight-decay / --bias-weight-decay group resnet18: its 20 BatchNorms' 40 parameters,
    its 21 biases (a BatchNorm's bias is a bias); left out, every parameter takes weight_decay;
    a layer's decay_mult still scales them (AlexNet's biases: none)."""
    from cnnkit.nn import build_model
    from cnnkit.train.optim import build_optimizer

    net = build_model("resnet18", num_classes=10)
    names = {id(p): n for n, p in net.named_parameters()}

    def decays(**given) -> dict[str, float]:
        cfg = TrainConfig(weight_decay=1e-4, **given)
        return {names[id(p)]: g["weight_decay"] for g in build_optimizer(net, cfg).param_groups
                for p in g["params"]}  # fmt: skip

    assert set(decays().values()) == {1e-4}
    norm = decays(norm_weight_decay=0.0)
    assert sorted(n for n, d in norm.items() if d == 0) == sorted(
        n for n, m in net.named_modules() if isinstance(m, torch.nn.BatchNorm2d)
        for n in (f"{n}.weight", f"{n}.bias")
    ) and len([d for d in norm.values() if d == 0]) == 40  # fmt: skip
    both = decays(norm_weight_decay=0.0, bias_weight_decay=2e-5)
    assert sorted(n for n, d in both.items() if d == 2e-5) == sorted(
        n for n in names.values() if n.endswith(".bias")
    ) and sum(d == 2e-5 for d in both.values()) == 21  # fmt: skip
    assert sum(d == 1e-4 for d in both.values()) == 21  # 20 convolutions' weights and fc's
    alexnet = build_model("alexnet", num_classes=10)  # decay_mult 0 on its biases
    groups = build_optimizer(alexnet, TrainConfig(bias_weight_decay=1.0)).param_groups
    assert {g["weight_decay"] for g in groups if g["decay_mult"] == 0} == {0.0}


@pytest.mark.parametrize(
    "name, cls",
    [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)],
)
def test_optimizer_choice(name, cls):
    opt = build_optimizer(build_model("facenet"), TrainConfig(optimizer=name))
    assert type(opt) is cls


def test_bf16_autocast_on_cpu_trains():
    torch.manual_seed(0)
    cfg = TrainConfig(precision="bf16", channels_last=True, lr=0.05)
    engine = build_engine(build_model("facenet"), cfg, CPU)
    losses = [train_step(engine, *_batch())[0].item() for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_fp16_and_absent_cuda_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="fp16"):
        build_engine(build_model("facenet"), TrainConfig(precision="fp16"), CPU)
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):  # measured settings too
        fit(load_run("digits", ["train.precision=fp16", "train.epochs=1"]), tmp_path, quiet=True)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda:1")


TINY = {
    "name": "tiny",
    "model": "facenet",
    "data": {"source": "faces", "batch_size": 30, "mirror": True, "shift": 0.1},
    "train": {"epochs": 2, "lr": 0.02, "schedule": "cosine"},
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    summary = fit(validate_run(TINY), run_dir, quiet=True)
    return run_dir, summary


def test_held_out_images_all_unreadable_is_an_error_not_a_zero():
    class Unreadable:  # a validation stream whose 3 images were all skipped
        num_samples = 3

        def set_epoch(self, epoch, skip_batches=0):
            pass

        def __iter__(self):
            return iter(())

    engine = build_engine(build_model("facenet"), TrainConfig(precision="fp32"), CPU)
    with pytest.raises(DataError, match="no held-out image could be read: all 3"):
        evaluate(engine, Unreadable())
    with pytest.raises(DataError, match="no held-out image could be read: all 3"):
        evaluate_ten_crops(engine, Unreadable(), 25)  # `cnnkit eval --tencrop` too


def test_run_directory_holds_every_file(tiny_run):
    run_dir, summary = tiny_run
    for name in ("config.yaml", "metrics.csv", "last.pt", "best.pt", "curves.png", "summary.json"):
        assert (run_dir / name).is_file(), name
    assert list(run_dir.glob("events.out.tfevents.*"))
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert rows[0].split(",")[:6] == [
        "epoch",
        "train_loss",
        "train_top1",
        "val_loss",
        "val_top1",
        "val_top5",
    ]
    assert len(rows) == 3
    header = rows[0].split(",")
    waits = [float(r.split(",")[header.index("data_wait")]) for r in rows[1:]]
    assert all(0.0 <= w < 1.0 for w in waits)  # the share of each epoch spent on the loader
    written = json.loads((run_dir / "summary.json").read_text())
    assert written["epochs"] == 2 and 0.0 <= written["val_top1"] <= 1.0
    assert written["val_images"] == 50 and written["val_top1"] == summary["val_top1"]


def test_eval_command_repeats_the_held_out_figure(tiny_run, capsys):
    run_dir, summary = tiny_run
    with pytest.raises(SystemExit) as done:
        main(["eval", str(run_dir / "last.pt"), "--json"])
    assert done.value.code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["images"] == 50
    assert result["top1"] == pytest.approx(summary["val_top1"])
    assert result["loss"] == pytest.approx(summary["val_loss"], rel=1e-4)


def test_eval_refuses_a_held_out_split_that_changed(tiny_run, tmp_path, capsys):
    """The run's own split, drawn now from data whose images changed, would count images the
    run trained on: refused in one line (as a resume is); a checkpoint from before the split's
    fingerprint (no `holdout`) still evaluates."""
    from helpers import one_error_line, run_cli

    from cnnkit.checkpoint import load_checkpoint, save_checkpoint

    run_dir, summary = tiny_run
    state = load_checkpoint(run_dir / "last.pt")
    assert state["holdout"]  # a split drawn from the faces' images
    state["holdout"] = "0123456789abcdef"  # as a grown or renamed image folder gives
    save_checkpoint(state, tmp_path / "changed.pt")
    code, out, err = run_cli(["eval", str(tmp_path / "changed.pt")], capsys)
    line = one_error_line(code, err, (2,))
    assert "the held-out images differ from the run's" in line and not out
    # a class folder added (or renamed, or gone) also changes the split: the classes are named
    trained = state["classes"]
    state["classes"] = [trained[0], "cat"]  # (the folder trained/cat is trained/face now)
    save_checkpoint(state, tmp_path / "classes.pt")
    code, out, err = run_cli(["eval", str(tmp_path / "classes.pt")], capsys)
    assert one_error_line(code, err, (2,)) == (
        f"cnnkit: error: {tmp_path / 'classes.pt'}: the data's 2 classes are not the 2 the run "
        "trained on (gone: cat; new: face): evaluate it on the data as it was, or give --data "
        "images it never trained on")  # fmt: skip
    state["classes"] = trained
    del state["holdout"]
    save_checkpoint(state, tmp_path / "older.pt")
    code, out, _ = run_cli(["eval", str(tmp_path / "older.pt"), "--json"], capsys)
    assert code == 0 and json.loads(out)["top1"] == pytest.approx(summary["val_top1"])


def test_eval_of_a_run_whose_data_moved_says_how_to_give_it(tiny_run, tmp_path, capsys):
    """eval RUN reads the run's own data.path; moved since, it said '(set data.path)', which
    eval has no way to set: it names --data, and what each kind of --data scores."""
    from helpers import one_error_line, run_cli

    from cnnkit.checkpoint import load_checkpoint, save_checkpoint

    state = load_checkpoint(tiny_run[0] / "last.pt")
    gone = tmp_path / "moved"
    state["config"]["data"] = {"source": "folder", "path": str(gone), "crop": 25, "size": 25}
    save_checkpoint(state, tmp_path / "moved.pt")
    code, _, err = run_cli(["eval", str(tmp_path / "moved.pt")], capsys)
    assert one_error_line(code, err, (1,)) == (
        f"cnnkit: error: the run's data.path {gone}: no such folder now (moved? give --data: "
        "a data YAML naming where it is now, with the run's val_fraction or val_path, scores "
        "its held-out split; a folder, every image in it)")  # fmt: skip


def test_a_bundled_sets_number_classes_are_not_taken_for_caffes_indices(tiny_run, capsys):
    """digits' classes are named '0'-'9' by the set itself: scored by a faces network, they are
    not the classes 'given by index, as in Caffe's val.txt' that a label file's would be."""
    from helpers import one_error_line, run_cli

    code, _, err = run_cli(["eval", str(tiny_run[0]), "--data", "digits"], capsys)
    assert one_error_line(code, err, (1,)) == (
        "cnnkit: error: --data digits: class '0' is not one the network was trained on "
        "(2 classes: 'non-face', 'face')")  # fmt: skip


def test_digits_run_learns_in_a_few_epochs(tmp_path):
    config = load_run("digits", ["train.epochs=3", "train.warmup_epochs=0"])
    summary = fit(config, tmp_path / "digits", quiet=True)
    assert summary["val_top1"] > 0.9 and summary["val_images"] == 359


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_mixed_precision_trains(precision, tmp_path):
    run = {**TINY, "train": {**TINY["train"], "device": "cuda", "precision": precision}}
    summary = fit(validate_run(run), tmp_path / precision, quiet=True)
    state = torch.load(tmp_path / precision / "last.pt", weights_only=True)
    assert summary["device"].startswith("cuda") and summary["precision"] == precision
    assert all(v.dtype != torch.float16 for v in state["model"].values())  # saved as fp32
    assert (precision == "fp16") == bool(state["scaler"])  # GradScaler state only for fp16


def test_metrics_record_the_share_of_time_spent_waiting_for_the_loader(tmp_path, monkeypatch):
    """A loader that takes 0.5 s per batch (the model needs a few ms, some 100 ms on a loaded
    machine) makes data_wait most of each epoch."""
    from cnnkit.data.memory import TensorBatches

    plain = TensorBatches.__iter__

    def slow(self):
        for batch in plain(self):
            time.sleep(0.5)
            yield batch

    monkeypatch.setattr(TensorBatches, "__iter__", slow)
    cfg = {**TINY, "train": {**TINY["train"], "epochs": 1}}
    fit(validate_run(cfg), tmp_path / "run", quiet=True)
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    assert float(rows[0]["data_wait"]) > 0.5


@pytest.mark.parametrize("program", ["untouched", "global ieee", "cuda matmuls alone"])
def test_tf32_settings_keep_torchs_two_apis_agreeing(monkeypatch, program):
    """TF32 on CUDA leaves torch.get_float32_matmul_precision readable (inductor's autotuning
    and TunableOp read it: it raised where only backends.cuda.matmul.fp32_precision was set),
    never reads the legacy allow_tf32 flags a program's own settings can make raise, and puts
    back what the program had; without CUDA nothing is touched."""
    from cnnkit.bench.peak import math_mode
    from cnnkit.runtime import restore_matmuls, tf32_matmuls
    from cnnkit.train.run import deterministic_mode

    backends = (torch.backends, torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    saved = torch.get_float32_matmul_precision(), [b.fp32_precision for b in backends]
    try:
        if program == "global ieee":  # the new API in use, as torch's docs now advise
            torch.backends.fp32_precision = "ieee"
        elif program == "cuda matmuls alone":  # legal, and the legacy getters raise after it
            torch.backends.cuda.matmul.fp32_precision = "tf32"
        with deterministic_mode(False, torch.device("cpu")):
            pass
        had = [b.fp32_precision for b in backends]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert tf32_matmuls() is None and [b.fp32_precision for b in backends] == had
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        old = tf32_matmuls()
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.get_float32_matmul_precision() == "high"  # raised before
        assert math_mode(torch.device("cuda"), "fp32").startswith("fp32 (")  # read, not raised
        restore_matmuls(old)
        assert [b.fp32_precision for b in backends] == had
        if program != "cuda matmuls alone":  # (there the getter raised: nothing to restore)
            assert torch.get_float32_matmul_precision() == saved[0]
    finally:
        torch.set_float32_matmul_precision(saved[0])
        for backend, value in zip(backends, saved[1], strict=True):
            backend.fp32_precision = value


def test_best_epoch_is_the_first_of_a_tie_and_later_ties_are_counted():
    """best.pt, best_ema.pt, the last line, early stopping and the curves take one rule: the
    highest held-out top-1, the first of a tie (timm's and Lightning's); "_ema" ranks the
    moving average's figures."""
    rows = [{"val_top1": 0.9}, {"val_top1": 1.0}, {"val_top1": 0.8}, {"val_top1": 1.0}]
    assert best_epoch(rows) == 1 and best_epoch([]) is None and tied_after(rows, 1) == 1
    ema = [{"val_top1": 1.0}, {"val_top1": 0.2, "val_top1_ema": 0.8},
           {"val_top1": 0.1, "val_top1_ema": 0.9}]  # fmt: skip
    assert best_epoch(ema, "_ema") == 2 and best_epoch(rows, "_ema") is None


def test_a_tie_keeps_the_first_epoch_and_the_last_line_says_later_ones_tied(tmp_path,
                                                                             monkeypatch, capsys):  # fmt: skip
    """Every epoch at held-out top-1 100% (a held-out set too small to tell them apart, a
    user's 300-epoch run kept epoch 1 without a word): best.pt holds the first, summary.json
    names it, and the last line says how many later epochs tied it."""
    from cnnkit.train import epochs as epochs_module

    real = epochs_module._evaluate

    def tied(engine, progress, stats, schedule, ctx):
        row = real(engine, progress, stats, schedule, ctx)
        return {**row, "val_top1": 1.0, "val_loss": 1.0 / row["epoch"]}

    monkeypatch.setattr(epochs_module, "_evaluate", tied)
    summary = fit(validate_run({**TINY, "train": {**TINY["train"], "epochs": 3}}), tmp_path / "r",
                  quiet=False)  # fmt: skip
    assert summary["best_epoch"] == 1
    assert load_checkpoint(tmp_path / "r" / "best.pt")["epoch"] == 1
    assert "best 100.00% at epoch 1 (and 2 later epochs), kept as best.pt" in (
        capsys.readouterr().out
    )
