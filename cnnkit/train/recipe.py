"""Modern recipe pieces applied to the training batch on its device, after the loader:
RandAugment / TrivialAugment / AutoAugment / AugMix (train/policy.py: torchvision's ops, a
draw per image, batched), random erasing (per image, one batched op), mixup / cutmix
(torchvision.transforms.v2, soft labels); and the exponential moving average of the weights
(torch.optim.swa_utils' AveragedModel, updated without a device sync).

Every random draw comes from torch's generators, whose states checkpoints keep: a resumed
run repeats its augmentations exactly.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch
import torch.optim.swa_utils
from torch import nn


@dataclass(frozen=True)
class BatchRecipe:
    """What `data:` asks for beyond crops and mirrors (all off by default)."""

    policy: str = "none"  # none | randaugment | trivialaugment | autoaugment | augmix
    magnitude: int = 9  # RandAugment's bin of 0..30
    num_ops: int = 2  # RandAugment's ops per image
    erasing: float = 0.0  # probability of erasing a random box of each image
    mixup: float = 0.0  # Beta(alpha, alpha) of mixup (0: off)
    cutmix: float = 0.0  # Beta(alpha, alpha) of cutmix (0: off); with mixup, one per batch
    mean: tuple[float, ...] = (0.0,)  # the stream's normalisation, 0-255 units
    std: tuple[float, ...] = (255.0,)

    @property
    def active(self) -> bool:
        return self.policy != "none" or bool(self.erasing or self.mixup or self.cutmix)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple:
        """A normalised float batch (B, C, H, W) and int64 labels -> the augmented batch and
        labels (soft (B, K) ones when mixing)."""
        if self.policy != "none":
            x = self._policy(x)
        if self.erasing:
            x = random_erasing(x, self.erasing)
        if self.mixup or self.cutmix:
            x, y = self._mix(x, y, num_classes)
        return x, y

    def _policy(self, x: torch.Tensor) -> torch.Tensor:
        """RandAugment / TrivialAugment on uint8 images: un-normalise, augment, normalise."""
        from cnnkit.train.policy import augment

        mean, std = _column(tuple(self.mean), x.device), _column(tuple(self.std), x.device)
        images = (x * std + mean).round_().clamp_(0, 255).to(torch.uint8)
        images = augment(images, self.policy, self.magnitude, self.num_ops)
        return (images.float() - mean) / std

    def _mix(self, x: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple:
        from torchvision.transforms import v2

        ops = []
        if self.mixup:
            ops.append(v2.MixUp(alpha=self.mixup, num_classes=num_classes))
        if self.cutmix:
            ops.append(v2.CutMix(alpha=self.cutmix, num_classes=num_classes))
        op = ops[0] if len(ops) == 1 else v2.RandomChoice(ops)
        return op(x, y)


@functools.lru_cache(maxsize=16)
def _column(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """Per-channel values as a (1, C, 1, 1) tensor on `device`, made once (a host-to-device
    copy each step would wait for the device)."""
    return torch.tensor(values, device=device).view(1, -1, 1, 1)


TRIES = 10  # boxes drawn per image for random erasing (torchvision's and timm's count)


def random_erasing(x: torch.Tensor, p: float, scale: tuple[float, float] = (0.02, 1 / 3),
                   ratio: tuple[float, float] = (0.3, 3.3)) -> torch.Tensor:  # fmt: skip
    """Erase one random box per image with probability p, filled with normal noise (as timm's
    'pixel' mode): boxes drawn per image, applied as one masked write for the batch. As
    torchvision's and timm's, up to TRIES boxes are drawn for an image and the first smaller
    than it is erased; none (a large scale or a far aspect): the image is left as it is."""
    B, _, H, W = x.shape
    dev = x.device
    area = torch.empty(B, TRIES, device=dev).uniform_(*scale) * H * W
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    aspect = torch.exp(torch.empty(B, TRIES, device=dev).uniform_(*log_ratio))
    hs, ws = (area * aspect).sqrt().round().long(), (area / aspect).sqrt().round().long()
    fits = (hs < H) & (ws < W)
    first = fits.to(torch.uint8).argmax(1, keepdim=True)  # the first that fits (0 if none)
    h, w = hs.gather(1, first).squeeze(1), ws.gather(1, first).squeeze(1)
    top = (torch.rand(B, device=dev) * (H - h + 1)).long()
    left = (torch.rand(B, device=dev) * (W - w + 1)).long()
    on = (torch.rand(B, device=dev) < p) & fits.any(1)
    rows = torch.arange(H, device=dev).view(1, H, 1)
    cols = torch.arange(W, device=dev).view(1, 1, W)
    inside = (rows >= top.view(B, 1, 1)) & (rows < (top + h).view(B, 1, 1))
    inside = inside & (cols >= left.view(B, 1, 1)) & (cols < (left + w).view(B, 1, 1))
    mask = (inside & on.view(B, 1, 1)).unsqueeze(1)  # (B, 1, H, W)
    return torch.where(mask, torch.randn_like(x), x)


class EMA(torch.optim.swa_utils.AveragedModel):
    """torch's AveragedModel with the exponential moving average of the weights and buffers
    (get_ema_multi_avg_fn's update, to the bit), without its device sync at every step: torch
    copies the step count (a host tensor) to the device each update, which waits for the step
    to finish; the count is read on the host here."""

    def __init__(self, network: nn.Module, decay: float) -> None:
        with warnings.catch_warnings():  # AveragedModel warns about its deep copy's buffers
            warnings.simplefilter("ignore", UserWarning)
            super().__init__(network, use_buffers=True)
        self.decay = decay

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        ours = [*self.module.parameters(), *self.module.buffers()]
        theirs = [t.detach() for t in (*model.parameters(), *model.buffers())]
        if int(self.n_averaged) == 0:  # (a host tensor: no sync)
            torch._foreach_copy_(ours, theirs)
        else:
            floats = [(a, b) for a, b in zip(ours, theirs, strict=True) if a.is_floating_point()]
            if floats:
                torch._foreach_lerp_([a for a, _ in floats], [b for _, b in floats], 1 - self.decay)
            for a, b in zip(ours, theirs, strict=True):
                if not a.is_floating_point():  # e.g. BatchNorm's num_batches_tracked, as torch
                    a.copy_(a * self.decay + b * (1 - self.decay))
        self.n_averaged += 1


def build_ema(network: nn.Module, decay: float) -> EMA | None:
    """The exponential moving average of the weights and buffers (None when decay is 0)."""
    return EMA(network, decay) if decay else None
