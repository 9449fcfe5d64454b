"""Pretrained weights for fine-tuning: a state_dict file (safetensors, or a weights-only .pt as
torchvision, timm and their training scripts save) loaded into a network by name. Nothing is
downloaded; every mismatch is named in one line."""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cnnkit.errors import CheckpointError, ConfigError
from cnnkit.nn.yamlio import export_kind, export_said

WRAPPERS = ("state_dict", "model", "model_state_dict")  # keys training scripts nest it under
MEAN_IMAGE_KEY = "cnnkit.mean_image"  # a safetensors export's tensor beside the weights
SHOWN = 3  # keys named per kind of mismatch
GIVEN_STATE = "weights (a state_dict)"  # a state_dict given itself, as messages name it


def read_state_dict(path: str | Path | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file or a weights-only .pt / .pth (a bare state_dict or a
    checkpoint holding one under `state_dict` / `model`; a run's best_ema.pt its moving average),
    or of a state_dict given itself, with DDP's `module.` prefix removed."""
    if isinstance(path, Mapping):  # model.state_dict(), or a checkpoint loaded already
        return _plain_state(dict(path), GIVEN_STATE)
    if not isinstance(path, (str, Path)):  # torchvision's ResNet18_Weights.DEFAULT, True...
        raise ConfigError(f"weights: a state_dict or the file of one (.safetensors, .pt, .pth), "
                          f"got {type(path).__name__} {str(path)[:60]!r}: nothing is downloaded "
                          f"(torchvision's weights: save model.state_dict() to a file once, "
                          f"where it can download)")  # fmt: skip
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path}: a folder, not a weights file (a .safetensors, .pt or "
                              ".pth file)")  # fmt: skip
    if not path.is_file():
        raise CheckpointError(f"{path}: no such weights file")
    safetensors = path.suffix.lower() == ".safetensors" or is_safetensors(path)  # (by contents
    state = _read_safetensors(path) if safetensors else _read_pt(path)  # where the name is other)
    if holds_its_moving_average(path, state):
        state = state["ema"]
    return _plain_state(state, path)


def holds_its_moving_average(path: Path, state: Any) -> bool:
    """Whether `state`, read from `path`, is a cnnkit run's best_ema.pt (the epoch whose moving
    average of the weights, train.ema, scored best): its weights are that average's."""
    return path.name == "best_ema.pt" and isinstance(state, dict) and bool(state.get("ema"))


def _plain_state(state: Any, path: Any) -> dict[str, torch.Tensor]:
    """The state_dict in `state` (itself, or under a training script's key), checked: names
    to tensors, DDP's `module.` prefix removed; `path` names it in errors."""
    for key in WRAPPERS:
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not state:
        raise CheckpointError(f"{path}: holds no state_dict (a mapping of names to tensors)")
    odd = next((k for k in state if not isinstance(k, str)), None)
    if odd is not None:
        raise CheckpointError(f"{path}: not a state_dict: its key {str(odd)[:60]!r} is not a name")
    odd = next((k for k, v in state.items() if not isinstance(v, torch.Tensor)), None)
    if odd is not None:
        raise CheckpointError(f"{path}: not a state_dict: {str(odd)[:60]!r} is not a tensor")
    if all(k.startswith("module.") for k in state):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    return state


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, less a cnnkit export's mean image (the run's
    preprocessing, not a weight of its network)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(path), device="cpu")
        state.pop(MEAN_IMAGE_KEY, None)
        return state
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({str(e)[:100]})") from None


def _read_pt(path: Path) -> object:
    if not starts_as_torch_save(path):  # (torch.load's message would be about weights_only)
        raise CheckpointError(f"{path}: not a weights file (neither safetensors nor a "
                              "torch.save file)")  # fmt: skip
    check_checksums(path, "weights file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))  # what weights_only refused to build
        if found:
            raise CheckpointError(
                f"{path}: refused: it holds a pickled object ({found.group(1)[:60]}), not only "
                "tensors (save a state_dict)"
            ) from None
        raise CheckpointError(unreadable(path, "weights file")) from None
    except Exception:  # torch.load raises many kinds on a truncated or foreign file (and
        raise CheckpointError(unreadable(path, "weights file")) from None  # on an OSError)


def is_safetensors(path: Path) -> bool:
    """Whether a file starts as safetensors does: its header's length (8 bytes, little-endian,
    within the file), then the header's JSON object."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
        size = path.stat().st_size
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= size - 8


def check_checksums(path: Path, what: str) -> None:
    """CheckpointError where a record of a torch.save archive fails its CRC-32 (bytes changed
    on disk or in a copy, the size unchanged): torch.load reads them without a word, and the
    weights come out wrong. 0.1 s for 256 MB. A record saved without one (CRC 0: torch's
    serialization config compute_crc32=False) is not checked."""
    import zipfile

    bad = None
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.CRC == 0 and info.file_size:
                    continue
                try:
                    with archive.open(info) as record:
                        while record.read(1 << 24):
                            pass
                except zipfile.BadZipFile:  # (zipfile's words for a CRC that does not match)
                    bad = info.filename
                    break
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return  # (no archive: a legacy file, or one cut short; torch.load says which)
    if bad is not None:
        raise CheckpointError(f"{path}: a damaged {what}: its record {bad.rsplit('/', 1)[-1]} "
                              "fails its checksum (the file changed after it was written); "
                              "use another copy")  # fmt: skip


def starts_as_torch_save(path: Path) -> bool:
    """Whether a file starts as torch.save writes (a file cut short still does): a zip
    archive's first entry, or (the legacy format, and a plain pickle) a pickle's protocol."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
        return head == b"PK\x03\x04" or head[:1] == b"\x80"
    except OSError:
        return True  # torch.load says what is wrong with reading it


def unreadable(path: Path, what: str) -> str:
    """What a file torch.load cannot read is (`what`: "checkpoint", "weights file"), judged by
    its first bytes, never by the error's text (a text file's is a bare pickle opcode: '101')."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError as e:
        return f"{path}: cannot read it ({e.strerror or e})"
    if not head:
        return f"{path}: an empty file, not a {what}"
    kind = export_kind(Path(path))  # an ONNX, torch.export or TorchScript file of cnnkit's
    if kind is not None:
        return f"{path}: {export_said(kind)}"
    if head.startswith(b"PK\x03\x04"):
        return (f"{path}: not a readable {what} (a zip archive, but truncated, damaged or "
                "not written by torch.save)")  # fmt: skip
    if head[:1] == b"\x80":  # a pickle: torch.save's older format
        return f"{path}: not a readable {what} (a pickle, but truncated or damaged)"
    if _is_text(head):
        return f"{path}: a text file, not a {what} (torch.save writes a zip archive)"
    return (f"{path}: not a {what} (torch.save writes a zip archive, or a pickle in its "
            "older format; this file is neither)")  # fmt: skip


def _is_text(head: bytes) -> bool:
    """Whether a file's first bytes are UTF-8 text (a character cut at their end aside)."""
    for cut in range(4):
        try:
            text = head[: len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return all(c.isprintable() or c in "\t\n\r" for c in text)
    return False


def check_finite_weights(weights: Mapping[str, Any], source: Any) -> None:
    """CheckpointError naming the first tensor that holds nan or inf: such weights classify
    everything as nan (or train into it) without a word otherwise."""
    for name, value in weights.items():
        if not torch.is_tensor(value) or not value.is_floating_point() or value.is_meta:
            continue
        try:
            finite = bool(value.isfinite().all())
        except RuntimeError:  # a dtype without isfinite (float8): not checked
            continue
        if not finite:
            raise CheckpointError(
                f"{source}: {name} holds nan or inf values (weights that diverged, or a "
                "damaged file)"
            )


def load_weights(network: nn.Module, path: str | Path | Mapping[str, Any],
                 other_classes: bool = True) -> list[str]:  # fmt: skip
    """Load a state_dict file (or a state_dict) into `network` (names and shapes must agree)
    and return the keys left as initialised. `other_classes` (fine-tuning: the network was
    built for another class count): a classifier (`heads`) whose tensors differ from the
    file's in their class count alone keeps its fresh weights, so training starts from
    everything else; any other difference is refused, and with other_classes False (a
    network to score with as it is), that one too."""
    state = published_keys(read_state_dict(path), getattr(network, "spec", {}))
    path = GIVEN_STATE if isinstance(path, Mapping) else path  # (for messages)
    check_finite_weights(state, path)
    fresh = _other_class_count(network, state)
    # everything named where more than the class count differs (a fine-tuning run: the rest)
    check_state_fits(network, state if fresh and not other_classes else
                     {k: v for k, v in state.items() if k not in fresh}, path,
                     fresh, other_only=not other_classes)  # fmt: skip
    if fresh and not other_classes:  # a classifier that would score with made-up weights
        theirs, ours = state[fresh[0]].shape[0], network.state_dict()[fresh[0]].shape[0]
        raise CheckpointError(f"{path}: its classifier ({fresh[0].rsplit('.', 1)[0]}) is for "
                              f"{theirs} classes, the network's for {ours} (num_classes): "
                              f"weights for other classes only start a fine-tuning run "
                              f"(cnnkit train), or set num_classes: {theirs} in the network file")  # fmt: skip
    own = network.state_dict()
    state = {**state, **{k: own[k] for k in fresh}}  # heads keep their fresh initialisation
    with torch.no_grad():
        network.load_state_dict(state)
    return fresh


def _other_class_count(network: nn.Module, state: Mapping[str, torch.Tensor]) -> list[str]:
    """The keys of each classifier (`heads`) whose tensors in `state` all differ from the
    network's in their first dimension (the class count) alone: a head with any other
    difference (its inputs, half its tensors) is left to check_state_fits to name."""
    own, fresh = network.state_dict(), []
    for head in getattr(network, "heads", ()):
        keys = [k for k in own if k.startswith(f"{head}.") and k in state]
        if not keys or any(state[k].dim() != own[k].dim() or state[k].dim() == 0
                           or state[k].shape[1:] != own[k].shape[1:] for k in keys):  # fmt: skip
            continue
        counts = {state[k].shape[0] for k in keys}  # the file's class count, one for all
        if len(counts) == 1 and counts != {own[keys[0]].shape[0]}:
            fresh += keys
    return fresh


def published_keys(state: dict[str, torch.Tensor], spec: dict) -> dict[str, torch.Tensor]:
    """`state` with the network file's `weights_keys` rules applied: keys a published file has
    that the network leaves out are dropped, older names of its tensors renamed."""
    rules = spec.get("weights_keys") or []
    if not rules:
        return state
    out = {}
    for key, tensor in state.items():
        for rule in rules:
            if rule.get("drop") is not None and re.fullmatch(rule["drop"], key):
                key = None
                break
            found = re.fullmatch(rule["match"], key) if rule.get("match") is not None else None
            if found:
                key = found.expand(rule["to"])
        if key is not None:
            out[key] = tensor
    return out


def check_state_fits(network: nn.Module, state: Mapping[str, Any], source: Any,
                     fresh: Collection[str] = (), other_only: bool = False) -> None:  # fmt: skip
    """CheckpointError naming the keys that keep `state` from loading into `network`: missing
    (but those in `fresh`), unexpected and mis-shaped ones, with both shapes. `other_only`:
    none where the mis-shaped keys are `fresh` ones alone (said otherwise by the caller)."""
    own = network.state_dict()
    missing = [k for k in own if k not in state and k not in fresh
               and not k.endswith("num_batches_tracked")]  # fmt: skip
    unexpected = [k for k in state if k not in own]
    misshaped = [k for k in own if k in state and state[k].shape != own[k].shape]
    if other_only and not missing and not unexpected and set(misshaped) <= set(fresh):
        return
    if missing or unexpected or misshaped:
        problems = [
            _named(missing, "missing", lambda k: k),
            _named(unexpected, "unexpected", lambda k: k),
            _named(misshaped, "mis-shaped", lambda k: f"{k}: file {_dims(state[k])}, network {_dims(own[k])}"),
        ]  # fmt: skip
        name = getattr(network, "name", type(network).__name__)
        raise CheckpointError(
            f"{source}: does not fit {name}: " + "; ".join(p for p in problems if p)
        )


def _named(keys: list[str], what: str, show: Callable[[str], str]) -> str:
    if not keys:
        return ""
    listed = ", ".join(show(k)[:80] for k in keys[:SHOWN])
    return f"{len(keys)} {what} ({listed}{', ...' if len(keys) > SHOWN else ''})"


def _dims(t: torch.Tensor) -> str:
    return "(" + ", ".join(map(str, t.shape)) + ")"
