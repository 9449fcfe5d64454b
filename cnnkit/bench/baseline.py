"""The plain PyTorch loop a cnnkit step is compared with: fp32, NCHW, `torch.optim.SGD`, the
textbook three lines, in a process of its own. For `alexnet-owt` it runs torchvision's
`alexnet` itself (the same architecture); for other networks, the cnnkit network built afresh
and run the plain way."""

from __future__ import annotations

import multiprocessing as mp
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


class PlainProcess:
    """The plain loop in a fresh Python process, as a user's own script runs it: none of the
    process-wide settings the `cnnkit` command starts with (cnnkit.runtime) reach it. Calling
    the object runs one step there and returns when it is done, so it times like a step here.
    """

    def __init__(self, model: Network, mode: str, batch: int, device: torch.device):
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        threads = torch.get_num_threads()  # the same CPU threads as the side it is compared with
        args = (child, model.spec, model.num_classes, mode, batch, str(device), threads)
        self._process = context.Process(target=_serve_plain, args=args, daemon=True)
        self._process.start()
        self.name: str = self._conn.recv()

    def __call__(self, _: Any = None) -> None:
        self._conn.send(True)
        self._conn.recv()

    def close(self) -> None:
        """Stop the process."""
        self._conn.send(False)
        self._process.join(timeout=30)


def _serve_plain(
    conn, spec: dict, num_classes: int, mode: str, batch: int, device: str, threads: int
) -> None:
    """The child's side of PlainProcess: build the peer, then one synchronised step per request."""
    from cnnkit.bench.model_setup import synthetic_batch
    from cnnkit.nn import Network

    torch.set_num_threads(threads)
    dev = torch.device(device)
    model = Network(spec, num_classes=num_classes, device="meta")
    peer, name = plain_model(model, dev)
    x, y = synthetic_batch(model, batch, dev)
    step = plain_train_step(peer, x, y) if mode == "train" else plain_infer_step(peer, x)
    conn.send(name)
    while conn.recv():
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        conn.send(True)
