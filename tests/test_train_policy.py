"""RandAugment and TrivialAugment-Wide, batched with a draw per image (train/policy.py), against
torchvision.transforms.v2.functional applied to one image at a time with the same parameter."""

from __future__ import annotations

import math

import pytest
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from cnnkit.train.policy import (
    AUGMIX,
    AUTOAUGMENT,
    IMAGENET_POLICY,
    OPS,
    RANDAUGMENT,
    SIGNED,
    TRIVIALAUGMENT,
    _imagenet_policy,
    apply,
    augment,
)


def _photos(n: int, h: int, w: int) -> torch.Tensor:
    """n crops of scikit-image's bundled colour photos, uint8 (n, 3, h, w)."""
    from skimage import data

    sources = [torch.from_numpy(f()).permute(2, 0, 1) for f in (data.astronaut, data.coffee,
                                                                  data.chelsea)]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        photo = sources[i % len(sources)]
        top = int(torch.randint(photo.shape[1] - 4 * h, (1,), generator=g))
        left = int(torch.randint(photo.shape[2] - 4 * w, (1,), generator=g))
        out.append(photo[:, top : top + 4 * h : 4, left : left + 4 * w : 4])
    images = torch.stack(out).contiguous()
    images[-1] = 77  # a flat image: autocontrast and equalize leave it alone
    return images


def _torchvision(image: torch.Tensor, op: str, m: float) -> torch.Tensor:
    """torchvision's v2 op, as its RandAugment and TrivialAugmentWide apply it to one image."""
    near = InterpolationMode.NEAREST
    if op == "identity":
        return image
    if op in ("shear_x", "shear_y"):
        degrees = math.degrees(math.atan(m))
        shear = [degrees, 0.0] if op == "shear_x" else [0.0, degrees]
        return TF.affine(image, angle=0.0, translate=[0, 0], scale=1.0, shear=shear,
                         interpolation=near, center=[0, 0])  # fmt: skip
    if op in ("translate_x", "translate_y"):
        shift = [int(m), 0] if op == "translate_x" else [0, int(m)]
        return TF.affine(image, angle=0.0, translate=shift, scale=1.0, shear=[0.0, 0.0],
                         interpolation=near)  # fmt: skip
    if op == "rotate":
        return TF.rotate(image, angle=m, interpolation=near)
    colour = {"brightness": TF.adjust_brightness, "color": TF.adjust_saturation,
              "contrast": TF.adjust_contrast, "sharpness": TF.adjust_sharpness}  # fmt: skip
    if op in colour:
        return colour[op](image, 1.0 + m)
    if op == "posterize":
        return TF.posterize(image, int(m))
    if op == "solarize":
        return TF.solarize(image, 255.0 * m)
    if op == "invert":
        return TF.invert(image)
    return TF.autocontrast(image) if op == "autocontrast" else TF.equalize(image)


def _magnitudes(space, op: int, n: int, h: int, w: int, g: torch.Generator) -> torch.Tensor:
    """n magnitudes of op from the space, every bin and sign in turn (float64)."""
    table = space.magnitudes(op, h, w).double()
    m = table[torch.randint(space.bins, (n,), generator=g)]
    if op in SIGNED:
        m = torch.where(torch.rand(n, generator=g) < 0.5, -m, m)
    return m


BLENDS = {"brightness", "color", "contrast", "sharpness"}


@pytest.mark.parametrize("shape", [(36, 36), (30, 44)], ids=["square", "wide"])
@pytest.mark.parametrize("op", OPS)
def test_each_op_is_torchvisions_with_a_magnitude_per_image(op, shape):
    """Every image of the batch its own magnitude (each bin and sign of TrivialAugment's wide
    ranges, which hold RandAugment's), against torchvision's op on that image alone. The
    blends add with one rounding fewer or more than torchvision's fused add: a pixel now and then
    lands one level off; everything else is equal."""
    h, w = shape
    images = _photos(24, h, w)
    g = torch.Generator().manual_seed(OPS.index(op))
    ops = torch.full((24,), OPS.index(op))
    m = _magnitudes(TRIVIALAUGMENT, OPS.index(op), 24, h, w, g)
    if op == "rotate":
        m[:4] = torch.tensor([90.0, -90.0, 0.0, 45.0])  # torchvision's rot90 and clone paths
    ours = apply(images, ops, m)
    theirs = torch.stack([_torchvision(images[i], op, float(m[i])) for i in range(24)])
    assert ours.dtype == torch.uint8 and ours.shape == images.shape
    diff = (ours.int() - theirs.int()).abs()
    if op in BLENDS:
        assert diff.max() <= 1 and (diff > 0).float().mean() < 0.002
    else:
        assert torch.equal(ours, theirs)


def test_a_batch_of_mixed_ops_is_each_image_given_its_own():
    images = _photos(40, 32, 32)
    g = torch.Generator().manual_seed(1)
    ops = torch.randint(len(OPS), (40,), generator=g)
    m = torch.stack([_magnitudes(RANDAUGMENT, int(k), 1, 32, 32, g)[0] for k in ops])
    ours = apply(images, ops, m)
    for i in range(40):
        theirs = _torchvision(images[i], OPS[ops[i]], float(m[i]))
        assert (ours[i].int() - theirs.int()).abs().max() <= (1 if OPS[ops[i]] in BLENDS else 0)


NAMES = {
    "ShearX": "shear_x",
    "ShearY": "shear_y",
    "TranslateX": "translate_x",
    "TranslateY": "translate_y",
}  # torchvision's op names, ours (the rest: lower case)


def test_the_ops_and_magnitudes_are_torchvisions():
    """Each policy's ops and their levels equal those of torchvision's RandAugment,
    TrivialAugmentWide, AutoAugment and AugMix."""
    for theirs, ours in ((v2.RandAugment, RANDAUGMENT), (v2.TrivialAugmentWide, TRIVIALAUGMENT),
                         (v2.AutoAugment, AUTOAUGMENT), (v2.AugMix, AUGMIX)):  # fmt: skip
        space = theirs._AUGMENTATION_SPACE
        drawn = {OPS[k] for k in ours.ops} if ours is not AUTOAUGMENT else set(OPS) - {"identity"}
        assert {NAMES.get(k, k.lower()) for k in space} == drawn
        for name, (levels, signed) in space.items():
            op = OPS.index(NAMES.get(name, name.lower()))
            assert signed == (op in SIGNED)
            table = levels(ours.bins, 30, 44)
            if table is not None:
                torch.testing.assert_close(
                    ours.magnitudes(op, 30, 44), table.float(), rtol=0, atol=0
                )


def test_autoaugment_is_the_imagenet_policy_drawn_per_image():
    """The 25 sub-policies are torchvision's ImageNet ones; an image draws one, and each step
    is applied with its probability (the identity where it is not)."""
    theirs = v2.AutoAugment()._policies
    assert [tuple((NAMES.get(n, n.lower()), p, b) for n, p, b in sub) for sub in theirs] == [
        tuple(sub) for sub in IMAGENET_POLICY]  # fmt: skip
    torch.manual_seed(0)
    ops, _ = _imagenet_policy(40000)
    skipped = sum(2 - p1 - p2 for (_, p1, _), (_, p2, _) in IMAGENET_POLICY) / 25 / 2
    assert (ops == 0).double().mean() == pytest.approx(skipped, abs=0.01)
    invert = sum((a == "invert") * p1 + (b == "invert") * p2
                 for (a, p1, _), (b, p2, _) in IMAGENET_POLICY) / 25 / 2  # fmt: skip
    assert (ops == OPS.index("invert")).double().mean() == pytest.approx(invert, abs=0.005)
    images = _photos(32, 24, 24)
    out = augment(images, "autoaugment")
    assert out.shape == images.shape and (out != images).flatten(1).any(1).float().mean() > 0.5


@pytest.mark.parametrize("policy", ["randaugment", "trivialaugment", "autoaugment", "augmix"])
def test_a_policy_draws_per_image_from_torchs_generator(policy):
    images = _photos(64, 24, 24)
    torch.manual_seed(3)
    once = augment(images, policy)
    torch.manual_seed(3)
    assert torch.equal(augment(images, policy), once)  # a resumed run repeats it
    changed = (once != images).flatten(1).any(1)
    assert 0.6 < changed.float().mean() <= 1.0
    if policy != "augmix":  # (which mixes every image with its chains)
        assert changed.float().mean() < 1.0  # identity and no-op draws leave a few alone
    assert augment(images[:0], policy).shape == (0, 3, 24, 24)


def test_grey_images_take_the_policies():
    images = _photos(16, 20, 20)[:, :1].contiguous()
    torch.manual_seed(0)
    for policy in ("randaugment", "trivialaugment", "autoaugment", "augmix"):
        out = augment(images, policy)
        assert out.shape == images.shape and out.dtype == torch.uint8
    for op in ("color", "contrast", "sharpness", "autocontrast"):
        m = torch.full((16,), 0.5, dtype=torch.float64)
        theirs = torch.stack([_torchvision(images[i], op, 0.5) for i in range(16)])
        diff = (apply(images, torch.full((16,), OPS.index(op)), m).int() - theirs.int()).abs()
        assert diff.max() <= 1


def test_randaugments_magnitude_and_ops_are_settings():
    """data.magnitude (torchvision's --ra-magnitude) and data.num_ops (timm's n2): at magnitude 0
    the ops change nothing but a few levels' pixels; more ops, more draws."""
    from cnnkit.config import load_run
    from cnnkit.data import data_config
    from cnnkit.errors import ConfigError

    images = _photos(64, 24, 24)
    torch.manual_seed(0)
    still = (augment(images, "randaugment", magnitude=0) != images).float().mean()
    strong = (augment(images, "randaugment", magnitude=30) != images).float().mean()
    assert still < 0.2 * strong
    state = torch.get_rng_state()
    augment(images, "randaugment", num_ops=3)
    three = torch.get_rng_state()
    torch.set_rng_state(state)
    augment(images, "randaugment", num_ops=1)
    assert not torch.equal(three, torch.get_rng_state())
    section = {"source": "synthetic", "shape": [3, 8, 8], "num_classes": 2}
    with pytest.raises(ConfigError, match="magnitude"):
        data_config({**section, "magnitude": 31})
    notes = data_config({**section, "magnitude": 5, "policy": "trivialaugment"}).training_notes()
    assert notes == ["data.magnitude not used: RandAugment's (data.policy: randaugment), and "
                     "the policy is trivialaugment"]  # fmt: skip
    assert data_config({**section, "magnitude": 5, "policy": "randaugment"}).training_notes() == []
    dumped = data_config(section).model_dump()  # a run's config.yaml: every field written
    assert data_config(dumped).training_notes() == []
    with pytest.raises(ConfigError, match=r"did you mean 'magnitude'\?"):
        load_run("digits", ["data.ra_magnitude=5"])


@pytest.mark.parametrize("op", ["shear_x", "shear_y", "translate_x", "translate_y", "rotate"])
def test_augmixs_geometric_ops_are_torchvisions_bilinear_ones(op):
    """AugMix resamples bilinearly (torchvision's AugMix default), its own magnitudes."""
    images = _photos(24, 30, 44)
    g = torch.Generator().manual_seed(2)
    m = _magnitudes(AUGMIX, OPS.index(op), 24, 30, 44, g)
    ours = apply(images, torch.full((24,), OPS.index(op)), m, resample="bilinear")
    bilinear = InterpolationMode.BILINEAR
    theirs = []
    for i in range(24):
        k = float(m[i])
        if op in ("shear_x", "shear_y"):
            d = math.degrees(math.atan(k))
            shear = [d, 0.0] if op == "shear_x" else [0.0, d]
            theirs.append(TF.affine(images[i], angle=0.0, translate=[0, 0], scale=1.0,
                                    shear=shear, interpolation=bilinear, center=[0, 0]))  # fmt: skip
        elif op == "rotate":
            theirs.append(TF.rotate(images[i], angle=k, interpolation=bilinear))
        else:
            shift = [int(k), 0] if op == "translate_x" else [0, int(k)]
            theirs.append(TF.affine(images[i], angle=0.0, translate=shift, scale=1.0,
                                    shear=[0.0, 0.0], interpolation=bilinear))  # fmt: skip
    diff = (ours.int() - torch.stack(theirs).int()).abs()
    # a level off on a few pixels: float rounding at .5 (0.25% on a Xeon with AMX, shear_y)
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.005


def test_augmix_mixes_its_chains_with_the_image_by_dirichlet_weights(monkeypatch):
    """The image's share and the chains' weights (Dirichlet(1) draws, summing to 1) mix the
    image with its chains, truncated to uint8 as torchvision's AugMix; each chain 1-3 ops."""
    import cnnkit.train.policy as policy

    images = _photos(16, 20, 20)
    chains = []

    def chain(x, space, ops, bins):
        chains.append((ops != 0).sum(0))  # ops per image in this chain
        return 255 - x

    monkeypatch.setattr(policy, "_rounds", chain)
    torch.manual_seed(4)
    out = augment(images, "augmix")
    torch.manual_seed(4)
    share = torch.distributions.Dirichlet(torch.ones(16, 2)).sample()
    mixing = torch.distributions.Dirichlet(torch.ones(16, 3)).sample() * share[:, 1:]
    expected = images.float() * share[:, :1, None, None] + (255 - images).float() * mixing.sum(
        1
    ).view(16, 1, 1, 1)
    assert (out.int() - expected.to(torch.uint8).int()).abs().max() <= 1
    depths = torch.stack(chains)
    assert len(chains) == 3 and depths.min() >= 1 and depths.max() <= 3


def test_torchvisions_policy_names_are_taken_and_timms_strings_answered():
    from cnnkit.data import data_config
    from cnnkit.errors import ConfigError

    section = {"source": "synthetic", "shape": [3, 8, 8], "num_classes": 2}
    for theirs, ours in (("ra", "randaugment"), ("ta_wide", "trivialaugment"),
                         ("imagenet", "autoaugment"), ("augmix", "augmix")):  # fmt: skip
        assert data_config({**section, "policy": theirs}).policy == ours
    with pytest.raises(ConfigError, match=r"'rand-m9-n3-mstd0.5' is timm's way of naming a "
                       r"policy; the closest here: data.policy=randaugment data.magnitude=27 "
                       r"data.num_ops=3 \(timm's magnitudes are of 10"):  # fmt: skip
        data_config({**section, "policy": "rand-m9-n3-mstd0.5"})
    with pytest.raises(ConfigError, match=r"the closest here: data.policy=augmix \("):
        data_config({**section, "policy": "augmix-m5-w4-d2"})
    answers = {  # timm's magnitude left out is its 10 of 10, torchvision's 30
        "rand-n3": "data.policy=randaugment data.magnitude=30 data.num_ops=3 (",
        "original-mstd0.5": "data.policy=autoaugment (the same ImageNet policy)",
        "v0r": "data.policy=autoaugment (the ImageNet policy, of which timm's v0 is",
        "3a": "3-Augment (DeiT III: grey, solarize or blur per image) is not one here",
    }
    for timms, answer in answers.items():
        with pytest.raises(ConfigError) as e:
            data_config({**section, "policy": timms})
        assert answer in str(e.value) and ("of 30" in str(e.value)) == timms.startswith("rand")
