"""A network file's `preprocess:` (what its weights were made for: filter, sizes, mean and std),
validated against the network's input; the default where it says none."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from cnnkit.data.base import MAX_SIDE, Preprocess, unit_mistake
from cnnkit.errors import ConfigError, validation_message


def network_preprocess(spec: Any, shape: tuple[int, ...], given: dict | None) -> Preprocess:
    """The preprocessing of a network file (its `preprocess:`, validated), else its default:
    0-255 pixels scaled to 0-1 for images, the values as given for anything else."""
    if reads_images(shape):
        c = shape[0]
        try:
            preprocess = Preprocess.from_dict({"channels": c, "crop": shape[-1], "mean": [0.0] * c,
                                               "std": [255.0] * c, **(given or {})})  # fmt: skip
        except ValidationError as e:
            raise ConfigError(f"{spec}: model: preprocess.{validation_message(e)}") from None
        for name in ("mean", "std"):  # (the values as validated: `std: 58` is [58.0])
            mistake = name in (given or {}) and unit_mistake(name, getattr(preprocess, name))
            if mistake:
                raise ConfigError(f"{spec}: model: preprocess.{name}: {mistake}")
        if preprocess.channels != c or preprocess.crop != shape[-1]:
            raise ConfigError(f"{spec}: model: preprocess: channels and crop are the input's "
                              f"({c} and {shape[-1]}): leave them out")  # fmt: skip
        return preprocess
    if given is not None:
        raise ConfigError(f"{spec}: model: preprocess: only for networks that read square grey "
                          f"or RGB images of at most {MAX_SIDE} px (this one reads "
                          f"{' x '.join(map(str, shape))})")  # fmt: skip
    if len(shape) == 3 and shape[0] <= 4:  # image-like (not square, 2 or 4 channels): 0-1
        c, crop = shape[0], min(shape[-1], MAX_SIDE)  # (crop: unused, nothing crops these)
        return Preprocess(channels=c, crop=crop, mean=[0.0] * c, std=[255.0] * c)
    return Preprocess(channels=1, crop=1, mean=[0.0], std=[1.0])  # vectors: as given


def reads_images(shape: tuple[int, ...]) -> bool:
    """Whether a network's input is a square grey or RGB image (what classify can feed it),
    at most MAX_SIDE pixels a side."""
    return len(shape) == 3 and shape[0] in (1, 3) and shape[1] == shape[2] <= MAX_SIDE
