"""Export a model: ONNX (dynamic batch, preprocessing in its metadata), torch.export's .pt2
(dynamic batch), TorchScript (deprecated by PyTorch), safetensors; and the check that the
exported model computes what PyTorch computes."""

from __future__ import annotations

import io
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from cnnkit.errors import CnnkitError, ConfigError, one_line
from cnnkit.infer.images import crops_of, to_channels, to_hwc
from cnnkit.infer.load import Loaded, load_safetensors, metadata, save_safetensors
from cnnkit.infer.pools import onnx_countable_pools
from cnnkit.nn.weights import is_safetensors
from cnnkit.nn.yamlio import archive_format
from cnnkit.runtime import write_atomic

Format = Literal["onnx", "torch-export", "torchscript", "safetensors"]
FORMATS: tuple[str, ...] = ("onnx", "torch-export", "torchscript", "safetensors")
RUNTIMES = {"onnx": "ONNX Runtime", "torch-export": "torch.export.load"}  # what --check runs
SUFFIXES = {".onnx": "onnx", ".pt2": "torch-export", ".safetensors": "safetensors",
            ".torchscript": "torchscript"}  # fmt: skip
MAX_BATCH = 1 << 16  # the dynamic batch dimension's upper bound
TOLERANCE = 1e-4  # max abs difference of fp32 logits, relative to the largest logit


@dataclass
class CheckResult:
    """How far the exported model is from PyTorch on random and on real inputs."""

    random_diff: float
    real_diff: float
    batch_sizes: tuple[int, ...]
    scale: float  # the largest |logit| PyTorch gave: fresh weights can give 1e-13

    @property
    def max_diff(self) -> float:
        return max(self.random_diff, self.real_diff)

    @property
    def tolerance(self) -> float:
        return TOLERANCE * self.scale

    @property
    def ok(self) -> bool:  # relative: an export giving zeros fails even where logits are tiny
        return self.max_diff <= self.tolerance


def _suffix_of(fmt: str) -> str:
    return next(suffix for suffix, name in SUFFIXES.items() if name == fmt)


def export_format(path: Path, fmt: str | None) -> str:
    """The format to write `path` in: `fmt` (--format), else the one its suffix names. A name
    that says another format than `fmt` is refused (a .pt2 holding ONNX would fail when read)."""
    implied = SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        if implied is None:
            raise ConfigError(f"-o {path}: its name does not say the format: give --format "
                              f"({', '.join(FORMATS)}) or end it in {', '.join(SUFFIXES)}")  # fmt: skip
        return implied
    fmt = format_name(fmt)
    if implied not in (None, fmt):
        raise ConfigError(f"-o {path}: a {path.suffix} name for --format {fmt} (that name is "
                          f"--format {implied}'s)")  # fmt: skip
    return fmt


def format_name(given: str) -> str:
    """--format's format: its name in any case (ONNX), or its suffix's (pt2, .pt2)."""
    name = given.lower().removeprefix(".")
    name = SUFFIXES.get(f".{name}", name)
    if name not in FORMATS:
        raise ConfigError(f"--format: {given!r} is not one of {', '.join(FORMATS)}")
    return name


def check_replaceable(path: Path, fmt: str) -> None:
    """ConfigError for an existing file that an export would replace, unless its name is the
    format's own (m.onnx) or it already holds an export of that format (by its first bytes):
    `--format onnx -o mean.npy` must not replace an array, a pickle or notes of the user's."""
    if not path.is_file() or path.suffix.lower() == _suffix_of(fmt):
        return
    if held_format(path) != fmt:
        raise ConfigError(f"-o {path}: exists, and is not an earlier export of this format "
                          f"({fmt}), the only file an export replaces: give a new name, or one "
                          f"ending in {_suffix_of(fmt)}")  # fmt: skip


def held_format(path: Path) -> str | None:
    """The export format a file holds, told by its first bytes; None for anything else."""
    if is_safetensors(path):
        return "safetensors"
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return None
    if head == b"PK\x03\x04":
        return archive_format(path)
    if head[:1] == b"\x08" and head[1:2] and head[1] < 0x80:
        return "onnx"  # a ModelProto starts with its ir_version (field 1, a small varint)
    return None


def export(loaded: Loaded, fmt: str, path: Path) -> None:
    """Write `loaded`'s model to `path` in format `fmt`."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    model = loaded.model.to("cpu").eval()
    if loaded.mean_image is not None and fmt != "safetensors":
        print(f"cnnkit: note: the network subtracts a mean image; the {fmt} file records "
              "only its per-channel averages as the preprocessing mean (safetensors keeps the "
              "image)", file=sys.stderr)  # fmt: skip
    with _torch_quiet():
        if fmt == "safetensors":
            save_safetensors(loaded, path)
        elif fmt == "torch-export":
            export_program(loaded, path)
        elif fmt == "torchscript":
            example = torch.zeros(2, *model.input_shape)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch.jit's deprecation notice
                traced = torch.jit.trace(model, example)
                extra = {"cnnkit.json": json.dumps(metadata(loaded))}
                buffer = io.BytesIO()
                torch.jit.save(traced, buffer, _extra_files=extra)
                write_atomic(path, buffer.getvalue(), private=True)
        else:
            export_onnx(loaded, path)


@contextmanager
def _torch_quiet() -> Iterator[None]:
    """torch's UserWarnings while it runs the model to export or check it (an even kernel with
    padding 'same' warns of a zero-padded copy, in several lines): the lines are cnnkit's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.")
        yield


def export_program(loaded: Loaded, path: Path) -> None:
    """torch.export's ExportedProgram (.pt2) with a dynamic batch dimension; the network,
    classes and preprocessing ride along as the extra file cnnkit.json."""
    model = loaded.model.to("cpu").eval()
    example = torch.zeros(2, *model.input_shape)
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    extra = {"cnnkit.json": json.dumps(metadata(loaded))}
    buffer = io.BytesIO()  # written whole, then renamed: torch's writer aborts on a full disk
    torch.export.save(program, buffer, extra_files=extra)
    write_atomic(path, buffer.getvalue(), private=True)


def _need(module: str):
    """Import an optional ONNX package, or say in one line how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"ONNX needs {module}: pip install 'cnnkit[onnx]'") from None


def export_onnx(loaded: Loaded, path: Path) -> None:
    """ONNX with a dynamic batch dimension; classes and preprocessing go in metadata_props."""
    onnx = _need("onnx")
    _need("onnxscript")  # torch's ONNX exporter

    model = loaded.model.to("cpu").eval()
    example = torch.zeros(2, *model.input_shape)
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    with warnings.catch_warnings(), onnx_countable_pools(model, example):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model,
            (example,),
            dynamo=True,
            input_names=["image"],
            output_names=["logits"],
            dynamic_shapes=({0: batch},),
            verbose=False,
        )
    proto = program.model_proto
    pre = loaded.preprocess
    props = {
        **metadata(loaded),
        "format": "cnnkit-onnx/1",
        "mean": json.dumps(pre.mean),  # per channel, 0-255 units: x = (pixel - mean) / std
        "std": json.dumps(pre.std),
        "crop": str(pre.crop),
        "resize": json.dumps(pre.resize),
        "resize_mode": pre.resize_mode,
        "interpolation": pre.interpolation,
        "channels": str(pre.channels),
    }
    del proto.metadata_props[:]
    for key, value in props.items():
        proto.metadata_props.add(key=key, value=value)
    buffer = io.BytesIO()
    onnx.save(proto, buffer)
    _check_loads(buffer.getvalue(), path)
    write_atomic(path, buffer.getvalue(), private=True)


def _check_loads(model: bytes, path: Path) -> None:
    """Refuse, before anything is written, an ONNX model that ONNX Runtime (where installed)
    cannot load as its users do, optimisations on (some shape errors show only there): a file
    written with exit 0 must run."""
    try:
        import onnxruntime as ort
    except ImportError:
        return
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: its warnings are said by the error, if any
    try:
        ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's own exception classes; any means it cannot load
        raise CnnkitError(f"{path}: ONNX Runtime cannot load the export, so it was not "
                          f"written: {one_line(e, 200)}") from None  # fmt: skip


def export_checked(loaded: Loaded, fmt: str, path: Path) -> CheckResult:
    """Export to a temporary file beside `path`, check it (`check_export`), and rename it to
    `path` only where it passes: a failed check, or an export that will not run, leaves `path`
    as it was, with one CnnkitError line for the latter."""
    # the format's own suffix: torch.export.load logs a warning for a name not ending in .pt2
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.check{_suffix_of(fmt)}")
    try:
        export(loaded, fmt, tmp)
        result = _checked(loaded, fmt, tmp, path)
        if result.ok:
            os.replace(tmp, path)
        return result
    except OSError as e:
        if e.filename is not None and Path(e.filename) == tmp:
            e.filename = str(path)  # the error names the file the user asked for
        raise
    finally:
        tmp.unlink(missing_ok=True)


def _checked(loaded: Loaded, fmt: str, tmp: Path, path: Path) -> CheckResult:
    try:
        return check_export(loaded, fmt, tmp)
    except CnnkitError as e:
        raise type(e)(f"{path}: {e}, so it was not written") from None
    except Exception as e:  # the runtime's own errors: the file loads or runs nowhere else either
        runtime = RUNTIMES.get(fmt, fmt)
        raise CnnkitError(f"{path}: {runtime} cannot run the export, so it was not written: "
                          f"{one_line(e, 200)}") from None  # fmt: skip


def run_exported(fmt: str, path: Path) -> Callable[[torch.Tensor], np.ndarray]:
    """A function running the exported file (ONNX Runtime for ONNX) on a float batch."""
    if fmt == "onnx":
        ort = _need("onnxruntime")
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return lambda x: session.run(None, {name: x.numpy()})[0]
    if fmt == "torch-export":
        module = torch.export.load(str(path)).module()
        return lambda x: module(x).detach().numpy()
    if fmt == "torchscript":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit's deprecation notice
            module = torch.jit.load(str(path), map_location="cpu").eval()
    else:
        module = load_safetensors(path).model
    return lambda x: module(x).detach().numpy()


def real_inputs(loaded: Loaded) -> torch.Tensor:
    """Real photographs that ship with scikit-image, preprocessed as at evaluation (normalised);
    for inputs that are not square grey or RGB images, the grey photos squashed to the input's
    height and width and repeated over its channels; none for vector inputs."""
    from skimage import data

    images = [data.astronaut(), data.coffee(), data.chelsea(), data.camera(), data.coins()]
    shape, pre = loaded.model.input_shape, loaded.preprocess
    if len(shape) != 3:
        return torch.zeros(0, *shape)
    c, h, w = shape
    if c in (1, 3) and h == w:
        crops = torch.cat([crops_of(im, pre, tencrop=False) for im in images])
        return pre.normalize(crops)
    grey = [torch.from_numpy(to_channels(to_hwc(im), 1)).permute(2, 0, 1)[None].float()
            for im in images]  # fmt: skip
    x = torch.cat([F.interpolate(g, size=(h, w), mode="bilinear", antialias=True) for g in grey])
    mean = torch.tensor(pre.mean).view(1, -1, 1, 1)
    std = torch.tensor(pre.std).view(1, -1, 1, 1)
    return (x.expand(-1, c, -1, -1) - mean) / std


@torch.no_grad()
def check_export(loaded: Loaded, fmt: str, path: Path, seed: int = 0) -> CheckResult:
    """Max abs difference of logits, exported vs PyTorch, on random inputs (batch 1 and 3:
    the batch is dynamic) and on real images, and the largest logit it is measured against."""
    model = loaded.model.to("cpu").eval()
    gen = torch.Generator().manual_seed(seed)
    diffs, scales = [], []
    with _torch_quiet():  # (torch 2.11's torch.export.load warns of a read-only buffer)
        run = run_exported(fmt, path)
        for n in (1, 3):
            x = torch.randn(n, *model.input_shape, generator=gen)
            diffs.append(_diff(model(x), run(x), scales))
        real = real_inputs(loaded)
        real_diff = _diff(model(real), run(real), scales) if len(real) else 0.0
    return CheckResult(max(diffs), real_diff, (1, 3, len(real)), max(scales))


def _diff(expected: torch.Tensor, got: np.ndarray, scales: list[float]) -> float:
    if tuple(got.shape) != tuple(expected.shape):
        raise CnnkitError(
            f"exported model gives shape {tuple(got.shape)}, PyTorch {tuple(expected.shape)}"
        )
    expected = expected.numpy().astype(np.float64)
    scales.append(float(np.abs(expected).max()))
    return float(np.abs(expected - got.astype(np.float64)).max())
