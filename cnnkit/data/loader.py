"""The fast loader of the image sets (folder, packed): worker processes build whole uint8
batches (one dataset call per batch, see data/batch.py) into a ring of shared slots made once;
the main process normalises them (CPU) or copies each straight from its slot to the GPU on a
side stream and augments it there while the model computes the previous batch.

How a batch is made depends on the device and the data (`ImageBatches.mode`):
- "views": CPU device, raw shards: the main process crops straight out of the page cache;
- "crops": CPU device training: workers decode once into the crop, main normalises;
- "whole": workers write whole stored-size images; the device crops (CUDA, and evaluation);
- "encoded": workers read JPEG bytes only; the main process decodes batches on the device.
"""

from __future__ import annotations

import errno
import functools
import math
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import (
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from torch.utils.data import DataLoader

from cnnkit.data.augment import CropAugment
from cnnkit.data.base import DataBundle, DataConfigBase, Preprocess, unit_mistake
from cnnkit.data.batch import BatchDataset, WorkerBatch
from cnnkit.data.device_decode import decode_batch
from cnnkit.data.feed import DeviceFeed
from cnnkit.data.sampling import EpochBatchSampler, JobSampler, batch_generator
from cnnkit.data.slots import SHM_ADVICE, BufferPool, SlotRing
from cnnkit.data.workers import (
    deaths_found_here,
    no_worker_count_warning,
    say_more_workers_than_cores,
    start_worker,
    worker_died,
)
from cnnkit.errors import ConfigError, DataError, brief, one_line
from cnnkit.runtime import available_cores, torch_threads

Mode = Literal["views", "crops", "whole", "encoded"]
LUMA = (0.299, 0.587, 0.114)  # ITU-R 601, as Pillow's convert("L") and torchvision's Grayscale


class ImageSetConfig(DataConfigBase):
    """Fields shared by the image sources (folder, packed): loading and augmentation."""

    crop: PositiveInt = Field(227, description="network input side (227 of 256 like the seeds)")
    train_crop: Literal["random", "resized"] = Field(
        "random",
        description="random: random crop; resized: random-resized-crop (torchvision's box "
        "rule, drawn on each photo at its own size)",
    )
    scale: tuple[float, float] = Field((0.08, 1.0), description="random-resized-crop area range")
    mirror: bool = Field(True, description="random horizontal mirror in training")
    lighting: float = Field(0.0, ge=0, description="PCA lighting std (0.1 in the 2012 paper)")
    normalize: Literal["channel", "mean_image"] = Field(
        "channel", description="channel: (x - mean_c) / std_c; mean_image: x - mean image"
    )
    decode: Literal["cpu", "gpu"] = Field(
        "cpu", description="JPEGs decoded by the workers, or in batches on the training device"
    )
    workers: NonNegativeInt | None = Field(
        None, description="loader processes (0: in the main process; default: from the cores)"
    )
    prefetch: PositiveInt = Field(2, description="batches prefetched per worker")
    val_fraction: float = Field(0.1, ge=0, lt=1, description="held out when no val_path")
    mean: tuple[float, float, float] | None = Field(
        None, description="per channel, 0-255 (None: ImageNet's for folders, the pack's own)"
    )
    std: tuple[PositiveFloat, PositiveFloat, PositiveFloat] | None = Field(
        None, description="per channel, 0-255 (each > 0: it divides)"
    )
    grey: bool = Field(False, description="luma of the RGB images (ITU-R 601, as torchvision's "
                       "Grayscale): for a network with 1 input channel")  # fmt: skip
    _mean_image: torch.Tensor | None = PrivateAttr(None)  # a trained run's (evaluated_as)

    @property
    def trained_mean(self) -> torch.Tensor | None:
        """The trained run's mean image these images are normalised with (evaluated_as)."""
        return self._mean_image

    def evaluated_as(self, preprocess: Preprocess,
                     mean_image: torch.Tensor | None = None) -> ImageSetConfig:  # fmt: skip
        """Normalised with a trained network's mean image where it has one the size of these
        images, else its per-channel mean/std (not this data's own)."""
        if mean_image is not None and mean_image.shape[-1] == self.stored_size():
            out = self.model_copy(update={"normalize": "mean_image"})
            out._mean_image = mean_image
            return out
        if self.normalize != "channel" or len(preprocess.mean) != 3:
            return self
        return self.model_copy(update={"mean": tuple(preprocess.mean),
                                       "std": tuple(preprocess.std)})  # fmt: skip

    def training_notes(self) -> list[str]:
        """A validation set that is the training set is refused (its figures would not be held
        out); a held-out fraction beside a validation set is said to be unused."""
        val_path = getattr(self, "val_path", None)
        if not val_path:
            return []
        if Path(val_path).resolve() == Path(getattr(self, "path", "")).resolve():
            raise ConfigError("data.val_path: the training set itself (data.path), so the held-out "
                              "figures would be of training images (leave data.val_path out "
                              "to hold out data.val_fraction of data.path)")  # fmt: skip
        default = type(self).model_fields["val_fraction"].default
        if self.val_fraction != default:
            return [f"data.val_fraction {self.val_fraction:g} is not used: data.val_path holds "
                    "the held-out images"]  # fmt: skip
        return []

    def worker_count(self, local_ranks: int = 1) -> int:
        """`workers`, or the cores this process may use shared among the ranks on this machine,
        one left to each rank's main process."""
        if self.workers is not None:
            return self.workers
        return max(1, available_cores() // max(local_ranks, 1) - 1)

    @field_validator("mean", "std", mode="before")
    @classmethod
    def _one_per_channel(cls, values: Any) -> Any:
        if isinstance(values, (list, tuple)) and len(values) != 3:
            raise ValueError(f"takes 3 values, one per channel (R, G, B), not {len(values)} "
                             f"(got {brief(values)})")  # fmt: skip
        return values

    @field_validator("mean", "std")
    @classmethod
    def _pixel_scale(cls, values: tuple[float, ...] | None, info: ValidationInfo) -> Any:
        mistake = unit_mistake(info.field_name, values)
        if mistake:
            raise ValueError(mistake)
        return values

    @model_validator(mode="after")
    def _check_scale(self) -> ImageSetConfig:
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ValueError(f"scale: need 0 < min <= max <= 1, got {self.scale}")
        if self.grey and self.normalize == "mean_image":
            raise ValueError("grey: takes normalize: channel (a grey mean image is not kept)")
        if self.policy != "none" and self.normalize == "mean_image":
            raise ValueError(f"policy: {self.policy} takes normalize: channel (it works on the "
                             "pixels, which a crop's own part of the mean image hides)")  # fmt: skip
        return self

    def finish(self, bundle: DataBundle) -> DataBundle:
        """The bundle a source built, made grey where `grey` asks: both streams yield the luma
        of their normalised RGB batches, normalised by the luma of the mean and std (a linear
        map, so exactly the luma of the images, normalised), and classification's
        preprocessing says 1 channel."""
        if not self.grey:
            return bundle
        pre = bundle.preprocess
        mean = sum(w * m for w, m in zip(LUMA, pre.mean, strict=True))
        std = sum(w * s for w, s in zip(LUMA, pre.std, strict=True))
        weights = torch.tensor([w * s / std for w, s in zip(LUMA, pre.std, strict=True)])
        for stream in (bundle.train, bundle.val):
            stream.grey = weights.view(1, 3, 1, 1).to(stream.device)
        grey = Preprocess.of_data(1, pre.crop, pre.resize, pre.resize_mode, [mean], [std])
        return replace(bundle, input_shape=(1, *bundle.input_shape[1:]), preprocess=grey)


@functools.cache
def _say_decoded_in_process(device: str) -> None:
    print(f"cnnkit: data.decode: gpu on a {device} device: the main process decodes each batch's "
          "JPEGs there (libjpeg-turbo; the workers only read bytes)", file=sys.stderr)  # fmt: skip


class ImageBatches:
    """A `Batches` stream: uint8 batches from worker processes, augmented on the device."""

    def __init__(self, dataset: BatchDataset, sampler: EpochBatchSampler, augment: CropAugment,
                 device: torch.device, train: bool, workers: int, prefetch: int,
                 num_samples: int, decode: str = "cpu", local_ranks: int = 1) -> None:  # fmt: skip
        self.dataset, self.sampler, self.train = dataset, sampler, train
        self.local_ranks = local_ranks  # the processes on this machine, each with its own ring
        self.device = torch.device(device)
        self.augment = augment.to(self.device)
        self.workers, self.prefetch, self.num_samples = workers, prefetch, num_samples
        self.num_images = len(dataset)
        if workers > (cores := available_cores()):
            say_more_workers_than_cores(workers, cores)
        self.mode: Mode = self._mode(decode)
        self._loader: DataLoader | None = None
        self._ring: SlotRing | None = None
        self._feed = DeviceFeed(self.device) if self.device.type == "cuda" else None
        self._pool = BufferPool() if self.device.type == "cpu" else None
        self._reported: set[str] = set()
        self.validation: ImageBatches | None = None  # its ring comes while this one's lives
        self.grey: torch.Tensor | None = None  # (1, 3, 1, 1) luma weights (ImageSetConfig.finish)

    def _mode(self, decode: str) -> Mode:
        cpu, ds = self.device.type == "cpu", self.dataset
        if decode == "gpu":
            if not ds.jpeg:
                raise ConfigError("data.decode: gpu decodes JPEGs; raw shards need no decoding")
            if self.device.type != "cuda":
                _say_decoded_in_process(str(self.device))
            return "encoded"
        per_channel = self.augment.mean.shape[-1] == 1
        crops = cpu and self.train and ds.crops and per_channel
        if (
            cpu
            and ds.direct
            and not (crops and self.augment.train_crop == "resized" and self.workers)
        ):
            return "views"  # a plain crop in-process beats a worker's copy into shared memory
        return "crops" if crops else "whole"

    def __len__(self) -> int:
        return self.sampler.total()

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Seeded order of `epoch`, starting after `skip_batches` (mid-epoch resume)."""
        self.sampler.set_epoch(epoch, skip_batches)

    def _slot_shape(self) -> tuple[int, ...]:
        side = self.augment.crop if self.mode == "crops" else self.dataset.size
        return (self.sampler.batch, 3, side, side)

    def ring_slots(self) -> int:
        """Shared-memory slots of this stream's ring: every batch in flight (no more than an
        epoch has: a validation set of 7 batches needs no 32 slots of 50 MB), plus two (none
        where batches are views or JPEG bytes)."""
        if self.mode not in ("crops", "whole"):
            return 0
        return min(max(self.workers, 1) * self.prefetch, max(self.sampler.total(), 1)) + 2

    def ring_bytes(self) -> int:
        return self.ring_slots() * math.prod(self._slot_shape())

    def loader(self) -> DataLoader:
        """The torch DataLoader over this stream's jobs; training workers persist across epochs,
        validation workers live only while validating (never two sets busy at once)."""
        if self._loader is None:
            if self.ring_slots():
                also = self.validation.ring_bytes() if self.validation is not None else 0
                what = f"data.workers={self.workers}" + (
                    " (training and validation)" if also else ""
                )
                self._ring = SlotRing(self.ring_slots(), self._slot_shape(),
                                      pin=self._feed is not None, what=what, also=also,
                                      ranks=self.local_ranks)  # fmt: skip
                self.dataset.slots = self._ring.buffers  # set before the workers start
            crops = self.augment if self.mode == "crops" else None
            jobs = JobSampler(self.sampler, self._ring, crops, self.dataset.size,
                              encoded=self.mode == "encoded")  # fmt: skip
            extra = {"prefetch_factor": self.prefetch, "persistent_workers": self.train}
            # its own generator: starting workers draws a seed (unused: they draw nothing random)
            # that would otherwise come from the global one and shift a resumed run's dropout
            with no_worker_count_warning():
                self._loader = DataLoader(self.dataset, batch_size=None, sampler=jobs,
                                          num_workers=self.workers, pin_memory=False,
                                          worker_init_fn=start_worker,
                                          generator=torch.Generator(),
                                          **(extra if self.workers else {}))  # fmt: skip
        return self._loader

    def worker_batches(self) -> Iterator[tuple[torch.Tensor, WorkerBatch]]:
        """(uint8 pixels on the CPU, the record) of each batch of the epoch, bad images reported;
        the pixels may be a slot, valid until the caller releases it (`release`)."""
        for batch in self._started(self.loader()):
            self._report(batch.bad)
            if batch.slot is not None:
                pixels = self._ring.buffers[batch.slot][: len(batch)]
            else:
                pixels = batch.pixels
            yield pixels, batch  # empty where every image was unreadable: still a step (the
            # other ranks of a group take theirs; the position of later batches stays)

    def _started(self, loader: DataLoader) -> Iterator[WorkerBatch]:
        """The loader's batches; shared memory running out (as its workers start: their queues
        and semaphores live in /dev/shm too, or in a worker) and a worker that died (found as
        an epoch's workers resume, or while a batch is awaited) are one line each."""
        try:
            with no_worker_count_warning():
                batches = iter(loader)  # (persistent workers: torch checks them here)
        except (RuntimeError, ConnectionError, EOFError) as e:
            raise self._failed(e, getattr(loader, "_iterator", None)) from None
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise
            raise self._no_shared_memory(e.strerror, "starting the loader's workers") from None
        deaths_found_here(batches)
        try:
            yield from batches
        except (RuntimeError, ConnectionError, EOFError) as e:
            raise self._failed(e, batches) from None

    def _failed(self, e: Exception, batches: Any) -> Exception:
        """The DataError of an error out of the DataLoader (a worker died, a worker ran out of
        shared memory), else `e` itself (a worker's own exception, raised again as torch does)."""
        text = str(e)
        if "in DataLoader worker process" in text and (
            "No space left on device" in text or "unable to write to file" in text
        ):  # torch's words for a worker's full /dev/shm
            return self._no_shared_memory("No space left on device", "in a worker")
        if not worker_died(e):
            return e
        self._end_workers(batches)
        return DataError(f"data.workers={self.workers}: a loader worker process died "
                         f"({one_line(e, 120)}): out of memory, or a crash decoding an "
                         "image; lower data.workers or data.prefetch, or give it more "
                         "memory")  # fmt: skip

    def _no_shared_memory(self, reason: str, where: str) -> DataError:
        return DataError(f"data.workers={self.workers}: shared memory ran out {where} ({reason}): "
                         f"{SHM_ADVICE}")  # fmt: skip

    def _end_workers(self, batches: Any) -> None:
        """Stop the other workers of a loader one of whose died (torch's own clean-up of the
        iterator: `batches`, None where there is none), so that the next epoch starts afresh."""
        try:
            if batches is not None:
                batches._shutdown_workers()
        except Exception:  # noqa: BLE001 - best effort: the DataError says what happened
            pass
        self._loader = None  # a next epoch starts workers afresh

    def release(self, batch: WorkerBatch, copied: torch.cuda.Event | None = None) -> None:
        """The batch's slot is read (or will be once `copied` completes): it may take another."""
        if batch.slot is not None:
            self._ring.release(batch.slot, copied)

    def _report(self, bad: list[tuple[str, str]]) -> None:
        for path, reason in bad:
            if path not in self._reported:
                self._reported.add(path)
                print(f"cnnkit: skipped {path}: {reason}", file=sys.stderr)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.mode == "views":
            for position, batch in enumerate(self.sampler, self.sampler.skip):
                x, y, sources = self.dataset.views(batch)
                yield self._augment(x, position, None, sources), y
        elif self._feed is not None:
            yield from self._feed.overlapped(self._on_device())
        else:
            for position, (pixels, batch) in enumerate(self.worker_batches(), self.sampler.skip):
                if self.mode == "encoded":
                    pixels, batch = decode_batch(pixels, batch, self.dataset, self.device)
                    self._report(batch.bad)
                x = self._augment(pixels.to(self.device), position, batch.alpha, batch.sources)
                self.release(batch)  # normalised into a buffer of its own: the slot is read
                yield x, batch.labels.to(self.device)

    def _on_device(self) -> Iterator:
        """For the DeviceFeed: per batch, a function that copies it to the GPU and augments it
        (run on the side stream), and the labels."""
        for position, (pixels, batch) in enumerate(self.worker_batches(), self.sampler.skip):

            def prepare(pixels=pixels, batch=batch, position=position) -> tuple:
                if self.mode == "encoded":
                    x, batch = decode_batch(pixels, batch, self.dataset, self.device)
                    self._report(batch.bad)
                else:
                    x = pixels.to(self.device, non_blocking=True)
                    self.release(batch, torch.cuda.current_stream(self.device).record_event())
                y = batch.labels.to(self.device, non_blocking=True)
                return self._augment(x, position, batch.alpha, batch.sources), y

            yield prepare

    def _augment(self, x, position: int, alpha: torch.Tensor | None,
                 sources: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if not len(x):  # every image of the batch unreadable (reported): an empty batch
            crop, channels = self.augment.crop, 1 if self.grey is not None else x.shape[1]
            return torch.empty((0, channels, crop, crop), device=self.device)
        x = self._augment_rgb(x, position, alpha, sources)
        return x if self.grey is None else (x * self.grey).sum(1, keepdim=True)

    def _augment_rgb(self, x, position: int, alpha: torch.Tensor | None,
                     sources: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        crop = self.augment.crop
        out = self._pool.take((x.shape[0], x.shape[1], crop, crop)) if self._pool else None
        # while workers decode, main's per-image kernels on many threads only fight them
        busy = self._pool is not None and self.workers > 0 and self.mode != "views"
        with torch_threads(1) if busy else nullcontext():
            if not self.train:
                return self.augment.eval(x, out)
            if alpha is not None:  # cropped by the workers: normalise only
                return self.augment.finish(x, alpha, out)
            g = batch_generator(self.sampler, position)
            params = self.augment.sample(x.shape[0], x.shape[2], x.shape[3], g, sources)
            return self.augment.train(x, params, out)


def build_augment(cfg: ImageSetConfig, stats: dict) -> CropAugment:
    """The CropAugment of a config, given the data's stats: mean (C,) or mean image, std, lighting."""
    image_mean = cfg.normalize == "mean_image"
    mean = torch.as_tensor(
        stats["mean_image"] if image_mean else stats["mean"], dtype=torch.float32
    )
    std = torch.ones(3) if image_mean else torch.as_tensor(stats["std"], dtype=torch.float32)
    eigval, eigvec = stats["lighting"]
    return CropAugment(cfg.crop, cfg.train_crop, cfg.mirror, cfg.lighting, mean, std, eigval,
                       eigvec, scale=cfg.scale)  # fmt: skip


def build_streams(cfg: ImageSetConfig, train: BatchDataset, val: BatchDataset,
                  augment: CropAugment, device: torch.device, rank: int, world_size: int,
                  seed: int, local_ranks: int = 1) -> tuple[ImageBatches, ImageBatches]:  # fmt: skip
    """Train and validation streams for this rank over two batch datasets."""
    local = max(1, cfg.batch_size // world_size)
    local_eval = max(1, (cfg.eval_batch_size or cfg.batch_size) // world_size)
    n_train, n_val = len(train), len(val)
    train_sampler = EpochBatchSampler(n_train, local, rank, world_size, seed, shuffle=True)
    val_sampler = EpochBatchSampler(n_val, local_eval, rank, world_size, seed, shuffle=False)
    per_rank = n_train // world_size
    seen = per_rank - per_rank % local if per_rank >= local else per_rank
    workers = cfg.worker_count(local_ranks)
    common = dict(device=device, workers=workers, prefetch=cfg.prefetch, decode=cfg.decode,
                  local_ranks=local_ranks)  # fmt: skip
    training = ImageBatches(train, train_sampler, augment, train=True,
                            num_samples=seen * world_size, **common)  # fmt: skip
    training.validation = ImageBatches(val, val_sampler, augment, train=False, num_samples=n_val,
                                       **common)  # fmt: skip
    return training, training.validation
