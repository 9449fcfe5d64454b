"""Batched augmentation: crops, mirrors, normalisation, lighting and 10 crops against references
(per-image slicing, torchvision), and the CPU fast path against the batched kernels."""

from __future__ import annotations

import math

import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF

from cnnkit.data.augment import (
    IMAGENET_EIGVAL,
    CropAugment,
    center_crop,
    crop_mirror,
    imagenet_lighting,
    lighting_from_cov,
    resized_crop_mirror,
    ten_crop,
)
from cnnkit.data.boxes import draw_boxes, frame_boxes, rrc_boxes, sample_boxes

CPU = torch.device("cpu")


def batch(b: int = 6, size: int = 32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, 3, size, size), dtype=torch.uint8, generator=g)


def test_crop_mirror_equals_per_image_slicing():
    x = batch()
    g = torch.Generator().manual_seed(1)
    top, left = torch.randint(0, 9, (6,), generator=g), torch.randint(0, 9, (6,), generator=g)
    flip = torch.tensor([True, False, True, False, False, True])
    out = crop_mirror(x, top, left, flip, 24)
    for i in range(6):
        ref = x[i, :, top[i] : top[i] + 24, left[i] : left[i] + 24]
        torch.testing.assert_close(out[i], ref.flip(-1) if flip[i] else ref, rtol=0, atol=0)


@pytest.mark.parametrize("mean_image", [False, True])
@pytest.mark.parametrize("lighting", [0.0, 0.1])
def test_cpu_fast_path_equals_batched_gather(mean_image, lighting):
    x = batch()
    mean = torch.rand(3, 32, 32) * 255 if mean_image else torch.tensor([120.0, 110.0, 100.0])
    eigval, eigvec = lighting_from_cov([[900, 100, 50], [100, 800, 60], [50, 60, 700]])
    aug = CropAugment(
        24, "random", True, lighting, mean, torch.tensor([50.0, 60, 70]), eigval, eigvec
    )
    aug = aug.to(CPU)
    p = aug.sample(6, 32, 32, torch.Generator().manual_seed(3))
    out = aug.train(x, p, out=torch.empty(6, 3, 24, 24))
    ref = crop_mirror(x.float() - aug.mean, p["top"], p["left"], p["flip"], 24) / aug.std
    if lighting:
        ref = ref + aug.light(p["alpha"])
        assert ref.std() > 0
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_eval_is_torchvision_center_crop_and_normalize():
    x = batch(size=30)
    mean, std = [120.0, 110.0, 100.0], [50.0, 60.0, 70.0]
    aug = CropAugment(24, mean=torch.tensor(mean), std=torch.tensor(std)).to(CPU)
    ref = TF.normalize(TF.center_crop(x.float(), [24, 24]), mean, std)
    torch.testing.assert_close(aug.eval(x), ref)
    torch.testing.assert_close(aug.eval(x, out=torch.empty(6, 3, 24, 24)), ref)


def test_ten_crop_matches_torchvision():
    x = batch(b=2, size=20)
    ours = ten_crop(x, 16)
    assert ours.shape == (2, 10, 3, 16, 16)
    for i in range(2):
        ref = torch.stack(TF.ten_crop(x[i], [16, 16]))
        torch.testing.assert_close(ours[i], ref, rtol=0, atol=0)
    torch.testing.assert_close(center_crop(x, 16), ours[:, 4], rtol=0, atol=0)


@pytest.mark.parametrize("side", [(21, 21), (20, 24), (256, 256)])
def test_ten_crop_mirrors_the_five_crops_for_odd_margins_too(side):
    """The paper's and Caffe's ten: the five crops and the mirror of each. For an odd margin
    (256 - 227 = 29) TenCrop's tenth was the centre of the mirrored image, a pixel off."""
    x = torch.randint(0, 256, (2, 3, *side), dtype=torch.uint8)
    size = side[0] - 5 if side[0] < 256 else 227
    ours = ten_crop(x, size)
    five = torch.stack(TF.five_crop(x, [size, size]), 1)
    assert torch.equal(ours[:, :5], five)
    assert torch.equal(ours[:, 5:], five[:, [1, 0, 3, 2, 4]].flip(-1))
    tencrop = torch.stack(TF.ten_crop(x, [size, size]), 1)
    assert torch.equal(ours[:, :9], tencrop[:, :9])
    assert not torch.equal(ours[:, 9], tencrop[:, 9])  # mirrored, then its centre: 1 px off


@pytest.mark.parametrize("crop", [224, 225, 227, 229, 231, 255])
def test_the_centre_crop_is_torchvisions_for_odd_margins_too(crop):
    """(256 - 225) / 2 = 15.5: torchvision rounds to 16 (half to even), not down to 15."""
    x = torch.arange(256 * 257, dtype=torch.float32).view(1, 1, 256, 257)
    assert torch.equal(center_crop(x, crop), TF.center_crop(x, [crop, crop]))


def test_resized_crop_identity_box_and_mirror():
    x = batch(b=2, size=16).float()
    full = torch.tensor([[0, 0, 16, 16], [0, 0, 16, 16]])
    same = resized_crop_mirror(x, full, torch.tensor([False, True]), 16)
    torch.testing.assert_close(same[0], x[0], rtol=0, atol=1e-3)
    torch.testing.assert_close(same[1], x[1].flip(-1), rtol=0, atol=1e-3)


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
@pytest.mark.parametrize("box, size", [((0, 0, 256, 256), 112), ((10, 10, 200, 180), 64),
                                       ((30, 40, 100, 100), 224), ((5, 0, 251, 40), 32),
                                       ((100, 7, 3, 2), 20)])  # fmt: skip
def test_the_device_resized_crop_is_torchvisions_antialiased_one(box, size, interpolation):
    """The batched device path averages a shrunk crop as torchvision (and the CPU path) do; a
    plain bilinear sample was up to 46 levels off (aliasing) where the crop shrinks 3x. Its
    bicubic filter is torchvision's too (Keys' a = -0.5, overshoots and all), up 10x or down."""
    torch.manual_seed(0)
    x = torch.nn.functional.avg_pool2d(torch.rand(2, 3, 256, 256) * 255, 3, 1, 1)
    flip = torch.tensor([False, True])
    got = resized_crop_mirror(x, torch.tensor([box] * 2), flip, size, interpolation)
    mode = getattr(T.InterpolationMode, interpolation.upper())
    for i in range(2):
        ref = TF.resized_crop(x[i], *box, [size, size], mode, antialias=True)
        torch.testing.assert_close(got[i], ref.flip(-1) if flip[i] else ref, rtol=0, atol=2e-3)


def test_sample_boxes_follow_torchvisions_rule():
    boxes = sample_boxes(
        4000, 64, 48, (0.08, 1.0), (3 / 4, 4 / 3), torch.Generator().manual_seed(0)
    )
    top, left, h, w = boxes.unbind(1)
    assert (
        (top >= 0).all() and (left >= 0).all() and (top + h <= 64).all() and (left + w <= 48).all()
    )
    area = (h * w).float() / (64 * 48)
    assert area.min() >= 0.07 and area.max() <= 1.0
    img = torch.zeros(1, 64, 48)  # torchvision's own sampler on the same image
    torch.manual_seed(0)
    tv = [T.RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(3000)]
    tv_area = torch.tensor([b[2] * b[3] / (64 * 48) for b in tv])
    assert abs(area.mean() - tv_area.mean()) < 0.03
    assert abs(area.std() - tv_area.std()) < 0.03


@pytest.mark.parametrize("shape", [(100, 20), (20, 100), (50, 60)])
def test_when_no_try_fits_the_box_is_torchvisions_fallback(shape):
    """No try fits (the whole area, a photo far from square): torchvision's centred box of the
    whole image, its aspect clamped to the ratio range; the old rule gave a random square."""
    H, W = shape
    draws = draw_boxes(5, (1.0, 1.0), (3 / 4, 4 / 3), torch.Generator().manual_seed(0))
    draws[:, 10:20] = torch.log(torch.tensor(1.3 if H < W else 0.8))  # never the photo's aspect
    ours = rrc_boxes(draws, H, W, (3 / 4, 4 / 3))
    tv = T.RandomResizedCrop.get_params(torch.zeros(1, H, W), [1.0, 1.0], [3 / 4, 4 / 3])
    if (H, W) == (50, 60):  # 1.2 fits the range: tries of aspect 0.8 don't fit, nor does tv's
        tv = (0, 0, 50, 60)
    assert ours.tolist() == [list(tv)] * 5


def test_the_box_rule_is_torchvisions_to_the_pixel():
    """Each box is what torchvision's RandomResizedCrop.get_params computes from the same random
    numbers (its arithmetic in Python floats, exp in float32), on photos of any size; in
    float32 about 1 box in 10,000 was a pixel off, and 1% of fallbacks of a narrow ratio."""
    g = torch.Generator().manual_seed(0)
    for ratio in ((3 / 4, 4 / 3), (0.9, 1.1)):
        n = 4000
        sizes = torch.randint(1, 5001, (n, 2), generator=g)
        draws = draw_boxes(n, (0.08, 1.0), ratio, g)
        draws[: n // 4, :10] = 1.0  # whole-area tries: many fall back
        got = rrc_boxes(draws, sizes[:, 0], sizes[:, 1], ratio).tolist()
        for (H, W), d, box in zip(sizes.tolist(), draws, got, strict=True):
            assert box == _torchvision_box(H, W, d, ratio), (H, W)


def _torchvision_box(H, W, d, ratio) -> list[int]:
    """torchvision's get_params (0.29), its random numbers taken from `d` (draw_boxes' row)."""
    area = H * W
    for k in range(10):
        target_area = area * d[k].item()
        aspect_ratio = torch.exp(d[10 + k]).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= W and 0 < h <= H:
            return [int(d[20].item() * (H - h + 1)), int(d[21].item() * (W - w + 1)), h, w]
    in_ratio = float(W) / float(H)
    if in_ratio < min(ratio):
        w, h = W, int(round(W / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = H, int(round(H * max(ratio)))
    else:
        w, h = W, H
    return [(H - h) // 2, (W - w) // 2, h, w]


def test_boxes_on_photos_have_torchvisions_aspects_in_the_square():
    """Photos squashed into a square (their sizes known): boxes are drawn on each photo, as
    torchvision draws them, then mapped into the square. In the photo's pixels their aspects
    and areas follow torchvision's on that photo; in the square's they are the photo's aspect
    off (what squashing did), so that resizing the box undoes the squash."""
    n, size, (H, W) = 3000, 256, (300, 600)
    aug = CropAugment(224, "resized", scale=(0.08, 1.0))
    sources = torch.tensor([[H, W]] * n)
    p = aug.sample(n, size, size, torch.Generator().manual_seed(0), sources)
    top, left, h, w = p["boxes"].double().unbind(1)
    assert (top >= 0).all() and (left >= 0).all()
    assert (top + h <= size).all() and (left + w <= size).all()
    aspect = (w * W / size) / (h * H / size)  # in the photo's pixels
    area = (h * H / size) * (w * W / size) / (H * W)
    torch.manual_seed(0)
    tv = [T.RandomResizedCrop.get_params(torch.zeros(1, H, W), [0.08, 1.0], [3 / 4, 4 / 3])
          for _ in range(n)]  # fmt: skip
    tv_aspect = torch.tensor([b[3] / b[2] for b in tv], dtype=torch.float64)
    tv_area = torch.tensor([b[2] * b[3] / (H * W) for b in tv], dtype=torch.float64)
    assert abs(aspect.log().mean() - tv_aspect.log().mean()) < 0.02  # ~0 for both
    assert abs(aspect.log().std() - tv_aspect.log().std()) < 0.02
    assert abs(area.mean() - tv_area.mean()) < 0.02
    square = (w / h).log()  # in the square: shifted by the squash, log(300 / 600)
    assert abs(square.mean() - (tv_aspect.log().mean() + torch.tensor(H / W).log())) < 0.03
    # without sizes, boxes are drawn in the square itself (the photo's aspect lost)
    plain = aug.sample(n, size, size, torch.Generator().manual_seed(0))["boxes"].double()
    assert abs((plain[:, 3] / plain[:, 2]).log().mean()) < 0.02


def test_frame_boxes_map_photo_boxes_into_the_square():
    sources = torch.tensor([[375, 500], [375, 500], [1, 3000], [64, 64]])
    boxes = torch.tensor([[0, 0, 375, 500], [100, 250, 150, 100], [0, 2999, 1, 1], [7, 9, 20, 30]])
    got = frame_boxes(boxes, sources, 256).tolist()
    assert got[0] == [0, 0, 256, 256]  # the whole photo: the whole square
    assert got[1] == [68, 128, 103, 51]  # edges 100 and 250 of 375 rows: 68.3 and 170.7
    assert got[2] == [0, 255, 256, 1]  # at least a pixel, inside the square
    assert got[3] == [28, 36, 80, 120]  # exact at 4x


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
@pytest.mark.parametrize("mean_image", [False, True])
def test_the_cpu_and_device_resized_crops_agree(interpolation, mean_image):
    """The CPU path (uint8, per image) and the device path (float, batched: what train runs on
    CUDA) take the same crops, shrunk or enlarged, with the same filter, to uint8 rounding:
    a bicubic crop's overshoot is clamped to the pixels' range on both (the device's float
    would otherwise run past 255 at an edge, where the CPU's uint8 stops)."""
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(8, 3, 96, 96, generator=g) * 255).to(torch.uint8)
    x[:4, :, 40:] = 255  # a hard edge: bicubic rings past it
    x[:4, :, :40] = 0
    mean = torch.rand(3, 96, 96, generator=g) * 255 if mean_image else torch.tensor([9.0, 5, 7])
    aug = CropAugment(32, "resized", True, mean=mean, scale=(0.08, 1.0),
                      interpolation=interpolation).to(CPU)  # fmt: skip
    p = aug.sample(8, 96, 96, torch.Generator().manual_seed(5))
    device = aug._resized_crops(x, p["boxes"], p["flip"]).div_(aug.std)
    out = aug.train(x, p, out=torch.empty(8, 3, 32, 32))
    assert (out - device).abs().max() <= 1  # uint8 rounding, 0-255 units (std 1 here)
    plain = resized_crop_mirror(x.float(), p["boxes"], p["flip"], 32, interpolation)
    overshoot = (plain.amax() - 255).item(), (-plain.amin()).item()
    assert max(overshoot) > 5 if interpolation == "bicubic" else max(overshoot) < 1e-3


def test_lighting_shift_is_constant_per_image_and_off_at_zero():
    x = batch()
    eigval, eigvec = lighting_from_cov([[900, 100, 50], [100, 800, 60], [50, 60, 700]])
    on = CropAugment(32, "random", False, 0.5, None, None, eigval, eigvec).to(CPU)
    p = on.sample(6, 32, 32, torch.Generator().manual_seed(0))
    diff = on.train(x, p) - x.float()
    assert diff.flatten(2).std(2).max() < 1e-3 and diff.abs().max() > 1  # one shift per image
    off = CropAugment(32, "random", False, 0.0).to(CPU)
    torch.testing.assert_close(off.train(x, off.sample(6, 32, 32, torch.Generator())), x.float())


def test_lighting_eigen_decomposition():
    cov = torch.tensor([[900.0, 100, 50], [100, 800, 60], [50, 60, 700]])
    eigval, eigvec = lighting_from_cov(cov.tolist())
    torch.testing.assert_close(eigvec @ torch.diag(eigval * 255) @ eigvec.T, cov, rtol=1e-4,
                               atol=1e-2)  # fmt: skip
    assert eigval[0] >= eigval[1] >= eigval[2]


def test_lighting_from_packed_stats_matches_imagenet_constants():
    """A packed set with ImageNet's colour covariance lights images as the folder path does."""
    ref_val, ref_vec = imagenet_lighting()
    cov_01 = ref_vec @ torch.diag(torch.tensor(IMAGENET_EIGVAL)) @ ref_vec.T
    eigval, eigvec = lighting_from_cov((cov_01 * 255**2).tolist())
    torch.testing.assert_close(eigval, ref_val, rtol=2e-3, atol=1e-3)
    torch.testing.assert_close(eigvec.abs(), ref_vec.abs(), rtol=0, atol=2e-3)  # signs are free
