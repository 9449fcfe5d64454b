"""`cnnkit train` and `cnnkit eval`: run files in, run directories out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add train and eval to the app."""
    app.command("train")(train)
    app.command("eval")(evaluate)
    app.command("config")(show_config)


RUN_HELP = (
    "A zoo run (digits, faces, ...), a run file, or a network with its data (NET data.path=DIR)."
)


def train(
    run: str = typer.Argument(None, help=RUN_HELP),
    overrides: list[str] = typer.Argument(None, help="key=value, e.g. train.lr=0.02"),
    out: Path = typer.Option(None, "--out", help="Run directory (default runs/<name>-<time>)."),
    resume: Path = typer.Option(None, "--resume", help="Continue the run in this directory."),
    quiet: bool = typer.Option(
        False,
        "--quiet",
        help="Only the last line (done: ... -> RUN_DIR): no start line, progress bars, epoch, "
        "step or mining-round lines; notes and errors still go to stderr.",
    ),
    nproc: int = typer.Option(None, "--nproc", min=1, help="Start N processes here (torchrun)."),
    max_restarts: int = typer.Option(0, "--max-restarts", min=0, help="With --nproc: restarts."),
    oversubscribe: bool = typer.Option(
        False, "--oversubscribe", help="With --nproc on CPUs: allow more processes than cores."
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Build data, network and settings (measured ones cached, as a run caches them), then stop: no run directory is written.",
    ),
) -> None:
    """Train a network: `cnnkit train digits`, `cnnkit train run.yaml train.lr=0.02`."""
    import cnnkit
    from cnnkit.runtime import keep_freed_memory

    keep_freed_memory()
    overrides = list(overrides or [])
    if run is not None and "=" in run and resume is not None:
        run, overrides = None, [run, *overrides]
    if resume is not None and (out is not None or run is not None):
        from cnnkit.errors import ConfigError

        given = f"--out {out}" if out is not None else f"the run {run}"
        raise ConfigError(f"--resume {resume} continues that run in its own directory: "
                          f"{given} cannot be given with it (key=value overrides can)")  # fmt: skip
    if run is not None and resume is None:
        _not_a_trained_model(run)
        _check_not_runs(run)
    if (max_restarts or oversubscribe) and nproc is None:
        from cnnkit.errors import ConfigError

        what = "--max-restarts: restarts" if max_restarts else "--oversubscribe: allows more of"
        raise ConfigError(f"{what} the processes of --nproc N; give --nproc")
    if nproc is not None and not dry_run:
        try:
            code = _start_processes(run, overrides, out, resume, quiet, nproc, max_restarts,
                                    oversubscribe)  # fmt: skip
        except typer.Exit as e:
            code = e.exit_code
        if code == 130:  # a Ctrl-C: rank 0 has said where the run stopped
            sys.exit(130)
        raise typer.Exit(code)
    if nproc is not None and (run is not None or resume is not None):  # a dry run of N
        from cnnkit.train.run import launch

        _check_group(_config(run, overrides, resume), nproc, resume, oversubscribe)
        launch(run, overrides, out=out, resume=resume, quiet=quiet, dry_run=True, processes=nproc)
        return
    cnnkit.fit(run, overrides, out=out, resume=resume, quiet=quiet, dry_run=dry_run)


TRAINED_SUFFIXES = (".pt", ".pth", ".safetensors", ".onnx", ".pt2", ".torchscript")


def _not_a_trained_model(run: str) -> None:
    """A checkpoint or export given as the run: what continues its run, or starts from it."""
    suffix = Path(run).suffix.lower()
    if suffix in TRAINED_SUFFIXES and Path(run).is_file():
        from cnnkit.errors import ConfigError
        from cnnkit.train.rundir import WEIGHTS_SUFFIXES

        weights = run if suffix in WEIGHTS_SUFFIXES else "W.safetensors"  # (exports: not read)
        raise ConfigError(f"{run}: a trained model, not a run file: `cnnkit train --resume "
                          "RUN_DIR` continues the run it came from, and a run file with "
                          f"model: {{network: NET, weights: {weights}}} starts a new one from "
                          "its weights")  # fmt: skip


def _config(run, overrides: list[str], resume):
    """The run's configuration: the run file's, or the resumed run's with the overrides."""
    from cnnkit.config import load_run
    from cnnkit.mining import mining_run
    from cnnkit.train.run import resume_state
    from cnnkit.train.rundir import resume_config

    if resume is None:
        return load_run(run, overrides)
    if mining_run(resume):  # its own config.yaml, not the last.pt of the round it kept
        return load_run(resume / "config.yaml", overrides)
    state = resume_state(resume)
    return resume_config(state, overrides) if state else load_run(resume / "config.yaml")


def _check_not_runs(run: str) -> None:
    """A folder of runs given where a run file goes (`cnnkit config runs`): name a run in it,
    as show and classify do (its runs' curves.png would have it taken for images); runs/NAME
    where only dated runs runs/NAME-TIME are: the newest, not the zoo's run NAME."""
    from cnnkit.checkpoint import holds_runs
    from cnnkit.checkpoint.locate import dated_run_hint
    from cnnkit.errors import ConfigError

    path = Path(run)
    dated = "" if path.exists() or "/" not in run else dated_run_hint(path)
    if dated:
        raise ConfigError(f"{run}: no such run file or run directory{dated}")
    if path.is_dir() and not (path / "config.yaml").is_file():
        held = holds_runs(path)
        if held is not None:
            raise ConfigError(held)


def _check_group(config, nproc: int, resume, oversubscribe: bool = False) -> None:
    """What N processes of this run must fit, checked as the ranks would check it (so a dry
    run of N passes only what N can run), and on CPUs, no more of them than cores unless
    `oversubscribe`."""
    import torch

    from cnnkit.distributed import group_device_name, resolve_device
    from cnnkit.errors import ConfigError
    from cnnkit.mining import mining_of
    from cnnkit.train.checks import check_processes
    from cnnkit.train.run import resume_state

    if mining_of(config) is not None:
        raise ConfigError("data.hard_negatives: mining runs in one process (no --nproc)")
    group_device_name(config.train.device)
    if config.train.device != "auto":  # `cuda` without a GPU: here once, not by each restart
        resolve_device(config.train.device, "train.device")
    cuda = config.train.device != "cpu" and torch.cuda.is_available()  # as each rank chooses
    state = resume_state(resume) if resume is not None else None
    check_processes(config, nproc, torch.device("cuda" if cuda else "cpu"), state, notes=False)
    if not cuda and not oversubscribe:
        _check_cores(nproc)


def _check_cores(nproc: int) -> None:
    """More CPU processes than this process's cores (its affinity mask, its container's quota):
    each would get a fraction of a core, slower than fewer, a mistake unless asked for."""
    from cnnkit.errors import ConfigError, plural
    from cnnkit.runtime import available_cores

    if nproc > (cores := available_cores()):
        raise ConfigError(f"--nproc {nproc}: more processes than the {plural(cores, 'CPU core')} "
                          f"this may run on; give --nproc {cores} or fewer "
                          "(or --oversubscribe to start them all the same)")  # fmt: skip


def _start_processes(run, overrides, out, resume, quiet, nproc: int, max_restarts: int,
                     oversubscribe: bool = False) -> int:  # fmt: skip
    """Re-run this command under torchrun with N processes and one agreed run directory."""
    from cnnkit.agent import start_local
    from cnnkit.train.rundir import claimed_run_dir

    argv = ["train", *([run] if run else []), *overrides]
    config = _config(run, overrides, resume)
    _check_group(config, nproc, resume, oversubscribe)  # here, once, not by N processes each
    argv += ["--quiet"] if quiet else []
    if resume is not None:
        return start_local(nproc, [*argv, "--resume", str(resume)], max_restarts, str(resume))
    with claimed_run_dir(config.name, out, reserve=out is None) as run_dir:
        code = start_local(nproc, [*argv, "--out", str(run_dir)], max_restarts, str(run_dir))
        if code:  # a failed run leaves no empty directory of its own behind
            raise typer.Exit(code)
    return 0


def show_config(
    run: str = typer.Argument(
        ...,
        help="A zoo run, a run file, a network with its data (NET data.path=DIR), a run "
        "directory or a checkpoint in one.",
    ),
    overrides: list[str] = typer.Argument(None, help="key=value, e.g. train.lr=0.02"),
    changed: bool = typer.Option(False, "--changed", help="Only the settings off their default."),
) -> None:
    """Every setting of a run: its value, its default and what it does (what a run from weights
    takes from its network's preprocess: included, with train's notes)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from cnnkit.config import describe_run, load_run, train_notes
    from cnnkit.tables import wide_console
    from cnnkit.train.build import for_weights
    from cnnkit.train.runfile import edited_run_config

    if Path(run).suffix.lower() in TRAINED_SUFFIXES and Path(run).is_file():
        run = _run_dir_of(Path(run))
    if Path(run).is_dir() and (Path(run) / "config.yaml").is_file():  # a run directory's own
        run = str(Path(run) / "config.yaml")
        if edited_run_config(Path(run)) is not None and (Path(run).parent / "last.pt").is_file():
            note = _edit_note(Path(run).parent)
            if note:
                print(f"cnnkit: note: {note}", file=sys.stderr)
    _check_not_runs(run)
    trained = Path(run).name == "config.yaml" and (Path(run).parent / "last.pt").is_file()
    config = load_run(run, list(overrides or []), trained=trained)  # (a resume's, if it trained)
    config, adapted = for_weights(config)  # what `train` would run
    for note in config._notes + adapted + train_notes(config.train):  # (as train says them)
        print(f"cnnkit: note: {note}", file=sys.stderr)
    table = Table(title=Text(f"{config.name}: {run}"), title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("key", "value", "default", "description"):
        table.add_column(column, overflow="fold")
    for key, value, default, description in describe_run(config):
        if changed and value == default:
            continue
        mark = "" if value == default else "bold"
        table.add_row(*(Text(c) for c in (key, _short(value), _short(default), description)),
                      style=mark)  # fmt: skip
    wide_console().print(table)


def _run_dir_of(model: Path) -> str:
    """The run directory a checkpoint or export lies in, whose settings config shows; a
    trained model elsewhere holds no run file to show: what reads it is said instead."""
    from cnnkit.errors import ConfigError
    from cnnkit.train.rundir import WEIGHTS_SUFFIXES

    if (model.parent / "config.yaml").is_file():
        return str(model.parent)
    if model.suffix.lower() not in WEIGHTS_SUFFIXES:  # an export: read_yaml says what it is
        return str(model)
    raise ConfigError(f"{model}: a trained model outside a run directory: `cnnkit config` lists "
                      "the settings of a run (give the run directory it came from), `cnnkit "
                      f"info {model}` shows its network, and a run file with model: {{network: "
                      f"NET, weights: {model}}} trains from its weights")  # fmt: skip


def _edit_note(run_dir: Path) -> str:
    """What an edit of a run directory's config.yaml changed against last.pt (the edited rows
    of the table), and what a resume does with it; nothing where no setting changed."""
    from cnnkit.errors import CnnkitError, ConfigError
    from cnnkit.train.rundir import resume_config, resume_state
    from cnnkit.train.runfile import check_unedited

    try:
        state = resume_state(run_dir)
        config = resume_config(state) if state is not None else None
    except CnnkitError:  # last.pt unreadable here: the edit alone is said
        state = None
    if state is None:
        return (f"{run_dir / 'config.yaml'} was edited since the run wrote it: shown as edited, "
                "but `cnnkit train --resume` takes last.pt's settings, changed by key=value "
                "overrides, and refuses the edit")  # fmt: skip
    try:
        check_unedited(run_dir, config, state)
    except ConfigError as e:  # the edit, named as a resume refuses it
        return f"{e} (shown as edited below)"
    return ""  # the same settings, written otherwise (a comment, the layout)


def _short(value) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def evaluate(
    target: str = typer.Argument(
        ...,
        help="A run directory, checkpoint file, or (with --data) a .safetensors export or a "
        "network file with weights: (torchvision's or timm's published ones, a Caffe import).",
    ),
    data: str = typer.Option(
        None,
        "--data",
        help="An image folder or packed set (every image in it is scored), a source name "
        "(digits, faces, synthetic: its held-out split) or a data YAML (its held-out split: "
        "val_path, else the val_fraction share of path). A path that exists wins over a "
        "source name (./faces over the bundled faces set, with a note).",
    ),
    labels: str = typer.Option(
        None,
        "--labels",
        help="With --data DIR: the label file of a flat folder (FILE CLASS lines).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N"),
    batch_size: int = typer.Option(None, "--batch-size", min=1, help="Evaluation batch size."),
    tencrop: bool = typer.Option(
        False, "--tencrop", help="Also average 10 crops (corners + centre, mirrored) per image."
    ),
    ema: bool = typer.Option(
        False,
        "--ema",
        help="The run's moving average of the weights (train.ema), from its best_ema.pt.",
    ),
) -> None:
    """Loss, top-1 and top-5 accuracy on the held-out split (or --data)."""
    from cnnkit.errors import plural
    from cnnkit.runtime import keep_freed_memory
    from cnnkit.train.evaluation import evaluate_checkpoint

    keep_freed_memory()  # batch after batch reuses the same large buffers
    loaded = _network_file(target, ema)
    result = evaluate_checkpoint(target, data, device, batch_size, tencrop, ema, labels, loaded)
    if as_json:
        print(json.dumps(result, indent=2))
        return
    crop = "centre crop  " if tencrop else ""
    skipped = f" ({result['skipped']} skipped)" if result.get("skipped") else ""
    top5 = result["classes"] > 5  # as training prints it: with 5 classes or fewer it is 100%
    what = f"{result['checkpoint']}{_which_epoch(result)}"
    images = plural(result["images"], "image")
    print(f"{what}: {images}{skipped}  {crop}{_figures(result, top5)}")
    if tencrop:
        print(f"{' ' * len(what)}  {images}  10 crops     "
              f"{_figures(result['tencrop'], top5)}")  # fmt: skip


def _network_file(target: str, ema: bool) -> tuple | None:
    """A network file with `weights:` (or a zoo name, refused: no trained weights) loaded as
    classify loads it, with the meta evaluate_checkpoint reads; None for anything else (a run
    directory, checkpoint or export: evaluate_checkpoint loads it with its records)."""
    from cnnkit.infer.load import load_for_inference, require_trained
    from cnnkit.zoo import net_path

    path = Path(target)
    named = not path.exists() and net_path(target) is not None  # a zoo name
    if not named and not (path.is_file() and path.suffix.lower() in (".yaml", ".yml", ".prototxt")):
        return None
    loaded = load_for_inference(target, ema=ema)
    require_trained(loaded, target)
    meta = {"classes": loaded.classes, "preprocess": loaded.preprocess.to_dict(), "config": {},
            "path": target, "epoch": None, "mean_image": loaded.mean_image,
            "settings": loaded.ran}  # fmt: skip
    return loaded.model, meta


def _which_epoch(result: dict) -> str:
    """' (epoch N, ...)': which weights a run's checkpoint holds (best.pt: the epoch chosen on
    the held-out split these figures may be of); '' for an export."""
    if result.get("epoch") is None:
        return ""
    why = {"best.pt": ", the best held-out top-1",
           "best_ema.pt": ", the moving average's best held-out top-1"}  # fmt: skip
    if result.get("step"):  # saved mid-epoch (Ctrl-C, checkpoint_every): the next one's steps
        return f" (epoch {result['epoch'] + 1}, {result['step']} steps of it done)"
    return f" (epoch {result['epoch']}{why.get(Path(result['checkpoint']).name, '')})"


def _figures(r: dict, top5: bool) -> str:
    return f"loss {r['loss']:.4f}  top-1 {r['top1']:.2%}" + (
        f"  top-5 {r['top5']:.2%}" if top5 else ""
    )
