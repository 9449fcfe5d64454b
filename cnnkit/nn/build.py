"""The public builders: a network from a zoo name, a network file or a mapping, its class
count checked, its weights loaded."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from cnnkit.errors import ConfigError
from cnnkit.nn.graph import Network, check_classes
from cnnkit.nn.spec import read_spec


def build_model(
    spec: str | Path | dict[str, Any],
    num_classes: int | None = None,
    device: Any = None,
    weights: str | Path | Mapping[str, Any] | None = None,
) -> Network:
    """Build a network from a zoo name, a YAML path or a dict; `num_classes` overrides the file's
    (it sizes the layers that leave their size out; a network whose output is fixed at another
    count is refused).

    `weights` (else the file's `weights:`) names a state_dict file, safetensors or a
    weights-only .pt (torchvision's, timm's), or is a state_dict (another model's
    `state_dict()`), loaded into it; not on the meta device. With `num_classes` given (to
    fine-tune), a classifier whose weights are for another class count keeps fresh ones, and
    `fresh_keys` names them; without it, weights must fit the network whole."""
    return _build(spec, num_classes, device, weights, checked=True)


def build_unchecked(
    spec: str | Path | dict[str, Any],
    num_classes: int | None = None,
    device: Any = None,
    weights: str | Path | Mapping[str, Any] | None = None,
) -> Network:
    """build_model without its check of `num_classes` against a fixed output: for the callers
    that say it in their own words (a run's data classes, the command line's --num-classes)."""
    return _build(spec, num_classes, device, weights, checked=False)


def _build(spec: str | Path | dict[str, Any], num_classes: int | None, device: Any,
           weights: str | Path | Mapping[str, Any] | None, checked: bool) -> Network:  # fmt: skip
    _not_trained_weights(spec)
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):  # torch's own words list every device type it knows
            raise ConfigError(f"device: {device!r} is not a device (cpu, cuda, cuda:N, mps, "
                              "meta)") from None  # fmt: skip
    model = read_spec(spec)
    network = Network(model, num_classes=num_classes, device=device)
    if num_classes is not None and checked:
        check_classes(network, num_classes, f"num_classes={num_classes}",
                      getattr(model, "source", None) or network.name)  # fmt: skip
    weights = weights if weights is not None else model.get("weights")
    if weights is not None and (device is None or torch.device(device).type != "meta"):
        from cnnkit.nn.weights import load_weights

        network.fresh_keys = load_weights(network, weights, other_classes=num_classes is not None)
    return network


def _not_trained_weights(spec: Any) -> None:
    """A checkpoint or export given to build_model, which builds a network from its
    description: one line saying what loads it (the YAML reader's "not a text file ... or a
    trained model" named what build_model does not take; a run directory is said there)."""
    if not isinstance(spec, (str, Path)) or not Path(spec).is_file():
        return
    if Path(spec).suffix.lower() in (".pt", ".pth", ".safetensors", ".ckpt"):
        raise ConfigError(f"{spec}: trained weights, not a network description: give the "
                          "network with them (a run file's model: {network: NET, weights: "
                          "FILE}; build_model(NET, weights=FILE)), or, in Python, "
                          f"cnnkit.Classifier.load({str(spec)!r}).model")  # fmt: skip
