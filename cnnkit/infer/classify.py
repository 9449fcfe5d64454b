"""Classify images with a trained model: top-k names and probabilities, centre crop or the
2012 paper's 10-crop average, preprocessing exactly as at evaluation time."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from cnnkit.checkpoint import note_mean_image
from cnnkit.data.augment import center_crop, ten_crop
from cnnkit.data.base import MAX_SIDE
from cnnkit.data.preprocess import reads_images
from cnnkit.distributed import resolve_device
from cnnkit.errors import CheckpointError, CnnkitError, ConfigError, DataError
from cnnkit.infer.images import ImageInput, check_preprocess, crops_of, image_name
from cnnkit.infer.load import Loaded, load_for_inference, require_trained
from cnnkit.runtime import restore_matmuls, tf32_matmuls


@dataclass
class Prediction:
    """One image's result: top-k class names with probabilities, best first (or an error)."""

    image: str
    labels: list[str] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    error: str | None = None  # why the image could not be classified

    @property
    def label(self) -> str | None:
        """The most probable class."""
        return self.labels[0] if self.labels else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping (what `cnnkit classify --json` prints)."""
        if self.error is not None:
            return {"image": self.image, "error": self.error}
        top = [
            {"class": c, "prob": round(p, 6)} for c, p in zip(self.labels, self.probs, strict=True)
        ]
        return {"image": self.image, "label": self.label, "top": top}


class Classifier:
    """A model plus its class names and evaluation preprocessing."""

    def __init__(self, loaded: Loaded, device: Any = "cpu"):
        if not isinstance(loaded, Loaded):  # Classifier("runs/d"): what was meant
            raise ConfigError(f"Classifier({str(loaded)[:80]!r}): Classifier.load(PATH) loads a "
                              "run, checkpoint, export or network file; Classifier() takes what "
                              "cnnkit.infer.load.load_for_inference returns")  # fmt: skip
        check_loaded(loaded)
        device = resolve_device(str(device), "device")  # 'cuda' without one: one line, as --device
        self.model = loaded.model.to(device).eval()
        self.classes = loaded.classes
        self.preprocess = loaded.preprocess
        self.device = torch.device(device)
        self.mean_image = loaded.mean_image  # (C, S, S) or None: see _mean_residual
        self._residuals: dict[int, torch.Tensor] = {}
        self.channels_last: bool | None = None  # the faster kernels, measured at the first batch
        self.autocast: torch.dtype | None = None  # a reduced precision a GPU run trained in
        ran = loaded.ran or {}
        if self.device.type == "cuda" and ran.get("device") == "cuda":  # as the run's steps ran
            self.autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
                ran.get("precision")
            )
            self.channels_last = bool(ran.get("channels_last"))
            if self.channels_last:
                self.model.to(memory_format=torch.channels_last)

    @classmethod
    def load(cls, path: str | Path, device: Any = "cpu", ema: bool = False) -> Classifier:
        """From a run directory, a checkpoint or a .safetensors export (GPU-trained works on CPU),
        or a network file that names its trained weights (`weights:`); `ema`: a run's moving
        average of the weights (train.ema) instead."""
        loaded = load_for_inference(path, "cpu", ema)
        require_trained(loaded, path)
        if loaded.mean_averaged:
            note_mean_image("classify")
        return cls(loaded, device)

    def predict(
        self, images: ImageInput | Sequence[ImageInput], top: int = 5, tencrop: bool = False
    ) -> Prediction | list[Prediction]:
        """Classify one image (-> Prediction) or a list or other iterable of them (-> list); an
        unreadable image raises. An array or tensor is one image ((H, W), (H, W, C) or
        (C, H, W)); a batch of them is given as list(batch)."""
        single = isinstance(images, (str, Path, np.ndarray, torch.Tensor, Image.Image)) or not (
            isinstance(images, Iterable))  # fmt: skip
        self._one_image_or_a_stack(images)
        batch = [images] if single else list(images)
        results = list(self.iter_predict(batch, top, tencrop))
        failed = next((r for r in results if r.error), None)
        if failed is not None:
            raise CnnkitError(f"{failed.image}: {failed.error}")
        return results[0] if single else results

    def _one_image_or_a_stack(self, images: Any) -> None:
        """ConfigError for a (3 or 4, H, W) array given to a grey network: one colour image
        (C, H, W), or 3 or 4 grey images stacked? It was read as the first, and a notebook's
        predict(X[:3]) got one answer for three digits."""
        shape = tuple(getattr(images, "shape", ()))
        if self.preprocess.channels == 1 and len(shape) == 3 and shape[0] in (3, 4) and (
            shape[2] not in (1, 3, 4)):  # fmt: skip
            raise ConfigError(f"a {shape} array for a 1-channel network: one colour image "
                              f"(C, H, W) or {shape[0]} grey images? give list(array) for "
                              "images, or one colour image as (H, W, C)")  # fmt: skip

    def iter_predict(
        self,
        images: Iterable[ImageInput],
        top: int = 5,
        tencrop: bool = False,
        batch_size: int = 64,
    ) -> Iterator[Prediction]:
        """Classify images in batches, in order; an unreadable one yields a Prediction with error."""
        if isinstance(top, bool) or not isinstance(top, numbers.Integral) or top < 1:  # as --top
            raise ConfigError(f"top: a whole number of classes, 1 or more, got {top!r}")
        top = int(top)  # (numpy's integers too)
        pre = self.preprocess
        if tencrop and not (pre.resize and pre.resize > pre.crop):  # 5 copies and 5 mirrors
            raise ConfigError(
                f"--tencrop: 10-crop needs images resized larger than the network's input "
                f"({pre.crop}x{pre.crop}); this network reads them at that size"
            )
        pending: list[tuple[str, torch.Tensor]] = []
        for index, image in enumerate(images):
            name = image_name(image, index)
            try:
                pending.append((name, crops_of(image, self.preprocess, tencrop)))
            except CnnkitError as e:
                yield from self._run(pending, top)
                pending = []
                yield Prediction(name, error=str(e).removeprefix(f"{name}: "))
                continue
            if len(pending) >= batch_size:
                yield from self._run(pending, top)
                pending = []
        yield from self._run(pending, top)

    @torch.no_grad()
    def probabilities(self, crops: torch.Tensor) -> torch.Tensor:
        """uint8 (B, N, C, H, W) crops -> class probabilities (B, K), averaged over the N crops
        (pixels 0-255 as decoded, H and W the network's crop; predict reads images of any size)."""
        pre = self.preprocess
        want = (pre.channels, pre.crop, pre.crop)
        if not (isinstance(crops, torch.Tensor) and crops.dtype == torch.uint8
                and crops.dim() == 5 and tuple(crops.shape[2:]) == want):  # fmt: skip
            got = (f"{crops.dtype} {tuple(crops.shape)}" if isinstance(crops, torch.Tensor)
                   else type(crops).__name__)  # fmt: skip
            raise ConfigError(f"probabilities: uint8 crops (B, N, {', '.join(map(str, want))}) "
                              f"of 0-255 pixels, N crops of each of B images (1, or 10: the "
                              f"ten-crop), got {got} (predict reads any image)")  # fmt: skip
        b, n = crops.shape[:2]
        x = self.preprocess.normalize(crops.flatten(0, 1).to(self.device))
        if self.mean_image is not None:
            x = (x.view(b, n, *x.shape[1:]) - self._mean_residual(n)).flatten(0, 1)
        if self.channels_last is None:
            self._choose_format(len(x))
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        matmuls = tf32_matmuls() if self.device.type == "cuda" else None  # as training ran
        try:
            with torch.autocast(self.device.type, self.autocast, enabled=self.autocast is not None):
                probs = self.model(x).float().softmax(dim=1)  # (B * N, K)
        finally:
            if matmuls is not None:
                restore_matmuls(matmuls)
        return probs.view(b, n, -1).mean(dim=1)

    def _mean_residual(self, n: int) -> torch.Tensor:
        """(n, C, crop, crop): what a normalize: mean_image run subtracted at each of the n
        crops' places beyond the channel averages `preprocess` holds (crops cut where
        crops_of cuts them from images resized to the mean image's side)."""
        if n not in self._residuals:
            pre, image = self.preprocess, self.mean_image[None].float()
            crops = ten_crop(image, pre.crop)[0] if n == 10 else center_crop(image, pre.crop)
            mean = torch.tensor(pre.mean).view(1, -1, 1, 1)
            std = torch.tensor(pre.std).view(1, -1, 1, 1)
            self._residuals[n] = ((crops - mean) / std).to(self.device)
        return self._residuals[n]

    def _choose_format(self, batch: int) -> None:
        """channels_last and the linear layers' product where this CPU runs the network's
        forward pass faster with them (timed once per machine and network, then cached:
        cnnkit/nn/tuning.py)."""
        from cnnkit.nn.kernels import set_kernels
        from cnnkit.nn.onednn import freeze
        from cnnkit.nn.tuning import choose_inference_kernels

        self.channels_last, plan = choose_inference_kernels(self.model, self.device, batch)
        if self.channels_last:
            self.model.to(memory_format=torch.channels_last)
        freeze(set_kernels(self.model, plan))  # a classifier's weights do not change

    def _run(self, pending: list[tuple[str, torch.Tensor]], top: int) -> Iterator[Prediction]:
        if not pending:
            return
        probs = self.probabilities(torch.stack([crops for _, crops in pending]))
        values, indices = probs.topk(min(top, probs.shape[1]), dim=1)
        for (name, _), p, i in zip(pending, values.tolist(), indices.tolist(), strict=True):
            yield Prediction(name, [self._name(k) for k in i], p)

    def _name(self, index: int) -> str:
        return self.classes[index]  # as many names as outputs (check_loaded)


def check_loaded(loaded: Loaded) -> None:
    """CheckpointError unless the model can classify: one class name per output, and a
    preprocessing resize within the pixel limit (checked before any image is read)."""
    shape = tuple(loaded.model.input_shape)
    if not reads_images(shape):
        raise ConfigError(f"{loaded.source}: classify reads square grey or RGB images of at "
                          f"most {MAX_SIDE} px; this network takes "
                          f"{' x '.join(map(str, shape))} inputs")  # fmt: skip
    output = tuple(loaded.model.output_shape)
    if len(output) != 1:  # a softmax over positions and channels would be no classification
        raise ConfigError(f"{loaded.source}: classify needs a network whose output is a vector of "
                          f"class scores; this one gives {' x '.join(map(str, output))}")  # fmt: skip
    outputs = output[0]
    if len(loaded.classes) != outputs:
        raise CheckpointError(
            f"{loaded.source}: {len(loaded.classes)} class names for the network's {outputs} "
            "outputs (the labels would be wrong)"
        )
    try:
        check_preprocess(loaded.preprocess)
    except DataError as e:
        raise CheckpointError(f"{loaded.source}: {e}") from None
