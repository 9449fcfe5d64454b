"""RandAugment, TrivialAugment-Wide, AutoAugment's ImageNet policy and AugMix on a uint8 batch
on its device, every image with draws of its own (as torchvision's transforms draw image by
image, and timm's), in whole-batch ops.

Each op computes what torchvision.transforms.v2.functional computes for one uint8 image given
the same parameter (tests/test_train_policy.py compares them op by op); the geometric ops
resample bilinearly, as torchvision's reference scripts ask of every policy. torchvision's ops take
one parameter for all the images they are given, and on a GPU each affine op and sharpness
copies its matrix or kernel to the device with a host wait: some 45 waits per step at batch
256, each stopping the CPU from running ahead of the GPU. Here the draws are made on the host,
sent in one non-blocking copy per round, and the images sorted by the op they drew, so each op
runs once per round on its share of the batch and the step never waits.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

OPS = ("identity", "shear_x", "shear_y", "translate_x", "translate_y", "rotate", "brightness",
       "color", "contrast", "sharpness", "posterize", "solarize", "autocontrast", "equalize",
       "invert")  # fmt: skip
GEOMETRIC = range(1, 6)  # shear_x .. rotate: one affine resampling
SIGNED = frozenset(range(1, 10))  # a magnitude drawn + or - with equal chance
BINS = 31  # magnitude levels of RandAugment and TrivialAugment (torchvision's num_magnitude_bins)
PARAMS = 9  # per image: the affine grid's 6 numbers, a blend's ratio and 1 - ratio, a level


@dataclass(frozen=True)
class Space:
    """A policy's ops and magnitude ranges (the RandAugment, TrivialAugment and AutoAugment
    papers', as torchvision states them): magnitude bin b of 0..bins-1 is b / (bins - 1) of the
    range."""

    rounds: int  # ops applied one after another to each image
    bin: int | None  # the magnitude bin of every op (RandAugment), None: drawn per image
    shear: float  # tan of the shear angle
    translate: float | None  # pixels (None: side_share of the side)
    rotate: float  # degrees
    colour: float  # brightness, colour, contrast, sharpness: factor 1 +- this
    posterize: float  # bits taken off `bits` at the top bin
    bins: int = BINS
    ops: tuple[int, ...] = tuple(range(OPS.index("invert")))  # drawn from (no invert)
    side_share: float = 150.0 / 331.0  # the largest translation without `translate`
    bits: int = 8  # posterize's bits kept at bin 0
    # the geometric ops' sampling: bilinear, as torchvision's reference scripts ask of every
    # policy (its classes' default: nearest) and timm's
    resample: str = "bilinear"

    def magnitudes(self, op: int, h: int, w: int) -> torch.Tensor:
        """The magnitudes of op's bins (float32, as torchvision's linspace makes them)."""
        name, n = OPS[op], self.bins
        top = {"shear_x": self.shear, "shear_y": self.shear, "rotate": self.rotate,
               "translate_x": self.translate or self.side_share * w,
               "translate_y": self.translate or self.side_share * h}.get(name, self.colour)  # fmt: skip
        if name == "posterize":
            return (self.bits - torch.arange(n) / ((n - 1) / self.posterize)).round().int().float()
        if name == "solarize":
            return torch.linspace(1.0, 0.0, n)
        return torch.linspace(0.0, top, n)


RANDAUGMENT = Space(rounds=2, bin=9, shear=0.3, translate=None, rotate=30.0, colour=0.9,
                    posterize=4)  # fmt: skip
TRIVIALAUGMENT = Space(rounds=1, bin=None, shear=0.99, translate=32.0, rotate=135.0, colour=0.99,
                       posterize=6)  # fmt: skip
AUTOAUGMENT = Space(rounds=2, bin=None, shear=0.3, translate=None, rotate=30.0, colour=0.9,
                    posterize=4, bins=10)  # fmt: skip
# AugMix (Hendrycks et al. 2020) as torchvision's defaults: severity 3 (bins 0-2 of 10), 3
# chains of 1-3 ops each (no identity, no invert), bilinear geometric ops, mixed by Dirichlet(1)
# weights and then with the image by a Beta(1, 1) share
AUGMIX = Space(rounds=3, bin=None, shear=0.3, translate=None, rotate=30.0, colour=0.9,
               posterize=4, bins=10, ops=tuple(range(1, OPS.index("invert"))), side_share=1 / 3,
               bits=4)  # fmt: skip
SEVERITY, CHAINS = 3, 3
SPACES = {"randaugment": RANDAUGMENT, "trivialaugment": TRIVIALAUGMENT,
          "autoaugment": AUTOAUGMENT, "augmix": AUGMIX}  # fmt: skip

# AutoAugment's ImageNet policy (Cubuk et al. 2019, its appendix): 25 sub-policies of two
# (op, probability, magnitude bin of 10) steps; an image draws one, each step applied with
# its probability. A bin of None: an op without a magnitude.
IMAGENET_POLICY = (
    (("posterize", 0.4, 8), ("rotate", 0.6, 9)), (("solarize", 0.6, 5), ("autocontrast", 0.6, None)),
    (("equalize", 0.8, None), ("equalize", 0.6, None)), (("posterize", 0.6, 7), ("posterize", 0.6, 6)),
    (("equalize", 0.4, None), ("solarize", 0.2, 4)), (("equalize", 0.4, None), ("rotate", 0.8, 8)),
    (("solarize", 0.6, 3), ("equalize", 0.6, None)), (("posterize", 0.8, 5), ("equalize", 1.0, None)),
    (("rotate", 0.2, 3), ("solarize", 0.6, 8)), (("equalize", 0.6, None), ("posterize", 0.4, 6)),
    (("rotate", 0.8, 8), ("color", 0.4, 0)), (("rotate", 0.4, 9), ("equalize", 0.6, None)),
    (("equalize", 0.0, None), ("equalize", 0.8, None)), (("invert", 0.6, None), ("equalize", 1.0, None)),
    (("color", 0.6, 4), ("contrast", 1.0, 8)), (("rotate", 0.8, 8), ("color", 1.0, 2)),
    (("color", 0.8, 8), ("solarize", 0.8, 7)), (("sharpness", 0.4, 7), ("invert", 0.6, None)),
    (("shear_x", 0.6, 5), ("equalize", 1.0, None)), (("color", 0.4, 0), ("equalize", 0.6, None)),
    (("equalize", 0.4, None), ("solarize", 0.2, 4)), (("solarize", 0.6, 5), ("autocontrast", 0.6, None)),
    (("invert", 0.6, None), ("equalize", 1.0, None)), (("color", 0.6, 4), ("contrast", 1.0, 8)),
    (("equalize", 0.8, None), ("equalize", 0.6, None)),
)  # fmt: skip


def augment(images: torch.Tensor, policy: str, magnitude: int = 9,
            num_ops: int = 2) -> torch.Tensor:  # fmt: skip
    """uint8 (B, C, H, W) on any device -> the batch with `policy` applied to each image, its
    ops and magnitudes its own (drawn from torch's CPU generator, which checkpoints keep);
    RandAugment's `magnitude` bin (0..BINS-1) and `num_ops`."""
    space = SPACES[policy]
    if policy == "randaugment":
        space = replace(space, rounds=num_ops, bin=magnitude)
    B = len(images)
    if B == 0:
        return images
    if policy == "augmix":
        return _augmix(images, space)
    if policy == "autoaugment":
        ops, bins = _imagenet_policy(B)
    else:
        ops = torch.tensor(space.ops)[torch.randint(len(space.ops), (space.rounds, B))]
        bins = torch.randint(space.bins, (space.rounds, B)) if space.bin is None else None
    return _rounds(images, space, ops, bins)


def _rounds(images: torch.Tensor, space: Space, ops: torch.Tensor,
            bins: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """Round r gives image i op ops[r, i] at magnitude bin bins[r, i] (space.bin where None),
    its sign drawn for a signed op."""
    rounds, B = ops.shape
    flips = torch.rand(rounds, B) <= 0.5
    H, W = images.shape[-2:]
    table = torch.stack([space.magnitudes(k, H, W) for k in range(len(OPS))]).double()
    signed = torch.tensor([k in SIGNED for k in range(len(OPS))])
    for r in range(rounds):
        b = bins[r] if bins is not None else torch.full((B,), space.bin)
        magnitude = table[ops[r], b]
        magnitude = torch.where(signed[ops[r]] & flips[r], -magnitude, magnitude)
        images = apply(images, ops[r], magnitude, space.resample)
    return images


def _augmix(images: torch.Tensor, space: Space) -> torch.Tensor:
    """AugMix: CHAINS chains of 1-3 ops from `space` per image (bins under SEVERITY), mixed by
    Dirichlet weights, then with the image itself by a Beta share; truncated to uint8 as
    torchvision's."""
    B = len(images)
    share = torch.distributions.Dirichlet(torch.ones(B, 2)).sample()  # image, chains
    mixing = torch.distributions.Dirichlet(torch.ones(B, CHAINS)).sample() * share[:, 1:]
    weights = _to(torch.cat([share[:, :1], mixing], 1), images.device)  # (B, 1 + CHAINS)
    mix = images.float() * weights[:, 0].view(B, 1, 1, 1)
    for chain in range(CHAINS):
        depth = torch.randint(1, 4, (B,))
        ops = torch.tensor(space.ops)[torch.randint(len(space.ops), (space.rounds, B))]
        ops = torch.where(torch.arange(space.rounds)[:, None] < depth, ops, 0)  # then identity
        bins = torch.randint(SEVERITY, (space.rounds, B))
        mix.add_(weights[:, chain + 1].view(B, 1, 1, 1) * _rounds(images, space, ops, bins))
    return mix.to(torch.uint8)


def _imagenet_policy(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(2, n) ops and magnitude bins of AutoAugment's ImageNet policy: a sub-policy per image,
    each step the identity where its probability does not draw it."""
    steps = [[(OPS.index(op), p, b or 0) for op, p, b in sub] for sub in IMAGENET_POLICY]
    table = torch.tensor(steps, dtype=torch.float64)  # (25, 2, 3): op, probability, bin
    chosen = table[torch.randint(len(IMAGENET_POLICY), (n,))].transpose(0, 1)  # (2, n, 3)
    taken = torch.rand(2, n, dtype=torch.float64) <= chosen[..., 1]
    return torch.where(taken, chosen[..., 0], 0).long(), chosen[..., 2].long()


def apply(images: torch.Tensor, ops: torch.Tensor, magnitudes: torch.Tensor,
          resample: str = "nearest") -> torch.Tensor:  # fmt: skip
    """One round: image i given OPS[ops[i]] at magnitudes[i] (CPU tensors: int64, float64); the
    geometric ops sample `resample` (nearest, or bilinear)."""
    if not len(images) or not ops.any():  # (nothing drawn but the identity: no copies)
        return images
    order = torch.argsort(ops, stable=True)  # the batch sorted by op, and back
    counts = torch.bincount(ops, minlength=len(OPS)).tolist()
    params = _to(image_params(ops[order], magnitudes[order], *images.shape[-2:]), images.device)
    order, back = _to(torch.stack([order, torch.argsort(order)]), images.device)
    x = images.index_select(0, order)
    pieces, start = [], 0
    for group in GROUPS:
        n = sum(counts[op] for op in group)
        if n:
            op, part, p = _OP[group[0]], x[start : start + n], params[start : start + n]
            pieces.append(_affine(part, p, resample) if op is _affine else op(part, p))
        start += n
    return torch.cat(pieces).index_select(0, back)


def image_params(ops: torch.Tensor, magnitudes: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, PARAMS) float32 on the host: what each image's op needs, computed from its magnitude
    as torchvision computes it (in float64, then float32)."""
    out = torch.zeros(len(ops), PARAMS, dtype=torch.float64)
    m = magnitudes.double()
    out[:, 6], out[:, 7] = 1.0 + m, 1.0 - (1.0 + m)  # a blend's ratio and 1 - ratio
    posterize, solarize = ops == OPS.index("posterize"), ops == OPS.index("solarize")
    bits = m[posterize].int()  # 0..8: the bits kept, as a mask of the top ones
    out[posterize, 8] = (((1 << bits) - 1) << (8 - bits)).double()
    # the threshold: a pixel at or over 255 m (float32, as torchvision compares) is inverted
    out[solarize, 8] = (255.0 * m[solarize]).float().ceil().double()
    geometric = [i for i, op in enumerate(ops.tolist()) if op in GEOMETRIC]
    if geometric:
        maps = [_inverse_affine(OPS[int(ops[i])], float(m[i]), h, w) for i in geometric]
        out[geometric, :6] = _grid_maps(torch.tensor(maps), h, w)
    return out.float()


def _inverse_affine(op: str, m: float, h: int, w: int) -> list[float]:
    """Where each output pixel is read from (x_in = a x + b y + c, y_in = d x + e y + f, about
    the image's centre: [a, b, c, d, e, f]) under torchvision's op at magnitude m: a shear by
    the angle atan(m) about the top-left corner, a whole-pixel translation, a rotation by m
    degrees about the centre."""
    angle, shear, centre, shift = 0.0, (0.0, 0.0), (0.0, 0.0), (0.0, 0.0)
    if op in ("shear_x", "shear_y"):
        degrees = math.degrees(math.atan(m))
        shear = (degrees, 0.0) if op == "shear_x" else (0.0, degrees)
        centre = (-w * 0.5, -h * 0.5)
    elif op == "translate_x":
        shift = (float(int(m)), 0.0)
    elif op == "translate_y":
        shift = (0.0, float(int(m)))
    else:  # rotate: torchvision's turns the other way to its affine's angle
        angle = -m
    return _inverse_map(angle, shear, centre, shift)


def _inverse_map(angle: float, shear: tuple[float, float], centre: tuple[float, float],
                 shift: tuple[float, float]) -> list[float]:  # fmt: skip
    """The inverse of: rotate by `angle` and shear by `shear` (degrees) about `centre`, then
    shift; the same float64 steps as torchvision's affine takes."""
    rot, sx, sy = math.radians(angle), math.radians(shear[0]), math.radians(shear[1])
    cx, cy = centre
    px, py = cx + shift[0], cy + shift[1]
    a = math.cos(rot - sy) / math.cos(sy)
    b = -(a * math.tan(sx) + math.sin(rot))
    c = math.sin(rot - sy) / math.cos(sy)
    d = math.cos(rot) - c * math.tan(sx)
    m = [d, -b, 0.0, -c, a, 0.0]  # the rotation-shear's inverse (its determinant is 1)
    m[2] += cx - m[0] * px - m[1] * py
    m[5] += cy - m[3] * px - m[4] * py
    return m


def _grid_maps(maps: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(n, 6) maps as grid_sample's normalised coordinates take them: each (3, 2), transposed,
    its columns divided by half the side (float32, as torchvision divides)."""
    theta = maps.float().view(-1, 2, 3).transpose(1, 2)
    return (theta / torch.tensor([0.5 * w, 0.5 * h])).reshape(-1, 6).double()


def _to(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting: page-locked, then copied non-blocking."""
    if device.type != "cuda":
        return x
    return x.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=8)
def _centres(h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The output pixels' centres about the image's centre: x (1, 1, w) and y (1, h, 1)."""
    x = torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w, device=device)
    y = torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h, device=device)
    return x.view(1, 1, w), y.view(1, h, 1)


def _affine(x: torch.Tensor, p: torch.Tensor, resample: str = "nearest") -> torch.Tensor:
    """Nearest-neighbour (or bilinear) resampling of each image through its map, zeros outside.
    The grid is made elementwise, not by a matrix product as torchvision's: one in TF32 (a
    run's GPU matmuls) would move it by up to a tenth of a pixel."""
    n, _, h, w = x.shape
    cx, cy = _centres(h, w, x.device)
    t = [p[:, k].view(n, 1, 1) for k in range(6)]  # (3, 2) row-major: x, y, 1 -> gx, gy
    grid = torch.stack([cx * t[0] + cy * t[2] + t[4], cx * t[1] + cy * t[3] + t[5]], -1)
    out = F.grid_sample(x.float(), grid, mode=resample, padding_mode="zeros",
                        align_corners=False)  # fmt: skip
    return out.round_().to(torch.uint8)


def _column(p: torch.Tensor, k: int) -> torch.Tensor:
    return p[:, k].view(-1, 1, 1, 1)


def _blend(x: torch.Tensor, other: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """ratio * x + (1 - ratio) * other, clamped and truncated to uint8 (torchvision's _blend)."""
    out = x.float().mul_(_column(p, 6)).add_(other * _column(p, 7))
    return out.clamp_(0, 255).to(torch.uint8)


def _grey(x: torch.Tensor) -> torch.Tensor:
    """(n, 1, H, W) float luma, floored, as torchvision's colour ops take it for uint8."""
    if x.shape[1] == 1:
        return x.float()
    r, g, b = x.unbind(1)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).floor_().unsqueeze(1)


def _identity(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return x


def _brightness(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return x.float().mul_(_column(p, 6)).clamp_(0, 255).to(torch.uint8)


def _color(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return x if x.shape[1] == 1 else _blend(x, _grey(x), p)


def _contrast(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return _blend(x, _grey(x).mean(dim=(-3, -2, -1), keepdim=True), p)


@functools.lru_cache(maxsize=8)
def _smoothing(channels: int, device: torch.device) -> torch.Tensor:
    """PIL's SMOOTH kernel times 13 (1s around a 5), one per channel: whole numbers, so the
    sums are exact in float32 and in TF32 alike (a GPU's convolutions), and one division by 13
    rounds as torchvision's kernel of thirteenths does (a thirteenth is never a half)."""
    kernel = torch.ones(3, 3)
    kernel[1, 1] = 5.0
    return _to(kernel.expand(channels, 1, 3, 3).contiguous(), device)


def _sharpness(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Blend with the smoothed image, inside a one-pixel border kept as it is."""
    if x.shape[-1] <= 2 or x.shape[-2] <= 2:
        return x
    out = x.float().contiguous(memory_format=torch.channels_last)  # (5x faster on a CPU)
    blurred = F.conv2d(out, _smoothing(x.shape[1], x.device), groups=x.shape[1])
    blurred = blurred.div_(13).round_()
    inner = out[..., 1:-1, 1:-1]
    inner.add_(blurred.sub_(inner).mul_(_column(p, 7)))
    return out.clamp_(0, 255).to(torch.uint8)


def _posterize(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return x.bitwise_and(_column(p, 8).to(torch.uint8))


def _solarize(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= _column(p, 8).to(torch.uint8), 255 - x, x)


def _autocontrast(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Each channel stretched to 0..255 (one of a single value left as it is)."""
    f = x.float()
    low, high = f.amin(dim=(-2, -1), keepdim=True), f.amax(dim=(-2, -1), keepdim=True)
    flat = high == low
    scale = torch.where(flat, 1.0, (high - low).mul_(1.0 / 255))
    low = torch.where(flat, 0.0, low)
    return f.sub_(low).div_(scale).clamp_(0, 255).to(torch.uint8)


def _invert(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return 255 - x


def _equalize(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    from torchvision.transforms.v2 import functional as TF

    return TF.equalize(x)  # batched, per image and channel, without a host wait


_OP = dict(enumerate((_identity, _affine, _affine, _affine, _affine, _affine, _brightness, _color,
                      _contrast, _sharpness, _posterize, _solarize, _autocontrast, _equalize,
                      _invert)))  # fmt: skip
GROUPS = [(0,), tuple(GEOMETRIC), *((op,) for op in range(GEOMETRIC[-1] + 1, len(OPS)))]
