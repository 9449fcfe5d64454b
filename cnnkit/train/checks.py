"""What a run's settings must fit before anything trains, each a ConfigError naming the
setting: the processes (batch split, a mid-epoch checkpoint's own count, SyncBatchNorm's
devices), the micro-batches a BatchNorm sees, the epochs a resume asks for."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch

from cnnkit.config import RunConfig
from cnnkit.data import DataBundle
from cnnkit.data.holdout import OWN_VAL_SET
from cnnkit.errors import ConfigError, DataError, plural
from cnnkit.nn import Network
from cnnkit.train.loop import Progress


def check_processes(config: RunConfig, world_size: int, device: torch.device,
                    resume: dict[str, Any] | None, notes: bool = True) -> None:  # fmt: skip
    """What the number of processes must fit, before anything is built: the batch split, a
    mid-epoch checkpoint's own count, SyncBatchNorm's CUDA devices (`notes`: and what is
    only said, which --nproc's own early check leaves to the run)."""
    check_batch(config, world_size)
    if resume:
        check_world_size(resume, world_size)
    if config.train.sync_bn and world_size > 1 and device.type != "cuda":
        raise ConfigError("train.sync_bn: SyncBatchNorm runs on CUDA devices only; leave it out "
                          f"on {device.type} (each process then keeps its own statistics)")  # fmt: skip
    if config.train.sync_bn and world_size == 1 and notes:
        print("cnnkit: note: train.sync_bn: one process, so its batch norms stay ordinary ones "
              "(SyncBatchNorm shares statistics between processes: --nproc N)", file=sys.stderr)  # fmt: skip


def check_world_size(state: dict[str, Any], world_size: int) -> None:
    """ConfigError for a mid-epoch resume in another number of processes: each rank skips the
    batches of its own share of the epoch, so another split would train some images twice and
    others not at all."""
    saved = len(state.get("rng_ranks") or [None])
    if state["step"] and saved != world_size:
        raise ConfigError(f"--resume: last.pt was saved by {saved} process(es) in the middle of "
                          f"epoch {state['epoch'] + 1} ({state['step']} steps done): resume it "
                          f"with {saved} (--nproc {saved}); the number can change at an "
                          "epoch's end")  # fmt: skip


def check_batch(config: RunConfig, world_size: int) -> None:
    """The global batch must split evenly over the processes, and each share into at most as
    many micro-batches as it has images."""
    if config.data.batch_size % world_size:
        raise ConfigError(
            f"data.batch_size: the global batch {config.data.batch_size} does not divide into "
            f"{world_size} processes (each takes batch_size / world_size)"
        )
    share, micro = config.data.batch_size // world_size, config.train.accumulate
    if micro > share:
        raise ConfigError(f"train.accumulate: {micro} micro-batches of a batch of {share} "
                          f"images{' per process' if world_size > 1 else ''}: at most {share}")  # fmt: skip


def check_batchnorm(network: Network, micro: int, accumulating: bool = False,
                    field: str | None = None) -> None:  # fmt: skip
    """ConfigError where a BatchNorm layer would see one value per channel in a training
    micro-batch (batch 1 through a BatchNorm on vectors or 1x1 maps): torch refuses it.
    `field`: what the message blames (bench's --batch), else the run's setting."""
    for row in network.table:
        if row.type == "batchnorm" and micro * math.prod(row.output_shape[1:]) < 2:
            field = field or ("train.accumulate" if accumulating else "data.batch_size")
            raise ConfigError(f"{field}: micro-batches of {micro} image(s), and BatchNorm layer "
                              f"{row.name} ({'x'.join(map(str, row.output_shape))}) needs at "
                              "least 2 values per channel to train: use larger batches")  # fmt: skip


def check_epochs_left(config: RunConfig, progress: Progress, run_dir: Path) -> None:
    """A resume asking for fewer epochs than done would rewrite config.yaml to fewer; one that
    ends where an epoch is in progress would leave it half-trained."""
    if progress.epoch > config.train.epochs:
        raise ConfigError(f"train.epochs={config.train.epochs}: {run_dir} has done "
                          f"{plural(progress.epoch, 'epoch')} already (ask for "
                          "more to go on, or leave it out)")  # fmt: skip
    if progress.step and progress.epoch >= config.train.epochs:
        raise ConfigError(f"train.epochs={config.train.epochs}: {run_dir} is in the middle of "
                          f"epoch {progress.epoch + 1} ({plural(progress.step, 'step')} done): "
                          f"ask for at least {progress.epoch + 1} to finish it")  # fmt: skip


def check_every_class_trains(data: DataBundle, path: str | None = None) -> None:
    """DataError where a class of a pack (at `path`) has no image to train on (`cnnkit pack`
    keeps a class none of whose files it could read, with none): its output would never
    learn; an empty class folder is refused alike. (Not for synthetic data, whose random
    labels may leave classes out.)"""
    counts = torch.bincount(data.train_labels, minlength=len(data.classes))
    empty = [data.classes[k] for k in torch.nonzero(counts == 0).flatten().tolist()]
    if empty:
        more = f" (and {plural(len(empty) - 1, 'other')})" if len(empty) > 1 else ""
        where = f"data.path {path}: " if path else ""
        raise DataError(f"{where}class {empty[0]!r}{more} has no image to train on (a pack "
                        "keeps a class whose every file was unreadable: see its "
                        "bad_images.tsv); fix its images and run the same cnnkit pack again "
                        "(it takes them then), or remove its folder and pack into a new "
                        "folder")  # fmt: skip


def check_same_data(state: dict[str, Any], data: DataBundle, run_dir: Path) -> None:
    """ConfigError where a resumed run's data no longer is the data it trained on: other class
    names (a renamed folder would shift every label after it, silently) or another held-out
    split (its figures would count images the run trained on)."""
    fresh = f"start a new run from its weights (model.weights={run_dir}/last.pt)"
    advice = f"resume with the data as it was, or {fresh}"
    check_same_classes(state.get("classes"), data, "--resume", advice)
    check_same_split(state.get("holdout"), data, "--resume", advice)


def check_same_classes(saved: list[str] | None, data: DataBundle, where: str,
                       advice: str) -> None:  # fmt: skip
    """ConfigError where the data's class names are not the run's (`saved`; None: unknown): a
    class folder added, renamed or gone shifts every label after it."""
    saved = list(saved or [])
    if saved and saved != list(data.classes):
        gone = [c for c in saved if c not in data.classes]
        new = [c for c in data.classes if c not in saved]
        what = "; ".join(part for part in (
            f"gone: {', '.join(gone[:3])}{' ...' * (len(gone) > 3)}" if gone else "",
            f"new: {', '.join(new[:3])}{' ...' * (len(new) > 3)}" if new else "",
        ) if part) or "the same names in another order"  # fmt: skip
        raise ConfigError(f"{where}: the data's {len(data.classes)} classes are not the "
                          f"{len(saved)} the run trained on ({what}): {advice}")  # fmt: skip


def check_same_split(drawn: str | None, data: DataBundle, where: str, advice: str) -> None:
    """ConfigError where a split drawn from the training images (`drawn`: the checkpoint's
    holdout_id, OWN_VAL_SET for a data.val_path of its own; None where it predates them) holds
    out other images now: the held-out figures would count images the run trained on."""
    if drawn == OWN_VAL_SET and data.holdout != OWN_VAL_SET:
        raise ConfigError(f"{where}: the run was evaluated on data.val_path, and the data now "
                          "holds out images of data.path, which it trained on; "
                          f"{advice}")  # fmt: skip
    if drawn is not None and drawn != data.holdout:
        raise ConfigError(f"{where}: the held-out images differ from the run's (images added, "
                          "removed or renamed, or the split's settings changed): its held-out "
                          f"figures would count images it trained on; {advice}")  # fmt: skip
