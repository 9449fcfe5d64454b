"""A run directory's config.yaml, as a resume sees it: written under a line that marks what
cnnkit wrote, an edit read back and refused where the resume would not make it, and a last.pt
told from another run's by the run id its checkpoints carry."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from cnnkit.checkpoint import load_checkpoint
from cnnkit.config import RunConfig, absolute_data, dump_run, validate_run
from cnnkit.errors import CheckpointError, ConfigError
from cnnkit.nn.yamlio import read_yaml
from cnnkit.runtime import write_atomic

WRITTEN = re.compile(r"# cnnkit wrote this run's settings \(sha256 ([0-9a-f]{16})\)")


def write_run_config(config: RunConfig, path: Path) -> None:
    """A run directory's config.yaml: the resolved run, under a first line that marks it as
    cnnkit wrote it (a hash of the rest), so a resume can tell an edit, which it never reads,
    from what it wrote (edited_run_config). Still a run file: the line is a comment."""
    body = dump_run(config)
    mark = hashlib.sha256(body.encode()).hexdigest()[:16]
    header = (f"# cnnkit wrote this run's settings (sha256 {mark}); `cnnkit train --resume` "
              "continues last.pt's, changed by key=value overrides, not by edits here\n")  # fmt: skip
    write_atomic(Path(path), (header + body).encode())


def edited_run_config(path: Path) -> dict[str, Any] | None:
    """config.yaml's settings where they were edited since cnnkit wrote them (its mark no
    longer fits the rest), else None (as written, unmarked, or unreadable)."""
    try:
        first, _, body = Path(path).read_text(encoding="utf-8").partition("\n")
    except (OSError, UnicodeDecodeError):
        return None
    found = WRITTEN.match(first)
    if found is None or hashlib.sha256(body.encode()).hexdigest()[:16] == found.group(1):
        return None
    try:
        data = read_yaml(path)
    except ConfigError as e:
        raise ConfigError(f"{e} (edited since the run wrote it: a resume takes last.pt's "
                          "settings; undo the edit)") from None  # fmt: skip
    return data if isinstance(data, dict) else {}


def same_run(last: Path, state: dict[str, Any]) -> None:
    """CheckpointError where last.pt and the best.pt beside it are of different runs (a last.pt
    copied from another run would otherwise train on, and replace this run's best.pt and
    metrics): each checkpoint says its run's id. Older checkpoints, without one: the same
    network, and best.pt's epochs before its last those of last.pt (a kill between the two
    files of an epoch's save leaves best.pt an epoch ahead, and its epoch is trained again)."""
    try:
        best = load_checkpoint(last.with_name("best.pt"))
    except CheckpointError:  # none, or damaged: said where best.pt itself is read
        return
    ids = state.get("run_id"), best.get("run_id")
    if None not in ids:
        same = ids[0] == ids[1]
    else:
        rows = [json.dumps(h, sort_keys=True, default=str)[1:-1]
                for h in (best.get("history", [])[:-1], state.get("history", []))]  # fmt: skip
        same = state.get("model_spec") == best.get("model_spec") and rows[1].startswith(rows[0])
    if not same:
        raise CheckpointError(f"{last}: not this run's checkpoint: best.pt beside it is another "
                              "run's (a last.pt copied from another run?); put this run's own "
                              "last.pt back, or train anew elsewhere (--out)")  # fmt: skip


def check_unedited(run_dir: Path, config: RunConfig, state: dict[str, Any],
                   overrides: list[str] | None = None) -> None:  # fmt: skip
    """ConfigError where the run's config.yaml was edited to a setting other than last.pt's
    that this resume does not set (an override given wins): a resume never reads
    config.yaml, and would silently train on without the edit, then write over it. The edit
    is read as a run file is (`lr: 1e-2` the number), and named with the override to give."""
    path = Path(run_dir) / "config.yaml"
    edited = edited_run_config(path)
    if edited is None:
        return
    if edited.get("model") not in (yaml.safe_load(dump_run(config)).get("model"),
                                   state["config"].get("model")):  # fmt: skip
        raise ConfigError(f"{path}: model: edited since the run wrote it, but a resumed run keeps "
                          "its network: undo the edit (or start a new run from config.yaml)")  # fmt: skip
    try:
        theirs = _settings({**edited, "model": state["model_spec"]})
    except ConfigError as e:
        raise ConfigError(f"{path}: edited since the run wrote it, and no longer a valid run "
                          f"({e}): a resume takes last.pt's settings; undo the edit") from None  # fmt: skip
    raw = dict(copy.deepcopy(state["config"]), model=state["model_spec"])
    absolute_data(raw)  # (an older run's relative paths: as resume_config reads them)
    saved = _settings(raw)
    given = {item.split("=", 1)[0].strip() for item in overrides or []}
    edits, gives = [], []
    for key in sorted(set(theirs) | set(saved)):
        if key.startswith("model.") or any(key == g or key.startswith(g + ".") for g in given):
            continue  # (the network: above; an override given: it wins)
        value, before = theirs.get(key, _ABSENT), saved.get(key, _ABSENT)
        if value == before:
            continue
        shown = "left out there" if value is _ABSENT else f"{_shown(value)} there"
        edits.append(f"{key}: {shown}, {_shown(before)} in last.pt")
        if value is not _ABSENT:
            gives.append(
                f"{key}={shlex.quote(value if isinstance(value, str) else json.dumps(value))}"
            )
    if edits:  # all of them at once: one resume to give them, not one try each
        more = f"; and {len(edits) - 4} more" if len(edits) > 4 else ""
        give = f"give {' '.join(gives)}, or " if gives else ""
        raise ConfigError(f"{path}: edited since the run wrote it ({'; '.join(edits[:4])}{more}): "
                          "a resume continues last.pt's settings, changed by key=value "
                          f"overrides only: {give}undo the edit")  # fmt: skip


def _settings(raw: dict[str, Any]) -> dict[str, Any]:
    """A run mapping's settings as config.yaml writes them, validated, by dotted key."""
    return _leaves(yaml.safe_load(dump_run(validate_run(raw))))


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


_ABSENT = object()


def _leaves(data: Any, prefix: str = "", skip: str = "") -> dict[str, Any]:
    """A mapping's values by dotted key (lists whole)."""
    if not isinstance(data, dict):
        return {prefix[:-1]: data} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in data.items():
        if str(key) != skip:
            out |= _leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {
                f"{prefix}{key}": value}  # fmt: skip
    return out
