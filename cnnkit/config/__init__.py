"""The run configuration: a typed, validated `model:` + `data:` + `train:` document.

`load_run(run, overrides)` reads a zoo run name or YAML file, applies dotted overrides
(`train.lr=0.02 data.batch_size=128`) and validates every field once: `config.data` is the
source's own config (DataConfig), `config.model` a ModelConfig. `dump_run` writes it back.
"""

from cnnkit.config.load import (
    absolute_data,
    apply_override,
    describe_run,
    dump_run,
    load_run,
    run_dict,
    source_follows_path,
    validate_run,
)
from cnnkit.config.sections import (
    ModelConfig,
    RunConfig,
    TrainConfig,
    train_notes,
)

__all__ = [
    "ModelConfig",
    "RunConfig",
    "TrainConfig",
    "absolute_data",
    "apply_override",
    "describe_run",
    "dump_run",
    "load_run",
    "run_dict",
    "train_notes",
    "source_follows_path",
    "validate_run",
]
