"""Hard-negative mining (bootstrapping) for a patch classifier: train, scan face-free pictures
with the detector, add its false positives as non-faces, train again; keep the round that does
best on a held-out measure (held-out faces scored above the strongest held-out clutter).

It needs both training and inference, so it sits above them; `cnnkit train` starts it for a
run whose data has `hard_negatives` rounds, and `cnnkit train --resume` continues it.
"""

from __future__ import annotations

import io
import json
import math
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cnnkit.config import RunConfig, dump_run, load_run
from cnnkit.data.bundled import FacesConfig, HardNegatives, face_free_picture
from cnnkit.errors import CheckpointError, CnnkitError, ConfigError, Interrupted
from cnnkit.infer.detect import MIN_FACE, detect, log_odds, mine_hard_negatives
from cnnkit.infer.load import Loaded, load_for_inference
from cnnkit.runtime import atomic, write_atomic
from cnnkit.train.metrics import write_summary
from cnnkit.train.run import fit, resume_state
from cnnkit.train.rundir import clear_orphans, resume_config, run_lock

CLUTTER_RANK = 1  # held-out faces must beat the strongest clutter window (a top-1 detection)
ROUNDS = "rounds.json"  # the rows of the rounds finished so far: a resume does not redo them
TEMPORARY = re.compile(r"\.(rounds\.json|negatives-\d+\.npy)\.tmp")  # killed writes of ours


def mining_of(config: RunConfig) -> HardNegatives | None:
    """The run's hard-negative settings when it mines at least one round, else None."""
    if not isinstance(config.data, FacesConfig):
        return None
    hn = config.data.hard_negatives
    return hn if hn is not None and hn.rounds > 0 else None


def mining_run(run_dir: str | Path) -> bool:
    """Whether run_dir holds a mining run (its config.yaml, written when the mining starts,
    mines hard negatives)."""
    path = Path(run_dir) / "config.yaml"
    try:
        return path.is_file() and mining_of(load_run(path)) is not None
    except (CnnkitError, OSError):  # not a run's config: the resume itself will say so
        return False


def check_not_a_round(run_dir: str | Path) -> None:
    """A round of a mining run is resumed with its mining run, never alone (the mining would
    not go on, and a finished round would change under the rounds after it)."""
    run_dir = Path(run_dir)
    if re.fullmatch(r"round-\d+", run_dir.name) and mining_run(run_dir.parent):
        raise ConfigError(f"--resume {run_dir}: a round of the mining run {run_dir.parent}: "
                          f"resume that (`cnnkit train --resume {run_dir.parent}`)")  # fmt: skip


def fit_rounds(
    config: RunConfig, run_dir: str | Path, quiet: bool = False, on_step: Any = None,
    callbacks: Sequence[Any] = (),
) -> dict[str, Any]:  # fmt: skip
    """Train round 0 on the data, then `rounds` times: mine, add, retrain from the same seed.
    Each round is a run in run_dir/round-N (on_step and callbacks reach each round's training);
    the best round's files are copied to run_dir (which is locked meanwhile, like any run
    directory). A Ctrl-C says how to go on: `resume_rounds`."""
    run_dir = Path(run_dir)
    if mining_of(config) is None:
        raise ConfigError("data.hard_negatives: no mining rounds in this run")
    rounds = Rounds(config, run_dir, quiet, on_step, callbacks, resumed=False)  # (checks first)
    with run_lock(run_dir):
        _open(run_dir, config)
        return rounds.run([], 0.0)


def resume_rounds(
    run_dir: str | Path, overrides: list[str] | None = None, quiet: bool = False,
    on_step: Any = None, callbacks: Sequence[Any] = (),
) -> dict[str, Any]:  # fmt: skip
    """Continue the mining run in run_dir where it stopped: finished rounds are read back (their
    rows and the negatives they trained on), the interrupted round resumes from its last.pt
    (overrides applied as a normal resume applies them), later rounds run, the best is kept."""
    run_dir = Path(run_dir)
    with run_lock(run_dir):
        config = _resumed_config(run_dir, overrides)
        rows, seconds = read_rounds(run_dir)
        done = _finished(run_dir, rows, mining_of(config).rounds)
        if done is not None:  # its last line, quiet or not (as a finished run's `done:`)
            print(f"{run_dir}: all {len(rows)} mining rounds done, round "
                  f"{done['chosen_round']} kept (data.hard_negatives.rounds=N for more)")  # fmt: skip
            return done
        rounds = Rounds(config, run_dir, quiet, on_step, callbacks, resumed=True,
                        overrides=overrides or [])  # fmt: skip
        _open(run_dir, config)
        return rounds.run(rows, seconds)


def describe_resume(run_dir: str | Path, overrides: list[str] | None, quiet: bool) -> dict:
    """A dry run of resume_rounds: where the mining would continue; nothing written."""
    run_dir = Path(run_dir)
    config = _resumed_config(run_dir, overrides)
    rows, _ = read_rounds(run_dir)
    last = mining_of(config).rounds
    resumes = (run_dir / f"round-{len(rows)}" / "last.pt").is_file()
    how = "resumes from its last.pt" if resumes else "starts"
    what = (f"round {len(rows)} {how}, rounds up to {last} follow" if len(rows) <= last
            else "nothing left to train")  # fmt: skip
    if not quiet:
        print(f"dry run of resuming the mining run {run_dir}: {len(rows)} of {last + 1} rounds "
              f"done, {what} (nothing written)")  # fmt: skip
    return {"dry_run": True, "name": config.name, "run_dir": str(run_dir),
            "rounds_done": len(rows), "resumes_round": resumes}  # fmt: skip


def _resumed_config(run_dir: Path, overrides: list[str] | None) -> RunConfig:
    config = load_run(run_dir / "config.yaml", overrides)
    if mining_of(config) is None:
        raise ConfigError(f"--resume {run_dir}: a mining run resumes with its mining rounds "
                          "(data.hard_negatives.rounds of 1 or more)")  # fmt: skip
    return config


def _open(run_dir: Path, config: RunConfig) -> None:
    """With the lock held: remove killed writes, save the mining run's config (what a resume
    reads; the rounds' own configs lie in their folders)."""
    clear_orphans(run_dir)
    for tmp in run_dir.glob(".*.tmp"):
        if TEMPORARY.fullmatch(tmp.name):
            tmp.unlink(missing_ok=True)
    write_atomic(run_dir / "config.yaml", dump_run(config).encode())


def read_rounds(run_dir: Path) -> tuple[list[dict[str, Any]], float]:
    """The rows of the rounds run_dir has finished, and the seconds the mining took so far."""
    path = run_dir / ROUNDS
    if not path.is_file():
        return [], 0.0
    try:
        found = json.loads(path.read_text())
        return list(found["rounds"]), float(found["seconds"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: damaged ({e})") from None


def _finished(run_dir: Path, rows: list[dict], rounds: int) -> dict[str, Any] | None:
    """The summary of a mining run that finished every round and kept one, else None."""
    path = run_dir / "summary.json"
    if len(rows) < rounds + 1 or not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except ValueError:  # damaged (a kill while it was copied): keeping the best writes it again
        return None
    return summary if isinstance(summary, dict) and summary.get("rounds") == rows else None


class Rounds:
    """The rounds of one mining run: the negatives each trains on, its training, its row."""

    def __init__(self, config: RunConfig, run_dir: Path, quiet: bool, on_step: Any,
                 callbacks: Sequence[Any], resumed: bool,
                 overrides: Sequence[str] = ()) -> None:  # fmt: skip
        self.config, self.run_dir, self.quiet = config, run_dir, quiet
        self.resumed = resumed  # read back what a round saved; a new run starts afresh
        self.on_step, self.callbacks = on_step, callbacks
        self.hn = mining_of(config)
        # a round resumed from its last.pt takes the overrides that concern its training
        self.overrides = [o for o in overrides
                          if not o.split("=", 1)[0].startswith("data.hard_negatives")]  # fmt: skip
        self.pictures = [face_free_picture(name, self.hn.max_side) for name in self.hn.images]
        self.held_out = [face_free_picture(name, self.hn.max_side) for name in self.hn.held_out]
        self.faces = held_out_faces(config)
        self.side = self.faces.shape[-1]
        self._check_pictures()

    def _check_pictures(self) -> None:
        """ConfigError, before any round, for a picture shrunk under the smallest face searched
        on it: one window for the mined pictures (mining scans, and cuts random windows, from
        one), MIN_FACE windows for the held-out ones (the measure detects as `detect` does)."""
        for names, pictures, smallest, what in (
            (self.hn.images, self.pictures, self.side, "mined"),
            (self.hn.held_out, self.held_out, round(MIN_FACE * self.side), "held-out"),
        ):
            for name, picture in zip(names, pictures, strict=True):
                if min(picture.shape) < smallest:
                    h, w = picture.shape
                    raise ConfigError(f"data.hard_negatives.max_side: {self.hn.max_side} shrinks "
                                      f"the {what} picture {name} to {w}x{h}, under the smallest "
                                      f"face searched on it ({smallest} px); give "
                                      f"{_max_side_for(name, smallest)} or more")  # fmt: skip

    def run(self, rows: list[dict[str, Any]], seconds_before: float) -> dict[str, Any]:
        """Every round not in rows, then keep the best of all."""
        started, loaded = time.perf_counter(), None
        for r in range(len(rows), self.hn.rounds + 1):
            try:
                negatives = self.negatives(r, rows, loaded)
                summary = self.train(r, negatives)
                loaded = load_for_inference(self.run_dir / f"round-{r}")
                rows.append(_round_row(r, summary, len(negatives), loaded, self.faces,
                                       self.held_out))  # fmt: skip
            except Interrupted as e:  # a round's Ctrl-C: the mining run is what resumes
                self._write_rounds(rows, seconds_before, started)  # its time so far counts
                where = str(e).partition("; resume with")[0]
                raise Interrupted(f"round {r}: {where}; {self.resume_hint()}") from None
            except KeyboardInterrupt:  # while mining or measuring (or a second Ctrl-C)
                self._write_rounds(rows, seconds_before, started)
                raise Interrupted(f"interrupted in round {r}; {self.resume_hint()}") from None
            self._write_rounds(rows, seconds_before, started)
            if not self.quiet:
                print(_describe(rows[-1]))
        seconds = seconds_before + time.perf_counter() - started
        return _keep_best(self.run_dir, rows, seconds)

    def _write_rounds(self, rows: list[dict[str, Any]], before: float, started: float) -> None:
        """rounds.json: the rounds finished, the seconds so far (an interrupted round's too)."""
        seconds = before + time.perf_counter() - started
        write_atomic(
            self.run_dir / ROUNDS, json.dumps({"rounds": rows, "seconds": seconds}).encode()
        )

    def resume_hint(self) -> str:
        return f"resume with `cnnkit train --resume {self.run_dir}`"

    def negatives(self, r: int, rows: list[dict], loaded: Loaded | None) -> np.ndarray:
        """Round r's non-face patches: random windows for round 0, then round r-1's negatives
        plus its detector's false positives (read back when saved: it is what round r trained
        on), uint8 (N, side, side)."""
        path = self.run_dir / f"negatives-{r}.npy"
        if self.resumed and path.is_file():
            return _read_negatives(path, None, self.side)
        if r == 0:
            rng = np.random.default_rng(self.config.seed)
            parts = [random_windows(p, self.hn.random_per_image, self.side, rng)
                     for p in self.pictures]  # fmt: skip
        else:
            if not self.quiet:
                print(f"round {r - 1}: scanning {len(self.pictures)} face-free pictures for false "
                      "positives", flush=True)  # fmt: skip
            loaded = loaded or load_for_inference(self.run_dir / f"round-{r - 1}")
            before = self.run_dir / f"negatives-{r - 1}.npy"
            parts = [_read_negatives(before, rows[r - 1]["negatives"], self.side),
                     _mine(loaded, self.pictures, self.hn, self.side)]  # fmt: skip
        negatives = np.concatenate([np.zeros((0, self.side, self.side), np.uint8), *parts])
        if len(negatives):
            buffer = io.BytesIO()
            np.save(buffer, negatives)
            write_atomic(path, buffer.getvalue())
        return negatives

    def train(self, r: int, negatives: np.ndarray) -> dict[str, Any]:
        """Round r's training run (resumed exactly from its last.pt where it has one)."""
        round_dir = self.run_dir / f"round-{r}"
        saved = self.resumed and (round_dir / "last.pt").exists()
        state = resume_state(round_dir) if saved else None
        if state is not None:
            config = resume_config(state, self.overrides)
        else:
            mined = str((self.run_dir / f"negatives-{r}.npy").resolve()) if len(negatives) else None
            data = self.config.data.model_copy(update={"hard_negatives": None, "negatives": mined})
            config = self.config.model_copy(update={"data": data})
        return fit(config, round_dir, resume=state, quiet=self.quiet, on_step=self.on_step,
                   callbacks=self.callbacks, last_line=not self.quiet)  # fmt: skip


def _read_negatives(path: Path, count: int | None, side: int) -> np.ndarray:
    """A saved negatives file (none for a round with no negatives); `count`: how many the
    round that trained on it recorded."""
    if count == 0:
        return np.zeros((0, side, side), np.uint8)
    try:
        found = np.load(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{path}: cannot read the negatives a round trained on ({e})"
        ) from None
    if count is not None and len(found) != count:
        raise CheckpointError(f"{path}: {len(found)} negatives, but its round trained on {count}")
    return found


def _mine(loaded: Loaded, pictures: list[np.ndarray], hn: HardNegatives, side: int) -> np.ndarray:
    """The detector's false positives on every picture, at most hn.per_image each."""
    mined = [mine_hard_negatives(loaded, [p], "face", hn.threshold, hn.per_image, hn.step)
             for p in pictures]  # fmt: skip
    return np.concatenate(
        [np.zeros((0, side, side), np.uint8)] + [m.reshape(-1, side, side) for m in mined]
    )


def _max_side_for(name: str, smallest: int) -> int:
    """The least max_side that keeps the picture's shorter side at `smallest` pixels or more."""
    h, w = face_free_picture(name, 1 << 20).shape  # (as loaded: no picture is that large)

    def keeps(side: int) -> bool:  # (the shrink rounds: try it, near the estimate)
        return min(face_free_picture(name, side).shape) >= smallest

    side = math.ceil(smallest * max(h, w) / min(h, w))
    while side > smallest and keeps(side - 1):
        side -= 1
    while not keeps(side):
        side += 1
    return side


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
    top1 = row["val_top1"]  # None: a callback stopped the round before its first epoch ended
    held_out = "no epoch trained" if top1 is None else f"best epoch's held-out top-1 {top1:.2%}"
    return (
        f"round {row['round']}: {row['negatives']} mined negatives, {held_out}, held-out faces "
        f"over clutter {row['faces_over_clutter']:.0%} (clutter {row['clutter_score']:.3f})"
    )


def _events(path: Path) -> bool:
    """A TensorBoard events file: left in its round's folder (a copy beside the rounds made
    `tensorboard --logdir RUN` show the kept round twice)."""
    return path.name.startswith("events.out.tfevents.")


def _keep_best(run_dir: Path, rounds: list[dict], seconds: float) -> dict[str, Any]:
    """Copy the best round's run files up into run_dir (an epoch trained, held-out top-1 >= 95%,
    then the most held-out faces over the clutter, then the earliest; not its config.yaml:
    run_dir's is the mining run's); summary.json lists every round."""
    # ties go to the earlier round: fewer mined patches, a less conservative classifier
    best = max(rounds, key=lambda row: (row["val_top1"] is not None,
                                        (row["val_top1"] or 0.0) >= 0.95,
                                        row["faces_over_clutter"], -row["round"]))  # fmt: skip
    source = run_dir / f"round-{best['round']}"
    try:
        summary = json.loads((source / "summary.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{source / 'summary.json'}: damaged or missing ({e})") from None
    for item in source.iterdir():  # each file whole or not at all (a kill mid-copy: a resume
        if item.is_file() and item.name != "config.yaml" and not _events(item):  # copies it
            with open(item, "rb") as f, atomic(run_dir / item.name) as out:  # again)
                shutil.copyfileobj(f, out)
            shutil.copystat(item, run_dir / item.name)
    kept = {item.name for item in source.iterdir() if not _events(item)}
    for other in run_dir.glob("round-*/*"):  # what an earlier kept round put there (its
        if other.name not in kept and (run_dir / other.name).is_file():  # best_ema.pt, or an
            (run_dir / other.name).unlink()  # older cnnkit's TensorBoard copy): one round's
    summary.update(run_dir=str(Path(run_dir).absolute()), chosen_round=best["round"], rounds=rounds)
    summary["wall_seconds"] = round(seconds, 3)  # every round's training and mining
    write_summary(run_dir / "summary.json", summary)
    print(f"kept round {best['round']} ({seconds:.1f}s in all) -> {run_dir}")  # quiet or not
    return summary
