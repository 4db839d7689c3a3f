"""Job and JobRunner: groups, stop conditions, checkpoints per epoch, resume, upload."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap

from .faults import failing_writes


class Counter:
    def __init__(self) -> None:
        self.value = torch.zeros(1)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value.copy_(state["value"])


def make_job(log: list[str], epochs: int) -> aiosnap.Job:
    job = aiosnap.Job()

    @job.init_group.add
    async def init(ctx: aiosnap.RunContext) -> None:
        log.append("init")

    @job.epoch_group.add
    async def train(ctx: aiosnap.RunContext) -> None:
        ctx.state["counter"].value += 1
        log.append(f"epoch {ctx.epoch}")

    @job.download_group.add
    async def download(ctx: aiosnap.RunContext) -> None:
        log.append("download")

    @job.exit_group.add
    async def leave(ctx: aiosnap.RunContext) -> None:
        log.append("exit")

    aiosnap.epoch_limiter(job, epochs)
    return job


async def test_train_from_scratch_then_resume(tmp_path: Path) -> None:
    log: list[str] = []
    uploads: list[int] = []
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        runner = aiosnap.JobRunner(
            make_job(log, 3), mgr, state={"counter": Counter()}, upload=lambda epoch, m: uploads.append(epoch)
        )
        assert await runner.train() == 3
        assert await mgr.steps() == [0, 1, 2, 3]
        assert float((await runner.load_blobs(["counter"], 2))["counter"]["value"][0]) == 2.0
    assert log == ["init", "epoch 1", "epoch 2", "epoch 3", "download", "exit"] and uploads == [3]

    log.clear()
    counter = Counter()
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        assert await aiosnap.JobRunner(make_job(log, 5), mgr, state={"counter": counter}).train() == 5
    assert log == ["epoch 4", "epoch 5", "download", "exit"]  # no init: resumed at epoch 3
    assert float(counter.value[0]) == 5.0

    log.clear()
    counter = Counter()
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        runner = aiosnap.JobRunner(make_job(log, 3), mgr, state={"counter": counter}, resume_from_epoch=1)
        assert await runner.train() == 3
    assert log[:2] == ["epoch 2", "epoch 3"] and float(counter.value[0]) == 3.0


async def test_a_failure_in_a_group_cancels_the_rest_and_propagates(tmp_path: Path) -> None:
    job = aiosnap.Job()
    started, cancelled = asyncio.Event(), asyncio.Event()

    @job.epoch_group.add
    async def slow(ctx: aiosnap.RunContext) -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # never set: only a cancel ends it
        except asyncio.CancelledError:
            cancelled.set()
            raise

    @job.epoch_group.add
    async def broken(ctx: aiosnap.RunContext) -> None:
        await started.wait()
        raise ValueError("bad batch")

    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(ValueError, match="bad batch"):
            await aiosnap.JobRunner(job, mgr, state={}).train()
    assert cancelled.is_set()
    with pytest.raises(TypeError, match="not an async callable"):
        job.epoch_group.add(lambda ctx: None)  # type: ignore[arg-type,return-value]


async def test_async_stop_condition(tmp_path: Path) -> None:
    job = aiosnap.Job()
    seen: list[int] = []

    @job.epoch_group.add
    async def step(ctx: aiosnap.RunContext) -> None:
        seen.append(ctx.epoch)

    async def enough(ctx: aiosnap.RunContext) -> bool:
        return ctx.epoch >= 2

    job.add_stop_condition(enough)
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        assert await aiosnap.JobRunner(job, mgr, state={}).train() == 2
    assert seen == [1, 2]


def FullDisk() -> aiosnap.storage.Storage:
    return failing_writes({"snapshot_iter_1", "snapshot_iter_2"})


async def test_failed_saves_warn_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log: list[str] = []
    storage = FullDisk()
    with caplog.at_level(logging.WARNING, logger="aiosnap"):
        async with aiosnap.CheckpointManager(str(tmp_path), storage=storage) as mgr:
            runner = aiosnap.JobRunner(make_job(log, 4), mgr, state={"counter": Counter()})
            assert await runner.train() == 4
            assert await mgr.steps() == [0, 3, 4]
    assert "checkpoint save failed" in caplog.text and "No space left" in caplog.text


async def test_failed_saves_raise_when_asked(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="No space left"):
        async with aiosnap.CheckpointManager(str(tmp_path), storage=FullDisk()) as mgr:
            runner = aiosnap.JobRunner(
                make_job([], 4), mgr, state={"counter": Counter()}, on_save_error="raise"
            )
            await runner.train()
