"""torchvision's RandomResizedCrop box rule for a batch: its random numbers drawn on the CPU
before any image's size is known (a resumed epoch repeats them), the boxes placed on each
image's own size, and boxes on a photo mapped into the square it was squashed into."""

from __future__ import annotations

import math

import torch

TRIES = 10  # torchvision's RandomResizedCrop: tries per image before its fallback
DRAWS = 2 * TRIES + 2  # per image: each try's area and log aspect, then the box's place


def draw_boxes(batch: int, scale: tuple[float, float], ratio: tuple[float, float],
               generator: torch.Generator) -> torch.Tensor:  # fmt: skip
    """The random numbers of torchvision's RandomResizedCrop for a batch, drawn before any
    image's size is known: (B, DRAWS) float32, per image TRIES area fractions (uniform in
    `scale`), TRIES log aspects (uniform in log `ratio`) and where the box goes (two uniforms
    in [0, 1)). The same numbers whatever the sizes, so a resumed epoch repeats them."""
    area = torch.empty(batch, TRIES).uniform_(*scale, generator=generator)
    log_r = torch.empty(batch, TRIES).uniform_(
        math.log(ratio[0]), math.log(ratio[1]), generator=generator
    )
    place = torch.rand(2, batch, generator=generator).T
    return torch.cat([area, log_r, place], 1)


def rrc_boxes(draws: torch.Tensor, height: torch.Tensor | int, width: torch.Tensor | int,
              ratio: tuple[float, float]) -> torch.Tensor:  # fmt: skip
    """torchvision's RandomResizedCrop box rule on images of `height` x `width` pixels (each
    image its own, or one for all), from `draw_boxes`' numbers: the first of the tries whose box
    fits, placed anywhere in the image; if none fits, the centred box of the whole image, its
    aspect clamped to `ratio` (torchvision's fallback). Returns (B, 4) int64 top, left, height,
    width in those images' pixels."""
    B = draws.shape[0]
    H = torch.as_tensor(height, dtype=torch.int64).expand(B)
    W = torch.as_tensor(width, dtype=torch.int64).expand(B)
    # in float64 from the float32 draws, as torchvision computes (its exp in float32, then
    # Python floats): float32 products put a box a pixel off now and then
    area = (H * W).double()[:, None] * draws[:, :TRIES].double()
    aspect = torch.exp(draws[:, TRIES : 2 * TRIES]).double()
    w = torch.sqrt(area * aspect).round().long()
    h = torch.sqrt(area / aspect).round().long()
    ok = (w > 0) & (h > 0) & (w <= W[:, None]) & (h <= H[:, None])
    pick = ok.float().argmax(1, keepdim=True)  # the first try that fits
    h, w, fits = h.gather(1, pick)[:, 0], w.gather(1, pick)[:, 0], ok.any(1)
    fall_h, fall_w = _fallback_box(H, W, ratio)
    h, w = torch.where(fits, h, fall_h), torch.where(fits, w, fall_w)
    place = draws[:, 2 * TRIES :].double()
    top = torch.where(fits, (place[:, 0] * (H - h + 1)).long(), (H - h) // 2)
    left = torch.where(fits, (place[:, 1] * (W - w + 1)).long(), (W - w) // 2)
    return torch.stack([top, left, h, w], 1)


def _fallback_box(H: torch.Tensor, W: torch.Tensor,
                  ratio: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """torchvision's box when no try fits: the whole image, its aspect clamped to `ratio`."""
    in_ratio = W.double() / H.double()
    narrow, wide = in_ratio < min(ratio), in_ratio > max(ratio)
    h = torch.where(narrow, (W.double() / min(ratio)).round().long(), H)
    w = torch.where(wide, (H.double() * max(ratio)).round().long(), W)
    return h, w


def frame_boxes(boxes: torch.Tensor, sources: torch.Tensor, size: int) -> torch.Tensor:
    """Boxes (B, 4: top, left, height, width) in each source's pixels ((B, 2): H, W) as boxes
    of the size x size square the source was squashed into: each edge to the nearest pixel,
    at least one pixel, inside the square."""
    H, W = sources[:, 0:1].double(), sources[:, 1:2].double()
    top, left, h, w = boxes.double().split(1, 1)
    y = torch.cat([top, top + h], 1).mul_(size / H).round_().long()
    x = torch.cat([left, left + w], 1).mul_(size / W).round_().long()
    y0, x0 = y[:, 0].clamp(max=size - 1), x[:, 0].clamp(max=size - 1)
    y1 = torch.maximum(y[:, 1], y0 + 1).clamp(max=size)
    x1 = torch.maximum(x[:, 1], x0 + 1).clamp(max=size)
    return torch.stack([y0, x0, y1 - y0, x1 - x0], 1)


def sample_boxes(batch: int, height: int, width: int, scale: tuple[float, float],
                 ratio: tuple[float, float], generator: torch.Generator) -> torch.Tensor:  # fmt: skip
    """torchvision's RandomResizedCrop boxes on `batch` images of height x width pixels:
    (B, 4) int64 top, left, height, width."""
    return rrc_boxes(draw_boxes(batch, scale, ratio, generator), height, width, ratio)
