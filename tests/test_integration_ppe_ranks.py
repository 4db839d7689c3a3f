"""aiosnap's ppe ``snapshot(saver_rank=...)`` in real torch.distributed jobs (gloo on
127.0.0.1, DDP): the job SIGKILLed right after a save call returned resumes through
autoload with every rank's losses bit for bit those of a run never killed; a save that
fails on the saver makes every rank raise; a saver that dies makes the others raise."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("pytorch_pfn_extras", reason="needs aiosnap[ppe]")

import pytorch_pfn_extras as ppe
import torch.distributed as dist

from aiosnap.integrations.ppe import Writer, snapshot
from tests.integration_runs import (
    RankJob,
    assert_aiosnap_checkpoint,
    assert_ranks_resumed_exactly,
    printed_losses,
    rank_loss,
    rank_report,
    report,
    run_torchrun_example,
    sum_in_rank_order,
    temp_entries,
)

ITERATIONS = 16
EVERY = 4


class _Reporting(Writer):
    """Reports each save call once it returned (the parent kills the job on that line);
    ``die_at``: the process kills itself inside that save call instead."""

    def __init__(self, out: str, die_at: str = "") -> None:
        super().__init__(out)
        self.die_at = die_at

    def __call__(self, filename: str, out_dir: str, target: Any, **kwargs: Any) -> None:
        if filename == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        super().__call__(filename, out_dir, target, **kwargs)
        report("saved", filename)


def ddp_child(out: str, saver_rank: str, die_at: str = "", fail_at: str = "") -> None:
    """A DDP run of ITERATIONS iterations, a snapshot every EVERY from ``saver_rank``,
    autoloading; each rank trains on its own batches. Reports what each rank raised.
    ``die_at``: the saver kills itself in that save; ``fail_at``: the saver's training
    step of that iteration raises (``snapshot_on_error`` is then on)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    model.register_comm_hook(None, sum_in_rank_order)  # bit-exact across a restart at 4 ranks
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = ppe.training.ExtensionsManager(
        model, optimizer, 1, iters_per_epoch=ITERATIONS, out_dir=out, extensions=[]
    )
    writer = _Reporting(out, die_at)
    manager.extend(
        snapshot(
            writer=writer,
            saver_rank=int(saver_rank),
            autoload=True,
            n_retains=2,
            timeout=60,
            snapshot_on_error=bool(fail_at),
        ),
        trigger=(EVERY, "iteration"),
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ITERATIONS, world, 8, 32, generator=g)
    try:
        rank_report("resumed", manager.iteration)
        while not manager.stop_trigger:
            with manager.run_iteration():
                if fail_at and manager.iteration + 1 == int(fail_at) and rank == int(saver_rank):
                    raise ValueError("a training step failed")
                batch = x[manager.iteration, rank]
                value = torch.nn.functional.mse_loss(model(batch), batch.sum(-1, keepdim=True))
                optimizer.zero_grad()
                value.backward()
                optimizer.step()
                rank_loss(manager.iteration + 1, value.item())
    except Exception as exc:
        rank_report("raised", type(exc).__name__, manager.iteration)
        sys.stderr.write(f"rank {rank} raised: {exc!r}\n")
    dist.destroy_process_group()


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_killed_ddp_job_resumes_on_every_rank_bit_identical(tmp_path: Path, ranks: int) -> None:

    def job(name: str, out: str) -> RankJob:
        return RankJob("tests.test_integration_ppe_ranks.ddp_child", out, 1, ranks=ranks, log=tmp_path / name)

    run = str(tmp_path / "run")
    killed = job("killed", run).finish(kill_after_save=3)  # right after iteration 12's save returned
    assert killed.killed
    reference = job("reference", str(tmp_path / "reference")).finish()
    resumed = job("resumed", run).finish()
    assert not any(resumed.of(r, "raised") for r in range(ranks)), resumed.reports
    start = assert_ranks_resumed_exactly(reference, resumed, ITERATIONS)
    assert start in (4, 8, 12), f"resumed from {start}: not from a snapshot of the killed run"
    names = sorted(os.listdir(run))  # saved by rank 1 alone, one file each; n_retains=2
    assert names == [f"snapshot_iter_{ITERATIONS - EVERY}", f"snapshot_iter_{ITERATIONS}"], names
    for name in names:
        assert_aiosnap_checkpoint(tmp_path / "run" / name)
    assert temp_entries(tmp_path / "run") == []


@pytest.mark.slow
def test_a_save_failing_on_the_saver_makes_every_rank_raise(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "snapshot_iter_8").mkdir(parents=True)  # the commit's rename onto it fails, in the background
    done = RankJob(
        "tests.test_integration_ppe_ranks.ddp_child", out, 1, ranks=2, log=tmp_path / "job"
    ).finish()
    # The failure surfaces at the saver's next save call (iteration 12), on both ranks there.
    assert done.of(1, "raised") == ["IsADirectoryError", "12"], done.reports
    assert done.of(0, "raised") == ["RankFailedError", "12"], done.reports
    assert_aiosnap_checkpoint(out / "snapshot_iter_4")
    assert sorted(os.listdir(out)) == ["snapshot_iter_12", "snapshot_iter_4", "snapshot_iter_8"]
    assert (out / "snapshot_iter_8").is_dir()  # not ours: left alone
    assert temp_entries(out) == []


@pytest.mark.slow
def test_a_saver_that_dies_in_a_save_makes_the_other_ranks_raise(tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = RankJob(
        "tests.test_integration_ppe_ranks.ddp_child", out, 0, "snapshot_iter_8", ranks=2, log=tmp_path / "job"
    )
    done = job.finish(check=False)
    assert done.returncodes[0] == -signal.SIGKILL
    assert done.of(1, "raised") == ["RankFailedError", "8"], done.reports
    assert done.returncodes[1] == 0


@pytest.mark.slow
def test_a_saver_failing_in_training_snapshots_on_error_without_waiting_for_others(tmp_path: Path) -> None:
    # The other rank waits in DDP's all-reduce for the saver's gradients: an agreement in
    # on_error would wait there for the group's timeout, then raise RankFailedError in place
    # of the training's error.
    out = tmp_path / "out"
    child = "tests.test_integration_ppe_ranks.ddp_child"
    job = RankJob(child, out, 1, "", "6", ranks=2, log=tmp_path / "job")
    done = job.finish()
    assert done.of(1, "raised") == ["ValueError", "5"], done.reports
    assert done.of(0, "raised"), done.reports  # gloo's error: the saver left the group
    assert_aiosnap_checkpoint(out / "snapshot_iter_5")  # durable before the saver's process ended
    assert temp_entries(out) == []


def _example(out: Path, iterations: int) -> str:
    return run_torchrun_example("ppe_ddp.py", out, "--iterations", str(iterations))


@pytest.mark.slow
def test_the_torchrun_example_of_the_docs_resumes_with_the_same_losses(tmp_path: Path) -> None:
    _example(tmp_path / "run", 20)
    resumed = _example(tmp_path / "run", 40)
    assert "rank 0: resumed at iteration 20" in resumed and "rank 1: resumed at iteration 20" in resumed
    reference = printed_losses(_example(tmp_path / "reference", 40), "iteration")
    later = printed_losses(resumed, "iteration")
    assert sorted(later) == [(r, i) for r in (0, 1) for i in range(21, 41)], sorted(later)
    assert all(reference[key] == value for key, value in later.items())
    assert sorted(os.listdir(tmp_path / "run")) == ["snapshot_iter_30", "snapshot_iter_40"]
