"""The processes training runs in, as training sees them: the `Processes` protocol, `Local`
(one process alone) and `on_rank0` (a check rank 0 makes, its error raised on every rank)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from cnnkit.distributed.device import resolve_device
from cnnkit.errors import ConfigError


class Processes(Protocol):
    """The processes training runs in: this one's rank, the collectives, the model wrapper."""

    rank: int
    world_size: int
    local_world_size: int  # processes on this machine (they share its cores)
    is_main: bool  # rank 0: prints and writes the run directory

    def device(self, name: str) -> torch.device: ...  # this process's device for `train.device`

    def wrap(self, model: nn.Module) -> nn.Module: ...  # DDP, or the model itself

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...  # sum over ranks, in place

    def gather(self, obj: Any) -> list[Any]: ...  # every rank's obj, rank order

    def broadcast_object(self, obj: Any) -> Any: ...  # rank 0's obj on every rank

    def agree(self, flags: Sequence[bool], every: int = 1) -> tuple[list[bool], int]: ...  # any

    # rank's, flag by flag; the fewest steps any rank proposes

    def synced(self, global_step: int, epoch_end: bool = False) -> bool: ...  # replicas equal

    def after_step(self, engine: Any, global_step: int, epoch_end: bool = False) -> None: ...

    def average(self, engine: Any) -> None: ...  # sync "average": make the replicas equal now


class Local:
    """One process alone: rank 0 of 1, no collectives."""

    rank, world_size, local_world_size, is_main = 0, 1, 1, True

    def device(self, name: str) -> torch.device:
        return resolve_device(name, "train.device")

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def agree(self, flags: Sequence[bool], every: int = 1) -> tuple[list[bool], int]:
        return list(flags), every

    def synced(self, global_step: int, epoch_end: bool = False) -> bool:
        return True

    def after_step(self, engine: Any, global_step: int, epoch_end: bool = False) -> None:
        """Nothing to average alone."""

    def average(self, engine: Any) -> None:
        """Nothing to average alone."""


def on_rank0(dist: Processes, check: Callable[[], Any]) -> None:
    """`check` on rank 0 only (the run directory is rank 0's), its ConfigError raised on every
    rank at once: the others stop there too, quietly (not with "lost a peer process" when
    rank 0 ends), and none goes on into a collective that rank 0 never reaches."""
    error = None
    if dist.is_main:
        try:
            check()
        except ConfigError as e:
            error = e
    if dist.world_size > 1:
        message = dist.broadcast_object(None if error is None else str(error))
        if message is not None and error is None:
            error = ConfigError(message)
    if error is not None:
        raise error
