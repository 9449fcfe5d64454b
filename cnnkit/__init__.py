"""cnnkit: describe any CNN in a file; train it on CPU, one GPU or many; classify, export, benchmark."""

from cnnkit.errors import CheckpointError, CnnkitError, ConfigError, DataError
from cnnkit.nn import Network, build_model

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "Classifier",
    "CnnkitError",
    "ConfigError",
    "DataError",
    "Network",
    "build_model",
]


def __getattr__(name: str):
    # Classifier pulls in the image decoding stack: import it only when asked for.
    if name == "Classifier":
        from cnnkit.infer import Classifier

        return Classifier
    raise AttributeError(f"module 'cnnkit' has no attribute {name!r}")
