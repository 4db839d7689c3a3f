"""Fault injection at every I/O call: each flow runs once to count its system calls,
then once per call N with that call failing (EIO, ENOSPC, EINTR), once or from then on.

After every run: the error is clear (an OSError or CheckpointError naming the user's
path, never a temp file); a clean reopen restores the previous checkpoint or the new
one, whole; no temp file is left once the directory has been opened again; and the
index lists only checkpoints that are there and verify.
"""

from __future__ import annotations

import asyncio
import errno
import json
import multiprocessing
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap
from aiosnap._catalog import INDEX_NAME

from .faults import HookedPosix, Injector

CODES = {"EIO": errno.EIO, "ENOSPC": errno.ENOSPC, "EINTR": errno.EINTR}
Flow = Callable[[Path, aiosnap.Storage], Awaitable[None]]


def state(step: int, size: int = 1024) -> dict[str, Any]:
    return {"x": torch.full((size,), float(step)), "step": step}


def assert_state(loaded: Any, step: int) -> None:
    assert loaded["step"] == step and bool((loaded["x"] == float(step)).all()), "a torn checkpoint"


# -- the flows: each starts from a directory holding step 1, and writes step 2 --------------------
async def save_file(directory: Path, storage: aiosnap.Storage) -> None:
    await aiosnap.save(str(directory / "snapshot_iter_2"), state(2), storage=storage)


async def save_in_pieces(directory: Path, storage: aiosnap.Storage) -> None:
    async with aiosnap.QueueWriter(max_host_bytes=1 << 20, storage=storage) as writer:
        await (await writer("snapshot_iter_2", str(directory), state(2, 3 << 18))).wait()  # 3 MiB


async def manager_commit(directory: Path, storage: aiosnap.Storage) -> None:
    # Open (lease, sweep, index), save (commit), index update, retention (step 1 goes), close.
    async with aiosnap.CheckpointManager(str(directory), keep=aiosnap.KeepLast(1), storage=storage) as mgr:
        await (await mgr.save(2, state(2))).wait()


FLOWS: dict[str, Flow] = {"save": save_file, "pieces": save_in_pieces, "manager": manager_commit}


async def seed(directory: Path) -> None:
    directory.mkdir()
    async with aiosnap.CheckpointManager(str(directory)) as mgr:
        await (await mgr.save(1, state(1))).wait()


async def run(flow: Flow, directory: Path, injector: Injector) -> BaseException | None:
    try:
        await flow(directory, aiosnap.LocalStorage(posix=HookedPosix(injector)))
    except Exception as exc:
        return exc
    return None


def check_error(error: BaseException | None, injector: Injector) -> None:
    if error is None:
        return
    assert isinstance(error, (OSError, aiosnap.CheckpointError)), repr(error)
    assert aiosnap.TEMP_PREFIX not in str(error), f"the message names a temp file: {error}"
    if isinstance(error, OSError):
        assert error.errno == injector.code and os.strerror(injector.code) in str(error), repr(error)
        assert error.filename and aiosnap.TEMP_PREFIX not in str(error.filename)


async def check_index(directory: Path) -> None:
    """The index lists only checkpoints that are there and verify; latest is the newest."""
    try:
        index = json.loads((directory / INDEX_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return  # no index, or a damaged one: rebuilt at the next open
    listed = [c for c in index["checkpoints"] if c["corrupt"] is None]
    for record in listed:
        await aiosnap.verify(str(directory / record["file"]))
    assert index["latest"] == max((c["step"] for c in listed), default=None)


async def reopen_and_restore(directory: Path, committed: bool) -> None:
    async with aiosnap.CheckpointManager(str(directory)) as mgr:
        assert [n for n in os.listdir(directory) if n.startswith(aiosnap.TEMP_PREFIX)] == []
        restored = await mgr.restore()
        assert restored.step in ((2,) if committed else (1, 2)), restored.step
        assert_state(restored.state, restored.step)
        on_disk = sorted(int(n.rsplit("_", 1)[1]) for n in os.listdir(directory) if n.startswith("snapshot"))
        assert await mgr.steps() == on_disk
    index = json.loads((directory / INDEX_NAME).read_text())
    assert [c["step"] for c in index["checkpoints"]] == on_disk


@pytest.mark.parametrize("persistent", [False, True], ids=["once", "persistent"])
@pytest.mark.parametrize("code", sorted(CODES), ids=sorted(CODES))
@pytest.mark.parametrize("name", sorted(FLOWS))
async def test_a_fault_at_every_call_keeps_a_whole_checkpoint(
    tmp_path: Path, name: str, code: str, persistent: bool
) -> None:
    flow = FLOWS[name]
    counted = Injector()
    await seed(tmp_path / "count")
    assert await run(flow, tmp_path / "count", counted) is None
    assert counted.calls > 5
    for n in range(1, counted.calls + 1):
        directory = tmp_path / f"n{n}"
        await seed(directory)
        injector = Injector(n, CODES[code], persistent=persistent)
        error = await run(flow, directory, injector)
        assert injector.failed, f"call #{n} was never made"
        try:
            check_error(error, injector)
            await check_index(directory)
            await reopen_and_restore(directory, committed=error is None)
        except AssertionError as exc:
            exc.add_note(f"{name}: {code} {'from' if persistent else 'at'} call {injector.failed[0]}")
            raise


# -- a crash at every call ------------------------------------------------------------------------
def _crash_at(flow_name: str, directory: str, n: int) -> None:
    """Run a flow in this (child) process and die at its ``n``-th system call, before the
    call is made, as a power cut or a SIGKILL would leave it."""

    def hook(op: str, path: str) -> None:
        calls.append(op)
        if len(calls) == n:
            os._exit(137)

    calls: list[str] = []
    asyncio.run(FLOWS[flow_name](Path(directory), aiosnap.LocalStorage(posix=HookedPosix(hook))))
    os._exit(0)


def _ctx() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["aiosnap", "tests.test_faults"])
    return ctx


@pytest.mark.parametrize("name", sorted(FLOWS))
async def test_a_crash_at_every_call_leaves_the_old_or_the_new_checkpoint(tmp_path: Path, name: str) -> None:
    counted = Injector()
    await seed(tmp_path / "count")
    assert await run(FLOWS[name], tmp_path / "count", counted) is None
    ctx = _ctx()
    for n in range(1, counted.calls + 1):
        directory = tmp_path / f"n{n}"
        await seed(directory)
        child = ctx.Process(target=_crash_at, args=(name, str(directory), n))
        child.start()
        await asyncio.to_thread(child.join)
        assert child.exitcode == 137, f"{name}: the child did not reach call {n}"
        try:
            await check_index(directory)
            await reopen_and_restore(directory, committed=False)
        except AssertionError as exc:
            exc.add_note(f"{name}: crashed before call {n} of {counted.calls}")
            raise
