"""The loader's worker processes, as the main process sees them: how each starts (one torch
thread, the slot ring mapped by itself), how many there are against the cores, and how a
worker's death is told from an exception it raised, and found inside the stream.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import get_worker_info

from cnnkit.data.slots import mapped_afresh
from cnnkit.errors import plural


@contextmanager
def no_worker_count_warning() -> Iterator[None]:
    """torch's advice on the worker count (a multi-line warning, printed at every start) hidden;
    ImageBatches says it once, in a line (say_more_workers_than_cores)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*suggested max number of worker")
        yield


@functools.cache
def say_more_workers_than_cores(workers: int, cores: int) -> None:
    """Said in the loader's words, not a setting's: `train` sets data.workers, `bench loader`
    --workers."""
    print(f"cnnkit: note: {plural(workers, 'loader worker')} are more than the "
          f"{plural(cores, 'core')} this process may use: they take turns (the default is one "
          "fewer than the cores)", file=sys.stderr)  # fmt: skip


def start_worker(worker_id: int) -> None:
    """A loader worker: one torch thread (one core's worth of decoding), and the ring of slots
    mapped by the worker itself (slots.mapped_afresh: a page-locked parent mapping may not
    survive the fork)."""
    torch.set_num_threads(1)
    dataset = get_worker_info().dataset
    if dataset.slots is not None:
        dataset.slots = mapped_afresh(dataset.slots)


def worker_died(e: BaseException) -> bool:
    """Whether an error out of a DataLoader's iterator says a worker process ended (the OOM
    killer, a crash): torch's words for it, or a batch's shared memory that could not be
    fetched from a worker gone; not an exception a worker raised that torch raises again."""
    text = str(e)
    if "in DataLoader worker process" in text:  # "Caught ValueError in DataLoader worker ..."
        return False
    return isinstance(e, (ConnectionError, EOFError)) or "DataLoader worker" in text


def deaths_found_here(batches: Any) -> None:
    """torch's SIGCHLD handler raises a dead worker's RuntimeError wherever the main process
    happens to be (most often in the training step, past this stream's one-line DataError).
    With the workers' pids off its list, torch finds the death where a batch is awaited
    (within seconds: it polls the workers while waiting), inside the stream. A private torch
    list: where it is missing, the handler stays as it is."""
    try:
        if getattr(batches, "_worker_pids_set", False):
            torch.utils.data._utils.signal_handling._remove_worker_pids(id(batches))
            batches._worker_pids_set = False
    except (AttributeError, RuntimeError, ValueError):
        pass
