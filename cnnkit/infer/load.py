"""One loader for everything inference reads: a run directory, a checkpoint, a .safetensors
export, or a bare network (zoo name, YAML, Caffe prototxt) with freshly initialised weights."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from cnnkit.checkpoint import (
    EXPORT_FORMAT,
    NETWORK_SUFFIXES,
    check_not_a_record,
    checkpoint_path,
    dated_run_hint,
    export_ema_error,
    file_kind,
    load_checkpoint,
    load_trained,
    read_export,
    run_of_settings,
    uses_mean_image,
)
from cnnkit.data.base import Preprocess
from cnnkit.data.preprocess import network_preprocess
from cnnkit.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    one_line,
    suggest,
)
from cnnkit.nn import Network, build_unchecked, read_spec
from cnnkit.nn.graph import scores
from cnnkit.nn.memory import check_fits
from cnnkit.nn.weights import MEAN_IMAGE_KEY
from cnnkit.runtime import write_atomic


@dataclass
class Loaded:
    """A model ready for inference with what it needs to read images and name classes."""

    model: Network  # eval mode
    classes: list[str]
    preprocess: Preprocess
    source: str  # what was loaded, for messages
    trained: bool = True  # False: a network description without weights (fresh ones)
    mean_image: torch.Tensor | None = None  # (C, S, S) a normalize: mean_image run subtracted
    mean_averaged: bool = False  # such a run's older checkpoint: only the image's averages
    ran: dict[str, Any] | None = None  # a checkpoint's settings (precision, channels_last, device)
    untrained: str | None = None  # why weights: named are no trained ones (require_trained)
    weights: str | None = None  # a network file's weights: file (else `source` holds them)


def load_for_inference(target: str | Path, device: Any = "cpu", ema: bool = False,
                       num_classes: int | None = None) -> Loaded:  # fmt: skip
    """Load a run directory, checkpoint, .safetensors file or network description (`ema`: a
    run's moving average of the weights, from its best_ema.pt where it has one; `num_classes`:
    a network description's class count, where it sets none or another)."""
    from cnnkit.zoo import net_path, zoo_names

    path = Path(target)
    if not path.exists() and net_path(str(target)) is None:
        if "/" not in str(target) and not path.suffix:  # a name, not a path: as `info` says it
            raise ConfigError(f"{target!r} is neither a zoo network ('cnnkit zoo' lists them) nor "
                              f"a run directory{suggest(target, zoo_names())}")  # fmt: skip
        if path.suffix.lower() in NETWORK_SUFFIXES:  # a usage error (exit 2), as info says it
            raise ConfigError(f"{target}: no such network or run file")
        raise CheckpointError(f"{target}: no such run directory, checkpoint, export or network"
                              f"{dated_run_hint(target)}")  # fmt: skip
    kind = file_kind(path)  # (by its name, else its first bytes: m.PT, model.ckpt)
    if ema and kind == "export":
        raise export_ema_error(target)
    if ema and not (run_folder(path) or kind == "checkpoint"):
        raise ConfigError(f"--ema: {target} is not a run directory or checkpoint (only those keep "
                          "a moving average of the weights)")  # fmt: skip
    if kind == "export":
        loaded = load_safetensors(path, device)  # (a damaged file: said first)
        _no_class_count(target, num_classes)
        return loaded
    if run_folder(path) or kind == "checkpoint":
        model, meta = load_trained(path, device, ema)  # (a folder not a run: said there)
        _no_class_count(target, num_classes)
        preprocess = Preprocess.from_dict(meta["preprocess"])
        image = meta.get("mean_image")
        averaged = image is None and uses_mean_image(meta.get("config", {}))
        return Loaded(model, list(meta["classes"]), preprocess, meta.get("path", str(path)),
                      mean_image=image, mean_averaged=averaged, ran=meta.get("settings"))  # fmt: skip
    check_not_a_record(path)  # metrics.csv: said as such, not as a network file's error
    return load_network(str(target), device, num_classes)


def _no_class_count(target: str | Path, num_classes: int | None) -> None:
    """A --num-classes given for trained weights (a run, checkpoint or export) is one line."""
    if num_classes is not None:
        raise ConfigError(f"--num-classes {num_classes}: {target} was trained for its own "
                          "classes (--num-classes sizes a network with fresh weights)")  # fmt: skip


def load_network(spec: str, device: Any = "cpu", num_classes: int | None = None) -> Loaded:
    """A network file, zoo name or Caffe prototxt with fresh weights (for export and drawing);
    `num_classes` sizes its class-count layers (none of them: one line)."""
    if spec.endswith(".prototxt"):
        from cnnkit.caffe import import_caffe

        description = import_caffe(spec)
    else:
        description = read_spec(spec)
    weights = description.get("weights")  # (a missing file: said as such, when it is built)
    if num_classes is not None and weights and Path(weights).exists():  # its head: untrained
        raise ConfigError(f"--num-classes {num_classes}: {spec} loads weights ("
                          f"{description['weights']}), trained for its own classes "
                          "(--num-classes sizes a network with fresh weights)")  # fmt: skip
    target = torch.device(device)
    with torch.random.fork_rng(devices=[]):  # the same fresh weights at every export, drawn
        torch.default_generator.manual_seed(0)  # by the CPU's generator (CUDA's untouched)
        try:
            model = build_unchecked(description, num_classes=num_classes,
                                device="meta" if target.type == "meta" else "cpu")  # fmt: skip
        except CheckpointError as e:  # its weights: file (beside it): say whose
            raise CheckpointError(f"{spec}: weights: {e}") from None
    check_sized_by(num_classes, model, spec)
    if target.type not in ("cpu", "meta"):  # refused in one line if it does not fit there
        check_fits(model.name, model.param_count, model.activation_count, target)
    model = model.to(target)
    out = tuple(model.output_shape)  # a vector of scores: one name per output
    outputs = model.num_classes or (out[0] if len(out) == 1 else 0)
    records = trained_records(description.get("weights"), model, outputs)
    given = description.get("preprocess", records.preprocess)
    named = description.get("classes", records.classes)
    image = records.mean_image if "preprocess" not in description else None
    preprocess = network_preprocess(spec, tuple(model.input_shape), given)
    if num_classes is not None and isinstance(named, list) and len(named) != num_classes:
        raise ConfigError(f"--num-classes {num_classes}: {spec} names {len(named)} classes "
                          "(classes:)")  # fmt: skip
    classes = class_names(named, outputs, spec)
    untrained = None  # (an export of fresh weights named as weights: refused as it is alone)
    if records.untrained:
        untrained = f"{spec}: weights: {description['weights']}: {records.untrained}"
    trained = "weights" in description and untrained is None
    return Loaded(model.eval(), classes, preprocess, spec, trained, mean_image=image,
                  untrained=untrained, weights=weights if trained else None)  # fmt: skip


class Records(NamedTuple):
    """What a network file's weights record beside them: a run's preprocessing, classes and
    mean image (None where they record none, or another input or class count), and why they
    are not trained weights (an export of fresh ones: its metadata says so)."""

    preprocess: dict | None = None
    classes: list | None = None
    mean_image: torch.Tensor | None = None
    untrained: str | None = None


def trained_records(weights: Any, model: Network, outputs: int) -> Records:
    """The Records of a `cnnkit export` or a cnnkit checkpoint named as a network file's weights
    (the preprocessing only where it read the input this network reads, the classes where as
    many), which the file's own `preprocess:` and `classes:` replace; none for other files
    (torchvision's and timm's state_dicts: the network file says how they read images)."""
    if not isinstance(weights, str) or not Path(weights).is_file():
        return Records()  # (build_model said what is wrong with it)
    kind = file_kind(Path(weights))
    read = {"export": _export_records, "checkpoint": _checkpoint_records}.get(kind)
    found = read(weights) if read is not None else None
    if found is None:
        return Records()
    pre, classes, image, untrained = found
    shape = tuple(model.input_shape)
    fits = isinstance(pre, dict) and len(shape) == 3 and (
        pre.get("channels"), pre.get("crop")) == (shape[0], shape[-1])  # fmt: skip
    named = classes if isinstance(classes, list) and len(classes) == outputs else None
    return Records(pre if fits else None, named, image if fits else None, untrained)


def _export_records(weights: str) -> Records | None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(weights, framework="pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            image = f.get_tensor(MEAN_IMAGE_KEY).float() if MEAN_IMAGE_KEY in keys else None
        if meta.get("format") != EXPORT_FORMAT:
            return None
        pre, classes = json.loads(meta["preprocess"]), json.loads(meta["classes"])
    except (SafetensorError, OSError, ValueError, KeyError):
        return None  # (build_model read its weights: nothing to add)
    untrained = meta.get("trained") == "false"
    return Records(pre, classes, image,
                   "the export of a network without trained weights (its metadata says so)"
                   if untrained else None)  # fmt: skip


def _checkpoint_records(weights: str) -> Records | None:
    try:
        state = load_checkpoint(weights)
    except CheckpointError:  # a state_dict (torchvision's, timm's): it records nothing more
        return None
    return Records(state["preprocess"], state["classes"], state.get("mean_image"))


def check_sized_by(num_classes: int | None, network: Network, name: str) -> None:
    """A --num-classes that sizes no layer of the network (its output fixed at another count)
    is one line."""
    if num_classes is not None and not network.heads and scores(network) != num_classes:
        raise ConfigError(f"--num-classes {num_classes}: no layer of {name} is sized by "
                          f"num_classes (its output is {' x '.join(map(str, network.output_shape))})")  # fmt: skip


def class_names(given: list[str] | str | None, outputs: int, spec: str) -> list[str]:
    """A network file's `classes:` (a list, or a file of one name per line), one per output;
    class0, class1... where it gives none."""
    if given is None:
        return [f"class{i}" for i in range(outputs)]
    names = given
    if isinstance(given, str):
        try:
            with open(given, encoding="utf-8") as f:
                names = [line.strip() for line in f if line.strip()]
        except (OSError, ValueError) as e:  # (ValueError: not UTF-8, or a NUL in the name)
            why = "not a UTF-8 text file" if isinstance(e, UnicodeDecodeError) else (
                "not a file name (a NUL byte)" if isinstance(e, ValueError) else
                e.strerror or one_line(e))  # fmt: skip
            raise ConfigError(f"{spec}: classes: {given}: {why}") from None
    if len(names) != outputs:
        raise ConfigError(f"{spec}: classes: {len(names)} names for the network's {outputs} "
                          "outputs")  # fmt: skip
    return [str(name) for name in names]


def require_trained(loaded: Loaded, target: str | Path) -> None:
    """ConfigError for a network with fresh weights, whose answers would be noise (classify,
    detect): a run directory, checkpoint, export or network file with `weights:` is needed."""
    if loaded.trained:
        return
    if loaded.untrained:
        raise ConfigError(f"{loaded.untrained}: export a run directory or checkpoint instead")
    if file_kind(Path(loaded.source)) == "export":
        raise ConfigError(f"{target}: the export of a network without trained weights (its "
                          "metadata says so): export a run directory or checkpoint instead")  # fmt: skip
    run = run_of_settings(target)
    if run is not None:
        raise ConfigError(f"{target}: the settings of run {run}, without its weights: give "
                          f"the run directory {run}")  # fmt: skip
    raise ConfigError(f"{target}: a network without trained weights: give a run directory, "
                      "a .pt checkpoint, a .safetensors export or a network file with "
                      "weights:")  # fmt: skip


def metadata(loaded: Loaded) -> dict[str, str]:
    """String metadata describing a model: network, classes and preprocessing (JSON values),
    and a run's settings (the precision its steps ran in, which eval repeats)."""
    meta = {
        "format": EXPORT_FORMAT,
        # the network as built: its num_classes the one the data set (a zoo file says 1000)
        "model_spec": json.dumps({**loaded.model.spec, "num_classes": loaded.model.num_classes}),
        "num_classes": json.dumps(loaded.model.num_classes),
        "classes": json.dumps(loaded.classes),
        "preprocess": json.dumps(loaded.preprocess.to_dict()),
    }
    if loaded.ran is not None:
        meta["settings"] = json.dumps(dict(loaded.ran))
    if not loaded.trained:  # classify and detect refuse it, as they refuse the network itself
        meta["trained"] = "false"
    return meta


def load_safetensors(path: Path, device: Any = "cpu") -> Loaded:
    """Rebuild a model from a .safetensors export (weights + metadata; no code is run)."""
    model, meta = read_export(Path(path))
    preprocess = Preprocess.from_dict(meta["preprocess"])
    return Loaded(model.to(device).eval(), meta["classes"], preprocess, str(path),
                  trained=meta["trained"], mean_image=meta["mean_image"],
                  ran=meta["settings"])  # fmt: skip


def save_safetensors(loaded: Loaded, path: Path) -> None:
    """Write weights plus network, classes and preprocessing as metadata (through a temporary
    file renamed into place; with the usual file mode, not save_file's private 0600)."""
    from safetensors.torch import save

    state = {k: v.detach().to("cpu").contiguous() for k, v in loaded.model.state_dict().items()}
    if loaded.mean_image is not None:  # classify from the export subtracts it as the run did
        state[MEAN_IMAGE_KEY] = loaded.mean_image.detach().to("cpu", torch.float32).contiguous()
    write_atomic(Path(path), save(state, metadata=metadata(loaded)), private=True)


def run_folder(path: Path) -> bool:
    """Whether `path` names a run directory: a folder, unless it holds no checkpoint and is
    also a zoo network's name (a folder `alexnet/` of one's own must not hide the zoo's)."""
    from cnnkit.zoo import net_path

    if not path.is_dir():
        return False
    return net_path(str(path)) is None or any(
        (path / name).is_file() for name in ("best.pt", "last.pt", "best_ema.pt")
    )


def network_of(target: str, num_classes: int | None = None, weights_note: bool = False) -> Network:
    """The network `target` names, built on the meta device (no memory, no weights);
    `weights_note`: a network file's `weights:` that is not there is said in a note (info
    describes the network all the same)."""
    spec: Any = target
    path, network_file = Path(target), True
    hint = "" if path.exists() or "/" not in str(target) else dated_run_hint(target)
    if hint:  # runs/digits for runs/digits-20261130-115642: not the zoo's digits
        raise CheckpointError(f"{target}: no such run directory, checkpoint, export or "
                              f"network{hint}")  # fmt: skip
    if path.suffix == ".prototxt":
        from cnnkit.caffe import import_caffe

        spec = import_caffe(path)
    elif run_folder(path) or file_kind(path) == "checkpoint":
        state = load_checkpoint(checkpoint_path(path))
        _no_class_count(target, None if num_classes == state["num_classes"] else num_classes)
        spec, num_classes = state["model_spec"], state["num_classes"]
        network_file = False  # its preprocessing is the run's data's, kept beside the network
    elif file_kind(path) == "export" and path.is_file():
        spec, saved = _export_spec(path)
        _no_class_count(target, None if num_classes == saved else num_classes)  # as export
        num_classes, network_file = saved, False  # (as a checkpoint)
    elif num_classes is None:
        num_classes = _run_classes(target)
    network = build_unchecked(spec, num_classes=num_classes, device="meta")
    if network_file:  # its preprocess: checked as classify would
        described = read_spec(spec) if isinstance(spec, str) else spec
        network_preprocess(target, tuple(network.input_shape), described.get("preprocess"))
        weights = described.get("weights")
        if weights_note and isinstance(weights, str) and not Path(weights).is_file():
            what = "a folder, not a weights file" if Path(weights).is_dir() else "no such file"
            print(f"cnnkit: note: {target}: weights: {weights}: {what} (classify, eval and "
                  "export need it)", file=sys.stderr)  # fmt: skip
    return network


def _run_classes(target: str) -> int | None:
    """The class count a run file's `data:` gives its network, as training builds it (None for
    a network file, or data whose classes only a scan would tell); data that cannot be read
    here (a folder on another machine) is said in a note, and the network's own count kept.
    The run's other sections are not read here (the network's errors are build_model's)."""
    from cnnkit.data import data_config
    from cnnkit.nn.yamlio import read_yaml
    from cnnkit.zoo import RUNS, net_path

    path = net_path(target) if target in RUNS else Path(target)
    if path is None or path.suffix.lower() not in (".yaml", ".yml") or not path.is_file():
        return None
    raw = read_yaml(path)
    if not isinstance(raw, dict) or "model" not in raw or "data" not in raw:
        return None
    try:
        names = data_config(raw["data"]).class_names()
        why = "no class folders" if names == [] else "a scan of its images would tell them"
    except (ConfigError, DataError) as e:
        names, why = None, one_line(e)
    if not names:
        print(f"cnnkit: note: {target}: its data's classes are not known here ({why}): the "
              "network's own class count is shown", file=sys.stderr)  # fmt: skip
    return len(names) if names else None


def _export_spec(path: Path) -> tuple[dict[str, Any], int | None]:
    """The network a `cnnkit export --format safetensors` file records in its metadata."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        return json.loads(meta["model_spec"]), json.loads(meta.get("num_classes", "null"))
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise CheckpointError(
            f"{path}: no cnnkit network in its metadata ({str(e)[:80]})"
        ) from None
