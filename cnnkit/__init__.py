"""cnnkit: describe any CNN in a file; train it on CPU, one GPU or many; classify, export, benchmark.

    import cnnkit
    model = cnnkit.build_model("resnet18")              # a torch.nn.Module
    summary = cnnkit.fit("digits", ["train.epochs=5"])  # what `cnnkit train digits` does
    clf = cnnkit.Classifier.load(summary["run_dir"])

Attributes are imported on first use, so `import cnnkit` (and `cnnkit --help`) stays fast.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from cnnkit.errors import CheckpointError, CnnkitError, ConfigError, DataError

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "Classifier",
    "CnnkitError",
    "ConfigError",
    "DataError",
    "Network",
    "StopTraining",
    "build_model",
    "fit",
]

_LAZY = {
    "StopTraining": "cnnkit.train.loop",
    "Network": "cnnkit.nn",
    "build_model": "cnnkit.nn",
    "Classifier": "cnnkit.infer",
}


def fit(
    run: str | Path | dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    *,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    quiet: bool = False,
    on_step: Any = None,
    dry_run: bool = False,
    callbacks: list[Any] | tuple = (),
) -> dict[str, Any]:
    """Train a run exactly as `cnnkit train` does and return its summary (also summary.json).

    `run`: a zoo run, a run file or a mapping; `overrides`: dotted `key=value` strings; `out`:
    the run directory; `resume`: a run directory to continue; `quiet`: print only the last line
    (`done: ... -> RUN_DIR`), as `--quiet` does. A run whose data mines hard
    negatives (the faces run) trains its rounds (and a resume of it continues them; callbacks
    reach every round's training, where StopTraining ends that round's and the mining goes
    on); any other run trains once, alone or as a torchrun worker. `dry_run`: build the data,
    the network and its settings, print the start line and stop (nothing is written). `callbacks`: objects with `on_step_end(epoch,
    step, global_step)` and/or `on_epoch_end(row)` methods (a row: that epoch's metrics.csv
    figures); either may raise `cnnkit.StopTraining` to end the run there, files written.
    `on_step(epoch, step, global_step)`: a function called as on_step_end is (epoch and step
    from 1, as logged). The run seeds torch, numpy and python from its `seed`; the caller's
    generators are as they were when it returns. Calls from threads of one process train one
    after the other: the generators and torch's settings a run sets are the process's.
    """
    from cnnkit.runtime import random_state_kept
    from cnnkit.train.run import launch

    _check_resume(run, out, resume)
    _check_run(run, overrides)
    overrides, callbacks = _checked_arguments(overrides, callbacks, on_step)
    hooks = {"quiet": quiet, "on_step": on_step, "callbacks": callbacks}
    with _ONE_RUN_AT_A_TIME, random_state_kept():
        mined = _fit_mining(run, overrides, out, resume, dry_run, hooks)
        if mined is not None:
            return mined
        return launch(run, overrides, out=out, resume=resume, dry_run=dry_run, **hooks)


_HOOK_METHODS = ("on_step_end", "on_epoch_end")
_ONE_RUN_AT_A_TIME = threading.RLock()  # (two runs in threads drew from each other's seeds)


def _check_run(run: Any, overrides: Any) -> None:
    """A run that is no name, path or mapping is one line (fit(5) raised pathlib's TypeError;
    fit(["train.epochs=1"]), its run left out, too)."""
    from cnnkit.errors import ConfigError, brief

    if run is None or isinstance(run, (str, Path, dict)):
        return
    hint = ""
    if isinstance(run, (list, tuple)) and all(isinstance(o, str) and "=" in o for o in run):
        hint = " (overrides go second: fit(RUN, [...]))"
    raise ConfigError(f"run: a zoo run, a run file or a mapping, got {brief(run)}{hint}")


def _check_resume(run: Any, out: Any, resume: Any) -> None:
    """resume= continues a run in its own directory, with its own settings: a run or an out
    given with it is refused, as `cnnkit train --resume` refuses them (the run was ignored,
    and out= named the run's directory in the summary, not the one given)."""
    from cnnkit.errors import ConfigError, brief

    if resume is not None and (out is not None or run is not None):
        named = brief(run) if isinstance(run, dict) else run
        given = f"out={out}" if out is not None else f"the run {named}"
        raise ConfigError(f"resume={resume} continues that run in its own directory: {given} "
                          "cannot be given with it (overrides can)")  # fmt: skip


def _checked_arguments(overrides: Any, callbacks: Any, on_step: Any) -> tuple[list[str], list]:
    """fit's overrides and callbacks checked before anything is built or written (a string
    was read a character at a time; callbacks=5 failed after the run directory was made): one
    callback alone is a list of one."""
    from cnnkit.errors import ConfigError, brief

    if isinstance(callbacks, type) or any(isinstance(cb, type) for cb in _listed(callbacks)):
        raise ConfigError(f"callbacks: objects, not classes: give {_class_of(callbacks)}() (its "
                          "methods are called on an object)")  # fmt: skip
    if isinstance(overrides, str):
        raise ConfigError(f"overrides: a list of key=value strings ([{overrides!r}]), got the "
                          f"string {brief(overrides)}")  # fmt: skip
    if overrides is not None and not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"overrides: a list of key=value strings, got {brief(overrides)}")
    if any(hasattr(callbacks, m) for m in _HOOK_METHODS):
        callbacks = [callbacks]
    if not isinstance(callbacks, (list, tuple)) or not all(
        any(callable(getattr(cb, m, None)) for m in _HOOK_METHODS) for cb in callbacks
    ):  # fmt: skip
        raise ConfigError(f"callbacks: objects with an on_step_end(epoch, step, global_step) "
                          f"or on_epoch_end(row) method, got {brief(callbacks)}")  # fmt: skip
    if on_step is not None and not callable(on_step):
        raise ConfigError(
            f"on_step: a function of (epoch, step, global_step), got {brief(on_step)}"
        )
    return list(overrides or []), list(callbacks)


def _listed(callbacks: Any) -> list:
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else []


def _class_of(callbacks: Any) -> str:
    """The name of the first class given as a callback."""
    found = callbacks if isinstance(callbacks, type) else next(
        cb for cb in _listed(callbacks) if isinstance(cb, type))  # fmt: skip
    return found.__name__


def _fit_mining(run, overrides, out, resume, dry_run: bool, hooks: dict) -> dict | None:
    """The rounds of a run that mines hard negatives, new or resumed; None for any other run
    (a new mining run's dry run is its first round's)."""
    from cnnkit import mining
    from cnnkit.config import load_run
    from cnnkit.train.rundir import new_run_dir

    if resume is not None:
        mining.check_not_a_round(resume)
        if not mining.mining_run(resume):
            return None
        if dry_run:
            return mining.describe_resume(resume, overrides, hooks["quiet"])
        _one_process()
        return mining.resume_rounds(resume, overrides, **hooks)
    if run is None or dry_run:
        return None
    config = load_run(run, overrides)
    if mining.mining_of(config) is None:
        return None
    _one_process()
    return mining.fit_rounds(config, new_run_dir(config.name, out), **hooks)


def _one_process() -> None:
    from cnnkit.distributed import launched

    if launched():
        raise ConfigError("data.hard_negatives: mining runs in one process (no --nproc)")


def __dir__() -> list[str]:
    """The lazy attributes too, for tab completion and dir()."""
    return sorted({*globals(), *_LAZY})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cnnkit' has no attribute {name!r}")
