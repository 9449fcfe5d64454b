"""JPEGs decoded in batches on the training device (`data.decode: gpu`; on a CPU device the
same code runs with torchvision's CPU decoder): the same batches as the workers' decoding up to
rounding, bad files reported the same way; and the loader's shared-memory budget and defaults."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch
from data_images import photo, write_bad_folder
from PIL import Image

from cnnkit.data import data_config, imageset
from cnnkit.data import loader as loader_module
from cnnkit.data import workers as workers_module
from cnnkit.data.batch import Encoded
from cnnkit.data.pack import pack_folder
from cnnkit.data.synth import synth_shapes
from cnnkit.errors import ConfigError, DataError

CPU = torch.device("cpu")
LEVEL = 1 / 57.12  # one 0-255 step in normalised units (ImageNet's smallest std)


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("device-decode")
    synth_shapes(root / "src", classes=3, per_class=8, size=40)
    pack_folder(root / "src", root / "jpeg", size=32, format="jpeg", quality=95, progress=False)
    pack_folder(root / "src", root / "raw", size=32, progress=False)
    return root


def sections(root):
    common = {"batch_size": 4, "crop": 28, "val_fraction": 0.25, "lighting": 0.1}
    return [{"source": "folder", "path": str(root / "src"), "size": 32, **common},
            {"source": "packed", "path": str(root / "jpeg"), **common}]  # fmt: skip


def epoch(stream, e):
    stream.set_epoch(e)
    return [(x.clone(), y.clone()) for x, y in stream]


@pytest.mark.parametrize("train_crop", ["random", "resized"])
@pytest.mark.parametrize("workers", [0, 2])
def test_device_decoding_equals_worker_decoding(sets, train_crop, workers):
    """Whole images decoded by the workers and augmented by the device (a CUDA device's path)
    = the same JPEGs decoded in batches by the main process, up to one level of rounding."""
    for section in sections(sets):
        section = {**section, "train_crop": train_crop, "workers": workers}
        cpu = data_config(section).build(CPU, seed=1)
        device = data_config({**section, "decode": "gpu"}).build(CPU, seed=1)
        assert device.train.mode == device.val.mode == "encoded"
        cpu.train.mode = "whole"  # a CPU device would cut the crops in the workers
        for a, b in ((cpu.train, device.train), (cpu.val, device.val)):
            one, two = epoch(a, 1), epoch(b, 1)
            assert len(one) == len(two) > 0
            for (x1, y1), (x2, y2) in zip(one, two, strict=True):
                assert torch.equal(y1, y2)
                assert (x1 - x2).abs().max() <= 1.01 * LEVEL


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_device_decoding_reports_bad_files_like_the_workers(tmp_path, capfd, device):
    """Empty, truncated and non-image files skipped and named; grey, CMYK and PNG-in-.JPEG
    files decoded on the CPU and kept: the same images as the workers' path (on CUDA, nvJPEG's
    batch refusing one file must not lose the others)."""
    expected = write_bad_folder(tmp_path)
    section = {"source": "folder", "path": str(tmp_path), "size": 16, "crop": 12,
               "batch_size": 7, "workers": 0, "val_fraction": 0.0}  # fmt: skip
    counts = {}
    for decode in ("cpu", "gpu"):
        stream = data_config({**section, "decode": decode}).build(torch.device(device)).train
        stream.set_epoch(0)
        counts[decode] = sorted(sum((y.tolist() for _, y in stream), []))
        err = capfd.readouterr().err
        for rel, status in expected.items():
            assert (rel in err) == (status == "skipped"), (decode, rel)
    assert counts["cpu"] == counts["gpu"] and len(counts["gpu"]) == 14 - 3


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_batch_of_only_corrupt_jpegs_is_empty_on_the_device(device):
    """Every image refused by the decoder: an empty batch where the network runs, each named."""
    from cnnkit.data.batch import Encoded, WorkerBatch
    from cnnkit.data.device_decode import decode_batch

    class Set:
        size, resize_mode, interpolation = 16, "squash", "bilinear"

    junk = [b"\xff\xd8\xff\xe0" + bytes(range(60)), b"\xff\xd8\xff\xdb" + bytes(40)]
    batch = WorkerBatch(torch.tensor([0, 1]), encoded=Encoded.join(junk), names=["a", "b"])
    pixels, kept = decode_batch(batch, Set(), torch.device(device))
    assert pixels.shape == (0, 3, 16, 16) and pixels.device.type == device
    assert len(kept) == 0 and [name for name, _ in kept.bad] == ["a", "b"]


def test_jpegs_for_the_device_keep_their_photos_sizes(tmp_path):
    """Random-resized crops of JPEGs decoded on the device are drawn on the photos too: the
    workers hand back each kept photo's (H, W), and a JPEG the decoder refuses drops its own."""
    from cnnkit.data.batch import BatchJob
    from cnnkit.data.device_decode import decode_batch

    for k, (h, w) in enumerate([(30, 50), (48, 20), (25, 25)]):
        (tmp_path / "c" / f"{k}").parent.mkdir(exist_ok=True)
        Image.fromarray(photo(h, w, seed=k)).save(tmp_path / "c" / f"{k}.jpg", quality=90)
    (tmp_path / "d").mkdir()
    Image.fromarray(photo(10, 10, seed=9)).save(tmp_path / "d" / "x.png")  # decoded by a worker
    section = {"source": "folder", "path": str(tmp_path), "size": 16, "crop": 12,
               "val_fraction": 0.0, "decode": "gpu", "train_crop": "resized"}  # fmt: skip
    ds = data_config(section).build(CPU).train.dataset
    names = [ds.files[i] for i in ds.ids]
    batch = ds[BatchJob(list(range(len(names))), encoded=True)]
    want = {"c/0.jpg": [30, 50], "c/1.jpg": [48, 20], "c/2.jpg": [25, 25], "d/x.png": [10, 10]}
    assert batch.sources.tolist() == [want[n] for n in names]
    coded = [i for i, n in enumerate(names) if n.endswith(".jpg")]
    junk = coded[1]  # its bytes replaced by a JPEG no decoder reads
    items = batch.encoded.items()
    items[coded.index(junk)] = torch.frombuffer(bytearray(b"\xff\xd8\xff\xdb" + bytes(40)),
                                                dtype=torch.uint8)  # fmt: skip
    batch.encoded = Encoded.join([t.numpy() for t in items])
    pixels, kept = decode_batch(batch, ds, CPU)
    assert len(pixels) == len(kept) == 3
    assert kept.sources.tolist() == [want[n] for i, n in enumerate(names) if i != junk]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torchvision 0.29 on its decoders
def test_a_jpeg_the_device_decoder_refuses_is_decoded_on_the_cpu(capfd):
    """A decoder that refuses whole batches and single images off the CPU (nvJPEG on a JPEG it
    does not support, or nvJPEG broken): each JPEG comes from the CPU decoder instead, the same
    pixels, said once on stderr; a file neither decoder reads is still dropped and named."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from cnnkit.data import device_decode
    from cnnkit.data.decode import encode_jpeg

    on_cpu = []

    def refusing(data, mode, device="cpu"):
        if torch.device(device).type != "cpu":
            raise RuntimeError("nvjpeg: unsupported")
        on_cpu.append(data)
        return decode_jpeg(data, mode=mode)

    image = torch.randint(0, 255, (3, 16, 24), dtype=torch.uint8)
    good = torch.frombuffer(bytearray(encode_jpeg(image.numpy(), 95)), dtype=torch.uint8)
    junk = torch.frombuffer(bytearray(b"\xff\xd8\xff\xe0" + bytes(60)), dtype=torch.uint8)
    meta = torch.device("meta")  # a device that is not the CPU, on every machine
    device_decode._say_decoded_on_the_cpu.cache_clear()
    for _ in range(2):
        out = device_decode._decode_all([good, junk, good], meta, refusing, ImageReadMode.RGB)
        assert [o is None for o in out] == [False, True, False]
        assert out[0].device == meta and out[0].shape == (3, 16, 24)
    assert len(on_cpu) == 2 * 3  # each image once per batch, after the device refused it
    err = capfd.readouterr().err
    assert err.count("decoded on the CPU") == 1, err


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torchvision 0.29 on its decoders
def test_a_device_decoder_that_cannot_start_is_said_once_and_left(capfd, monkeypatch):
    """nvJPEG failing to start (torchvision retries the start at every call) was taken for bad
    files: each batch split in halves down to single images, 2n - 1 failed starts a batch, and
    'refused images' said of good ones. Now one line says the decoder cannot start, and every
    later batch goes straight to the CPU decoder: the same pixels, one failed start in all."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from cnnkit.data import device_decode
    from cnnkit.data.decode import encode_jpeg

    starts = []

    def broken(data, mode, device="cpu"):
        if torch.device(device).type != "cpu":
            starts.append(device)
            raise RuntimeError("Failed to initialize nvjpeg with hardware backend: 5\nException")
        return decode_jpeg(data, mode=mode)

    monkeypatch.setattr(device_decode, "_unavailable", set())
    image = torch.randint(0, 255, (3, 16, 24), dtype=torch.uint8)
    good = torch.frombuffer(bytearray(encode_jpeg(image.numpy(), 95)), dtype=torch.uint8)
    junk = torch.frombuffer(bytearray(b"\xff\xd8\xff\xe0" + bytes(60)), dtype=torch.uint8)
    meta = torch.device("meta")
    for _ in range(3):
        out = device_decode._decode_all([good, junk] + [good] * 6, meta, broken, ImageReadMode.RGB)
        assert [o is None for o in out] == [False, True] + [False] * 6
        assert all(o.device == meta and o.shape == (3, 16, 24) for o in out if o is not None)
    assert len(starts) == 1
    err = capfd.readouterr().err.strip()
    assert err == (
        "cnnkit: note: the meta JPEG decoder cannot start (Failed to initialize nvjpeg with hardware "
        "backend: 5): JPEGs are decoded on the CPU in the main process (correct, slow; "
        "data.decode: cpu decodes them in the loader workers instead)"
    )


def test_raw_shards_need_no_decoding(sets):
    with pytest.raises(ConfigError, match="raw shards need no decoding"):
        data_config({"source": "packed", "path": str(sets / "raw"), "crop": 28,
                     "decode": "gpu"}).build(CPU)  # fmt: skip


def test_too_little_shared_memory_is_one_clear_line(sets, monkeypatch):
    real = os.statvfs

    class Tiny:
        f_bavail, f_frsize = 16, 4096  # 64 KiB free, as in a small container

    monkeypatch.setattr(os, "statvfs", lambda p: Tiny() if p == "/dev/shm" else real(p))
    stream = data_config({**sections(sets)[1], "workers": 2}).build(CPU).val
    with pytest.raises(DataError, match=r"needs .* MiB of shared memory .*--shm-size"):
        next(iter(stream))


def test_every_set_and_stream_keeps_the_loaders_contract(sets):
    """The loader's protocols, checked on what implements them: both image sets are
    BatchDatasets; image streams, in-memory ones and evaluation's counting wrapper are
    Batches, so the run and evaluation call them without asking what they are."""
    from cnnkit.data.base import Batches
    from cnnkit.data.batch import BatchDataset
    from cnnkit.train.evaluation import CountedBatches

    for section in sections(sets):
        bundle = data_config(section).build(CPU)
        assert isinstance(bundle.train.dataset, BatchDataset)
        for stream in (bundle.train, bundle.val, CountedBatches(bundle.val)):
            assert isinstance(stream, Batches)
    digits = data_config({"source": "digits"}).build(CPU)
    assert isinstance(digits.train, Batches) and isinstance(CountedBatches(digits.val), Batches)
    digits.train.check_room()  # (nothing to check: in memory)
    assert not isinstance(object(), Batches) and not isinstance(object(), BatchDataset)


def test_without_workers_the_ring_takes_no_shared_memory(sets, monkeypatch):
    """data.workers=0, the way out of a small /dev/shm, made its ring there all the same and was
    refused for want of it; now the ring is two slots of this process's own memory."""
    real = os.statvfs

    class Tiny:
        f_bavail, f_frsize = 16, 4096  # 64 KiB free

    monkeypatch.setattr(os, "statvfs", lambda p: Tiny() if p == "/dev/shm" else real(p))
    bundle = data_config({**sections(sets)[1], "workers": 0}).build(CPU)
    assert bundle.train.ring_slots() == 2 and bundle.train.shared_bytes() == 0
    bundle.train.check_room()
    assert sum(len(y) for _, y in bundle.train) == 16
    assert not bundle.train._ring.buffers.untyped_storage().is_shared()


def test_a_stream_without_images_starts_no_workers(sets):
    """bench loader holds out nothing: its empty held-out stream forked a second set of
    workers beside training's."""
    bundle = data_config({**sections(sets)[1], "workers": 2, "val_fraction": 0.0}).build(CPU)
    assert bundle.val.processes() == 0 and bundle.train.processes() == 2
    bundle.val.start_workers()
    assert bundle.val.loader().num_workers == 0 and list(bundle.val) == []


def test_a_pass_begun_early_is_begun_again_for_another_epoch(sets):
    """start_workers begins a pass ahead (validation's, as training starts); a set_epoch after
    it read that pass's batches all the same: 4 batches of epoch 0 for 2 of epoch 1."""
    stream = data_config({**sections(sets)[1], "workers": 1}).build(CPU).train
    stream.set_epoch(1, 2)
    expected = [y.clone() for _, y in stream]
    early = data_config({**sections(sets)[1], "workers": 1}).build(CPU).train
    early.start_workers()
    early.set_epoch(1, 2)
    got = [y.clone() for _, y in early]
    assert len(got) == len(expected) == 2
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    early.set_epoch(0)  # the persistent workers go on as before
    assert len(list(early)) == 4


def test_the_validation_ring_is_counted_before_training_starts(sets, monkeypatch):
    """Room for training's ring but not for validation's too: refused before the first
    training batch, not after an epoch's work; then both fit and the stream runs."""
    from cnnkit.data import slots

    bundle = data_config({**sections(sets)[1], "workers": 1}).build(CPU)
    train, val = bundle.train.shared_bytes(), bundle.val.shared_bytes()
    assert train > 0 and val > 0
    real, free = os.statvfs, [train + slots.SHM_MARGIN + val // 2]

    class Room:
        f_frsize = 1

        @property
        def f_bavail(self):
            return free[0]

    monkeypatch.setattr(os, "statvfs", lambda p: Room() if p == "/dev/shm" else real(p))
    with pytest.raises(DataError, match=r"data.workers=1 \(training and validation\) needs "
                                        r"4\.\d MiB .* has 4\.\d MiB free"):  # fmt: skip
        next(iter(bundle.train))
    free[0] += val
    assert next(iter(bundle.train))[0].shape[0] == 4


def test_a_ring_has_no_more_slots_than_its_epoch_has_batches(sets):
    """workers x prefetch batches in flight, but never more than the epoch holds: a
    validation set of a few batches got 32 page-locked slots of 50 MB each on a GPU."""
    bundle = data_config({**sections(sets)[1], "workers": 2, "prefetch": 16}).build(CPU)
    for stream in (bundle.train, bundle.val):
        batches = len(stream.sampler.batches())
        assert batches < 2 * 16 and stream.ring_slots() == batches + 2
        stream.set_epoch(1)
        assert len(list(stream)) == batches  # every batch, the slots reused


def test_a_ring_holds_no_more_images_a_batch_than_the_set_has(sets):
    """A validation set of 6 images under an eval batch of 100 takes slots of 6 images, not
    100 (bench loader's --batch 100000 over 16 images asked for 100 GB); an empty one takes
    none, and is not counted beside training's."""
    bundle = data_config({**sections(sets)[1], "workers": 1, "eval_batch_size": 100}).build(CPU)
    assert bundle.val.sampler.largest() == 6 and bundle.val._slot_shape()[0] == 6
    images = sum(len(y) for _, y in bundle.val)
    assert images == 6
    alone = data_config({**sections(sets)[1], "workers": 1, "val_fraction": 0.0}).build(CPU)
    assert alone.val.shared_bytes() == 0 and alone.train._ring_needs() == ("data.workers=1", 0)


def test_shared_memory_is_counted_for_every_process_on_the_machine(sets, monkeypatch):
    """Each local rank makes its own rings, and their pages are taken only as batches fill
    them: room for one rank's but not for 4 is refused before any worker starts, naming both."""
    from cnnkit.data import slots

    one = data_config({**sections(sets)[1], "workers": 1}).build(CPU)
    need = one.train.shared_bytes() + one.val.shared_bytes() + slots.SHM_MARGIN
    real = os.statvfs

    class Room:
        f_frsize, f_bavail = 1, 3 * need  # room for 3 ranks' rings

    monkeypatch.setattr(os, "statvfs", lambda p: Room() if p == "/dev/shm" else real(p))
    assert next(iter(one.train))[0].shape[0] == 4  # one process: fits
    four = data_config({**sections(sets)[1], "workers": 1}).build(CPU, local_ranks=4)
    with pytest.raises(DataError, match=r"in each of the 4 processes on this machine \(.* in "
                                        r"all\) but /dev/shm has"):  # fmt: skip
        next(iter(four.train))


def test_workers_default_from_the_cores_shared_by_local_ranks(sets, monkeypatch):
    monkeypatch.setattr(imageset, "available_cores", lambda: 16)
    cfg = data_config(sections(sets)[0])
    assert cfg.workers is None
    assert cfg.worker_count(1) == 15 and cfg.worker_count(8) == 1 and cfg.worker_count(4) == 3
    assert data_config({**sections(sets)[0], "workers": 3}).worker_count(8) == 3
    bundle = cfg.build(CPU, local_ranks=4)
    assert bundle.train.workers == bundle.val.workers == 3


def test_validation_workers_are_started_once_as_trainings_are(sets):
    """Forked afresh for every epoch's validation, a worker hung now and then in a --nproc run
    on Python 3.11 (CPython's fork deadlock, while another thread held its thread-state lock):
    one set a run, forked with training's as its first epoch starts, idle while training."""
    expected = [y for _, y in data_config({**sections(sets)[0], "workers": 0}).build(CPU).val]
    bundle = data_config({**sections(sets)[0], "workers": 2}).build(CPU)
    assert bundle.train.loader().persistent_workers and bundle.val.loader().persistent_workers
    assert bundle.val.loader()._iterator is None
    next(iter(bundle.train))  # training's first epoch starts: validation's workers with it
    workers = bundle.val.loader()._iterator._workers
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    first = [y for _, y in bundle.val]  # two whole passes, as two epochs' validations
    workers = bundle.val.loader()._iterator._workers
    second = [y for _, y in bundle.val]
    assert bundle.val.loader()._iterator._workers == workers  # the same processes, not new ones
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(first, expected, strict=True))


def test_gpu_decoding_on_a_cpu_and_too_many_workers_are_said_once(sets, monkeypatch, capfd):
    """No silent fallback and no wall of torch warnings: one line each, once a process."""
    loader_module._say_decoded_in_process.cache_clear()
    workers_module.say_more_workers_than_cores.cache_clear()
    monkeypatch.setattr(loader_module, "available_cores", lambda: 1)
    with _no_warnings():  # torch's own advice on the worker count is not shown
        bundle = data_config({**sections(sets)[1], "decode": "gpu", "workers": 2}).build(CPU)
        next(iter(bundle.train)), next(iter(bundle.val))
    err = capfd.readouterr().err.splitlines()
    assert [line for line in err if "decode: gpu on a cpu device" in line] == [
        "cnnkit: note: data.decode: gpu on a cpu device: the main process decodes each batch's JPEGs "
        "there (libjpeg-turbo; the workers only read bytes)"]  # fmt: skip
    assert sum("note: 2 loader workers are more than the 1 core this" in line for line in err) == 1
    workers_module.say_more_workers_than_cores.cache_clear()  # raw shards on a CPU: none start
    raw = {**sections(sets)[1], "path": str(sets / "raw"), "workers": 2}
    bundle = data_config(raw).build(CPU)
    assert bundle.train.mode == "views" and next(iter(bundle.train))
    assert "more than the 1 core" not in capfd.readouterr().err


@contextmanager
def _no_warnings():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not [w for w in caught if "worker" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torchvision 0.29 on its decoders
def test_a_bad_jpeg_in_a_big_batch_is_found_by_halves():
    """A batch that one corrupt file fails is split in halves until the file is found: the
    other images still decode in batches (a few calls, not one per image), the same pixels."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from cnnkit.data import device_decode
    from cnnkit.data.decode import encode_jpeg

    calls = []

    def counted(data, mode, device="cpu"):
        calls.append(len(data) if isinstance(data, list) else 1)
        return decode_jpeg(data, mode=mode, device=device)

    images = [torch.randint(0, 255, (3, 8, 8 + i % 5), dtype=torch.uint8) for i in range(64)]
    items = [torch.frombuffer(bytearray(encode_jpeg(im.numpy(), 90)), dtype=torch.uint8)
             for im in images]  # fmt: skip
    items[37] = torch.frombuffer(bytearray(b"\xff\xd8\xff\xe0" + bytes(60)), dtype=torch.uint8)
    out = device_decode._decode_all(items, CPU, counted, ImageReadMode.RGB)
    assert [i for i, o in enumerate(out) if o is None] == [37]
    alone = [decode_jpeg(item, mode=ImageReadMode.RGB) for i, item in enumerate(items) if i != 37]
    assert all(
        torch.equal(a, b) for a, b in zip(alone, [o for o in out if o is not None], strict=True)
    )
    assert len(calls) <= 2 * 6 + 1 and sum(calls) < 3 * 64  # log2(64) = 6 halvings


@pytest.mark.parametrize("mode", ["squash", "shorter"])
def test_images_of_one_size_are_resized_together_as_each_alone(mode):
    """A batch's decoded photos resized by size group (one call each): the pixels each one's
    own resize gives, in the batch's order, for photos larger, smaller and of the size."""
    from cnnkit.data.device_decode import _resized, resize_on_device

    g = torch.Generator().manual_seed(0)
    shapes = [(37, 50), (50, 37), (37, 50), (24, 24), (10, 31), (37, 50), (50, 37)]
    images = {i: torch.randint(0, 256, (3, *s), generator=g, dtype=torch.uint8)
              for i, s in enumerate(shapes)}  # fmt: skip
    out = _resized(images, 24, mode)
    assert list(out) != sorted(out) and sorted(out) == sorted(images)  # grouped, all there
    for i, image in images.items():
        assert torch.equal(out[i], resize_on_device(image, 24, mode)), i
        assert out[i].shape == (3, 24, 24) and out[i].dtype == torch.uint8


def test_bicubic_device_decoding_equals_the_workers(tmp_path):
    """data.interpolation: bicubic on the device's path (its resize in two passes, rounded and
    clipped between as torch's uint8 kernel does) = the workers' within two levels, on the
    hard edges of black and white blocks, where bicubic overshoots most (one pass: 4 levels)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for c in range(2):
        (tmp_path / f"c{c}").mkdir()
        for i in range(4):
            blocks = (rng.random((12, 16, 3)) > 0.5).astype(np.uint8) * 255
            image = np.kron(blocks, np.ones((5, 5, 1), np.uint8))  # 60 x 80
            Image.fromarray(image).save(tmp_path / f"c{c}" / f"{i}.jpg", quality=100)
    section = {"source": "folder", "path": str(tmp_path), "size": 32, "crop": 28,
               "batch_size": 4, "val_fraction": 0.25, "interpolation": "bicubic", "workers": 0}  # fmt: skip
    cpu = data_config(section).build(CPU, seed=1)
    device = data_config({**section, "decode": "gpu"}).build(CPU, seed=1)
    cpu.train.mode = "whole"
    for a, b in ((cpu.train, device.train), (cpu.val, device.val)):
        for (x1, _), (x2, _) in zip(epoch(a, 1), epoch(b, 1), strict=True):
            assert (x1 - x2).abs().max() <= 2.01 * LEVEL
