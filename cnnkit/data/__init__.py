"""Data sources (bundled, synthetic, folder, packed), packing, loading and batched augmentation.

A run file's `data:` section names a `source`; SOURCES maps it to the config class that
validates the section and builds the streams (`cfg.build(device, rank, world_size, seed)`).
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from pydantic import ValidationError

from cnnkit.data.base import Batches, DataBundle, DataConfigBase, Preprocess
from cnnkit.errors import ConfigError

# source name -> "module:ConfigClass"
SOURCES: dict[str, str] = {
    "digits": "cnnkit.data.bundled:DigitsConfig",
    "faces": "cnnkit.data.bundled:FacesConfig",
    "synthetic": "cnnkit.data.synthetic:SyntheticConfig",
    "folder": "cnnkit.data.folder:FolderConfig",
    "packed": "cnnkit.data.packed:PackedConfig",
}


def data_config(section: dict[str, Any] | DataConfigBase) -> DataConfigBase:
    """Validate a `data:` section into its source's config (one clear ConfigError if bad)."""
    if isinstance(section, DataConfigBase):
        return section
    if not isinstance(section, dict):
        raise ConfigError(f"data: expected a mapping, got {section!r}")
    source = section.get("source")
    if source not in SOURCES:
        close = difflib.get_close_matches(str(source), SOURCES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (one of: {', '.join(SOURCES)})"
        raise ConfigError(f"data.source: unknown source {source!r}{hint}")
    module, cls = SOURCES[source].split(":")
    config_class = getattr(importlib.import_module(module), cls)
    try:
        return config_class.model_validate(section)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"data.{loc}: {err['msg'].removeprefix('Value error, ')}") from None


__all__ = ["SOURCES", "Batches", "DataBundle", "DataConfigBase", "Preprocess", "data_config"]
