"""torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*, TORCHELASTIC_*): whether this
process was launched in a group, the variables read as checked values, the job's id and
restarts."""

from __future__ import annotations

import os
from typing import Any

from cnnkit.errors import ConfigError, brief

GROUP_VARIABLES = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}  # -> a process alone's


def launched() -> bool:
    """True inside a torchrun worker (RANK, WORLD_SIZE and LOCAL_RANK set). Some of them set
    to what names a group (RANK=1, WORLD_SIZE=4), the others not: a ConfigError, as torch's
    env:// rendezvous refuses it, not one process training alone as if it were the group."""
    given = [name for name in GROUP_VARIABLES if name in os.environ]
    if len(given) == len(GROUP_VARIABLES):
        return True
    grouped = [n for n in given if os.environ[n].strip() != GROUP_VARIABLES[n]]
    if grouped:
        missing = " and ".join(n for n in GROUP_VARIABLES if n not in given)
        name = grouped[0]
        raise ConfigError(f"{name}={brief(os.environ[name])} is set but {missing} not: a process "
                          "of a group needs RANK, WORLD_SIZE and LOCAL_RANK (torchrun sets them "
                          f"all); unset {name} to train alone")  # fmt: skip
    return False


TORCHRUN_VARIABLES = "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"


def env_text(name: str) -> str:
    """A torchrun variable that must be set (MASTER_ADDR): one clear line where it is not."""
    value = os.environ.get(name, "").strip()
    if not value:
        raise ConfigError(f"{name} is not set: a process of a group needs {TORCHRUN_VARIABLES} "
                          "(torchrun sets them all)")  # fmt: skip
    return value


def env_number(name: str, least: int, most: int | None = None, default: str | None = None) -> int:
    """A torchrun variable as a whole number from `least` to `most`: one clear line where it is
    missing or is not one (set by hand, or by a launcher other than torchrun)."""
    value = os.environ.get(name, default)
    if value is None:
        env_text(name)  # (raises: not set)
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < least or (most is not None and number > most):
        span = f"from {least} to {most}" if most is not None else f"of {least} or more"
        raise ConfigError(f"{name}={brief(value)}: expected a whole number {span} (torchrun sets "
                          f"{TORCHRUN_VARIABLES} for each process it starts)")  # fmt: skip
    return number


def restart_count() -> int:
    """How many times torchrun restarted this group (elastic restarts; 0 on the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def is_rank0() -> bool:
    """Whether this process is rank 0 of its torchrun group, or alone (before the group is
    joined: for what only one process should say)."""
    return os.environ.get("RANK", "0") == "0"


def resume_command(run_dir: Any, world_size: int) -> str:
    """How to continue a run stopped mid-epoch: in as many processes as it had (a mid-epoch
    checkpoint of N processes resumes in N only)."""
    if world_size == 1:
        return f"`cnnkit train --resume {run_dir}`"
    if os.environ.get("CNNKIT_NPROC"):  # started by `cnnkit train --nproc N` (cnnkit.agent)
        return f"`cnnkit train --resume {run_dir} --nproc {world_size}`"
    return f"`cnnkit train --resume {run_dir}` under the same torchrun ({world_size} processes)"


def run_id() -> str | None:
    """torchrun's id of this job (the same on every rank and across restarts)."""
    value = os.environ.get("TORCHELASTIC_RUN_ID")
    return value if value and value != "none" else None
