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
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader

from cnnkit.data.augment import CropAugment
from cnnkit.data.batch import BatchDataset, WorkerBatch
from cnnkit.data.device_decode import decode_batch
from cnnkit.data.feed import DeviceFeed
from cnnkit.data.imageset import ImageSetConfig
from cnnkit.data.sampling import EpochBatchSampler, JobSampler, batch_generator
from cnnkit.data.slots import SHM_ADVICE, BufferPool, SlotRing, check_shared_memory
from cnnkit.data.workers import (
    deaths_found_here,
    no_worker_count_warning,
    say_more_workers_than_cores,
    start_worker,
    worker_died,
)
from cnnkit.errors import ConfigError, DataError, one_line
from cnnkit.runtime import available_cores, torch_threads

Mode = Literal["views", "crops", "whole", "encoded"]


@functools.cache
def _say_decoded_in_process(device: str) -> None:
    print(f"cnnkit: note: data.decode: gpu on a {device} device: the main process decodes each batch's "
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
        self.mode: Mode = self._mode(decode)
        if workers > (cores := available_cores()) and self.mode != "views":  # (views: none start)
            say_more_workers_than_cores(workers, cores)
        self._loader: DataLoader | None = None
        self._early: Iterator[WorkerBatch] | None = None  # a pass begun by start_workers
        self._early_order: tuple[int, int] = (0, 0)  # the (epoch, skip) it was begun for
        self._passes = 0  # begun by the DataLoader (its persistent workers) so far
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
        return (self.sampler.largest(), 3, side, side)  # (a set smaller than a batch: its own)

    def processes(self) -> int:
        """The worker processes this stream starts: data.workers, but none where batches are
        views or the stream has no images (a bench's empty held-out split, a rank with none)."""
        return 0 if self.mode == "views" or not self.sampler.total() else self.workers

    def ring_slots(self) -> int:
        """Slots of this stream's ring: every batch in flight (no more than an epoch has: a
        validation set of 7 batches needs no 32 slots of 50 MB), plus two; two where no
        workers start (none where batches are views or JPEG bytes, or there are no images)."""
        if self.mode not in ("crops", "whole") or not self.sampler.largest():
            return 0
        if not self.processes():
            return 2
        return min(self.workers * self.prefetch, max(self.sampler.total(), 1)) + 2

    def shared_bytes(self) -> int:
        """The /dev/shm bytes of the ring: none where no workers start (this process's memory)."""
        return self.ring_slots() * math.prod(self._slot_shape()) if self.processes() else 0

    def _ring_needs(self) -> tuple[str, int]:
        """Who the ring is for, and the bytes of validation's, made while this one lives."""
        also = self.validation.shared_bytes() if self.validation is not None else 0
        return f"data.workers={self.workers}" + (" (training and validation)" if also else ""), also

    def check_room(self) -> None:
        """The shared memory this stream's ring will take (and validation's beside it), checked
        now: a training run does before it writes anything, not when its first epoch starts
        (a refused resume had rewritten config.yaml by then)."""
        what, also = self._ring_needs()
        if self.shared_bytes() + also:
            check_shared_memory(self.shared_bytes() + also, what, ranks=self.local_ranks)

    def loader(self) -> DataLoader:
        """The torch DataLoader over this stream's jobs. Its workers persist across epochs, the
        validation ones idle while training (but for reading the first validation's batches
        ahead), both forked as the first epoch starts (start_workers): a fork while another
        thread holds CPython's thread-state lock hangs the child on Python 3.10-3.11
        (validation's, forked afresh every epoch, left a --nproc run waiting for good now and
        then)."""
        if self._loader is None:
            if self.ring_slots():
                what, also = self._ring_needs()
                self._ring = SlotRing(self.ring_slots(), self._slot_shape(),
                                      pin=self._feed is not None, what=what, also=also,
                                      ranks=self.local_ranks, shared=self.processes() > 0)  # fmt: skip
                self.dataset.slots = self._ring.buffers  # set before the workers start
            crops = self.augment if self.mode == "crops" else None
            jobs = JobSampler(self.sampler, self._ring, crops, self.dataset.size,
                              encoded=self.mode == "encoded")  # fmt: skip
            workers = self.processes()
            extra = {"prefetch_factor": self.prefetch, "persistent_workers": True}
            # its own generator: starting workers draws a seed (unused: they draw nothing random)
            # that would otherwise come from the global one and shift a resumed run's dropout
            with no_worker_count_warning():
                self._loader = DataLoader(self.dataset, batch_size=None, sampler=jobs,
                                          num_workers=workers, pin_memory=False,
                                          worker_init_fn=start_worker,
                                          generator=torch.Generator(),
                                          **(extra if workers else {}))  # fmt: skip
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

    def start_workers(self) -> None:
        """Fork the workers now, their first pass begun (its batches read ahead): validation's
        as training's first epoch starts, so that both sets are forked together, while the
        process is young (its pages, which the idle workers keep while training rewrites
        them, are then the ones training's workers keep too)."""
        if not self.processes() or self._early is not None:
            return
        loader = self.loader()
        if not self._passes:
            self._early_order = (self.sampler.epoch, self.sampler.skip)
            self._early = self._begun(loader)

    def _started(self, loader: DataLoader) -> Iterator[WorkerBatch]:
        """The loader's batches; shared memory running out (as its workers start: their queues
        and semaphores live in /dev/shm too, or in a worker) and a worker that died (found as
        an epoch's workers resume, or while a batch is awaited) are one line each."""
        if self.validation is not None and not self._passes:
            self.validation.start_workers()  # training's first epoch: both sets forked now
        if self._early_order != (self.sampler.epoch, self.sampler.skip):
            self._early = None  # set_epoch since: that pass's batches are not this one's
        batches = self._early if self._early is not None else self._begun(loader)
        self._early = None
        try:
            yield from batches
        except (RuntimeError, ConnectionError, EOFError) as e:
            raise self._failed(e, batches) from None

    def _begun(self, loader: DataLoader) -> Iterator[WorkerBatch]:
        """iter(loader): the workers started, or woken (persistent ones), for a pass."""
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
        self._passes += 1
        return batches

    def _failed(self, e: Exception, batches: Any) -> Exception:
        """The DataError of an error out of the DataLoader (a worker died, a worker ran out of
        shared memory), else `e` itself (a worker's own exception, raised again as torch does)."""
        text = str(e)
        if "in DataLoader worker process" in text and (
            "No space left on device" in text or "unable to write to file" in text
        ):  # torch's words for a worker's full /dev/shm
            self._end_workers(batches)  # (not left to the collector: 5 s a worker at exit)
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
        """Stop the workers of a loader one of whose died or ran out of shared memory (torch's
        own clean-up of the iterator: `batches`, None where there is none), so that the next
        epoch starts afresh."""
        try:
            if batches is not None:
                batches._shutdown_workers()
        except Exception:  # noqa: BLE001 - best effort: the DataError says what happened
            pass
        self._loader, self._early, self._passes = None, None, 0  # a next epoch starts afresh

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
                    pixels, batch = decode_batch(batch, self.dataset, self.device)
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
                    x, batch = decode_batch(batch, self.dataset, self.device)
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
        busy = self._pool is not None and self.processes() > 0
        with torch_threads(1) if busy else nullcontext():
            if not self.train:
                return self.augment.eval(x, out)
            if alpha is not None:  # cropped by the workers: normalise only
                return self.augment.finish(x, alpha, out)
            g = batch_generator(self.sampler, position)
            params = self.augment.sample(x.shape[0], x.shape[2], x.shape[3], g, sources)
            return self.augment.train(x, params, out)


def build_streams(cfg: ImageSetConfig, train: BatchDataset, val: BatchDataset,
                  augment: CropAugment, device: torch.device, rank: int, world_size: int,
                  seed: int, local_ranks: int = 1) -> tuple[ImageBatches, ImageBatches]:  # fmt: skip
    """Train and validation streams for this rank over two batch datasets."""
    local = max(1, cfg.batch_size // world_size)
    local_eval = max(1, (cfg.eval_batch_size or cfg.batch_size) // world_size)
    n_train, n_val = len(train), len(val)
    train_sampler = EpochBatchSampler(n_train, local, rank, world_size, seed, shuffle=True)
    val_sampler = EpochBatchSampler(n_val, local_eval, rank, world_size, seed, shuffle=False)
    workers = cfg.worker_count(local_ranks)
    common = dict(device=device, workers=workers, prefetch=cfg.prefetch, decode=cfg.decode,
                  local_ranks=local_ranks)  # fmt: skip
    training = ImageBatches(train, train_sampler, augment, train=True,
                            num_samples=train_sampler.images() * world_size, **common)  # fmt: skip
    training.validation = ImageBatches(val, val_sampler, augment, train=False, num_samples=n_val,
                                       **common)  # fmt: skip
    return training, training.validation
