"""A run killed with SIGKILL mid-epoch and resumed is the run that never stopped.

The child reports every batch it trains on; the parent kills it once it has reported
the batch chosen for this run, so the kills land where the test says, on any machine.
The child then waits on its event loop, where the previous epoch's checkpoint may
still be in flight: the kill lands at whatever point of that save it has reached.
"""

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
BATCHES = 16  # per epoch: 512 samples in batches of 32


def _train(directory: str, workers: int, stop_at: int | None, report: Any) -> None:
    # A process group of its own, killed whole (see _run): the DataLoader's workers are
    # started through a forkserver of this process's own (its default context is its
    # parent's, forkserver), so they are that server's children, and torch's watchdog
    # in them waits for the server to die, not for this process. Killed alone, this
    # left the server and the workers alive after the test suite (~260 MB each).
    os.setpgrp()
    torch.set_num_threads(1)  # the same kernels in every process: bit-identical results
    asyncio.run(_train_async(directory, workers, stop_at, report))


async def _train_async(directory: str, workers: int, stop_at: int | None, report: Any) -> None:
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
    trained = 0

    @job.epoch_group.add
    async def epoch(ctx: aiosnap.RunContext) -> None:
        nonlocal trained
        async for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            trained += 1
            report.send(trained)
            if trained == stop_at:
                await asyncio.Event().wait()  # the loop runs on (saves in flight) until the kill

    aiosnap.epoch_limiter(job, EPOCHS)
    state = {"model": model, "optimizer": optimizer, "loader": loader, "rng": aiosnap.RNGState()}
    async with aiosnap.CheckpointManager(directory, keep=aiosnap.retention.KeepLast(2)) as mgr:
        await aiosnap.JobRunner(job, mgr, state=state).train()


def _ctx() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["aiosnap", "torch.utils.data", "tests.test_exact_resume"])
    return ctx


def _run(directory: Path, workers: int, stop_at: int | None) -> bool:
    """Train in a child; SIGKILL it once it has trained ``stop_at`` batches (None: never).
    Whether it was killed (False: it finished first)."""
    ctx = _ctx()
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_train, args=(str(directory), workers, stop_at, send))
    proc.start()
    send.close()
    killed = False
    try:
        while True:
            try:
                trained = receive.recv()  # EOFError once the child has exited
            except EOFError:
                break
            if trained == stop_at:
                os.killpg(proc.pid, signal.SIGKILL)  # the trainer, its workers and their server
                killed = True
                break
    finally:
        proc.join()
        receive.close()
        try:  # whatever of the group outlived the trainer (a run that failed)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert killed or proc.exitcode == 0, f"the run failed with exit code {proc.exitcode}"
    return killed


def _final_params(directory: Path) -> dict[str, torch.Tensor]:
    return aiosnap.load_sync(str(directory / f"snapshot_iter_{EPOCHS}"), keys=["model"])["model"]


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])  # slow: CI's budget
def test_killed_and_resumed_run_is_bit_identical(workers: int, tmp_path: Path) -> None:
    assert not _run(tmp_path / "reference", workers, None)
    reference = _final_params(tmp_path / "reference")
    rng = random.Random(workers)
    for attempt in range(2):
        directory = tmp_path / f"run{attempt}"
        # A run resumes at an epoch boundary at most two epochs back, so at least
        # BATCHES batches remain and a kill before then always lands mid-run: first
        # anywhere in the first three epochs, then early, while saves are in flight.
        stops = [rng.randint(1, 3 * BATCHES - 1), rng.randint(1, BATCHES - 1)]
        kills = [_run(directory, workers, stop) for stop in stops]
        assert kills == [True, True]
        assert not _run(directory, workers, None)
        got = _final_params(directory)
        assert got.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(got[name], tensor), f"{name} differs after kills at batches {stops}"
