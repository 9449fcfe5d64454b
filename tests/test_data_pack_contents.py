"""`cnnkit pack`: what a pack holds (every image resized once, JPEG shards, stats, label
files, links and odd file names) and how the packed source reads it back."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from data_images import all_images, write_bad_folder
from PIL import Image

from cnnkit.data import data_config
from cnnkit.data.decode import load_resized
from cnnkit.data.holdout import holdout_id, holdout_split
from cnnkit.data.pack import pack_folder
from cnnkit.data.packed import PackedImages
from cnnkit.errors import DataError


@pytest.mark.parametrize("workers", [1, 2])
def test_raw_pack_holds_every_image_resized_once(shapes, tmp_path, workers):
    s = pack_folder(shapes, tmp_path / "p", size=16, workers=workers, shard_size=4, progress=False)
    assert (s.images, s.shards, s.classes, s.skipped) == (15, 4, 3, 0)
    meta = json.loads((tmp_path / "p/meta.json").read_text())
    files = (tmp_path / "p/files.txt").read_text().split()
    x, y = all_images(tmp_path / "p")
    for i, rel in enumerate(files):
        expected = load_resized(shapes / rel, 16, "squash").image
        torch.testing.assert_close(x[i], expected, rtol=0, atol=0)
        assert meta["classes"][int(y[i])] == rel.split("/")[0]
    pixels = x.double().permute(1, 0, 2, 3).reshape(3, -1)
    np.testing.assert_allclose(np.load(tmp_path / "p/mean.npy"), x.double().mean(0), atol=1e-4)
    np.testing.assert_allclose(meta["mean"], pixels.mean(1), rtol=1e-6)
    np.testing.assert_allclose(meta["std"], pixels.std(1, unbiased=False), rtol=1e-6)
    corr = lambda c: c / np.sqrt(np.outer(np.diag(c), np.diag(c)))  # noqa: E731
    cov = torch.cov(pixels, correction=0).numpy()
    np.testing.assert_allclose(corr(np.array(meta["rgb_cov"])), corr(cov), atol=0.1)  # sampled


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_a_packs_shards_are_mapped_once_and_hold_no_open_files(shapes, tmp_path):
    """np.memmap kept a file open per shard, and the training and held-out subsets mapped every
    shard again: ImageNet's 2,500 shards ran past 1,024 open files in each process."""
    pack_folder(shapes, tmp_path / "p", size=16, workers=1, shard_size=1, progress=False)
    every = PackedImages(tmp_path / "p")
    train, val = every.subset(np.arange(10)), every.subset(np.arange(10, 15))
    before = len(os.listdir("/proc/self/fd"))
    mapped = train.shards()
    assert len(mapped) == 15 and len(os.listdir("/proc/self/fd")) == before
    assert val.shards() is mapped and all(a is b for a, b in zip(val.shards(), mapped, strict=True))
    x, _ = all_images(tmp_path / "p")
    for i in range(15):  # what the mappings read is the pack's
        torch.testing.assert_close(every._image(i), x[i], rtol=0, atol=0)


def test_a_pack_in_a_folder_whose_name_is_not_utf8_is_read(shapes, tmp_path):
    """torch maps files by UTF-8 names only: a pack under a name of other bytes (Linux takes
    any) is mapped through its descriptor, as np.memmap read it."""
    dst = tmp_path / os.fsdecode(b"p\xff")
    try:
        dst.mkdir()
    except (OSError, UnicodeError):
        pytest.skip("this file system takes UTF-8 names only")
    pack_folder(shapes, dst / "pack", size=16, workers=1, shard_size=8, progress=False)
    packed, shards = PackedImages(dst / "pack"), sorted((dst / "pack/shards").glob("*.u8"))
    raw = np.fromfile(shards[0], np.uint8)[: 3 * 16 * 16].reshape(3, 16, 16)
    torch.testing.assert_close(packed._image(0), torch.from_numpy(raw), rtol=0, atol=0)


def test_jpeg_pack_is_smaller_and_close(shapes, tmp_path):
    pack_folder(shapes, tmp_path / "raw", size=48, progress=False, workers=1)
    pack_folder(shapes, tmp_path / "jpg", size=48, format="jpeg", quality=90, progress=False)
    raw, _ = all_images(tmp_path / "raw")
    jpg, _ = all_images(tmp_path / "jpg")
    assert (raw.float() - jpg.float()).abs().mean() < 6
    size = lambda p: sum(f.stat().st_size for f in (p / "shards").iterdir() if f.suffix != ".npz")  # noqa: E731
    assert size(tmp_path / "jpg") < size(tmp_path / "raw") / 4


@pytest.mark.parametrize("format", ["raw", "jpeg"])
def test_a_shard_whose_every_image_was_skipped_reads_as_empty(shapes, tmp_path, format):
    """Broken files last in the sorted order leave the last shard with no record (a 0-byte
    file, which mmap refuses): the set still reads, every good image in its place."""
    src = tmp_path / "src"
    shutil.copytree(shapes, src)
    last = sorted(src.iterdir())[-1]
    for i in range(4):
        (last / f"zz{i}.JPEG").write_text("<html>404</html>")
    s = pack_folder(src, tmp_path / "p", size=16, format=format, workers=1, shard_size=4,
                    progress=False)  # fmt: skip
    assert (s.images, s.shards, s.skipped) == (15, 5, 4)
    assert (tmp_path / f"p/shards/00004.{'u8' if format == 'raw' else 'jpg'}").stat().st_size == 0
    pack_folder(shapes, tmp_path / "clean", size=16, format=format, workers=1, progress=False)
    torch.testing.assert_close(all_images(tmp_path / "p"), all_images(tmp_path / "clean"))


def test_a_file_name_that_is_not_utf8_is_held_out_alike_in_a_folder_and_its_pack(shapes,
                                                                                 tmp_path):  # fmt: skip
    """Names are hashed as files.txt writes them (undecodable bytes as \\xNN, tabs escaped):
    no UnicodeEncodeError, and a folder and its pack hold out the same images."""
    src = tmp_path / "src"
    shutil.copytree(shapes, src)
    first = sorted(p for p in src.iterdir() if p.is_dir())
    for folder, odd in zip(first, (b"c\xff\xfeat.JPEG", b"t\tab.JPEG"), strict=False):
        image = sorted(folder.iterdir())[0]
        os.rename(bytes(image), bytes(folder) + b"/" + odd)
    pack_folder(src, tmp_path / "p", size=16, workers=1, progress=False)
    common = {"crop": 16, "workers": 0, "val_fraction": 0.4}
    folder = data_config({"source": "folder", "path": str(src), "size": 16, **common})
    packed = data_config({"source": "packed", "path": str(tmp_path / "p"), **common})
    f, p = folder.build(torch.device("cpu")), packed.build(torch.device("cpu"))
    assert f.holdout == p.holdout and f.val.num_samples == p.val.num_samples == 6


def test_a_folder_with_unreadable_images_and_its_pack_hold_out_the_same_images(shapes,
                                                                                tmp_path):  # fmt: skip
    """The folder's split counts its unreadable files (skipped as they are read); the pack
    left them out, and drew its split from fewer images: a folder run could not resume on its
    pack. The pack now draws from the folder's scan (plan.json) and holds out the same readable
    images; a split drawn the older way (a run made before) is drawn so again (drawn_as)."""
    src = tmp_path / "src"
    shutil.copytree(shapes, src)
    classes = sorted(p for p in src.iterdir() if p.is_dir())
    for k, folder in enumerate(classes):
        for i in range(k + 1):  # a class with several: the held-out counts move
            (folder / f"a{i}.JPEG").write_bytes(b"" if i % 2 else b"<html>404</html>")
    pack_folder(src, tmp_path / "p", size=16, workers=1, progress=False)
    common = {"crop": 16, "workers": 0, "val_fraction": 0.4}
    folder = data_config({"source": "folder", "path": str(src), "size": 16, **common})
    packed = data_config({"source": "packed", "path": str(tmp_path / "p"), **common})
    f, p = folder.build(torch.device("cpu")), packed.build(torch.device("cpu"))
    assert f.holdout == p.holdout
    scored = [sum(len(y) for _, y in bundle.val) for bundle in (f, p)]
    assert scored[0] == scored[1] == p.val.num_samples < f.val.num_samples  # the bad skipped
    every = PackedImages(tmp_path / "p")
    train_ids, val_ids = holdout_split(every.labels, 0.4, keys=every.keys())
    before = holdout_id(every.keys(), val_ids, len(every.labels))  # a run made before
    assert before != p.holdout
    old = packed.drawn_as(before).build(torch.device("cpu"))
    assert old.holdout == before and old.val.num_samples == len(val_ids)
    assert packed.drawn_as(p.holdout).build(torch.device("cpu")).holdout == p.holdout
    assert packed.drawn_as(None).build(torch.device("cpu")).holdout == before  # before holdouts
    (tmp_path / "p" / "plan.json").unlink()  # a pack copied without it: its own split
    assert packed.build(torch.device("cpu")).holdout == before


def test_a_pack_keeps_a_readable_image_of_each_class_to_train_on(tmp_path):
    """The folder's split may hold out a class's only readable image (it counts the
    unreadable one as the image left to train on); the pack then takes its own split, which
    keeps each class an image to train on (the diff review)."""
    for name, count in (("a", 1), ("b", 4)):
        (tmp_path / "src" / name).mkdir(parents=True)
        for i in range(count):
            Image.fromarray(np.full((8, 8, 3), 60 * i, np.uint8)).save(
                tmp_path / "src" / name / f"{i}.png"
            )
    (tmp_path / "src" / "a" / "zz.png").write_text("junk")
    pack_folder(tmp_path / "src", tmp_path / "p", size=8, workers=1, progress=False)
    for fraction in (0.2, 0.3, 0.4, 0.5, 0.6):
        cfg = data_config({"source": "packed", "path": str(tmp_path / "p"), "crop": 8,
                           "workers": 0, "val_fraction": fraction})  # fmt: skip
        bundle = cfg.build(torch.device("cpu"))
        assert set(bundle.train_labels.tolist()) == {0, 1}, fraction


def test_a_pack_with_a_constant_channel_trains_and_its_preprocessing_is_valid(tmp_path):
    """Blue 128 in every pixel: meta.json's std is 0 for it, which normalisation would divide
    by (once a pydantic traceback): it divides by 1 instead, so the batches are finite."""
    for k, name in enumerate("ab"):
        (tmp_path / "src" / name).mkdir(parents=True)
        for i in range(3):
            pixels = np.zeros((8, 8, 3), np.uint8) + np.uint8([10 + 40 * i, 30 + 90 * k, 128])
            Image.fromarray(pixels).save(tmp_path / "src" / name / f"{i}.png")
    pack_folder(tmp_path / "src", tmp_path / "p", size=8, workers=1, progress=False)
    assert json.loads((tmp_path / "p/meta.json").read_text())["std"][2] == 0.0
    cfg = data_config({"source": "packed", "path": str(tmp_path / "p"), "crop": 8, "workers": 0,
                       "val_fraction": 0.4, "batch_size": 2})  # fmt: skip
    bundle = cfg.build(torch.device("cpu"))
    assert bundle.preprocess.std[2] == 1.0
    x, _ = next(iter(bundle.train))
    assert torch.isfinite(x).all() and (x[:, 2] == 0).all()  # centred, unscaled


def test_an_image_folder_holding_its_own_meta_or_plan_json_is_no_pack(shapes, tmp_path):
    """A pack is a meta.json of the pack format, or cnnkit's plan.json (an interrupted pack):
    a user's own file of either name leaves an image folder one (eval --data reads it so)."""
    from cnnkit.data.base import Preprocess
    from cnnkit.data.packfiles import is_pack
    from cnnkit.train.eval_data import eval_data

    pre = Preprocess(3, 16, mean=[0.0] * 3, std=[1.0] * 3)
    for name, text in (("meta.json", '{"author": "me"}'), ("plan.json", '{"steps": [1]}'),
                       ("plan.json", "my plan"), ("meta.json", "[1, 2]")):  # fmt: skip
        src = tmp_path / f"{name}-{len(text)}"
        shutil.copytree(shapes, src)
        (src / name).write_text(text)
        assert not is_pack(src) and eval_data(str(src), {}, pre).source == "folder", (name, text)
    pack_folder(shapes, tmp_path / "p", size=16, workers=1, progress=False)
    assert is_pack(tmp_path / "p") and eval_data(str(tmp_path / "p"), {}, pre).source == "packed"
    (tmp_path / "p/meta.json").unlink()  # as an interrupted pack leaves it: plan.json alone
    assert is_pack(tmp_path / "p")


def test_bad_images_reported_converted_and_skipped(tmp_path):
    expected = write_bad_folder(tmp_path / "src")
    s = pack_folder(tmp_path / "src", tmp_path / "p", size=16, workers=2, progress=False)
    assert (s.images, s.skipped, s.converted) == (11, 3, 3)  # 8 good + 3 converted
    lines = (tmp_path / "p/bad_images.tsv").read_text().splitlines()
    assert lines[0] == "path\tstatus\treason"
    report = {line.split("\t")[0]: line.split("\t")[1] for line in lines[1:]}
    assert report == expected
    files = set((tmp_path / "p/files.txt").read_text().split())
    assert {f"good/g{i}.JPEG" for i in range(4)} | {
        "good/png_inside.JPEG",
        "odd/cmyk.JPEG",
    } <= files


def test_flat_val_folder_with_label_file(shapes, tmp_path):
    flat = tmp_path / "val"
    flat.mkdir()
    lines = ["ImageId,PredictionString"]
    for k, cls in enumerate(sorted(p.name for p in shapes.iterdir())):
        src = next((shapes / cls).iterdir())
        (flat / f"v{k}.JPEG").write_bytes(src.read_bytes())
        lines.append(f"v{k},{cls} 1 2 3 4")  # Kaggle's LOC_val_solution.csv
    (tmp_path / "labels.csv").write_text("\n".join(lines))
    pack_folder(shapes, tmp_path / "train", size=16, progress=False)
    pack_folder(
        flat, tmp_path / "valp", size=16, labels_file=tmp_path / "labels.csv", progress=False
    )
    cfg = data_config({"source": "packed", "path": str(tmp_path / "train"), "crop": 12,
                       "val_path": str(tmp_path / "valp"), "workers": 0, "batch_size": 4})  # fmt: skip
    bundle = cfg.build(torch.device("cpu"))
    labels = torch.cat([y for _, y in bundle.val])
    assert labels.tolist() == [0, 1, 2] and bundle.classes == sorted(
        p.name for p in shapes.iterdir()
    )
    pack_folder(flat, tmp_path / "valc", size=16, resize="shorter",
                labels_file=tmp_path / "labels.csv", progress=False)  # fmt: skip
    other = cfg.model_copy(update={"val_path": str(tmp_path / "valc")})  # centre squares
    with pytest.raises(DataError, match="packed with --size 16 --resize shorter-side-crop "
                       "--interpolation bilinear, the training set with --size 16 --resize "
                       "squash --interpolation bilinear: pack both alike"):  # fmt: skip
        other.build(torch.device("cpu"))
    from cnnkit.data.scan import read_label_file

    (tmp_path / "commas.txt").write_text("img,1.jpg cat\nimg 2.jpg dog\n")  # names, not CSV
    assert read_label_file(tmp_path / "commas.txt") == {"img,1.jpg": "cat", "img 2.jpg": "dog"}
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\n")  # not text: one line, not a traceback
    with pytest.raises(DataError, match="not a UTF-8 text file"):
        pack_folder(flat, tmp_path / "bad", size=16, labels_file=tmp_path / "binary.txt",
                    progress=False)  # fmt: skip
    assert not (tmp_path / "bad").exists()


def test_a_symlink_loop_packs_each_image_once(shapes, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(shapes, src)
    first = sorted(p.name for p in src.iterdir())[0]
    os.symlink(".", src / first / "loop")  # the issue's `ln -s . class001/loop`
    os.symlink(sorted((src / first).glob("*.JPEG"))[0].name, src / first / "again.jpg")
    s = pack_folder(src, tmp_path / "p", size=16, progress=False, workers=1)
    files = (tmp_path / "p/files.txt").read_text().split()
    assert s.images == 15 and len(files) == len({os.path.realpath(src / f) for f in files})
    report = (tmp_path / "p/bad_images.tsv").read_text()
    assert f"{first}/loop\tskipped\ta folder already scanned" in report
    assert f"{first}/again.jpg\tskipped\tthe same file as {first}/" in report
    # no image is packed twice, so none of the held-out split is a copy of a training image
    # (93% were, through the loop)
    x = all_images(tmp_path / "p")[0].float().flatten(1)
    assert (torch.cdist(x, x) + torch.eye(len(x)) * 1e9).min() > 0


def test_a_link_in_another_class_loses_to_the_real_file(shapes, tmp_path):
    """b/real.jpg linked from a/: the image keeps class b (its own folder), wherever the link
    sorts; the link is listed as skipped."""
    from cnnkit.data.scan import scan_images

    src = tmp_path / "s"
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir()
    one, two = sorted((shapes / sorted(os.listdir(shapes))[0]).iterdir())[:2]
    shutil.copy(one, src / "b/real.jpg")
    shutil.copy(two, src / "a/other.jpg")
    os.symlink("../b/real.jpg", src / "a/link.jpg")
    scan = scan_images(src)
    assert dict(zip(scan.files, scan.labels, strict=True)) == {"a/other.jpg": 0, "b/real.jpg": 1}
    assert ("a/link.jpg", "the same file as b/real.jpg") in scan.skipped


def test_a_folder_link_in_another_class_loses_to_the_real_folder(shapes, tmp_path):
    """a/zlink -> ../b/sub: the real folder b/sub keeps class b, though class a is walked
    first; a link into a folder outside the tree is still followed."""
    from cnnkit.data.scan import scan_images

    src, outside = tmp_path / "s", tmp_path / "outside"
    for folder in (src / "a", src / "b/sub", outside):
        folder.mkdir(parents=True)
    one, two, three = sorted((shapes / sorted(os.listdir(shapes))[0]).iterdir())[:3]
    shutil.copy(one, src / "b/sub/real.jpg")  # all of class b's images
    shutil.copy(two, src / "a/other.jpg")
    shutil.copy(three, outside / "far.jpg")
    os.symlink("../b/sub", src / "a/zlink")
    os.symlink(outside, src / "b/sub/far")
    scan = scan_images(src)
    assert dict(zip(scan.files, scan.labels, strict=True)) == {
        "a/other.jpg": 0, "b/sub/far/far.jpg": 1, "b/sub/real.jpg": 1}  # fmt: skip
    assert ("a/zlink", "a folder already scanned (a symlink loop, a second link or another "
            "class)") in scan.skipped  # fmt: skip


def test_label_files_with_spaces_a_bom_conflicts_and_absent_images(shapes, tmp_path, capsys):
    from cnnkit.data.scan import scan_images

    flat = tmp_path / "flat"
    flat.mkdir()
    classes = sorted(p.name for p in shapes.iterdir())
    names = ["with space ñ.png", "plain.png", "v2.png"]
    for name, cls in zip(names, classes, strict=True):
        shutil.copy(next((shapes / cls).iterdir()), flat / name)
    lines = [f"{n} {c}" for n, c in zip(names, classes, strict=True)] + [f"gone.png {classes[0]}"]
    (tmp_path / "bom.txt").write_text("\ufeff" + "\n".join(lines) + "\n", encoding="utf-8")
    scan = scan_images(flat, tmp_path / "bom.txt")
    assert dict(zip(scan.files, scan.labels, strict=True)) == {
        "plain.png": 1, "v2.png": 2, "with space ñ.png": 0}  # fmt: skip
    assert ("gone.png", "named in bom.txt but not in the folder") in scan.skipped
    s = pack_folder(flat, tmp_path / "p", size=16, labels_file=tmp_path / "bom.txt",
                    progress=False)  # fmt: skip
    assert s.images == 3 and "gone.png\tskipped\tnamed in bom.txt" in (
        tmp_path / "p/bad_images.tsv").read_text()  # fmt: skip
    (tmp_path / "twice.txt").write_text("\n".join(lines[:3] + [f"plain.png {classes[2]}"]))
    with pytest.raises(DataError, match=r"twice.txt:4: 'plain.png' is labelled .* on line 2"):
        scan_images(flat, tmp_path / "twice.txt")
    (tmp_path / "again.txt").write_text("\n".join(lines[:3] + [lines[1]]))  # the same: fine
    assert len(scan_images(flat, tmp_path / "again.txt").files) == 3
    with pytest.raises(DataError, match="no image files found at its top .*class subfolders"):
        scan_images(shapes, tmp_path / "bom.txt")  # a label file for class folders


def test_rgb_covariance_is_within_two_percent_of_every_pixels(shapes, tmp_path):
    """The cross-products come from a seventh of the pixels, centred on each image's exact
    mean: within 2% of numpy's covariance over every stored pixel (the uncentred estimate was
    6% off at 56 px on these 15 images: E[xy] is ~100x the covariance)."""
    pack_folder(shapes, tmp_path / "p", size=56, workers=1, progress=False)
    x, _ = all_images(tmp_path / "p")
    pixels = x.double().permute(1, 0, 2, 3).reshape(3, -1)
    cov = torch.cov(pixels, correction=0).numpy()
    got = np.array(json.loads((tmp_path / "p/meta.json").read_text())["rgb_cov"])
    np.testing.assert_allclose(got, cov, atol=0.02 * np.abs(cov).max())


def test_pack_forks_only_where_no_other_thread_runs():
    """A fork copies whatever lock another thread holds: with one running, the workers start
    from a fork server instead (a plain script, with no thread, still forks: no main guard)."""
    import threading

    from cnnkit.data import pack

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert pack._pool_context().get_start_method() == "forkserver"
    finally:
        stop.set()
        other.join()
    alone = threading.active_count() == 1  # pytest-xdist's worker runs a thread of its own
    assert (pack._pool_context().get_start_method() == "fork") == alone
