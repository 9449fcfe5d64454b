"""The run config: YAML + dotted overrides, validation naming the field, dump round trip."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from cnnkit.config import RunConfig, apply_override, dump_run, load_run, validate_run
from cnnkit.config.sections import TrainConfig
from cnnkit.errors import ConfigError


def test_zoo_run_with_overrides_is_typed():
    config = load_run("digits", ["train.lr=0.02", "data.batch_size=128", "train.milestones=[3, 6]"])
    assert isinstance(config, RunConfig)
    assert config.train.lr == 0.02 and config.data.batch_size == 128
    assert config.train.milestones == [3, 6] and config.name == "digits"
    config = load_run("digits", ["name=2024", "train.channels_last=auto"])  # YAML's int; auto
    assert config.name == "2024" and config.train.channels_last is None


def test_overrides_create_nested_keys_and_parse_yaml_values():
    raw: dict = {"train": {"lr": 0.1}}
    apply_override(raw, "train.compile=true")
    apply_override(raw, "data.source=faces")
    assert raw == {"train": {"lr": 0.1, "compile": True}, "data": {"source": "faces"}}
    with pytest.raises(ConfigError, match="key=value"):
        apply_override(raw, "=3")


def test_dump_then_load_gives_the_same_config(tmp_path):
    config = load_run("faces", ["seed=7"])
    dump_run(config, tmp_path / "run.yaml")
    again = load_run(tmp_path / "run.yaml")
    assert again == config
    assert yaml.safe_load((tmp_path / "run.yaml").read_text())["data"]["source"] == "faces"


def test_run_file_naming_a_network_file_beside_it(tmp_path):
    (tmp_path / "net.yaml").write_text(
        "model: {input: [1, 8, 8], layers: [{type: flatten}, {type: linear}]}\n"
    )
    (tmp_path / "run.yaml").write_text("model: net.yaml\ndata: {source: digits}\n")
    config = load_run(tmp_path / "run.yaml")
    assert config.model.network == str(tmp_path / "net.yaml") and config.name == "run"


@pytest.mark.parametrize("model", ["{LAYERS}", "{network: {LAYERS}}"])
def test_a_network_written_in_a_run_file_names_it_in_its_layer_errors(tmp_path, monkeypatch,
                                                                       model):  # fmt: skip
    """A `model:` mapping written in the run file is named as a network file is (it was
    `layer 1 (add): ...` alone)."""
    from cnnkit import build_model

    layers = ("input: [1, 8, 8], layers: [{name: c1, type: conv, out_channels: 4, kernel_size: "
              "3}, {name: add, type: add, inputs: [c1, c9]}]")  # fmt: skip
    monkeypatch.chdir(tmp_path)
    Path("inline.yaml").write_text(f"model: {model.replace('LAYERS', layers)}\n"
                                   "data: {source: digits}\n")  # fmt: skip
    with pytest.raises(ConfigError) as error:
        build_model(load_run("inline.yaml").model.spec())
    assert str(error.value) == "inline.yaml: line 1: layer 1 (add): inputs: unknown layer 'c9'"


def test_a_fine_tuning_run_file_builds_with_its_weights(tmp_path):
    """`model: {network:, weights:}` is what info, show and build_model read too."""
    import torch

    from cnnkit import build_model

    net = build_model("digitnet")
    torch.save(net.state_dict(), tmp_path / "pre.pth")
    (tmp_path / "run.yaml").write_text(
        "model: {network: digitnet, weights: pre.pth}\ndata: {source: digits}\n"
    )
    built = build_model(tmp_path / "run.yaml")  # the weights beside the run file, as training
    assert all(torch.equal(v, built.state_dict()[k]) for k, v in net.state_dict().items())
    (tmp_path / "self.yaml").write_text("model: {network: self.yaml}\n")
    with pytest.raises(ConfigError, match="files name each other more than"):
        build_model(tmp_path / "self.yaml")


@pytest.mark.parametrize(
    "change, words",
    [
        ({"train": {"momentum": 1.5}}, "train.momentum"),
        ({"train": {"schedule": "multistep"}}, "milestones"),
        ({"train": {"precision": "fp16", "device": "cpu"}}, "fp16"),
        ({"train": {"epochs": 0}}, "train.epochs"),
        ({"data": {"source": "digits", "val_fraction": 1.5}}, "data.val_fraction"),
        ({"data": {"source": "digits", "colour": 1}}, "data.colour"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed: Input should be less than 9223372036854775808"),  # torch's bound
        ({"train": {"checkpoint_minutes": 1e308}}, "train.checkpoint_minutes: Input should be"),
        # YAML's on / off / yes / no are booleans: never read as 1 and 0 where a number goes
        (
            {"train": {"epochs": True}},
            r"train.epochs: Input should be a number, not true or false \(got true\)",  # YAML's
        ),
        ({"train": {"grad_clip": False}}, "train.grad_clip: Input should be a number"),
        ({"train": {"milestones": [5, True]}}, "train.milestones: Input should be a number"),
        (
            {"data": {"source": "digits", "batch_size": True}},
            "data.batch_size: Input should be a number",
        ),
        (
            {"data": {"source": "faces", "hard_negatives": {"images": [], "rounds": True}}},
            "data.hard_negatives.rounds: Input should be a number",
        ),
        ({"seed": False}, "seed: Input should be a number"),
        # nor text ('3', quoted in YAML) nor, where a whole number goes, a float (lax mode's)
        (
            {"train": {"epochs": "3"}},
            r"train.epochs: Input should be a number, not text \(write it without quotes\)",
        ),
        (
            {"train": {"epochs": "abc"}},
            r"train.epochs: Input should be a number, not text \(got 'abc'\)",
        ),  # no quotes to drop
        ({"train": {"early_stop": 1.0}}, r"train.early_stop: Input should be a whole number"),
        (  # `seed=1e3`, unquoted: YAML 1.1 reads it as text (it said "write it without quotes")
            {"seed": "1e3"},
            r"seed: Input should be a whole number, written out \(YAML reads 1e3 as text\)",
        ),
        ({"train": {"milestones": [5, "9"]}}, r"train.milestones: Input should be a number"),
        (
            {"name": True},
            "name: Input should be a valid string \\(got true\\)",
        ),  # not a number field: pydantic's
        ({"name": "run\n"}, "name: use letters, digits"),  # (a folder named with a newline)
        ({"train": {"device": "cpu\n"}}, r"train.device: 'cpu\\n' is not one of auto"),
        ({"train": {"optimizer": True}}, "train.optimizer: Input should be 'sgd'"),
        # refused here, not later as a preprocessing pydantic traceback
        (
            {"data": {"source": "folder", "path": "imgs", "std": [0, 1, 1]}},
            r"data.std.0: Input should be greater than 0",
        ),
        ({"data": {"source": "packed", "path": "pk", "std": [1, -1, 1]}}, r"data.std.1: Input"),
        (
            {"data": {"source": "folder", "path": "imgs", "mean": [123.675, 116.28]}},
            r"^data.mean: takes 3 values, one per channel \(R, G, B\), not 2 \(got \[123",
        ),  # not `data.mean.2: Field required`
        (
            {"data": {"source": "packed", "path": "pk", "std": [1] * 4}},
            r"^data.std: takes 3 values",
        ),
        ({"train": {"betas": [0.9]}}, r"^train.betas: takes 2 values, not 1 \(got \[0.9\]\)$"),
        ({"train": {"betas": [0.9, 0.9, 0.9]}}, r"^train.betas: takes 2 values, not 3 \(got"),
        (
            {"data": {"source": "folder", "path": "imgs", "size": 9000}},
            "data.size: Input should be less than or equal to 8192",
        ),  # a network's MAX_SIDE
        (
            {"data": {"source": "synthetic", "shape": [5, 8, 8]}},
            "data.shape: 5 channels: at most 4",
        ),
        ({"data": {"source": "synthetic", "shape": [3, 9000, 8]}}, "data.shape: 9000x8: at most"),
    ],
)
def test_each_bad_field_is_named(change, words):
    raw = {"model": "digitnet", "data": {"source": "digits"}, **change}
    with pytest.raises(ConfigError, match=words):
        validate_run(raw)


@pytest.mark.parametrize(
    "data",
    [{"source": "folder", "path": "imgs"}, {"source": "packed", "path": "pk"},
     {"source": "digits"}, {"source": "faces"}, {"source": "synthetic"}],
)  # fmt: skip
def test_setting_descriptions_show_numbers_not_constant_names(data):
    """`cnnkit config` shows a limit as its number (8192), not the code's name (MAX_SIDE)."""
    import re

    from cnnkit.config import describe_run

    rows = describe_run(validate_run({"model": "digitnet", "data": data}))
    named = [(key, text) for key, _, _, text in rows if re.search(r"\b[A-Z]+_[A-Z_]+\b", text)]
    assert not named, named
    if data["source"] == "folder":
        assert "at most 8192" in dict((key, text) for key, _, _, text in rows)["data.size"]


@pytest.mark.parametrize(
    "raw, line",
    [
        ({"data": {"source": "folder", "paht": "sm"}}, "data.paht: unknown field (did you mean 'path'?)"),
        ({"data": {"sorce": "digits"}}, "data.sorce: unknown field (did you mean 'source'?)"),
        ({"model": {"netwrk": "digitnet"}}, "model.netwrk: unknown field (did you mean 'network'?)"),
        ({"dat": {"source": "digits"}}, "dat: unknown field (did you mean 'data'?)"),
        ({"model": {"input": [1, 8, 8], "layres": [{"type": "flatten"}]}},
         "model.layres: unknown field (did you mean 'layers'?)"),
    ],
)  # fmt: skip
def test_a_misspelt_required_field_is_named_with_the_one_meant(raw, line):
    """A required field misspelt is the unknown key beside it that is wrong, not the field
    missing: the key is named with the one meant, as a misspelt optional one is."""
    raw = {"model": "digitnet", **({} if "dat" in raw else {"data": {"source": "digits"}}), **raw}
    with pytest.raises(ConfigError) as caught:
        validate_run(raw)
    assert str(caught.value) == line


def test_a_data_path_without_a_source_is_read_as_what_is_there(shapes, tmp_path):
    """`data: {path: DIR}` is a pack where `cnnkit pack` wrote DIR, else an image folder (as
    timm reads a data folder); the source is written out in the resolved run. No path and no
    source is still refused, naming the sources."""
    from cnnkit.data.pack import pack_folder

    pack_folder(shapes, tmp_path / "packed", size=24, progress=False)
    for path, source in ((shapes, "folder"), (tmp_path / "packed", "packed")):
        config = load_run({"model": "digitnet", "data": {"path": str(path)}})
        assert config.data.source == source
        assert yaml.safe_load(dump_run(config))["data"]["source"] == source
    with pytest.raises(ConfigError, match=r"^data.source: missing \(one of: digits, faces"):
        load_run({"model": "digitnet", "data": {"batch_size": 8}})


@pytest.mark.parametrize("model, data, crop, size", [
    ("resnet18", {}, 224, 256),  # torchvision's 224 of 256, not AlexNet's 227
    ("lenet5", {}, 32, 37),  # 8/7 of the side: not a 32 px crop of 256
    ("alexnet", {}, 227, 256),  # the default itself: nothing set
    ("resnet18", {"crop": 200}, 200, 256),  # given: kept (and size left as it is)
    ("resnet18", {"crop": 299}, 299, 342),  # given over 256: size follows it (8/7), not refused
    ("resnet18", {"size": 300}, 224, 300),
    ({"network": "resnet18", "input": [3, 64, 64]}, {}, 64, 73),  # model.input: its side
    ("inception-small", {"source": "packed"}, 32, None),  # a pack: its crop only
    ("digitnet", {"source": "digits"}, None, None),  # no crop to set
])  # fmt: skip
def test_an_image_sets_crop_left_out_is_the_networks_input_side(shapes, tmp_path, model, data,
                                                                crop, size):  # fmt: skip
    """As timm takes a model's input size: a folder or pack trains at its network's side, and a
    folder resized in proportion, where the run leaves them out."""
    if data.get("source") == "packed":
        from cnnkit.data.pack import pack_folder

        pack_folder(shapes, tmp_path / "packed", size=24, progress=False)
    section = {"path": str(tmp_path / "packed" if data.get("source") else shapes), **data}
    if data.get("source") == "digits":
        section = data
    config = load_run({"model": model, "data": section})
    assert getattr(config.data, "crop", None) == crop
    assert getattr(config.data, "size", None) == size
    if crop is not None:  # resolved as it was run: config.yaml gives the crop and size taken
        again = yaml.safe_load(dump_run(config))["data"]
        assert again["crop"] == crop and again.get("size") == size


def test_a_zoo_network_given_its_data_is_a_run(shapes):
    """`cnnkit train resnet18 data.path=DIR`, as timm's `train.py DIR --model resnet18`: the
    network's run with the train section's defaults, its crop and the folder's size its own."""
    config = load_run("resnet18", [f"data.path={shapes}", "train.epochs=3"])
    assert (config.name, config.model.network, config.data.source) == ("resnet18", "resnet18",
                                                                        "folder")  # fmt: skip
    assert (config.data.crop, config.data.size, config.train.epochs) == (224, 256, 3)
    assert config.train.lr == TrainConfig().lr
    with pytest.raises(ConfigError, match=r"^'resnet18' is a zoo network, not a run: give its "
                       r"data \(`cnnkit train resnet18 data.path=DIR`"):  # fmt: skip
        load_run("resnet18", ["train.epochs=3"])  # no data: what to give
    with pytest.raises(ConfigError, match=r"^'resnet18' is a zoo network, not a run"):
        load_run("resnet18", ["data.batch_size=8"])  # (was: data.source: missing)
    with pytest.raises(ConfigError, match=r"^data\.data_dir: unknown field \(did you mean 'path'\?\): "
                       r"`cnnkit train resnet18 data\.path=DIR` trains it on a folder"):  # fmt: skip
        load_run("resnet18", ["data.batch_size=8", "data.data_dir=/x"])  # (was: the zoo line)
    with pytest.raises(ConfigError, match=r"^data\.shfit: unknown field \(data\.shift is a "
                       r"setting of data\.source digits / faces, not of a folder or a pack\)"):  # fmt: skip
        load_run("resnet18", ["data.shfit=2"])  # (no source given: not 'not folder')


def test_a_path_given_on_the_command_line_brings_its_source(shapes, tmp_path):
    """A run directory's config.yaml names `source: folder` and a folder's `size`: given
    `data.path=PACK`, it failed on the pack's shards as class folders, then on each folder
    field in turn. The source follows the path, unless data.source is given too."""
    from cnnkit.data.pack import pack_folder

    pack_folder(shapes, tmp_path / "packed", size=24, progress=False)
    run = {"model": "lenet5", "data": {"source": "folder", "path": str(shapes), "size": 37,
                                       "resize_mode": "shorter", "grey": True}}  # fmt: skip
    config = load_run(run, [f"data.path={tmp_path / 'packed'}", "data.crop=24"])
    assert config.data.source == "packed" and config.data.grey
    assert config.data.mean is None  # a new run on a pack: the pack's own statistics
    assert config._notes == [
        f"data.path {tmp_path / 'packed'}: its images were packed with size 24, resize_mode "
        "squash, the run's folder read them with size 37, resize_mode shorter (cnnkit pack "
        "--size 37 --resize shorter-side-crop packs them as it did)"
    ]
    back = load_run(yaml.safe_load(dump_run(config)), [f"data.path={shapes}"])
    assert back.data.source == "packed"  # a folder to a pack's run: said when it is opened
    with pytest.raises(ConfigError, match="data.size"):  # both given: as the user says
        load_run(run, [f"data.path={tmp_path / 'packed'}", "data.source=packed"])
    with pytest.raises(ConfigError, match=r"^data.interpolation: unknown field \(a pack's "):
        load_run(run, [f"data.path={tmp_path / 'packed'}", "data.interpolation=bicubic"])
    written = {"model": "lenet5", "data": {"path": str(shapes), "size": 37, "grey": True}}
    moved = load_run(written, [f"data.path={tmp_path / 'packed'}", "data.crop=24"])
    assert moved.data.source == "packed" and moved.data.grey  # `source` left out: a folder's
    assert moved._notes == [
        config._notes[0]
        .replace(", resize_mode shorter", "")
        .replace(", resize_mode squash", "")
        .replace(" --resize shorter-side-crop", "")
    ]
    misspelt = {"model": "lenet5", "data": {"path": str(shapes), "sorce": "folder"}}
    with pytest.raises(ConfigError, match=r"^data\.sorce: unknown field \(did you mean 'source'"):
        load_run(misspelt, [f"data.path={tmp_path / 'packed'}"])


def test_a_folders_run_resumed_on_its_pack_keeps_its_normalisation(shapes, tmp_path):
    """A folder's statistics left out are ImageNet's, a pack's its own: a run that trained on
    the folder went on with the pack's after a resume on it, without a word. Given, they stand."""
    from cnnkit.data.folder import IMAGENET_MEAN, IMAGENET_STD
    from cnnkit.data.pack import pack_folder
    from cnnkit.train.rundir import resume_config

    pack_folder(shapes, tmp_path / "packed", size=24, progress=False)
    trained = load_run({"model": "lenet5", "data": {"path": str(shapes), "size": 24,
                                                    "grey": True}})  # fmt: skip
    state = {"config": yaml.safe_load(dump_run(trained)), "model_spec": trained.model.spec()}
    resumed = resume_config(state, [f"data.path={tmp_path / 'packed'}"])
    assert resumed.data.source == "packed" and resumed._notes == []  # packed as it read them
    assert (resumed.data.mean, resumed.data.std) == (IMAGENET_MEAN, IMAGENET_STD)
    given = resume_config(state, [f"data.path={tmp_path / 'packed'}", "data.std=[50,50,50]"])
    assert (given.data.mean, given.data.std) == (IMAGENET_MEAN, (50, 50, 50))
    null = resume_config(state, [f"data.path={tmp_path / 'packed'}", "data.mean=null"])
    assert (null.data.mean, null.data.std) == (IMAGENET_MEAN, IMAGENET_STD)  # the folder's null
    shown = load_run(state["config"], [f"data.path={tmp_path / 'packed'}"], trained=True)
    assert shown.data.mean == IMAGENET_MEAN  # `cnnkit config RUN_DIR data.path=PACK`: as resumed
    held_out = {**state["config"], "data": {**state["config"]["data"], "val_path": str(shapes)}}
    with pytest.raises(ConfigError, match=r"data.val_path .* the folder the run held out: give "
                       r"data.val_path=VALPACK"):  # fmt: skip
        resume_config({**state, "config": held_out}, [f"data.path={tmp_path / 'packed'}"])


def test_resize_mode_takes_packs_name_for_shorter_side_resizing(shapes):
    """`pack --resize shorter-side-crop` is data.resize_mode shorter: either name, in either."""
    from cnnkit.data.base import Preprocess

    config = load_run("resnet18", [f"data.path={shapes}", "data.resize_mode=shorter-side-crop"])
    assert config.data.resize_mode == "shorter"
    assert Preprocess(channels=3, crop=8, resize_mode="shorter-side-crop").resize_mode == "shorter"
    with pytest.raises(ConfigError, match=r"^data.resize_mode: 'short' is not squash or shorter "
                       r"\(shorter-side-crop\)$"):  # fmt: skip
        load_run("resnet18", [f"data.path={shapes}", "data.resize_mode=short"])


def test_a_crop_left_out_fits_before_the_crops_own_checks(shapes):
    """data.size 32 for lenet5 was refused as smaller than AlexNet's crop of 227."""
    config = load_run({"model": "lenet5", "data": {"path": str(shapes), "size": 32}})
    assert (config.data.crop, config.data.size) == (32, 32)


@pytest.mark.parametrize("source, key, meant", [
    ("folder", "image_size", "(did you mean 'crop'?)"),  # spelling alone: 'batch_size'
    ("folder", "crop_size", "(did you mean 'crop'?)"),
    ("folder", "batch", "(did you mean 'batch_size'?)"),  # spelling alone: 'path'
    ("folder", "data_path", "(did you mean 'path'?)"),  # spelling alone: 'val_path'
    ("folder", "num_workers", "(did you mean 'workers'?)"),
    ("digits", "image_size", "(data.crop is a setting of data.source folder / packed, not digits)"),
    ("digits", "learning_rate", "(it belongs in train: train.lr)"),
    ("digits", "pth", "(data.path is a setting of data.source folder / packed, not digits)"),
    ("folder", "shfit", "(data.shift is a setting of data.source digits / faces, not folder)"),
    ("folder", "xyz", ""),  # no peer name and nothing close: nothing said
    # another source's own field: said as such, not a field spelt alike, nor this very command
    ("digits", "val_path", "(a setting of data.source folder / packed, not digits: `cnnkit "
                           "train digitnet data.path=DIR data.val_path=...` trains the run's "
                           "network, digitnet, on such data)"),
    ("folder", "shift", "(a setting of data.source digits / faces, not folder)"),
    ("folder", "split_seed", "(a setting of data.source digits / faces, not folder: a folder's "
                             "or a pack's held-out images are data.val_fraction of data.path "
                             "(drawn by file name), or data.val_path)"),
])  # fmt: skip
def test_the_names_peers_give_a_data_setting_are_met_with_ours(source, key, meant):
    """torchvision's, timm's and Caffe's names for our settings are answered with ours, never
    with a setting that is only spelt alike."""
    data = {"source": source, key: 1, **({"path": "x"} if source == "folder" else {})}
    with pytest.raises(ConfigError) as caught:
        validate_run({"model": "digitnet", "data": data})
    assert str(caught.value) == f"data.{key}: unknown field {meant}".strip()


@pytest.mark.parametrize("model, network", [
    ("digitnet", "digitnet"),
    ({"network": "digitnet", "input": [1, 8, 8]}, "digitnet"),
    ({"network": {"input": [1, 8, 8], "layers": [{"type": "flatten"}]}}, None),
])  # fmt: skip
def test_an_image_folder_given_to_the_digits_run_points_to_its_network(model, network):
    """`cnnkit train digits data.path=DIR`: its network trains on a folder, not the run."""
    with pytest.raises(ConfigError) as caught:
        validate_run({"model": model, "data": {"source": "digits", "path": "shapes"}})
    said = "data.path: unknown field (a setting of data.source folder / packed, not digits: "
    assert str(caught.value) == said + (
        f"`cnnkit train {network} data.path=DIR` trains the run's network, {network}, on such "
        "data)" if network else "data.path=null leaves it out, or start from a run file "
        "written for digits data)")  # fmt: skip


@pytest.mark.parametrize("data, line", [
    ({"img_size": 3}, "data.img_size: unknown field (did you mean 'crop'?)"),
    ({"batch_sise": 3}, "data.batch_sise: unknown field (did you mean 'batch_size'?)"),
    ({"sed": 1}, "data.sed: unknown field (did you mean 'std'?)"),  # not the top level's seed
    ({"sorce": "folder"}, "data.sorce: unknown field (did you mean 'source'?)"),
])  # fmt: skip
def test_a_source_read_from_the_path_names_its_fields_in_messages(shapes, data, line):
    """The source a path says (data: {path: DIR}) is the run's for every message: its fields
    are the ones meant, and a source misspelt is still named, not read from the path."""
    with pytest.raises(ConfigError) as caught:
        load_run({"model": "resnet18", "data": {"path": str(shapes), **data}})
    assert str(caught.value) == line


def test_a_folders_size_follows_a_crop_over_its_default_where_left_out(shapes):
    """bench loader --crop 299 and data.crop=299 alike: no data.size there to set."""
    from cnnkit.data import data_config

    section = {"source": "folder", "path": str(shapes)}
    assert data_config({**section, "crop": 299}).size == 342
    assert data_config({**section, "crop": 299, "size": 320}).size == 320  # given: kept
    assert data_config({**section, "crop": 256}).size == 256


def test_the_crop_and_size_from_a_network_stay_within_what_a_folder_takes(shapes):
    config = load_run({"model": {"network": "resnet18", "input": [3, 8000, 8000]},
                       "data": {"path": str(shapes)}})  # fmt: skip
    assert (config.data.crop, config.data.size) == (8000, 8192)  # 8/7 of 8000: past the most


@pytest.mark.parametrize("key, meant", [
    ("learning_rate", "lr"), ("base_lr", "lr"), ("wd", "weight_decay"), ("amp", "precision"),
    ("lr_scheduler", "schedule"), ("lr_policy", "schedule"), ("warmup", "warmup_epochs"),
    ("clip_grad_norm", "grad_clip"), ("model_ema", "ema"), ("stepvalue", "milestones"),
    ("warmup_lr", None),  # timm's, an lr: not warmup_start, a factor, however spelt alike
    ("warmup_prefix", None),  # timm's: where the cosine starts, not warmup_start
    ("weight_decay_bias", "bias_weight_decay"), ("norm_wd", "norm_weight_decay"),
    ("nesterov", "optimizer"),
    ("model.arch", "network"), ("arch", "model"),
])  # fmt: skip
def test_the_names_peers_give_a_training_setting_are_met_with_ours(key, meant):
    key = key if "arch" in key else f"train.{key}"
    with pytest.raises(ConfigError) as caught:
        load_run("digits", [f"{key}=1"])
    said = f" (did you mean {meant!r}?)" if meant else ""
    assert str(caught.value) == f"{key}: unknown field{said}"


@pytest.mark.parametrize("key, hint", [
    ("train.LR", "(did you mean 'lr'?)"), ("train.Momentum", "(did you mean 'momentum'?)"),
    ("model.WEIGHTS", "(did you mean 'weights'?)"),
    ("train.SEED", "(it belongs at the top level: seed)"),
    ("data.PATH", "(data.path is a setting of data.source folder / packed, not digits)"),
])  # fmt: skip
def test_a_field_written_in_capitals_is_met_with_the_one_meant(key, hint):
    """The hint is case-insensitive (train.LR was `unknown field` alone, while Train.lr got one)."""
    with pytest.raises(ConfigError) as caught:
        load_run("digits", [f"{key}=1"])
    assert str(caught.value) == f"{key}: unknown field {hint}"


@pytest.mark.parametrize("key, hint", [
    ("train.batch_size", "(it belongs in data: data.batch_size)"),  # was 'step_size'
    ("train.batchsize", "(it belongs in data: data.batch_size)"),
    ("train.workers", "(data.workers is a setting of data.source folder / packed)"),
    ("model.crop", "(data.crop is a setting of data.source folder / packed)"),
    ("train.size", "(data.size is a setting of data.source folder)"),  # was 'step_size'
])  # fmt: skip
def test_another_sections_own_field_is_named_before_a_near_spelling_here(key, hint):
    """Many training scripts keep the batch size with the optimizer's settings: train.batch_size
    is cnnkit's data.batch_size, not train.step_size; an image set's field on digits names the
    sources that have it."""
    with pytest.raises(ConfigError) as caught:
        load_run("digits", [f"{key}=1"])
    assert str(caught.value) == f"{key}: unknown field {hint}"


def test_num_classes_on_synthetic_data_belongs_in_its_data_section():
    """Synthetic data's class count is its own setting: said so, not 'taken from the data'."""
    with pytest.raises(ConfigError) as caught:
        load_run({"model": {"network": "lenet5"}, "data": {"source": "synthetic"}},
                 ["model.num_classes=10"])  # fmt: skip
    assert str(caught.value) == ("model.num_classes: unknown field (it belongs in data: "
                                 "data.num_classes)")  # fmt: skip


def test_num_classes_beside_a_runs_network_says_where_the_class_count_comes_from(tmp_path):
    """`model: {network: net.yaml, num_classes: 10}` was `unknown field` alone."""
    (tmp_path / "net.yaml").write_text(
        "model: {input: [1, 8, 8], layers: [{type: flatten}, {type: linear}]}\n"
    )
    (tmp_path / "run.yaml").write_text(
        "model: {network: net.yaml, num_classes: 10}\ndata: {source: digits}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_run(tmp_path / "run.yaml")
    assert str(caught.value) == ("model.num_classes: unknown field (training takes the class "
                                 "count from the data set, in place of a network file's "
                                 "num_classes)")  # fmt: skip


def test_a_new_run_needs_held_out_images(tmp_path):
    """val_fraction 0 without val_path is refused for a new run (best.pt would be epoch 1's);
    a checkpoint saved with it before still validates, so it resumes."""
    section = {"source": "folder", "path": str(tmp_path), "val_fraction": 0}
    with pytest.raises(ConfigError, match="data.val_fraction: 0 leaves no held-out images"):
        load_run({"model": "digitnet", "data": section})
    validate_run({"model": "digitnet", "data": section})


def test_missing_run_file_or_zoo_name(tmp_path):
    with pytest.raises(ConfigError, match="neither a zoo run or network"):
        load_run("no-such-run")
    (tmp_path / "run.yaml").write_text("name: x\nmodel: digitnet\n")
    with pytest.raises(ConfigError, match=f"did you mean '{tmp_path / 'run.yaml'}'"):
        load_run(tmp_path / "runs.yaml")  # a file mistyped: the file beside it meant


def test_run_file_weights_start_the_network_from_a_state_dict(tmp_path):
    """model: {network, weights}: the run trains from the file's weights (relative to the run
    file), a classifier of another class count fresh; config.yaml keeps the section."""
    import torch
    from safetensors.torch import save_file

    from cnnkit.nn import build_model
    from cnnkit.train.run import fit

    source = build_model("digitnet", num_classes=4)
    save_file(
        {k: v.contiguous() for k, v in source.state_dict().items()}, tmp_path / "w.safetensors"
    )
    (tmp_path / "run.yaml").write_text(
        "model: {network: digitnet, weights: w.safetensors}\n"
        "data: {source: digits}\ntrain: {epochs: 1, lr: 1.0e-9, momentum: 0, weight_decay: 0}\n"
    )
    config = load_run(tmp_path / "run.yaml")
    assert config.model.weights == str(tmp_path / "w.safetensors")
    fit(config, tmp_path / "run", quiet=True)
    trained = torch.load(tmp_path / "run" / "last.pt", weights_only=True)["model"]
    torch.testing.assert_close(
        trained["conv1.weight"], source.state_dict()["conv1.weight"], atol=1e-5, rtol=0
    )
    assert trained["output.weight"].shape[0] == 10  # digits has 10 classes: a fresh classifier
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["model"] == {"network": "digitnet", "weights": str(tmp_path / "w.safetensors")}


def test_booleans_still_set_the_boolean_fields():
    raw = {"model": "digitnet", "data": {"source": "digits"}, "deterministic": True,
           "train": {"channels_last": True, "compile": False, "calibrate": False}}  # fmt: skip
    config = validate_run(raw)
    assert config.train.channels_last is True and config.deterministic is True


def test_whole_numbers_go_where_floats_do():
    raw = {"model": "digitnet", "data": {"source": "digits"}, "train": {"lr": 1, "epochs": 2}}
    cfg = validate_run(raw)
    assert cfg.train.lr == 1.0 and cfg.train.epochs == 2
    raw["train"]["lr"] = "1e-3"  # PyYAML reads 1e-3 (no dot) as text: still a learning rate
    assert validate_run(raw).train.lr == 1e-3


def test_another_sources_data_section_says_so():
    """data.source=packed over a run written for digits: digits' scale (a zoom) is not packed's
    (an area range); the type error says the section was written for another source, and
    the unknown fields say whose they are."""
    with pytest.raises(ConfigError) as caught:
        load_run("digits", ["data.source=packed", "data.path=p"])
    assert str(caught.value) == (
        "data.scale: Input should be a valid tuple (got 0.1) (this data: section was written "
        "for another source: data.scale is packed's random-resized-crop area range, by default "
        "[0.08, 1.0]; data.shift, data.rotate are not settings of packed, and =null leaves each "
        "out; or start from a run file written for packed data)"
    )
    with pytest.raises(ConfigError) as caught:  # =null leaves out only another source's fields
        load_run("digits", ["data.source=packed", "data.path=p", "data.scale=null"])
    assert str(caught.value).startswith(
        "data.scale: Input should be a valid tuple (got null) (this data: section was written "
        "for another source: data.scale is packed's random-resized-crop area range, by default "
        "[0.08, 1.0]; data.shift, data.rotate are not settings of packed, and =null leaves each "
    ), caught.value
    with pytest.raises(ConfigError, match=r"data.shift: unknown field \(a setting of data.source"):
        load_run("digits", ["data.source=packed", "data.path=p", "data.scale=[0.5, 1]"])
    moved = load_run("digits", ["data.source=packed", "data.path=p", "data.scale=[0.5, 1]",
                                "data.shift=null", "data.rotate=null"])  # fmt: skip
    assert moved.data.source == "packed" and moved.data.scale == (0.5, 1.0)
    packed = {"name": "p", "model": "alexnet", "data": {"source": "packed", "path": "p",
                                                        "scale": 0.1}}  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"^data.scale: Input should be a valid tuple \(got 0.1\)$"
    ):
        validate_run(packed)  # its own mistake: no word of other sources


def test_the_readme_run_files_are_valid_runs():
    """Every run file the README's Train section shows loads as written (a field renamed in
    the code and not in the README fails here)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    train = readme.split("### Train: `cnnkit train`")[1].split("\n### ")[0]
    runs = [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", train, re.S)]
    assert len(runs) >= 2
    for raw in runs:
        config = load_run(raw)
        assert config.name == raw["name"]
        assert config.data.source == raw["data"].get("source", "folder")
        assert config.train.epochs == raw["train"]["epochs"]


def test_torchvisions_0_1_mean_and_std_are_refused_with_their_0_255_values():
    """torchvision's Normalize values pasted as data.mean / data.std trained silently on inputs
    off by 255x (up to 1136 where about 2.6 was meant); 0-255 values, and mean 0 with std 1
    (the pixels as they are), still pass."""
    base = {"name": "x", "model": "resnet18", "data": {"source": "folder", "path": "/d"}}
    for field, values, scaled in (
        ("mean", [0.485, 0.456, 0.406], "[123.675, 116.28, 103.53]"),
        ("std", [0.229, 0.224, 0.225], "[58.395, 57.12, 57.375]"),
        ("mean", [0.5, 0.5, 0.5], "[127.5, 127.5, 127.5]"),
    ):
        with pytest.raises(ConfigError) as e:
            load_run({**base, "data": {**base["data"], field: values}})
        assert str(e.value).startswith(f"data.{field}: [{', '.join(map(str, values))}] is on a")
        assert str(e.value).endswith(f"on 0-255, as pixels are: {scaled}")
    for mean, std in (([0, 0, 0], [1, 1, 1]), ([123.675, 116.28, 103.53], [58.395, 57.12, 57.375])):
        data = load_run({**base, "data": {**base["data"], "mean": mean, "std": std}}).data
        assert list(data.mean) == mean and list(data.std) == std


def test_a_network_files_preprocess_on_a_0_1_scale_is_refused():
    from cnnkit.infer.load import network_preprocess

    with pytest.raises(ConfigError, match=r"^n.yaml: model: preprocess.std: \[0.5\] is on a 0-1"):
        network_preprocess("n.yaml", (1, 28, 28), {"std": [0.5]})
    assert network_preprocess("n.yaml", (1, 28, 28), {"mean": [0.0], "std": [1.0]}).std == [1.0]


def test_model_input_builds_a_zoo_network_at_the_datas_size():
    """timm's img_size: `model: {network: resnet18, input: [3, 64, 64]}` builds the zoo file
    at 64 px (it was 'model.input: unknown field'); the run's dump keeps it, and a network
    whose layers cannot take the size says which layer."""
    from cnnkit.config.load import run_dict
    from cnnkit.nn import build_model

    raw = {"name": "x", "model": {"network": "resnet18", "input": [3, 64, 64]},
           "data": {"source": "folder", "path": "/d", "crop": 64}}  # fmt: skip
    config = load_run(raw)
    assert config.model.spec()["input"] == [3, 64, 64]
    assert build_model(config.model.spec()).input_shape == (3, 64, 64)
    assert run_dict(config)["model"] == {
        "network": "resnet18",
        "weights": None,
        "input": [3, 64, 64],
    }
    assert load_run(run_dict(config)).model.spec()["input"] == [3, 64, 64]
    assert run_dict(load_run({**raw, "model": "resnet18"}))["model"] == "resnet18"
    alexnet = load_run({**raw, "model": {"network": "alexnet", "input": [3, 64, 64]}})
    with pytest.raises(ConfigError, match=r"\(pool5\): kernel_size: kernel 3 is larger than"):
        build_model(alexnet.model.spec())


def test_model_input_of_other_channels_or_size_carries_the_preprocess_that_still_holds(
    tmp_path, capsys
):
    """`model: {network: resnet18, input: [1, 64, 64]}`: the zoo's three ImageNet means no
    longer fit one channel, and `info` of the run file refused it ("preprocess.mean: one value
    or one per channel (1)"). Another channel count drops mean and std; another size scales
    the resize as timm's crop_pct does (256 for 224 -> 73 for 64)."""
    from helpers import run_cli

    from cnnkit.nn import read_spec

    zoo = read_spec("resnet18")["preprocess"]
    grey = {"name": "x", "model": {"network": "resnet18", "input": [1, 64, 64]},
            "data": {"source": "synthetic", "shape": [1, 64, 64]}}  # fmt: skip
    assert load_run(grey).model.spec()["preprocess"] == {"resize": 73, "resize_mode": "shorter"}
    larger = {**grey, "model": {"network": "resnet18", "input": [3, 320, 320]}}
    assert load_run(larger).model.spec()["preprocess"] == {**zoo, "resize": 366}
    same = {**grey, "model": {"network": "resnet18", "input": [3, 224, 224]}}
    assert load_run(same).model.spec()["preprocess"] == zoo
    assert read_spec("resnet18")["preprocess"] == zoo  # the zoo's own mapping is untouched
    (tmp_path / "run.yaml").write_text(json.dumps(grey))
    code, out, err = run_cli(["info", str(tmp_path / "run.yaml")], capsys)
    assert (code, err) == (0, "") and "input 1x64x64" in out
    for shape in ([3, 48, 72], [2, 64, 64]):  # not an image classify reads: none at all (info
        other = {**grey, "model": {"network": "resnet18", "input": shape}}  # and export
        assert "preprocess" not in load_run(other).model.spec()  # refused the zoo's)
        (tmp_path / "run.yaml").write_text(json.dumps(other))
        code, out, err = run_cli(["info", str(tmp_path / "run.yaml")], capsys)
        assert (code, err) == (0, "") and "input {}x{}x{}".format(*shape) in out


def test_more_epochs_on_resume_says_the_cosine_schedule_stretches():
    """`all 3 epochs done (train.epochs=N for more)`, followed, restarted the cosine curve
    from near its peak without a word: the note says so, and what it is instead."""
    from cnnkit.train.rundir import resume_config

    trained = load_run("digits", ["train.epochs=3"])
    state = {"config": yaml.safe_load(dump_run(trained)), "model_spec": trained.model.spec(),
             "epoch": 3, "step": 0}  # fmt: skip
    longer = resume_config(state, ["train.epochs=5"])
    assert longer._notes == [
        "train.epochs=5: the cosine schedule spans 5 epochs, not 3: the learning rate after "
        "epoch 3 is 0.0173, not 0, and anneals to train.min_lr again (a new run from its "
        "weights, model.weights=RUN/last.pt, has a schedule of its own)"]  # fmt: skip
    assert resume_config(state, ["train.epochs=3"])._notes == []
    stepped = {**state, "config": {**state["config"], "train": {
        **state["config"]["train"], "schedule": "step"}}}  # fmt: skip
    assert resume_config(stepped, ["train.epochs=5"])._notes == []  # (epochs move no step)
    midway = {**state, "epoch": 1, "step": 5}  # refused by the epochs-left check: no note
    assert resume_config(midway, ["train.epochs=1"])._notes == []  # before its error line
    assert resume_config(state, ["train.epochs=2"])._notes == []
    assert resume_config(midway, ["train.epochs=2"])._notes != []  # (it finishes epoch 2)


def test_a_section_given_as_a_mapping_on_the_command_line_sets_those_settings():
    """`train={lr: 0.2}` replaced the zoo run's whole train section: its 25 epochs, cosine
    schedule and warm-up went back to the defaults without a word. It sets those settings, as
    OmegaConf merges; a data section of another source is that source's whole."""
    base = load_run("digits")
    merged = load_run("digits", ["train={lr: 0.2, epochs: 3}"])
    assert (merged.train.lr, merged.train.epochs) == (0.2, 3)
    assert (merged.train.schedule, merged.train.warmup_epochs) == (
        base.train.schedule, base.train.warmup_epochs) == ("cosine", 1.0)  # fmt: skip
    data = load_run("digits", ["data={batch_size: 32}"]).data
    assert (data.batch_size, data.shift, data.rotate) == (32, base.data.shift, base.data.rotate)
    other = load_run("digits", ["data={source: synthetic, num_classes: 3}"]).data
    assert other.source == "synthetic"  # (digits' shift and rotate left behind)


def test_command_line_paths_are_the_working_directorys_and_zoo_names_the_zoos(
    tmp_path, monkeypatch
):
    """model=../nets/n.yaml from another folder took the file of that name beside the run file
    (the run file's own paths are beside it; the command line's in the working directory), and
    a file named `digitnet` (or `digits`) in the working directory took the zoo's place."""
    from cnnkit import build_model
    from cnnkit.zoo import net_path

    lenet = net_path("lenet5").read_text()
    for folder in ("nets", "proj/nets", "proj/runs", "other"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "nets" / "n.yaml").write_text(lenet)
    (tmp_path / "proj" / "nets" / "n.yaml").write_text(lenet)
    run = tmp_path / "proj" / "runs" / "r.yaml"
    run.write_text("model: ../nets/n.yaml\ndata: {source: synthetic, num_classes: 3}\n")
    monkeypatch.chdir(tmp_path / "other")
    assert load_run(str(run)).model.network == str(tmp_path / "proj" / "nets" / "n.yaml")
    given = load_run(str(run), ["model=../nets/n.yaml"]).model.network
    assert given == str(tmp_path / "nets" / "n.yaml")
    (tmp_path / "other" / "digitnet").write_text(lenet)  # a stray file of a zoo name
    (tmp_path / "other" / "digits").write_text("x: 1\n")
    assert load_run("digits").model.network == "digitnet"
    assert build_model("digitnet").input_shape == (1, 8, 8)  # the zoo's, not the file's
    assert build_model("./digitnet").input_shape == (1, 32, 32)  # the file, named as a path


@pytest.mark.parametrize("item", ["+train.lr=0.1", "++train.lr=0.1", "~train.lr"])
def test_hydras_add_and_delete_prefixes_are_answered(item):
    """`+train.lr=0.1` got the generic "expected key=value": it says what to write instead."""
    with pytest.raises(ConfigError, match=r"Hydra's \+ and ~ are not used here: train\.lr=VALUE"):
        load_run("digits", [item])
