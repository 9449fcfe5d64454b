"""JPEG batches decoded where the network runs: torchvision's batched `decode_jpeg` (nvJPEG on
CUDA, libjpeg-turbo on the CPU), then resized there to the set's stored size. Images the
workers could not hand over as JPEG (PNG, CMYK...) arrive decoded already; a JPEG the device's
decoder refuses goes to the CPU decoder, and one neither reads is reported and dropped with its
label.

nvJPEG (torchvision's flags) upsamples 4:2:0 chroma by repetition where libjpeg-turbo
interpolates: colour edges of such JPEGs differ by a few levels between `decode: gpu` and the
workers. `cnnkit pack --format jpeg` writes 4:4:4, where the two agree to rounding."""

from __future__ import annotations

import functools
import sys
import warnings

import torch
import torch.nn.functional as F

from cnnkit.data.batch import BatchDataset, WorkerBatch
from cnnkit.data.resize import centre_offset

# torchvision's words where the device's decoder itself cannot start (not a file's fault)
_DECODER_FAILED = ("failed to initialize nvjpeg", "failed to create", "nvjpeggetproperty failed",
                   "not compiled with nvjpeg")  # fmt: skip
_unavailable: set[str] = set()  # devices whose decoder failed to start: the CPU decodes for them


def decode_images(items: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """(3, H, W) uint8 RGB per JPEG on `device`, None where one cannot be decoded."""
    with warnings.catch_warnings():  # torchvision 0.29 deprecates it for TorchCodec; it works
        warnings.simplefilter("ignore", DeprecationWarning)
        from torchvision.io import ImageReadMode, decode_jpeg

        if device.type == "cuda":
            # nvJPEG fills its outputs from a stream of its own that does not wait for this one;
            # memory freed on this stream (the last batch's images) must be idle before reuse
            torch.cuda.current_stream(device).synchronize()
        return _decode_all(items, device, decode_jpeg, ImageReadMode.RGB)


def _decode_all(items, device, decode_jpeg, rgb) -> list[torch.Tensor | None]:
    """One batched call; where a bad file fails it, each half again (a bad JPEG in a batch of
    256 costs 2 log2(256) batched calls, not 256 single ones), down to the file itself. Where
    the decoder itself cannot start, every image goes to the CPU, now and from then on."""
    if str(device) in _unavailable:
        return [_on_the_cpu(item, device, decode_jpeg, rgb) for item in items]
    if len(items) <= 1:
        return [_decode_one(item, device, decode_jpeg, rgb) for item in items]
    try:
        return list(decode_jpeg(items, mode=rgb, device=device))
    except RuntimeError as e:
        if _decoder_failed(e, device):
            return _decode_all(items, device, decode_jpeg, rgb)
        half = len(items) // 2
        return [*_decode_all(items[:half], device, decode_jpeg, rgb),
                *_decode_all(items[half:], device, decode_jpeg, rgb)]  # fmt: skip


def _decoder_failed(error: RuntimeError, device: torch.device) -> bool:
    """Whether `error` says the device's decoder cannot start; if so, said once, and the device
    is marked for CPU decoding (torchvision would retry the start at every call: a batch of
    256 split in halves down to single files is 511 failed starts)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if not any(words in text.lower() for words in _DECODER_FAILED):
        return False
    _unavailable.add(str(device))
    print(f"cnnkit: note: the {device} JPEG decoder cannot start ({text[:120]}): JPEGs are decoded "
          "on the CPU in the main process (correct, slow; data.decode: cpu decodes them in the "
          "loader workers instead)", file=sys.stderr)  # fmt: skip
    return True


def _decode_one(item, device, decode_jpeg, rgb) -> torch.Tensor | None:
    """One JPEG on `device`; one the device's decoder refuses but libjpeg-turbo reads is decoded
    on the CPU and copied over; None if neither can."""
    try:
        return decode_jpeg(item, mode=rgb, device=device)
    except RuntimeError as e:
        if device.type == "cpu":
            return None
        failed = _decoder_failed(e, device)
    image = _on_the_cpu(item, device, decode_jpeg, rgb)
    if image is not None and not failed:
        _say_decoded_on_the_cpu(str(device))
    return image


def _on_the_cpu(item, device, decode_jpeg, rgb) -> torch.Tensor | None:
    """One JPEG decoded by libjpeg-turbo and copied to `device`; None if it cannot be read."""
    try:
        image = decode_jpeg(item, mode=rgb)
    except RuntimeError:
        return None
    return image.to(device, non_blocking=True)


@functools.cache
def _say_decoded_on_the_cpu(device: str) -> None:
    print(f"cnnkit: note: the {device} JPEG decoder refused images the CPU decoder reads: those are "
          "decoded on the CPU (correct, slower)", file=sys.stderr)  # fmt: skip


def resize_on_device(images: torch.Tensor, size: int, mode: str,
                     interpolation: str = "bilinear") -> torch.Tensor:  # fmt: skip
    """(..., 3, H, W) uint8 -> (..., 3, size, size) uint8: squash, or shorter side + centre
    crop, with antialiased bilinear (or bicubic) resampling (what the workers' CPU path does).

    Bicubic overshoots: torch's uint8 kernel on the CPU (as Pillow) rounds and clips between
    its horizontal and vertical passes, so on the device too the width is resized first, made
    whole levels in 0..255, then the height (one float pass differed by up to 30 levels at
    hard edges, this by 2)."""
    h, w = images.shape[-2:]
    if mode == "shorter":
        side = min(h, w)
        top, left = centre_offset(h, w)  # the CPU path's centre square
        images = images[..., top : top + side, left : left + side]
    if images.shape[-2:] == (size, size):
        return images
    x = images.reshape(-1, *images.shape[-3:]).float()
    if interpolation == "bicubic":
        x = F.interpolate(x, size=(x.shape[-2], size), mode=interpolation, antialias=True)
        x = x.round_().clamp_(0, 255)
    x = F.interpolate(x, size=(size, size), mode=interpolation, antialias=True)
    return x.round_().clamp_(0, 255).to(torch.uint8).reshape(*images.shape[:-2], size, size)


def _resized(images: dict[int, torch.Tensor], size: int, mode: str,
             interpolation: str = "bilinear") -> dict[int, torch.Tensor]:  # fmt: skip
    """Each image resized as resize_on_device does, those of one size in one call: a batch of
    256 photos a few sizes share (ImageNet's 500x375 and 375x500) takes a few kernel launches
    per size, not five per photo."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, image in images.items():
        by_shape.setdefault(tuple(image.shape), []).append(i)
    out = {}
    for ids in by_shape.values():
        group = images[ids[0]][None] if len(ids) == 1 else torch.stack([images[i] for i in ids])
        out |= dict(zip(ids, resize_on_device(group, size, mode, interpolation), strict=True))
    return out


def decode_batch(batch: WorkerBatch, dataset: BatchDataset,
                 device: torch.device) -> tuple[torch.Tensor, WorkerBatch]:  # fmt: skip
    """The batch's images as uint8 (B, 3, size, size) on `device`, and the record of the images
    kept (undecodable ones are added to `bad` and dropped)."""
    size, mode = dataset.size, dataset.resize_mode
    n = len(batch)
    coded = [i for i in range(n) if i not in batch.decoded]
    decoded = decode_images(batch.encoded.items(), device) if coded else []
    image = dict(zip(coded, decoded, strict=True))
    keep = [i for i in range(n) if i in batch.decoded or image[i] is not None]
    decoded = {i: im for i, im in image.items() if im is not None}
    resized = _resized(decoded, size, mode, dataset.interpolation)
    parts = [batch.decoded[i].to(device, non_blocking=True) if i in batch.decoded
             else resized[i] for i in keep]  # fmt: skip
    empty = torch.empty((0, 3, size, size), dtype=torch.uint8, device=device)
    out = torch.stack(parts) if parts else empty
    if len(keep) < n:
        bad = [(batch.names[i], "corrupt JPEG (device decoder)") for i in range(n) if i not in keep]
        sources = None if batch.sources is None else batch.sources[keep]
        batch = WorkerBatch(batch.labels[keep], bad=bad, sources=sources)
    return out, batch
