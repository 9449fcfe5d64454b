"""The bundled data sets and the in-memory batch streams they share: split, sharding across
ranks, exactly-once validation, seeded order and mid-epoch skip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cnnkit.data import data_config
from cnnkit.data.base import Preprocess
from cnnkit.data.bundled import DigitsConfig
from cnnkit.data.holdout import holdout_split
from cnnkit.data.memory import Jitter, TensorBatches
from cnnkit.errors import ConfigError

CPU = torch.device("cpu")


def test_digits_are_uint8_with_a_fixed_stratified_split():
    images, labels, classes = DigitsConfig().load()
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8 and images.max() == 255
    train, val = holdout_split(labels, 0.2, 0)
    assert len(train) == 1438 and len(val) == 359 and not set(train) & set(val)
    assert np.array_equal(holdout_split(labels, 0.2, 0)[1], val)  # fixed, independent of run
    counts = np.bincount(labels[val])
    assert counts.min() >= 35 and counts.max() <= 37 and classes == list("0123456789")


def test_a_held_out_split_never_takes_a_class_s_last_image():
    for labels, fraction in [([0, 1, 1, 1, 1, 1], 0.5), ([0, 1, 1, 2], 0.25), ([0, 1, 2, 2, 2, 2], 0.25),
                             ([0, 0, 1, 1, 2, 2], 0.5)]:  # fmt: skip
        labels = np.array(labels)
        train, val = holdout_split(labels, fraction)
        assert set(labels[train]) == set(labels) and len(val) >= 1, (labels, fraction)
        assert not set(train) & set(val) and len(train) + len(val) == len(labels)
    with pytest.raises(ConfigError, match="empty split"):  # one image per class: none to spare
        holdout_split(np.array([0, 1, 2]), 0.25)


def test_digits_are_scikit_learns_read_from_its_file(monkeypatch):
    """The file scikit-learn ships is read directly (no `load_digits`, so no scikit-learn
    import): the same pixels and labels; where the file is not found, `load_digits` gives them."""
    import sklearn.datasets

    from cnnkit.data import bundled

    digits = sklearn.datasets.load_digits()

    def not_called(*args, **kwargs):
        raise AssertionError("load_digits was called")

    with monkeypatch.context() as patch:
        patch.setattr(sklearn.datasets, "load_digits", not_called)
        pixels, target = bundled._digits()
    assert np.array_equal(pixels, digits.data) and np.array_equal(target, digits.target)
    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda name: None)
    pixels, target = bundled._digits()
    assert np.array_equal(pixels, digits.data) and np.array_equal(target, digits.target)


def test_faces_split_sizes_and_labels():
    bundle = data_config({"source": "faces", "batch_size": 16}).build(CPU)
    assert len(bundle.train.images) == 150 and bundle.val.num_samples == 50
    assert bundle.train.num_samples == 144  # whole batches of 16 per epoch, reshuffled
    assert bundle.classes == ["non-face", "face"] and bundle.input_shape == (1, 25, 25)
    ys = torch.cat([y for _, y in bundle.val])
    assert ys.sum().item() == 25


def _stream(n=10, batch=4, rank=0, world=1, train=True, seed=0):
    images = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1)
    pre = Preprocess(channels=1, crop=1, mean=[0.0], std=[1.0])
    return TensorBatches(images, torch.arange(n), batch, pre, train=train, rank=rank,
                         world_size=world, seed=seed)  # fmt: skip


def test_two_ranks_split_each_global_batch_disjointly():
    one = [y.tolist() for y in (y for _, y in _stream(batch=4))]
    r0 = [y.tolist() for _, y in _stream(batch=4, rank=0, world=2)]
    r1 = [y.tolist() for _, y in _stream(batch=4, rank=1, world=2)]
    assert [a + b for a, b in zip(r0, r1, strict=True)] == one


def test_order_is_seeded_per_epoch_and_skip_resumes_mid_epoch():
    s = _stream(n=20, batch=4)
    s.set_epoch(1)
    full = [y.tolist() for _, y in s]
    s.set_epoch(2)
    assert [y.tolist() for _, y in s] != full
    s.set_epoch(1, skip_batches=3)
    assert [y.tolist() for _, y in s] == full[3:]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_validation_counts_every_image_exactly_once(world):
    seen = []
    for rank in range(world):
        s = _stream(n=11, batch=3, rank=rank, world=world, train=False)
        seen += [v for _, y in s for v in y.tolist()]
        assert s.num_samples == 11
    assert sorted(seen) == list(range(11))


def test_batch_not_divisible_by_world_size_is_a_clear_error():
    from cnnkit.errors import ConfigError

    with pytest.raises(ConfigError, match="does not divide into 3 processes"):
        _stream(batch=4, world=3)


def test_augmentation_jitters_images_but_not_labels():
    x = torch.rand(8, 1, 8, 8) * 255
    aug = Jitter(shift=0.125, rotate=10, scale=0.1, mirror=True)
    out = aug(x, torch.Generator().manual_seed(0))
    assert out.shape == x.shape and not torch.allclose(out, x)
    again = aug(x, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    flip = Jitter(mirror=True)(x, torch.Generator().manual_seed(1))
    flipped = torch.isclose(flip, x.flip(-1), atol=1e-4).flatten(1).all(1)
    same = torch.isclose(flip, x, atol=1e-4).flatten(1).all(1)
    assert (flipped | same).all() and flipped.any() and same.any()


@pytest.mark.parametrize("padding", ["zeros", "border"])
def test_what_a_shift_brings_in_is_black_or_the_edge_in_pixels(padding):
    """The batch is normalised before it is jittered: `zeros` filled with 0 in normalised
    units, the data set's mean grey (78 of 255 on digits), not the black torchvision's
    RandomAffine fills; it fills -mean / std now, black in pixels."""
    from cnnkit.data.base import Preprocess
    from cnnkit.data.memory import TensorBatches

    images = torch.full((4, 1, 8, 8), 200, dtype=torch.uint8)
    pre = Preprocess(channels=1, crop=8, mean=[78.0], std=[60.0])
    stream = TensorBatches(images, torch.arange(4), 4, pre, train=True,
                           augment=Jitter(shift=0.5, padding=padding))  # fmt: skip
    x, _ = next(iter(stream))
    pixels = (x * 60 + 78).round()
    if padding == "border":
        assert (pixels == 200).all()
    else:  # black came in (the grey was 78), blended with the image at the edges
        assert pixels.min() == 0 and (pixels == 0).float().mean() > 0.1


def test_contrast_and_brightness_jitter_per_image():
    x = torch.randn(64, 1, 8, 8)
    gen = torch.Generator().manual_seed(0)
    y = Jitter(contrast=0.5, padding="border")(x, gen)  # identity geometry: contrast only
    mean_x, mean_y = x.mean((1, 2, 3)), y.mean((1, 2, 3))
    torch.testing.assert_close(mean_y, mean_x, atol=1e-4, rtol=1e-4)  # about each image's mean
    gain = (y - mean_y.view(-1, 1, 1, 1)).std((1, 2, 3)) / (x - mean_x.view(-1, 1, 1, 1)).std(
        (1, 2, 3)
    )
    assert gain.min() >= 0.5 - 1e-4 and gain.max() <= 1.5 + 1e-4 and gain.std() > 0.1
    z = Jitter(brightness=0.3, padding="border")(x, torch.Generator().manual_seed(0))
    shift = (z - x).flatten(1)
    assert (shift.std(1) < 1e-4).all() and shift[:, 0].abs().max() <= 0.3 + 1e-5
    assert not Jitter().active and Jitter(brightness=0.1).active


def test_a_held_out_split_is_each_class_s_own_by_file_name():
    """Which images a class holds out depends on the seed and its own files alone: images added
    to another class, a class folder added, or the files listed in another order leave it."""
    files = [f"a/{i}.png" for i in range(40)] + [f"b/{i}.png" for i in range(30)]
    labels = np.array([0] * 40 + [1] * 30)
    _, val = holdout_split(labels, 0.2, keys=files)
    held = {files[i] for i in val}
    grown = files + [f"b/{i}.png" for i in range(30, 60)] + [f"c/{i}.png" for i in range(20)]
    grown_labels = np.array([0] * 40 + [1] * 60 + [2] * 20)
    _, val2 = holdout_split(grown_labels, 0.2, keys=grown)
    assert {grown[i] for i in val2 if grown[i].startswith("a/")} == {
        f for f in held if f.startswith("a/")
    }
    order = np.random.default_rng(0).permutation(len(files))
    _, val3 = holdout_split(labels[order], 0.2, keys=[files[i] for i in order])
    assert {files[order[i]] for i in val3} == held
    _, other = holdout_split(labels, 0.2, seed=1, keys=files)
    assert {files[i] for i in other} != held and len(other) == len(val) == 14


def test_small_classes_still_give_a_split_the_old_runs_rule():
    """The odd images are handed out across classes by largest remainders (never a class's
    last): 10 classes of 4 images hold out 4 at 0.1, where each class's own share rounds to 0;
    the counts are those runs trained with (their fingerprints still match)."""
    for counts, fraction, held in (([4] * 10, 0.1, 4), ([2] * 100, 0.2, 40), ([3] * 7, 0.15, 3),
                                   ([10, 10, 11], 0.25, 8), ([2, 2], 0.25, 1)):  # fmt: skip
        labels = np.repeat(np.arange(len(counts)), counts)
        train, val = holdout_split(labels, fraction)
        per_class = np.bincount(labels[val], minlength=len(counts))
        assert len(val) == held and (per_class < np.asarray(counts)).all(), counts
        assert sorted([*train, *val]) == list(range(len(labels)))
