"""Memory the loader makes once and reuses: the ring of shared-memory batch slots that workers
write into (page-locked when batches go to a GPU), and the CPU float buffers of augmentation.

A fresh 50-100 MB tensor per batch costs more in page faults than decoding it; a slot is
mapped once by every process, so a batch crosses from a worker to the main process as a
number, and on CUDA goes to the device in one asynchronous copy straight from the slot.
"""

from __future__ import annotations

import math
import os
import sys
from collections import deque

import torch
from torch.multiprocessing import get_sharing_strategy
from torch.utils.data import get_worker_info

from cnnkit.errors import DataError

SHM = "/dev/shm"


def in_shared_memory(shape: tuple[int, ...]) -> torch.Tensor:
    """An empty uint8 tensor in shared memory (other processes map it; nothing is copied)."""
    storage = torch.UntypedStorage._new_shared(math.prod(shape))
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)


def mapped_afresh(memory: torch.Tensor) -> torch.Tensor:
    """`memory` (made by `in_shared_memory`) mapped anew in this process, from the file behind it.

    A forked loader worker inherits the parent's mapping of the ring, unless the parent's
    mapping was page-locked by a driver that marks such memory MADV_DONTFORK (ROCm's did;
    whether NVIDIA's does is not documented): then the child has no mapping there and dies on
    its first write. The shared-memory file (its descriptor) is always inherited. Under the
    file_system sharing strategy, or where this torch lacks the (private) calls, the inherited
    mapping is kept.
    """
    if get_sharing_strategy() != "file_descriptor":  # (file_system: a mapping made anew would
        return memory  # count as a user of the file, which would then outlive the process)
    try:
        fd, size = memory.untyped_storage()._share_fd_cpu_()
        fresh = torch.UntypedStorage._new_shared_fd_cpu(fd, size)
    except (AttributeError, RuntimeError, TypeError):
        return memory
    return torch.empty(0, dtype=memory.dtype).set_(fresh).view(memory.shape)


def new_batch(n: int, size: int, channels: int = 3) -> torch.Tensor:
    """An empty uint8 (n, C, size, size) batch. In a loader worker it lives in shared memory
    already, so handing it to the main process sends a file descriptor and copies nothing."""
    shape = (n, channels, size, size)
    if get_worker_info() is None:
        return torch.empty(shape, dtype=torch.uint8)
    return in_shared_memory(shape)


SHM_ADVICE = ("give the container more /dev/shm (docker run --shm-size=8g), or lower "
              "data.workers, data.prefetch or data.batch_size")  # fmt: skip
SHM_MARGIN = 4 * 2**20  # the DataLoader's own use: semaphores, each batch's labels


def check_shared_memory(needed: int, what: str, path: str = SHM, ranks: int = 1) -> None:
    """One clear line, not a bus error later, when `path` has less room than `needed` bytes
    plus the DataLoader's own margin, for each of the `ranks` processes of this machine: their
    rings are made at about the same time and take their pages only as batches fill them, so
    none of them sees the others' in the free space."""
    try:
        stat = os.statvfs(path)
    except OSError:  # no /dev/shm (not Linux): torch uses its own mechanism
        return
    free, each = stat.f_bavail * stat.f_frsize, needed + SHM_MARGIN
    if each * ranks > free:
        many = (f" in each of the {ranks} processes on this machine ({_mib(each * ranks)} in "
                "all)") if ranks > 1 else ""  # fmt: skip
        raise DataError(f"{what} needs {_mib(each)} of shared memory{many} but {path} has "
                        f"{_mib(free)} free: {SHM_ADVICE}")  # fmt: skip


def _mib(n: int) -> str:
    """Bytes as MiB, with a decimal where a whole number would hide the difference."""
    return f"{n / 2**20:,.1f} MiB" if n < 100 * 2**20 else f"{n / 2**20:,.0f} MiB"


class SlotRing:
    """`count` uint8 batch buffers of `shape` (B, C, H, W) in shared memory, made once (in this
    process's own memory, not `shared`, where no worker process writes them).

    The main process takes a free slot for each job it sends (or None when all are in
    flight: the worker then makes fresh memory) and releases it once the batch is read; on
    CUDA the release waits for the copy's event. With `pin`, the ring is page-locked
    (cudaHostRegister), so the host-to-device copy is asynchronous and needs no staging.
    """

    def __init__(self, count: int, shape: tuple[int, ...], pin: bool = False, what: str = "loader",
                 also: int = 0, ranks: int = 1, shared: bool = True):  # fmt: skip
        """`also`: bytes of another ring that will be made while this one lives (validation's,
        next to training's), checked against /dev/shm now, before any worker starts, for each
        of the `ranks` processes on this machine."""
        shape = (count, *shape)
        if shared or also:
            check_shared_memory(math.prod(shape) * shared + also, what, ranks=ranks)
        self.buffers = in_shared_memory(shape) if shared else torch.empty(shape, dtype=torch.uint8)
        self.free: deque[int] = deque(range(count))
        self.copying: deque[tuple[int, torch.cuda.Event]] = deque()  # slot, copy-done event
        self.pinned = pin and _register(self.buffers)
        if pin and not self.pinned:
            print(f"cnnkit: note: {what}: CUDA could not page-lock the loader's shared memory "
                  "(cudaHostRegister failed): each batch's copy to the GPU is staged and "
                  "synchronous, so loading overlaps less with training", file=sys.stderr)  # fmt: skip

    def take(self) -> int | None:
        """A free slot, or None when every one is in flight."""
        while self.copying and self.copying[0][1].query():  # copies finished since
            self.free.append(self.copying.popleft()[0])
        return self.free.popleft() if self.free else None

    def release(self, slot: int, copied: torch.cuda.Event | None = None) -> None:
        """The batch in `slot` has been read (or will be once `copied` completes)."""
        if copied is None:
            self.free.append(slot)
        else:
            self.copying.append((slot, copied))

    def reset(self) -> None:
        """Every slot free (a new epoch: the workers have drained)."""
        for _, event in self.copying:
            event.synchronize()
        self.free, self.copying = deque(range(len(self.buffers))), deque()

    def close(self) -> None:
        """Undo the page-locking (before the memory is unmapped)."""
        if self.pinned:
            torch.cuda.synchronize()
            self.pinned = False
            err = torch.cuda.cudart().cudaHostUnregister(self.buffers.data_ptr())
            if err is not None and int(err) != 0:  # not left as CUDA's "last error" either
                _clear_cuda_error()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: CUDA may be gone already
            pass


def _register(buffers: torch.Tensor) -> bool:
    """Page-lock shared memory for asynchronous copies; False where CUDA cannot."""
    if not torch.cuda.is_available():
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(buffers.data_ptr(), buffers.numel(), 0)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return False
    if err is None or int(err) == 0:  # cudaSuccess (some builds return nothing)
        return True
    _clear_cuda_error()
    return False


def _clear_cuda_error() -> None:
    """A failed cudaHostRegister stays CUDA's "last error", which torch reads after its next
    kernel launch and raises there, in unrelated code. One throw-away launch reads and clears
    it here (the registration errors are not sticky)."""
    try:
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass


class BufferPool:
    """Float output buffers on the CPU, reused once nothing else references them: a fresh
    100+ MB tensor costs more in page faults than the whole augmentation. A buffer the caller
    still holds (a variable, a view, autograd) is never reused; a new one is made instead.

    Telling "nobody holds it" needs torch's private storage use count; where a torch build
    lacks it (`supported()` is False) every take makes a fresh buffer (correct, slower).
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.reuse = self.supported()
        self._buffers: list[torch.Tensor] = []
        self._idle: list[tuple[int, int]] = []  # reference counts of each buffer when unused

    @staticmethod
    def supported() -> bool:
        """Whether this torch exposes what reuse needs (checked, never assumed)."""
        probe = torch.empty(1)
        try:
            torch._C._storage_Use_Count(probe.untyped_storage()._cdata)
            probe._use_count()
        except (AttributeError, RuntimeError, TypeError):
            return False
        return True

    def _refs(self, i: int) -> tuple[int, int]:
        buf = self._buffers[i]
        users = torch._C._storage_Use_Count(buf.untyped_storage()._cdata)
        return sys.getrefcount(buf) + 100 * buf._use_count(), users

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A float32 buffer of `shape` that nobody else uses."""
        if not self.reuse:
            return torch.empty(shape)
        for i in range(len(self._buffers)):  # indices, not items: no loop variable holds one
            if self._buffers[i].shape == shape and self._refs(i) == self._idle[i]:
                return self._buffers[i]
        drop = max(0, len(self._buffers) - self.keep + 1)  # room for the new one: `keep` at most
        del self._buffers[:drop], self._idle[:drop]
        self._buffers.append(torch.empty(shape))
        self._idle.append(self._refs(len(self._buffers) - 1))
        return self._buffers[-1]
