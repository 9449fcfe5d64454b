"""The network file: read it (zoo name, path or dict) and validate its `model:` mapping.

`parse_spec` hands the mapping to the expander (expand.py), whose result is a flat list of
`Node`s in order, each naming the earlier outputs it reads, so the graph builder never sees
blocks, `$params`, conditions, `previous` or defaults.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from cnnkit.errors import ConfigError, brief, suggest
from cnnkit.nn.expr import reads
from cnnkit.nn.kinds import KINDS

MAX_FILE_HOPS = 8  # a run file may name a network file, which may name another ...
RESERVED_PARAMS = ("num_classes", "in_channels", "in_height", "in_width", "index")
BLOCK_LINE_KEYS = ("block", "name", "inputs", "if", "repeat", "start", "first", "inline")
Dim = Annotated[StrictInt, Field(gt=0, le=2**31 - 1)]
RUN_KEYS = ("name", "model", "data", "train", "seed", "deterministic")  # a run file's (RunConfig)


class Described(dict):
    """A network's `model:` mapping that knows which file (or zoo name) it was read from, so
    that its layer errors can name it."""

    source: str | None = None


class BlockDef(BaseModel):
    """A block: layers written once, used many times with parameters (`$name` in its layers)."""

    model_config = ConfigDict(extra="forbid")
    params: dict[str, Any] = Field(
        default_factory=dict, description="name -> default (null: required)"
    )
    sequential: StrictBool = Field(
        False, description="unnamed layers are named 0, 1, 2 ... as in torch's nn.Sequential"
    )
    inputs: list[str] = Field(
        default_factory=lambda: ["input"], min_length=1, max_length=16,
        description="the names its layers read its inputs by; the first is `previous` at its "
        "start and what each repeated copy takes from the one before (a decoder's skip: "
        "[input, skip])",
    )  # fmt: skip
    layers: list[dict[str, Any]] = Field(min_length=1)

    @field_validator("inputs")
    @classmethod
    def _input_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", name) or name == "previous":
                raise ValueError(f"{brief(name)} is not a usable input name")
        if len(set(v)) != len(v):
            raise ValueError(f"names an input twice: {v}")
        return v

    @model_validator(mode="after")
    def _inputs_not_layers(self) -> BlockDef:
        clash = next((n for n in self.inputs if any(raw.get("name") == n for raw in self.layers
                                                    if isinstance(raw, dict))), None)  # fmt: skip
        if clash is not None:
            raise ValueError(f"{clash!r} names an input and a layer; call the layer otherwise")
        return self

    def sized_params(self, given: dict[str, Any], outer: Collection[str]) -> frozenset[str]:
        """The parameters num_classes sizes in a use of this block: given as an expression
        reading one of the caller's (`n: $num_classes`), or defaulting to one reading such."""
        sized = {"num_classes"}
        for key, default in self.params.items():
            value, names = (given[key], outer) if key in given else (default, sized)
            if reads(value, names):
                sized.add(key)
        return frozenset(sized)

    @field_validator("params")
    @classmethod
    def _no_reserved(cls, v: dict[str, Any]) -> dict[str, Any]:
        taken = [k for k in v if k in RESERVED_PARAMS]
        if taken:
            raise ValueError(f"{taken[0]!r} is set by cnnkit; call the parameter otherwise")
        line = [k for k in v if k in BLOCK_LINE_KEYS]  # a use's `start: 0` would never reach it
        if line:
            raise ValueError(f"{line[0]!r} is a keyword of the line that uses a block; call the "
                             "parameter otherwise")  # fmt: skip
        for i, (key, default) in enumerate(v.items()):  # defaults are read in order
            later = [k for k in re.findall(r"\$(\w+)", str(default)) if k in list(v)[i + 1 :]]
            if later:
                raise ValueError(
                    f"the default of {key} uses ${later[0]}, a parameter after it: "
                    f"defaults are read in order, so list {later[0]} first"
                )
        return v


class KeyRule(BaseModel):
    """A rule for the keys of a weights file, applied as it is loaded: keys that fully match
    `drop` are left out (a training-only head the network has not); keys that fully match
    `match` become `to` (with its \\1 groups; an older naming of the same tensors)."""

    model_config = ConfigDict(extra="forbid")
    drop: str | None = None
    match: str | None = None
    to: str | None = None

    @model_validator(mode="after")
    def _one_rule(self) -> KeyRule:
        if (self.drop is None) == (self.match is None) or (self.match is None) != (self.to is None):
            raise ValueError("a rule is {drop: REGEX} or {match: REGEX, to: REPLACEMENT}")
        for pattern in (self.drop, self.match):
            try:
                re.compile(pattern or "")
            except re.error as e:
                raise ValueError(f"{brief(pattern)}: not a regular expression ({e})") from None
        if self.match is not None:
            _check_replacement(re.compile(self.match), self.to or "")
        return self


def _check_replacement(pattern: re.Pattern, to: str) -> None:
    """ValueError unless `to` is a replacement for matches of `pattern`: its \\N and \\g<name>
    name groups the pattern has. Tried on an empty match of a stand-in with the same groups."""
    names = {index: name for name, index in pattern.groupindex.items()}
    groups = "".join(
        f"(?P<{names[i]}>)" if i in names else "()" for i in range(1, pattern.groups + 1)
    )
    try:
        re.fullmatch(groups, "").expand(to)
    except (re.error, IndexError) as e:  # IndexError: an unknown group name
        raise ValueError(
            f"to: {brief(to)} does not fit match {brief(pattern.pattern)} ({e})"
        ) from None


class NetSpec(BaseModel):
    """The `model:` section of a network or run file."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    input: list[Dim] = Field(min_length=1, max_length=3, description="[C, H, W] or [F]")
    num_classes: Dim | None = Field(None, description="omitted: taken from the data set")
    weights: str | None = Field(None, description="a state_dict file to load (safetensors, .pt)")
    weights_keys: list[KeyRule] = Field(
        default_factory=list,
        description="how published weight files name some keys: rename ({match, to}) or drop",
    )
    preprocess: dict[str, Any] | None = Field(
        None,
        description="how classify and export read images for these weights: mean, std "
        "(0-255, per channel), resize, resize_mode, interpolation (default: 0-1 pixels, no "
        "resize)",
    )
    classes: list[str] | str | None = Field(
        None,
        description="the outputs' names, in order, for classify, eval and export: a list, or a "
        "text file of one per line beside the network file (default: class0, class1, ...)",
    )
    defaults: dict[str, dict[str, Any]] = Field(default_factory=dict, description="type -> fields")
    blocks: dict[str, BlockDef] = Field(default_factory=dict)
    layers: list[dict[str, Any]] = Field(min_length=1)

    @field_validator("classes", mode="before")
    @classmethod
    def _named(cls, v: Any) -> Any:
        """Whole numbers are names as written (`classes: [0, 1, 2]`, digits'); checked."""
        if isinstance(v, list):
            v = [str(n) if type(n) is int else n for n in v]
        check_class_names(v)
        return v

    @field_validator("defaults")
    @classmethod
    def _known_types(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for kind, fields in v.items():
            if kind not in KINDS:
                raise ValueError(f"unknown type {brief(kind)}{suggest(kind, KINDS)}")
            known = [f for f in KINDS[kind].model_fields if f not in ("type", "name")]
            unknown = next((f for f in fields if f not in known), None)
            if unknown is not None:  # never blamed on a layer, nor ignored where none is a `kind`
                raise ValueError(
                    f"{kind}.{str(unknown)[:40]}: unknown field{suggest(unknown, known)}"
                )
        return v


def check_class_names(names: Any) -> None:
    """ValueError unless each output's name is one classify can print and a file of classes
    can hold: never blank, never across lines (a name repeated is kept: ImageNet's list repeats
    two). A file's name, or a list's other types, are for the field's own checks."""
    for i, name in enumerate(names if isinstance(names, list) else []):
        if isinstance(name, str) and (not name.strip() or "\n" in name or "\r" in name):
            why = "is blank" if not name.strip() else "holds a line break"
            raise ValueError(f"name {i + 1} of {len(names)} {why}: each output's name is text "
                             "on one line")  # fmt: skip


def read_spec(spec: str | Path | dict[str, Any], _hops: int = 0) -> dict[str, Any]:
    """Return the `model:` mapping of a zoo name, a YAML file or a dict (a run file's too)."""
    if isinstance(spec, dict):  # as a file would give it (a date as text, never an object)
        from cnnkit.nn.yamlio import plain_data

        data, source = plain_data(spec, "" if "model" in spec else "model"), None
        if isinstance(spec, Described):  # read from a file before: its errors still name it
            data = Described(data)
            data.source = spec.source
    elif str(spec).lower().endswith(".caffemodel"):  # Caffe's weights, not its network
        raise ConfigError(f"{spec}: Caffe's weights, not a network: `cnnkit import-caffe "
                          f"deploy.prototxt {spec} -o net.yaml` makes the network file")  # fmt: skip
    else:
        data, source = _read_yaml_or_zoo(str(spec))
    if data is None and source:  # no document, or only comments
        raise ConfigError(
            f"{source}: the file is empty (a network file has model: {{input, layers}}, or "
            "input and layers at its top)"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source or 'spec'}: expected a mapping with 'layers' (or 'model'), got {type(data).__name__}"
        )
    if "model" in data:
        _check_run_keys(data, source)
    model = data.get("model", data)
    if isinstance(model, dict) and "network" in model and "layers" in model:
        where = f"{source}: " if source else ""
        raise ConfigError(f"{where}model: both network: (a network named, as a run file names "
                          "one) and layers: (a network described here); give one of the two")  # fmt: skip
    if isinstance(model, dict) and "network" in model and "layers" not in model:
        return _run_model(model, source, _hops)  # a run file's {network:, weights:}
    if isinstance(model, str):  # a run file naming a zoo network or another file
        if _hops >= MAX_FILE_HOPS:
            raise ConfigError(
                f"{source}: model: files name each other more than {MAX_FILE_HOPS} deep"
            )
        base = Path(source).parent if source else Path.cwd()
        relative = base / model
        return read_spec(str(relative) if relative.is_file() else model, _hops + 1)
    if not isinstance(model, dict) or "layers" not in model:
        _check_misspelt_layers(model, source)
        raise ConfigError(
            f"{source or 'spec'}: no 'layers' list (a network file has model: {{input, layers}})"
        )
    shown = getattr(model, "source", None) or (spec if source else None)
    model = Described(copy.deepcopy(model))
    model.source = str(shown) if shown is not None else None
    for key in ("weights", "classes"):  # files beside the network file
        named = model.get(key)
        if source and isinstance(named, str) and not Path(named).is_absolute():
            model[key] = str(Path(source).parent / named)
    return model


def with_input(network: dict[str, Any], shape: list[int]) -> dict[str, Any]:
    """`network` reading `shape` in place of its own input (a run file's `model.input`). Its
    `preprocess:` describes the input its weights were made for: another channel count drops
    its mean and std (they are another colour space's), another size scales its resize so that
    the crop keeps its share of the resized image (timm's crop_pct); an input that is not a
    square grey or RGB image, which classify cannot feed, drops it."""
    out = copy.copy(network)  # (a Described keeps its source)
    out["input"] = list(shape)
    own, pre = network.get("input"), network.get("preprocess")
    if len(shape) != 3 or shape[0] not in (1, 3) or shape[1] != shape[2]:
        out.pop("preprocess", None)
        return out
    if not isinstance(pre, dict) or not isinstance(own, list) or len(own) != 3:
        return out
    pre = dict(pre)
    if own[0] != shape[0]:
        pre = {k: v for k, v in pre.items() if k not in ("mean", "std")}
    resize, crop = pre.get("resize"), own[-1]
    if isinstance(resize, int) and isinstance(crop, int) and crop > 0 and shape[-1] != crop:
        pre["resize"] = max(shape[-1], round(resize * shape[-1] / crop))
    out["preprocess"] = pre
    return out


def _check_misspelt_layers(model: Any, source: str | None) -> None:
    """A `model:` mapping without `layers` (nor a run file's `network`) whose key is one of them
    misspelt (`laeyrs`, `netwrk`) is refused naming that key, with the one meant."""
    keys = [str(k) for k in model] if isinstance(model, dict) else []
    for meant in ("layers", "network"):
        close = difflib.get_close_matches(meant, keys, n=1)
        if close:
            where = f"{source}: " if source else ""
            raise ConfigError(f"{where}model.{close[0][:40]}: unknown field (did you mean "
                              f"{meant!r}?)")  # fmt: skip


def _check_run_keys(data: dict[str, Any], source: str | None) -> None:
    """A file with `model:` holds a run's keys only: a network field written beside `model:`
    (a mis-indented `weights:`) is refused, never dropped."""
    unknown = next((k for k in data if k not in RUN_KEYS), None)
    if unknown is None:
        return
    where, key = f"{source}: " if source else "", str(unknown)[:40]
    if unknown in NetSpec.model_fields:
        raise ConfigError(f"{where}{key}: a network field beside model: (indent it under model:)")
    raise ConfigError(f"{where}{key}: unknown key (a file with model: takes "
                      f"{', '.join(RUN_KEYS)}){suggest(unknown, RUN_KEYS)}")  # fmt: skip


def _run_model(model: dict[str, Any], source: str | None, hops: int) -> dict[str, Any]:
    """A run file's `model: {network: ..., weights: ...}` (fine-tuning) as the network's mapping
    with those weights; files relative to the run file where they are there, as training reads
    them."""
    if hops >= MAX_FILE_HOPS:
        raise ConfigError(f"{source}: model: files name each other more than {MAX_FILE_HOPS} deep")
    unknown = sorted(set(model) - {"network", "weights", "input", "classes"}, key=str)
    if unknown:  # as `cnnkit train` refuses them: never dropped silently (a mistyped weights)
        where = f"{source}: " if source else ""
        hint = {
            "preprocess": " (preprocess: goes in the network file, beside its layers)",
            "num_classes": " (the outputs are the data's classes: a run needs no count; "
            "classes: names them, `cnnkit info NET --num-classes N` shows a table)",
        }.get(unknown[0]) or suggest(unknown[0], ("network", "weights", "input", "classes"))
        raise ConfigError(f"{where}model.{unknown[0]}: unknown field (a run file's model: takes "
                          f"network, weights, input and classes){hint}")  # fmt: skip
    base = Path(source).parent if source else Path.cwd()

    def beside(name: Any) -> Any:
        return str(base / name) if isinstance(name, str) and (base / name).is_file() else name

    network = read_spec(beside(model["network"]), hops + 1)
    if model.get("weights") is not None:
        network["weights"] = beside(model["weights"])
    if model.get("input") is not None:
        shape = model["input"]  # checked here, where it is written (the network file was blamed)
        if not (isinstance(shape, list) and 1 <= len(shape) <= 3
                and all(type(n) is int and n > 0 for n in shape)):  # fmt: skip
            where = f"{source}: " if source else ""
            raise ConfigError(f"{where}model.input: {brief(shape)} is not [C, H, W] of whole "
                              "numbers above 0")  # fmt: skip
        network = with_input(network, shape)
    if model.get("classes") is not None:
        try:  # checked here, where it is written, as the input is
            check_class_names(model["classes"])
        except ValueError as e:
            raise ConfigError(f"{f'{source}: ' if source else ''}model.classes: {e}") from None
        network["classes"] = beside(model["classes"])
    return network


def _read_yaml_or_zoo(spec: str) -> tuple[Any, str]:
    from cnnkit.nn.yamlio import read_yaml
    from cnnkit.zoo import net_path, zoo_name, zoo_names

    path = Path(spec)
    if not path.is_file() or zoo_name(spec):
        zoo_file = net_path(spec)
        if zoo_file is None and path.is_dir():
            trained = " (a trained run's: model: {network: NET, weights: FILE})" * any(
                path.glob("*.pt"))  # fmt: skip
            raise ConfigError(f"{brief(spec, 80)} is a folder, not a network file{trained}")
        if zoo_file is None:
            raise ConfigError(f"{brief(spec, 80)} is neither a zoo network ('cnnkit zoo' lists "
                              f"them) nor a file{suggest(spec, zoo_names())}")  # fmt: skip
        path = zoo_file
    if path.suffix.lower() == ".prototxt":  # (info and show read one: not a run file's model)
        raise ConfigError(f"{spec[:200]}: a Caffe prototxt: `cnnkit import-caffe "
                          f"{spec[:200]} -o NET.yaml` makes a network file of it")  # fmt: skip
    return read_yaml(path), str(path)
