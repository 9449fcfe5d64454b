"""What a run holds while it trains (`RunContext`) and what its checkpoints save and restore:
the inference contract (network, classes, preprocessing) plus the exact training state."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cnnkit.checkpoint import rng_state
from cnnkit.config import RunConfig, run_dict
from cnnkit.data import DataBundle
from cnnkit.distributed import Processes
from cnnkit.errors import CheckpointError, one_line
from cnnkit.nn.weights import check_finite_weights
from cnnkit.train.engine import Engine
from cnnkit.train.loop import Progress
from cnnkit.train.metrics import RunLog
from cnnkit.train.optim import Schedule


@dataclass
class RunContext:
    """What every part of a run reads: the config, the data, the processes, where it writes."""

    config: RunConfig
    data: DataBundle
    dist: Processes
    run_dir: Path
    log: RunLog | None  # rank 0's writer of the run directory (None on other ranks)
    started: float  # time.perf_counter() at the start of this session


def training_state(
    engine: Engine, schedule: Schedule, progress: Progress, ctx: RunContext,
    ranks: list[tuple] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Everything a checkpoint holds: the inference contract plus the exact training state
    (`ranks`: each rank's generator states, statistics of the epoch so far and, mid-epoch, its
    moving average's floating buffers; rank 0 first)."""
    ranks = ranks or [(rng_state(), progress.epoch_stats())]
    rngs = [rank[0] for rank in ranks]
    averaged = {}
    if ctx.data.mean_image is not None:  # normalize: mean_image: classify subtracts it too
        averaged["mean_image"] = ctx.data.mean_image.detach().to("cpu", torch.float32)
    if engine.ema is not None:  # the moving average beside the raw weights
        averaged |= {"ema": plain_state_dict(engine.ema.module),
                    "ema_count": int(engine.ema.n_averaged.item())}  # fmt: skip
        buffers = [rank[2] for rank in ranks if len(rank) > 2 and rank[2]]
        if len(ranks) > 1 and len(buffers) == len(ranks):
            averaged["ema_buffer_ranks"] = buffers
    return averaged | {
        "model_spec": engine.network.spec,
        "num_classes": engine.network.num_classes,
        "model": plain_state_dict(engine.network),
        "classes": list(ctx.data.classes),
        "holdout": ctx.data.holdout,
        "preprocess": ctx.data.preprocess.to_dict(),
        "config": run_dict(ctx.config),
        "optimizer": engine.optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "scaler": engine.scaler.state_dict(),
        "epoch": progress.epoch,
        "step": progress.step,
        "global_step": progress.global_step,
        "best_top1": progress.best_top1,
        "seconds": progress.seconds + time.perf_counter() - ctx.started,
        "history": list(progress.history),
        "run_id": progress.run_id,  # (resume_state: last.pt and best.pt of one run)
        "partial": progress.epoch_stats(),
        "partial_ranks": [rank[1] for rank in ranks],
        "rng": rngs[0],
        "rng_ranks": rngs,
        "settings": {**engine.settings.saved(), "device": engine.device.type},
    }


def ema_buffers(engine: Engine) -> dict[str, torch.Tensor]:
    """The moving average's floating buffers (BatchNorm statistics) on the CPU; {} without."""
    if engine.ema is None:
        return {}
    return {k: v.detach().float().cpu() for k, v in engine.ema.module.named_buffers()
            if v.is_floating_point()}  # fmt: skip


def load_ema_buffers(engine: Engine, saved: dict[str, torch.Tensor]) -> None:
    """Put one rank's saved moving-average buffers back (see ema_buffers)."""
    own = dict(engine.ema.module.named_buffers())
    if set(saved) - set(own):
        raise CheckpointError(f"last.pt: moving-average buffers {sorted(set(saved) - set(own))} "
                              "are not this network's")  # fmt: skip
    with torch.no_grad():
        for name, value in saved.items():
            own[name].copy_(value)


def plain_state_dict(network: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors on the CPU, contiguous, floats as fp32 (portable across devices)."""
    out = {}
    for k, v in network.state_dict().items():
        v = v.detach()
        out[k] = (v.float() if v.is_floating_point() else v).contiguous().cpu()
    return out


def match_param_layout(optimizer: torch.optim.Optimizer) -> None:
    """Give each parameter's optimizer state (momenta, Adam's averages) the parameter's memory
    format: a checkpoint saved in another format (channels_last on one device, NCHW on another)
    loads with its own strides, which fused and foreach kernels want equal to the parameter's."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if not torch.is_tensor(value) or value.shape != p.shape:
                    continue  # a step count
                if value.stride() != p.stride():
                    state[key] = torch.empty_like(p, dtype=value.dtype).copy_(value)


def load_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load the saved momenta or moments, keeping the hyperparameters this run's config gave
    the optimizer (weight decay, momentum, Nesterov, betas, AdamW's decoupled decay, the fused
    kernel): torch's load_state_dict would put back the saved ones, so a resume's
    `train.weight_decay=...` would be written to config.yaml and silently not used."""
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        group.update(own)
    match_param_layout(optimizer)


def restore(state: dict[str, Any], engine: Engine, schedule: Schedule,
            steps_per_epoch: int | None = None) -> Progress:  # fmt: skip
    """Load model, optimizer, scaler and schedule from a checkpoint; return where it stood
    (checked against `steps_per_epoch`: a step past the epoch's end is a damaged checkpoint)."""
    step, epoch, done = state["step"], state["epoch"], state["global_step"]
    if (steps_per_epoch is not None and step > steps_per_epoch) or done < step:
        raise CheckpointError(f"last.pt: step {step} of epoch {epoch + 1} (global step {done}) "
                              f"does not fit this run's {steps_per_epoch} steps an epoch")  # fmt: skip
    try:
        engine.network.load_state_dict(state["model"])
        check_finite_weights(state["model"], "last.pt")
        load_optimizer(engine.optimizer, state["optimizer"])
        if engine.scaler.is_enabled() and state.get("scaler"):
            engine.scaler.load_state_dict(state["scaler"])
        schedule.load_state_dict(state["schedule"])
        if engine.ema is not None and state.get("ema"):
            engine.ema.module.load_state_dict(state["ema"])
            check_finite_weights(state["ema"], "last.pt (ema)")
            engine.ema.n_averaged.fill_(state.get("ema_count", 0))
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"last.pt does not match this run's network or optimizer: {one_line(e)}"
        ) from None
    return Progress(
        epoch=state["epoch"],
        step=state["step"],
        global_step=state["global_step"],
        best_top1=state["best_top1"],
        seconds=state["seconds"],
        history=list(state["history"]),
        partial=dict(state["partial"]),
        **({"run_id": state["run_id"]} if state.get("run_id") else {}),  # (an older run: anew)
    )
