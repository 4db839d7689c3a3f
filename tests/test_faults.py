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
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap
from aiosnap._manager.catalog import INDEX_NAME

from .faults import HookedPosix, Injector
from .test_distributed import run_ranks

CODES = {"EIO": errno.EIO, "ENOSPC": errno.ENOSPC, "EINTR": errno.EINTR}
Flow = Callable[[Path, aiosnap.storage.Storage], Awaitable[None]]


def state(step: int, size: int = 1024) -> dict[str, Any]:
    return {"x": torch.full((size,), float(step)), "step": step}


def assert_state(loaded: Any, step: int) -> None:
    assert loaded["step"] == step and bool((loaded["x"] == float(step)).all()), "a torn checkpoint"
    assert "shared" not in loaded or torch.equal(loaded["shared"], _SHARED), "a torn checkpoint"


# -- the flows: each starts from a directory holding step 1, and writes step 2 --------------------
async def save_file(directory: Path, storage: aiosnap.storage.Storage) -> None:
    await aiosnap.save(str(directory / "snapshot_iter_2"), state(2), storage=storage)


async def save_in_pieces(directory: Path, storage: aiosnap.storage.Storage) -> None:
    async with aiosnap.QueueWriter(max_host_bytes=1 << 20, storage=storage) as writer:
        await (await writer("snapshot_iter_2", str(directory), state(2, 3 << 18))).wait()  # 3 MiB


async def manager_commit(directory: Path, storage: aiosnap.storage.Storage) -> None:
    # Open (lease, sweep, index), save (commit), index update, retention (step 1 goes), close.
    async with aiosnap.CheckpointManager(
        str(directory), keep=aiosnap.retention.KeepLast(1), storage=storage
    ) as mgr:
        await (await mgr.save(2, state(2))).wait()


#: A frozen tensor both steps of the incremental flow share (one blob), 128 KiB.
_SHARED = torch.arange(1 << 15, dtype=torch.float32)


def incremental_state(step: int) -> dict[str, Any]:
    return {**state(step, 1 << 15), "shared": _SHARED}  # x: 128 KiB, a blob of its own


async def incremental_commit(directory: Path, storage: aiosnap.storage.Storage) -> None:
    # Blobs first (x of step 2; the shared one is there), then the file, then retention
    # drops step 1 and collects its blob of x.
    async with aiosnap.CheckpointManager(
        str(directory), keep=aiosnap.retention.KeepLast(1), storage=storage, incremental=True
    ) as mgr:
        await (await mgr.save(2, incremental_state(2))).wait()


FLOWS: dict[str, Flow] = {
    "save": save_file,
    "pieces": save_in_pieces,
    "manager": manager_commit,
    "incremental": incremental_commit,
    # As after a restart: the shared blob is not one this process wrote, so the save reads
    # it back (and checks it) before it refers to it.
    "incremental-restart": incremental_commit,
}


async def seed_incremental(directory: Path) -> None:
    directory.mkdir()
    async with aiosnap.CheckpointManager(str(directory), incremental=True) as mgr:
        await (await mgr.save(1, incremental_state(1))).wait()


async def seed_incremental_elsewhere(directory: Path) -> None:
    """``seed_incremental``'s directory, copied: files this process did not write."""
    origin = directory.with_name(directory.name + "-origin")
    await seed_incremental(origin)
    shutil.copytree(origin, directory)


#: How a flow's directory is made, where it is not ``seed``'s.
SEEDS: dict[str, Callable[[Path], Awaitable[None]]] = {
    "incremental": seed_incremental,
    "incremental-restart": seed_incremental_elsewhere,
}


async def seed(directory: Path) -> None:
    directory.mkdir()
    async with aiosnap.CheckpointManager(str(directory)) as mgr:
        await (await mgr.save(1, state(1))).wait()


async def run(flow: Flow, directory: Path, injector: Injector) -> BaseException | None:
    try:
        await flow(directory, aiosnap.storage.LocalStorage(posix=HookedPosix(injector)))
    except Exception as exc:
        return exc
    return None


def check_error(error: BaseException | None, injector: Injector) -> None:
    if error is None:
        return
    assert isinstance(error, (OSError, aiosnap.errors.CheckpointError)), repr(error)
    assert aiosnap.storage.TEMP_PREFIX not in str(error), f"the message names a temp file: {error}"
    if isinstance(error, OSError):
        assert error.errno == injector.code and os.strerror(injector.code) in str(error), repr(error)
        assert error.filename and aiosnap.storage.TEMP_PREFIX not in str(error.filename)


async def check_index(directory: Path, error: BaseException | None = None) -> None:
    """The index lists only checkpoints that are there and verify; latest is the newest.
    Unless its own write failed (``IndexWriteError``): retention removed what it would
    have removed all the same, and the stale index is rebuilt at the next open."""
    try:
        index = json.loads((directory / INDEX_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return  # no index, or a damaged one: rebuilt at the next open
    listed = [c for c in index["checkpoints"] if c["corrupt"] is None]
    stale = isinstance(error, aiosnap.errors.IndexWriteError)
    for record in listed:
        if not stale or (directory / record["file"]).exists():
            await aiosnap.verify(str(directory / record["file"]))
    if not stale:
        assert index["latest"] == max((c["step"] for c in listed), default=None)


async def reopen_and_restore(directory: Path, committed: bool) -> None:
    async with aiosnap.CheckpointManager(str(directory)) as mgr:
        for folder in (directory, directory / "aiosnap-blobs"):  # the blob folder's swept too
            left = os.listdir(folder) if folder.exists() else []
            assert [n for n in left if n.startswith(aiosnap.storage.TEMP_PREFIX)] == []
        restored = await mgr.restore()
        assert restored.step in ((2,) if committed else (1, 2)), restored.step
        assert_state(restored.state, restored.step)
        on_disk = sorted(int(n.rsplit("_", 1)[1]) for n in os.listdir(directory) if n.startswith("snapshot"))
        assert await mgr.steps() == on_disk
        for step in on_disk:  # each whole: no reference to a missing blob
            await aiosnap.verify(str(directory / mgr.filename(step)))
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
    seeded = SEEDS.get(name, seed)
    await seeded(tmp_path / "count")
    assert await run(flow, tmp_path / "count", counted) is None
    assert counted.calls > 5
    short = 0
    for n in range(1, counted.calls + 1):
        directory = tmp_path / f"n{n}"
        await seeded(directory)
        injector = Injector(n, CODES[code], persistent=persistent)
        error = await run(flow, directory, injector)
        if not injector.failed:
            # The incremental flow's count once came out one call longer than a later run
            # (its referring file took the O_DIRECT path where malloc page-aligned it; it is
            # mmap'd now). Should a run still fall short of n, it has no call n to fail, and
            # is checked as a whole run. One at most.
            assert injector.calls < n, f"call #{n} was never made"
            short += 1
        try:
            check_error(error, injector)
            await check_index(directory, error)
            await reopen_and_restore(directory, committed=error is None)
        except AssertionError as exc:
            at = injector.failed[0] if injector.failed else "none (a shorter run)"
            exc.add_note(f"{name}: {code} {'from' if persistent else 'at'} call {at}")
            raise
    assert short <= 1, f"{short} of {counted.calls} calls were never made"


# -- a crash at every call ------------------------------------------------------------------------
def _crash_at(flow_name: str, directory: str, n: int) -> None:
    """Run a flow in this (child) process and die at its ``n``-th system call, before the
    call is made, as a power cut or a SIGKILL would leave it."""

    def hook(op: str, path: str) -> None:
        calls.append(op)
        if len(calls) == n:
            os._exit(137)

    calls: list[str] = []
    asyncio.run(FLOWS[flow_name](Path(directory), aiosnap.storage.LocalStorage(posix=HookedPosix(hook))))
    os._exit(0)


def _ctx() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["aiosnap", "tests.test_faults"])
    return ctx


@pytest.mark.parametrize("name", sorted(FLOWS))
async def test_a_crash_at_every_call_leaves_the_old_or_the_new_checkpoint(tmp_path: Path, name: str) -> None:
    counted = Injector()
    seeded = SEEDS.get(name, seed)
    await seeded(tmp_path / "count")
    assert await run(FLOWS[name], tmp_path / "count", counted) is None
    ctx = _ctx()
    for n in range(1, counted.calls + 1):
        directory = tmp_path / f"n{n}"
        await seeded(directory)
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


# -- a group commit: 2 ranks on gloo --------------------------------------------------------------
def group_state(step: int, big: bool = False) -> dict[str, Any]:
    """The same on both ranks (so one process restores it whole), a DTensor included;
    ``big``: entries of blob size (incremental saves), each box of ``d`` too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    d = torch.full((256 if big else 8, 128), float(step))
    return {
        **state(step, 1 << 15 if big else 1024),
        "d": distribute_tensor(d, mesh, [Shard(0)], src_data_rank=None),
    }


async def _group_flow(
    rank: int, directory: str, storage: aiosnap.storage.Storage | None, big: bool = False
) -> None:
    async with aiosnap.CheckpointManager(
        directory,
        storage=storage,
        writer=aiosnap.QueueWriter(storage=storage, incremental=big),
        keep=aiosnap.retention.KeepLast(1),
        ranks=aiosnap.Ranks(timeout=30),
    ) as mgr:
        await (await mgr.save(2, group_state(2, big))).wait()


async def _group_seed(directory: str, big: bool = False) -> None:
    async with aiosnap.CheckpointManager(directory, ranks=aiosnap.Ranks(timeout=30), incremental=big) as mgr:
        await (await mgr.save(1, group_state(1, big))).wait()


async def _group_faults(
    rank: int, world: int, root: str, victim: int, code: int, persistent: bool, big: bool = False
) -> Any:
    """Every call of the victim's group commit fails in turn; the other rank goes along.
    Runs until the victim makes fewer calls than the next n."""
    import torch.distributed as dist

    outcomes = []
    n = 1
    while True:
        directory = os.path.join(root, f"n{n}")
        await _group_seed(directory, big)
        injector = Injector(n if rank == victim else 0, code, persistent=persistent)
        try:
            await _group_flow(rank, directory, aiosnap.storage.LocalStorage(posix=HookedPosix(injector)), big)
            outcomes.append(None)
        except Exception as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
        fired: list[Any] = [None] * world
        dist.all_gather_object(fired, bool(injector.failed))
        if not fired[victim]:
            return {"calls": n - 1, "outcomes": outcomes[:-1]}
        n += 1


def _faults_in_a_group_commit(
    tmp_path: Path, victim: int, code: str, persistent: bool, big: bool = False
) -> None:
    results = run_ranks(2, _group_faults, str(tmp_path), victim, CODES[code], persistent, big, limit=600)
    assert sorted(results) == [0, 1], results
    calls = results[victim]["calls"]
    assert calls > 5, results
    if big:  # the saves were incremental: each rank's blobs in a folder of its own
        assert sorted(os.listdir(tmp_path / "n1" / "aiosnap-blobs")) == ["rank_00000", "rank_00001"]
    for n in range(1, calls + 1):
        for rank in (0, 1):
            outcome = results[rank]["outcomes"][n - 1]
            assert outcome is None or aiosnap.storage.TEMP_PREFIX not in outcome, outcome
        try:
            asyncio.run(_check_group_dir(tmp_path / f"n{n}"))
        except AssertionError as exc:
            exc.add_note(f"rank {victim}: {code} {'from' if persistent else 'at'} call {n} of {calls}")
            raise


async def _check_group_dir(directory: Path) -> None:
    """A process on its own reopens the directory and restores the old step or the new."""
    async with aiosnap.CheckpointManager(str(directory)) as mgr:
        leftovers = [p for p in directory.rglob(f"{aiosnap.storage.TEMP_PREFIX}*")]
        assert leftovers == []
        restored = await mgr.restore()
        assert restored.step in (1, 2)
        assert_state(restored.state, restored.step)
        assert bool((restored.state["d"] == float(restored.step)).all())
        assert await mgr.steps() == [restored.step] or await mgr.steps() == [1, 2]
        for step in await mgr.steps():  # each whole: no reference to a missing blob
            await aiosnap.verify(str(directory / mgr.filename(step)))


@pytest.mark.parametrize(
    ("code", "persistent"), [("EIO", True), ("ENOSPC", False)], ids=["EIO-persistent", "ENOSPC-once"]
)
@pytest.mark.parametrize("victim", [0, 1])
def test_a_fault_at_every_call_of_a_group_commit_keeps_a_whole_checkpoint(
    tmp_path: Path, victim: int, code: str, persistent: bool
) -> None:
    _faults_in_a_group_commit(tmp_path, victim, code, persistent)


@pytest.mark.parametrize("victim", [0, 1])
def test_a_fault_at_every_call_of_an_incremental_group_commit_keeps_every_blob_referred_to(
    tmp_path: Path, victim: int
) -> None:
    # Each rank writes its blobs, then its file; rank 0 the manifest; retention drops step 1
    # and each rank collects its own blob folder.
    _faults_in_a_group_commit(tmp_path, victim, "ENOSPC", False, big=True)


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True], ids=["once", "persistent"])
@pytest.mark.parametrize("code", sorted(CODES))
@pytest.mark.parametrize("victim", [0, 1])
def test_every_fault_at_every_call_of_a_group_commit(
    tmp_path: Path, victim: int, code: str, persistent: bool
) -> None:
    _faults_in_a_group_commit(tmp_path, victim, code, persistent)


async def _seed_only(rank: int, world: int, directory: str) -> Any:
    await _group_seed(directory)
    return {}


async def _group_crash(rank: int, world: int, directory: str, victim: int, n: int) -> Any:
    """The group commit of step 2, the victim dying before its ``n``-th call (n=0: never;
    it counts them)."""

    def hook(op: str, path: str) -> None:
        calls.append(op)
        if len(calls) == n:
            os._exit(137)

    calls: list[str] = []
    posix = HookedPosix(hook) if rank == victim else None
    try:
        await _group_flow(rank, directory, aiosnap.storage.LocalStorage(posix=posix))
    except aiosnap.errors.RankFailedError:
        return {"survived": True}
    return {"calls": len(calls)}


def _crash_group_commit(tmp_path: Path, victim: int, every: int) -> None:
    seeded = tmp_path / "seed"
    assert sorted(run_ranks(2, _seed_only, str(seeded))) == [0, 1]
    shutil.copytree(seeded, tmp_path / "count")
    total = run_ranks(2, _group_crash, str(tmp_path / "count"), victim, 0)[victim]["calls"]
    assert total > 5
    for n in range(1, total + 1, every):
        directory = tmp_path / f"n{n}"
        shutil.copytree(seeded, directory)
        run_ranks(2, _group_crash, str(directory), victim, n, limit=120)
        try:
            asyncio.run(_check_group_dir(directory))
        except AssertionError as exc:
            exc.add_note(f"rank {victim} crashed before call {n} of {total}")
            raise


@pytest.mark.parametrize(("victim", "every"), [(0, 5), (1, 2)])
def test_a_crash_at_calls_of_a_group_commit_leaves_the_old_or_the_new_step(
    tmp_path: Path, victim: int, every: int
) -> None:
    """Every second call of rank 1's part, every fifth of rank 0's (all of them: the slow
    test below, in nox -s slow)."""
    _crash_group_commit(tmp_path, victim, every)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_crash_at_every_call_of_a_group_commit_leaves_the_old_or_the_new_step(
    tmp_path: Path, victim: int
) -> None:
    _crash_group_commit(tmp_path, victim, 1)
