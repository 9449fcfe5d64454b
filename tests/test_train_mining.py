"""Hard-negative mining run by the trainer: mined windows become non-face training patches and
cut the false positives on a face-free picture; face pictures are refused; balanced loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from cnnkit.config import load_run
from cnnkit.data import data_config
from cnnkit.data.bundled import face_free_picture
from cnnkit.errors import ConfigError
from cnnkit.infer.detect import detect
from cnnkit.infer.load import load_for_inference
from cnnkit.mining import fit_rounds
from cnnkit.nn import build_model
from cnnkit.train.engine import balanced_weights, build_engine

MINING = {"images": ["brick", "grass"], "held_out": ["gravel"], "rounds": 1, "per_image": 20,
          "threshold": 0.5, "max_side": 160}  # fmt: skip


def small_run(**mining) -> dict:
    return {"name": "faces", "model": "facenet", "seed": 0,
            "data": {"source": "faces", "batch_size": 16, "mirror": True,
                     "hard_negatives": {**MINING, **mining}},
            "train": {"epochs": 8, "optimizer": "nesterov", "lr": 0.02, "schedule": "cosine",
                      "class_weights": "balanced", "device": "cpu"}}  # fmt: skip


def test_mining_adds_non_faces_and_cuts_false_positives(tmp_path):
    summary = fit_rounds(load_run(small_run()), tmp_path / "run", quiet=True)
    first, second = summary["rounds"]
    assert first["negatives"] == 0 and second["negatives"] > 0
    mined = np.load(tmp_path / "run" / "negatives-1.npy")
    assert mined.dtype == np.uint8 and mined.shape == (second["negatives"], 25, 25)
    config = yaml.safe_load((tmp_path / "run" / "round-1" / "config.yaml").read_text())
    assert config["data"]["negatives"].endswith("negatives-1.npy")  # a plain run of its own
    brick = face_free_picture("brick", 160)
    hits = [len(detect(load_for_inference(tmp_path / "run" / f"round-{r}"), brick, threshold=0.5))
            for r in (0, 1)]  # fmt: skip
    assert hits[0] > 0 and hits[1] < hits[0], hits
    assert summary["chosen_round"] in (0, 1) and (tmp_path / "run" / "best.pt").is_file()
    assert summary["rounds"][1]["seconds"] > 0 and summary["val_images"] == 50


def test_negatives_file_adds_non_face_training_patches(tmp_path):
    patches = np.full((10, 25, 25), 7, np.uint8)
    np.save(tmp_path / "neg.npy", patches)
    plain = data_config({"source": "faces"}).build(torch.device("cpu"))
    more = data_config({"source": "faces", "negatives": str(tmp_path / "neg.npy")})
    bundle = more.build(torch.device("cpu"))
    assert len(bundle.train.labels) == len(plain.train.labels) + 10
    assert (bundle.train.labels == 0).sum() == (plain.train.labels == 0).sum() + 10
    assert bundle.val.num_samples == plain.val.num_samples == 50  # held-out split unchanged
    assert bundle.preprocess.mean == plain.preprocess.mean  # statistics of the LFW patches


@pytest.mark.parametrize("name", ["astronaut", "camera", "coins"])
def test_pictures_with_faces_are_refused(name):
    with pytest.raises(ConfigError, match="not a face-free picture"):
        data_config({"source": "faces", "hard_negatives": {"images": [name]}})


def test_balanced_loss_equals_weighted_cross_entropy():
    labels = torch.tensor([0] * 30 + [1] * 10)
    cfg = load_run(small_run()).train
    engine = build_engine(build_model("facenet"), cfg, torch.device("cpu"),
                          class_weights=balanced_weights(labels, 2))  # fmt: skip
    logits, y = torch.randn(8, 2), torch.tensor([0, 1, 1, 0, 0, 1, 0, 0])
    weight = torch.tensor([40 / (2 * 30), 40 / (2 * 10)])
    expected = torch.nn.functional.cross_entropy(logits, y, weight=weight)
    torch.testing.assert_close(engine.loss_fn(logits, y), expected)
