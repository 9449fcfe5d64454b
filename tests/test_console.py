"""What a run reports as it goes: plain progress lines in a log file, per-step TensorBoard
scalars, top-5 hidden below 6 classes, and the last line naming the last and best epochs."""

from __future__ import annotations

import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cnnkit.config import load_run
from cnnkit.train.loop import FINITE_EVERY
from cnnkit.train.metrics import LOG_EVERY, Console, RunLog, StepInfo
from cnnkit.train.run import fit


def test_log_files_get_a_plain_line_every_few_seconds(capsys):
    console = Console(every=0.0)  # capsys is no terminal: lines, not a bar
    console.start_epoch(3, 10, 100, 0)
    console.step(StepInfo(3, 10, 40, 100, torch.tensor(1.25), 40, 0.01, 512.0, 0.12, 8.0))
    line = capsys.readouterr().out.strip()
    assert line.startswith("epoch 3/10  step 40/100  loss 1.2500  lr 0.01  512 img/s")
    assert "data wait 12%" in line and "epoch eta 12s" in line  # 8 s for 40 steps, 60 to go


def test_tensorboard_gets_per_step_scalars_where_the_loop_syncs(tmp_path):
    """Reading the loss syncs the device: TensorBoard's scalars are written at the steps of an
    epoch where the loop reads it anyway (every FINITE_EVERY, and the epoch's last: an epoch
    shorter than FINITE_EVERY is logged too), not at other ones."""
    log = RunLog(tmp_path, [])
    console = Console(quiet=True, log=log)
    steps = 2 * LOG_EVERY + 3  # epochs of steps that are not a multiple of LOG_EVERY
    for epoch in range(2):
        for step in range(1, steps + 1):
            done = epoch * steps + step
            console.step(StepInfo(epoch + 1, 2, step, steps, torch.tensor(float(done)), done, 0.1,
                                  100.0, 0, 1))  # fmt: skip
    log.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("step/loss")]
    logged = [LOG_EVERY, 2 * LOG_EVERY, steps, steps + LOG_EVERY, steps + 2 * LOG_EVERY, 2 * steps]
    assert losses == [(g, float(g)) for g in logged] and LOG_EVERY == FINITE_EVERY
    assert {"step/lr", "step/images_per_second"} <= set(events.Tags()["scalars"])


def test_two_class_runs_hide_top5_and_say_which_epoch(tmp_path, capsys):
    fit(load_run("faces", ["data.hard_negatives=null", "train.epochs=2"]), tmp_path / "f")
    out, err = capsys.readouterr()
    # the run's log is on stdout (`| tee` and `> log` get it all); stderr its warnings alone
    assert (
        err
        == "cnnkit: note: train.warmup_epochs 2 of 2 epochs: the lr never reaches train.lr 0.02\n"
    )
    assert "top-5" not in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("done: held-out top-1") and "at the last epoch" in last
    assert "best" in last and "kept as best.pt" in last


def test_a_resumed_run_keeps_tensorboards_points_from_before_its_checkpoint(tmp_path):
    """Session 1 logs to global step 90 and is killed after a checkpoint at step 70; session 2
    resumes there: TensorBoard holds session 1's points up to 70 and session 2's after it."""
    row = {k: 0.5 for k in ("train_loss", "train_top1", "val_loss", "val_top1", "val_top5", "lr",
                            "images_per_second", "seconds")}  # fmt: skip
    first = RunLog(tmp_path, [{**row, "epoch": 1}])
    for step in (20, 40, 60, 80):
        first.write_step(step, 1.0, 0.1, 100.0)
    first.log_epoch(first.history[-1], 44)
    first.write_epoch()
    first.tb.close()  # killed: the checkpoint was at step 70, mid epoch 2
    second = RunLog(tmp_path, [{**row, "epoch": 1}], global_step=70)
    second.write_epoch(final=True)  # what a resume does first
    for step in (80, 100):
        second.write_step(step, 2.0, 0.1, 100.0)
    second.history.append({**row, "epoch": 2})
    second.log_epoch(second.history[-1], 88)
    second.write_epoch(final=True)
    second.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("step/loss")] == [
        (20, 1.0), (40, 1.0), (60, 1.0), (80, 2.0), (100, 2.0)]  # fmt: skip
    assert [(e.step, e.value) for e in events.Scalars("epoch")] == [(44, 1.0), (88, 2.0)]
    assert [e.step for e in events.Scalars("val/top1")] == [44, 88]
    tags = set(events.Tags()["scalars"])  # the other columns under epoch/, not made-up sections
    assert {"train/loss", "val/top5", "epoch/lr", "epoch/images_per_second"} <= tags
    assert not {"images/per_second", "data/wait", "lr"} & tags


def test_metrics_csv_keeps_the_moving_averages_columns_after_a_resume_turns_it_off(tmp_path):
    row = {k: 0.5 for k in ("train_loss", "train_top1", "val_loss", "val_top1", "val_top5", "lr",
                            "images_per_second", "seconds", "data_wait")}  # fmt: skip
    ema = {"val_loss_ema": 0.4, "val_top1_ema": 0.6, "val_top5_ema": 0.9}
    log = RunLog(tmp_path, [{**row, **ema, "epoch": 1}, {**row, "epoch": 2}], tensorboard=False)
    log.write_epoch()
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines[0].endswith(",val_loss_ema,val_top1_ema,val_top5_ema")
    assert lines[1].endswith(",0.4,0.6,0.9") and lines[2].endswith(",,,")


class Killed(BaseException):
    """A kill (not an error the run handles) right after an epoch's last.pt is written."""


def test_a_kill_between_last_pt_and_the_metrics_files_loses_no_tensorboard_epoch(
    tmp_path, monkeypatch
):
    """The epoch's TensorBoard row is logged before its last.pt: a kill after the checkpoint
    but before metrics.csv cannot leave TensorBoard without that epoch for good."""
    from cnnkit.config import validate_run

    run = {"name": "tiny", "model": "digitnet", "seed": 1, "train": {"epochs": 3, "lr": 0.05},
           "data": {"source": "synthetic", "shape": [1, 8, 8], "num_classes": 4,
                    "train_size": 64, "val_size": 16, "batch_size": 16}}  # fmt: skip
    write_epoch = RunLog.write_epoch

    def killed_at_epoch_2(self, final=False):
        if len(self.history) == 2:
            raise Killed
        write_epoch(self, final)

    monkeypatch.setattr(RunLog, "write_epoch", killed_at_epoch_2)
    with pytest.raises(Killed):
        fit(validate_run(run), tmp_path / "r", quiet=True)
    monkeypatch.undo()
    from cnnkit.train.run import resume_state

    # TensorBoard reads a run's event files in name order: two made in the same second by one
    # process differ by a counter, whose 10 sorts before 9 (the resumed file read first, the
    # first file's earlier steps then purging it as out of order): a second apart, as runs are
    time.sleep(1.05)
    fit(validate_run(run), tmp_path / "r", resume=resume_state(tmp_path / "r"), quiet=True)
    events = EventAccumulator(str(tmp_path / "r"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("epoch")] == [(4, 1.0), (8, 2.0), (12, 3.0)]
    assert len((tmp_path / "r" / "metrics.csv").read_text().splitlines()) == 1 + 3


def test_tensorboards_step_lr_is_the_rate_the_step_used(tmp_path):
    from cnnkit.train.optim import Schedule

    config = load_run("digits", ["train.epochs=2", "train.warmup_epochs=1", "data.batch_size=32"])
    fit(config, tmp_path / "r", quiet=True)
    events = EventAccumulator(str(tmp_path / "r"))
    events.Reload()
    points = [(e.step, e.value) for e in events.Scalars("step/lr")]
    schedule, per_epoch = Schedule(config.train), len(config.data.build(torch.device("cpu")).train)
    assert len(points) >= 2
    for global_step, lr in points:  # step g ran at (g - 1) / steps of an epoch into the run
        used = schedule.lr((global_step - 1) / per_epoch)
        assert lr == pytest.approx(used, rel=1e-6), global_step


def test_the_moving_averages_figures_are_on_the_epoch_and_done_lines(capsys):
    from cnnkit.train.summary import done_line

    row = {"epoch": 2, "train_loss": 0.5, "train_top1": 0.8, "val_loss": 0.4, "val_top1": 0.9,
           "val_top5": 1.0, "lr": 0.01, "images_per_second": 100.0, "seconds": 1.0,
           "val_top1_ema": 0.925}  # fmt: skip
    Console(every=0.0).end_epoch(row, 5)
    assert "top-1 90.00% (EMA 92.50%)" in capsys.readouterr().out
    summary = {"val_top1": 0.9, "val_top5": 1.0, "val_images": 40, "wall_seconds": 2.0,
               "best_val_top1_ema": 0.95}  # fmt: skip
    line = done_line(summary, [row], False, "runs/x")
    assert "; the moving average's best 95.00%, kept as best_ema.pt)" in line


def test_the_start_line_says_when_the_data_sets_the_class_count(tmp_path, capsys):
    """A network file's num_classes is replaced by the data's (fine-tuning's rule): said."""
    net = {"input": [1, 8, 8], "num_classes": 4, "layers": [{"type": "flatten"},
                                                             {"type": "linear"}]}  # fmt: skip
    config = load_run({"name": "n", "model": net, "data": {"source": "digits"},
                       "train": {"epochs": 1, "precision": "fp32", "channels_last": False,
                                 "threads": 1}})  # fmt: skip
    fit(config, tmp_path / "run")
    first = capsys.readouterr().out.splitlines()[0]
    assert "10 classes (the data's, in place of the network's num_classes 4)" in first
    # digits' 1,438 training images in whole batches of 64: 1,408 an epoch (was '1408 train')
    assert (
        "1438 train (1408 an epoch: whole batches, reshuffled each epoch) / 359 held-out" in first
    )


def test_the_start_line_names_the_batch_recipe(capsys):
    """timm's start lines name the augmentation (`aa: rand-m9-n2`): so does this one, and a
    dry run's line, where a user checks what an override did."""
    from helpers import run_cli

    from cnnkit.train.run import _recipe

    code, out, _ = run_cli(["train", "digits", "data.policy=augmix", "--dry-run"], capsys)
    assert code == 0 and "held-out images, augmix, 22 steps an epoch" in out, out

    config = load_run("digits", ["data.policy=ra", "data.magnitude=12", "data.mixup=0.2"])
    assert _recipe(config) == ", randaugment m12 n2, mixup 0.2"
    assert _recipe(load_run("digits", ["data.policy=augmix", "data.erasing=0.25"])) == (
        ", augmix, erasing 0.25"
    )
    assert _recipe(load_run("digits")) == ""


def test_without_tensorboard_the_loss_is_not_read_for_its_scalars(tmp_path):
    """Reading the loss (a device tensor) syncs the GPU: a quiet run without TensorBoard never
    reads it for the per-step scalars it does not write."""

    class Loss:
        reads = 0

        def __float__(self):
            Loss.reads += 1
            return 1.0

    console = Console(quiet=True, log=RunLog(tmp_path, [], tensorboard=False))
    for step in range(1, 61):
        console.step(StepInfo(1, 1, step, 60, Loss(), step, 0.1, 100.0, 0.0, 1.0))
    assert Loss.reads == 0
    console = Console(quiet=True, log=RunLog(tmp_path / "tb", [], tensorboard=True))
    for step in range(1, 61):
        console.step(StepInfo(1, 1, step, 60, Loss(), step, 0.1, 100.0, 0.0, 1.0))
    console.log.close()
    assert Loss.reads == 4  # steps 16, 32, 48 and the epoch's last, 60


def test_the_progress_bar_shows_the_loss_read_where_the_loop_syncs_never_its_own():
    """A terminal's bar refreshes 10 times a second, every few steps of a fast GPU: it shows the
    loss last read at a step where the loop reads the device anyway, never a read (a sync) of
    its own."""

    class Loss:
        reads = 0

        def __init__(self, value: float) -> None:
            self.value = value

        def __float__(self) -> float:
            Loss.reads += 1
            return self.value

    console = Console()
    console.terminal = True  # (capsys is not one)
    console.start_epoch(1, 1, 40, 0)
    shown = []
    try:
        for step in range(1, 41):
            console._last = float("-inf")  # due a refresh at every step
            console.step(StepInfo(1, 1, step, 40, Loss(step / 100), step, 0.1, 100.0, 0.0, 1.0))
            shown.append(console.progress.tasks[0].fields["loss"])
    finally:
        console.close()
    assert Loss.reads == 3  # steps 16, 32 and the epoch's last, 40
    assert shown[:15] == ["-"] * 15 and shown[15] == shown[30] == "0.1600"
    assert shown[31] == "0.3200" and shown[-1] == "0.4000"


def test_tensorboards_step_rate_is_the_rate_since_its_previous_point():
    """step/images_per_second: the images/s of the steps since the last point (the epoch's
    average would hide a slowdown), from each epoch's start again."""

    class Log:
        rates: list[float] = []

        def write_step(self, global_step, loss, lr, images_per_second):
            self.rates.append(images_per_second)

    console = Console(quiet=True, log=Log())
    # 16 steps of 10 images a second at 100 images/s, then 16 at 25 images/s
    for epoch in (1, 2):
        seconds = images = 0.0
        for step in range(1, 33):
            seconds += 0.1 if step <= 16 else 0.4
            images += 10
            console.step(StepInfo(epoch, 2, step, 32, torch.tensor(1.0), step, 0.1,
                                  images / seconds, 0.0, seconds))  # fmt: skip
    assert Log.rates == pytest.approx([100.0, 25.0, 100.0, 25.0])
