"""Checkpoints off the training step's critical path: the state is snapshotted (copied to host
memory) between two steps and written on a background thread, one checkpoint after another,
each to a temporary file renamed into place (a kill mid-write leaves the previous one). Mid-epoch
saves come every N steps and/or about every M minutes, on steps all ranks agree on.
"""

from __future__ import annotations

import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch

from cnnkit.checkpoint import save_checkpoint
from cnnkit.distributed import Processes

CALIBRATION = (10, 30)  # steps between which the step time is measured (after warm-up)
BACKGROUND_BYTES = 64 * 2**20  # smaller states are written at once: a thread would gain nothing


def snapshot(obj: Any) -> Any:
    """A deep copy in host memory: tensors copied to the CPU, containers rebuilt (the live
    model and optimizer may change under a writer thread)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj


def tensor_bytes(obj: Any) -> int:
    """Bytes of all tensors in a nested state."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class CheckpointWriter:
    """Writes (state, path) pairs in order on one background thread (states under
    BACKGROUND_BYTES at once: a tiny net's save costs less than starting a thread)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, *items: tuple[dict[str, Any], Path]) -> None:
        """Snapshot now, write in the background (after any write still in progress)."""
        copies = [(snapshot(state), Path(path)) for state, path in items]
        self.wait()
        if sum(tensor_bytes(state) for state, _ in copies) < BACKGROUND_BYTES:
            self._write(copies)
            self.wait()
            return
        self._thread = threading.Thread(target=self._write, args=(copies,), daemon=False)
        self._thread.start()

    def _write(self, items: list[tuple[dict[str, Any], Path]]) -> None:
        """One save's files in order; where one fails, those of them that had no earlier
        version are removed again: a first epoch's best.pt without its last.pt (a full disk)
        would leave a run that had trained, yet had nothing to resume from."""
        written: list[Path] = []
        try:
            for state, path in items:
                new = not path.exists()
                save_checkpoint(state, path)
                written += [path] if new else []
        except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
            for path in written:
                with suppress(OSError):
                    path.unlink()
            self._error = e

    def wait(self) -> None:
        """Block until the last write is on disk; raise what it raised (a full disk...)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class MidEpochSaves:
    """When to save last.pt inside an epoch: every `every` steps, and/or about every `minutes`
    (converted to steps from the step time rank 0 measures early on, then sent to every rank,
    so all ranks reach the same decision without a collective per step)."""

    def __init__(self, every: int, minutes: float, dist: Processes) -> None:
        self.every, self.seconds, self.dist = every, minutes * 60, dist
        self.interval: int | None = None  # steps between timed saves, once measured
        self.next_step = 0
        self._steps, self._t0 = 0, 0.0
        self.pending = False  # a save fell due while the replicas differed (sync: average)

    def due(self, global_step: int, step: int, steps: int, synced: bool = True) -> bool:
        """Whether to save after this step (`step` of `steps` in the epoch: the epoch's own
        save follows its last step). `synced`: whether the replicas are equal after it; a
        save that falls due while they are not waits for the next step where they are."""
        self._steps += 1
        timed = self.seconds > 0 and self._timed(global_step)
        by_count = bool(self.every) and global_step % self.every == 0
        self.pending = (self.pending or timed or by_count) and step < steps
        if self.pending and synced:
            self.pending = False
            return True
        return False

    def _timed(self, global_step: int) -> bool:
        if self.interval is None:
            self._calibrate(global_step)
            return False
        if global_step >= self.next_step:
            self.next_step = global_step + self.interval
            return True
        return False

    def _calibrate(self, global_step: int) -> None:
        first, last = CALIBRATION
        if self._steps == first:
            self._t0 = time.perf_counter()
        elif self._steps == last:
            per_step = (time.perf_counter() - self._t0) / (last - first)
            interval = max(1, round(self.seconds / max(per_step, 1e-9)))
            self.interval = int(self.dist.broadcast_object(interval))  # rank 0's, everywhere
            self.next_step = global_step + self.interval
