"""The loader: seeded per-epoch order, mid-epoch resume, rank sharding, exactly-once validation,
worker processes equal to in-process loading, reused CPU buffers never overwrite held batches."""

from __future__ import annotations

import csv
import sys

import pytest
import torch
from data_images import write_bad_folder

from cnnkit.data import data_config
from cnnkit.data.batch import BatchJob
from cnnkit.data.pack import pack_folder
from cnnkit.data.sampling import EpochBatchSampler
from cnnkit.data.slots import BufferPool
from cnnkit.data.synth import synth_shapes
from cnnkit.errors import ConfigError

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    synth_shapes(root / "src", classes=3, per_class=8, size=20)
    pack_folder(root / "src", root / "p", size=16, workers=1, progress=False)
    return root


def streams(root, rank=0, world=1, seed=0, **options):
    section = {"source": "packed", "path": str(root / "p"), "batch_size": 4, "crop": 12,
               "workers": 0, "val_fraction": 0.25, "lighting": 0.1, **options}  # fmt: skip
    return data_config(section).build(CPU, rank, world, seed)


def epoch(stream, e, skip=0):
    stream.set_epoch(e, skip)
    return [(x.clone(), y.clone()) for x, y in stream]


def test_sampler_is_seeded_per_epoch():
    a = EpochBatchSampler(50, 8, 0, 1, seed=1, shuffle=True)
    b = EpochBatchSampler(50, 8, 0, 1, seed=1, shuffle=True)
    a.set_epoch(3), b.set_epoch(3)
    assert list(a) == list(b) and len(list(a)) == len(a) == 6  # full batches only
    b.set_epoch(4)
    assert list(a) != list(b)
    assert sorted(sum(list(a), [])) != list(range(48))  # shuffled, not the first 48


@pytest.mark.parametrize("world", [2, 3])
def test_train_shards_are_disjoint_and_equal(world):
    samplers = [EpochBatchSampler(50, 4, r, world, seed=0, shuffle=True) for r in range(world)]
    seen = [sum(list(s), []) for s in samplers]
    assert len({len(s) for s in samplers}) == 1  # same batch count on every rank
    flat = sum(seen, [])
    assert len(flat) == len(set(flat))


@pytest.mark.parametrize("world", [1, 3, 4])
def test_validation_covers_every_image_exactly_once(packed, world):
    labels = []
    for rank in range(world):
        bundle = streams(packed, rank, world, val_fraction=0.5, eval_batch_size=5)
        got = epoch(bundle.val, 0)
        assert len(got) == len(bundle.val)
        labels += [y for _, y in got]
    assert sum(len(y) for y in labels) == bundle.val.num_samples == 12


def test_epoch_order_and_augmentation_are_seeded(packed):
    one, two = streams(packed).train, streams(packed).train
    first = epoch(one, 2)
    for (x1, y1), (x2, y2) in zip(first, epoch(two, 2), strict=True):
        torch.testing.assert_close(x1, x2, rtol=0, atol=0)
        assert torch.equal(y1, y2)
    other = epoch(one, 3)
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(first, other, strict=True))
    assert len(first) == len(one) == 4 and one.num_samples == 16  # 18 train images, batch 4


def test_mid_epoch_resume_repeats_the_rest_of_the_epoch_exactly(packed):
    full = epoch(streams(packed).train, 5)
    resumed = epoch(streams(packed).train, 5, skip=2)  # a fresh process resuming at batch 2
    assert len(resumed) == len(full) - 2
    for (x1, y1), (x2, y2) in zip(full[2:], resumed, strict=True):
        torch.testing.assert_close(x1, x2, rtol=0, atol=0)
        assert torch.equal(y1, y2)


def test_worker_loader_leaves_the_global_random_state_alone(packed):
    """Starting worker processes draws no global random number: a resumed run (whose persistent
    workers start once more than an uninterrupted run's) keeps the same dropout and mixup."""
    section = {"source": "folder", "path": str(packed / "src"), "size": 16, "batch_size": 4,
               "crop": 12, "workers": 1, "val_fraction": 0.25}  # fmt: skip
    train = data_config(section).build(CPU, 0, 1, 0).train
    torch.manual_seed(3)
    before = torch.get_rng_state()
    train.set_epoch(0)
    assert len(list(train)) == 4
    assert torch.equal(torch.get_rng_state(), before)


def test_batches_reach_a_device_without_a_side_stream(packed):
    """A device that is neither the CPU nor CUDA (mps; `meta` stands in for it here) gets its
    batches copied there, pixels and labels, by the plain path."""
    section = {"source": "folder", "path": str(packed / "src"), "size": 16, "batch_size": 4,
               "crop": 12, "workers": 0, "val_fraction": 0.25}  # fmt: skip
    bundle = data_config(section).build(torch.device("meta"), 0, 1, 0)
    for stream in (bundle.train, bundle.val):
        stream.set_epoch(0)
        x, y = next(iter(stream))
        assert x.device.type == y.device.type == "meta" and x.shape[1:] == (3, 12, 12)


def test_held_batches_are_never_overwritten(packed):
    train = streams(packed).train
    train.set_epoch(0)
    held = list(train)  # every batch kept alive: the pool must not reuse any of them
    copies = epoch(streams(packed).train, 0)
    assert len({id(x) for x, _ in held}) == len(held)
    for (x1, _), (x2, _) in zip(held, copies, strict=True):
        torch.testing.assert_close(x1, x2, rtol=0, atol=0)


def test_buffer_pool_reuses_only_released_buffers():
    pool = BufferPool()
    a = pool.take((2, 3))
    a_id = id(a)
    del a
    b = pool.take((2, 3))
    assert id(b) == a_id  # released: reused
    c = pool.take((2, 3))
    assert c is not b  # b still held
    view, c_id = c[0], id(c)
    del c
    assert id(pool.take((2, 3))) != c_id  # a view still holds it
    w = torch.ones(2, 3, requires_grad=True)
    d = pool.take((2, 3))
    loss, d_id = (w * d).sum(), id(d)
    del d
    assert id(pool.take((2, 3))) != d_id  # saved for backward: not reused
    assert loss.requires_grad and view.shape == (3,)


@pytest.mark.parametrize("keep", [1, 2, 4])
def test_buffer_pool_keeps_at_most_keep_buffers(keep):
    """Buffers still held are replaced, the oldest let go: keep=1 kept every one made."""
    pool = BufferPool(keep)
    held = [pool.take((2, 3)) for _ in range(6)]
    assert len(pool._buffers) == len(pool._idle) == keep and held[-1] is pool._buffers[-1]


def test_buffer_pool_without_the_private_use_count_makes_fresh_buffers(packed, monkeypatch):
    """Where torch lacks the storage use count, buffers are never reused, and the stream's
    batches are the same as with reuse."""
    reused = epoch(streams(packed).train, 1)
    monkeypatch.setattr(BufferPool, "supported", staticmethod(lambda: False))
    pool = BufferPool()
    a = pool.take((2, 3))
    a_id = id(a)
    del a
    assert id(pool.take((2, 3))) != a_id or not pool._buffers  # fresh every time
    fresh = epoch(streams(packed).train, 1)
    for (x1, y1), (x2, y2) in zip(reused, fresh, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_folder_training_skips_and_reports_bad_images(tmp_path, capfd):
    expected = write_bad_folder(tmp_path)
    section = {"source": "folder", "path": str(tmp_path), "size": 16, "crop": 12,
               "batch_size": 7, "workers": 0, "val_fraction": 0.0}  # fmt: skip
    bundle = data_config(section).build(CPU)
    bundle.train.set_epoch(0)
    images = sum(len(y) for _, y in bundle.train)  # 2 batches of 7 = all 14 files
    err = capfd.readouterr().err
    assert images == 14 - 3  # the 3 broken files dropped, the 3 odd ones converted and kept
    for rel, status in expected.items():
        assert (rel in err) == (status == "skipped")
    assert "empty file" in err and "truncated" in err and "not an image" in err
    assert bundle.classes == ["good", "odd"]


def test_a_runs_summary_counts_the_held_out_images_it_scored(tmp_path, capfd):
    """3 of the 14 held-out files are unreadable: the run scores 11, and says 3 skipped."""
    import json
    from pathlib import Path

    from cnnkit.config import validate_run
    from cnnkit.train.run import fit

    write_bad_folder(tmp_path / "val")
    synth_shapes(tmp_path / "train", classes=2, per_class=8, size=24)
    for name, folder in zip(("good", "odd"), sorted((tmp_path / "train").iterdir()), strict=True):
        folder.rename(tmp_path / "train" / name)  # the held-out set's class names
    net = Path(__file__).parent / "data" / "tiny_alexnet.yaml"
    run = {"name": "b", "model": str(net),
           "data": {"source": "folder", "path": str(tmp_path / "train"), "val_path":
                    str(tmp_path / "val"), "size": 24, "crop": 20, "batch_size": 8, "workers": 0},
           "train": {"epochs": 1}}  # fmt: skip
    summary = fit(validate_run(run), tmp_path / "run", quiet=True)
    assert (summary["val_images"], summary["val_skipped"]) == (11, 3)
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (written["val_images"], written["val_skipped"]) == (11, 3)


@pytest.mark.parametrize("train_crop", ["random", "resized"])
def test_zero_copy_views_augment_like_a_batch_tensor(packed, train_crop):
    stream = streams(packed, train_crop=train_crop).train
    ds, aug = stream.dataset, stream.augment
    positions = [0, 3, 5, 7]
    batch = ds[BatchJob(positions)]
    x, y = batch.pixels, batch.labels
    views, y2, _ = ds.views(positions)
    assert torch.equal(y, y2) and views.shape == x.shape
    p = aug.sample(4, 16, 16, torch.Generator().manual_seed(0))
    torch.testing.assert_close(aug.train(views, p, torch.empty(4, 3, 12, 12)), aug.train(x, p))
    torch.testing.assert_close(aug.eval(views, torch.empty(4, 3, 12, 12)), aug.eval(x))


def test_jpeg_shards_through_worker_processes(packed, tmp_path):
    pack_folder(packed / "src", tmp_path / "j", size=16, format="jpeg", quality=95, progress=False)
    section = {"source": "packed", "path": str(tmp_path / "j"), "batch_size": 4, "crop": 12,
               "val_fraction": 0.25}  # fmt: skip
    one = epoch(data_config({**section, "workers": 0}).build(CPU).train, 0)
    two = epoch(data_config({**section, "workers": 2}).build(CPU).train, 0)
    for (x1, y1), (x2, y2) in zip(one, two, strict=True):
        torch.testing.assert_close(x1, x2, rtol=0, atol=0)
        assert torch.equal(y1, y2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("options", [{}, {"normalize": "mean_image"}, {"workers": 2}])
def test_cuda_stream_equals_cpu_stream(packed, options):
    """Pinned copies on a side stream + batched gather on the GPU = the CPU fast path."""
    section = {"source": "packed", "path": str(packed / "p"), "batch_size": 4, "crop": 12,
               "workers": 0, "val_fraction": 0.25, "lighting": 0.1, **options}  # fmt: skip
    cpu = data_config(section).build(CPU)
    gpu = data_config(section).build(torch.device("cuda"))
    for a, b in ((cpu.train, gpu.train), (cpu.val, gpu.val)):
        for (x1, y1), (x2, y2) in zip(epoch(a, 1), epoch(b, 1), strict=True):
            assert x2.is_cuda and y2.is_cuda
            torch.testing.assert_close(x1, x2.cpu(), rtol=1e-5, atol=1e-4)
            assert torch.equal(y1, y2.cpu())


@pytest.mark.parametrize("workers", [0, 2])
def test_grey_batches_are_the_luma_of_the_rgb_ones_normalised(packed, workers):
    """data.grey: every batch is ITU-R 601 luma (torchvision's Grayscale weights) of the
    augmented RGB batch, normalised by the luma of the mean and std; the network sees 1 channel."""
    rgb, grey = streams(packed, workers=workers), streams(packed, workers=workers, grey=True)
    pre = rgb.preprocess
    weights = torch.tensor([0.299, 0.587, 0.114])
    mean, std = float(weights @ torch.tensor(pre.mean)), float(weights @ torch.tensor(pre.std))
    assert grey.input_shape == (1, 12, 12) and grey.preprocess.channels == 1
    assert grey.preprocess.mean == pytest.approx([mean]) and grey.preprocess.std == pytest.approx(
        [std]
    )
    for a, b in ((rgb.train, grey.train), (rgb.val, grey.val)):
        for (x, y), (g, y2) in zip(epoch(a, 1), epoch(b, 1), strict=True):
            luma = (x * pre_std(pre) + pre_mean(pre)) * weights.view(1, 3, 1, 1)  # 0-255 RGB
            expected = (luma.sum(1, keepdim=True) - mean) / std
            assert g.shape[1] == 1 and torch.equal(y, y2)
            torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-5)


def pre_mean(pre):
    return torch.tensor(pre.mean).view(1, -1, 1, 1)


def pre_std(pre):
    return torch.tensor(pre.std).view(1, -1, 1, 1)


def test_a_grey_network_trains_on_rgb_images_then_evaluates_as_it_trained(packed, tmp_path):
    from pathlib import Path

    from cnnkit.config import validate_run
    from cnnkit.infer.classify import Classifier
    from cnnkit.train.evaluation import evaluate_checkpoint
    from cnnkit.train.run import fit

    net = {"input": [1, 12, 12], "layers": [{"type": "conv", "out_channels": 8, "kernel_size": 3},
                                            {"type": "relu"}, {"type": "global_avgpool"},
                                            {"type": "linear"}]}  # fmt: skip
    run = {"name": "g", "model": net,
           "data": {"source": "packed", "path": str(packed / "p"), "crop": 12, "batch_size": 6,
                    "workers": 0, "grey": True},
           "train": {"epochs": 2, "precision": "fp32"}}  # fmt: skip
    summary = fit(validate_run(run), tmp_path / "run", quiet=True)
    again = evaluate_checkpoint(tmp_path / "run")  # best.pt on the run's own data: its luma
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    best = max(rows, key=lambda r: float(r["val_top1"]))
    assert again["top1"] == pytest.approx(summary["best_val_top1"])
    assert again["loss"] == pytest.approx(float(best["val_loss"]), rel=1e-5)
    image = str(sorted(Path(packed / "src").rglob("*.JPEG"))[0])
    classifier = Classifier.load(tmp_path / "run")  # reads images as grey (Pillow's "L")
    assert classifier.preprocess.channels == 1 and len(classifier.predict(image).probs) == 3
    with pytest.raises(ConfigError, match="grey: takes normalize: channel"):
        validate_run({**run, "data": {**run["data"], "normalize": "mean_image"}})


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_of_unreadable_images_is_an_empty_step_not_a_missing_one(tmp_path, workers):
    """Each rank of a group must take as many steps as the others: a batch whose images were
    all unreadable comes as an empty batch (the loop steps on it), never left out."""
    from data_images import jpeg_bytes, photo

    for k, name in enumerate(("a", "b")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "good.JPEG").write_bytes(jpeg_bytes(photo(seed=k)))
        for i in range(3):
            full = jpeg_bytes(photo(seed=10 + 3 * k + i))
            (tmp_path / name / f"cut{i}.JPEG").write_bytes(full[: len(full) // 3])
    section = {"source": "folder", "path": str(tmp_path), "size": 16, "crop": 12,
               "batch_size": 2, "workers": workers, "val_fraction": 0.0}  # fmt: skip
    stream = data_config(section).build(CPU).train
    batches = epoch(stream, 0)
    assert len(batches) == len(stream) == 4  # 2 good images fill at most 2 of the 4 batches
    assert sum(len(y) for _, y in batches) == 2
    empty = [x for x, y in batches if not len(y)]
    assert len(empty) >= 2 and all(x.shape == (0, 3, 12, 12) for x in empty)


DIED = r"data.workers=1: a loader worker process died \("


def _one_worker_train(packed):
    """The training stream of the shapes folder, read by one loader worker."""
    section = {"source": "folder", "path": str(packed / "src"), "size": 20, "crop": 16,
               "batch_size": 4, "workers": 1}  # fmt: skip
    return data_config(section).build(torch.device("cpu")).train


def _dying_worker(monkeypatch, position: int = 5) -> None:
    """Loader workers (forks of this process) kill themselves on the batch with `position`."""
    import os
    import signal

    from cnnkit.data.folder import FolderImages

    real = FolderImages.__getitem__

    def dying(self, job):
        if position in list(job.positions):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, job)

    monkeypatch.setattr(FolderImages, "__getitem__", dying)


def test_a_loader_worker_that_dies_is_one_line(packed, monkeypatch):
    """A worker killed mid-batch (the OOM killer, a decoder's crash) ends the epoch with a
    DataError saying what happened, not torch's bare RuntimeError and its traceback."""
    from cnnkit.errors import DataError

    _dying_worker(monkeypatch)
    stream = _one_worker_train(packed)
    stream.set_epoch(0)
    with pytest.raises(DataError, match=DIED):
        for _ in stream:
            pass
    import subprocess
    import time

    subprocess.run(["true"], check=True)  # a later child's end (SIGCHLD): torch's handler
    time.sleep(0.2)  # raised for the dead worker still on its watch list, anywhere after


def _no_fork(memory: torch.Tensor) -> None:
    """madvise(MADV_DONTFORK) over a tensor's pages, as a driver may do to the memory it
    page-locks: a forked child then has no mapping there."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = memory.data_ptr() - memory.data_ptr() % mmap.PAGESIZE
    length = memory.data_ptr() + memory.numel() - start
    if libc.madvise(start, length, 10) != 0:  # MADV_DONTFORK
        pytest.skip(f"madvise(MADV_DONTFORK): errno {ctypes.get_errno()}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTFORK is Linux's")
@pytest.mark.parametrize("source", ["folder", "packed"])
def test_workers_map_the_ring_themselves(packed, monkeypatch, source):
    """Workers write batches into the ring even when the parent's mapping of it is not
    inherited by a fork (page-locked memory marked MADV_DONTFORK): each maps it anew."""
    from cnnkit.data.slots import SlotRing

    made = SlotRing.__init__

    def dontfork(self, *args, **kwargs):
        made(self, *args, **kwargs)
        _no_fork(self.buffers)

    section = {"source": source, "crop": 12, "workers": 2}
    if source == "folder":
        section.update(path=str(packed / "src"), size=16)
    else:  # (a plain crop of raw shards is cut in-process on the CPU: no ring)
        section.update(train_crop="resized")
    expected = epoch(streams(packed, **section).train, 0)
    monkeypatch.setattr(SlotRing, "__init__", dontfork)
    got = epoch(streams(packed, **section).train, 0)
    assert len(got) == len(expected) > 0
    for (x1, y1), (x2, y2) in zip(got, expected, strict=True):
        assert torch.equal(y1, y2)
        torch.testing.assert_close(x1, x2, rtol=0, atol=0)


def test_a_worker_that_dies_while_the_step_runs_is_one_line(packed, monkeypatch):
    """A worker that dies while the main process is busy elsewhere (its training step) is
    found where the next batch is awaited: the stream's DataError, not torch's RuntimeError
    raised by its SIGCHLD handler in the middle of the step."""
    import time

    from cnnkit.errors import DataError

    _dying_worker(monkeypatch)
    stream = _one_worker_train(packed)
    stream.set_epoch(0)
    with pytest.raises(DataError, match=DIED):
        for _ in stream:
            time.sleep(1.5)  # the step: the worker prefetches the next batch and dies meanwhile


def test_a_batch_lost_with_its_worker_is_one_line(packed, monkeypatch):
    """A batch whose shared memory cannot be fetched because its worker has gone (the
    connection to it reset) ends the epoch with the same DataError; an exception a worker
    raised itself is not mistaken for its death."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    from cnnkit.errors import DataError

    full = RuntimeError("Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback"
                        " ...\nRuntimeError: unable to write to file </torch_1_2>: No space left "
                        "on device (28)")  # fmt: skip
    for error, expected in ((ConnectionResetError(104, "Connection reset by peer"), DataError),
                            (EOFError("Caught EOFError in DataLoader worker process 0."), EOFError),
                            (full, DataError)):  # fmt: skip

        def lost(self, error=error):
            raise error

        monkeypatch.setattr(_MultiProcessingDataLoaderIter, "_next_data", lost)
        stream = _one_worker_train(packed)
        stream.set_epoch(0)
        with pytest.raises(expected) as caught:
            next(iter(stream))
        if error is full:  # a worker's full /dev/shm: said as such, with what to do
            assert "shared memory ran out in a worker (No space left on device): give the " in (
                str(caught.value))  # fmt: skip
            assert stream._loader is None  # its workers ended, the next epoch's start afresh
        elif expected is DataError:
            assert "a loader worker process died (" in str(caught.value)
        # the worker an error left running (a worker's own exception, a full /dev/shm): shut
        # down here, at once; left to the collector, a later test (or the worker's exit) waited
        # 5 s for each to join
        batches = getattr(stream._loader, "_iterator", None)
        if batches is not None:
            batches._shutdown_workers()


def test_a_worker_that_died_between_epochs_is_one_line(packed):
    """Training workers persist across epochs: one killed after an epoch is found as the
    next epoch resumes them (inside torch's iter()), and said in one line."""
    import os
    import signal

    from cnnkit.errors import DataError

    stream = _one_worker_train(packed)
    assert len(epoch(stream, 0)) > 0
    (worker,) = stream._loader._iterator._workers
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(30)
    with pytest.raises(DataError, match=DIED):
        epoch(stream, 1)
    assert len(epoch(stream, 2)) > 0  # the next epoch starts workers afresh


def test_workers_keep_the_inherited_ring_under_the_file_system_strategy(monkeypatch):
    """Under torch's file_system sharing a mapping made anew would keep the shared file alive
    after the process: the ring is used as inherited."""
    import torch.multiprocessing as mp

    from cnnkit.data.slots import in_shared_memory, mapped_afresh

    ring = in_shared_memory((2, 3, 4, 4))
    assert mapped_afresh(ring).data_ptr() != ring.data_ptr()  # file_descriptor: mapped anew
    monkeypatch.setattr("cnnkit.data.slots.get_sharing_strategy", lambda: "file_system")
    assert mapped_afresh(ring) is ring
    assert mp.get_sharing_strategy() == "file_descriptor"


def test_a_preprocessing_a_source_makes_that_is_not_valid_is_a_config_error():
    """What a data section's settings make (channels, sizes, statistics) is refused in one
    ConfigError line, never a pydantic ValidationError and its traceback."""
    from cnnkit.data.base import Preprocess

    with pytest.raises(ConfigError, match=r"^data: makes a preprocessing that is not valid: std"):
        Preprocess.of_data(3, 8, mean=[0.0] * 3, std=[1.0, 0.0, 1.0])
    with pytest.raises(
        ConfigError, match=r"valid: channels: Input should be less than or equal to 4"
    ):
        Preprocess.of_data(5, 8, mean=[0.0] * 5)


def test_the_largest_batch_is_what_each_rank_is_given():
    """A ring's slots hold a batch, or a rank's whole share where it is smaller: exactly the
    largest batch the sampler hands out."""
    for n, batch, world, shuffle in ((10, 8, 3, False), (10, 2, 3, False), (50, 8, 2, True),
                                     (5, 8, 1, True), (0, 4, 1, False)):  # fmt: skip
        for rank in range(world):
            sampler = EpochBatchSampler(n, batch, rank, world, seed=0, shuffle=shuffle)
            sizes = [len(b) for b in sampler.batches()]
            assert sampler.largest() == max(sizes, default=0)
