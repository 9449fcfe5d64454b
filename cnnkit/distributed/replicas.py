"""What keeps a group's replicas one model: tensors averaged over ranks in place, and BatchNorm
swapped for SyncBatchNorm."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def average_in_place(tensors: list[torch.Tensor], world_size: int) -> None:
    """Average tensors over ranks in place: one all-reduce per dtype and device, each tensor
    keeping its storage and memory format (channels_last stays channels_last)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        flat = _flatten_dense_tensors(group)  # a contiguous copy, logical order
        dist.all_reduce(flat)
        flat.div_(world_size)
        for t, mean in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
            t.copy_(mean)  # element by element: t's own strides are kept


def convert_sync_batchnorm(network: nn.Module) -> None:
    """Swap BatchNorm layers for SyncBatchNorm in place."""
    for name, module in list(network.named_modules()):
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            synced = nn.SyncBatchNorm.convert_sync_batchnorm(module)
            parent_name, _, leaf = name.rpartition(".")
            network.get_submodule(parent_name).add_module(leaf, synced)
