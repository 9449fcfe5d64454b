"""Optimisers (SGD classical/Nesterov, Adam, AdamW) over the network's per-layer lr/decay groups,
and the learning-rate schedule: a pure function of progress, plus plateau state for resume.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cnnkit.config import TrainConfig
from cnnkit.nn import Network


def build_optimizer(network: Network, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer the config names, over Network.param_groups (AlexNet: biases 2x lr, no decay).

    Fused kernels where the parameters' device has them: one pass over each tensor instead of
    several; on this CPU that halved AlexNet's step (the update of 61 M weights is memory-bound).
    """
    groups = network.param_groups(cfg.lr, cfg.weight_decay, cfg.norm_weight_decay,
                                  cfg.bias_weight_decay)  # fmt: skip
    fused = all(p.device.type in ("cpu", "cuda") for p in network.parameters())
    if cfg.optimizer in ("sgd", "nesterov"):
        nesterov = cfg.optimizer == "nesterov"
        return torch.optim.SGD(
            groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=nesterov, fused=fused
        )
    if cfg.optimizer == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr, betas=cfg.betas, fused=fused)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=fused)


class Schedule:
    """lr(epoch progress) = base lr x warm-up x (step | multistep | cosine | plateau factor).

    `progress` is in epochs (epoch + fraction of it done), so the rate is set every step and a
    resumed run recomputes it exactly; only the plateau rule carries state (state_dict).
    """

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.plateau_factor = 1.0
        self.best: float | None = None
        self.bad_epochs = 0

    def factor(self, progress: float) -> float:
        """The multiplier of the base lr after `progress` epochs."""
        cfg = self.cfg
        if cfg.schedule == "step":
            f = cfg.gamma ** math.floor(progress / cfg.step_size + 1e-9)
        elif cfg.schedule == "multistep":
            f = cfg.gamma ** sum(progress + 1e-9 >= m for m in cfg.milestones)
        elif cfg.schedule == "cosine":
            floor = cfg.min_lr / cfg.lr
            t = min(progress / cfg.epochs, 1.0)
            f = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
        elif cfg.schedule == "plateau":
            f = self.plateau_factor
        else:
            f = 1.0
        if progress < cfg.warmup_epochs:
            t = progress / cfg.warmup_epochs
            f *= cfg.warmup_start + (1 - cfg.warmup_start) * t
        return f

    def lr(self, progress: float) -> float:
        """The base learning rate after `progress` epochs."""
        return self.cfg.lr * self.factor(progress)

    def apply(self, optimizer: torch.optim.Optimizer, progress: float) -> float:
        """Set every group's lr (its multiplier x the scheduled base lr); return the base lr."""
        lr = self.lr(progress)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        return lr

    def end_epoch(self, val_error: float) -> None:
        """Plateau rule (the 2012 paper's): divide by 1/gamma when val error stops falling."""
        if self.cfg.schedule != "plateau":
            return
        if self.best is None or val_error < self.best * (1 - self.cfg.threshold):
            self.best, self.bad_epochs = val_error, 0
            return
        self.bad_epochs += 1
        if self.bad_epochs > self.cfg.patience:
            floor = self.cfg.min_lr / self.cfg.lr
            self.plateau_factor = max(self.plateau_factor * self.cfg.gamma, floor)
            self.bad_epochs = 0

    def state_dict(self) -> dict[str, Any]:
        return {"plateau_factor": self.plateau_factor, "best": self.best, "bad": self.bad_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.plateau_factor, self.best = state["plateau_factor"], state["best"]
        self.bad_epochs = state["bad"]
