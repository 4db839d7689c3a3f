"""A run killed with SIGKILL at a random moment and resumed is the run that never stopped."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import aiosnap

EPOCHS = 4


def _train(directory: str, workers: int) -> None:
    torch.set_num_threads(1)  # the same kernels in every process: bit-identical results
    asyncio.run(_train_async(directory, workers))


async def _train_async(directory: str, workers: int) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, 1, generator=g))
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = aiosnap.AsyncLoader(
        DataLoader(
            data, batch_size=32, shuffle=True, num_workers=workers, generator=torch.Generator().manual_seed(1)
        )
    )
    job = aiosnap.Job()

    @job.epoch_group.add
    async def epoch(ctx: aiosnap.RunContext) -> None:
        async for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            await asyncio.sleep(0.002)  # room for the kill to land mid-epoch

    aiosnap.epoch_limiter(job, EPOCHS)
    state = {"model": model, "optimizer": optimizer, "loader": loader, "rng": aiosnap.RNGState()}
    async with aiosnap.CheckpointManager(directory, keep=aiosnap.KeepLast(2)) as mgr:
        await aiosnap.JobRunner(job, mgr, state=state).train()


def _ctx() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["aiosnap", "torch.utils.data", "tests.test_exact_resume"])
    return ctx


def _run(directory: Path, workers: int, kill_after: float | None) -> int | None:
    proc = _ctx().Process(target=_train, args=(str(directory), workers))
    proc.start()
    proc.join(kill_after)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    return proc.exitcode


def _final_params(directory: Path) -> dict[str, torch.Tensor]:
    return aiosnap.load_sync(str(directory / f"snapshot_iter_{EPOCHS}"), keys=["model"])["model"]


@pytest.mark.parametrize("workers", [0, 2])
def test_killed_and_resumed_run_is_bit_identical(workers: int, tmp_path: Path) -> None:
    assert _run(tmp_path / "reference", workers, None) == 0
    reference = _final_params(tmp_path / "reference")
    rng = random.Random(workers)
    total_kills = 0
    for attempt in range(2):
        directory = tmp_path / f"run{attempt}"
        kills = 0
        while _run(directory, workers, rng.uniform(0.3, 2.0) if kills < 2 else None) != 0:
            kills += 1
        total_kills += kills
        got = _final_params(directory)
        assert got.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(got[name], tensor), f"{name} differs after {kills} kill(s)"
    assert total_kills >= 2, "the runs finished before they could be killed"
