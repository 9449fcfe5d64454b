"""Learning-rate schedules match their definitions, and torch.optim.lr_scheduler where it has one."""

from __future__ import annotations

import math

import pytest
import torch

from cnnkit.config import TrainConfig, dump_run, load_run, train_notes
from cnnkit.errors import ConfigError
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


@pytest.mark.parametrize(
    "overrides, note",
    [
        (["train.step_size=1", "train.gamma=0.1"],
         "train.schedule cosine does not use train.step_size, train.gamma (train.schedule=step "
         "would use them)"),
        (["train.milestones=[1]"],
         "train.schedule cosine does not use train.milestones (train.schedule=multistep would use "
         "it)"),
        (["train.schedule=constant", "train.gamma=0.5"],
         "train.schedule constant does not use train.gamma (train.schedule=step or multistep or "
         "plateau would use it)"),
        (["train.step_size=2", "train.milestones=[1]"],
         "train.schedule cosine does not use train.step_size, train.milestones (train.schedule="
         "step uses step_size; train.schedule=multistep uses milestones)"),
        (["train.min_lr=0.001"], None),  # cosine's own
        ([], None),
    ],
)  # fmt: skip
def test_settings_the_schedule_does_not_read_are_said(overrides, note):
    """A torchvision user's step_size or milestones under the run's cosine schedule: said with
    the schedule that reads them, not silently ignored; only settings given, never defaults."""
    notes = train_notes(load_run("digits", ["train.epochs=3", *overrides]).train)
    assert notes == ([note] if note else [])


def test_a_resolved_config_says_only_the_settings_off_their_default(tmp_path):
    """config.yaml holds every setting: read back (a resume, a rerun of it), only the unused
    ones off their default are said, not every default it wrote."""
    dump_run(load_run("digits", ["train.step_size=1", "train.gamma=0.1"]), tmp_path / "c.yaml")
    assert train_notes(load_run(tmp_path / "c.yaml").train) == [
        "train.schedule cosine does not use train.step_size (train.schedule=step would use it)"
    ]
    dump_run(load_run("digits"), tmp_path / "plain.yaml")
    assert train_notes(load_run(tmp_path / "plain.yaml").train) == []


@pytest.mark.parametrize(
    "milestones, note",
    [
        ("[2,2]", "train.milestones [2, 2]: 2 is given 2 times: the lr drops by gamma**2 at "
                  "once there, as torch's MultiStepLR does"),
        ("[4,2]", "train.milestones [4, 2] are not in increasing order: the lr drops at each all "
                  "the same (at [2, 4]), as torch's MultiStepLR counts them in any order"),
        ("[2,4]", None),
    ],
)  # fmt: skip
def test_repeated_or_unsorted_milestones_are_said_with_what_torch_does(milestones, note):
    """MultiStepLR takes [30, 30] (two drops at once) and [4, 2]: said, not refused."""
    train = load_run("digits", ["train.epochs=6", "train.schedule=multistep",
                                f"train.milestones={milestones}"]).train  # fmt: skip
    assert train_notes(train) == ([note] if note else [])
    schedule = Schedule(TrainConfig(lr=0.1, schedule="multistep", milestones=train.milestones))
    ours = [schedule.lr(epoch) for epoch in range(6)]  # what the note says torch does
    assert ours == pytest.approx(_torch_lrs(lambda o: torch.optim.lr_scheduler.MultiStepLR(
        o, train.milestones), 6), rel=1e-9, abs=1e-12)  # fmt: skip


@pytest.mark.parametrize(
    "override, line",
    [
        ("train.milestones=30,60", "train.milestones: give the epochs as a list: "
                                   "train.milestones=[30,60] (got '30,60')"),
        ("train.milestones=30", "train.milestones: give the epochs as a list: "
                                "train.milestones=[30] (got 30)"),
        ("train.milestones.0=3", "override 'train.milestones.0=3': list items cannot be set one "
                                 "by one: give the whole list, e.g. train.milestones=[...]"),
    ],
)  # fmt: skip
def test_milestones_given_as_torchvisions_lr_steps_or_one_by_one_say_how(override, line):
    with pytest.raises(ConfigError) as error:
        load_run("digits", ["train.schedule=multistep", override])
    assert str(error.value) == line


@pytest.mark.parametrize(
    "overrides, note",
    [
        (["train.optimizer=adam", "train.momentum=0.9"],
         "train.optimizer adam does not use train.momentum (train.optimizer=sgd or nesterov "
         "would use it)"),
        (["train.optimizer=sgd", "train.betas=[0.8,0.99]"],
         "train.optimizer sgd does not use train.betas (train.optimizer=adam or adamw would use "
         "it)"),
        (["train.optimizer=adamw", "train.betas=[0.8,0.99]"], None),
        (["train.optimizer=adam"], None),  # momentum's default is not given
    ],
)  # fmt: skip
def test_settings_the_optimizer_does_not_read_are_said(overrides, note, tmp_path):
    """Adam given momentum (its betas do that job): said as the schedule's unread settings
    are; a resolved config.yaml of the same run says it too, its defaults never."""
    config = load_run("digits", overrides)
    assert train_notes(config.train) == ([note] if note else [])
    dump_run(config, tmp_path / "c.yaml")
    resolved = train_notes(load_run(tmp_path / "c.yaml").train)
    assert resolved == ([note] if note and "betas" in note else [])  # (momentum 0.9: default)
