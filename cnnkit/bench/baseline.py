"""The plain PyTorch loop a cnnkit step is compared with: fp32, NCHW, `torch.optim.SGD`, the
textbook three lines. For `alexnet-owt` it runs torchvision's `alexnet` itself (the same
architecture); for other networks, the cnnkit network built afresh and run the plain way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cnnkit.bench.model_setup import load_network
from cnnkit.nn import Network

# cnnkit zoo name -> torchvision model of the same architecture
TORCHVISION = {"alexnet-owt": "alexnet"}


def plain_model(model: Network, device: torch.device) -> tuple[nn.Module, str]:
    """(the peer model on `device`, its name): torchvision's where one matches, else ours."""
    if model.name in TORCHVISION:
        import torchvision

        name = TORCHVISION[model.name]
        peer = torchvision.models.get_model(name, num_classes=model.num_classes)
        return peer.to(device), f"torchvision {name} fp32 NCHW"
    return load_network(model.spec, device, model.num_classes), f"plain {model.name} fp32 NCHW"


def plain_train_step(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[Any], None]:
    """zero_grad, loss.backward(), SGD step (momentum 0.9, weight decay 5e-4), all in fp32."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss()
    x = x.contiguous()  # NCHW
    module.train()

    def step(_: Any = None) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(module(x), y).backward()
        optimizer.step()

    return step


def plain_infer_step(module: nn.Module, x: torch.Tensor) -> Callable[[Any], None]:
    """An fp32 NCHW forward pass in eval mode under no_grad."""
    x = x.contiguous()
    module.eval()

    def step(_: Any = None) -> None:
        with torch.no_grad():
            module(x)

    return step
