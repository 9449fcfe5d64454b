"""The resize filter of a whole image (`preprocess.interpolation`, `data.interpolation`,
`pack --interpolation`): bilinear, or bicubic as timm's and torchvision's EfficientNet weights
were made; checked against torchvision's transforms."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torchvision
import yaml
from PIL import Image
from skimage import data as skdata
from torchvision.transforms import v2
from torchvision.transforms.v2 import InterpolationMode

from cnnkit.data import data_config
from cnnkit.data.base import Preprocess
from cnnkit.data.decode import load_resized
from cnnkit.data.pack import pack_folder
from cnnkit.data.resize import resize_uint8
from cnnkit.errors import ConfigError


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_a_squash_is_torchvisions_resize(interpolation):
    photo = skdata.coffee()  # (400, 600, 3)
    ours = resize_uint8(photo, 96, "squash", interpolation=interpolation)
    mode = InterpolationMode(interpolation)
    theirs = v2.functional.resize(torch.from_numpy(photo).permute(2, 0, 1), [96, 96],
                                  interpolation=mode, antialias=True)  # fmt: skip
    assert torch.equal(ours, theirs)
    other = resize_uint8(photo, 96, "squash", interpolation="bicubic" if interpolation ==
                         "bilinear" else "bilinear")  # fmt: skip
    assert (ours.int() - other.int()).abs().max() > 4  # (the filters differ visibly)


def test_efficientnet_weights_are_classified_as_torchvision_transforms_them(tmp_path):
    """torchvision's EfficientNet-B0 weights were made with Resize(256, bicubic) and
    CenterCrop(224): the zoo network reads images so (bilinear resizing made these weights
    pick another class)."""
    from cnnkit.infer.classify import Classifier

    torch.manual_seed(0)
    reference = torchvision.models.efficientnet_b0()
    for bn in reference.modules():  # statistics of its own activations (fresh ones vanish)
        if isinstance(bn, torch.nn.BatchNorm2d):
            bn.momentum = None
    with torch.no_grad():
        reference(torch.rand(8, 3, 224, 224))
    reference.eval()
    torch.save(reference.state_dict(), tmp_path / "b0.pth")
    (tmp_path / "run.yaml").write_text("model: {network: efficientnet_b0, weights: b0.pth}\n")
    photo = Image.fromarray(np.asarray(skdata.astronaut())).resize((600, 400))
    transform = v2.Compose([v2.PILToTensor(), v2.Resize(256, InterpolationMode.BICUBIC),
                            v2.CenterCrop(224), v2.ToDtype(torch.float32, scale=True),
                            v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])  # fmt: skip
    with torch.no_grad():
        expected = reference(transform(photo)[None]).softmax(1)[0]
    classifier = Classifier.load(tmp_path / "run.yaml")
    assert classifier.preprocess.interpolation == "bicubic"
    got = classifier.predict(photo, top=3)
    assert int(got.labels[0].removeprefix("class")) == int(expected.argmax())
    assert got.probs == pytest.approx(expected.topk(3).values.tolist(), abs=0.01)


def test_a_network_file_takes_interpolation_and_refuses_others(tmp_path, capsys):
    from helpers import run_cli

    net = tmp_path / "net.yaml"
    net.write_text("model:\n  input: [3, 8, 8]\n  preprocess: {resize: 10, interpolation: "
                   "nearest}\n  layers:\n    - {type: flatten}\n    - {type: linear, "
                   "out_features: 2}\n")  # fmt: skip
    run = ["train", str(net), "data.source=synthetic", "data.shape=[3,8,8]", "--dry-run"]
    for argv in (["classify", str(net), str(net)], run):
        code, _, err = run_cli(argv, capsys)  # (train took the file and trained bilinear)
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert "preprocess.interpolation: Input should be 'bilinear' or 'bicubic'" in err, err
    with pytest.raises(ValueError, match="interpolation"):
        Preprocess(channels=3, crop=8, interpolation="lanczos")
    from cnnkit.config import load_run
    from cnnkit.train.build import build_network

    config = load_run(
        str(net), ["data.source=synthetic", "data.shape=[3,8,8]", "data.num_classes=2"]
    )
    data = config.data.build(torch.device("cpu"))
    assert build_network(config, data, fresh=False).num_classes == 2  # a run that began so


def test_a_pack_resizes_with_its_filter_and_says_so(shapes, tmp_path):
    pack_folder(shapes, tmp_path / "p", size=16, progress=False, workers=1,
                interpolation="bicubic")  # fmt: skip
    meta = json.loads((tmp_path / "p/meta.json").read_text())
    assert meta["interpolation"] == "bicubic"
    from data_images import all_images

    x, _ = all_images(tmp_path / "p")
    files = (tmp_path / "p/files.txt").read_text().split()
    for i, rel in enumerate(files):
        expected = load_resized(shapes / rel, 16, "squash", interpolation="bicubic").image
        assert torch.equal(x[i], expected)
    data = data_config({"source": "packed", "path": str(tmp_path / "p"), "crop": 12})
    bundle = data.build(torch.device("cpu"))  # its random-resized crops' filter too
    assert bundle.preprocess.interpolation == bundle.train.augment.interpolation == "bicubic"
    with pytest.raises(ConfigError, match="--interpolation: 'box' is not bilinear or bicubic"):
        pack_folder(shapes, tmp_path / "q", size=16, progress=False, interpolation="box")
    assert not (tmp_path / "q").exists()


def test_a_pack_planned_before_the_setting_resumes_as_bilinear(shapes, tmp_path):
    """An unfinished pack of an earlier cnnkit (its plan without the parameter) resumes: it
    was bilinear; asked for bicubic, the folder is refused as a different pack."""
    pack_folder(shapes, tmp_path / "p", size=16, progress=False, workers=1)
    plan_path = tmp_path / "p/plan.json"
    plan = json.loads(plan_path.read_text())
    del plan["params"]["interpolation"]
    plan_path.write_text(json.dumps(plan))
    (tmp_path / "p/meta.json").unlink()
    assert pack_folder(shapes, tmp_path / "p", size=16, progress=False).images == 15
    with pytest.raises(Exception, match="--interpolation bicubic here, bilinear there"):
        pack_folder(shapes, tmp_path / "p", size=16, progress=False, interpolation="bicubic")


def test_a_folder_run_keeps_its_filter_for_evaluation(shapes, tmp_path):
    section = {"source": "folder", "path": str(shapes), "size": 20, "crop": 16,
               "val_fraction": 0.3, "batch_size": 4, "interpolation": "bicubic"}  # fmt: skip
    bundle = data_config(section).build(torch.device("cpu"))
    assert bundle.preprocess.interpolation == "bicubic"
    with pytest.raises(ConfigError, match="interpolation"):
        data_config({**section, "interpolation": "area"})


def test_evaluating_on_a_pack_of_another_filter_says_so(capsys):
    from cnnkit.train.eval_data import check_pack_fits

    pre = Preprocess(channels=3, crop=224, resize=256, resize_mode="shorter",
                     interpolation="bicubic")  # fmt: skip
    meta = {"size": 256, "resize": "shorter"}  # an older pack: bilinear, unsaid
    check_pack_fits("val/", meta, pre)
    err = capsys.readouterr().err
    assert err.startswith("cnnkit: note: --data val/: packed with bilinear resizing, but the ")
    assert "--interpolation bicubic" in err
    check_pack_fits("val/", {**meta, "interpolation": "bicubic"}, pre)
    assert capsys.readouterr().err == ""


def test_a_run_from_weights_resizes_with_their_filter(shapes, tmp_path, capsys):
    """Fine-tuning efficientnet_b0's weights on a folder resizes bicubic, as they were made
    (data.interpolation left out; given, it stands), and `cnnkit config` shows it so; on a pack
    of another filter, a note."""
    from helpers import run_cli

    from cnnkit.config import load_run
    from cnnkit.train.build import resized_for_weights

    torch.save(torchvision.models.efficientnet_b0().state_dict(), tmp_path / "b0.pth")
    model = {"network": "efficientnet_b0", "weights": str(tmp_path / "b0.pth")}
    run = load_run({"model": model, "data": {"path": str(shapes)}})
    adapted, note = resized_for_weights(run)
    assert adapted.data.interpolation == "bicubic" and "from the network's preprocess" in note
    (tmp_path / "run.yaml").write_text(
        yaml.safe_dump({"model": model, "data": {"path": str(shapes)}})
    )
    code, out, err = run_cli(["config", str(tmp_path / "run.yaml"), "--changed"], capsys)
    shown = [line.split()[:2] for line in out.splitlines() if "data.interpolation" in line]
    assert code == 0 and shown == [["data.interpolation", "bicubic"]], out  # as train runs it
    assert "cnnkit: note: data.interpolation bicubic from the network's preprocess:" in err
    given = load_run({"model": model, "data": {"path": str(shapes), "interpolation": "bilinear"}})
    assert resized_for_weights(given) == (given, None)
    fresh = load_run({"model": "efficientnet_b0", "data": {"path": str(shapes)}})
    assert resized_for_weights(fresh) == (fresh, None)  # no weights: the data's own choice
    pack_folder(shapes, tmp_path / "p", size=16, progress=False, workers=1)
    packed = load_run({"model": model, "data": {"path": str(tmp_path / "p")}})
    same, note = resized_for_weights(packed)
    assert same is packed and note.startswith(f"data.path {tmp_path / 'p'}: packed with bilinear")


def test_a_filter_named_without_a_resize_is_the_weights_filter_too(shapes, tmp_path):
    """preprocess: {interpolation: bicubic} with no resize (classify squashes to the crop with
    it): a run from those weights resizes its folder bicubic too; no filter and no resize named,
    the data's own choice."""
    from cnnkit.config import load_run
    from cnnkit.train.build import resized_for_weights

    layers = "  layers:\n    - {type: flatten}\n    - {type: linear}\n"
    (tmp_path / "w.pth").write_bytes(b"")  # (read when the network is built)
    for pre, wanted in (("{interpolation: bicubic}", "bicubic"), ("{mean: [0.5]}", "bilinear")):
        net = tmp_path / "net.yaml"
        net.write_text(f"model:\n  input: [3, 12, 12]\n  preprocess: {pre}\n{layers}")
        model = {"network": str(net), "weights": str(tmp_path / "w.pth")}
        run = load_run({"model": model, "data": {"path": str(shapes), "crop": 12}})
        adapted, note = resized_for_weights(run)
        assert adapted.data.interpolation == wanted and (note is None) == (wanted == "bilinear")


def test_a_training_pack_and_its_validation_pack_must_share_a_filter(shapes, tmp_path):
    from cnnkit.errors import DataError

    pack_folder(shapes, tmp_path / "a", size=16, progress=False, workers=1)
    pack_folder(shapes, tmp_path / "b", size=16, progress=False, workers=1,
                interpolation="bicubic")  # fmt: skip
    section = {"source": "packed", "path": str(tmp_path / "a"), "val_path": str(tmp_path / "b"),
               "crop": 12}  # fmt: skip
    with pytest.raises(DataError, match="--interpolation bicubic, the training set with "
                       "--size 16 --resize squash --interpolation bilinear: pack both alike"):  # fmt: skip
        data_config(section).build(torch.device("cpu"))


def test_a_packs_filter_is_a_setting_of_the_pack(tmp_path):
    from cnnkit.config import load_run

    with pytest.raises(ConfigError, match=r"`cnnkit pack --interpolation` sets it"):
        load_run({"model": "alexnet", "data": {"source": "packed", "path": str(tmp_path),
                                               "interpolation": "bicubic"}})  # fmt: skip
