"""The run directory: where a new run writes, the lock that keeps a second writer out, and the
config of a run to resume."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from cnnkit.checkpoint import dated_run_hint, load_checkpoint, trained_files
from cnnkit.config import (
    RunConfig,
    absolute_data,
    apply_override,
    source_follows_path,
    validate_run,
)
from cnnkit.errors import CheckpointError, ConfigError
from cnnkit.runtime import cannot_write
from cnnkit.train.runfile import same_run

LOCK = ".lock"

RUN_FILES = ("config.yaml", "last.pt", "best.pt", "best_ema.pt", "metrics.csv", "summary.json")


def new_run_dir(
    name: str, out: str | Path | None, reuse: bool = False, tag: str | None = None,
    reserve: bool = False,
) -> Path:  # fmt: skip
    """The directory a new run will write; refuses one that holds a run unless `reuse` (an
    elastic restart before the first checkpoint). `tag`: torchrun's job id, so every rank and
    every restart agrees on the default runs/<name>-<tag>. A default runs/<name>-<time> is
    created at once when `reserve`d, so runs started in the same second (a sweep started in
    the background) each get their own (-2, -3, ...); see claimed_run_dir."""
    if out is None and tag is not None:
        out = Path("runs") / f"{name}-{tag[:12]}"
    if out is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        for n in range(1, 10_000):
            path = Path("runs") / (f"{name}-{stamp}" + (f"-{n}" if n > 1 else ""))
            if not reserve and not path.exists():
                return path
            if reserve:
                try:
                    path.mkdir(parents=True)
                    return path
                except FileExistsError:
                    continue
                except OSError as e:
                    raise ConfigError(
                        f"run directory {path}: cannot make it ({e.strerror})"
                    ) from None
        raise ConfigError(f"runs/{name}-{stamp}: no free run directory name (give --out)")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path}: exists and is not a directory")
    if not reuse and any((path / f).exists() for f in RUN_FILES):
        busy = in_use(path)  # a live run first: resuming it would be refused as well
        raise ConfigError(busy or f"--out {path}: already holds a run (continue it with "
                          f"--resume {path})")  # fmt: skip
    others = sorted(p.name for p in path.iterdir() if not p.name.startswith(".")
                    and not ORPHAN.fullmatch(p.name)) if not reuse and path.is_dir() else []  # fmt: skip
    if others:  # a data set's class folders, a project: a run's files would mix with them
        more = f" and {len(others) - 1} more" if len(others) > 1 else ""
        raise ConfigError(f"--out {path}: holds files that are not a run's ({others[0]}{more}): "
                          "give a new or empty folder")  # fmt: skip
    return path


@contextmanager
def claimed_run_dir(name: str, out: str | Path | None, reserve: bool, reuse: bool = False,
                    tag: str | None = None) -> Iterator[Path]:  # fmt: skip
    """new_run_dir for the run inside the block; a directory it `reserve`d (with runs/, if it
    made that too) is removed again where the block fails and leaves it empty."""
    made_runs = reserve and not Path("runs").exists()
    path = new_run_dir(name, out, reuse=reuse, tag=tag, reserve=reserve)
    try:
        yield path
    except BaseException:
        for empty in (path, path.parent)[: 2 if made_runs else 1] if reserve else ():
            try:
                empty.rmdir()
            except OSError:  # it holds something, or is gone: keep it as it is
                break
        raise


def check_writable(run_dir: Path) -> None:
    """ConfigError, before any work, where the run directory cannot be made: a file in the way,
    a read-only folder, one nothing can be created in (a probe file is made and removed)."""
    if run_dir.is_symlink() and not run_dir.exists():  # (mkdir: "File exists")
        raise ConfigError(f"run directory {run_dir}: a link to {os.readlink(run_dir)}, which is "
                          "not there: make that folder, or give another")  # fmt: skip
    parent = run_dir
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the nearest folder that exists
    if not parent.is_dir():
        raise ConfigError(f"run directory {run_dir}: {parent} is a file, not a folder")
    reason = cannot_write(parent)
    if reason is not None:
        raise ConfigError(f"run directory {run_dir}: cannot write in {parent} ({reason})")


WEIGHTS_SUFFIXES = (".pt", ".pth", ".safetensors")  # what model.weights reads


def check_outside_data(run_dir: Path, data: Any) -> None:
    """ConfigError where the run directory would be inside a folder of the images it trains
    on (data.path, data.val_path): its files would be read as a class of images by the next
    run, the resume and eval (pack refuses its own output inside its source alike)."""
    if getattr(data, "source", None) != "folder":
        return
    for key in ("path", "val_path"):
        folder = getattr(data, key, None)
        if folder and run_dir.resolve().is_relative_to(Path(folder).resolve()):
            raise ConfigError(f"run directory {run_dir}: inside data.{key} ({folder}), whose "
                              "subfolders are classes of images; give --out a folder outside "
                              "it")  # fmt: skip


def resume_state(run_dir: str | Path) -> dict[str, Any] | None:
    """The last.pt of a run directory (CheckpointError if missing, truncated, foreign or a
    best.pt's weights alone), or None for a run that stopped after writing config.yaml but
    before its first checkpoint. A run that trained and lost its last.pt is refused, not
    started again over its best.pt and metrics."""
    run_dir = Path(run_dir)
    if run_dir.is_file() and run_dir.suffix.lower() not in WEIGHTS_SUFFIXES:  # a run file, ...
        raise ConfigError(f"--resume {run_dir}: a file, not a run directory: give the folder "
                          "a run wrote (runs/NAME-TIME)")  # fmt: skip
    if run_dir.is_file():
        raise CheckpointError(f"--resume {run_dir}: give the run directory ({run_dir.parent}); "
                              f"to train on from these weights as a new run, give it "
                              f"model.weights={run_dir}")  # fmt: skip
    if not run_dir.is_dir():
        raise CheckpointError(f"--resume {run_dir}: no such run directory{dated_run_hint(run_dir)}")
    last = run_dir / "last.pt"
    if not last.exists() and (run_dir / "config.yaml").is_file():
        trained = trained_files(run_dir)
        if trained:
            raise CheckpointError(f"--resume {run_dir}: last.pt is missing, yet the run trained "
                                  f"({', '.join(trained)}): starting it again would overwrite "
                                  "them; put last.pt back, or train anew elsewhere (--out)")  # fmt: skip
        return None
    if not last.exists():
        raise CheckpointError(f"--resume {run_dir}: not a run directory (no last.pt or "
                              "config.yaml in it)")  # fmt: skip
    state = load_checkpoint(last)
    if state.get("optimizer") is None:
        raise CheckpointError(f"{last}: holds the weights alone (a best.pt?), not a training state "
                              f"to resume; train on from them as a new run with "
                              f"model.weights={last}")  # fmt: skip
    same_run(last, state)
    return state


def resume_config(state: dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """The run config stored in a checkpoint, with overrides (e.g. train.epochs=30) applied; the
    network is the checkpoint's own (its file may have moved since)."""
    raw = dict(copy.deepcopy(state["config"]), model=state["model_spec"])  # the state unchanged
    for item in overrides or []:
        key = item.split("=", 1)[0].strip()
        if key == "model" or key.startswith("model."):  # its weights are the network's
            raise ConfigError(f"--resume: {key} cannot change: a resumed run keeps its network "
                              "(to fine-tune it as another run, give a new run model.weights: "
                              "RUN/best.pt)")  # fmt: skip
        apply_override(raw, item)
    notes = source_follows_path(raw, overrides, resumed=True)
    absolute_data(raw)  # (an older run's relative paths too: read from here, as before)
    if state.get("step"):
        _same_epoch_order(state, raw)
    _same_optimizer_state(state, raw)
    if not overrides:
        try:
            return validate_run(raw)
        except ConfigError as e:  # nothing of the user's: the checkpoint itself is damaged
            raise CheckpointError(f"last.pt: its run settings do not validate: {e}") from None
    config = validate_run(raw)
    config._notes = notes + _schedule_stretched(state, config)
    return config


def _schedule_stretched(state: dict[str, Any], config: RunConfig) -> list[str]:
    """A note where train.epochs given on resume stretches a cosine schedule (or shrinks it):
    its lr where the run stopped jumps (up, for a finished run given more epochs) and anneals
    again, as timm's recomputed schedule does; unsaid, it looked like a bug in the curves."""
    from cnnkit.train.optim import Schedule

    was = (state["config"].get("train") or {}).get("epochs")
    train = config.train
    if train.schedule != "cosine" or not isinstance(was, int) or was == train.epochs:
        return []
    done = state.get("epoch", 0)
    if train.epochs < done + bool(state.get("step")):  # refused (check_epochs_left): unsaid
        return []
    before = Schedule(train.model_copy(update={"epochs": was})).lr(done)
    after = Schedule(train).lr(done)
    if math.isclose(before, after, rel_tol=0.01):
        return []
    return [f"train.epochs={train.epochs}: the cosine schedule spans {train.epochs} epochs, "
            f"not {was}: the learning rate after epoch {done} is {after:.3g}, not {before:.3g}, "
            f"and anneals to train.min_lr again (a new run from its weights, model.weights="
            f"RUN/last.pt, has a schedule of its own)"]  # fmt: skip


OPTIMIZER_STATE = {"sgd": "momenta", "nesterov": "momenta", "adam": "moments",
                   "adamw": "moments"}  # fmt: skip


def _same_optimizer_state(state: dict[str, Any], raw: dict[str, Any]) -> None:
    """An optimizer override on resume must continue the saved optimizer's state (SGD and
    Nesterov share momenta, Adam and AdamW their two moments): ConfigError otherwise."""
    before = (state["config"].get("train") or {}).get("optimizer", "sgd")
    after = (raw.get("train") or {}).get("optimizer", "sgd")
    kinds = OPTIMIZER_STATE.get(before), OPTIMIZER_STATE.get(after)
    if None not in kinds and kinds[0] != kinds[1]:
        raise ConfigError(f"--resume: train.optimizer={after} cannot continue {before}'s "
                          f"{kinds[0]} in last.pt: resume with {before}")  # fmt: skip
    for name in ("norm_weight_decay", "bias_weight_decay"):  # given or not: the groups differ
        was = (state["config"].get("train") or {}).get(name)
        now = (raw.get("train") or {}).get(name)
        if (was is None) != (now is None):
            said = "left out" if was is None else f"at {was:g}"
            raise ConfigError(f"--resume: train.{name}={'null' if now is None else now} "
                              f"regroups the optimizer's state in last.pt, saved with it {said}:"
                              " resume with it so (where it was given, another value is "
                              "taken)")  # fmt: skip


HARMLESS_DATA = {"workers", "prefetch", "eval_batch_size", "decode"}  # no effect on the order
# augmentations of each batch, drawn from the batch's own generator: the order is the same
AUGMENTATIONS = {"mixup", "cutmix", "erasing", "policy", "magnitude", "num_ops", "shift",
                 "rotate", "scale", "mirror", "padding", "contrast", "brightness", "lighting"}  # fmt: skip
SPLIT = {"val_fraction", "split_seed", "val_path", "val_labels"}  # which images are held out


def _same_epoch_order(state: dict[str, Any], raw: dict[str, Any]) -> None:
    """A run stopped mid-epoch resumes by skipping the batches it did: an override that changes
    the epoch's order or batches (the seed, the batch size, the data) would skip the wrong
    images, or train some twice. ConfigError naming it (the held-out split's settings as
    such); each batch's augmentation may change."""
    before, after = state["config"], raw
    changed = ["seed"] if before.get("seed") != after.get("seed") else []
    old, new = dict(before.get("data") or {}), after.get("data") or {}
    absolute_data({"data": old})  # an older run's relative folder is the same folder
    keys = [k for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]
    split = [k for k in keys if k in SPLIT]
    if split:  # (said as a finished epoch's resume would say it: no epoch's end allows it)
        raise ConfigError(f"--resume: data.{split[0]} changes the run's held-out images: its "
                          "held-out figures would count images it trained on; resume with the "
                          "data as it was, or start a new run from its weights")  # fmt: skip
    changed += [f"data.{k}" for k in keys if k not in HARMLESS_DATA | AUGMENTATIONS]
    if changed:
        raise ConfigError(f"--resume: {changed[0]} changes the order of the epoch in progress "
                          f"(epoch {state['epoch'] + 1}, {state['step']} steps of it done): "
                          "resume without it, and change it once the epoch is finished")  # fmt: skip


def _process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot), None if there is no such process;
    a pid the kernel gave to another process since starts at another time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"


def _holder(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads(path.read_text())
        return found if isinstance(found, dict) else None
    except (OSError, ValueError):
        return None


def _stale(holder: dict[str, Any] | None, job: str | None) -> bool:
    """A lock whose writer is gone: died on this host (its pid gone, or another process's now),
    or, on another host, an earlier attempt of this torchrun job (an elastic restart, a
    requeued job). A live process on this host holds its lock whatever its job id: a second
    torchrun given the same --rdzv-id took over a run still training, and both wrote it."""
    if holder is None:  # unreadable: written by a process killed mid-write
        return True
    if holder.get("host") != socket.gethostname():  # another machine's: its pid cannot be
        return job is not None and holder.get("job") == job  # checked, its job id can
    start = _process_start(int(holder.get("pid", -1)))
    return start is None or (start != "?" and start != holder.get("start"))


def in_use(run_dir: Path, job: str | None = None) -> str | None:
    """What to say when a live run holds run_dir's lock (None: no lock, or a stale one)."""
    path = run_dir / LOCK
    if not path.exists():
        return None
    holder = _holder(path)
    if _stale(holder, job):
        return None
    return (f"{run_dir}: in use by another run (pid {holder.get('pid')} on {holder.get('host')} "
            f"since {holder.get('since')}); let it finish (a new run: give another --out)")  # fmt: skip


def _create_whole(path: Path, text: str) -> None:
    """Create `path` holding `text`, appearing with it whole (FileExistsError if it exists): a
    file written beside it, then hard-linked into place, so no other run ever reads it empty
    and takes it for a dead run's. Where links are not supported, created then written."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        try:
            os.link(tmp, path)
            return
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links (some FUSE and SMB mounts)
            pass
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def run_lock(run_dir: Path, job: str | None = None) -> Iterator[None]:
    """Hold run_dir/.lock (owner pid, host, start time) while a run writes there: a second
    writer is refused with one line; a lock left by a dead process is taken over."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    me = {"pid": os.getpid(), "host": socket.gethostname(), "start": _process_start(os.getpid()),
          "job": job, "since": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    for _ in range(3):
        try:
            _create_whole(path, json.dumps(me))
        except FileExistsError:
            busy = in_use(run_dir, job)
            if busy:
                raise ConfigError(busy) from None
            path.unlink(missing_ok=True)
            continue
        break
    else:
        raise ConfigError(f"{run_dir}: could not take its lock ({path})")
    try:
        yield
    finally:
        if (_holder(path) or {}).get("pid") == me["pid"]:
            path.unlink(missing_ok=True)


# the temporary names a run's writers use (.last.pt.PID.tmp, metrics.csv.tmp, curves.png.tmp)
ORPHAN = re.compile(
    rf"\.?({'|'.join(map(re.escape, (*RUN_FILES, 'curves.png', 'lock')))})(\.\d+)?\.tmp"
)


def clear_orphans(run_dir: Path) -> None:
    """Remove temporary files left by a process killed mid-write (the lock is held: no writer
    of this run is alive). Only the names cnnkit writes: a folder of the user's given as --out
    keeps its own .tmp files."""
    for tmp in run_dir.glob("*.tmp"):
        if ORPHAN.fullmatch(tmp.name):
            tmp.unlink(missing_ok=True)
