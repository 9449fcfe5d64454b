"""`cnnkit bench layers`: per-layer forward and backward times, and the whole pass timed as a whole.

Like `caffe time`, without its bugs: each layer is timed alone (device-synchronised, warm-up,
median of repeats) on the activations a real forward pass gave it, and the whole forward and
backward passes are timed separately as single measurements, so the per-layer sum and the true
total are both reported and their gap (timer overhead, caching effects) is visible, not hidden.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cnnkit.bench.model_setup import load_network, synthetic_batch
from cnnkit.bench.timing import Timing, autocast, measure, timer_overhead
from cnnkit.nn import Network
from cnnkit.nn.kernels import FORMATS, set_kernels
from cnnkit.runtime import machine_name


@dataclass(frozen=True)
class LayerTime:
    """One layer's forward and backward timings (backward None: nothing to differentiate)."""

    name: str
    type: str
    output_shape: tuple[int, ...]
    macs: int
    forward: Timing
    backward: Timing | None


@dataclass(frozen=True)
class Runner:
    """How to time things here: device, precision and repeat counts."""

    device: torch.device
    precision: str
    warmup: int
    repeats: int

    def time(self, fn: Callable[[Any], Any], setup: Callable[[], Any] | None = None) -> Timing:
        return measure(fn, self.device, setup=setup, warmup=self.warmup, repeats=self.repeats)


def capture_inputs(model: Network, x: torch.Tensor, runner: Runner) -> list[list[torch.Tensor]]:
    """The input tensors each layer of the table received in one real forward pass."""
    values: dict[str, torch.Tensor] = {"input": x}
    inputs = []
    with torch.no_grad(), autocast(runner.device, runner.precision):
        for row in model.table:
            args = [values[name] for name in row.inputs]
            inputs.append(args)
            values[row.name] = model.get_submodule(row.name)(*args)
    return inputs


def time_layer(module: nn.Module, args: list[torch.Tensor], from_input: bool, runner: Runner):
    """Forward and backward timings of one module on its captured inputs, each call as a
    training step makes it: autocast entered afresh (its cast weights are cached only until
    the context ends, so a step pays for the casts), and gradients made, not added to."""

    def run(_: Any) -> torch.Tensor:
        with torch.enable_grad(), autocast(runner.device, runner.precision):
            return module(*args)

    forward = runner.time(run)

    def setup() -> tuple[torch.Tensor, torch.Tensor] | None:
        module.zero_grad(set_to_none=True)
        # the network input needs no gradient in training; every activation does
        leaves = [a.detach().requires_grad_(not from_input and a.is_floating_point()) for a in args]
        with torch.enable_grad(), autocast(runner.device, runner.precision):
            out = module(*leaves)
        return (out, torch.randn_like(out)) if out.requires_grad else None

    if setup() is None:
        return forward, None
    return forward, runner.time(lambda pair: pair[0].backward(pair[1]), setup)


def time_loss(logits: torch.Tensor, y: torch.Tensor, runner: Runner) -> tuple[Timing, Timing]:
    """Forward and backward timings of the cross-entropy loss on real logits."""
    logits = logits.detach().float()
    forward = runner.time(lambda _: F.cross_entropy(logits, y))

    def setup() -> torch.Tensor:
        return F.cross_entropy(logits.clone().requires_grad_(True), y)

    return forward, runner.time(lambda loss: loss.backward(), setup)


def time_whole(model: Network, x: torch.Tensor, y: torch.Tensor, runner: Runner):
    """Whole forward (with loss), whole backward and whole forward + backward, each as one
    (gradients made afresh, as a training step's zero_grad(set_to_none) leaves them)."""

    def forward(_: Any = None) -> torch.Tensor:
        with autocast(runner.device, runner.precision):
            return F.cross_entropy(model(x).float(), y)

    def fresh() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        return forward()

    def step(_: Any) -> None:
        model.zero_grad(set_to_none=True)
        forward().backward()

    return (
        runner.time(forward),
        runner.time(lambda loss: loss.backward(), fresh),
        runner.time(step),
    )


def bench_layers(
    net: str | dict[str, Any],
    batch: int,
    device: torch.device,
    precision: str = "fp32",
    channels_last: bool = False,
    warmup: int = 1,
    repeats: int = 5,
    num_classes: int | None = None,
    progress: Callable[[str], None] | None = None,
    kernels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Time every layer's forward and backward and the whole passes; a JSON-ready report.
    `progress` hears a line about every 5 seconds (which layer, how far); `kernels`: a kernel
    per layer (nn/kernels.py), as training runs them."""
    runner = Runner(device, precision, warmup, repeats)
    layout = "channels_last" if channels_last else "NCHW"
    given = torch.channels_last if channels_last else torch.contiguous_format
    mixed = any(FORMATS.get(kernel, given) != given for kernel in (kernels or {}).values())
    model = load_network(net, device, num_classes, channels_last).train()  # as in training
    set_kernels(model, kernels or {})
    x, y = synthetic_batch(model, batch, device, channels_last)
    inputs = capture_inputs(model, x, runner)
    rows, said = [], time.monotonic()
    for k, (row, args) in enumerate(zip(model.table, inputs, strict=True)):
        if progress is not None and time.monotonic() - said > 5.0:
            progress(f"timing layer {k + 1}/{len(model.table)} ({row.name})")
            said = time.monotonic()
        module = model.get_submodule(row.name)
        forward, backward = time_layer(module, args, row.inputs == ("input",), runner)
        rows.append(LayerTime(row.name, row.type, row.output_shape, row.macs, forward, backward))
        module.zero_grad(set_to_none=True)
    with torch.no_grad(), autocast(device, precision):
        logits = model(x)
    loss_fwd, loss_bwd = time_loss(logits, y, runner)
    rows.append(LayerTime("loss", "cross_entropy", (), 0, loss_fwd, loss_bwd))
    if progress is not None:
        progress("timing the whole forward, backward and step")
    whole = time_whole(model, x, y, runner)
    report = _report(model, rows, whole, runner, batch, timer_overhead(device))
    return {**report, "memory_format": layout, "layouts_per_layer": mixed}


def _report(model: Network, rows: list[LayerTime], whole, runner: Runner, batch: int, overhead):
    whole_forward, whole_backward, whole_step = whole
    forward_sum = sum(r.forward.median for r in rows)
    backward_sum = sum(r.backward.median for r in rows if r.backward)
    return {
        "net": model.name,
        "device": str(runner.device),
        "hardware": machine_name(runner.device),
        "precision": runner.precision,
        "batch": batch,
        "repeats": runner.repeats,
        "layers": [_layer_dict(r) for r in rows],
        "forward_sum_ms": forward_sum * 1e3,
        "backward_sum_ms": backward_sum * 1e3,
        "forward_whole_ms": whole_forward.median * 1e3,
        "backward_whole_ms": whole_backward.median * 1e3,
        "step_ms": whole_step.median * 1e3,
        "step": whole_step.to_dict(),
        "images_per_second": batch / whole_step.median,
        "timer_overhead_ms": overhead * 1e3,
        "measurements_in_sums": len(rows) + sum(1 for r in rows if r.backward),
    }


def _layer_dict(r: LayerTime) -> dict[str, Any]:
    return {
        "name": r.name,
        "type": r.type,
        "output_shape": list(r.output_shape),
        "macs": r.macs,
        "forward_ms": r.forward.median * 1e3,
        "forward": r.forward.to_dict(),
        "backward_ms": r.backward.median * 1e3 if r.backward else None,
        "backward": r.backward.to_dict() if r.backward else None,
    }


def print_layers(report: dict[str, Any], console: Any = None) -> None:
    """The per-layer table, then per-layer sums against the whole passes timed as a whole."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from cnnkit.tables import wide_console

    console = console or wide_console()
    title = (
        f"{report['net']}  batch {report['batch']}  {report['device']}  {report['precision']}  "
        f"{report['memory_format']}{' input, layouts per layer' if report.get('layouts_per_layer') else ''}  "
        f"median of {report['repeats']}"
    )
    if report.get("settings"):  # threads and kernels: the figures depend on them
        title += f"\n{report['settings']}"
    table = Table(title=Text(title), title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("#", "name", "type", "output"):
        table.add_column(column)
    for column in ("forward ms", "backward ms", "% of sum"):
        table.add_column(column, justify="right")
    total = report["forward_sum_ms"] + report["backward_sum_ms"]
    for i, layer in enumerate(report["layers"]):
        both = layer["forward_ms"] + (layer["backward_ms"] or 0.0)
        table.add_row(
            str(i),
            layer["name"],
            layer["type"],
            "x".join(map(str, layer["output_shape"])),
            f"{layer['forward_ms']:.3f}",
            "-" if layer["backward_ms"] is None else f"{layer['backward_ms']:.3f}",
            f"{100 * both / total:.1f}" if total else "",
        )
    console.print(table)
    for part in ("forward", "backward"):
        s, w = report[f"{part}_sum_ms"], report[f"{part}_whole_ms"]
        console.print(
            f"{part:8s}  per-layer sum {s:10.3f} ms   whole pass {w:10.3f} ms   "
            f"sum/whole {s / w if w else float('nan'):.2f}"
        )
    console.print(
        f"step      forward+backward timed as one: {report['step_ms']:.3f} ms "
        f"({report['images_per_second']:.1f} images/s)"
    )
    console.print(
        f"timer     {report['timer_overhead_ms'] * 1e3:.1f} us per measurement, "
        f"{report['measurements_in_sums']} measurements in the sums"
    )
