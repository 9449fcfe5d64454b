"""Feeding a CUDA device: each batch is copied and augmented on a side stream (made once) while
the model computes on the previous one, then handed to the compute stream."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

Prepare = Callable[[], tuple[torch.Tensor, ...]]  # run on the side stream: tensors on the GPU


class DeviceFeed:
    """Overlaps host-to-device copies and augmentation with compute, one batch ahead."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def overlapped(self, batches: Iterator[Prepare]) -> Iterator[tuple[torch.Tensor, ...]]:
        """Run each batch's `prepare` on the side stream while the caller computes on the batch
        before it; yield its tensors once they may be used on the current stream."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # e.g. mean/std made there
        pending = None
        for prepare in batches:
            with torch.cuda.stream(self.stream):
                staged = prepare(), self.stream.record_event()
            if pending is not None:
                yield self._hand_over(*pending)
            pending = staged
        if pending is not None:
            yield self._hand_over(*pending)

    def _hand_over(self, batch: tuple[torch.Tensor, ...], ready: torch.cuda.Event) -> tuple:
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready)
        for t in batch:
            t.record_stream(current)  # memory made on the side stream is now used on this one
        return batch
