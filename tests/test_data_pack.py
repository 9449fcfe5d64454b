"""`cnnkit pack`: shards, index, stats, resume, labels files, bad images; the packed source."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from data_images import write_bad_folder

from cnnkit.data import data_config
from cnnkit.data.batch import BatchJob
from cnnkit.data.decode import load_resized
from cnnkit.data.pack import pack_folder
from cnnkit.data.packed import PackedImages
from cnnkit.data.synth import synth_shapes
from cnnkit.errors import DataError


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
        expected, _ = load_resized(shapes / rel, 16, "squash")
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
    with pytest.raises(KeyboardInterrupt):
        pack_folder(shapes, tmp_path / "p", size=16, workers=1, shard_size=4, progress=False)
    assert not (tmp_path / "p/meta.json").exists()
    with pytest.raises(DataError, match="interrupted"):
        PackedImages(tmp_path / "p")
    monkeypatch.setattr(pack, "pack_shard", lambda job: (calls.append(job.shard), real(job))[1])
    s = pack_folder(shapes, tmp_path / "p", size=16, workers=1, progress=False)
    assert calls == [0, 1, 2, 3] and s.resumed_shards == 2 and s.images == 15
    pack_folder(shapes, tmp_path / "fresh", size=16, workers=1, shard_size=4, progress=False)
    torch.testing.assert_close(all_images(tmp_path / "p"), all_images(tmp_path / "fresh"))
    with pytest.raises(DataError, match="different pack"):
        pack_folder(shapes, tmp_path / "p", size=12, progress=False)


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


def test_pack_errors_are_one_line(tmp_path):
    with pytest.raises(DataError, match="not a folder"):
        pack_folder(tmp_path / "missing", tmp_path / "p")
    (tmp_path / "empty/a").mkdir(parents=True)
    with pytest.raises(DataError, match="no images"):
        pack_folder(tmp_path / "empty", tmp_path / "p")
