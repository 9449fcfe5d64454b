"""Data sources (bundled, synthetic, folder, packed), packing, loading and batched augmentation.

A run file's `data:` section is one of the source configs below, told apart by `source`
(`DataConfig`, a discriminated union); each builds its streams with
`cfg.build(device, rank, world_size, seed)`.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from cnnkit.data.base import Batches, DataBundle, DataConfigBase, Preprocess
from cnnkit.data.bundled import DigitsConfig, FacesConfig
from cnnkit.data.folder import FolderConfig
from cnnkit.data.packed import PackedConfig
from cnnkit.data.packfiles import is_pack
from cnnkit.data.synthetic import SyntheticConfig
from cnnkit.errors import ConfigError, brief, config_error

SOURCES: dict[str, type[DataConfigBase]] = {
    "digits": DigitsConfig,
    "faces": FacesConfig,
    "synthetic": SyntheticConfig,
    "folder": FolderConfig,
    "packed": PackedConfig,
}
DataConfig = Annotated[
    DigitsConfig | FacesConfig | SyntheticConfig | FolderConfig | PackedConfig,
    Field(discriminator="source"),
]
_ADAPTER: TypeAdapter[DataConfig] = TypeAdapter(DataConfig)


def check_source(section: Any) -> Any:
    """Refuse a `data:` section without a known `source` in one line, with a suggestion. One
    that names a `path` and no source reads it as what is there: a pack `cnnkit pack` wrote,
    else an image folder (as timm reads a data folder by what it holds)."""
    if not isinstance(section, dict):
        return section  # pydantic says what it expected
    for key, value in section.items():  # (a path with one names no file: no OS call takes it)
        if isinstance(value, str) and "\0" in value:
            raise ConfigError(f"data.{str(key)[:40]}: a NUL character (\\0) names no file or "
                              "setting")  # fmt: skip
    source = section.get("source")
    typo = difflib.get_close_matches("source", [str(k) for k in section], n=1)
    if source is None and "source" not in section and typo:  # `sorce: digits`
        raise ConfigError(f"data.{typo[0][:40]}: unknown field (did you mean 'source'?)")
    if source is None and isinstance(section.get("path"), str) and section["path"]:
        source = "packed" if is_pack(section["path"]) else "folder"
        section = {**section, "source": source}
    if not isinstance(source, str | None):
        raise ConfigError(f"data.source: a name ({', '.join(SOURCES)}), not {brief(source)}")
    if source not in SOURCES:
        close = difflib.get_close_matches(str(source), SOURCES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (one of: {', '.join(SOURCES)})"
        what = "missing" if source is None else f"unknown source {source!r}"
        raise ConfigError(f"data.source: {what}{hint}")
    # a field of another source set to null is dropped: `data.source=packed data.val_labels=null`
    # moves a run file written for a folder to a pack from the command line
    kind = SOURCES[source]
    others = {f for other in SOURCES.values() if other is not kind for f in other.model_fields}
    return {k: v for k, v in section.items()
            if not (v is None and k in others and k not in kind.model_fields)}  # fmt: skip


def data_config(section: dict[str, Any] | DataConfigBase) -> DataConfig:
    """Validate a `data:` mapping into its source's config (one clear ConfigError if bad)."""
    if isinstance(section, DataConfigBase):
        return section
    if not isinstance(section, dict):
        raise ConfigError(f"data: expected a mapping, got {type(section).__name__}")
    try:
        return _ADAPTER.validate_python(check_source(section))
    except ValidationError as e:
        raise config_error(e, "data", hide=SOURCES) from None


__all__ = [
    "SOURCES",
    "Batches",
    "DataBundle",
    "DataConfig",
    "DataConfigBase",
    "Preprocess",
    "check_source",
    "data_config",
]
