"""Hard-negative mining (bootstrapping) for a patch classifier: train, scan face-free pictures
with the detector, add its false positives as non-faces, train again; keep the round that does
best on a held-out measure (held-out faces scored above the strongest held-out clutter).

It needs both training and inference, so it sits above them; `cnnkit train` starts it for a
run whose data has `hard_negatives` rounds.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cnnkit.config import RunConfig
from cnnkit.data.bundled import FacesConfig, HardNegatives, face_free_picture
from cnnkit.errors import ConfigError
from cnnkit.infer.detect import detect, log_odds, mine_hard_negatives
from cnnkit.infer.load import Loaded, load_for_inference
from cnnkit.train.metrics import write_summary
from cnnkit.train.run import fit
from cnnkit.train.rundir import run_lock

CLUTTER_RANK = 1  # held-out faces must beat the strongest clutter window (a top-1 detection)


def mining_of(config: RunConfig) -> HardNegatives | None:
    """The run's hard-negative settings when it mines at least one round, else None."""
    if not isinstance(config.data, FacesConfig):
        return None
    hn = config.data.hard_negatives
    return hn if hn is not None and hn.rounds > 0 else None


def fit_rounds(
    config: RunConfig, run_dir: str | Path, quiet: bool = False, on_step: Any = None
) -> dict[str, Any]:
    """Train round 0 on the data, then `rounds` times: mine, add, retrain from the same seed.
    Each round is a run in run_dir/round-N; the best round's files are copied to run_dir
    (which is locked meanwhile, like any run directory)."""
    run_dir = Path(run_dir)
    with run_lock(run_dir):
        return _fit_rounds(config, run_dir, quiet, on_step)


def _fit_rounds(config: RunConfig, run_dir: Path, quiet: bool, on_step: Any) -> dict[str, Any]:
    started, hn = time.perf_counter(), mining_of(config)
    if hn is None:
        raise ConfigError("data.hard_negatives: no mining rounds in this run")
    pictures = [face_free_picture(name, hn.max_side) for name in hn.images]
    held_out = [face_free_picture(name, hn.max_side) for name in hn.held_out]
    faces = held_out_faces(config)
    rng, side = np.random.default_rng(config.seed), faces.shape[-1]
    negatives = np.concatenate(
        [np.zeros((0, side, side), np.uint8)]
        + [random_windows(p, hn.random_per_image, side, rng) for p in pictures]
    )
    rounds: list[dict[str, Any]] = []
    for r in range(hn.rounds + 1):
        mined = None
        if len(negatives):
            mined = str((run_dir / f"negatives-{r}.npy").resolve())
            np.save(mined, negatives)
        data = config.data.model_copy(update={"hard_negatives": None, "negatives": mined})
        round_dir = run_dir / f"round-{r}"
        summary = fit(config.model_copy(update={"data": data}), round_dir, quiet=quiet,
                      on_step=on_step)  # fmt: skip
        loaded = load_for_inference(round_dir)
        rounds.append(_round_row(r, summary, len(negatives), loaded, faces, held_out))
        if not quiet:
            print(_describe(rounds[-1]))
        if r < hn.rounds:
            if not quiet:
                print(f"round {r}: scanning {len(pictures)} face-free pictures for false "
                      "positives", flush=True)  # fmt: skip
            negatives = np.concatenate([negatives, _mine(loaded, pictures, hn, side)])
    return _keep_best(run_dir, rounds, time.perf_counter() - started, quiet)


def _mine(loaded: Loaded, pictures: list[np.ndarray], hn: HardNegatives, side: int) -> np.ndarray:
    """The detector's false positives on every picture, at most hn.per_image each."""
    mined = [mine_hard_negatives(loaded, [p], "face", hn.threshold, hn.per_image, hn.step)
             for p in pictures]  # fmt: skip
    return np.concatenate(
        [np.zeros((0, side, side), np.uint8)] + [m.reshape(-1, side, side) for m in mined]
    )


def random_windows(picture: np.ndarray, n: int, side: int, rng: np.random.Generator) -> np.ndarray:
    """n random square windows of a grey picture (sides from `side` to the picture's shorter
    one, log-uniform), each resized to side x side: uint8 (n, side, side)."""
    from PIL import Image

    h, w = picture.shape
    image, out = Image.fromarray(picture), np.zeros((n, side, side), np.uint8)
    for k in range(n):
        s = int(round(np.exp(rng.uniform(np.log(side), np.log(min(h, w))))))
        y, x = rng.integers(0, h - s + 1), rng.integers(0, w - s + 1)
        out[k] = np.asarray(image.crop((x, y, x + s, y + s)).resize((side, side), Image.BILINEAR))
    return out


def held_out_faces(config: RunConfig) -> np.ndarray:
    """The face patches of the run's held-out split, uint8 (N, H, W)."""
    _, _, images, labels, classes = config.data.split()
    return images[labels == classes.index("face")]


@torch.no_grad()
def held_out_measure(
    loaded: Loaded, faces: np.ndarray, pictures: list[np.ndarray]
) -> tuple[float, float]:
    """(share of held-out faces whose log-odds beat the CLUTTER_RANK-th strongest window on the
    held-out face-free pictures, that clutter level as a probability)."""
    logits = loaded.model(loaded.preprocess.normalize(torch.from_numpy(faces)[:, None])).float()
    k = loaded.classes.index("face")
    others = torch.cat([logits[:, :k], logits[:, k + 1 :]], 1)
    face_odds = logits[:, k] - others.logsumexp(1)
    scores = sorted((b.score for p in pictures for b in detect(loaded, p, threshold=0.01)),
                    reverse=True)  # fmt: skip
    clutter = scores[CLUTTER_RANK - 1] if len(scores) >= CLUTTER_RANK else 0.01
    return float((face_odds > log_odds(clutter)).float().mean()), clutter


def _round_row(r: int, summary: dict, negatives: int, loaded: Loaded, faces, held_out) -> dict:
    beat, clutter = held_out_measure(loaded, faces, held_out) if held_out else (0.0, 0.0)
    return {
        "round": r,
        "negatives": negatives,
        "val_top1": summary["best_val_top1"],
        "faces_over_clutter": round(beat, 4),
        "clutter_score": round(clutter, 4),
        "seconds": summary["wall_seconds"],
    }


def _describe(row: dict) -> str:
    return (
        f"round {row['round']}: {row['negatives']} mined negatives, best epoch's held-out top-1 "
        f"{row['val_top1']:.2%}, held-out faces over clutter {row['faces_over_clutter']:.0%} "
        f"(clutter {row['clutter_score']:.3f})"
    )


def _keep_best(run_dir: Path, rounds: list[dict], seconds: float, quiet: bool) -> dict[str, Any]:
    """Copy the best round's run files up into run_dir (held-out top-1 >= 95%, then the most
    held-out faces over the clutter, then the earliest); summary.json lists every round."""
    # ties go to the earlier round: fewer mined patches, a less conservative classifier
    best = max(rounds, key=lambda row: (row["val_top1"] >= 0.95, row["faces_over_clutter"],
                                        -row["round"]))  # fmt: skip
    source = run_dir / f"round-{best['round']}"
    for item in source.iterdir():
        if item.is_file():
            shutil.copy2(item, run_dir / item.name)
    summary = json.loads((source / "summary.json").read_text())
    summary.update(run_dir=str(run_dir), chosen_round=best["round"], rounds=rounds)
    summary["wall_seconds"] = round(seconds, 3)  # every round's training and mining
    write_summary(run_dir / "summary.json", summary)
    if not quiet:
        print(f"kept round {best['round']} ({seconds:.1f}s in all) -> {run_dir}")
    return summary
