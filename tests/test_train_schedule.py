"""Learning-rate schedules match their definitions, and torch.optim.lr_scheduler where it has one."""

from __future__ import annotations

import math

import pytest
import torch

from cnnkit.config import TrainConfig
from cnnkit.train.optim import Schedule


def _torch_lrs(make, epochs: int, lr: float = 0.1) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = make(opt)
    out = []
    for _ in range(epochs):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize(
    "fields, make",
    [
        ({"schedule": "step", "step_size": 3, "gamma": 0.5},
         lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.5)),
        ({"schedule": "multistep", "milestones": [2, 5], "gamma": 0.1},
         lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [2, 5], 0.1)),
        ({"schedule": "cosine", "epochs": 8, "min_lr": 0.001},
         lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 8, eta_min=0.001)),
    ],
)  # fmt: skip
def test_epoch_schedules_match_torch(fields, make):
    schedule = Schedule(TrainConfig(lr=0.1, **fields))
    ours = [schedule.lr(epoch) for epoch in range(8)]
    assert ours == pytest.approx(_torch_lrs(make, 8), rel=1e-9, abs=1e-12)


def test_linear_warmup_then_constant():
    schedule = Schedule(TrainConfig(lr=1.0, warmup_epochs=2, warmup_start=0.1))
    assert schedule.lr(0) == pytest.approx(0.1)
    assert schedule.lr(1) == pytest.approx(0.55)
    assert schedule.lr(2) == schedule.lr(7) == 1.0


def test_alexnet_multistep_divides_by_ten():
    schedule = Schedule(TrainConfig(lr=0.01, schedule="multistep", milestones=[20, 40]))
    assert [schedule.lr(e) for e in (0, 19.99, 20, 39, 40, 59)] == pytest.approx(
        [0.01, 0.01, 0.001, 0.001, 0.0001, 0.0001]
    )


def test_cosine_is_continuous_within_an_epoch():
    schedule = Schedule(TrainConfig(lr=1.0, schedule="cosine", epochs=4))
    assert schedule.lr(1.5) == pytest.approx(0.5 * (1 + math.cos(math.pi * 1.5 / 4)))


def test_plateau_on_val_error_matches_reduce_lr_on_plateau():
    errors = [0.5, 0.4, 0.41, 0.42, 0.40, 0.39, 0.39, 0.395, 0.40, 0.38, 0.38, 0.38]
    cfg = TrainConfig(lr=0.1, schedule="plateau", patience=1, gamma=0.1, threshold=1e-4)
    schedule = Schedule(cfg)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, "min", 0.1, patience=1)
    for err in errors:
        schedule.end_epoch(err)
        reference.step(err)
        assert schedule.lr(0) == pytest.approx(opt.param_groups[0]["lr"])
    assert schedule.lr(0) < 0.1  # it did drop


def test_plateau_state_round_trips():
    schedule = Schedule(TrainConfig(schedule="plateau", patience=0))
    for err in (0.5, 0.6, 0.7):
        schedule.end_epoch(err)
    copy = Schedule(TrainConfig(schedule="plateau", patience=0))
    copy.load_state_dict(schedule.state_dict())
    assert copy.lr(3) == schedule.lr(3) < TrainConfig().lr


def test_apply_sets_each_group_by_its_multiplier():
    w, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [w], "lr_mult": 1.0}, {"params": [b], "lr_mult": 2.0}], lr=1)
    Schedule(TrainConfig(lr=0.01, schedule="step", step_size=1)).apply(opt, 1.0)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.001, 0.002])
