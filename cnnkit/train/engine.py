"""The training step itself, as `cnnkit train` runs it, as a small public API.

    engine = build_engine(network, TrainConfig(), device=torch.device("cpu"))
    loss, correct = train_step(engine, x, y)   # one optimizer step on batch (x, y)

`build_engine` puts the network on the device in the chosen precision (fp32 | bf16 autocast |
fp16 + GradScaler), memory format and kernels per layer (train/settings.py chooses them), with
optional torch.compile, the optimizer over the network's per-layer groups, label smoothing,
clipping and accumulation. `cnnkit bench train` times `train_step`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from cnnkit.config import TrainConfig
from cnnkit.errors import ConfigError
from cnnkit.nn import Network
from cnnkit.nn.kernels import set_kernels
from cnnkit.runtime import quiet_compile_logs
from cnnkit.train.optim import build_optimizer
from cnnkit.train.recipe import build_ema
from cnnkit.train.settings import Settings, static_settings

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Engine:
    """Everything one training step needs; `network` is the plain model checkpoints save."""

    network: Network
    model: nn.Module  # what runs: the network, maybe compiled and/or wrapped (DDP)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loss_fn: nn.Module
    device: torch.device
    precision: str  # fp32 | bf16 | fp16 (resolved)
    channels_last: bool
    accumulate: int = 1
    grad_clip: float | None = None
    settings: Settings | None = None  # how precision, format and threads were chosen
    ema: nn.Module | None = None  # an AveragedModel of the network (train.ema), or None

    def autocast(self):
        """The autocast context of this engine's precision (a no-op for fp32)."""
        if self.precision == "fp32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.precision])

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Put a batch in the memory format the model was converted to."""
        if self.channels_last and x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x

    def takes(self, images: int) -> bool:
        """Whether a batch of `images` can take a training step: every micro-batch gives each
        BatchNorm layer 2 values per channel at least (torch refuses 1). The batch size was
        checked at the start (checks.check_batchnorm); one that unreadable images shrank, not."""
        if images < 1:
            return False
        fewest = self._batchnorm_values
        return fewest is None or smallest_chunk(images, self.accumulate) * fewest >= 2

    @functools.cached_property
    def _batchnorm_values(self) -> int | None:
        """The fewest values per channel one image gives a BatchNorm layer (None: none)."""
        rows = getattr(self.network, "table", ())
        sizes = [math.prod(r.output_shape[1:]) for r in rows if r.type == "batchnorm"]
        return min(sizes, default=None)


def build_engine(
    network: Network,
    cfg: TrainConfig,
    device: torch.device,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    class_weights: torch.Tensor | None = None,
    settings: Settings | None = None,
) -> Engine:
    """Move the network to the device in the chosen format and build optimizer, scaler and loss.

    `settings`: what `choose_settings` picked (`cnnkit train` measures them); None: the config's
    values, the static rules for what it leaves on auto. `class_weights`: one weight per class
    in the training loss (e.g. from `balanced_weights`).
    """
    settings = settings or static_settings(network, cfg, device, batch=1)
    precision, channels_last = settings.precision, settings.channels_last
    network = network.to(device)
    if channels_last:
        network = network.to(memory_format=torch.channels_last)
    set_kernels(network, dict(settings.kernels))  # a kernel per layer, where measured faster
    model: nn.Module = wrap(network) if wrap else network
    if cfg.compile:
        if device.type == "cpu":
            check_cpu_compiler()
        quiet_compile_logs()
        model = torch.compile(model)
    return Engine(
        network=network,
        model=model,
        optimizer=build_optimizer(network, cfg),
        scaler=torch.amp.GradScaler(device.type, enabled=precision == "fp16"),
        loss_fn=nn.CrossEntropyLoss(
            weight=None if class_weights is None else class_weights.to(device),
            label_smoothing=cfg.label_smoothing,
        ),
        device=device,
        precision=precision,
        channels_last=channels_last,
        accumulate=cfg.accumulate,
        grad_clip=cfg.grad_clip,
        settings=settings,
        ema=build_ema(network, cfg.ema),
    )


def smallest_chunk(images: int, parts: int) -> int:
    """The smallest of torch.chunk(batch of `images`, `parts`): what the last micro-batch of an
    accumulated step holds (chunks of ceil(images / parts), the last the remainder)."""
    size = -(-images // parts)
    return images - size * (-(-images // size) - 1)


def check_cpu_compiler() -> None:
    """ConfigError, before any work, where torch.compile would fail at the first step on a CPU:
    inductor builds its kernels with a C++ compiler, which slim containers lack."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # (another torch: said at the first step instead)
        return
    try:
        get_cpp_compiler()
    except RuntimeError as e:  # inductor's InvalidCxxCompiler
        raise ConfigError(f"train.compile: torch.compile needs a C++ compiler, and none works "
                          f"here ({str(e).strip()[:200]}): install g++ or name one in CXX, or "
                          "leave compiling off (train.compile=false; bench without "
                          "--compile)") from None  # fmt: skip


def balanced_weights(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """One loss weight per class, N / (K * count), so that rare classes count as much."""
    counts = torch.bincount(labels.flatten().cpu(), minlength=num_classes).float()
    return counts.sum() / (num_classes * counts.clamp(min=1))


def train_step(
    engine: Engine, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on (x, y), split into `accumulate` micro-batches whose gradients add
    up to the whole batch's: each micro-batch's mean loss weighs its share of the batch (of
    its images, or with class weights of its images' weights, as the loss normalises).
    `scale` multiplies the loss that is backpropagated (0: a step that adds no gradient of its
    own, but runs DDP's all-reduces with the other ranks).

    Returns (the batch's loss, number correct) as device tensors (no host sync).
    """
    model, opt = engine.model, engine.optimizer
    model.train()
    ddp = hasattr(model, "no_sync")
    # under DDP the gradients are views into its buckets (gradient_as_bucket_view): zeroed in
    # place, since fresh ones each backward would be copied into the buckets every step
    opt.zero_grad(set_to_none=not ddp)
    x = engine.prepare(x)
    chunks = list(zip(x.chunk(engine.accumulate), y.chunk(engine.accumulate), strict=True))
    weight = engine.loss_fn.weight
    per_image = weight[y] if weight is not None and y.dim() == 1 else None  # hard labels
    total = per_image.sum() if per_image is not None else len(y)
    loss_sum = torch.zeros((), device=x.device)
    correct = torch.zeros((), device=x.device, dtype=torch.long)
    for i, (xc, yc) in enumerate(chunks):
        last = i == len(chunks) - 1
        sync = model.no_sync() if ddp and not last else nullcontext()
        with sync:
            with engine.autocast():
                logits = model(xc)
                loss = engine.loss_fn(logits.float(), yc)
            share = (weight[yc].sum() if per_image is not None else len(yc)) / total
            engine.scaler.scale(loss * (share * scale)).backward()
        loss_sum += loss.detach() * share
        hard = yc.argmax(1) if yc.dim() == 2 else yc  # mixed (soft) labels: the larger share
        correct += (logits.argmax(1) == hard).sum()
    if engine.grad_clip is not None:
        engine.scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(engine.network.parameters(), engine.grad_clip)
    engine.scaler.step(opt)
    engine.scaler.update()
    if engine.ema is not None:
        engine.ema.update_parameters(engine.network)
    return loss_sum, correct
