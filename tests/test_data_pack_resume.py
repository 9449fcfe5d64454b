"""`cnnkit pack` stopped part-way (Ctrl-C, a full disk, a dying worker, a removed shards
folder): one line, no half-written file, and the same command resumes where it stopped."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from data_images import all_images, within
from helpers import interrupt_pack_after, run_cli, sigint_default

from cnnkit.data.pack import pack_folder
from cnnkit.data.packed import PackedImages
from cnnkit.data.synth import synth_shapes
from cnnkit.errors import DataError, Interrupted


def test_pack_resumes_after_an_interrupt(shapes, tmp_path, monkeypatch):
    import cnnkit.data.pack as pack

    calls, real = interrupt_pack_after(monkeypatch, 2)
    with pytest.raises(Interrupted, match=r"pack interrupted: 2 shards done in .*resumes"):
        pack_folder(shapes, tmp_path / "p", size=16, workers=1, shard_size=4, progress=False)
    assert not (tmp_path / "p/meta.json").exists()
    with pytest.raises(DataError, match="interrupted"):
        PackedImages(tmp_path / "p")
    monkeypatch.setattr(pack, "pack_shard", lambda job: (calls.append(job.shard), real(job))[1])
    s = pack_folder(shapes, tmp_path / "p", size=16, workers=1, progress=False)
    assert calls == [0, 1, 2, 3] and s.resumed_shards == 2 and s.images == 15
    pack_folder(shapes, tmp_path / "fresh", size=16, workers=1, shard_size=4, progress=False)
    torch.testing.assert_close(all_images(tmp_path / "p"), all_images(tmp_path / "fresh"))
    with pytest.raises(DataError, match=r"different pack \(--size 12 here, 16 there\); use"):
        pack_folder(shapes, tmp_path / "p", size=12, progress=False)
    with pytest.raises(DataError, match=r"--resize shorter-side-crop here, squash there; --format"):
        pack_folder(
            shapes, tmp_path / "p", size=16, resize="shorter", format="jpeg", progress=False
        )


def test_a_second_pack_into_a_dst_being_packed_is_refused(shapes, tmp_path, monkeypatch):
    """Two packs into one DST wrote the same shards and removed each other's .tmp files; now
    the second is one line, and leaves the first's files alone; once the first has ended, the
    same command resumes."""
    from cnnkit.data.pack_dst import DstLock

    calls, _ = interrupt_pack_after(monkeypatch, 1)
    with pytest.raises(Interrupted):
        pack_folder(shapes, tmp_path / "p", size=16, workers=1, shard_size=4, progress=False)
    monkeypatch.undo()
    writing = tmp_path / "p/shards/00001.u8.tmp"  # the first pack's shard in progress
    writing.write_bytes(b"partial")
    first = DstLock(tmp_path / "p")
    first.take()
    try:
        with pytest.raises(DataError, match=r"p: another cnnkit pack is writing it; when that "
                           r"one has ended, the same command resumes"):  # fmt: skip
            pack_folder(shapes, tmp_path / "p", size=16, workers=1, progress=False)
        assert writing.read_bytes() == b"partial" and not (tmp_path / "p/meta.json").exists()
    finally:
        first.release()
    s = pack_folder(shapes, tmp_path / "p", size=16, workers=1, progress=False)
    assert s.resumed_shards == 1 and s.images == 15 and not writing.exists()


def test_a_pack_into_a_new_dst_another_pack_took_during_its_scan(shapes, tmp_path, monkeypatch):
    """Two packs into one new DST both scan; the first to hold DST writes its plan. The other
    overwrote that plan (another --size: the finished pack's meta said 16 and its plan 32) and
    its Ctrl-C during the scan removed the first's .tmp files; now it leaves both alone: busy
    while the first runs, and after it, a plan to resume or refuse as any pack's."""
    import cnnkit.data.pack as pack
    from cnnkit.data.pack_dst import DstLock

    pack_folder(shapes, tmp_path / "a", size=16, workers=1, shard_size=4, progress=False)
    theirs = (tmp_path / "a/plan.json").read_text()
    dst, real, first = tmp_path / "p", pack.scan_images, DstLock(tmp_path / "p")

    def scan_while_another_packs(*args, interrupt=False, **kwargs):
        (dst / "shards").mkdir(parents=True, exist_ok=True)  # the first pack, meanwhile
        (dst / "plan.json").write_text(theirs)
        (dst / "shards/00000.u8.tmp").write_bytes(b"theirs")
        first.take()
        if interrupt:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(pack, "scan_images", scan_while_another_packs)
    with pytest.raises(DataError, match="another cnnkit pack is writing it"):
        pack_folder(shapes, dst, size=32, workers=1, progress=False)
    assert (dst / "plan.json").read_text() == theirs and (dst / "shards/00000.u8.tmp").exists()
    first.release()
    shutil.rmtree(dst)
    monkeypatch.setattr(pack, "scan_images", lambda *a, **k: scan_while_another_packs(
        *a, interrupt=True, **k))  # fmt: skip
    with pytest.raises(Interrupted, match="before its first shard: nothing was packed"):
        pack_folder(shapes, dst, size=32, workers=1, progress=False)
    assert (dst / "plan.json").read_text() == theirs and (dst / "shards/00000.u8.tmp").exists()
    first.release()
    monkeypatch.setattr(pack, "scan_images", real)
    with pytest.raises(DataError, match=r"holds a different pack \(--size 32 here, 16 there\)"):
        pack_folder(shapes, dst, size=32, workers=1, progress=False)


def test_a_pack_resumes_where_its_shards_folder_was_removed(shapes, tmp_path, monkeypatch):
    import cnnkit.data.pack as pack

    used, real = [], pack._run_jobs
    monkeypatch.setattr(pack, "available_cores", lambda: 1)  # the default: this process's cores
    monkeypatch.setattr(pack, "_run_jobs", lambda todo, n, *a: (used.append(n), real(todo, n, *a)))
    pack_folder(shapes, tmp_path / "p", size=16, shard_size=4, progress=False)
    assert used == [1]
    monkeypatch.undo()
    shutil.rmtree(tmp_path / "p/shards")  # the plan stays: a resume must make the folder again
    (tmp_path / "p/meta.json").unlink()
    s = pack_folder(shapes, tmp_path / "p", size=16, workers=1, progress=False)
    assert s.images == 15 and len(all_images(tmp_path / "p")[1]) == 15


def _fails_on_third_shard(monkeypatch):
    import cnnkit.data.pack_shard as shard

    real, calls = shard._write_records, []

    def disk_fills(job, out):
        calls.append(job.shard)
        if len(calls) == 3:
            out.write(b"\0" * 1000)  # a partial shard, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(job, out)

    monkeypatch.setattr(shard, "_write_records", disk_fills)


def test_a_full_disk_is_one_line_and_the_pack_resumes(shapes, tmp_path, monkeypatch, capsys):
    import cnnkit.data.pack as pack

    _fails_on_third_shard(monkeypatch)
    argv = ["pack", str(shapes), str(tmp_path / "p"), "--size", "16", "-j", "1"]
    monkeypatch.setattr(pack, "_jobs", _small_shards(pack._jobs))
    code, out, err = run_cli(argv, capsys)
    (line,) = err.splitlines()
    assert code == 1 and "the disk is full" in line and str(tmp_path / "p") in line, line
    assert "00002.u8" in line and "resumes" in line
    shards = sorted(p.name for p in (tmp_path / "p/shards").iterdir())
    assert shards == ["00000.npz", "00000.u8", "00001.npz", "00001.u8"]  # no .tmp, no part
    assert not (tmp_path / "p/meta.json").exists()
    monkeypatch.undo()
    monkeypatch.setattr(pack, "_jobs", _small_shards(pack._jobs))
    code, out, err = run_cli(argv, capsys)
    assert code == 0 and "(2 resumed)" in out
    pack_folder(shapes, tmp_path / "fresh", size=16, workers=1, shard_size=4, progress=False)
    torch.testing.assert_close(all_images(tmp_path / "p"), all_images(tmp_path / "fresh"))


def _small_shards(jobs):
    """The CLI's pack with 4 images per shard (the CLI has no option for it)."""

    def planned(plan, src, dst):
        return jobs({**plan, "shard_size": 4}, src, dst)

    return planned


def test_a_full_disk_while_finishing_leaves_no_meta(shapes, tmp_path, monkeypatch):
    import cnnkit.data.pack_shard as shard

    real = shard.atomic

    @contextmanager
    def full(path):
        with real(path) as f:
            if path.name == "meta.json":
                f.write(b'{"format": ')  # half a meta.json, then the disk is full
                raise OSError(errno.ENOSPC, "No space left on device")
            yield f

    monkeypatch.setattr(shard, "atomic", full)
    with pytest.raises(DataError, match="disk is full.*meta.json"):
        pack_folder(shapes, tmp_path / "p", size=16, workers=1, progress=False)
    assert not (tmp_path / "p/meta.json").exists() and not list((tmp_path / "p").glob("*.tmp"))
    monkeypatch.undo()
    s = pack_folder(shapes, tmp_path / "p", size=16, workers=1, progress=False)
    assert s.images == 15 and s.resumed_shards == s.shards


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs (root only; skipped where mounting is not allowed)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(disk)],
                          capture_output=True)  # fmt: skip
    if done.returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_real_full_disk_with_worker_processes(small_disk, tmp_path, capsys):
    synth_shapes(tmp_path / "src", classes=3, per_class=30, size=40)  # 90 x 27 kB raw at 96 px:
    # 6 shards of 16 images (442 kB each), 4 fit
    argv = ["pack", str(tmp_path / "src"), str(small_disk / "p"), "--size", "96", "-j", "2"]
    with within(60):
        code, out, err = run_cli(argv, capsys)
    (line,) = err.splitlines()
    assert code == 1 and "the disk is full" in line and "Traceback" not in err, err
    assert not (small_disk / "p/meta.json").exists()
    assert not [p for p in (small_disk / "p").rglob("*.tmp")]
    done = {p.stem for p in (small_disk / "p/shards").glob("*.npz")}
    subprocess.run(["mount", "-o", "remount,size=16M", str(small_disk)], check=True)
    with within(60):
        code, out, err = run_cli(argv, capsys)
    assert code == 0 and done and f"({len(done)} resumed)" in out, (out, err)
    assert json.loads((small_disk / "p/meta.json").read_text())["num_images"] == 90


def _pack_patched(
    tmp_path: Path,
    name: str,
    module: str,
    argv: list[str],
    first: str = "",
    shard_size: int | None = None,
) -> tuple[str, dict]:
    """A script that runs `cnnkit pack ARGV` with the shard writing patched by `module` (the
    module `name`, written to tmp_path: a forked worker inherits it, a fork server is told to
    import it), `first` its first line, `shard_size` the pack's; and the environment to run it
    in (tmp_path on the import path)."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(module))
    lines = [first,
             f"import cnnkit.data.pack as pack, {name}",
             "chosen = pack._pool_context",
             "def patched():",
             "    ctx = chosen()",
             "    if ctx.get_start_method() == 'forkserver':",
             f"        ctx.set_forkserver_preload([{name!r}, 'cnnkit.data.pack'])",
             "    return ctx",
             "pack._pool_context = patched",
             "real = pack.pack_folder",
             f"pack.pack_folder = lambda *a, **k: real(*a, **k, shard_size={shard_size})"
             if shard_size else "",
             "from cnnkit.cli import main",
             f"main(['pack', *{argv!r}])"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    return "\n".join(lines) + "\n", env


def test_ctrl_c_in_a_pack_with_workers_is_one_line_and_resumes(shapes, tmp_path):
    """SIGINT to the whole process group (a terminal's Ctrl-C): the workers ignore it, the
    main process says how far it got; the same command then finishes the pack."""
    import signal
    import time

    src = tmp_path / "src"
    for k in range(8):
        shutil.copytree(shapes, src / f"copy{k}", dirs_exist_ok=True)
    flat = tmp_path / "classes"
    for path in sorted(src.rglob("*.JPEG")):
        cls = path.parent.name
        (flat / cls).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, flat / cls / f"{path.parent.parent.name}-{path.name}")
    slow = """
        import cnnkit.data.pack_shard as shard, time
        real = shard._write_records
        def slow(job, out):  # two shards are written, the rest wait for the Ctrl-C
            time.sleep(0.3 if job.shard < 2 else 120)
            return real(job, out)
        shard._write_records = slow
    """
    script, env = _pack_patched(
        tmp_path,
        "slow_shards",
        slow,
        [str(flat), str(tmp_path / "p"), "--size", "16", "-j", "2"],
        # the stacks, should it hang
        first="import faulthandler, signal; faulthandler.register(signal.SIGUSR1, all_threads=True)",
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=sigint_default, env=env)  # fmt: skip
    deadline = time.monotonic() + 60
    while not list((tmp_path / "p").glob("shards/*.npz")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        err = proc.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:  # its signal masks and stacks, for the failure
        masks = []
        for status in sorted(Path(f"/proc/{proc.pid}/task").glob("*/status")):
            masks += [f"{status.parent.name} {line}" for line in status.read_text().splitlines()
                      if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]  # fmt: skip
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGKILL)
        err = proc.communicate()[1]
        pytest.fail("the pack did not stop at Ctrl-C:\n" + "\n".join(masks) + "\n" + err[-6000:])
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 130 and len(lines) == 1, err
    assert lines[0].startswith("cnnkit: pack interrupted: ") and "resumes" in lines[0]
    s = pack_folder(flat, tmp_path / "p", size=16, progress=False)
    assert s.images == 120 and 0 < s.resumed_shards < s.shards


def test_a_pack_worker_that_dies_is_one_line_not_a_hang(shapes, tmp_path):
    """A worker killed mid-shard (the OOM killer, a decoder's crash): the pool starts another,
    but the shard never comes back, and the pack waited for it forever; now one line, exit
    status 1, and the same command resumes."""
    dying = """
        import os, signal, cnnkit.data.pack_shard as shard
        real = shard._write_records
        def dying(job, out):  # shard 1's worker is killed; the others pack
            if job.shard == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(job, out)
        shard._write_records = dying
    """
    script, env = _pack_patched(  # 4 shards of 15 images
        tmp_path,
        "dying_shards",
        dying,
        [str(shapes), str(tmp_path / "p"), "--size", "16", "-j", "2"],
        shard_size=4,
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith("cnnkit: error: pack: a worker process died (killed by SIGKILL)")
    assert "the same command resumes from them" in lines[0]
    s = pack_folder(shapes, tmp_path / "p", size=16, shard_size=4, progress=False)
    assert s.images == 15 and 0 < s.resumed_shards < s.shards


def test_a_disk_that_fills_at_the_mean_image_says_so(small_disk, tmp_path, capsys):
    """numpy's own write of an array to a file raises an OSError with no errno on a full disk:
    the mean image is written as bytes, so the line says the disk is full."""
    synth_shapes(tmp_path / "src", classes=2, per_class=4, size=40)
    argv = ["pack", str(tmp_path / "src"), "DST", "--size", "128", "-j", "1"]
    pack_folder(tmp_path / "src", tmp_path / "sized", size=128, workers=1, progress=False)
    pages = lambda p: -(-p.stat().st_size // 4096) * 4096  # noqa: E731 (tmpfs: whole pages)
    before = sum(
        pages(p)
        for p in (tmp_path / "sized").rglob("*")
        if p.is_file() and p.name not in ("mean.npy", "files.txt", "bad_images.tsv", "meta.json")
    )
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    with open(small_disk / "filler", "wb") as f:  # room for all but half the mean image
        os.posix_fallocate(f.fileno(), 0, free - before - 8 * 4096 - (3 * 128 * 128 * 4) // 2)
    argv[2] = str(small_disk / "p")
    code, out, err = run_cli(argv, capsys)
    (line,) = err.splitlines()
    assert code == 1 and "the disk is full" in line and "mean.npy" in line, line
    assert not (small_disk / "p/meta.json").exists()
    (small_disk / "filler").unlink()
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
