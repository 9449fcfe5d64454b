"""Checkpoints, read and written by training and inference alike: atomic save, safe load
(`weights_only=True`: data, never code), the structure validated (`Saved`), RNG state, and
`load_trained` for inference. Format "cnnkit-checkpoint/1": model_spec, num_classes, model
(fp32 state_dict of the plain model), classes, preprocess, config, mean_image (runs with
`normalize: mean_image`), plus the training state.
"""

from cnnkit.checkpoint.locate import (
    CHECKPOINTS,
    NETWORK_SUFFIXES,
    check_not_a_record,
    checkpoint_path,
    dated_run_hint,
    file_kind,
    holds_runs,
    no_checkpoint_in,
    run_of_settings,
    trained_files,
)
from cnnkit.checkpoint.saved import (
    EXPORT_FORMAT,
    FORMAT,
    RunSettings,
    Saved,
    check_mean_image,
    is_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from cnnkit.checkpoint.trained import (
    NOT_HELD,
    check_input_fits,
    export_ema_error,
    export_settings,
    load_trained,
    note_mean_image,
    read_export,
    uses_mean_image,
)

__all__ = [
    "CHECKPOINTS",
    "NETWORK_SUFFIXES",
    "EXPORT_FORMAT",
    "FORMAT",
    "NOT_HELD",
    "RunSettings",
    "Saved",
    "check_input_fits",
    "check_mean_image",
    "check_not_a_record",
    "checkpoint_path",
    "dated_run_hint",
    "file_kind",
    "holds_runs",
    "export_ema_error",
    "export_settings",
    "is_checkpoint",
    "load_checkpoint",
    "load_trained",
    "no_checkpoint_in",
    "run_of_settings",
    "note_mean_image",
    "read_export",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "trained_files",
    "uses_mean_image",
]
