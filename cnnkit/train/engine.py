"""The training step itself, as `cnnkit train` runs it, as a small public API.

    engine = build_engine(network, TrainConfig(), device=torch.device("cpu"))
    loss, correct = train_step(engine, x, y)   # one optimizer step on batch (x, y)

`build_engine` picks what `cnnkit train` picks: device, precision (fp32 | bf16 autocast | fp16
+ GradScaler), channels_last, optional torch.compile, the optimizer over the network's per-layer
groups, label smoothing, clipping and accumulation. `cnnkit bench train` times `train_step`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from cnnkit.config import TrainConfig
from cnnkit.errors import ConfigError
from cnnkit.nn import Network
from cnnkit.train.optim import build_optimizer

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


def default_precision(device: torch.device) -> str:
    """The fastest precision that keeps accuracy: bf16 where the hardware has it, else fp16 on
    CUDA (with loss scaling), else fp32."""
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return "bf16"
    return "fp32"


def resolve_precision(cfg: TrainConfig, device: torch.device) -> tuple[str, bool]:
    """(precision, channels_last) for this device: the config's, or the measured defaults."""
    precision = default_precision(device) if cfg.precision == "auto" else cfg.precision
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision: fp16 needs a CUDA device (use bf16 on CPU)")
    channels_last = cfg.channels_last
    if channels_last is None:  # NHWC pays off with reduced precision (oneDNN, tensor cores)
        channels_last = precision != "fp32"
    return precision, channels_last


SMALL_STEP_MACS = 1e9  # below this, extra CPU threads mostly wait on each other


def default_threads(network: Network, batch: int, cfg: TrainConfig, device: torch.device) -> int:
    """CPU threads for training: the config's, else 1 for small steps (a tiny net's ops are too
    short to split across threads; BENCHMARKS.md has the measurement), else all of torch's."""
    if cfg.threads is not None:
        return cfg.threads
    macs = sum(layer.macs for layer in network.table) * batch
    if device.type == "cpu" and macs < SMALL_STEP_MACS:
        return 1
    return torch.get_num_threads()


def build_engine(
    network: Network,
    cfg: TrainConfig,
    device: torch.device,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    class_weights: torch.Tensor | None = None,
) -> Engine:
    """Move the network to the device in the chosen format and build optimizer, scaler and loss
    (`class_weights`: one weight per class in the training loss, e.g. from `balanced_weights`)."""
    precision, channels_last = resolve_precision(cfg, device)
    network = network.to(device)
    if channels_last:
        network = network.to(memory_format=torch.channels_last)
    model: nn.Module = wrap(network) if wrap else network
    if cfg.compile:
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
    )


def balanced_weights(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """One loss weight per class, N / (K * count), so that rare classes count as much."""
    counts = torch.bincount(labels.flatten().cpu(), minlength=num_classes).float()
    return counts.sum() / (num_classes * counts.clamp(min=1))


def train_step(
    engine: Engine, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on (x, y), split into `accumulate` micro-batches.

    Returns (mean loss, number correct) as device tensors (no host sync).
    """
    model, opt = engine.model, engine.optimizer
    model.train()
    opt.zero_grad(set_to_none=True)
    x = engine.prepare(x)
    chunks = list(zip(x.chunk(engine.accumulate), y.chunk(engine.accumulate), strict=True))
    loss_sum = torch.zeros((), device=x.device)
    correct = torch.zeros((), device=x.device, dtype=torch.long)
    for i, (xc, yc) in enumerate(chunks):
        last = i == len(chunks) - 1
        sync = nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with engine.autocast():
                logits = model(xc)
                loss = engine.loss_fn(logits.float(), yc)
            engine.scaler.scale(loss * (len(yc) / len(y))).backward()
        loss_sum += loss.detach() * len(yc)
        correct += (logits.argmax(1) == yc).sum()
    if engine.grad_clip is not None:
        engine.scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(engine.network.parameters(), engine.grad_clip)
    engine.scaler.step(opt)
    engine.scaler.update()
    return loss_sum / len(y), correct
