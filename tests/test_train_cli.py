"""Bad input to `cnnkit train` / `cnnkit eval`: one clear line, non-zero exit, no traceback, and
nothing in an existing run directory overwritten."""

from __future__ import annotations

import pytest

from cnnkit.cli import main


def _fails(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return done.value.code, err


@pytest.mark.parametrize(
    "argv, code, words",
    [
        (["train", "nosuchrun"], 2, "neither a zoo run"),
        (["train", "digits", "train.lr=-1"], 2, "train.lr"),
        (["train", "digits", "data.batch_size=0"], 2, "data.batch_size"),
        (["train", "digits", "train.optimizer=sgdd"], 2, "train.optimizer"),
        (["train", "digits", "train.lrr=0.1"], 2, "train.lrr: unknown field"),
        (["train", "digits", "data.source=nowhere"], 2, "data.source"),
        (["train", "digits", "train.device=gpu7"], 2, "train.device"),
        (["train", "digits", "lr"], 2, "key=value"),
        (["train", "--resume", "/no/such/run"], 1, "no such run directory"),
        (["train", "--resume", "/a/run", "--out", "/b"], 2, "--out /b cannot be given with it"),
        (["train", "digits", "--resume", "/a/run"], 2, "the run digits cannot be given with it"),
        (["train", "digits", "--nproc", "3", "--dry-run"], 2, "does not divide into 3"),
        (["eval", "/no/such/run"], 1, "no such checkpoint"),
    ],
)
def test_bad_input_is_one_clear_line(argv, code, words, capsys):
    got, err = _fails(argv, capsys)
    assert got == code and words in err and err.startswith("cnnkit: error:")


def test_failed_starts_overwrite_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    files = {"config.yaml": b"name: old\n", "last.pt": b"\x00truncated", "metrics.csv": b"epoch\n"}
    for name, content in files.items():
        (run / name).write_bytes(content)
    code, err = _fails(["train", "digits", "--out", str(run)], capsys)
    assert code == 2 and "already holds a run" in err
    code, err = _fails(["train", "--resume", str(run)], capsys)
    assert code == 1 and "last.pt" in err
    code, err = _fails(["train", "digits", "train.lr=-1", "--out", str(tmp_path / "new")], capsys)
    assert code == 2 and not (tmp_path / "new").exists()
    assert {p.name: p.read_bytes() for p in run.iterdir()} == files
