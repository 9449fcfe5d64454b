"""The CUDA path end to end (run by `pytest -m gpu` on a GPU machine; skipped elsewhere):
training through validation, evaluation and 10-crop on the device, the page-locked slot ring,
JPEGs decoded on the GPU, a one-process NCCL group, the benchmark's steady-state figures, a
training step and the RandAugment / TrivialAugment policies that never wait for the
GPU, and fp16 with loss scaling, the moving average,
random-resized crops and erasing on the device, classified there as the run trained."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cnnkit.config import validate_run
from cnnkit.data import data_config
from cnnkit.data.pack import pack_folder
from cnnkit.data.synth import synth_shapes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
CUDA, CPU = torch.device("cuda"), torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]
NET = Path(__file__).parent / "data" / "tiny_alexnet.yaml"  # input 20x20


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    synth_shapes(root / "src", classes=4, per_class=12, size=32)
    pack_folder(root / "src", root / "raw", size=24, progress=False)
    pack_folder(root / "src", root / "jpeg", size=24, format="jpeg", quality=95, progress=False)
    return root


def test_training_on_cuda_validates_evaluates_and_tencrops(shapes, tmp_path):
    from cnnkit.train.evaluation import evaluate_checkpoint
    from cnnkit.train.run import fit

    run = {"name": "g", "model": str(NET),
           "data": {"source": "packed", "path": str(shapes / "raw"), "crop": 20, "batch_size": 8,
                    "val_fraction": 0.25, "workers": 2},
           "train": {"epochs": 2, "device": "cuda", "optimizer": "adam", "lr": 0.003}}  # fmt: skip
    summary = fit(validate_run(run), tmp_path / "run", quiet=True)
    assert summary["device"].startswith("cuda") and summary["epochs"] == 2
    plain = evaluate_checkpoint(tmp_path / "run", device="cuda")
    ten = evaluate_checkpoint(tmp_path / "run", device="cuda", tencrop=True)
    assert plain["images"] == ten["images"] == 12 and 0 <= ten["tencrop"]["top1"] <= 1
    on_cpu = evaluate_checkpoint(tmp_path / "run", device="cpu")  # the CPU's auto: bf16 on some
    assert plain["loss"] == pytest.approx(on_cpu["loss"], rel=0.05, abs=0.02)
    assert plain["top1"] == pytest.approx(on_cpu["top1"], abs=2 / 12)  # near-ties may flip


def _late(monkeypatch) -> None:
    """Every copy to the GPU starts 25 ms late on the side stream, and every batch is used 25 ms
    late on the compute stream: a slot released, or a tensor reused, before the copy that reads
    it is done would show as a wrong batch."""
    from cnnkit.data.feed import DeviceFeed

    plain = DeviceFeed.overlapped

    def wait_first(prepare):
        def run():
            torch.cuda._sleep(50_000_000)  # (cycles, on the side stream: about 25 ms)
            return prepare()

        return run

    def slow(self, batches):
        for batch in plain(self, (wait_first(p) for p in batches)):
            torch.cuda._sleep(50_000_000)
            yield batch

    monkeypatch.setattr(DeviceFeed, "overlapped", slow)


def _can_page_lock() -> bool:
    """Whether this runtime lets CUDA page-lock /dev/shm (gVisor may refuse: the loader then
    copies through staging, with a note, and these tests' page-lock checks do not apply)."""
    from cnnkit.data.slots import SlotRing

    probe = SlotRing(1, (1, 1, 64, 64), pin=True)
    try:
        return probe.pinned
    finally:
        probe.close()


@pytest.mark.parametrize("late", [False, True])
def test_slot_ring_is_page_locked_and_cuda_batches_equal_cpu_ones(shapes, late, monkeypatch):
    section = {"source": "packed", "path": str(shapes / "raw"), "batch_size": 4, "crop": 20,
               "val_fraction": 0.25, "workers": 2, "prefetch": 1}  # fmt: skip
    if late:
        _late(monkeypatch)
    cpu, gpu = data_config(section).build(CPU), data_config(section).build(CUDA)
    gpu.train.set_epoch(1)
    cpu.train.mode = "whole"  # the CUDA path's crops: whole images, cut by the device
    cpu.train.set_epoch(1)
    for (x1, y1), (x2, y2) in zip(cpu.train, gpu.train, strict=True):
        assert x2.is_cuda and torch.equal(y1, y2.cpu())
        torch.testing.assert_close(x1, x2.cpu(), rtol=1e-5, atol=1e-4)
    assert gpu.train._ring is not None and gpu.train._ring.pinned == _can_page_lock()


def test_a_failed_page_lock_leaves_no_cuda_error_behind():
    """Registering memory twice fails (cudaErrorHostMemoryAlreadyRegistered): the ring is then
    not pinned, and the next kernel launch does not raise the stale error; nor does a failed
    unregistering (cudaErrorHostMemoryNotRegistered) in close."""
    from cnnkit.data.slots import SlotRing, _register

    if not _can_page_lock():
        pytest.skip("this runtime cannot page-lock /dev/shm (gVisor may refuse)")
    ring = SlotRing(2, (1, 3, 8, 8), pin=True)
    try:
        assert ring.pinned and not _register(ring.buffers)
        assert torch.ones(4, device=CUDA).sum().item() == 4
    finally:
        ring.close()
    ring.pinned = True  # as if still registered: the second unregistering fails
    ring.close()
    assert not ring.pinned and torch.ones(4, device=CUDA).sum().item() == 4


@pytest.mark.parametrize("source", ["folder", "jpeg"])
def test_jpegs_decoded_on_the_gpu_equal_the_workers_decoding(shapes, source):
    if source == "folder":
        section = {"source": "folder", "path": str(shapes / "src"), "size": 24}
    else:
        section = {"source": "packed", "path": str(shapes / "jpeg")}
    section.update(batch_size=4, crop=20, val_fraction=0.25, workers=2)
    # nvJPEG's IDCT and colour conversion differ from libjpeg-turbo by a few levels; on the
    # folder's 4:2:0 JPEGs (Pillow's default, like most photos) it also repeats chroma where
    # libjpeg-turbo interpolates it, by up to ~50 levels on a saturated edge. The shards are
    # 4:4:4 (pack's encoder), where only rounding differs.
    mean, most = (0.05, 0.5) if source == "jpeg" else (0.1, 1.5)
    cpu = data_config(section).build(CUDA)
    gpu = data_config({**section, "decode": "gpu"}).build(CUDA)
    assert gpu.train.mode == "encoded"
    for a, b in ((cpu.val, gpu.val), (cpu.train, gpu.train)):
        a.set_epoch(1), b.set_epoch(1)
        for (x1, y1), (x2, y2) in zip(a, b, strict=True):
            assert torch.equal(y1, y2)
            assert (x1 - x2).abs().mean() < mean and (x1 - x2).abs().max() < most


def test_one_process_nccl_group_trains_with_ddp_and_averaging(tmp_path):
    for sync in ("ddp", "average"):
        out = tmp_path / sync
        cmd = [sys.executable, "-m", "cnnkit", "train", "digits", "--nproc", "1", "--out", str(out),
               "--quiet", "train.epochs=1", "train.device=cuda", f"train.sync={sync}"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=150)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["world_size"] == 1 and summary["device"].startswith("cuda")


def test_bench_reports_steady_state_synced_and_tf32():
    from cnnkit.bench.throughput import bench_throughput

    r = bench_throughput("alexnet-owt", "train", 32, CUDA, precision="fp32", repeats=3,
                         quick_peak=True, baseline=True)  # fmt: skip
    assert r["steps_per_measurement"] > 1 and r["synced"]["images_per_second"] > 0
    assert r["math"] == "fp32 (TF32 convolutions and matmuls)"  # as `cnnkit train` runs fp32
    assert 0 < r["peak_fraction"] and r["theoretical_peak"] is not None
    assert r["speedup_vs_baseline"] > 0 and r["speedup_vs_careful"] > 0


def test_rng_state_holds_this_devices_generator_and_restores_it():
    from cnnkit.checkpoint import rng_state, set_rng_state

    torch.rand(1, device=CUDA)  # CUDA in use: its generator is part of the state
    state = rng_state()
    assert len(state["cuda"]) == 1
    first = torch.rand(8, device=CUDA)
    set_rng_state(state)
    assert torch.equal(first, torch.rand(8, device=CUDA))


def test_a_training_step_never_waits_for_the_gpu():
    """After warm-up (cuDNN's autotuning, first allocations), a step of in-memory batches in
    bf16 channels_last with the moving average asks the host to wait for the device nowhere:
    torch raises at any synchronising call (an .item(), a blocking copy) under sync debug mode."""
    from cnnkit.config import TrainConfig
    from cnnkit.nn import build_model
    from cnnkit.train.engine import build_engine, train_step

    data = data_config({"source": "digits", "batch_size": 32}).build(CUDA)
    cfg = TrainConfig(precision="bf16", channels_last=True, ema=0.99)
    engine = build_engine(build_model("digitnet"), cfg, CUDA)
    data.train.set_epoch(0)
    batches = iter(data.train)
    for _ in range(3):
        train_step(engine, *next(batches))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            loss, _ = train_step(engine, *next(batches))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item() and int(engine.ema.n_averaged) == 6


@pytest.mark.parametrize("policy", ["randaugment", "trivialaugment", "autoaugment", "augmix"])
def test_the_policies_never_wait_for_the_gpu_and_equal_the_cpus(policy):
    """The policies on a CUDA batch (torchvision's ops copy a matrix or kernel
    with a host wait each): no synchronising call after the first batch, and the CPU's result
    for the same draws (resampling and blends may round a rare pixel the other way)."""
    from cnnkit.train.policy import augment

    images = torch.randint(0, 256, (64, 3, 40, 48), dtype=torch.uint8)
    on_gpu = images.to(CUDA)
    augment(on_gpu, policy)  # first use: the cached grid and kernel
    torch.manual_seed(5)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = augment(on_gpu, policy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.manual_seed(5)
    cpu = augment(images, policy)
    diff = (out.cpu().int() - cpu.int()).abs()
    assert (diff > 1).float().mean() < 0.001 and (diff > 0).float().mean() < 0.01


def test_fp16_with_the_moving_average_resized_crops_and_erasing_then_classify(shapes, tmp_path):
    """GradScaler, the moving average, random-resized crops and erasing on the device; then
    `classify` on the GPU runs the network as it trained (fp16 autocast) and agrees with the CPU."""
    from cnnkit.infer.classify import Classifier
    from cnnkit.train.run import fit

    run = {"name": "f", "model": str(NET),
           "data": {"source": "packed", "path": str(shapes / "raw"), "crop": 20, "batch_size": 8,
                    "val_fraction": 0.25, "workers": 2, "train_crop": "resized", "erasing": 0.5},
           "train": {"epochs": 2, "device": "cuda", "precision": "fp16", "optimizer": "adam",
                     "lr": 0.003, "ema": 0.9}}  # fmt: skip
    summary = fit(validate_run(run), tmp_path / "run", quiet=True)
    assert summary["precision"] == "fp16" and summary["val_top1_ema"] is not None
    assert (tmp_path / "run" / "best_ema.pt").is_file()
    images = sorted((shapes / "src").rglob("*.JPEG"))[:6]
    on_gpu = Classifier.load(tmp_path / "run", "cuda")
    assert on_gpu.autocast == torch.float16
    on_cpu = Classifier.load(tmp_path / "run", "cpu")
    for a, b in zip(on_gpu.predict([str(p) for p in images]),
                    on_cpu.predict([str(p) for p in images]), strict=True):  # fmt: skip
        assert a.probs[0] == pytest.approx(b.probs[0], abs=0.05)


def test_the_synthetic_held_out_set_is_the_same_on_the_gpu():
    section = {"source": "synthetic", "shape": [3, 8, 8], "num_classes": 3, "train_size": 16,
               "val_size": 10, "batch_size": 8}  # fmt: skip
    (a, ya), (b, yb) = (next(iter(data_config(section).build(d).val)) for d in (CPU, CUDA))
    assert torch.equal(a, b.cpu()) and torch.equal(ya, yb.cpu())
