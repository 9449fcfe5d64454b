"""What every model benchmark starts from: the network on its device in its memory format, and a
synthetic batch of the right shape (so the model is timed, not the data pipeline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cnnkit.errors import ConfigError
from cnnkit.nn import Network, build_unchecked


def load_network(
    net: str | Path | dict[str, Any],
    device: torch.device,
    num_classes: int | None = None,
    channels_last: bool = False,
) -> Network:
    """Build a zoo name / file / dict on `device`, optionally in channels_last memory format."""
    model = build_unchecked(net, num_classes=num_classes, device=device)
    if model.num_classes is None:
        raise ConfigError(
            f"{model.name}: the network does not end in class scores (output "
            f"{model.output_shape}); benchmarks need a classifier"
        )
    if channels_last and len(model.input_shape) == 3:
        model = model.to(memory_format=torch.channels_last)
    return model


def check_batch(net: str | Path | dict[str, Any], batch: int, device: torch.device,
                num_classes: int | None = None, training: bool = False,
                accumulate: int = 1) -> None:  # fmt: skip
    """One line before any timing when `batch` images cannot fit on `device` (not a traceback
    from the allocator minutes later), or, `training`, cannot train (more micro-batches, a
    run's `accumulate`, than images; a BatchNorm layer given one value per channel), as
    `cnnkit train` says it."""
    from cnnkit.nn.memory import check_batch_fits
    from cnnkit.train.checks import check_batchnorm
    from cnnkit.train.engine import smallest_chunk

    model = build_unchecked(net, num_classes=num_classes, device="meta")
    check_batch_fits(model.name, model.param_count, model.activation_count, batch, device)
    if training and accumulate > batch:
        raise ConfigError(f"--batch {batch}: the run's train.accumulate splits it into "
                          f"{accumulate} micro-batches: give at least {accumulate} images")  # fmt: skip
    if training:
        check_batchnorm(model, smallest_chunk(batch, accumulate), accumulate > 1, field="--batch")


def synthetic_batch(
    model: Network, batch: int, device: torch.device, channels_last: bool = False, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded random (x, y) batch for `model`: normalised-looking inputs, labels in range."""
    if batch < 1:
        raise ConfigError(f"--batch: must be >= 1, got {batch}")
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn((batch, *model.input_shape), generator=generator).to(device)
    y = torch.randint(0, model.num_classes, (batch,), generator=generator).to(device)
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y


def forward_flops(model: Network) -> float:
    """FLOPs of one image's forward pass: 2 per multiply-add of the layer table (conv, linear)."""
    return 2.0 * sum(row.macs for row in model.table)
