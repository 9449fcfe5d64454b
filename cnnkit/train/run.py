"""`fit`: one whole run. Validates and builds everything before touching the run directory,
then trains epoch by epoch, saving last.pt every epoch and every N steps, best.pt, metrics.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from cnnkit.config import RunConfig, apply_override, dump_run, load_run, validate_run
from cnnkit.data import data_config
from cnnkit.data.memory import hash_seed
from cnnkit.errors import CheckpointError, ConfigError
from cnnkit.train.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from cnnkit.train.engine import Engine, balance_loss, build_engine, default_threads
from cnnkit.train.loop import (
    Local,
    Progress,
    StepHook,
    build_network,
    cpu_threads,
    deterministic_mode,
    evaluate,
    seed_everything,
    train_one_epoch,
)
from cnnkit.train.metrics import Console, RunLog, write_summary
from cnnkit.train.optim import Schedule

RUN_FILES = ("config.yaml", "last.pt", "best.pt", "metrics.csv", "summary.json")


def new_run_dir(
    name: str, out: str | Path | None, reuse: bool = False, tag: str | None = None
) -> Path:
    """The directory a new run will write (not created yet); refuses one that holds a run unless
    `reuse` (an elastic restart before the first checkpoint). `tag`: torchrun's job id, so every
    rank and every restart agrees on the default runs/<name>-<tag>."""
    if out is None and tag is not None:
        out = Path("runs") / f"{name}-{tag[:12]}"
    if out is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"{name}-{stamp}"
        n = 1
        while path.exists():
            n += 1
            path = Path("runs") / f"{name}-{stamp}-{n}"
        return path
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path}: exists and is not a directory")
    if not reuse and any((path / f).exists() for f in RUN_FILES):
        raise ConfigError(f"--out {path}: already holds a run (continue it with --resume {path})")
    return path


def launch(
    run: str | Path | None,
    overrides: list[str] | None = None,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    quiet: bool = False,
    on_step: StepHook | None = None,
) -> dict[str, Any]:
    """What `cnnkit train` does, alone or as one torchrun worker: validate, join the process
    group, pick or resume the run directory (elastic restarts continue from last.pt), fit."""
    from cnnkit import distributed
    from cnnkit.train.mining import fit_rounds, mining_of

    restarted = distributed.restart_count() > 0
    state = resume_state(resume) if resume is not None else None
    if state is None and run is None:
        raise ConfigError("train: give a run (a zoo name or a run file) or --resume RUN_DIR")
    config = resume_config(state, overrides) if state else load_run(run, overrides)
    with distributed.group_for(config.train) as group:
        if state is None:
            tag = distributed.run_id() if group is not None else None
            run_dir = new_run_dir(config.name, out, reuse=restarted, tag=tag)
            if restarted and (run_dir / "last.pt").is_file():
                state = resume_state(run_dir)  # the group died: continue from its checkpoint
                config = resume_config(state, overrides)
        else:
            run_dir = Path(resume)
        if state is None and mining_of(config) is not None:
            if group is not None:
                raise ConfigError("data.hard_negatives: mining runs in one process (no --nproc)")
            return fit_rounds(config, run_dir, quiet=quiet, on_step=on_step)
        return fit(config, run_dir, resume=state, quiet=quiet, on_step=on_step, dist=group)


def resume_state(run_dir: str | Path) -> dict[str, Any]:
    """The last.pt of a run directory (CheckpointError if missing, truncated or foreign)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"--resume {run_dir}: no such run directory")
    return load_checkpoint(run_dir / "last.pt")


def resume_config(state: dict[str, Any], overrides: list[str] | None = None) -> RunConfig:
    """The run config stored in a checkpoint, with overrides (e.g. train.epochs=30) applied."""
    raw = dict(state["config"], model=state["model_spec"])  # the file may have moved since
    for item in overrides or []:
        apply_override(raw, item)
    return validate_run(raw)


def fit(
    config: RunConfig,
    run_dir: str | Path | None = None,
    resume: dict[str, Any] | None = None,
    quiet: bool = False,
    on_step: StepHook | None = None,
    dist: Any = None,
) -> dict[str, Any]:
    """Train as `config` says into `run_dir` (resume: a state from `resume_state`); return the
    summary (also written to summary.json)."""
    started = time.perf_counter()
    dist = dist or Local()
    run_dir = Path(run_dir) if run_dir is not None else new_run_dir(config.name, None)
    device = dist.device(config.train.device)
    if config.data["batch_size"] % dist.world_size:
        raise ConfigError(
            f"data.batch_size: the global batch {config.data['batch_size']} does not divide into "
            f"{dist.world_size} processes (each takes batch_size / world_size)"
        )
    with ExitStack() as stack:
        stack.enter_context(deterministic_mode(config.deterministic, device))
        seed_everything(config.seed)
        data = data_config(config.data).build(device, dist.rank, dist.world_size, config.seed)
        network = build_network(config, data)
        engine = build_engine(network, config.train, device, wrap=dist.wrap)
        if config.train.class_weights == "balanced":
            _balance(engine, data, config)
        if dist.world_size > 1:  # same initial weights everywhere, then each rank its own dropout
            torch.manual_seed(hash_seed(config.seed, dist.rank))
        per_rank = config.data["batch_size"] // dist.world_size
        threads = default_threads(network, per_rank, config.train, device)
        stack.enter_context(cpu_threads(threads))
        schedule = Schedule(config.train)
        progress = restore(resume, engine, schedule) if resume else Progress()
        log = _open_run_dir(run_dir, config, progress) if dist.is_main else None
        console = Console(quiet or not dist.is_main)
        context = dict(config=config, data=data, dist=dist, run_dir=run_dir, log=log)
        context["started"] = started
        _describe(console, config, engine, data, run_dir, progress)
        if resume:
            set_rng_state(_rank_rng(resume, dist))  # last: nothing above may draw from them
        try:
            _train_epochs(engine, schedule, progress, console, on_step, context)
        finally:
            if log is not None:
                log.close()
        return _finish(engine, progress, context, time.perf_counter() - started, console)


def _balance(engine: Engine, data, config: RunConfig) -> None:
    labels = getattr(data.train, "labels", None)  # in-memory sources hold every label
    if not isinstance(labels, torch.Tensor):
        raise ConfigError(
            f"train.class_weights: balanced needs an in-memory data source, not "
            f"{config.data['source']}"
        )
    balance_loss(engine, labels, len(data.classes), config.train.label_smoothing)


def _open_run_dir(run_dir: Path, config: RunConfig, progress: Progress) -> RunLog:
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_run(config, run_dir / "config.yaml")
    log = RunLog(run_dir, progress.history)
    if progress.history:  # resumed: drop rows written after the checkpoint
        log.write_epoch(progress.history[-1], final=True)
    return log


def _describe(console: Console, config, engine: Engine, data, run_dir: Path, progress) -> None:
    if progress.epoch >= config.train.epochs:
        console.print(f"{run_dir}: all {config.train.epochs} epochs done (train.epochs=N for more)")
        return
    what = "resuming" if progress.global_step else "training"
    at = f" from epoch {progress.epoch + 1} step {progress.step}" if progress.global_step else ""
    console.print(
        f"{what} {config.name}{at}: {engine.network.name} on {engine.device} "
        f"({engine.precision}{', channels_last' if engine.channels_last else ''}), "
        f"{data.train.num_samples} train / {data.val.num_samples} held-out images, "
        f"batch {config.data['batch_size']} -> {run_dir}"
    )


def _train_epochs(engine, schedule, progress: Progress, console, on_step, ctx) -> None:
    config, data, dist = ctx["config"], ctx["data"], ctx["dist"]
    every, steps = config.train.checkpoint_every, len(data.train)

    def after_step(epoch: int, step: int, global_step: int) -> None:
        if every and global_step % every == 0 and step < steps:
            rngs = dist.gather_rng(rng_state())  # every rank's generators, for exact resume
            if dist.is_main:
                state = training_state(engine, schedule, progress, ctx, rngs)
                save_checkpoint(state, ctx["run_dir"] / "last.pt")
        if on_step is not None:
            on_step(epoch, step, global_step)

    epochs = config.train.epochs
    while progress.epoch < epochs:
        console.start_epoch(progress.epoch + 1, epochs, steps, progress.step)
        stats = train_one_epoch(engine, data.train, schedule, progress, console, after_step, dist)
        val = evaluate(engine, data.val, dist)
        row = _epoch_row(progress, stats, val, schedule, dist, engine.device)
        schedule.end_epoch(1.0 - val["top1"])
        progress.history.append(row)
        progress.epoch, progress.step, progress.partial = progress.epoch + 1, 0, {}
        _save_epoch(engine, schedule, progress, ctx, row)
        console.end_epoch(row, epochs)


def _epoch_row(progress, stats, val, schedule, dist, device) -> dict[str, float]:
    total = torch.tensor([stats["loss"], stats["correct"], stats["seen"]], device=device)
    loss, correct, seen = dist.all_reduce(total.double()).tolist()
    seen = max(seen, 1.0)
    return {
        "epoch": progress.epoch + 1,
        "train_loss": loss / seen,
        "train_top1": correct / seen,
        "val_loss": val["loss"],
        "val_top1": val["top1"],
        "val_top5": val["top5"],
        "lr": schedule.lr(progress.epoch + 1 - 1 / max(progress.step, 1)),  # the last step's
        "images_per_second": seen / max(stats["seconds"], 1e-9),
        "seconds": stats["seconds"],
    }


def _save_epoch(engine, schedule, progress: Progress, ctx, row: dict[str, float]) -> None:
    """last.pt first (it holds the history), then best.pt and the metrics files."""
    rngs = ctx["dist"].gather_rng(rng_state())
    if not ctx["dist"].is_main:
        return
    run_dir = ctx["run_dir"]
    state = training_state(engine, schedule, progress, ctx, rngs)
    if row["val_top1"] > progress.best_top1:
        progress.best_top1 = state["best_top1"] = row["val_top1"]
        skip = ("optimizer", "scaler", "rng", "rng_ranks")
        best = {k: v for k, v in state.items() if k not in skip}
        save_checkpoint(best, run_dir / "best.pt")
    save_checkpoint(state, run_dir / "last.pt")
    ctx["log"].write_epoch(row, final=progress.epoch == ctx["config"].train.epochs)


def training_state(
    engine: Engine, schedule: Schedule, progress: Progress, ctx, rngs: list | None = None
) -> dict[str, Any]:
    """Everything a checkpoint holds: the inference contract plus the exact training state
    (`rngs`: each rank's generator states, rank 0 first)."""
    rngs = rngs or [rng_state()]
    partial = progress.running() if progress.running and progress.step else {}
    data = ctx["data"]
    return {
        "model_spec": engine.network.spec,
        "num_classes": engine.network.num_classes,
        "model": plain_state_dict(engine.network),
        "classes": list(data.classes),
        "preprocess": data.preprocess.to_dict(),
        "config": ctx["config"].model_dump(mode="json"),
        "optimizer": engine.optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "scaler": engine.scaler.state_dict(),
        "epoch": progress.epoch,
        "step": progress.step,
        "global_step": progress.global_step,
        "best_top1": progress.best_top1,
        "seconds": progress.seconds + time.perf_counter() - ctx["started"],
        "history": list(progress.history),
        "partial": partial,
        "rng": rngs[0],
        "rng_ranks": rngs,
    }


def _rank_rng(state: dict[str, Any], dist: Any) -> dict[str, Any]:
    """This rank's saved generator states (rank 0's if the world size changed)."""
    ranks = state.get("rng_ranks") or [state["rng"]]
    return ranks[dist.rank] if len(ranks) == dist.world_size else state["rng"]


def plain_state_dict(network: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors on the CPU, contiguous, floats as fp32 (portable across devices)."""
    out = {}
    for k, v in network.state_dict().items():
        v = v.detach()
        out[k] = (v.float() if v.is_floating_point() else v).contiguous().cpu()
    return out


def restore(state: dict[str, Any], engine: Engine, schedule: Schedule) -> Progress:
    """Load model, optimizer, scaler and schedule from a checkpoint; return where it stood."""
    try:
        engine.network.load_state_dict(state["model"])
        engine.optimizer.load_state_dict(state["optimizer"])
        if engine.scaler.is_enabled() and state.get("scaler"):
            engine.scaler.load_state_dict(state["scaler"])
        schedule.load_state_dict(state["schedule"])
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise CheckpointError(
            f"last.pt does not match this run's network or optimizer: {first}"
        ) from None
    return Progress(
        epoch=state["epoch"],
        step=state["step"],
        global_step=state["global_step"],
        best_top1=state["best_top1"],
        seconds=state["seconds"],
        history=list(state["history"]),
        partial=dict(state["partial"]),
    )


def _finish(engine: Engine, progress: Progress, ctx, seconds: float, console: Console):
    """Write summary.json (rank 0) and return the summary."""
    history, config = progress.history, ctx["config"]
    last = history[-1] if history else {}
    train_seconds = sum(r["seconds"] for r in history)
    images = sum(r["images_per_second"] * r["seconds"] for r in history)
    summary = {
        "name": config.name,
        "run_dir": str(ctx["run_dir"]),
        "epochs": len(history),
        "val_top1": last.get("val_top1"),
        "val_top5": last.get("val_top5"),
        "val_loss": last.get("val_loss"),
        "best_val_top1": max((r["val_top1"] for r in history), default=None),
        "train_images": ctx["data"].train.num_samples,
        "val_images": ctx["data"].val.num_samples,
        "wall_seconds": round(progress.seconds + seconds, 3),
        "images_per_second": round(images / train_seconds, 1) if train_seconds else None,
        "device": str(engine.device),
        "precision": engine.precision,
        "channels_last": engine.channels_last,
        "world_size": ctx["dist"].world_size,
    }
    if ctx["dist"].is_main:
        write_summary(ctx["run_dir"] / "summary.json", summary)
        console.print(
            f"done: held-out top-1 {summary['val_top1']:.2%} top-5 {summary['val_top5']:.2%} "
            f"({summary['val_images']} images), {summary['wall_seconds']:.1f}s -> {ctx['run_dir']}"
        )
    return summary
