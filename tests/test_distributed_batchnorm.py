"""BatchNorm in a group, checked in one process: SyncBatchNorm conversion keeps the network's
maths (and is refused on CPUs), and a weighted-0 step on an all-unreadable batch leaves
the running statistics alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import DDP_RUN as BASE

from cnnkit.config import TrainConfig, validate_run
from cnnkit.nn import build_model
from cnnkit.train.engine import build_engine
from cnnkit.train.run import fit


def test_sync_batchnorm_conversion_keeps_the_network_running_its_layers():
    from cnnkit.distributed import convert_sync_batchnorm

    torch.manual_seed(0)
    network = build_model("digitnet")
    x = torch.randn(8, 1, 8, 8)
    torch.manual_seed(1)  # the same dropout mask for both forwards
    expected = network(x)
    convert_sync_batchnorm(network)
    kinds = {type(m).__name__ for m in network.modules()}
    assert "SyncBatchNorm" in kinds and "BatchNorm2d" not in kinds
    ran = []
    network.bn1.register_forward_hook(lambda *_: ran.append(True))
    torch.manual_seed(1)
    torch.testing.assert_close(network(x), expected)  # no process group: plain batch norm maths
    assert ran  # the converted layer is the one that runs


def test_sync_batchnorm_on_cpus_is_one_line(capsys):
    """Several CPU processes are refused; one process keeps ordinary batch norms, said."""
    from cnnkit.distributed import Local
    from cnnkit.errors import ConfigError
    from cnnkit.train.checks import check_processes

    class TwoOnCpus(Local):  # the check comes before any collective
        world_size = 2

    config = validate_run({**BASE, "train": {**BASE["train"], "sync_bn": True}})
    with pytest.raises(ConfigError, match="sync_bn: SyncBatchNorm runs on CUDA devices only"):
        fit(config, Path("/nonexistent/never-written"), quiet=True, dist=TwoOnCpus())
    capsys.readouterr()
    check_processes(config, 1, torch.device("cpu"), None, notes=False)  # (--nproc's own check)
    assert capsys.readouterr().err == ""
    check_processes(config, 1, torch.device("cpu"), None)
    assert capsys.readouterr().err == ("cnnkit: note: train.sync_bn: one process, so its batch "
        "norms stay ordinary ones (SyncBatchNorm shares statistics between processes: --nproc "
        "N)\n")  # fmt: skip


def test_a_step_on_an_all_unreadable_batch_leaves_batchnorms_statistics_alone():
    """Under sync: average a rank whose batch was all unreadable steps on blank stand-ins,
    weighted 0: their forward pass (training mode) must not move the running statistics of
    the network or of its moving average."""
    from cnnkit.distributed import Local
    from cnnkit.train.loop import Progress, train_one_epoch
    from cnnkit.train.metrics import Console
    from cnnkit.train.optim import Schedule

    class TwoRanks(Local):  # collectives as no-ops, world_size 2
        world_size = 2

        def agree(self, flags, every=1):  # the other rank: its loss finite, its batch read
            return [a or b for a, b in zip(flags, (False, True), strict=True)], every

    class OneEmpty:  # this rank's only batch: every image unreadable
        num_samples = 8

        def __len__(self):
            return 1

        def set_epoch(self, epoch, skip_batches=0):
            pass

        def __iter__(self):
            yield torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long)

    cfg = TrainConfig(sync="average", precision="fp32", channels_last=False, ema=0.9, epochs=1)
    engine = build_engine(build_model("digitnet"), cfg, torch.device("cpu"))
    before = {k: v.clone() for k, v in engine.network.named_buffers()}
    ema_before = {k: v.clone() for k, v in engine.ema.module.named_buffers()}
    train_one_epoch(engine, OneEmpty(), Schedule(cfg), Progress(), Console(True),
                    lambda *a: None, TwoRanks())  # fmt: skip
    for name, value in engine.network.named_buffers():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)
    for name, value in engine.ema.module.named_buffers():
        torch.testing.assert_close(value, ema_before[name], rtol=0, atol=0, msg=name)
