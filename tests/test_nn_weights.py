"""Pretrained weights: torchvision's state_dict in every file form training scripts write,
loaded by name for fine-tuning (a fresh classifier for other classes), mismatches in one line."""

import pytest
import torch
import torchvision
import yaml
from safetensors.torch import save_file

from cnnkit import CheckpointError, ConfigError, build_model
from cnnkit.nn.weights import load_weights
from cnnkit.zoo import net_path


@pytest.fixture(scope="module")
def squeezenet():
    """torchvision's SqueezeNet 1.1 with random weights, in eval mode."""
    torch.manual_seed(0)
    return torchvision.models.squeezenet1_1(weights=None).eval()


@pytest.mark.parametrize(
    "form", ["safetensors", "pt", "checkpoint-model", "checkpoint-state_dict", "ddp"]
)
def test_torchvisions_weights_in_any_file_form_give_its_logits(tmp_path, squeezenet, form):
    state = squeezenet.state_dict()
    path = tmp_path / ("w.safetensors" if form == "safetensors" else "w.pt")
    if form == "safetensors":
        save_file(state, str(path))
    else:
        wrapped = {
            "pt": state,
            "checkpoint-model": {"model": state, "epoch": 90, "args": {"lr": 0.1}},
            "checkpoint-state_dict": {"state_dict": state, "arch": "squeezenet1_1"},
            "ddp": {f"module.{k}": v for k, v in state.items()},
        }[form]
        torch.save(wrapped, path)
    model = build_model("squeezenet1_1", weights=path).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), squeezenet(x), rtol=0, atol=1e-5)


def test_weights_named_otherwise_or_saved_without_checksums_load(tmp_path, squeezenet):
    """A safetensors file named M.SAFETENSORS or model.bin was read as a torch.save file and
    refused; a torch.save file written with compute_crc32=False (its records' CRC 0) was
    refused as damaged by the checksum check, where torch.load reads it."""
    state = squeezenet.state_dict()
    for name in ("M.SAFETENSORS", "model.bin"):
        save_file(state, str(tmp_path / name))
    config = getattr(getattr(torch.utils, "serialization", None), "config", None)
    crc = getattr(getattr(config, "save", None), "compute_crc32", None)
    names = ["M.SAFETENSORS", "model.bin"]
    if crc is not None:  # (a torch that can save without checksums)
        config.save.compute_crc32 = False
        try:
            torch.save(state, tmp_path / "nocrc.pt")
        finally:
            config.save.compute_crc32 = crc
        names.append("nocrc.pt")
    x = torch.randn(2, 3, 64, 64)
    for name in names:
        model = build_model("squeezenet1_1", weights=tmp_path / name).eval()
        with torch.no_grad():
            torch.testing.assert_close(model(x), squeezenet(x), rtol=0, atol=1e-5)


def test_a_state_dict_itself_is_weights_and_anything_else_one_line(squeezenet):
    """build_model(weights=other.state_dict()) raised pathlib's TypeError, as did torchvision's
    weights enum (which downloads: cnnkit does not)."""
    model = build_model("squeezenet1_1", weights=squeezenet.state_dict()).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), squeezenet(x), rtol=0, atol=1e-5)
    wrapped = {"model": {f"module.{k}": v for k, v in squeezenet.state_dict().items()}}
    assert build_model("squeezenet1_1", weights=wrapped) is not None  # a checkpoint, loaded
    enum = torchvision.models.SqueezeNet1_1_Weights.DEFAULT
    with pytest.raises(ConfigError, match=r"^weights: a state_dict or the file of one .* got "
                       r"SqueezeNet1_1_Weights .*: nothing is downloaded"):  # fmt: skip
        build_model("squeezenet1_1", weights=enum)
    with pytest.raises(CheckpointError, match=r"^weights \(a state_dict\): not a state_dict"):
        build_model("squeezenet1_1", weights={"features.0.weight": [1.0]})


def test_fine_tuning_keeps_a_fresh_classifier_for_other_classes(tmp_path):
    torch.manual_seed(0)
    ref = torchvision.models.resnet18(weights=None)
    path = tmp_path / "resnet18.safetensors"
    save_file(ref.state_dict(), str(path))
    model = build_model("resnet18", num_classes=10)
    fresh = load_weights(model, path)
    assert fresh == ["fc.weight", "fc.bias"] and model.fc.weight.shape == (10, 512)
    torch.testing.assert_close(
        model.get_submodule("layer4.1.conv2").weight, ref.layer4[1].conv2.weight
    )
    torch.testing.assert_close(model.bn1.running_var, ref.bn1.running_var)


def test_a_classifier_sized_by_num_classes_in_a_block_is_a_head_too(tmp_path, squeezenet):
    path = tmp_path / "squeeze.safetensors"
    save_file(squeezenet.state_dict(), str(path))
    model = build_model("squeezenet1_1", num_classes=5)  # its final 1x1 conv: $num_classes
    assert load_weights(model, path) == ["classifier.1.weight", "classifier.1.bias"]
    torch.testing.assert_close(
        model.get_submodule("features.12.expand3x3").weight,
        squeezenet.features[12].expand3x3.weight,
    )


@pytest.mark.parametrize("passed", ["n: $num_classes", "m: $num_classes"])
def test_a_classifier_sized_through_a_block_parameter_is_a_head(tmp_path, passed):
    """`n: $num_classes` given to a block (or a default reading such a parameter) sizes the
    layer that reads `$n`: fine-tuning keeps that layer fresh as it does a `$num_classes` one."""
    net = {"input": [1, 8, 8], "num_classes": 10,
           "blocks": {"head": {"params": {"m": None, "n": "$m"}, "layers": [
               {"name": "fc", "type": "linear", "out_features": "$n"}]}},
           "layers": [{"name": "c", "type": "conv", "out_channels": 4, "kernel_size": 3},
                      {"name": "classifier", "block": "head", "m": 3, **yaml.safe_load(passed)}]}  # fmt: skip
    save_file(build_model(net).state_dict(), str(tmp_path / "w.safetensors"))
    model = build_model(net, num_classes=5)
    assert model.heads == ("classifier.fc",)
    assert load_weights(model, tmp_path / "w.safetensors") == ["classifier.fc.weight",
                                                                "classifier.fc.bias"]  # fmt: skip


def test_a_network_file_names_its_weights_beside_it(tmp_path, squeezenet):
    save_file(squeezenet.state_dict(), str(tmp_path / "squeeze.safetensors"))
    zoo_file = net_path("squeezenet1_1").read_text()
    spec = tmp_path / "squeeze.yaml"
    spec.write_text(zoo_file.replace("  input:", "  weights: squeeze.safetensors\n  input:"))
    model = build_model(str(spec)).eval()
    torch.testing.assert_close(
        model.get_submodule("features.0").weight, squeezenet.features[0].weight
    )
    assert "weights" not in model.spec  # a checkpoint's copy of the network does not reload it
    assert build_model(str(spec), device="meta").output_shape == (1000,)  # info reads no weights


def test_a_mean_image_runs_safetensors_export_is_weights_to_fine_tune_from(tmp_path):
    """cnnkit's own export of a `normalize: mean_image` run keeps the image beside the
    weights: read as weights, it is left out, not an unexpected key."""
    from cnnkit.infer.load import load_network, save_safetensors

    loaded = load_network("digitnet")
    loaded.mean_image = torch.rand(1, 8, 8) * 255
    save_safetensors(loaded, tmp_path / "m.safetensors")
    model = build_model("digitnet", weights=tmp_path / "m.safetensors")
    mine, theirs = model.state_dict(), loaded.model.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_mismatches_are_one_line_naming_the_keys(tmp_path, squeezenet):
    state = dict(squeezenet.state_dict())
    del state["features.3.squeeze.weight"]
    state["features.3.extra.weight"] = torch.zeros(2)
    state["features.0.weight"] = torch.zeros(64, 3, 5, 5)
    path = tmp_path / "bad.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError) as e:
        build_model("squeezenet1_1", weights=path)
    message = str(e.value)
    assert message.startswith(
        f"{path}: does not fit squeezenet1_1: 1 missing (features.3.squeeze.weight)"
    )
    assert "1 unexpected (features.3.extra.weight)" in message
    assert "1 mis-shaped (features.0.weight: file (64, 3, 5, 5), network (64, 3, 3, 3))" in message
    assert "\n" not in message and len(message) < 400


def test_files_that_are_not_weights_are_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"model": Evil()}, tmp_path / "evil.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    torch.save({"lr": 0.1}, tmp_path / "config.pt")
    torch.save({"fc.weight": [1, 2]}, tmp_path / "list.pt")
    torch.save({0: torch.zeros(2), "fc.bias": torch.zeros(2)}, tmp_path / "numbered.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "config.pt").read_bytes()[:-40])
    cases = {
        "evil.pt": r"refused: it holds a pickled object \(.*print\)",
        "junk.pt": r"junk.pt: not a weights file \(neither safetensors nor a torch.save file\)$",
        "cut.pt": r"cut.pt: not a readable weights file \(a zip archive, but truncated, damaged "
        r"or not written by torch.save\)$",  # a torch.save file cut short: no torch words
        "config.pt": "not a state_dict: 'lr' is not a tensor",
        "list.pt": "not a state_dict: 'fc.weight' is not a tensor",
        "numbered.pt": "not a state_dict: its key '0' is not a name",
        "missing.pt": "no such weights file",
        ".": r"a folder, not a weights file \(a .safetensors, .pt or .pth file\)$",
    }
    for name, message in cases.items():
        with pytest.raises(CheckpointError, match=message):
            build_model("squeezenet1_1", weights=tmp_path / name)
    from cnnkit.infer.load import load_for_inference

    (tmp_path / "nets").mkdir()  # the network file whose weights: are missing is named
    (tmp_path / "nets" / "net.yaml").write_text("model: {network: squeezenet1_1, weights: w.pt}\n")
    with pytest.raises(CheckpointError) as caught:
        load_for_inference(tmp_path / "nets" / "net.yaml")
    assert (
        str(caught.value)
        == f"{tmp_path / 'nets' / 'net.yaml'}: weights: w.pt: no such weights file"
    )


def test_weights_holding_nan_are_refused_naming_the_tensor(tmp_path):
    """A state_dict file, a .safetensors export and a checkpoint with a nan: one line naming
    the tensor, not a network that classifies everything as nan."""
    from cnnkit.infer.load import load_for_inference, load_network, save_safetensors

    model = build_model("digitnet")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    name = next(k for k in state if k.endswith("weight"))
    state[name][0] = float("inf")
    torch.save(state, tmp_path / "w.pt")
    with pytest.raises(CheckpointError, match=f"w.pt: {name} holds nan or inf"):
        build_model("digitnet", weights=tmp_path / "w.pt")
    loaded = load_network("digitnet")
    with torch.no_grad():
        loaded.model.get_parameter(name)[0] = float("nan")
    save_safetensors(loaded, tmp_path / "e.safetensors")
    with pytest.raises(CheckpointError, match=f"e.safetensors: {name} holds nan or inf"):
        load_for_inference(tmp_path / "e.safetensors")


@pytest.mark.parametrize(
    "rule, problem",
    [
        ({"match": r"(c)\.(weight)", "to": r"\3"}, "invalid group reference 3"),
        ({"match": r"(?P<a>c)\.weight", "to": r"\g<b>"}, "unknown group name 'b'"),
        ({"match": r"c\.weight", "to": r"\q"}, r"bad escape \q"),
    ],
)
def test_a_rename_rule_whose_replacement_does_not_fit_its_match_is_refused(rule, problem):
    layer = {"name": "c", "type": "conv", "out_channels": 4, "kernel_size": 3}
    spec = {"input": [3, 8, 8], "weights_keys": [rule], "layers": [layer]}
    with pytest.raises(ConfigError) as e:
        build_model(spec, device="meta")
    message = str(e.value)
    assert message.startswith("model: weights_keys.0: ") and problem in message
    assert "\n" not in message
    fine = {**spec, "weights_keys": [{"match": r"(?P<a>c)\.(w)eight", "to": r"\g<a>.\2eight"}]}
    assert build_model(fine, device="meta").c.weight.shape == (4, 3, 3, 3)


@pytest.mark.parametrize("key,hint", [
    ("weigths", "(did you mean 'weights'?)"),
    ("preprocess", "(preprocess: goes in the network file, beside its layers)"),
    ("num_classes", "(the outputs are the data's classes: a run needs no count"),  # not 'classes?'
])  # fmt: skip
def test_a_run_files_model_mapping_refuses_what_it_does_not_take(tmp_path, capsys, key, hint):
    """As `cnnkit train` does: `info` and `export` used to drop the key silently (an export of
    fresh weights, exit 0, for a mistyped `weights`)."""
    from helpers import run_cli

    (tmp_path / "run.yaml").write_text(f"model: {{network: lenet5, {key}: x.pth}}\n")
    for args in (["info"], ["export", "-o", str(tmp_path / "m.safetensors")]):
        code, _, err = run_cli([args[0], str(tmp_path / "run.yaml"), *args[1:]], capsys)
        assert code == 2 and f"model.{key}: unknown field" in err and hint in err, err
    assert not (tmp_path / "m.safetensors").exists()


@pytest.mark.parametrize("shape", ["[3, -1, 16]", "[3, 16, 16, 16]", "three", "[3, 1.5, 16]"])
def test_a_run_files_model_input_is_checked_where_it_is_written(tmp_path, capsys, shape):
    """`info w.yaml` of `model: {network: net.yaml, input: [3, -1, 16]}` blamed net.yaml."""
    from helpers import one_error_line, run_cli

    (tmp_path / "w.yaml").write_text(f"model: {{network: lenet5, input: {shape}}}\n")
    code, _, err = run_cli(["info", str(tmp_path / "w.yaml")], capsys)
    assert one_error_line(code, err).startswith(f"cnnkit: error: {tmp_path / 'w.yaml'}: "
                                                "model.input: ")  # fmt: skip
    assert err.rstrip().endswith("is not [C, H, W] of whole numbers above 0")


def test_torchvision_weights_are_classified_as_torchvision_transforms_them(tmp_path):
    """A zoo network of torchvision's with its weights reads images as those weights were
    trained: Resize(256), CenterCrop(224), ImageNet's mean and std (it was 0-1 pixels,
    squashed to 224: other probabilities, silently)."""
    import numpy as np
    import torchvision.transforms as T
    from PIL import Image
    from skimage import data as skdata

    from cnnkit.infer.classify import Classifier

    torch.manual_seed(0)
    reference = torchvision.models.resnet18().eval()
    with torch.no_grad():
        reference.fc.weight.mul_(30)  # confident logits: a wrong input moves them visibly
    torch.save(reference.state_dict(), tmp_path / "r18.pth")
    (tmp_path / "run.yaml").write_text("model: {network: resnet18, weights: r18.pth}\n")
    photo = Image.fromarray(np.asarray(skdata.coffee())).resize((600, 400))
    transform = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(),
                           T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])  # fmt: skip
    with torch.no_grad():
        expected = reference(transform(photo)[None]).softmax(1)[0]
    got = Classifier.load(tmp_path / "run.yaml").predict(photo, top=3)
    assert int(got.labels[0].removeprefix("class")) == int(expected.argmax())
    top = expected.topk(3).values.tolist()
    assert got.probs == pytest.approx(top, abs=0.01)


def test_no_decay_on_norms_and_biases_as_the_readme_writes_it():
    """timm's default (torchvision's --norm-weight-decay 0 --bias-weight-decay 0) through
    defaults: only the conv and linear weights decay."""
    spec = {"input": [3, 8, 8],
            "defaults": {"batchnorm": {"decay_mult": 0}, "conv": {"decay_mult": {"bias": 0}},
                         "linear": {"decay_mult": {"bias": 0}}},
            "layers": [{"type": "conv", "out_channels": 4, "kernel_size": 3},
                       {"type": "batchnorm"}, {"type": "relu"}, {"type": "global_avgpool"},
                       {"type": "linear", "out_features": 3}]}  # fmt: skip
    groups = build_model(spec).param_groups(0.1, 5e-4)
    decays = {g["weight_decay"]: sorted(tuple(p.shape) for p in g["params"]) for g in groups}
    assert decays == {5e-4: [(3, 4), (4, 3, 3, 3)], 0.0: [(3,), (4,), (4,), (4,)]}


TINY_NET = """model:
  input: [3, 20, 20]
  weights: tiny.safetensors
  preprocess: {mean: [104, 117, 123], std: [1]}
  layers:
    - {type: conv, out_channels: 4, kernel_size: 3}
    - {type: global_avgpool}
    - {type: linear}
"""


def test_fine_tuning_normalises_as_the_weights_were_made_for(tmp_path, shapes, capsys):
    """A run that starts from weights takes its network's preprocess: mean and std (a Caffe
    net's pixels less its mean, unscaled; torchvision's ImageNet mean and std), as timm takes a
    pretrained model's: from a pack's own statistics instead, a Caffe net read inputs 58x
    smaller than its weights were made for. A checkpoint and classify take them too."""
    from helpers import run_cli

    from cnnkit.checkpoint import load_checkpoint
    from cnnkit.data.pack import pack_folder

    pack_folder(shapes, tmp_path / "packed", size=24, progress=False)
    (tmp_path / "net.yaml").write_text(TINY_NET)
    fresh = yaml.safe_load(TINY_NET)["model"]
    del fresh["weights"]
    save_file(build_model(fresh, num_classes=3).state_dict(), str(tmp_path / "tiny.safetensors"))
    data = {"source": "packed", "path": str(tmp_path / "packed"), "crop": 20, "workers": 0,
            "batch_size": 4}  # fmt: skip
    run = {"name": "ft", "model": "net.yaml", "data": data, "train": {"epochs": 1, "device": "cpu"}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    code, _, err = run_cli(["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "r"),
                            "--quiet"], capsys)  # fmt: skip
    assert code == 0, err
    assert ("cnnkit: note: data.mean [104, 117, 123] and data.std [1, 1, 1] from the network's "
            "preprocess:, as its weights were made for") in err  # fmt: skip
    pre = load_checkpoint(tmp_path / "r" / "last.pt")["preprocess"]
    assert (pre["mean"], pre["std"]) == ([104.0, 117.0, 123.0], [1.0, 1.0, 1.0])
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["data"]["std"] == [1] * 3


@pytest.mark.parametrize("case", ["no weights", "mean given", "mean_image", "folder", "bad"])
def test_only_what_a_fine_tuning_run_leaves_out_takes_the_weights_normalisation(tmp_path, case):
    """Fresh weights: the data's own statistics. A given data.mean stays (data.std comes from
    the network); `normalize: mean_image` subtracts the pack's mean image, as it says. A
    folder of torchvision's ImageNet values says nothing (nothing changes). A preprocess: that
    is no normalisation is one line."""
    from cnnkit.config import RunConfig
    from cnnkit.train.build import normalised_for_weights

    net = TINY_NET.replace("std: [1]", "std: [0, 1, 1]") if case == "bad" else TINY_NET
    if case == "folder":
        net = net.replace(
            "mean: [104, 117, 123], std: [1]",
            "mean: [123.675, 116.28, 103.53], std: [58.395, 57.12, 57.375]",
        )
    (tmp_path / "net.yaml").write_text(net.replace("  weights: tiny.safetensors\n", "")
                                       if case == "no weights" else net)  # fmt: skip
    data = {"source": "folder" if case == "folder" else "packed", "path": "p", "crop": 20,
            **({"mean": [1, 2, 3]} if case == "mean given" else {}),
            **({"normalize": "mean_image"} if case == "mean_image" else {})}  # fmt: skip
    config = RunConfig.model_validate({"model": str(tmp_path / "net.yaml"), "data": data})
    if case == "bad":
        with pytest.raises(
            ConfigError, match=r"preprocess\.std\.0: Input should be greater than 0"
        ):
            normalised_for_weights(config)
        return
    got, note = normalised_for_weights(config)
    if case == "mean given":
        assert (got.data.mean, got.data.std) == ((1, 2, 3), (1.0, 1.0, 1.0))
        assert note.startswith("data.std [1, 1, 1] from the network's preprocess:")
    else:
        assert (got, note) == (config, None)


def test_build_model_of_trained_weights_says_what_loads_them(digits_run):
    """build_model(RUN/best.pt) said "not a text file: give ... or a trained model", which
    build_model does not take."""
    with pytest.raises(ConfigError, match=r"trained weights, not a network description: "
                       r".*build_model\(NET, weights=FILE\).*Classifier\.load"):  # fmt: skip
        build_model(str(digits_run / "best.pt"))


HEAD_NET = {"input": [3, 8, 8], "num_classes": 6, "layers": [
    {"name": "c", "type": "conv", "out_channels": 4, "kernel_size": 3},
    {"name": "g", "type": "global_avgpool"}, {"name": "fc", "type": "linear"}]}  # fmt: skip


@pytest.mark.parametrize("fc", [{"fc.weight": (6, 5), "fc.bias": (6,)},
                                {"fc.weight": (6, 4), "fc.bias": (7,)},
                                {"fc.weight": (10, 5), "fc.bias": (10,)}])  # fmt: skip
def test_a_classifier_of_other_inputs_or_half_fitting_is_never_left_fresh(tmp_path, fc):
    """Only a class count of its own starts a classifier fresh: other inputs, or a bias that
    does not fit its weight, are mis-shaped keys, named, even when fine-tuning."""
    state = {"c.weight": torch.randn(4, 3, 3, 3), "c.bias": torch.randn(4)}
    state |= {k: torch.randn(shape) for k, shape in fc.items()}
    save_file(state, str(tmp_path / "w.safetensors"))
    for num_classes in (None, 6, 3):
        with pytest.raises(CheckpointError, match=r"mis-shaped \(fc\.(weight|bias): file"):
            build_model(HEAD_NET, num_classes=num_classes, weights=tmp_path / "w.safetensors")


def test_weights_for_other_classes_are_refused_where_the_network_scores_as_it_is(tmp_path):
    """A network built as its file says (classify, eval, export, build_model without
    num_classes) refuses a classifier for other classes: its scores would be made up."""
    state = {"c.weight": torch.randn(4, 3, 3, 3), "c.bias": torch.randn(4),
             "fc.weight": torch.randn(10, 4), "fc.bias": torch.randn(10)}  # fmt: skip
    save_file(state, str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointError, match=r"its classifier \(fc\) is for 10 classes, the "
                                              r"network's for 6 \(num_classes\)"):  # fmt: skip
        build_model(HEAD_NET, weights=tmp_path / "w.safetensors")
    tuned = build_model(HEAD_NET, num_classes=6, weights=tmp_path / "w.safetensors")
    assert tuned.fresh_keys == ["fc.weight", "fc.bias"]
    torch.testing.assert_close(tuned.c.weight, state["c.weight"])
    fits = build_model(HEAD_NET, num_classes=10, weights=tmp_path / "w.safetensors")
    assert fits.fresh_keys == [] and torch.equal(fits.fc.bias, state["fc.bias"])
    del state["c.bias"]
    save_file(state, str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointError, match=r"1 missing \(c\.bias\); 2 mis-shaped \(fc\.weight"):
        build_model(HEAD_NET, weights=tmp_path / "w.safetensors")  # every problem named
