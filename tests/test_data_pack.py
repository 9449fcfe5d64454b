"""`cnnkit pack`: shards, index, stats, resume, labels files, bad images; the packed source."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from data_images import within, write_bad_folder
from helpers import run_cli, sigint_default
from PIL import Image

from cnnkit.data import data_config
from cnnkit.data.batch import BatchJob
from cnnkit.data.decode import load_resized
from cnnkit.data.pack import pack_folder
from cnnkit.data.packed import PackedImages
from cnnkit.data.synth import synth_shapes
from cnnkit.errors import ConfigError, DataError, Interrupted


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    synth_shapes(root, classes=3, per_class=5, size=24)
    return root


def all_images(path) -> tuple[torch.Tensor, torch.Tensor]:
    ds = PackedImages(path)
    batch = ds[BatchJob(list(range(len(ds))))]
    assert batch.bad == []
    return batch.pixels, batch.labels


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


def test_jpeg_pack_is_smaller_and_close(shapes, tmp_path):
    pack_folder(shapes, tmp_path / "raw", size=48, progress=False, workers=1)
    pack_folder(shapes, tmp_path / "jpg", size=48, format="jpeg", quality=90, progress=False)
    raw, _ = all_images(tmp_path / "raw")
    jpg, _ = all_images(tmp_path / "jpg")
    assert (raw.float() - jpg.float()).abs().mean() < 6
    size = lambda p: sum(f.stat().st_size for f in (p / "shards").iterdir() if f.suffix != ".npz")  # noqa: E731
    assert size(tmp_path / "jpg") < size(tmp_path / "raw") / 4


def test_pack_resumes_after_an_interrupt(shapes, tmp_path, monkeypatch):
    import cnnkit.data.pack as pack

    real, calls = pack.pack_shard, []

    def dies_on_third(job):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(job.shard)
        return real(job)

    monkeypatch.setattr(pack, "pack_shard", dies_on_third)
    with pytest.raises(Interrupted, match=r"pack interrupted: 2 shards done in .*resumes"):
        pack_folder(shapes, tmp_path / "p", size=16, workers=1, shard_size=4, progress=False)
    assert not (tmp_path / "p/meta.json").exists()
    with pytest.raises(DataError, match="interrupted"):
        PackedImages(tmp_path / "p")
    monkeypatch.setattr(pack, "pack_shard", lambda job: (calls.append(job.shard), real(job))[1])
    s = pack_folder(shapes, tmp_path / "p", size=16, workers=1, progress=False)
    assert calls == [0, 1, 2, 3] and s.resumed_shards == 2 and s.images == 15
    pack_folder(shapes, tmp_path / "fresh", size=16, workers=1, shard_size=4, progress=False)
    torch.testing.assert_close(all_images(tmp_path / "p"), all_images(tmp_path / "fresh"))
    with pytest.raises(DataError, match=r"different pack \(--size 12 here, 16 there\); use"):
        pack_folder(shapes, tmp_path / "p", size=12, progress=False)
    with pytest.raises(DataError, match=r"--resize shorter-side-crop here, squash there; --format"):
        pack_folder(
            shapes, tmp_path / "p", size=16, resize="shorter", format="jpeg", progress=False
        )


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


def test_a_pack_resumes_where_its_shards_folder_was_removed(shapes, tmp_path, monkeypatch):
    import cnnkit.data.pack as pack

    used, real = [], pack._run_jobs
    monkeypatch.setattr(pack, "available_cores", lambda: 1)  # the default: this process's cores
    monkeypatch.setattr(pack, "_run_jobs", lambda todo, n, *a: (used.append(n), real(todo, n, *a)))
    pack_folder(shapes, tmp_path / "p", size=16, shard_size=4, progress=False)
    assert used == [1]
    monkeypatch.undo()
    shutil.rmtree(tmp_path / "p/shards")  # the plan stays: a resume must make the folder again
    (tmp_path / "p/meta.json").unlink()
    s = pack_folder(shapes, tmp_path / "p", size=16, workers=1, progress=False)
    assert s.images == 15 and len(all_images(tmp_path / "p")[1]) == 15


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
    from cnnkit.data.packed import is_pack
    from cnnkit.train.evaluation import eval_data

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
    with pytest.raises(DataError, match="packed with --size 16 --resize shorter-side-crop, the "
                       "training set with --size 16 --resize squash: pack both alike"):  # fmt: skip
        other.build(torch.device("cpu"))
    from cnnkit.data.scan import read_label_file

    (tmp_path / "commas.txt").write_text("img,1.jpg cat\nimg 2.jpg dog\n")  # names, not CSV
    assert read_label_file(tmp_path / "commas.txt") == {"img,1.jpg": "cat", "img 2.jpg": "dog"}
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\n")  # not text: one line, not a traceback
    with pytest.raises(DataError, match="not a UTF-8 text file"):
        pack_folder(flat, tmp_path / "bad", size=16, labels_file=tmp_path / "binary.txt",
                    progress=False)  # fmt: skip
    assert not (tmp_path / "bad").exists()


def test_pack_errors_are_one_line(tmp_path):
    with pytest.raises(DataError, match="not a folder"):
        pack_folder(tmp_path / "missing", tmp_path / "p")
    (tmp_path / "src/a").mkdir(parents=True)
    with pytest.raises(ConfigError, match="inside the folder being packed"):
        pack_folder(tmp_path / "src", tmp_path / "src" / "packed")
    assert not (tmp_path / "src" / "packed").exists()
    (tmp_path / "empty/a").mkdir(parents=True)
    with pytest.raises(DataError, match="no images"):
        pack_folder(tmp_path / "empty", tmp_path / "p")
    assert not (tmp_path / "p").exists()


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


def test_folders_that_would_change_the_classes_are_refused_and_nothing_is_written(tmp_path, capsys):
    for name, build, code, words in [
        ("empty class", lambda s: (s / "a").mkdir(), 1, "class folder with no images"),
        ("gif only", lambda s: (s / "a").mkdir() or (s / "a/x.gif").write_bytes(b"GIF89a"), 1,
         "not a supported image type (.gif)"),
        ("linked class", lambda s: os.symlink("b", s / "a"), 1, "already a class"),
        ("unreadable only", lambda s: (s / "a").mkdir() or (s / "a/x.jpg").write_bytes(b"x"), 1,
         "none of the 2 images could be read"),
    ]:  # fmt: skip
        src = tmp_path / name
        (src / "b").mkdir(parents=True)
        (src / "b/ok.png").write_bytes(b"not really") if name == "unreadable only" else \
            Image.new("RGB", (8, 8)).save(src / "b/ok.png")  # fmt: skip
        build(src)
        code_got, out, err = run_cli(["pack", str(src), str(tmp_path / "dst")], capsys)
        (line,) = err.splitlines()
        assert code_got == code and line.startswith("cnnkit: error: ") and words in line, line
        assert "Traceback" not in err and not (tmp_path / "dst").exists(), name
    Image.new("RGB", (8, 8)).save(tmp_path / "empty class/a/ok.png")
    code, _, err = run_cli(["pack", str(tmp_path / "empty class"), str(tmp_path / "dst"),
                            "--size", "8193"], capsys)  # fmt: skip
    assert code == 2 and "over the limit of 8192 px" in err and not (tmp_path / "dst").exists()
    for option, words in ((["--format", "png"], "--format: 'png' is not raw or jpeg"),
                          (["--resize", "fit"], "--resize: 'fit' is not squash or shorter")):  # fmt: skip
        code, _, err = run_cli(["pack", str(tmp_path / "empty class"), str(tmp_path / "dst"),
                                *option], capsys)  # fmt: skip
        assert code == 2 and words in err and not (tmp_path / "dst").exists(), err


def _fails_on_third_shard(monkeypatch):
    import cnnkit.data.pack_shard as shard

    real, calls = shard._write_records, []

    def disk_fills(job, out):
        calls.append(job.shard)
        if len(calls) == 3:
            out.write(b"\0" * 1000)  # a partial shard, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(job, out)

    monkeypatch.setattr(shard, "_write_records", disk_fills)


def test_a_full_disk_is_one_line_and_the_pack_resumes(shapes, tmp_path, monkeypatch, capsys):
    import cnnkit.data.pack as pack

    _fails_on_third_shard(monkeypatch)
    argv = ["pack", str(shapes), str(tmp_path / "p"), "--size", "16", "-j", "1"]
    monkeypatch.setattr(pack, "_jobs", _small_shards(pack._jobs))
    code, out, err = run_cli(argv, capsys)
    (line,) = err.splitlines()
    assert code == 1 and "the disk is full" in line and str(tmp_path / "p") in line, line
    assert "00002.u8" in line and "resumes" in line
    shards = sorted(p.name for p in (tmp_path / "p/shards").iterdir())
    assert shards == ["00000.npz", "00000.u8", "00001.npz", "00001.u8"]  # no .tmp, no part
    assert not (tmp_path / "p/meta.json").exists()
    monkeypatch.undo()
    monkeypatch.setattr(pack, "_jobs", _small_shards(pack._jobs))
    code, out, err = run_cli(argv, capsys)
    assert code == 0 and "(2 resumed)" in out
    pack_folder(shapes, tmp_path / "fresh", size=16, workers=1, shard_size=4, progress=False)
    torch.testing.assert_close(all_images(tmp_path / "p"), all_images(tmp_path / "fresh"))


def _small_shards(jobs):
    """The CLI's pack with 4 images per shard (the CLI has no option for it)."""

    def planned(plan, src, dst):
        return jobs({**plan, "shard_size": 4}, src, dst)

    return planned


def test_a_full_disk_while_finishing_leaves_no_meta(shapes, tmp_path, monkeypatch):
    import cnnkit.data.pack_shard as shard

    real = shard.atomic

    @contextmanager
    def full(path):
        with real(path) as f:
            if path.name == "meta.json":
                f.write(b'{"format": ')  # half a meta.json, then the disk is full
                raise OSError(errno.ENOSPC, "No space left on device")
            yield f

    monkeypatch.setattr(shard, "atomic", full)
    with pytest.raises(DataError, match="disk is full.*meta.json"):
        pack_folder(shapes, tmp_path / "p", size=16, workers=1, progress=False)
    assert not (tmp_path / "p/meta.json").exists() and not list((tmp_path / "p").glob("*.tmp"))
    monkeypatch.undo()
    s = pack_folder(shapes, tmp_path / "p", size=16, workers=1, progress=False)
    assert s.images == 15 and s.resumed_shards == s.shards


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs (root only; skipped where mounting is not allowed)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(disk)],
                          capture_output=True)  # fmt: skip
    if done.returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_real_full_disk_with_worker_processes(small_disk, tmp_path, capsys):
    synth_shapes(tmp_path / "src", classes=3, per_class=30, size=40)  # 90 x 27 kB raw at 96 px:
    # 6 shards of 16 images (442 kB each), 4 fit
    argv = ["pack", str(tmp_path / "src"), str(small_disk / "p"), "--size", "96", "-j", "2"]
    with within(60):
        code, out, err = run_cli(argv, capsys)
    (line,) = err.splitlines()
    assert code == 1 and "the disk is full" in line and "Traceback" not in err, err
    assert not (small_disk / "p/meta.json").exists()
    assert not [p for p in (small_disk / "p").rglob("*.tmp")]
    done = {p.stem for p in (small_disk / "p/shards").glob("*.npz")}
    subprocess.run(["mount", "-o", "remount,size=16M", str(small_disk)], check=True)
    with within(60):
        code, out, err = run_cli(argv, capsys)
    assert code == 0 and done and f"({len(done)} resumed)" in out, (out, err)
    assert json.loads((small_disk / "p/meta.json").read_text())["num_images"] == 90


def test_a_failed_pack_keeps_the_users_own_files(tmp_path, capsys):
    (tmp_path / "bad/a").mkdir(parents=True)
    (tmp_path / "bad/a/x.jpg").write_bytes(b"not an image")
    dst = tmp_path / "mine"
    (dst / "shards").mkdir(parents=True)
    for name in ("shards/notes.txt", "shards/12.u8", "draft.tmp", "readme.txt"):
        (dst / name).write_text("precious")
    code, _, err = run_cli(["pack", str(tmp_path / "bad"), str(dst), "--size", "16"], capsys)
    assert code == 1 and "could be read" in err
    left = sorted(str(p.relative_to(dst)) for p in dst.rglob("*"))
    assert left == ["draft.tmp", "readme.txt", "shards", "shards/12.u8", "shards/notes.txt"]


def test_bench_loader_on_a_folder_of_unreadable_images_is_one_line(tmp_path, capsys):
    for cls in ("a", "b"):
        (tmp_path / "bad" / cls).mkdir(parents=True)
        (tmp_path / "bad" / cls / "x.jpg").write_bytes(b"not an image")
    for workers in ("0", "1"):
        code, _, err = run_cli(["bench", "loader", str(tmp_path / "bad"), "--crop", "16",
                                "--workers", workers, "--batches", "2"], capsys)  # fmt: skip
        assert code == 1 and "Traceback" not in err, err
        assert err.splitlines()[-1].startswith("cnnkit: error: bench loader: an epoch"), err


def test_a_folder_holding_a_packs_file_names_is_refused_untouched(shapes, tmp_path, capsys):
    """A folder of the user's with a files.txt or meta.json (not a pack): a pack would have
    overwritten them, and a failed one deleted them; a plan.json not of a pack, JSON or not,
    is one line that never says to delete the folder."""
    for name, text in [("files.txt", "my list"), ("meta.json", "{}"), ("plan.json", '{"a": 1}'),
                       ("plan.json", "[1, 2]"), ("plan.json", "my plan: not JSON")]:  # fmt: skip
        dst = tmp_path / f"mine-{len(list(tmp_path.iterdir()))}"
        dst.mkdir()
        (dst / name).write_text(text)
        code, _, err = run_cli(["pack", str(shapes), str(dst), "--size", "16"], capsys)
        (line,) = err.splitlines()
        assert code in (1, 2) and line.startswith("cnnkit: error: "), err
        assert ("not a pack" in line) if name != "plan.json" else ("not a cnnkit pack's" in line)
        assert "delete" not in line, line
        assert [p.name for p in dst.iterdir()] == [name] and (dst / name).read_text() == text


def test_a_pack_rerun_on_a_changed_folder_or_label_file_is_refused(shapes, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(shapes, src)
    flat = tmp_path / "flat"
    flat.mkdir()
    classes = sorted(p.name for p in src.iterdir())
    for k, cls in enumerate(classes):
        shutil.copy(next((src / cls).iterdir()), flat / f"v{k}.png")
    (tmp_path / "labels.txt").write_text("".join(f"v{k}.png {c}\n" for k, c in enumerate(classes)))
    (tmp_path / "swapped.txt").write_text(f"v0.png {classes[1]}\nv1.png {classes[0]}\n"
                                          f"v2.png {classes[2]}\n")  # fmt: skip
    pack_folder(flat, tmp_path / "val", size=16, labels_file=tmp_path / "labels.txt",
                progress=False)  # fmt: skip
    before = (tmp_path / "val/index.npz").read_bytes()
    with pytest.raises(DataError, match=r"changed since .* \(2 relabelled\); delete"):
        pack_folder(flat, tmp_path / "val", size=16, labels_file=tmp_path / "swapped.txt",
                    progress=False)  # fmt: skip
    assert (tmp_path / "val/index.npz").read_bytes() == before  # the finished pack untouched
    s = pack_folder(flat, tmp_path / "val", size=16, labels_file=tmp_path / "labels.txt",
                    progress=False)  # fmt: skip
    assert s.images == 3 and s.resumed_shards == s.shards  # unchanged: already packed
    pack_folder(src, tmp_path / "train", size=16, progress=False)
    shutil.copy(next((src / classes[0]).iterdir()), src / classes[0] / "new.png")
    (src / classes[1] / sorted(os.listdir(src / classes[1]))[0]).unlink()
    with pytest.raises(DataError, match=r"\(1 added, 1 gone\)"):
        pack_folder(src, tmp_path / "train", size=16, progress=False)


def test_a_damaged_packed_set_is_one_line_or_skips_the_damaged_image(shapes, tmp_path, capsys):
    pack_folder(shapes, tmp_path / "raw", size=16, shard_size=4, progress=False)
    pack_folder(shapes, tmp_path / "jpeg", size=16, shard_size=4, format="jpeg", progress=False)
    damaged = {
        "cut": lambda p: os.truncate(p / "shards/00001.u8", 100),
        "meta": lambda p: (p / "meta.json").write_text('{"format": '),
        "index": lambda p: (p / "index.npz").write_bytes(b"PK\x03\x04 not a zip"),
        "gone": lambda p: (p / "shards/00003.u8").unlink(),
    }
    words = {"cut": "00001.u8: 100 bytes, the index needs 3,072", "meta": "unreadable",
             "index": "index.npz: unreadable", "gone": "00003.u8: missing"}  # fmt: skip
    for name, damage in damaged.items():
        shutil.copytree(tmp_path / "raw", tmp_path / name)
        damage(tmp_path / name)
        code, _, err = run_cli(["bench", "loader", str(tmp_path / name), "--workers", "0",
                                "--batch", "4", "--batches", "1", "--crop", "12"], capsys)  # fmt: skip
        (line,) = err.splitlines()
        assert code == 1 and line.startswith("cnnkit: error: ") and words[name] in line, line
    # a JPEG record with damaged bytes: that image is skipped and named, the others are kept
    index = np.load(tmp_path / "jpeg/index.npz")
    shard, offset = int(index["shard"][5]), int(index["offset"][5])
    with open(tmp_path / f"jpeg/shards/{shard:05d}.jpg", "r+b") as f:
        f.seek(offset + 2)
        f.write(b"\xff\x00" * 40)  # over its headers
    ds = PackedImages(tmp_path / "jpeg")
    for job in (BatchJob(list(range(15))), BatchJob(list(range(15)), crops=None)):
        batch = ds[job]
        assert len(batch) == 14 and batch.pixels.shape[0] == 14
        ((name, reason),) = batch.bad
        assert name.startswith(f"{tmp_path / 'jpeg'} image 5 (packed from ") and "damaged" in reason
        assert batch.labels.tolist() == np.delete(index["labels"], 5).tolist()
    code, out, err = run_cli(["bench", "loader", str(tmp_path / "jpeg"), "--workers", "1",
                              "--batch", "4", "--batches", "4", "--crop", "12"], capsys)  # fmt: skip
    assert code == 0 and "Traceback" not in err and "image 5" in err and "skipped" in err, err


def test_a_hand_edited_meta_json_is_one_line_naming_the_field(shapes, tmp_path):
    """A meta.json missing what the readers take, or holding it as another type, is damaged
    (one DataError naming the field), never a KeyError or TypeError traceback."""
    pack_folder(shapes, tmp_path / "p", size=16, workers=1, progress=False)
    meta = json.loads((tmp_path / "p/meta.json").read_text())
    edits = {"no rgb_cov": ("rgb_cov", None, "rgb_cov: Field required"),
             "no classes": ("classes", None, "classes: Field required"),
             "no size": ("size", None, "size: Field required"),
             "no storage": ("storage", None, "storage: Field required"),
             "text size": ("size", "32", "size: Input should be a valid integer (got '32')"),
             "two stds": ("std", [1.0, 2.0], "std: List should have at least 3 items"),
             "a path": ("shards", ["../../x.u8"], "shards.0: String should match")}  # fmt: skip
    for name, (key, value, words) in edits.items():
        edited = {k: v for k, v in meta.items() if k != key or value is not None}
        edited.update({key: value} if value is not None else {})
        shutil.copytree(tmp_path / "p", tmp_path / name)
        (tmp_path / name / "meta.json").write_text(json.dumps(edited))
        cfg = data_config({"source": "packed", "path": str(tmp_path / name), "crop": 12,
                           "workers": 0})  # fmt: skip
        with pytest.raises(DataError) as e:
            cfg.build(torch.device("cpu"))
        message = str(e.value)
        assert message.startswith(f"{tmp_path / name}/meta.json: damaged ({words}"), message
        assert message.endswith("); pack the set again") and "\n" not in message, message


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


def test_ctrl_c_in_a_pack_with_workers_is_one_line_and_resumes(shapes, tmp_path):
    """SIGINT to the whole process group (a terminal's Ctrl-C): the workers ignore it, the
    main process says how far it got; the same command then finishes the pack."""
    import signal
    import sys
    import textwrap
    import time

    src = tmp_path / "src"
    for k in range(8):
        shutil.copytree(shapes, src / f"copy{k}", dirs_exist_ok=True)
    flat = tmp_path / "classes"
    for path in sorted(src.rglob("*.JPEG")):
        cls = path.parent.name
        (flat / cls).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, flat / cls / f"{path.parent.parent.name}-{path.name}")
    # the slow writing is a module: a fork inherits it, a fork server imports it too
    (tmp_path / "slow_shards.py").write_text(textwrap.dedent("""
        import cnnkit.data.pack_shard as shard, time
        real = shard._write_records
        def slow(job, out):  # two shards are written, the rest wait for the Ctrl-C
            time.sleep(0.3 if job.shard < 2 else 120)
            return real(job, out)
        shard._write_records = slow
    """))  # fmt: skip
    script = textwrap.dedent(f"""
        import faulthandler, signal
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the stacks, should it hang
        import cnnkit.data.pack as pack, slow_shards
        chosen = pack._pool_context
        def with_slow_shards():
            ctx = chosen()
            if ctx.get_start_method() == "forkserver":
                ctx.set_forkserver_preload(["slow_shards", "cnnkit.data.pack"])
            return ctx
        pack._pool_context = with_slow_shards
        from cnnkit.cli import main
        main(["pack", {str(flat)!r}, {str(tmp_path / "p")!r}, "--size", "16", "-j", "2"])
    """)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=sigint_default, env=env)  # fmt: skip
    deadline = time.monotonic() + 60
    while not list((tmp_path / "p").glob("shards/*.npz")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        err = proc.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:  # its signal masks and stacks, for the failure
        masks = []
        for status in sorted(Path(f"/proc/{proc.pid}/task").glob("*/status")):
            masks += [f"{status.parent.name} {line}" for line in status.read_text().splitlines()
                      if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]  # fmt: skip
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGKILL)
        err = proc.communicate()[1]
        pytest.fail("the pack did not stop at Ctrl-C:\n" + "\n".join(masks) + "\n" + err[-6000:])
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 130 and len(lines) == 1, err
    assert lines[0].startswith("cnnkit: pack interrupted: ") and "resumes" in lines[0]
    s = pack_folder(flat, tmp_path / "p", size=16, progress=False)
    assert s.images == 120 and 0 < s.resumed_shards < s.shards


def test_a_pack_worker_that_dies_is_one_line_not_a_hang(shapes, tmp_path):
    """A worker killed mid-shard (the OOM killer, a decoder's crash): the pool starts another,
    but the shard never comes back, and the pack waited for it forever; now one line, exit
    status 1, and the same command resumes."""
    import sys
    import textwrap

    (tmp_path / "dying_shards.py").write_text(textwrap.dedent("""
        import os, signal, cnnkit.data.pack_shard as shard
        real = shard._write_records
        def dying(job, out):  # shard 1's worker is killed; the others pack
            if job.shard == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(job, out)
        shard._write_records = dying
    """))  # fmt: skip
    script = textwrap.dedent(f"""
        import cnnkit.data.pack as pack, dying_shards
        chosen = pack._pool_context
        def with_dying_shards():
            ctx = chosen()
            if ctx.get_start_method() == "forkserver":
                ctx.set_forkserver_preload(["dying_shards", "cnnkit.data.pack"])
            return ctx
        pack._pool_context = with_dying_shards
        real = pack.pack_folder
        pack.pack_folder = lambda *a, **k: real(*a, shard_size=4, **k)  # 4 shards of 15 images
        from cnnkit.cli import main
        main(["pack", {str(shapes)!r}, {str(tmp_path / "p")!r}, "--size", "16", "-j", "2"])
    """)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith("cnnkit: error: pack: a worker process died (killed by SIGKILL)")
    assert "the same command resumes from them" in lines[0]
    s = pack_folder(shapes, tmp_path / "p", size=16, shard_size=4, progress=False)
    assert s.images == 15 and 0 < s.resumed_shards < s.shards


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
