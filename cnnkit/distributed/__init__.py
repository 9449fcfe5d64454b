"""The only package that touches torch.distributed or torchrun's variables (RANK, WORLD_SIZE,
LOCAL_RANK, TORCHELASTIC_*): process group, DDP or periodic weight averaging, collectives.
`Processes` is what training needs of them; `Local` (one process) and `Group` (torchrun)
implement it. `resolve_device` is cnnkit's one rule for turning a device name into a device.

    torchrun --standalone --nproc_per_node=2 -m cnnkit train digits --out runs/digits-ddp
    cnnkit train digits --nproc 2          # the same, started for you
"""

from cnnkit.distributed.device import DEVICE_HELP, group_device_name, resolve_device
from cnnkit.distributed.environment import (
    GROUP_VARIABLES,
    TORCHRUN_VARIABLES,
    env_number,
    env_text,
    is_rank0,
    launched,
    restart_count,
    resume_command,
    run_id,
)
from cnnkit.distributed.group import Group, group_for
from cnnkit.distributed.processes import Local, Processes, on_rank0
from cnnkit.distributed.replicas import average_in_place, convert_sync_batchnorm

__all__ = [
    "DEVICE_HELP",
    "GROUP_VARIABLES",
    "TORCHRUN_VARIABLES",
    "Group",
    "Local",
    "Processes",
    "average_in_place",
    "convert_sync_batchnorm",
    "env_number",
    "env_text",
    "group_device_name",
    "group_for",
    "is_rank0",
    "launched",
    "on_rank0",
    "restart_count",
    "resolve_device",
    "resume_command",
    "run_id",
]
