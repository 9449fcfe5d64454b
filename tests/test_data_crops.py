"""Folder workers that crop (CPU training): one resize from the file equals, closely, resizing to
`size` then cropping; workers equal in-process loading; the main-process path is matched."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from data_images import photo
from PIL import Image

from cnnkit.data import data_config
from cnnkit.data import regions as regions_module
from cnnkit.data.augment import CropAugment
from cnnkit.data.batch import BatchJob
from cnnkit.data.boxes import rrc_boxes
from cnnkit.data.decode import decode_data
from cnnkit.data.pack import pack_folder
from cnnkit.data.packed import PackedImages
from cnnkit.data.regions import load_region, open_image, region_factor
from cnnkit.data.resize import box_region, planar, resize_crop, resize_uint8
from cnnkit.data.sampling import EpochBatchSampler, JobSampler, batch_generator
from cnnkit.data.slots import SlotRing

CPU = torch.device("cpu")


def load_box(path, size, mode, box, crop, flip) -> torch.Tensor:
    """Box (top, left, h, w) of the image resized to size x size, resized to crop x crop from
    the file: the folder workers' way (the box's region of the photo, then load_region)."""
    image = open_image(path)
    return load_region(image, box_region(image.shape, box, size, mode), crop, flip)


def two_step(path, size, mode, box, crop, flip) -> torch.Tensor:
    """The reference: resize to size x size, cut the box, resize it to crop (float)."""
    array = np.array(Image.open(path).convert("RGB"))
    top, left, h, w = box
    region = resize_uint8(array, size, mode)[None, :, top : top + h, left : left + w].float()
    out = F.interpolate(region, size=(crop, crop), mode="bilinear", antialias=True)[0]
    return out.flip(-1) if flip else out


@pytest.mark.parametrize("mode", ["squash", "shorter"])
@pytest.mark.parametrize(("box", "flip"), [((0, 0, 64, 64), False), ((10, 20, 30, 40), True)])
def test_load_box_is_close_to_resize_then_crop(tmp_path, mode, box, flip):
    path = tmp_path / "p.png"
    Image.fromarray(photo(90, 120, seed=3)).save(path)
    got = load_box(path, 64, mode, box, 48, flip).float()
    ref = two_step(path, 64, mode, box, 48, flip)
    assert got.shape == (3, 48, 48)
    assert (got - ref).abs().mean() < 2.0  # 0-255 units: rounding and the box's edges only
    wrong = ref.flip(-1)  # a mirror mistake would be far off
    assert (got - wrong).abs().mean() > 3 * (got - ref).abs().mean()


def test_same_size_box_is_an_exact_crop(tmp_path):
    path = tmp_path / "p.png"  # lossless, already size x size: no resize at all
    Image.fromarray(photo(32, 32, seed=4)).save(path)
    got = load_box(path, 32, "squash", (5, 7, 24, 24), 24, True)
    ref = np.asarray(Image.open(path)).transpose(2, 0, 1)[:, 5:29, 7:31][..., ::-1]
    np.testing.assert_array_equal(got.numpy(), ref)


@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("layout", ["hwc view", "channels-last", "planar slice"])
def test_planar_copies_any_layout_as_torch_does(layout, flip):
    hwc = torch.from_numpy(photo(40, 52, seed=5))
    image = {"hwc view": hwc.permute(2, 0, 1),
             "channels-last": hwc.permute(2, 0, 1)[None].contiguous(
                 memory_format=torch.channels_last)[0],
             "planar slice": hwc.permute(2, 0, 1).contiguous()[:, 3:30, 5:41]}[layout]  # fmt: skip
    want = (image.flip(-1) if flip else image).contiguous()
    got = planar(image, flip=flip)
    assert got.is_contiguous() and torch.equal(got, want)
    slots = torch.zeros(3, *image.shape, dtype=torch.uint8)
    assert planar(image, slots[1], flip).data_ptr() == slots[1].data_ptr()
    assert torch.equal(slots[1], want) and not slots[0].any() and not slots[2].any()


def test_resize_crop_into_a_slot_equals_torchs_resize():
    region = torch.from_numpy(photo(90, 120, seed=6)).permute(2, 0, 1)[:, 5:80, 10:100]
    want = F.interpolate(region[None].contiguous(), size=(48, 48), mode="bilinear",
                         antialias=True)[0]  # fmt: skip
    slot = torch.empty(3, 48, 48, dtype=torch.uint8)
    assert torch.equal(resize_crop(region, 48, False, slot), want)
    assert torch.equal(slot, want)
    assert torch.equal(resize_crop(region, 48, True), want.flip(-1))


def test_box_region_maps_to_the_source():
    assert box_region((200, 100), (0, 0, 64, 64), 64, "squash") == (0, 0, 200, 100)
    assert box_region((200, 100), (32, 16, 32, 16), 64, "squash") == (100, 25, 200, 50)
    assert box_region((200, 100), (0, 0, 64, 64), 64, "shorter") == (50, 0, 150, 100)


@pytest.mark.parametrize("shape", [(1, 3000), (3000, 1), (2, 5)])
def test_a_box_of_a_one_pixel_thin_image_holds_pixels(shape, tmp_path):
    """Every box of a very thin image maps to at least one pixel inside it (the lower half of
    a 1-pixel row once mapped past its end: an empty region, and the resize crashed)."""
    h, w = shape
    for top, left in [(0, 0), (40, 40), (60, 62), (63, 63)]:
        y0, x0, y1, x1 = box_region(shape, (top, left, 1, 1), 64, "squash")
        assert 0 <= y0 < y1 <= h and 0 <= x0 < x1 <= w, (top, left, (y0, x0, y1, x1))
    path = tmp_path / "thin.png"
    Image.fromarray(np.full((h, w, 3), 90, np.uint8)).save(path)
    assert load_box(path, 64, "squash", (48, 48, 16, 16), 16, False).shape == (3, 16, 16)


def test_large_jpeg_is_dct_scaled_for_the_box(tmp_path, monkeypatch):
    path = tmp_path / "big.jpg"
    Image.fromarray(photo(256, 256, seed=5)).save(path, quality=95)
    asked = []
    real = regions_module.decode_data
    monkeypatch.setattr(
        regions_module, "decode_data", lambda *a, **k: asked.append(k["factor"]) or real(*a, **k)
    )
    small = load_box(path, 64, "squash", (0, 0, 64, 64), 32, False)
    large = load_box(path, 64, "squash", (0, 0, 8, 8), 32, False)
    assert asked == [2, 1]  # 256 px for 32: 1/2 (1/4 would keep no more than twice 32); 32 whole
    assert small.shape == large.shape == (3, 32, 32)
    whole = real(path.read_bytes()).array
    ref = torch.nn.functional.interpolate(
        torch.from_numpy(whole).permute(2, 0, 1)[None].float(),
        size=(32, 32),
        mode="bilinear",
        antialias=True,
    )[0]
    assert (small.float() - ref).abs().mean() < 1  # 1/2 in the DCT domain, then the filter


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("crops")
    for k in range(3):
        (root / f"c{k}").mkdir()
        for i in range(6):
            h, w = (30, 40) if i % 2 else (44, 33)
            Image.fromarray(photo(h, w, seed=10 * k + i)).save(
                root / f"c{k}" / f"{i}.jpg", quality=95
            )
    return root


def folder(root, **options):
    section = {"source": "folder", "path": str(root), "size": 24, "crop": 20, "batch_size": 4,
               "workers": 0, "val_fraction": 0.0, "lighting": 0.1, **options}  # fmt: skip
    return data_config(section).build(CPU, seed=7)


def epoch(stream, e, skip=0):
    stream.set_epoch(e, skip)
    return [(x.clone(), y.clone()) for x, y in stream]


@pytest.mark.parametrize("train_crop", ["random", "resized"])
def test_worker_crops_equal_in_process_crops(photos, train_crop):
    """9 batches an epoch through 6 reused slots, two epochs: nothing overwritten early."""
    workers = folder(photos, train_crop=train_crop, workers=2, batch_size=2).train
    for e in (1, 2):
        one = epoch(folder(photos, train_crop=train_crop, batch_size=2).train, e)
        two = epoch(workers, e)
        assert len(one) == len(two) == 9
        for (x1, y1), (x2, y2) in zip(one, two, strict=True):
            torch.testing.assert_close(x1, x2, rtol=0, atol=0)
            assert torch.equal(y1, y2)
    resumed = epoch(folder(photos, train_crop=train_crop, batch_size=2).train, 2, skip=2)
    torch.testing.assert_close(resumed[0][0], one[2][0], rtol=0, atol=0)


def test_jobs_hand_out_free_slots_only():
    sampler = EpochBatchSampler(20, 4, 0, 1, seed=0, shuffle=True)
    ring = SlotRing(2, (4, 3, 8, 8))
    jobs = JobSampler(sampler, ring, CropAugment(8).to(CPU), 10)
    it = iter(jobs)
    slots = [next(it).slot for _ in range(3)]
    assert sorted(slots[:2]) == [0, 1] and slots[2] is None  # none free: fresh memory
    ring.release(slots[0])
    assert next(it).slot == slots[0]
    fresh = [job.slot for job in jobs]  # a new epoch: all drained, so all free again
    assert sorted(fresh[:2]) == [0, 1] and fresh[2:] == [None] * 3


def test_jobs_draw_their_crops_on_one_thread(monkeypatch):
    """The workers' crops are drawn in the main process on one thread, its count restored:
    on the main process's threads those few small kernels wait for the cores the workers hold
    (ten times the CPU time with both cores busy)."""
    augment = CropAugment(8, train_crop="resized").to(CPU)
    seen, sample = [], augment.sample
    monkeypatch.setattr(augment, "sample",
                        lambda *a, **k: (seen.append(torch.get_num_threads()), sample(*a, **k))[1])  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        jobs = list(JobSampler(EpochBatchSampler(12, 4, 0, 1, seed=0, shuffle=True), None,
                               augment, 10))  # fmt: skip
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert seen == [1, 1, 1] and all(job.crops.draws is not None for job in jobs)


def test_a_ring_that_cannot_be_page_locked_says_so(capsys):
    """Pinning asked for (a CUDA feed) and refused: still correct, one note saying the copies
    lose their overlap (the first GPU run must show it, not hide it); none when not asked."""
    ring = SlotRing(2, (1, 3, 8, 8))
    assert not ring.pinned and capsys.readouterr().err == ""
    if torch.cuda.is_available():
        pytest.skip("CUDA can page-lock here")
    ring = SlotRing(2, (1, 3, 8, 8), pin=True, what="data.workers=2")
    assert not ring.pinned
    assert "data.workers=2: CUDA could not page-lock" in capsys.readouterr().err


@pytest.mark.parametrize("train_crop", ["random", "resized"])
def test_worker_crops_match_main_process_augmentation(photos, train_crop):
    """The same seeded crops, mirrors and lighting as resizing to `size` and augmenting the
    batch (the path of a CUDA device), up to the one-resize rounding."""
    stream = folder(photos, train_crop=train_crop).train
    stream.set_epoch(2)
    for position, (batch, (x, y)) in enumerate(zip(stream.sampler, stream, strict=True)):
        whole = stream.dataset[BatchJob(batch)]
        raw, y_ref = whole.pixels, whole.labels
        assert whole.sources.tolist() == [list(Image.open(p).size[::-1]) for p in
                                          [stream.dataset.root / stream.dataset.files[i]
                                           for i in stream.dataset.ids[batch]]]  # fmt: skip
        params = stream.augment.sample(
            len(batch), 24, 24, batch_generator(stream.sampler, position), whole.sources
        )
        ref = stream.augment.train(raw, params)
        assert torch.equal(y, y_ref)
        assert (x - ref).abs().mean() < 0.1  # normalised units: ~5 of 255, tiny boxes' edges
        assert (x - ref.flip(-1)).abs().mean() > 0.3  # other draws differ by 0.45-1


@pytest.mark.parametrize(("storage", "interpolation"), [("raw", "bicubic"), ("jpeg", "bilinear")])
def test_packed_worker_crops_equal_main_process_crops(photos, tmp_path, storage, interpolation):
    """Resized crops of a packed set: cut in the workers (slots) = cut in the main process,
    both with the pack's filter."""
    pack_folder(photos, tmp_path / "p", size=24, format=storage, quality=95, progress=False,
                interpolation=interpolation)  # fmt: skip
    section = {"source": "packed", "path": str(tmp_path / "p"), "batch_size": 2, "crop": 20,
               "train_crop": "resized", "lighting": 0.1, "val_fraction": 0.0}  # fmt: skip
    workers = data_config({**section, "workers": 2}).build(CPU, seed=3).train
    main = data_config({**section, "workers": 0}).build(CPU, seed=3).train
    assert workers.mode == "crops"
    assert workers.augment.interpolation == main.augment.interpolation == interpolation
    assert (main.mode == "views") == (storage == "raw")  # raw in-process: zero-copy, main crops
    if storage == "jpeg":
        main.mode = "whole"  # JPEG shards in-process: decode, then augment in the main process
    for (x1, y1), (x2, y2) in zip(epoch(main, 1), epoch(workers, 1), strict=True):
        # the same crops; only float rounding of the normalisation (fused there, two steps here)
        torch.testing.assert_close(x1, x2, rtol=0, atol=1e-5)
        assert torch.equal(y1, y2)


def photo_sizes(root, rels) -> list[list[int]]:
    return [list(Image.open(root / rel).size[::-1]) for rel in rels]  # (H, W)


def test_a_pack_records_each_photos_size_for_the_boxes(photos, tmp_path):
    """Squashed packs know each photo's (H, W); the packs of centre squares (whose boxes stay
    in the square) and packs written before the sizes were recorded give None, and train."""
    pack_folder(photos, tmp_path / "sq", size=24, progress=False, workers=1)
    files = (tmp_path / "sq/files.txt").read_text().split()
    ds = PackedImages(tmp_path / "sq")
    assert ds.sources(np.arange(len(ds))).tolist() == photo_sizes(photos, files)
    batch = ds[BatchJob([4, 0, 9])]
    assert batch.sources.tolist() == photo_sizes(photos, [files[i] for i in (4, 0, 9)])
    pack_folder(photos, tmp_path / "short", size=24, resize="shorter", progress=False, workers=1)
    assert PackedImages(tmp_path / "short").sources(np.arange(3)) is None
    with np.load(tmp_path / "sq/index.npz") as z:  # as an older cnnkit wrote it
        older = {k: z[k] for k in z.files if k != "source"}
    np.savez(tmp_path / "sq/index.npz", **older)
    assert PackedImages(tmp_path / "sq").sources(np.arange(3)) is None
    section = {"source": "packed", "path": str(tmp_path / "sq"), "batch_size": 4, "crop": 20,
               "train_crop": "resized", "val_fraction": 0.0, "workers": 0}  # fmt: skip
    x, _ = next(iter(data_config(section).build(CPU, seed=3).train))
    assert x.shape == (4, 3, 20, 20)


@pytest.mark.parametrize("storage", ["raw", "jpeg"])
def test_packs_and_folders_draw_the_same_boxes_on_the_photos(photos, tmp_path, storage):
    """The same seeded random-resized crops from a squashed pack (boxes on the photos, mapped
    into the stored squares) as straight from the folder (boxes on the photos, cut from the
    files): the pictures agree up to the pack's one extra resample, as they could not if
    either drew its boxes in the square."""
    pack_folder(photos, tmp_path / "p", size=24, format=storage, quality=95, progress=False)
    common = {"batch_size": 4, "crop": 20, "train_crop": "resized", "val_fraction": 0.0,
              "workers": 0, "mirror": False}  # fmt: skip
    packed = data_config({"source": "packed", "path": str(tmp_path / "p"), **common})
    packed = packed.build(CPU, seed=7).train  # folder()'s seed
    plain = folder(photos, **common, lighting=0.0).train
    files = (tmp_path / "p/files.txt").read_text().split()
    assert [plain.dataset.files[i] for i in plain.dataset.ids] == files  # the same order
    packed.augment.mean, packed.augment.std = plain.augment.mean, plain.augment.std
    close = far = 0
    for (x1, y1), (x2, y2) in zip(epoch(packed, 1), epoch(plain, 1), strict=True):
        assert torch.equal(y1, y2)
        close += (x1 - x2).abs().mean().item()
        far += (x1 - x2.flip(0)).abs().mean().item()
    assert close / 4.5 < 0.15 < far / 4.5  # normalised units (std 1 is ~58 levels)


def test_a_dct_scaled_region_never_has_fewer_pixels_than_the_crop():
    """Its edges are rounded to the decoded pixels: a 264 px region at 1/8 had 32 px for a 33
    px crop (a full decode had 264 to shrink from); it keeps over twice the crop's pixels."""
    assert region_factor((12, 12, 276, 276), 33) == 2  # 1/4: 66, not over 2 x 33
    assert region_factor((12, 12, 276, 276), 32) == 4
    rng = np.random.default_rng(0)
    for _ in range(3000):
        y0, crop = int(rng.integers(0, 64)), int(rng.integers(8, 64))
        y1 = y0 + int(rng.integers(crop, 10 * crop))
        f = region_factor((y0, y0, y1, y1), crop)
        if f > 1:
            assert round(y1 / f) - round(y0 / f) >= 2 * crop, (y0, y1, crop, f)


def test_a_files_size_is_read_from_its_first_bytes_or_the_whole_file(tmp_path):
    """The folder workers learn each photo's size before cutting any crop, without holding the
    batch's files in memory: from the first 64 KB, or the whole file where the header lies
    further on (a JPEG whose ICC profile comes first)."""
    from cnnkit.data.decode import BadImage
    from cnnkit.data.regions import HEADER_BYTES, file_shape

    Image.fromarray(photo(30, 50, seed=1)).save(tmp_path / "a.jpg")
    Image.fromarray(photo(30, 50, seed=1)).save(tmp_path / "b.jpg", icc_profile=bytes(200_000))
    Image.fromarray(photo(7, 9, seed=1)).save(tmp_path / "c.png")
    assert (tmp_path / "b.jpg").stat().st_size > 3 * HEADER_BYTES
    assert [file_shape(tmp_path / n) for n in ("a.jpg", "b.jpg", "c.png")] == [(30, 50)] * 2 + [
        (7, 9)
    ]
    (tmp_path / "d.jpg").write_bytes(b"not an image")
    with pytest.raises(BadImage, match="not an image"):
        file_shape(tmp_path / "d.jpg")


@pytest.mark.parametrize("mode", ["squash", "shorter"])
def test_photos_smaller_than_size_are_cropped_where_the_box_says(photos, mode):
    """Photos upsampled to `size` (30x40 and 44x33 to 64): the worker's crop is the box of the
    photo resized whole, as on a GPU or from a pack. A region with edges rounded to the photo's
    pixels moved the crop by up to an output pixel here (0.4-0.5 normalised units off)."""
    stream = folder(photos, size=64, crop=56, resize_mode=mode, lighting=0.0).train
    stream.set_epoch(1)
    for x, ref in beside_the_devices_path(stream, 64):
        torch.testing.assert_close(x, ref, rtol=0, atol=1e-5)  # float rounding only


def beside_the_devices_path(stream, side):
    """Each batch of a CPU stream (its workers' crops) and the same draws on the CUDA device's
    path: the whole images the workers resize to side x side, augmented as a batch."""
    for position, (batch, (x, _)) in enumerate(zip(stream.sampler, stream, strict=True)):
        whole = stream.dataset[BatchJob(batch)]
        params = stream.augment.sample(
            len(batch), side, side, batch_generator(stream.sampler, position), whole.sources
        )
        yield x, stream.augment.train(whole.pixels, params)


def test_bicubic_folder_crops_are_cut_from_the_bicubic_square(photos):
    """data.interpolation: bicubic: the workers' random crops are cut from each photo resized
    whole with that filter (a region resized once would be a bilinear resize), so they equal
    the CUDA device's path, which crops the square the workers resized, to float rounding."""
    stream = folder(photos, train_crop="random", interpolation="bicubic").train
    stream.set_epoch(2)
    for x, ref in beside_the_devices_path(stream, 24):
        assert (x - ref).abs().max() < 1e-4


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_a_folders_random_resized_crops_are_torchvisions(photos, interpolation):
    """A folder's random-resized crops of squashed photos are torchvision's RandomResizedCrop of
    each photo, run with the run's filter on PIL images as its reference scripts run it: the
    box drawn on the photo, cut, resized once. From the same decoded pixels, to a level on
    average 0.13 (two on a rare pixel, where torch's uint8 kernels round or order their passes
    otherwise than PIL's); data.interpolation: bicubic once resized the crop bilinearly, 4
    levels off here."""
    stream = folder(photos, train_crop="resized", interpolation=interpolation, lighting=0.0,
                    mirror=False).train  # fmt: skip
    mode = getattr(T.InterpolationMode, interpolation.upper())
    mean, std = stream.augment.mean, stream.augment.std
    stream.set_epoch(1)
    for position, (batch, (x, _)) in enumerate(zip(stream.sampler, stream, strict=True)):
        paths = [stream.dataset.root / stream.dataset.files[i] for i in stream.dataset.ids[batch]]
        images = [decode_data(p.read_bytes(), fast=True).array for p in paths]
        sources = torch.tensor([image.shape[:2] for image in images])
        draws = stream.augment.sample(len(batch), 24, 24, batch_generator(stream.sampler, position),
                                      sources)["draws"]  # fmt: skip
        boxes = rrc_boxes(draws, sources[:, 0], sources[:, 1], stream.augment.ratio)
        for k, image in enumerate(images):
            ref = TF.resized_crop(Image.fromarray(image), *boxes[k].tolist(), [20, 20], mode)
            ref = torch.from_numpy(np.array(ref)).permute(2, 0, 1).float()
            off = (x[k] * std + mean - ref).abs()
            assert off.max() < 2.01 and off.mean() < 0.5  # bilinear for bicubic: 2 levels
