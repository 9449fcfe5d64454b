"""Face detection with a patch classifier: the network applied convolutionally over an image
pyramid (a sliding window at every scale in one pass per scale), scores above a threshold,
torchvision's non-maximum suppression; plus hard-negative mining for training."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from torch import nn

from cnnkit.data.decode import MAX_PIXELS
from cnnkit.data.scan import printable
from cnnkit.errors import ConfigError, DataError
from cnnkit.infer.images import ImageInput, save_picture, to_channels, to_hwc
from cnnkit.infer.load import Loaded
from cnnkit.nn import Network
from cnnkit.nn.layers import FlatLinear, ScaledTanh

# The smallest face searched by default, in windows. At 1 window (the image's own pixels) the
# windows outnumber all coarser scales together and show pixel detail that the training patches
# (downscaled photographs) never have: they made most of the false boxes on the astronaut.
MIN_FACE = 1.5
BAND_PIXELS = 1 << 21  # input pixels a band of a pyramid level's windows is scored over at once

# layers that work on any image size unchanged
_SPATIAL = (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d, nn.ReLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid,
            nn.GELU, nn.SiLU, nn.PReLU, nn.LocalResponseNorm, nn.BatchNorm2d, nn.Dropout,
            nn.Identity, ScaledTanh)  # fmt: skip


@dataclass
class Box:
    """One detection in the original image's pixels, best first."""

    x0: float
    y0: float
    x1: float
    y1: float
    score: float

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 4 if k == "score" else 1) for k, v in asdict(self).items()}


@dataclass
class SlidingNet:
    """A patch classifier as a fully convolutional net: output (i, j) is the window whose
    top-left corner is (i * stride, j * stride) in its input. (Padding does not shift it: a
    padded layer's output k lies over input k * stride in the patch and in the whole image
    alike; only the pixels it reads past the patch's edge differ: zeros for the patch alone,
    the neighbours in the image.)"""

    net: nn.Sequential
    window: int
    stride: int
    halo: int = 0  # input rows past a window's own that its score may read (padding,
    # ceil_mode pools), rounded up to whole strides: what a band of rows overlaps its neighbours

    def log_odds(self, x: torch.Tensor, label: int, rows: int, cols: int) -> torch.Tensor:
        """(rows, cols) log-odds of `label` of the windows of x (1, C, H, W), computed in bands
        of rows that overlap by the halo, so memory stays bounded however large x is (the
        activations take hundreds of bytes a pixel); the same numbers as one pass."""
        S, H = self.stride, x.shape[-2]
        per = max(1, BAND_PIXELS // (x.shape[-1] * S))  # output rows per band
        bands = []
        for a in range(0, rows, per):
            b = min(rows, a + per)
            start = max(0, a * S - self.halo)  # whole strides: every layer's grid stays put
            stop = min(H, (b - 1) * S + self.window + self.halo)
            skip = (a * S - start) // S
            bands.append(_log_odds(self.net(x[..., start:stop, :]), label)[skip : skip + b - a])
        return torch.cat(bands)[:rows, :cols]


def sliding_net(model: Network) -> SlidingNet:
    """Turn a chain of conv / pool / activation / linear layers into a fully convolutional net:
    the first linear becomes a convolution over its whole input, later ones 1x1 convolutions.
    A window's score is its classification's, except where a layer reads past the patch's
    edge (padding, a ceil_mode pool's last window): there it reads the image's pixels beyond."""
    modules, stride, reach = [], 1, 0
    current = model.input_shape  # the (C, H, W) the next layer reads
    if len(current) != 3 or current[1] != current[2]:
        raise ConfigError(f"detect: the network reads {' x '.join(map(str, current))} inputs; "
                          "sliding windows need square images")  # fmt: skip
    for i, row in enumerate(model.table):
        if row.inputs != (("input",) if i == 0 else (model.table[i - 1].name,)):
            raise ConfigError(f"detect: layer {row.name!r} branches; detection needs a chain")
        module = model.get_submodule(row.name)
        if isinstance(module, nn.Flatten):
            continue
        if isinstance(module, FlatLinear):
            module = _linear_as_conv(module, current)
            current = (module.out_channels, 1, 1)
        elif isinstance(module, nn.BatchNorm1d):
            module = _bn_as_2d(module)
        elif not isinstance(module, _SPATIAL):
            raise ConfigError(f"detect: layer {row.name!r} ({row.type}) cannot slide over an image")
        elif isinstance(module, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)):
            if not (_square(module.stride) and _square(module.padding)):
                raise ConfigError(f"detect: layer {row.name!r} strides or pads the two axes "
                                  "differently; sliding windows need the same on both")  # fmt: skip
            # past the patch: its padding, a ceil_mode pool's last window (generously)
            reach += (_first(module.kernel_size) + _pad(module)) * stride
            stride *= _first(module.stride)
            current = row.output_shape
        modules.append(module)
    window = model.input_shape[-1]
    halo = stride * -(-(window + reach) // stride)
    return SlidingNet(nn.Sequential(*modules).eval(), window, stride, halo)


def _pad(module: nn.Module) -> int:
    """A layer's padding in pixels ('same': about half its kernel)."""
    if isinstance(module.padding, str):
        return _first(module.kernel_size) * _first(getattr(module, "dilation", 1))
    return _first(module.padding)


def _square(value: int | tuple | str) -> bool:
    return not isinstance(value, tuple) or len(set(value)) == 1


def _first(value: int | tuple | str) -> int:
    return 0 if isinstance(value, str) else value if isinstance(value, int) else value[0]


def _linear_as_conv(linear: nn.Linear, shape: tuple[int, ...]) -> nn.Conv2d:
    c, h, w = shape
    conv = nn.Conv2d(c, linear.out_features, (h, w), bias=linear.bias is not None)
    conv.weight.data.copy_(linear.weight.data.view(linear.out_features, c, h, w))
    if linear.bias is not None:
        conv.bias.data.copy_(linear.bias.data)
    return conv


def _bn_as_2d(bn: nn.BatchNorm1d) -> nn.BatchNorm2d:
    out = nn.BatchNorm2d(bn.num_features, bn.eps, bn.momentum, bn.affine)
    out.load_state_dict(bn.state_dict())
    return out.eval()


def pyramid_scales(size: tuple[int, int], window: int, min_face: int, step: float) -> list[float]:
    """Image scales so that faces from `min_face` pixels up to the image fit the window."""
    scales, scale = [], window / min_face
    while min(size) * scale >= window:
        scales.append(scale)
        scale /= step
    return scales


@torch.no_grad()
def score_maps(
    loaded: Loaded, image: ImageInput, scales: list[float], label: int, mirror: bool = True
):
    """(scale, map of the log-odds of `label`) for each scale; the map's (i, j) is a window (see
    SlidingNet). Log-odds rank windows that float32 probabilities would tie at 1.0. `mirror`:
    average with the mirrored image's map (each window and its mirror image, like 10-crop's
    flips): a face scores high both ways, chance texture rarely does."""
    slider = sliding_net(loaded.model)
    grey = to_channels(to_hwc(image), loaded.preprocess.channels)
    x = torch.from_numpy(grey).permute(2, 0, 1)[None].float()  # (1, C, H, W) 0-255
    mean = torch.tensor(loaded.preprocess.mean).view(1, -1, 1, 1)
    std = torch.tensor(loaded.preprocess.std).view(1, -1, 1, 1)
    for scale in scales:
        size = (round(x.shape[2] * scale), round(x.shape[3] * scale))
        scaled = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
        rows, cols = ((n - slider.window) // slider.stride + 1 for n in size)  # whole windows
        width = (cols - 1) * slider.stride + slider.window  # (the mirror's windows line up)
        scaled = (scaled[..., :width].round().clamp(0, 255) - mean) / std
        odds = slider.log_odds(scaled, label, rows, cols)  # (pools that round up: cut)
        if mirror:  # the mirrored image's windows line up with these (the width fits the stride)
            mirrored = slider.log_odds(scaled.flip(-1), label, rows, cols).flip(-1)
            odds = (odds + mirrored) / 2
        yield scale, slider, odds


def _log_odds(logits: torch.Tensor, label: int) -> torch.Tensor:
    """(1, K, h, w) logits -> (h, w) log-odds of `label` against all the others."""
    others = torch.cat([logits[:, :label], logits[:, label + 1 :]], 1)
    return (logits[:, label] - others.logsumexp(1))[0]


def detect(
    loaded: Loaded,
    image: ImageInput,
    label: str = "face",
    threshold: float = 0.95,
    iou: float = 0.3,
    min_face: int | None = None,
    step: float = 1.2,
    top: int = 50,
    mirror: bool = True,
    clip: bool = True,
    name: str | None = None,
) -> list[Box]:
    """Boxes where the classifier says `label` with probability >= threshold, after NMS
    (`mirror`: the probability averaged in log-odds with the mirrored window's), for faces of
    `min_face` pixels (default MIN_FACE windows) up to the whole image; `clip`: boxes cut to
    the image (else each is its window's whole extent); `name`: the image's in errors (default:
    its path, if it is one)."""
    from torchvision.ops import nms

    if label not in loaded.classes:
        raise ConfigError(f"detect: class {label!r} is not one of {loaded.classes}")
    h, w = to_hwc(image).shape[:2]
    window = loaded.model.input_shape[-1]
    smallest = min_face or round(MIN_FACE * window)
    scales = pyramid_scales((h, w), window, smallest, step)
    where = _where(image, name)
    if not scales:  # no window fits: "no face found" would not say why
        raise DataError(f"{where}the image ({w}x{h}) is smaller than the smallest face searched "
                        f"({smallest} px): give a smaller --min-size")  # fmt: skip
    _check_level_pixels(h, w, scales[0], window, smallest, where)
    boxes, scores, cut = [], [], log_odds(threshold)
    for scale, slider, odds in score_maps(loaded, image, scales, loaded.classes.index(label),
                                          mirror):  # fmt: skip
        i, j = torch.nonzero(odds >= cut, as_tuple=True)
        y0, x0 = i * slider.stride / scale, j * slider.stride / scale
        side = window / scale
        boxes.append(torch.stack([x0, y0, x0 + side, y0 + side], 1).float())
        scores.append(odds[i, j].float())
    if not boxes:
        return []
    all_boxes, all_scores = torch.cat(boxes), torch.cat(scores)
    keep = nms(all_boxes, all_scores, iou)[:top]  # sorted by log-odds, best first
    probs = all_scores[keep].double().sigmoid().tolist()
    kept = all_boxes[keep]
    if clip:  # a scale's rounded size can reach half a scaled pixel past the image's edge
        kept = torch.minimum(kept.clamp(min=0), torch.tensor([w, h, w, h], dtype=kept.dtype))
    return [Box(*box, p) for box, p in zip(kept.tolist(), probs, strict=True)]


def _where(image: ImageInput, name: str | None) -> str:
    """How an error starts: the image's name (given, or its path) and a colon, or nothing."""
    name = name if name is not None else image if isinstance(image, (str, Path)) else None
    return f"{printable(str(name))}: " if name is not None else ""


def _check_level_pixels(h: int, w: int, scale: float, window: int, smallest: int,
                        where: str = "") -> None:  # fmt: skip
    """DataError where the pyramid's largest level (the image scaled so that the smallest face
    fills a window) is over the pixel limit images are decoded under: it would not fit in
    memory (the network's activations take hundreds of bytes a pixel). `where`: _where's."""
    level = round(h * scale) * round(w * scale)
    if level > MAX_PIXELS:
        need = math.ceil(window * math.sqrt(h * w / MAX_PIXELS))
        while round(h * window / need) * round(w * window / need) > MAX_PIXELS:
            need += 1  # (each side is rounded)
        raise DataError(f"{where}the smallest face searched ({smallest} px) scales the {w}x{h} "
                        f"image {scale:.2g}x, to {level:,} pixels, over the limit of "
                        f"{MAX_PIXELS:,}: give --min-size {need} or more")  # fmt: skip


def log_odds(p: float) -> float:
    """log(p / (1 - p)), infinite at 0 and 1."""
    return -math.inf if p <= 0 else math.inf if p >= 1 else math.log(p / (1 - p))


def draw_boxes(image: ImageInput, boxes: list[Box], path: Path) -> None:
    """Save the image with each box drawn, the best in red, and its rank and score written on a
    filled label; lines and text scale with the picture (18-pixel text on a 512-pixel one)."""
    from cnnkit.infer.show import IMAGE_SUFFIXES, check_suffix, font

    check_suffix(path, IMAGE_SUFFIXES)
    picture = Image.fromarray(to_channels(to_hwc(image), 3))
    pen = ImageDraw.Draw(picture)
    side = min(picture.size)
    text_font, width = font(max(11, round(side / 28))), max(2, round(side / 170))
    colours = ([((230, 30, 30), "white")] + [((255, 200, 0), "black")] * len(boxes))[: len(boxes)]
    for box, (colour, _) in reversed(list(zip(boxes, colours, strict=True))):  # best on top
        pen.rectangle([box.x0, box.y0, box.x1, box.y1], outline=colour, width=width)
    for rank in reversed(range(len(boxes))):  # labels over every line, the best's on top
        box, (colour, ink) = boxes[rank], colours[rank]
        text = f"{rank + 1}: {box.score:.3f}"
        left, top, right, bottom = pen.textbbox((0, 0), text, font=text_font)
        pad = max(2, (bottom - top) // 5)
        x = min(max(box.x0, 0), picture.width - (right - left) - 2 * pad)
        y = box.y0 - (bottom - top) - 2 * pad  # above the box, or inside it at the top
        y = y if y >= 0 else max(box.y0, 0)
        pen.rectangle([x, y, x + right - left + 2 * pad, y + bottom - top + 2 * pad], fill=colour)
        pen.text((x + pad - left, y + pad - top), text, fill=ink, font=text_font)
    save_picture(picture, path)


def mine_hard_negatives(
    loaded: Loaded, images: list[ImageInput], label: str = "face", threshold: float = 0.5,
    per_image: int = 50, step: float = 1.3,
) -> np.ndarray:  # fmt: skip
    """Windows of face-free images that the classifier calls `label` (bootstrapping): uint8
    (N, C, window, window) patches, the highest scores first per image, to train on as negatives."""
    window = loaded.model.input_shape[-1]
    patches = []
    for image in images:
        hwc = to_channels(to_hwc(image), loaded.preprocess.channels)
        name = str(image) if isinstance(image, (str, Path)) else None  # hwc has none
        # every window size, the smallest too: its false positives are non-faces all the same
        for box in detect(loaded, hwc, label, threshold, 0.5, window, step, per_image,
                          clip=False, name=name):  # fmt: skip
            crop = Image.fromarray(hwc.squeeze(-1) if hwc.shape[2] == 1 else hwc).crop(
                (round(box.x0), round(box.y0), round(box.x1), round(box.y1))
            )
            patch = np.asarray(crop.resize((window, window), Image.BILINEAR))
            patches.append(patch.reshape(window, window, -1).transpose(2, 0, 1))
    shape = (0, loaded.preprocess.channels, window, window)
    return np.stack(patches) if patches else np.zeros(shape, np.uint8)


def iou_of(a: Box, b: tuple[float, float, float, float]) -> float:
    """Intersection over union of a box and (x0, y0, x1, y1)."""
    ix = max(0.0, min(a.x1, b[2]) - max(a.x0, b[0]))
    iy = max(0.0, min(a.y1, b[3]) - max(a.y0, b[1]))
    inter = ix * iy
    union = (a.x1 - a.x0) * (a.y1 - a.y0) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0
