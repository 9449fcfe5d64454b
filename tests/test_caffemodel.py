"""import-caffe with a .caffemodel: models written here with Caffe's message definitions (new
and V1 layers, BlobShape and the legacy 4-D blob shape) import with the weights they were
written from; BatchNorm + Scale, PReLU and LRN WITHIN_CHANNEL against a direct computation."""

from __future__ import annotations

import errno
import os
import re
import warnings
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


@pytest.mark.slow
def test_alexnet_caffemodel_imports_with_the_logits_of_its_weights(tmp_path, capsys):
    """BVLC AlexNet's layers (groups, LRN, the BGR first layer) at an eighth of its widths: the
    same import, a 240 MB .caffemodel fewer (the full net's import is in test_caffe_translate.py)."""
    torch.manual_seed(0)
    prototxt = tmp_path / "alexnet.prototxt"
    prototxt.write_text(re.sub(r"num_output: (\d+)", lambda m: f"num_output: {int(m[1]) // 8}",
                               (DATA / "alexnet.prototxt").read_text()))  # fmt: skip
    source = build_model(import_caffe(prototxt)).eval()
    caffemodel = tmp_path / "bvlc_alexnet.caffemodel"
    write_caffemodel(caffemodel, blobs_of(source))
    out = tmp_path / "alexnet.yaml"
    args = ["import-caffe", str(prototxt), str(caffemodel), "-o", str(out)]
    code, printed, _ = run_cli(args, capsys)
    params = sum(p.numel() for p in source.parameters())
    assert code == 0 and f"alexnet.safetensors: 22 layers, {params:,} parameters" in printed
    assert params < 2_000_000  # (60,965,224 at full width)
    text = out.read_text()
    assert "weights: alexnet.safetensors" in text and "conv1: input channels reversed" in text
    assert "std to 1 / its transform_param scale" in text  # (a deploy prototxt lacks it)
    imported = build_model(str(out)).eval()  # the network file loads its weights
    x = torch.randn(2, 3, 227, 227) * 50
    with torch.no_grad():  # cnnkit's RGB is Caffe's BGR reversed
        assert (imported(x) - source(x.flip(1))).abs().max().item() <= 1e-5
    from cnnkit.infer.load import load_for_inference

    preprocess = load_for_inference(str(out)).preprocess  # Caffe's 0-255 scale, ImageNet's mean
    assert preprocess.std == [1.0] * 3 and preprocess.mean == [122.68, 116.67, 104.01]
    code, printed, _ = run_cli([*args, "--keep-bgr"], capsys)
    assert code == 0 and "preprocess" not in out.read_text()
    with torch.no_grad():  # a net trained on RGB: its weights as they were
        assert (build_model(str(out)).eval()(x) - source(x)).abs().max().item() <= 1e-5


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
    y = F.conv2d(x.flip(1), w, b, padding=1)  # the imported net reads RGB, Caffe's read BGR
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
        match=r"layer 'ip1': blob weight has shape \(10, 800\) \(8,000 values\), ip1 needs \(500, 800\)",
    ):
        import_caffe_weights(DATA / "lenet.prototxt", wrong)
    partial = tmp_path / "partial.caffemodel"
    write_caffemodel(partial, {k: v for k, v in blobs.items() if k != "conv2"})
    with pytest.raises(CheckpointError, match="the .caffemodel has no weights for layer 'conv2'"):
        import_caffe_weights(DATA / "lenet.prototxt", partial)
    norms = tmp_path / "norms.prototxt"
    norms.write_text(NORMS)
    ones = torch.ones(4)
    layers = {"conv1": [torch.zeros(4, 3, 3, 3), ones], "scale1": [ones, ones], "relu1": [ones],
              "fc8": [torch.zeros(5, 196), torch.zeros(5)]}  # fmt: skip
    for variance, factor in ((torch.tensor([1.0, -0.5, 1, 1]), 1.0), (ones, -2.0)):
        write_caffemodel(wrong, {**layers, "bn1": [ones, variance, torch.tensor([factor])]})
        with pytest.raises(CheckpointError, match=r"^layer 'bn1': blob variance \(over the "
                           r"scale factor\) has negative values, as no trained batch norm"):  # fmt: skip
            import_caffe_weights(norms, wrong)
    junk = tmp_path / "junk.caffemodel"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a Caffe .caffemodel"):
        import_caffe_weights(DATA / "lenet.prototxt", junk)
    code, _, err = run_cli(["import-caffe", str(DATA / "lenet.prototxt"), str(partial)], capsys)
    assert code == 2 and "needs -o NET.yaml" in err and err.count("\n") == 1


def prototxt_file(tmp_path: Path, layers: str, dims: str = "dim: 1 dim: 2 dim: 4 dim: 4") -> Path:
    path = tmp_path / "net.prototxt"
    data = (
        f'layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ {dims} }} }} }}'
    )
    path.write_text(data + "\n" + layers)
    return path


TRANSPOSED = """layer { name: "fc8" type: "InnerProduct" bottom: "data" top: "fc8"
        inner_product_param { num_output: 3 transpose: true } }"""


def test_only_colour_images_are_turned_to_rgb_and_grey_ones_say_their_scaling(tmp_path):
    """A net that reads vectors of 3 numbers imports as they are (it was given a channel
    reversal that needs (C, H, W) input, and ImageNet's mean); a 1-channel image net, whose
    scaling no deploy prototxt says, says what cnnkit feeds it."""
    from cnnkit.caffe import read_caffe

    prototxt = prototxt_file(tmp_path, TRANSPOSED, "dim: 1 dim: 3")
    weight, bias = torch.randn(3, 3), torch.randn(3)
    write_caffemodel(tmp_path / "net.caffemodel", {"fc8": [weight, bias]})
    imported = read_caffe(prototxt, tmp_path / "net.caffemodel")
    assert "preprocess" not in imported.model and imported.notes == []
    net = build_model(imported.model).eval()
    net.load_state_dict(imported.state)
    x = torch.randn(2, 3)
    torch.testing.assert_close(net(x), x @ weight + bias)
    conv = """layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 2 kernel_size: 3 } }"""
    grey = prototxt_file(tmp_path, conv, "dim: 1 dim: 1 dim: 8 dim: 8")
    write_caffemodel(tmp_path / "grey.caffemodel",
                     {"conv1": [torch.randn(2, 1, 3, 3), torch.randn(2)]})  # fmt: skip
    imported = read_caffe(grey, tmp_path / "grey.caffemodel")
    assert "preprocess" not in imported.model
    assert any(n.startswith("preprocess: none in a deploy prototxt: cnnkit feeds greyscale "
                            "pixels / 255") for n in imported.notes), imported.notes  # fmt: skip


@pytest.mark.parametrize("v1", [False, True])  # V1: the weight as a (1, 1, in, out) blob
def test_transposed_inner_product_computes_x_times_w(tmp_path, v1):
    prototxt = prototxt_file(tmp_path, TRANSPOSED, "dim: 1 dim: 6")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(6, 3, generator=g), torch.randn(3, generator=g)  # Caffe's (in, out)
    write_caffemodel(tmp_path / "t.caffemodel", {"fc8": [w, b]}, v1=v1)
    model, state = import_caffe_weights(prototxt, tmp_path / "t.caffemodel")
    net = build_model(model).eval()
    net.load_state_dict(state)
    x = torch.randn(4, 6, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(net(x), x @ w + b, rtol=1e-6, atol=1e-6)
    write_caffemodel(tmp_path / "t.caffemodel", {"fc8": [w.T, b]})  # (out, in): not transposed
    with pytest.raises(CheckpointError, match=r"blob weight has shape \(3, 6\) .*needs \(6, 3\)"):
        import_caffe_weights(prototxt, tmp_path / "t.caffemodel")


def test_the_forks_depthwise_convolution_takes_its_caffemodel_weights(tmp_path):
    """MobileNet's ports: ConvolutionDepthwise's blobs are a grouped Convolution's."""
    prototxt = prototxt_file(
        tmp_path,
        """layer { name: "dw" type: "ConvolutionDepthwise"
        bottom: "data" top: "dw" convolution_param { num_output: 2 kernel_size: 3 pad: 1 } }""",
    )
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(2, 1, 3, 3, generator=g), torch.randn(2, generator=g)
    write_caffemodel(tmp_path / "dw.caffemodel", {"dw": [w, b]})
    model, state = import_caffe_weights(prototxt, tmp_path / "dw.caffemodel")
    net = build_model(model).eval()
    net.load_state_dict(state)
    x = torch.randn(3, 2, 4, 4, generator=g)
    with torch.no_grad():  # (a 2-channel input: no RGB turn)
        torch.testing.assert_close(net(x), F.conv2d(x, w, b, padding=1, groups=2))


FORK = """layer { name: "bn1" type: "BatchNorm" bottom: "data" top: "bn1" }
layer { name: "sc1" type: "Scale" bottom: "bn1" top: "sc1" scale_param { bias_term: true } }
layer { name: "sum" type: "Eltwise" bottom: "bn1" bottom: "sc1" top: "sum" }
layer { name: "bn2" type: "BatchNorm" bottom: "sum" top: "sum" }
layer { name: "sc2" type: "Scale" bottom: "sum" top: "sum" }
layer { name: "fc8" type: "InnerProduct" bottom: "sum" top: "fc8" inner_product_param { num_output: 3 } }
"""  # the un-scaled bn1 read twice; a Scale without bias


def test_scale_beside_another_reader_of_the_batchnorm_keeps_caffes_sum(tmp_path):
    prototxt = prototxt_file(tmp_path, FORK)
    g = torch.Generator().manual_seed(0)

    def stats() -> list[torch.Tensor]:
        return [torch.randn(2, generator=g) * 2, torch.rand(2, generator=g) + 0.5, torch.ones(1)]

    blobs = {"bn1": stats(), "sc1": [torch.randn(2, generator=g), torch.randn(2, generator=g)]}
    blobs |= {"bn2": stats(), "sc2": [torch.randn(2, generator=g)]}
    blobs["fc8"] = [torch.randn(3, 32, generator=g), torch.randn(3, generator=g)]
    write_caffemodel(tmp_path / "f.caffemodel", blobs)
    model, state = import_caffe_weights(prototxt, tmp_path / "f.caffemodel")
    net = build_model(model).eval()
    net.load_state_dict(state)

    def per_channel(t: torch.Tensor) -> torch.Tensor:
        return t.view(1, -1, 1, 1)

    def normalise(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, _) -> torch.Tensor:
        return (x - per_channel(mean)) / per_channel(var + 1e-5).sqrt()  # Caffe's BatchNorm

    x = torch.randn(2, 2, 4, 4, generator=g)
    bn1 = normalise(x, *blobs["bn1"])
    total = bn1 + (bn1 * per_channel(blobs["sc1"][0]) + per_channel(blobs["sc1"][1]))
    scaled = normalise(total, *blobs["bn2"]) * per_channel(blobs["sc2"][0])
    expected = scaled.flatten(1) @ blobs["fc8"][0].T + blobs["fc8"][1]
    with torch.no_grad():
        torch.testing.assert_close(net(x), expected, rtol=1e-5, atol=1e-5)


FOLDED = """layer { name: "bn1" type: "BatchNorm" bottom: "data" top: "bn1" }
layer { name: "sc1" type: "Scale" bottom: "bn1" top: "bn1" scale_param { bias_term: true } }
layer { name: "bn2" type: "BatchNorm" bottom: "bn1" top: "bn2" }
layer { name: "sc2" type: "Scale" bottom: "bn2" top: "bn2" }
layer { name: "fc8" type: "InnerProduct" bottom: "bn2" top: "fc8" inner_product_param { num_output: 3 } }
"""  # sc1 folds into bn1 (its gamma and beta); sc2, without bias, is cnnkit's `scale`


def test_caffemodels_the_network_cannot_take_write_nothing(tmp_path, capsys):
    prototxt = prototxt_file(tmp_path, FOLDED)
    g = torch.Generator().manual_seed(0)
    good = {
        "bn1": [torch.zeros(2), torch.ones(2), torch.ones(1)], "sc1": [torch.ones(2), torch.zeros(2)],
        "bn2": [torch.zeros(2), torch.ones(2), torch.ones(1)], "sc2": [torch.ones(2)],
        "fc8": [torch.randn(3, 32, generator=g), torch.randn(3, generator=g)],
    }  # fmt: skip
    bad = {
        "fc8": (
            [good["fc8"][0]],
            r"layer 'fc8': no bias blob \(the .caffemodel has 1; fc8 takes 2",
        ),
        "sc1": ([torch.ones(2)], r"layer 'sc1': no bias blob"),  # folded into bn1: gamma, no beta
        "bn2": ([torch.zeros(2), torch.ones(2)], r"layer 'bn2': no scale factor blob"),
        "sc2": ([torch.ones(2), torch.zeros(2)], r"layer 'sc2': 2 blobs, sc2 takes 1 \(weight\)"),
    }
    out = tmp_path / "net.yaml"
    for name, (blobs, message) in bad.items():
        write_caffemodel(tmp_path / "bad.caffemodel", {**good, name: blobs})
        args = ["import-caffe", str(prototxt), str(tmp_path / "bad.caffemodel"), "-o", str(out)]
        code, _, err = run_cli(args, capsys)
        assert code == 1 and re.search(message, err) and err.count("\n") == 1, err
    for name, blob, message in [
        ("fc8", good["fc8"][0].reshape(32, 3), r"fc8': blob weight has shape \(32, 3\)"),
        ("sc1", torch.tensor([1.0, float("nan")]), r"sc1': blob weight holds nan or inf"),
        ("bn2", torch.tensor([0.0, float("inf")]), r"bn2': blob mean holds nan or inf"),
    ]:
        write_caffemodel(tmp_path / "bad.caffemodel", {**good, name: [blob, *good[name][1:]]})
        with pytest.raises(CheckpointError, match=message):
            import_caffe_weights(prototxt, tmp_path / "bad.caffemodel")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.caffemodel", "net.prototxt"]
    write_caffemodel(tmp_path / "good.caffemodel", good)
    args = ["import-caffe", str(prototxt), str(tmp_path / "good.caffemodel"), "-o", str(out)]
    assert run_cli(args, capsys)[0] == 0
    build_model(str(out))  # loads its weights
    assert run_cli(args, capsys)[0] == 0  # again: the earlier import's weights are replaced


def test_an_import_never_replaces_its_input_or_a_file_not_its_own(tmp_path, capsys):
    """-o the prototxt itself, a name not .yaml, or NAME.safetensors that another command
    wrote: one line each, and every file as it was."""
    prototxt = prototxt_file(tmp_path, TRANSPOSED, "dim: 1 dim: 6")
    write_caffemodel(tmp_path / "t.caffemodel", {"fc8": [torch.ones(6, 3), torch.zeros(3)]})
    (tmp_path / "mine.safetensors").write_bytes(b"an export the user keeps")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for out, words in ((prototxt, "is the input"), (tmp_path / "t.onnx", "name it .yaml"),
                       (tmp_path / "mine.yaml", "not the weights of an earlier import")):  # fmt: skip
        args = ["import-caffe", str(prototxt), str(tmp_path / "t.caffemodel"), "-o", str(out)]
        code, _, err = run_cli(args, capsys)
        assert code == 2 and words in err and err.count("\n") == 1, err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # the user's own network file (naming its own weights, or not a mapping of one), with or
    # without weights to import: never replaced
    for text in ("model: {input: [3, 6, 6], layers: [], weights: mine.safetensors}\n",
                 "model: digitnet\n", "- 1\n"):  # fmt: skip
        (tmp_path / "mine.yaml").write_text(text)
        for weights in ([str(tmp_path / "t.caffemodel")], []):
            args = ["import-caffe", str(prototxt), *weights, "-o", str(tmp_path / "mine.yaml")]
            code, _, err = run_cli(args, capsys)
            assert code == 2 and "is not the network file of an earlier import" in err, err
            assert (tmp_path / "mine.yaml").read_text() == text
    assert (tmp_path / "mine.safetensors").read_bytes() == before["mine.safetensors"]


def test_a_full_disk_leaves_no_half_written_file(tmp_path, capsys, monkeypatch):
    prototxt = prototxt_file(tmp_path, TRANSPOSED, "dim: 1 dim: 6")
    write_caffemodel(tmp_path / "t.caffemodel", {"fc8": [torch.ones(6, 3), torch.zeros(3)]})
    out = tmp_path / "net.yaml"
    out.write_text("# imported by cnnkit import-caffe from an older net\n")
    real_write = Path.write_bytes

    def fill_the_disk(path: Path, data: bytes) -> int:
        if path.name.startswith(".net.safetensors"):  # after net.yaml's temporary file
            real_write(path, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, data)

    monkeypatch.setattr(Path, "write_bytes", fill_the_disk)
    args = ["import-caffe", str(prototxt), str(tmp_path / "t.caffemodel"), "-o", str(out)]
    code, _, err = run_cli(args, capsys)
    assert code == 1 and err.count("\n") == 1
    assert "net.safetensors: cannot write: No space left on device (nothing half-written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "net.prototxt",
        "net.yaml",
        "t.caffemodel",
    ]
    assert out.read_text() == "# imported by cnnkit import-caffe from an older net\n"


def test_layer_renamed_from_a_module_attribute_keeps_its_weights(tmp_path):
    prototxt = prototxt_file(tmp_path, TRANSPOSED.replace('"fc8"', '"eval"'), "dim: 1 dim: 6")
    w, b = torch.randn(6, 3), torch.randn(3)
    write_caffemodel(tmp_path / "t.caffemodel", {"eval": [w, b]})
    model, state = import_caffe_weights(prototxt, tmp_path / "t.caffemodel")
    net = build_model(model).eval()
    net.load_state_dict(state)
    assert net.table[0].name == "eval_caffe"
    torch.testing.assert_close(net.eval_caffe.weight.detach(), w.T)


INPUT_NAMED = """layer { name: "input_proj" type: "Convolution" bottom: "data" top: "input_proj"
        convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "branch_a" type: "Convolution" bottom: "input_proj" top: "branch_a"
        convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "branch_b" type: "Convolution" bottom: "input_proj" top: "branch_b"
        convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "sum" type: "Eltwise" bottom: "branch_a" bottom: "branch_b" top: "sum" }
layer { name: "pool" type: "Pooling" bottom: "sum" top: "pool"
        pooling_param { pool: 1 global_pooling: true } }
layer { name: "prob" type: "Softmax" bottom: "pool" top: "prob" }
"""  # pool: 1 is AVE by number; SqueezeNet's end: (C, 1, 1) scores through Softmax


@pytest.mark.parametrize("side", [8, 224])
def test_only_the_input_readers_turn_rgb_and_a_squeezenet_end_is_a_vector(tmp_path, side):
    prototxt = prototxt_file(tmp_path, INPUT_NAMED, f"dim: 1 dim: 3 dim: {side} dim: {side}")
    g = torch.Generator().manual_seed(0)
    blobs = {n: [torch.randn(4, c, 1, 1, generator=g), torch.randn(4, generator=g)]
             for n, c in (("input_proj", 3), ("branch_a", 4), ("branch_b", 4))}  # fmt: skip
    write_caffemodel(tmp_path / "n.caffemodel", blobs)
    from cnnkit.caffe import read_caffe

    imported = read_caffe(prototxt, tmp_path / "n.caffemodel")
    assert imported.state["input_proj.weight"].equal(blobs["input_proj"][0].flip(1))
    for name in ("branch_a", "branch_b"):  # they read input_proj, not the image: as Caffe's
        assert imported.state[f"{name}.weight"].equal(blobs[name][0]), name
    net = build_model(imported.model).eval()
    net.load_state_dict(imported.state)
    assert net.output_shape == (4,) and net.table[-1].type == "flatten"
    x = torch.rand(2, 3, side, side) * 255
    with torch.no_grad():
        a = F.conv2d(x.flip(1), blobs["input_proj"][0], blobs["input_proj"][1])
        caffe = sum(F.conv2d(a, *blobs[n]) for n in ("branch_a", "branch_b")).mean((2, 3))
        torch.testing.assert_close(net(x), caffe, rtol=1e-5, atol=1e-4)
    resize = imported.model["preprocess"].get("resize")
    assert resize == (256 if side == 224 else None)  # Caffe's ImageNet images: 256, cropped


def test_a_non_square_colour_net_turns_rgb_and_its_file_describes(tmp_path, capsys):
    """A network file's preprocess is for square images: a 7 x 5 colour net gets its weights
    turned to RGB and a note on what to feed it, and the file it writes is one info reads."""
    prototxt = prototxt_file(tmp_path, INPUT_NAMED, "dim: 1 dim: 3 dim: 7 dim: 5")
    g = torch.Generator().manual_seed(0)
    blobs = {n: [torch.randn(4, c, 1, 1, generator=g), torch.randn(4, generator=g)]
             for n, c in (("input_proj", 3), ("branch_a", 4), ("branch_b", 4))}  # fmt: skip
    write_caffemodel(tmp_path / "n.caffemodel", blobs)
    out = tmp_path / "n.yaml"
    code, _, err = run_cli(["import-caffe", str(prototxt), str(tmp_path / "n.caffemodel"), "-o",
                            str(out)], capsys)  # fmt: skip
    assert code == 0, err
    text = out.read_text()
    assert "preprocess" not in text and "feed it RGB 0-255 pixels less the training" in text
    assert run_cli(["info", str(out)], capsys)[0] == 0


DECONV = """layer { name: "up" type: "Deconvolution" bottom: "data" top: "up"
        param { lr_mult: 0 } convolution_param { num_output: 2 group: 2 kernel_size: 4 stride: 2
        pad: 1 bias_term: false weight_filler { type: "bilinear" } } }
layer { name: "score" type: "Deconvolution" bottom: "up" top: "score"
        convolution_param { num_output: 3 kernel_size: [2, 3] stride: 2 } }
"""  # FCN's upsampling (a fixed bilinear kernel per channel), then a learned one


def test_deconvolution_is_conv_transpose_with_caffes_weights_and_bilinear_filler(tmp_path):
    prototxt = prototxt_file(tmp_path, DECONV, "dim: 1 dim: 2 dim: 5 dim: 5")
    model = import_caffe(prototxt)
    up, score = model["layers"]
    assert up["type"] == "conv_transpose" and up["init"] == {"weight": "bilinear"}
    assert up["lr_mult"] == {"weight": 0.0} and score["kernel_size"] == [2, 3]
    net = build_model(model)
    assert net.output_shape == (3, 20, 21)  # 5 -> 10 (k 4, s 2, p 1) -> 20 x 21 (k 2 x 3, s 2)
    k = torch.tensor([0.25, 0.75, 0.75, 0.25])  # Caffe's bilinear, f = 2, c = 0.75
    torch.testing.assert_close(net.up.weight, torch.outer(k, k).expand(2, 1, 4, 4))
    g = torch.Generator().manual_seed(0)
    blobs = {"up": [torch.randn(2, 1, 4, 4, generator=g)],  # Caffe's (in, out / group, kh, kw)
             "score": [torch.randn(2, 3, 2, 3, generator=g), torch.randn(3, generator=g)]}  # fmt: skip
    write_caffemodel(tmp_path / "d.caffemodel", blobs)
    model, state = import_caffe_weights(prototxt, tmp_path / "d.caffemodel")
    net = build_model(model).eval()
    net.load_state_dict(state)
    x = torch.randn(2, 2, 5, 5, generator=g)
    with torch.no_grad():
        a = F.conv_transpose2d(x, blobs["up"][0], stride=2, padding=1, groups=2)
        torch.testing.assert_close(net(x), F.conv_transpose2d(a, *blobs["score"], stride=2))


BN_FIRST = """layer { name: "data_bn" type: "BatchNorm" bottom: "data" top: "data_bn" }
layer { name: "data_scale" type: "Scale" bottom: "data_bn" top: "data_bn" scale_param { bias_term: true } }
layer { name: "act" type: "PReLU" bottom: "data_bn" top: "act" }
layer { name: "norm" type: "LRN" bottom: "act" top: "norm" lrn_param { local_size: 3 } }
layer { name: "both" type: "Eltwise" bottom: "norm" bottom: "data" top: "both" }
layer { name: "pool" type: "Pooling" bottom: "both" top: "pool"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv1" type: "Convolution" bottom: "pool" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "conv2" type: "Convolution" bottom: "data" top: "conv2"
        convolution_param { num_output: 4 kernel_size: 5 stride: 2 } }
layer { name: "sum" type: "Eltwise" bottom: "conv1" bottom: "conv2" top: "sum" }
layer { name: "fc8" type: "InnerProduct" bottom: "sum" top: "fc8" inner_product_param { num_output: 5 } }
"""  # the input normalised by a batch norm first, as some Caffe ResNets do, and read again
SCALE_BESIDE = """layer { name: "input_scale" type: "Power" bottom: "data" top: "scaled"
        power_param { scale: 0.017 shift: -1 } }
layer { name: "data_bn" type: "BatchNorm" bottom: "scaled" top: "bn" }
layer { name: "data_scale" type: "Scale" bottom: "bn" top: "sc" scale_param { bias_term: true } }
layer { name: "both" type: "Eltwise" bottom: "sc" bottom: "bn" top: "both" }
layer { name: "conv1" type: "Convolution" bottom: "both" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "fc8" type: "InnerProduct" bottom: "conv1" top: "fc8" inner_product_param { num_output: 5 } }
"""  # the input scaled (a Power), then a Scale beside another reader of the batch norm: a
# depthwise convolution
CROP = """layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 2 } }
layer { name: "crop" type: "Crop" bottom: "conv1" bottom: "data" top: "crop" crop_param { offset: 1 } }
layer { name: "datac" type: "Crop" bottom: "data" bottom: "crop" top: "datac" }
layer { name: "conv2" type: "Convolution" bottom: "datac" top: "conv2"
        convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "sum" type: "Eltwise" bottom: "crop" bottom: "conv2" top: "sum" }
layer { name: "fc8" type: "InnerProduct" bottom: "sum" top: "fc8" inner_product_param { num_output: 5 } }
"""  # FCN's crops to the image's size: the image read for its size only, or cropped itself
CONCAT = """layer { name: "relu" type: "ReLU" bottom: "data" top: "r" }
layer { name: "cat" type: "Concat" bottom: "data" bottom: "r" top: "cat" }
layer { name: "conv1" type: "Convolution" bottom: "cat" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "fc8" type: "InnerProduct" bottom: "conv1" top: "fc8" inner_product_param { num_output: 5 } }
"""  # the reversed channels concatenated: their order cannot be followed
LINEAR = """layer { name: "fc8" type: "InnerProduct" bottom: "data" top: "fc8" inner_product_param { num_output: 5 } }
"""  # the pixels straight into a linear layer
INTERP = """layer { name: "zoom" type: "Interp" bottom: "data" top: "zoom" interp_param { zoom_factor: 2 } }
layer { name: "conv1" type: "Convolution" bottom: "zoom" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "fc8" type: "InnerProduct" bottom: "conv1" top: "fc8" inner_product_param { num_output: 5 } }
"""  # a bilinear resize, per channel, before the first convolution


@pytest.mark.parametrize(
    ("layers", "reversed_layers"),
    [
        (BN_FIRST, "data_bn, act, conv1, conv2"),
        (SCALE_BESIDE, "data_bn, data_scale, conv1"),
        (CROP, "conv1, conv2"),
        (CONCAT, None),
        (LINEAR, None),
        (INTERP, "conv1"),
    ],
    ids=["bn-first", "scale-beside", "crop", "concat", "linear", "interp"],
)
def test_layers_before_the_first_convolutions_are_turned_to_rgb_too(
    tmp_path, layers, reversed_layers
):
    """The BGR order is followed from the input through batch norms, Scales, PReLU, LRN,
    Power, pooling and sums to the convolutions: the import reads RGB as the Caffe net read BGR, and
    says Caffe's preprocessing. Where it cannot be followed, a channel reversal goes first."""
    from cnnkit.caffe import read_caffe

    prototxt = prototxt_file(tmp_path, layers, "dim: 1 dim: 3 dim: 8 dim: 8")
    g = torch.Generator().manual_seed(0)
    shapes = {name: [p.shape for p in m.parameters(recurse=False)] for name, m in
              build_model(import_caffe(prototxt)).named_modules() if name}  # fmt: skip
    blobs = {}
    for name in ("conv1", "conv2", "fc8", "act"):
        if name in shapes:
            blobs[name] = [torch.randn(s, generator=g) * 0.3 for s in shapes[name]]
    if "data_bn" in shapes:
        blobs["data_bn"] = [torch.randn(3, generator=g), torch.rand(3, generator=g) + 0.5,
                            torch.tensor([3.0])]  # fmt: skip
        blobs["data_scale"] = [torch.rand(3, generator=g) + 0.5, torch.randn(3, generator=g)]
    write_caffemodel(tmp_path / "net.caffemodel", blobs)

    def built(keep_bgr: bool):
        imported = read_caffe(prototxt, tmp_path / "net.caffemodel", keep_bgr=keep_bgr)
        net = build_model(imported.model).eval()
        net.load_state_dict(imported.state)
        return net, imported

    caffe, _ = built(keep_bgr=True)  # the weights as Caffe holds them: BGR
    rgb, imported = built(keep_bgr=False)
    x = torch.randn(2, 3, 8, 8, generator=g) * 40
    with torch.no_grad():
        assert imported.model["preprocess"]["mean"] == [122.68, 116.67, 104.01]
        if reversed_layers is None:  # (was: kept BGR, fed RGB by every command, without a word)
            assert imported.model["layers"][0]["name"] == "rgb_to_bgr"
            assert imported.notes[0].startswith("rgb_to_bgr: a 1x1 convolution that reverses")
            torch.testing.assert_close(rgb(x), caffe(x.flip(1)), rtol=0, atol=0)
        else:
            assert imported.notes[0].startswith(f"{reversed_layers}: input channels reversed")
            torch.testing.assert_close(rgb(x), caffe(x.flip(1)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("dims", "legacy", "shown"),
    [
        ([-5, -144], False, r"\(-5, -144\)"),  # np.prod 720: numpy had refused the reshape
        ([1099511627783, 7529267139302429360], False, r"\(1099511627783, 7529267139302429360\)"),
        ([1, 1, -5, -144], True, r"\(1, 1, -5, -144\)"),  # the legacy num / channels / ...
        ([1] * 40 + [720], False, r"\(1, 1, 1, 1, 1, 1, 1, 1, ... \(41 axes\)\)"),
    ],
)
def test_a_blob_shape_that_cannot_hold_its_values_is_one_line(
    tmp_path, capsys, dims, legacy, shown
):
    """Negative dims, dims whose int64 product wraps to the values' count, or more axes than
    any array has: the file and the layer's blob named, not numpy's ValueError."""
    prototxt = prototxt_file(
        tmp_path, TRANSPOSED.replace(" transpose: true", ""), "dim: 1 dim: 240"
    )
    net = caffe_messages()["NetParameter"]()
    layer = net.layer.add(name="fc8")
    blob = layer.blobs.add(data=[0.5] * 720)
    if legacy:
        blob.num, blob.channels, blob.height, blob.width = dims
    else:
        blob.shape.dim.extend(dims)
    layer.blobs.add(data=[0.0] * 3).shape.dim.append(3)
    model = tmp_path / "bad.caffemodel"
    model.write_bytes(net.SerializeToString())
    out = tmp_path / "net.yaml"
    code, _, err = run_cli(["import-caffe", str(prototxt), str(model), "-o", str(out)], capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert re.search(rf"bad.caffemodel: layer 'fc8': blob 0 has shape {shown}, which does not "
                     r"hold its 720 values", err), err  # fmt: skip
    assert not out.exists()


@pytest.mark.parametrize(("blob", "stats"), [
    ("mean", [torch.tensor([-1e30, 1e30]), torch.ones(2)]),
    ("variance", [torch.zeros(2), torch.tensor([1.0, 1e30])]),
])  # fmt: skip
def test_batchnorm_statistics_that_overflow_over_the_scale_factor_are_one_line(
    tmp_path, capsys, blob, stats
):
    """Finite blobs over a scale factor of 1e-30 are inf: that had been written, exit 0, after
    numpy's overflow warning on stderr."""
    prototxt = prototxt_file(tmp_path, FOLDED)
    g = torch.Generator().manual_seed(0)
    blobs = {
        "bn1": [*stats, torch.tensor([1e-30])], "sc1": [torch.ones(2), torch.zeros(2)],
        "bn2": [torch.zeros(2), torch.ones(2), torch.ones(1)], "sc2": [torch.ones(2)],
        "fc8": [torch.randn(3, 32, generator=g), torch.randn(3, generator=g)],
    }  # fmt: skip
    write_caffemodel(tmp_path / "bn.caffemodel", blobs)
    out = tmp_path / "net.yaml"
    args = ["import-caffe", str(prototxt), str(tmp_path / "bn.caffemodel"), "-o", str(out)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, err = run_cli(args, capsys)
    assert not caught and code == 1 and err.count("\n") == 1, err
    assert f"layer 'bn1': blob {blob} (over the scale factor) holds nan or inf" in err
    assert not out.exists() and not out.with_suffix(".safetensors").exists()


def test_a_failed_rename_leaves_the_earlier_import_whole(tmp_path, capsys, monkeypatch):
    """The network file had been renamed into place before its weights failed to be (a folder
    NAME.safetensors): the old network file was gone, naming weights of another net."""
    prototxt = prototxt_file(tmp_path, TRANSPOSED, "dim: 1 dim: 6")
    write_caffemodel(tmp_path / "t.caffemodel", {"fc8": [torch.ones(6, 3), torch.zeros(3)]})
    out, weights = tmp_path / "net.yaml", tmp_path / "net.safetensors"
    args = ["import-caffe", str(prototxt), str(tmp_path / "t.caffemodel"), "-o", str(out)]
    assert run_cli(args, capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in (out, weights)}
    prototxt.write_text(
        prototxt.read_text().replace("num_output: 3", "num_output: 3 bias_term: false")
    )
    write_caffemodel(tmp_path / "t.caffemodel", {"fc8": [torch.full((6, 3), 2.0)]})
    weights.unlink()
    weights.mkdir()
    code, _, err = run_cli(args, capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert f"{weights}: cannot write: Is a directory (nothing half-written was kept)" in err
    assert out.read_bytes() == before["net.yaml"]
    weights.rmdir()
    weights.write_bytes(before["net.safetensors"])
    real_replace = os.replace

    def refuse_the_network_file(src, dst):  # after the weights' rename
        if Path(dst) == out:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", refuse_the_network_file)
    code, _, err = run_cli(args, capsys)
    assert code == 1 and f"{out}: cannot write: Permission denied (nothing half-written" in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "net.prototxt", "net.safetensors", "net.yaml", "t.caffemodel"
    ]  # fmt: skip


def test_a_long_output_name_and_a_failing_cleanup_name_the_users_file(
    tmp_path, capsys, monkeypatch
):
    """-o of 245 characters (legal): its hidden temporary `.NAME.PID.tmp` had been too long a
    name; and the cleanup's own error had replaced the one that said what went wrong."""
    prototxt = prototxt_file(tmp_path, TRANSPOSED, "dim: 1 dim: 6")
    write_caffemodel(tmp_path / "t.caffemodel", {"fc8": [torch.ones(6, 3), torch.zeros(3)]})
    out = tmp_path / ("a" * 240 + ".yaml")  # and a.....safetensors: 252 characters
    args = ["import-caffe", str(prototxt), str(tmp_path / "t.caffemodel"), "-o", str(out)]
    code, stdout, err = run_cli(args, capsys)
    assert code == 0 and stdout.startswith(f"wrote {out} and "), err
    build_model(str(out))  # loads its weights
    real_write = Path.write_bytes

    def fill_the_disk(path: Path, data: bytes) -> int:
        real_write(path, data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    def unlink_fails(path: Path, missing_ok: bool = False) -> None:
        raise OSError(errno.ENAMETOOLONG, "File name too long")

    monkeypatch.setattr(Path, "write_bytes", fill_the_disk)
    monkeypatch.setattr(Path, "unlink", unlink_fails)
    code, _, err = run_cli(args, capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert f"{out.with_suffix('.safetensors')}: cannot write: No space left on device" in err


HEADS = """layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 3 kernel_size: 1 } }
layer { name: "aux" type: "InnerProduct" bottom: "conv" top: "aux" inner_product_param { num_output: 4 } }
layer { name: "aux_prob" type: "Softmax" bottom: "aux" top: "aux_prob" }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "main" type: "InnerProduct" bottom: "conv" top: "main/scores" inner_product_param { num_output: 5 } }
"""  # two heads (GoogLeNet's auxiliary classifier, HED's side outputs): the file has both


def test_output_picks_the_head_the_network_returns_and_leaves_the_others_out(tmp_path, capsys):
    """--output BLOB keeps the layers that blob is computed from (its weights too); without
    it, several heads are refused in one line that names the way out."""
    from cnnkit.caffe import read_caffe

    prototxt = prototxt_file(tmp_path, HEADS)
    code, _, err = run_cli(["import-caffe", str(prototxt)], capsys)
    assert code == 2 and "outputs (aux_prob and main); a cnnkit network has one (--output" in err
    g = torch.Generator().manual_seed(0)
    blobs = {"conv": [torch.randn(3, 2, 1, 1, generator=g), torch.randn(3, generator=g)],
             "aux": [torch.randn(4, 48, generator=g), torch.randn(4, generator=g)],
             "main": [torch.randn(5, 48, generator=g), torch.randn(5, generator=g)]}  # fmt: skip
    write_caffemodel(tmp_path / "net.caffemodel", blobs)
    for output in ("main/scores", "main"):  # a top, or the layer's name as the error shows it
        imported = read_caffe(prototxt, tmp_path / "net.caffemodel", output=output)
        assert [layer["name"] for layer in imported.model["layers"]] == ["conv", "relu", "main"]
        assert imported.notes == [f"--output {output}: what does not feed it is left out, 2 "
                                  "layers (aux, aux_prob)"]  # fmt: skip
        net = build_model(imported.model).eval()
        net.load_state_dict(imported.state)  # strict: aux's weights are not in it
        x = torch.randn(2, 2, 4, 4, generator=g)
        with torch.no_grad():
            conv = F.relu(F.conv2d(x, blobs["conv"][0], blobs["conv"][1]))
            torch.testing.assert_close(net(x), F.linear(conv.flatten(1), *blobs["main"]))
    aux = read_caffe(prototxt, output="aux_prob").model  # a Softmax returned: dropped, as a
    assert [layer["name"] for layer in aux["layers"]] == ["conv", "aux"]  # final one is
    code, _, err = run_cli(["import-caffe", str(prototxt), "--output", "nope"], capsys)
    assert code == 2 and "--output 'nope': no layer's top (the last tops:" in err
    softmax = 'layer { name: "s" type: "Softmax" bottom: "data" top: "s" }\n'
    code, _, err = run_cli(["import-caffe", str(prototxt_file(tmp_path, softmax + HEADS)),
                            "--output", "s"], capsys)  # fmt: skip
    assert code == 2 and "--output 's': the input's own softmax, no layer" in err


def _caffe_interp(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Caffe's Interp (caffe_cpu_interp2) loop for loop: each output pixel from its four
    neighbours at (H_in - 1) / (H_out - 1) steps, the last row and column clamped."""
    _, _, h1, w1 = x.shape
    out = torch.empty(*x.shape[:2], height, width, dtype=x.dtype)
    rh = (h1 - 1) / (height - 1) if height > 1 else 0.0
    rw = (w1 - 1) / (width - 1) if width > 1 else 0.0
    for i in range(height):
        y = int(rh * i)
        dy, ly = int(y < h1 - 1), rh * i - int(rh * i)
        for j in range(width):
            xx = int(rw * j)
            dx, lx = int(xx < w1 - 1), rw * j - int(rw * j)
            out[:, :, i, j] = (1 - ly) * ((1 - lx) * x[:, :, y, xx] + lx * x[:, :, y, xx + dx]) \
                + ly * ((1 - lx) * x[:, :, y + dy, xx] + lx * x[:, :, y + dy, xx + dx])  # fmt: skip
    return out


PSPNET = """layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 3 kernel_size: 1 bias_term: false } }
layer { name: "conv/bn" type: "BN" bottom: "conv" top: "conv"
        param { lr_mult: 1 decay_mult: 0 } param { lr_mult: 1 decay_mult: 0 }
        param { lr_mult: 0 decay_mult: 0 } param { lr_mult: 0 decay_mult: 0 }
        bn_param { slope_filler { type: "constant" value: 1 } bias_filler { type: "constant"
        value: 0 } frozen: true eps: 1e-4 } }
layer { name: "up" type: "Interp" bottom: "conv" top: "up" interp_param { zoom_factor: 3 } }
"""  # PSPNet's layers: its fork's BN after a convolution, an Interp to the image's size


def test_pspnets_bn_and_interp_compute_as_their_forks_layers(tmp_path, capsys):
    """The fork's BN, blobs [slope, bias, mean, variance] of (1, C, 1, 1), at test time; the
    Interp's corner-aligned bilinear resize, against Caffe's loop; the other forks' BN and a
    cropping Interp refused in one line each."""
    from cnnkit.caffe import read_caffe

    g = torch.Generator().manual_seed(0)
    slope, bias, mean = (torch.randn(1, 3, 1, 1, generator=g) for _ in range(3))
    var = torch.rand(1, 3, 1, 1, generator=g) + 0.5
    conv = torch.randn(3, 2, 1, 1, generator=g)
    write_caffemodel(tmp_path / "net.caffemodel", {"conv": [conv],
                                                   "conv/bn": [slope, bias, mean, var]})  # fmt: skip
    imported = read_caffe(prototxt_file(tmp_path, PSPNET), tmp_path / "net.caffemodel")
    bn, up = imported.model["layers"][1:]
    assert bn["decay_mult"] == {"weight": 0.0, "bias": 0.0} and bn["eps"] == 1e-4
    assert up == {"name": "up", "type": "upsample", "size": [10, 10], "mode": "bilinear",
                  "align_corners": True}  # (4 - 1) * 3 + 1  # fmt: skip
    net = build_model(imported.model).eval()
    net.load_state_dict(imported.state)
    x = torch.randn(2, 2, 4, 4, generator=g)
    with torch.no_grad():
        normed = slope * (F.conv2d(x, conv) - mean) / (var + 1e-4).sqrt() + bias
        torch.testing.assert_close(net(x), _caffe_interp(normed, 10, 10), rtol=1e-5, atol=1e-5)
    for params, sizes in [("height: 5 width: 7", [5, 7]), ("shrink_factor: 2", [2, 2]),
                          ("shrink_factor: 2 zoom_factor: 4", [5, 5])]:  # fmt: skip
        text = PSPNET.replace("zoom_factor: 3", params)
        assert read_caffe(prototxt_file(tmp_path, text)).model["layers"][-1]["size"] == sizes
    for text, words in [
        (PSPNET.replace("frozen: true", "bn_mode: INFERENCE"),
         r"bn_param \{ bn_mode \}: another fork's BN \(SegNet's and ENet's"),
        (PSPNET.replace("zoom_factor: 3", "zoom_factor: 3 pad_beg: -1"), "Interp pad_beg -1"),
        (PSPNET.replace("zoom_factor: 3", "height: 5"), "Interp needs zoom_factor, shrink_factor"),
    ]:  # fmt: skip
        code, _, err = run_cli(["import-caffe", str(prototxt_file(tmp_path, text))], capsys)
        assert code == 2 and re.search(words, err) and err.count("\n") == 1, err
    same = PSPNET.replace("zoom_factor: 3", "height: 4 width: 4")  # Caffe copies: no layer
    assert [layer["type"] for layer in read_caffe(prototxt_file(tmp_path, same)).model["layers"]] \
        == ["conv", "batchnorm"]  # fmt: skip
