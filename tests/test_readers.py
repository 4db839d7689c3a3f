"""Readers beside a training run (issue 38): a ``read_only`` manager beside a writer that
saves with ``KeepLast(1)`` restores the newest valid checkpoint every time, ``resume()``
never takes a rotation for a fresh start, and nothing the writer does is called foreign.

The races are forced, not hoped for: the reader's storage runs a hook before each of its
system calls (``faults.HookedPosix``), and ``Rotation`` makes the writer commit its next
step, and so remove the one the reader chose, at the exact call the test picks: between
the reader's listing and its read. The long runs (a real writer process) come last.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
import torch

import aiosnap
from aiosnap._manager.restores import RELISTS
from aiosnap.storage import INDEX_NAME

from .conftest import wait_until
from .faults import HookedPosix
from .test_distributed import run_ranks

NAME = "snapshot_iter_"


def state(step: int, size: int = 64) -> dict[str, Any]:
    return {"x": torch.full((size,), float(step)), "step": step}


class Rotation:
    """A hook on a reader's system calls: when the reader opens a path ``chosen`` picks,
    the writer first saves its next step and waits for it (and its upload), in the event
    loop, while the reader's worker thread waits. With ``KeepLast(1)`` that removes what
    the reader listed, between its listing and its read. ``arm(n)``: the next n opens."""

    def __init__(self, writer: aiosnap.CheckpointManager, chosen: Callable[[str], bool], step: int) -> None:
        self.writer, self.chosen, self.step = writer, chosen, step
        self.left = 0
        self.rotations = 0
        self.size = 64
        self._token: Any = None

    def arm(self, times: int = 1) -> None:
        self._token = anyio.lowlevel.current_token()
        self.left = times

    def __call__(self, op: str, path: str) -> None:
        if op == "open" and self.left and self.chosen(path):
            self.left -= 1
            anyio.from_thread.run(self.save_next, token=self._token)

    async def save_next(self) -> None:
        self.step += 1
        handle = await self.writer.save(self.step, state(self.step, self.size))
        await handle.wait()
        if handle.upload is not None:
            await handle.upload.wait()
        self.rotations += 1


def reader(
    directory: str | Path, hook: Callable[[str, str], None], **options: Any
) -> aiosnap.CheckpointManager:
    """A read-only manager whose system calls ``hook`` sees first."""
    storage = aiosnap.storage.LocalStorage(posix=HookedPosix(hook))
    return aiosnap.CheckpointManager(str(directory), read_only=True, storage=storage, **options)


def of_aiosnap(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("aiosnap") and r.levelno >= level]


def checkpoint(path: str) -> bool:
    return os.path.basename(path).startswith(NAME)


# -- the races, forced ---------------------------------------------------------------------------
async def test_restore_takes_the_newer_step_when_retention_removes_the_one_it_chose(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every restore's chosen file goes away just before the reader opens it."""
    async with aiosnap.CheckpointManager(str(tmp_path), keep=aiosnap.retention.KeepLast(1)) as writer:
        await (await writer.save(0, state(0))).wait()
        rotation = Rotation(writer, checkpoint, 0)
        async with reader(tmp_path, rotation) as mgr:
            for i in range(1, 201):
                rotation.arm()
                got = await (mgr.resume() if i % 2 else mgr.restore())
                assert got is not None and got.step == rotation.step == i and got.state["step"] == i
    assert rotation.rotations == 200
    assert of_aiosnap(caplog) == []


async def test_a_file_gone_between_listing_and_index_is_no_stranger_nor_a_fresh_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The reader lists step N; the writer commits N+1 and removes N before the reader
    reads the index (which names N+1 only): N was aiosnap's, and N+1 is there to resume."""
    index = str(tmp_path / INDEX_NAME)
    async with aiosnap.CheckpointManager(str(tmp_path), keep=aiosnap.retention.KeepLast(1)) as writer:
        await (await writer.save(0, state(0))).wait()
        rotation = Rotation(writer, lambda path: path == index, 0)
        async with reader(tmp_path, rotation) as mgr:
            for _ in range(50):
                rotation.arm()
                got = await mgr.resume()
                assert got is not None and got.step == rotation.step
                rotation.arm()
                assert await mgr.latest_step() == rotation.step
            assert rotation.rotations == 100
    assert of_aiosnap(caplog) == []


@pytest.mark.parametrize("chosen", ["aiosnap-manifest.json", "rank_00000"])
async def test_a_step_directory_that_goes_away_mid_restore(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, chosen: str
) -> None:
    """A group's layout: the step directory the reader chose, its manifest or its rank
    file, goes away as the reader reads it (a group of one writes the later steps)."""
    assert run_ranks(1, _first_step, str(tmp_path)) == {0: None}
    async with aiosnap.CheckpointManager(str(tmp_path), keep=aiosnap.retention.KeepLast(1)) as writer:
        rotation = Rotation(writer, lambda path: os.path.basename(path) == chosen, 0)
        async with reader(tmp_path, rotation) as mgr:
            for i in range(1, 41):
                rotation.arm()
                got = await (mgr.resume() if i % 2 else mgr.restore())
                assert got is not None and got.step == i and got.state["step"] == i
                assert (tmp_path / f"{NAME}{i}").is_dir() and not (tmp_path / f"{NAME}{i - 1}").exists()
    assert of_aiosnap(caplog) == []


async def _first_step(rank: int, world: int, directory: str) -> None:
    async with aiosnap.CheckpointManager(directory) as manager:
        await (await manager.save(0, state(0))).wait()


async def test_a_blob_that_goes_away_mid_restore(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Incremental checkpoints: the blob the reader opens was collected with the step
    that referred to it, which the writer's next save rotated away."""
    async with aiosnap.CheckpointManager(
        str(tmp_path), keep=aiosnap.retention.KeepLast(1), incremental=True
    ) as writer:
        rotation = Rotation(writer, lambda path: "aiosnap-blobs" in path, 0)
        rotation.size = 1 << 15  # 128 KiB: stored as a blob, a new one at every step
        await (await writer.save(0, state(0, rotation.size))).wait()
        async with reader(tmp_path, rotation) as mgr:
            for i in range(1, 21):
                rotation.arm()
                got = await mgr.restore()
                assert got.step == i and torch.equal(got.state["x"], state(i, rotation.size)["x"])
    assert rotation.rotations == 20
    assert of_aiosnap(caplog) == []


async def test_a_reader_of_two_tiers_lists_both_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With a remote tier, the step the reader chose goes from both tiers (each keeps one)
    before it reads it: it takes the newer one, from the local tier."""
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    tiers: dict[str, Any] = {"remote": aiosnap.Remote(remote, keep=aiosnap.retention.KeepLast(1))}
    async with aiosnap.CheckpointManager(local, keep=aiosnap.retention.KeepLast(1), **tiers) as writer:
        handle = await writer.save(0, state(0))
        assert handle.upload is not None
        await handle.upload.wait()
        rotation = Rotation(writer, checkpoint, 0)
        async with reader(local, rotation, remote=remote) as mgr:
            for i in range(1, 31):
                rotation.arm()
                got = await (mgr.resume() if i % 2 else mgr.restore())
                assert got is not None and (got.step, got.path) == (i, os.path.join(local, f"{NAME}{i}"))
    assert of_aiosnap(caplog) == []


async def test_a_reader_that_the_writer_always_outruns_gives_up(tmp_path: Path) -> None:
    """Each file the reader chooses goes away before it reads it: it lists again only as
    often as RELISTS allows, then says where it looked and what it tried."""
    async with aiosnap.CheckpointManager(str(tmp_path), keep=aiosnap.retention.KeepLast(1)) as writer:
        await (await writer.save(0, state(0))).wait()
        rotation = Rotation(writer, checkpoint, 0)
        async with reader(tmp_path, rotation) as mgr:
            rotation.arm(times=10 * RELISTS)
            with pytest.raises(aiosnap.errors.CheckpointNotFoundError) as raised:
                await mgr.restore()
            assert rotation.rotations == RELISTS + 1  # one listing, then RELISTS more
            message = str(raised.value)
            assert (
                raised.value.path == str(tmp_path) and f"no valid checkpoint in {str(tmp_path)!r}" in message
            )
            assert f"listed again {RELISTS} times" in message and f"{NAME}{RELISTS}" in message
            rotation.left = 0
            assert (await mgr.restore()).step == RELISTS + 1  # once it holds still, it reads


@pytest.mark.parametrize("layout", ["files", "step directories"])
async def test_a_commit_in_flight_is_nothing_foreign(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, layout: str
) -> None:
    """The writer's commit of step 2 is held just before the rename that makes it visible
    (its temp file there; or a step directory with its rank file and no manifest yet): the
    reader sees step 1, and names nothing as foreign."""
    if layout == "step directories":
        assert run_ranks(1, _first_step, str(tmp_path)) == {0: None}
    last = f"{NAME}2" if layout == "files" else "aiosnap-manifest.json"
    held, release = threading.Event(), threading.Event()

    def gate(op: str, path: str) -> None:
        if op == "rename" and os.path.basename(path) == last and f"{NAME}2" in path:
            held.set()
            release.wait()

    storage = aiosnap.storage.LocalStorage(posix=HookedPosix(gate))
    async with aiosnap.CheckpointManager(
        str(tmp_path), keep=aiosnap.retention.KeepLast(1), storage=storage
    ) as writer:
        await (await writer.save(1, state(1))).wait()
        handle = await writer.save(2, state(2))
        try:
            await wait_until(held.is_set, what="the commit of step 2 held at its rename")
            async with aiosnap.CheckpointManager(str(tmp_path), read_only=True) as mgr:
                assert await mgr.steps() == [1] and await mgr.latest_step() == 1
                got = await mgr.resume()
                assert got is not None and got.step == 1 and (await mgr.restore()).step == 1
        finally:
            release.set()
        await handle.wait()
    assert of_aiosnap(caplog) == []


# -- what a reader tells a fresh start by -------------------------------------------------------------
async def test_resume_starts_afresh_only_where_nothing_was_ever_committed(tmp_path: Path) -> None:
    async with aiosnap.CheckpointManager(str(tmp_path), read_only=True) as mgr:
        assert await mgr.resume() is None  # no checkpoint, no index: a fresh start
    async with aiosnap.CheckpointManager(str(tmp_path), keep=aiosnap.retention.KeepLast(1)) as writer:
        for step in (1, 2):
            await (await writer.save(step, state(step))).wait()
    (tmp_path / f"{NAME}2").unlink()  # by hand: the index tells of commits, no file is left
    async with aiosnap.CheckpointManager(str(tmp_path), read_only=True) as mgr:
        assert await mgr.steps() == []
        with pytest.raises(aiosnap.errors.CheckpointNotFoundError, match="no valid checkpoint"):
            await mgr.resume()


# -- a real writer beside the reader --------------------------------------------------------------------
_WRITER = r"""
import asyncio, sys, torch, aiosnap

async def main():
    async with aiosnap.CheckpointManager(sys.argv[1], keep=aiosnap.retention.KeepLast(1)) as mgr:
        step = 0
        while True:
            await (await mgr.save(step, {"x": torch.full((64,), float(step)), "step": step})).wait()
            if step == 0:
                print("ready", flush=True)
            step += 1

asyncio.run(main())
"""


async def read_beside_a_writer(
    directory: Path, reads: int, caplog: pytest.LogCaptureFixture
) -> dict[str, float]:
    """``reads`` restores and resumes, alternately, while a writer process saves with
    KeepLast(1) as fast as it can; then at least until the writer has moved on 20 steps.
    Every one must be valid and no older than the one before. Returns what was measured."""
    caplog.set_level(logging.INFO, logger="aiosnap._manager.restores")
    writer = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _WRITER, str(directory), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert writer.stdout is not None and (await writer.stdout.readline()).strip() == b"ready"
        seen: list[int] = []
        t0 = time.perf_counter()
        async with aiosnap.CheckpointManager(str(directory), read_only=True) as mgr:
            while len(seen) < reads or seen[-1] - seen[0] < 20:
                assert writer.returncode is None, "the writer process died"
                got = await (mgr.resume() if len(seen) % 2 else mgr.restore())
                assert got is not None, f"resume() started afresh after {len(seen)} reads"
                assert got.state["step"] == got.step >= (seen[-1] if seen else 0)
                seen.append(got.step)
        took = time.perf_counter() - t0
    finally:
        writer.kill()
        await writer.wait()
    assert of_aiosnap(caplog) == []
    relists = sum("again" in m for m in of_aiosnap(caplog, logging.INFO))
    return {"reads": len(seen), "per_s": len(seen) / took, "relists": relists, "steps": seen[-1] - seen[0]}


async def test_a_reader_beside_a_writer_process(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    measured = await read_beside_a_writer(tmp_path, 300, caplog)
    print(f"\nreader beside a writer: {measured}")


@pytest.mark.slow
async def test_ten_thousand_reads_beside_a_writer_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    measured = await read_beside_a_writer(tmp_path, 10_000, caplog)
    print(f"\nreader beside a writer: {measured}")
