"""A whole training run: `launch` (what `cnnkit train` does, alone or as a torchrun worker)
and `fit`, which validates and builds everything before touching the run directory, then
trains epoch by epoch, saving last.pt every epoch and every N steps, best.pt and the metrics.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

import cnnkit.distributed as distributed
from cnnkit.checkpoint import set_rng_state
from cnnkit.config import RunConfig, load_run, train_notes
from cnnkit.data import DataBundle
from cnnkit.distributed import Local, Processes
from cnnkit.errors import CheckpointError, ConfigError, plural
from cnnkit.runtime import mix_seed, restore_matmuls, seed_everything, tf32_matmuls, torch_threads
from cnnkit.train.build import build_run_engine, for_weights
from cnnkit.train.checks import (
    check_epochs_left,
    check_every_class_trains,
    check_processes,
    check_same_data,
)
from cnnkit.train.engine import Engine
from cnnkit.train.epochs import Hooks, stop_on_interrupt, train_epochs
from cnnkit.train.loop import Progress, StepHook
from cnnkit.train.metrics import Console, RunLog
from cnnkit.train.optim import Schedule
from cnnkit.train.rundir import (
    check_outside_data,
    check_writable,
    claimed_run_dir,
    clear_orphans,
    new_run_dir,
    resume_config,
    resume_state,
    run_lock,
)
from cnnkit.train.runfile import check_unedited, write_run_config
from cnnkit.train.saver import CheckpointWriter
from cnnkit.train.state import RunContext, load_ema_buffers, restore
from cnnkit.train.summary import finish


def launch(
    run: str | Path | dict | None,
    overrides: list[str] | None = None,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    quiet: bool = False,
    on_step: StepHook | None = None,
    dry_run: bool = False,
    callbacks: Sequence[Any] = (),
    processes: int | None = None,
) -> dict[str, Any]:
    """What `cnnkit train` does, alone or as one torchrun worker: validate, join the process
    group, pick or resume the run directory (elastic restarts continue from last.pt), fit.
    `processes`: the process count a dry run stands for (`--nproc N --dry-run`)."""
    restarted = distributed.restart_count() > 0
    state = resume_state(resume) if resume is not None else None
    fresh_in = None  # a run directory to start again in
    if resume is not None and state is None:  # it died before its first checkpoint: start over
        run, fresh_in = Path(resume) / "config.yaml", Path(resume)
        if distributed.is_rank0():  # a warning: on stderr, --quiet or not
            print(f"{resume}: no checkpoint yet: the run starts again from the beginning",
                  file=sys.stderr)  # fmt: skip
    if state is None and run is None:
        raise ConfigError("train: give a run (a zoo name or a run file) or --resume RUN_DIR")
    config = resume_config(state, overrides) if state else load_run(run, overrides)
    if state is not None:  # (before a dry run too)
        check_unedited(Path(resume), config, state, overrides)
    with distributed.group_for(config.train) as group, ExitStack() as stack:
        if fresh_in is not None:
            run_dir = fresh_in
        elif state is None:
            tag = distributed.run_id() if group is not None else None
            reserve = out is None and tag is None and not dry_run  # a default name: made now
            if reserve and group is not None:  # no job id (a static rendezvous): rank 0 names
                out = _group_run_dir(config.name, group)  # it for every rank, and removes it
                reserve = group.is_main  # again where the run fails leaving it empty
            run_dir = stack.enter_context(claimed_run_dir(config.name, out, reserve,
                                                          reuse=restarted, tag=tag))  # fmt: skip
            if restarted:  # the group died: continue from its checkpoint, if it made one
                state = _restart_state(run_dir, group)
                config = resume_config(state, overrides) if state else config
        else:
            run_dir = Path(resume)
            if group is not None:  # each rank read its own copy: rank 0's is the one
                state = _rank0_state(state, group)
                config = resume_config(state, overrides)
        return fit(config, run_dir, resume=state, quiet=quiet, on_step=on_step, dist=group,
                   dry_run=dry_run, callbacks=callbacks,
                   fresh=state is None and fresh_in is None and not restarted,
                   processes=processes)  # fmt: skip


def _group_run_dir(name: str, group: distributed.Group) -> Path:
    """The default run directory of a group without torchrun's job id: rank 0 makes
    runs/<name>-<time> and every rank writes there; after an elastic restart, the one the
    first attempt made (so the run continues from its last.pt, not afresh)."""
    return Path(group.job_value("run_dir", lambda: str(new_run_dir(name, None, reserve=True))))


def _rank0_state(state: dict[str, Any], group: distributed.Group) -> dict[str, Any]:
    """The checkpoint every rank of a resumed group starts from: rank 0's. Each rank read
    last.pt from its own disk; a machine holding a stale copy (no shared filesystem, an old
    rsync) would otherwise train other weights from the first step on, unnoticed. Sent only
    where some rank's copy differs (the checkpoint is large)."""
    weights = next(iter(state["model"].values()), None)
    mark = (state.get("global_step"), float(weights.double().sum()) if weights is not None else 0)
    (differs,), _ = group.agree((mark != group.broadcast_object(mark),))
    return group.broadcast_object(state if group.is_main else None) if differs else state


def _restart_state(run_dir: Path, group: distributed.Group) -> dict[str, Any] | None:
    """Rank 0 decides whether a restarted group resumes, and sends every rank its checkpoint:
    ranks on machines without the run directory (no shared filesystem) never split off."""
    found = resume_state(run_dir) if group.is_main and (run_dir / "last.pt").is_file() else None
    return group.broadcast_object(found)


@contextmanager
def deterministic_mode(on: bool, device: torch.device) -> Iterator[None]:
    """Bitwise-repeatable kernels while training if `on`; cuDNN's autotuner (benchmark mode)
    otherwise. On CUDA, fp32 matmuls in TF32 as cuDNN's convolutions already are (torch's
    default leaves them in true fp32: an fp32 run's linear layers 7x slower on an H100).
    All restored afterwards."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()  # (the caller's, kept)
    benchmark = torch.backends.cudnn.benchmark
    if on != before:  # the call imports torch's compiler stack (3 s): only when it changes
        torch.use_deterministic_algorithms(on, warn_only=device.type != "cpu")
    torch.backends.cudnn.benchmark = not on
    matmuls = tf32_matmuls() if device.type == "cuda" else None
    try:
        yield
    finally:
        if on != before:
            torch.use_deterministic_algorithms(before, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark
        if matmuls is not None:
            restore_matmuls(matmuls)


def fit(
    config: RunConfig,
    run_dir: str | Path | None = None,
    resume: dict[str, Any] | None = None,
    quiet: bool = False,
    on_step: StepHook | None = None,
    dist: Processes | None = None,
    dry_run: bool = False,
    callbacks: Sequence[Any] = (),
    fresh: bool = False,
    processes: int | None = None,
    last_line: bool = True,
) -> dict[str, Any]:
    """Train as `config` says into `run_dir` (resume: a state from `resume_state`); return the
    summary (also written to summary.json). `quiet`: no lines but the last (`done: ... -> DIR`),
    which `last_line` False leaves out too (a quiet mining round's: its mining run says its
    own). `dry_run`: build everything, stop before the first step, write nothing. `callbacks`:
    see train/epochs.Hooks. `fresh`: `run_dir` was chosen as holding no run, which is checked
    again once it is locked. `processes`: the process count a dry run stands for, whose checks
    it makes."""
    started = time.perf_counter()
    dist = dist or Local()
    run_dir = Path(run_dir) if run_dir is not None else new_run_dir(config.name, None)
    device = dist.device(config.train.device)
    ranks = processes if dry_run and processes else dist.world_size
    notes = list(config._notes)  # (what loading it had to say)
    if not resume:  # (a resumed run's config.yaml has the values it began with)
        config, adapted = for_weights(config)
        notes += adapted
    for note in notes if dist.is_main else ():
        print(f"cnnkit: note: {note}", file=sys.stderr)
    check_processes(config, ranks, device, resume)
    check_outside_data(run_dir, config.data)
    if not dry_run:
        distributed.on_rank0(dist, lambda: check_writable(run_dir))
    with ExitStack() as stack:
        stack.enter_context(deterministic_mode(config.deterministic, device))
        data, engine, schedule, progress = _build(config, run_dir, resume, quiet, dist, device,
                                                  ranks, stack)  # fmt: skip
        if dry_run:
            return _dry_run(Console(quiet or not dist.is_main), config, engine, data, run_dir,
                            progress, processes or dist.world_size, dist.is_main)  # fmt: skip
        distributed.on_rank0(dist, lambda: stack.enter_context(_locked(run_dir, fresh)))
        log = _open_run_dir(run_dir, config, progress) if dist.is_main else None
        ctx = RunContext(config, data, dist, run_dir, log, started)
        return _train(ctx, engine, schedule, progress, Hooks(on_step, callbacks), quiet,
                      last_line)  # fmt: skip


def _build(config: RunConfig, run_dir: Path, resume: dict[str, Any] | None, quiet: bool,
           dist: Processes, device: torch.device, ranks: int,
           stack: ExitStack) -> tuple[DataBundle, Engine, Schedule, Progress]:  # fmt: skip
    """Everything the run needs, seeded: the data, the engine (its threads held by `stack`),
    the schedule, and the progress (a resumed run's, with this rank's generators)."""
    seed_everything(config.seed)
    notes = config.data.training_notes()  # (a ConfigError before anything is built)
    if dist.is_main and not resume:
        for note in notes:
            print(f"cnnkit: note: {note}", file=sys.stderr)
    source = config.data.drawn_as(resume.get("holdout")) if resume else config.data
    data = source.build(
        device, dist.rank, dist.world_size, config.seed, local_ranks=dist.local_world_size
    )
    data.train.check_room()  # (image streams: their shared memory, up front)
    if resume:
        check_same_data(resume, data, run_dir)
    elif config.data.source == "packed":  # (new runs: one that trained so is not stopped now)
        check_every_class_trains(data, config.data.path)
    engine = build_run_engine(config, data, device, dist, Console(quiet or not dist.is_main),
                              resume, ranks)  # fmt: skip
    if dist.world_size > 1:  # same initial weights everywhere, then each rank its own dropout
        torch.manual_seed(mix_seed(config.seed, dist.rank))
    stack.enter_context(torch_threads(engine.settings.threads))
    schedule = Schedule(config.train)
    progress = restore(resume, engine, schedule, len(data.train)) if resume else Progress()
    if resume:  # after everything that draws from the generators, before any file is written
        _restore_rank(resume, dist, progress, engine)
        check_epochs_left(config, progress, run_dir)
    return data, engine, schedule, progress


def _train(ctx: RunContext, engine: Engine, schedule: Schedule, progress: Progress,
           hooks: Hooks, quiet: bool, last_line: bool) -> dict[str, Any]:  # fmt: skip
    """The epochs, then the summary; however they end, the bar is gone, every checkpoint on
    disk and the log closed before anything more is said. A first Ctrl-C once the last step
    is done lets the run finish (its curves and summary.json written), as one during the
    epochs lets it save and stop; a second stops it at once."""
    main = ctx.dist.is_main
    console = Console(quiet or not main, top5=len(ctx.data.classes) > 5, log=ctx.log,
                      last=main and last_line)  # fmt: skip
    _describe(console, ctx, engine, progress)
    writer, done_before = CheckpointWriter(), progress.global_step
    with stop_on_interrupt() as stop:
        try:
            train_epochs(engine, schedule, progress, console, hooks, ctx, writer, stop)
        finally:
            console.close()  # the bar gone before any line of how the run ended
            writer.wait()  # every checkpoint on disk before the run reports anything
            if ctx.log is not None:
                ctx.log.close()
        # a session that trained nothing (all epochs done) adds nothing to the run's wall time
        spent = None if progress.global_step == done_before else time.perf_counter() - ctx.started
        return finish(engine, progress, ctx, spent, console)


@contextmanager
def _locked(run_dir: Path, fresh: bool) -> Iterator[None]:
    """The run directory's lock (rank 0); a `fresh` one must still hold no run once locked."""
    with run_lock(run_dir, job=distributed.run_id()):
        if fresh and (run_dir / "last.pt").exists():  # written since it was chosen
            raise ConfigError(f"{run_dir}: another run wrote there while this one was "
                              "starting (give each run its own --out)")  # fmt: skip
        yield


def _dry_run(console: Console, config: RunConfig, engine: Engine, data: DataBundle,
             run_dir: Path, progress: Progress, processes: int = 1,
             main: bool = True) -> dict[str, Any]:  # fmt: skip
    """Everything built: say what would run, write nothing."""
    params = sum(p.numel() for p in engine.network.parameters())
    many = f", {processes} processes" if processes > 1 else ""
    n = config.train.epochs
    plan = (f"{plural(len(data.train), 'step')} an epoch from epoch {progress.epoch + 1}; would "
            f"write {run_dir}" if progress.epoch < n else  # fmt: skip
            f"{'all ' + str(n) + ' epochs' if n != 1 else 'its 1 epoch'} done: would train "
            f"nothing (train.epochs=N for more) in {run_dir}")  # fmt: skip
    console.print(
        f"dry run of {config.name}: {engine.network.name} ({params:,} parameters) on "
        f"{engine.device}{many} ({engine.settings.describe(config.train.threads)}), "
        f"{_train_images(data)} / {plural(data.val.num_samples, 'held-out image')}{_crops(config)}"
        f"{_recipe(config)}, {plan} (nothing written there)"
    )
    _train_notes(config, main)
    mining = getattr(config.data, "hard_negatives", None)
    if mining is not None and mining.rounds:  # the dry run above is the first round's
        console.print(f"note: {mining.describe()}")
    return {"dry_run": True, "name": config.name, "run_dir": str(run_dir),
            "settings": engine.settings.describe(), "train_images": data.train.num_samples,
            "val_images": data.val.num_samples, "parameters": params}  # fmt: skip


def _open_run_dir(run_dir: Path, config: RunConfig, progress: Progress) -> RunLog:
    run_dir.mkdir(parents=True, exist_ok=True)
    clear_orphans(run_dir)
    if progress.epoch < config.train.epochs or not (run_dir / "config.yaml").exists():
        write_run_config(config, run_dir / "config.yaml")  # all done: as last.pt, unchanged
        # a finished session's figures: this one trains on, and writes them when it finishes
        (run_dir / "summary.json").unlink(missing_ok=True)
    log = RunLog(run_dir, progress.history, global_step=progress.global_step)
    if progress.history:  # resumed: drop rows written after the checkpoint
        log.write_epoch(final=True)
    return log


def _describe(console: Console, ctx: RunContext, engine: Engine, progress: Progress) -> None:
    config, data = ctx.config, ctx.data
    if progress.epoch >= config.train.epochs:
        n = config.train.epochs
        done = f"all {n} epochs" if n != 1 else "its 1 epoch"
        console.print(f"{ctx.run_dir}: {done} done (train.epochs=N for more)")
        return
    what = "resuming" if progress.global_step else "training"
    at = f" from epoch {progress.epoch + 1} step {progress.step}" if progress.global_step else ""
    processes = f", {ctx.dist.world_size} processes" if ctx.dist.world_size > 1 else ""
    given = config.model.spec().get("num_classes")
    classes = (f", {len(data.classes)} classes (the data's, in place of the network's "
               f"num_classes {given})" if given not in (None, len(data.classes)) else "")  # fmt: skip
    console.print(
        f"{what} {config.name}{at}: {engine.network.name} on {engine.device}{processes} "
        f"({engine.settings.describe(config.train.threads)}), {_train_images(data)} / "
        f"{plural(data.val.num_samples, 'held-out image')}{classes}{_crops(config)}"
        f"{_recipe(config)}, "
        f"batch {config.data.batch_size} -> {ctx.run_dir}"
    )
    _train_notes(config, ctx.dist.is_main)


def _crops(config: RunConfig) -> str:
    """', crops 224 of 256 px' for an image set ('random-resized crops' where they are; the
    crop may be the network's side, taken where the run left it out), else nothing."""
    crop = getattr(config.data, "crop", None)
    side = config.data.stored_size() if crop is not None else None
    kind = "random-resized " if getattr(config.data, "train_crop", None) == "resized" else ""
    return f", {kind}crops {crop} of {side} px" if side else ""


def _recipe(config: RunConfig) -> str:
    """', randaugment m9 n2, erasing 0.25, mixup 0.2' for what the batch recipe adds, or ''."""
    d, parts = config.data, []
    if d.policy != "none":
        parts.append(f"{d.policy} m{d.magnitude} n{d.num_ops}" if d.policy == "randaugment"
                     else d.policy)  # fmt: skip
    parts += [f"{name} {getattr(d, name):g}" for name in ("erasing", "mixup", "cutmix")
              if getattr(d, name)]  # fmt: skip
    return "".join(f", {part}" for part in parts)


def _train_images(data: DataBundle) -> str:
    """'N train', and the images an epoch takes where whole batches leave some out."""
    every, taken = data.train.num_images, data.train.num_samples
    if every == taken:
        return f"{taken} train"
    return f"{every} train ({taken} an epoch: whole batches, reshuffled each epoch)"


def _train_notes(config: RunConfig, main: bool) -> None:
    """Say which schedule and optimizer settings the run never uses or reaches, on stderr (rank 0; --quiet or not)."""
    if main:
        for note in train_notes(config.train):
            print(f"cnnkit: note: {note}", file=sys.stderr)


def _restore_rank(state: dict[str, Any], dist: Processes, progress: Progress,
                  engine: Engine) -> None:  # fmt: skip
    """Set this rank's saved generator states (if the world size changed: rank 0's, and torch's
    then reseeded from it per rank, so mixup or dropout do not draw alike on every rank), its
    statistics of the epoch in progress and its moving average's buffers (a mid-epoch resume
    keeps the world size)."""
    partials = state.get("partial_ranks") or []
    if len(partials) == dist.world_size:
        progress.partial = dict(partials[dist.rank])
    buffers = state.get("ema_buffer_ranks") or []
    if engine.ema is not None and len(buffers) == dist.world_size:
        load_ema_buffers(engine, buffers[dist.rank])
    ranks = state.get("rng_ranks") or [state.get("rng")]
    mine = ranks[dist.rank] if len(ranks) == dist.world_size else state.get("rng")
    try:
        set_rng_state(mine)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
        raise CheckpointError(f"last.pt: its random generator states are damaged ({e})") from None
    if len(ranks) != dist.world_size and dist.world_size > 1:  # each rank a stream of its own
        drawn = int(torch.randint(2**62, (1,)))  # from rank 0's state: the same on every rank
        torch.manual_seed(mix_seed(drawn, dist.rank))  # (as a new run seeds each rank's)
