"""import-caffe with a .caffemodel: models written here with Caffe's message definitions (new
and V1 layers, BlobShape and the legacy 4-D blob shape) import with the weights they were
written from; BatchNorm + Scale, PReLU and LRN WITHIN_CHANNEL against a direct computation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_cli

from cnnkit import CheckpointError, build_model
from cnnkit.caffe import import_caffe, import_caffe_weights
from cnnkit.caffe.weights import caffe_messages

DATA = Path(__file__).parent / "data" / "caffe"
V1_TYPES = {"conv": 4, "linear": 14}  # V1LayerParameter.LayerType: CONVOLUTION, INNER_PRODUCT


def write_caffemodel(path: Path, layers: dict[str, list[torch.Tensor]], v1: bool = False) -> None:
    """A .caffemodel holding `layers` (Caffe name -> blobs), with the train net's data and loss
    layers (no blobs) around them, serialised with the importer's own message classes."""
    net = caffe_messages()["NetParameter"](name="written-by-the-test")
    entries = net.layers if v1 else net.layer
    entries.add(name="data", top=["data", "label"], **({} if v1 else {"type": "Data"}))
    for name, blobs in layers.items():
        layer = entries.add(name=name)
        for t in blobs:
            blob = layer.blobs.add()
            if v1:  # models of that era: the 4-D num / channels / height / width fields
                dims = [1] * (4 - t.dim()) + list(t.shape)
                blob.num, blob.channels, blob.height, blob.width = dims
            else:
                blob.shape.dim.extend(t.shape)
            blob.data.extend(t.detach().flatten().tolist())
    entries.add(name="loss", bottom=["fc8", "label"])
    path.write_bytes(net.SerializeToString())


def blobs_of(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """Caffe's blobs of every conv and linear layer: [weight, bias], named as the layers."""
    return {
        row.name: [model.get_submodule(row.name).weight, model.get_submodule(row.name).bias]
        for row in model.table
        if row.type in ("conv", "linear")
    }


def test_alexnet_caffemodel_imports_with_the_logits_of_its_weights(tmp_path, capsys):
    torch.manual_seed(0)
    source = build_model(import_caffe(DATA / "alexnet.prototxt")).eval()
    caffemodel = tmp_path / "bvlc_alexnet.caffemodel"
    write_caffemodel(caffemodel, blobs_of(source))
    out = tmp_path / "alexnet.yaml"
    args = ["import-caffe", str(DATA / "alexnet.prototxt"), str(caffemodel), "-o", str(out)]
    code, printed, _ = run_cli(args, capsys)
    assert code == 0 and "alexnet.safetensors: 22 layers, 60,965,224 parameters" in printed
    assert "weights: alexnet.safetensors" in out.read_text()
    imported = build_model(str(out)).eval()  # the network file loads its weights
    x = torch.randn(2, 3, 227, 227) * 50
    with torch.no_grad():
        assert (imported(x) - source(x)).abs().max().item() <= 1e-5


def test_v1_layers_and_legacy_blob_shapes(tmp_path):
    torch.manual_seed(0)
    source = build_model(import_caffe(DATA / "lenet.prototxt")).eval()
    caffemodel = tmp_path / "lenet.caffemodel"
    write_caffemodel(caffemodel, blobs_of(source), v1=True)
    model, state = import_caffe_weights(DATA / "lenet.prototxt", caffemodel)
    imported = build_model(model)
    imported.load_state_dict(state)
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(imported.eval()(x), source(x), rtol=0, atol=1e-6)


NORMS = """name: "norms"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 7 dim: 7 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" batch_norm_param { eps: 0.001 } }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "PReLU" bottom: "conv1" top: "conv1" }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1"
        lrn_param { norm_region: WITHIN_CHANNEL local_size: 3 alpha: 0.5 beta: 0.75 } }
layer { name: "fc8" type: "InnerProduct" bottom: "norm1" top: "fc8" inner_product_param { num_output: 5 } }
"""  # cifar10_full's WITHIN_CHANNEL LRN, after a PReLU and Caffe's two-layer batch norm


def within_channel(x: torch.Tensor, size: int, alpha: float, beta: float) -> torch.Tensor:
    """Caffe's WITHIN_CHANNEL LRN: 1 + alpha * (sum of squares over the zero-padded square,
    divided by its size clipped at H + pad, Caffe's AVE pooling rule)."""
    pad, (h, w) = size // 2, x.shape[2:]
    squares = F.pad(x * x, (pad, pad, pad, pad))
    out = torch.empty_like(x)
    for i in range(h):
        for j in range(w):
            count = (min(i + pad + 1, h + pad) - (i - pad)) * (
                min(j + pad + 1, w + pad) - (j - pad)
            )
            total = squares[:, :, i : i + size, j : j + size].sum((2, 3))
            out[:, :, i, j] = x[:, :, i, j] / (1 + alpha * total / count) ** beta
    return out


def test_batchnorm_scale_prelu_and_within_channel_lrn_weights(tmp_path):
    prototxt = tmp_path / "norms.prototxt"
    prototxt.write_text(NORMS)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(4, 3, 3, 3, generator=g), torch.randn(4, generator=g)
    mean, var, factor = torch.randn(4, generator=g), torch.rand(4, generator=g) + 0.5, 7.0
    gamma, beta, slope = (
        torch.rand(4, generator=g) + 0.5,
        torch.randn(4, generator=g),
        torch.rand(4, generator=g),
    )
    fc_w, fc_b = torch.randn(5, 196, generator=g) * 0.1, torch.randn(5, generator=g)
    blobs = {
        "conv1": [w, b],
        "bn1": [mean * factor, var * factor, torch.tensor([factor])],  # Caffe's running sums
        "scale1": [gamma, beta],
        "relu1": [slope],
        "fc8": [fc_w, fc_b],
    }
    caffemodel = tmp_path / "norms.caffemodel"
    write_caffemodel(caffemodel, blobs)
    model, state = import_caffe_weights(prototxt, caffemodel)
    net = build_model(model).eval()
    net.load_state_dict(state)
    x = torch.randn(2, 3, 7, 7, generator=g)
    y = F.conv2d(x, w, b, padding=1)
    y = (y - mean.view(1, -1, 1, 1)) / (var.view(1, -1, 1, 1) + 1e-3).sqrt()
    y = F.prelu(y * gamma.view(1, -1, 1, 1) + beta.view(1, -1, 1, 1), slope)
    expected = F.linear(within_channel(y, 3, 0.5, 0.75).flatten(1), fc_w, fc_b)
    with torch.no_grad():
        torch.testing.assert_close(net(x), expected, rtol=1e-5, atol=1e-5)


def test_caffemodels_that_do_not_fit_are_one_line(tmp_path, capsys):
    torch.manual_seed(0)
    source = build_model(import_caffe(DATA / "lenet.prototxt"))
    blobs = blobs_of(source)
    wrong = tmp_path / "wrong.caffemodel"
    write_caffemodel(wrong, {**blobs, "ip1": [torch.zeros(10, 800), blobs["ip1"][1]]})
    with pytest.raises(
        CheckpointError,
        match=r"layer 'ip1': blob weight holds 8,000 values, ip1 needs \(500, 800\)",
    ):
        import_caffe_weights(DATA / "lenet.prototxt", wrong)
    partial = tmp_path / "partial.caffemodel"
    write_caffemodel(partial, {k: v for k, v in blobs.items() if k != "conv2"})
    with pytest.raises(CheckpointError, match="the .caffemodel has no weights for layer 'conv2'"):
        import_caffe_weights(DATA / "lenet.prototxt", partial)
    junk = tmp_path / "junk.caffemodel"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a Caffe .caffemodel"):
        import_caffe_weights(DATA / "lenet.prototxt", junk)
    code, _, err = run_cli(["import-caffe", str(DATA / "lenet.prototxt"), str(partial)], capsys)
    assert code == 2 and "needs -o NET.yaml" in err and err.count("\n") == 1
