"""cnnkit: describe any CNN in a file; train it on CPU, one GPU or many; classify, export, benchmark."""

from cnnkit.errors import CheckpointError, CnnkitError, ConfigError, DataError
from cnnkit.nn import Network, build_model

__version__ = "0.1.0"

__all__ = ["CheckpointError", "CnnkitError", "ConfigError", "DataError", "Network", "build_model"]
