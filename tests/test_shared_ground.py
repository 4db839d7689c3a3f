"""A checkpoint directory is shared ground: aiosnap never deletes, follows or overwrites
what it did not write, and whatever it finds there (stray directories, symbolic links,
files of other formats, odd names) never costs a checkpoint or a resume.

Each test here was a defect of wave 2 (issue 28): it fails with the fix taken out.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import pickle
import subprocess
import sys
import zipfile
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aiosnap
from aiosnap._manager.catalog import INDEX_NAME
from aiosnap.cli import main as cli_main

from .faults import HookedPosix, target_of
from .test_distributed import run_ranks


def state(step: int, size: int = 256) -> dict[str, Any]:
    return {"x": torch.full((size,), float(step)), "step": step}


def own_files(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("snapshot_iter_"))


async def save_steps(directory: Path, steps: list[int], **options: Any) -> None:
    async with aiosnap.CheckpointManager(str(directory), **options) as mgr:
        for step in steps:
            await (await mgr.save(step, state(step))).wait()


def strays_warned(caplog: pytest.LogCaptureFixture, *names: str) -> bool:
    """Whether one warning named every one of ``names`` as left alone."""
    return any(
        r.levelno == logging.WARNING
        and "left alone" in r.getMessage()
        and all(n in r.getMessage() for n in names)
        for r in caplog.records
    )


def user_directory(parent: Path, name: str) -> Path:
    """A user's directory of notes, outside any checkpoint directory."""
    notes = parent / name
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    (notes / "rank_00000").write_bytes(b"not a checkpoint")
    return notes


# -- 1. what aiosnap did not write is never deleted, and never switches the layout -------------
@pytest.mark.parametrize("how", ["directory", "symlink"])
async def test_a_directory_named_like_a_checkpoint_is_left_alone(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    await save_steps(run, [1, 2])
    if how == "directory":
        notes = user_directory(run, "snapshot_iter_0")
    else:
        notes = user_directory(tmp_path, "elsewhere")
        (run / "snapshot_iter_0").symlink_to(notes, target_is_directory=True)
    async with aiosnap.CheckpointManager(str(run), keep=aiosnap.retention.KeepLast(2)) as mgr:
        assert await mgr.steps() == [1, 2]  # the file checkpoints are still seen
        assert (await mgr.restore()).step == 2
        await (await mgr.save(3, state(3))).wait()
        assert (run / "snapshot_iter_3").is_file()  # still a file per step
        assert await mgr.steps() == [2, 3]
    assert (notes / "notes.txt").read_text() == "mine" and (notes / "rank_00000").exists()
    assert strays_warned(caplog, "snapshot_iter_0")


def test_prune_leaves_a_directory_named_like_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    asyncio.run(save_steps(tmp_path, [1, 2, 3]))
    notes = user_directory(tmp_path, "snapshot_iter_0")
    assert cli_main(["prune", str(tmp_path), "--keep-last", "1"]) == 0
    capsys.readouterr()
    assert own_files(tmp_path) == ["snapshot_iter_0", "snapshot_iter_3"]
    assert (notes / "notes.txt").read_text() == "mine" and (notes / "rank_00000").exists()


async def test_a_file_named_like_a_checkpoint_is_neither_listed_nor_deleted_nor_overwritten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await save_steps(tmp_path, [2])
    (tmp_path / "snapshot_iter_1").write_text("a user's file, older than every checkpoint")
    (tmp_path / "snapshot_iter_5").write_text("a user's file, of a step to come")
    async with aiosnap.CheckpointManager(str(tmp_path), keep=aiosnap.retention.KeepLast(1)) as mgr:
        assert await mgr.steps() == [2]
        await (await mgr.save(3, state(3))).wait()  # retention: step 2 goes, the user's file stays
        with pytest.raises(aiosnap.errors.ForeignFileError, match="snapshot_iter_5.*did not write"):
            await mgr.save(5, state(5))
        assert await mgr.steps() == [3]
    assert (tmp_path / "snapshot_iter_1").read_text().startswith("a user's file")
    assert (tmp_path / "snapshot_iter_5").read_text().startswith("a user's file")
    assert own_files(tmp_path) == ["snapshot_iter_1", "snapshot_iter_3", "snapshot_iter_5"]
    assert strays_warned(caplog, "snapshot_iter_1", "snapshot_iter_5")


async def test_a_symlink_at_a_checkpoints_name_is_not_written_through(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / "snapshot_iter_3").symlink_to(target)
    async with aiosnap.CheckpointManager(str(run)) as mgr:
        assert await mgr.steps() == []
        with pytest.raises(aiosnap.errors.ForeignFileError, match="symbolic link"):
            await mgr.save(3, state(3))
        await (await mgr.save(4, state(4))).wait()
    assert target.read_text() == "keep me" and (run / "snapshot_iter_3").is_symlink()


async def _save_group_steps(rank: int, world: int, directory: str) -> None:
    async with aiosnap.CheckpointManager(directory) as mgr:
        for step in (1, 2):
            await (await mgr.save(step, state(step))).wait()


def group_run(directory: Path) -> None:
    """Step directories (a file per rank and a manifest), as a group writes them."""
    assert run_ranks(1, _save_group_steps, str(directory)) == {0: None}


async def test_retention_of_a_step_directory_never_follows_a_symlink_in_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    group_run(run)
    outside = user_directory(tmp_path, "outside")
    (run / "snapshot_iter_1" / "link").symlink_to(outside, target_is_directory=True)
    (run / "snapshot_iter_1" / "README").write_text("a user's note")
    async with aiosnap.CheckpointManager(str(run), keep=aiosnap.retention.KeepLast(1)) as mgr:
        await (await mgr.save(3, state(3))).wait()  # a group of one: step directories
        assert await mgr.steps() == [3]
    assert (outside / "notes.txt").read_text() == "mine" and (outside / "rank_00000").exists()
    # What aiosnap wrote in step 1 went; the user's things, and so the directory, stayed.
    assert sorted(os.listdir(run / "snapshot_iter_1")) == ["README", "link"]
    assert not (run / "snapshot_iter_2").exists()
    assert strays_warned(caplog, "snapshot_iter_1", "README", "link")
    async with aiosnap.CheckpointManager(str(run)) as mgr:
        assert await mgr.steps() == [3]


async def test_an_uncommitted_step_directory_holding_a_users_files_is_not_swept(tmp_path: Path) -> None:
    run = tmp_path / "run"
    group_run(run)
    notes = user_directory(run, "snapshot_iter_0")  # no manifest: "a save that never committed"
    async with aiosnap.CheckpointManager(str(run)) as mgr:
        assert await mgr.steps() == [1, 2]
        await (await mgr.save(3, state(3))).wait()  # sweeps uncommitted steps below 3
    assert (notes / "notes.txt").read_text() == "mine" and (notes / "rank_00000").exists()


# -- 2. the lock and the index are never written through a link ----------------------------------
@pytest.mark.parametrize("name", [".aiosnap.lock", INDEX_NAME])
async def test_a_symlink_for_the_lock_or_the_index_is_refused(tmp_path: Path, name: str) -> None:
    target = tmp_path / "precious"
    target.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    if name == INDEX_NAME:
        await save_steps(run, [1])
        (run / name).unlink()
    (run / name).symlink_to(target)
    with pytest.raises(aiosnap.errors.ForeignFileError, match=f"{name}.*symbolic link"):
        async with aiosnap.CheckpointManager(str(run)):
            pass
    assert target.read_text() == "keep me" and (run / name).is_symlink()
    if name == INDEX_NAME:  # a reader reads the directory without it
        async with aiosnap.CheckpointManager(str(run), read_only=True) as reader:
            assert await reader.steps() == [1]


async def test_a_directory_for_the_lock_is_refused(tmp_path: Path) -> None:
    (tmp_path / ".aiosnap.lock").mkdir()
    with pytest.raises(aiosnap.errors.ForeignFileError, match="directory"):
        async with aiosnap.CheckpointManager(str(tmp_path)):
            pass


# -- 3. names and steps ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    [
        ".aiosnap-tmp-{step}",
        ".aiosnap.lock{step}",
        "aiosnap-index{step}",
        "../{step}",
        "/abs/{step}",
        "a/{step}",
        "{step}/../x",
        "{step}_{step}",
        "{step}{rank}x/",
        "snap{step:05d}",
        "no_step",
    ],
)
def test_a_name_that_would_not_read_back_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="name"):
        aiosnap.CheckpointManager(str(tmp_path), name=name)


@pytest.mark.parametrize("step", [-1, True, 2.5, "3", None])
async def test_a_step_that_is_not_a_non_negative_int_is_refused(tmp_path: Path, step: Any) -> None:
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            await mgr.save(step, state(0))
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            await mgr.restore(step if step is not None else -2)
        await (await mgr.save(np.int64(4), state(4))).wait()  # a NumPy integer is an int
        assert await mgr.steps() == [4]
    assert own_files(tmp_path) == ["snapshot_iter_4"]


async def test_a_name_whose_fields_run_together_is_refused_at_the_save(tmp_path: Path) -> None:
    async with aiosnap.CheckpointManager(str(tmp_path), name="s{step}{epoch}") as mgr:
        with pytest.raises(ValueError, match="reads back as another step"):
            await mgr.save(1, state(1), epoch=23)  # "s123": step 12, epoch 3
        await (await mgr.save(1, state(1), epoch=0)).wait()  # "s10" reads back as step 1, epoch 0?
    async with aiosnap.CheckpointManager(str(tmp_path), name="s{step}{epoch}") as mgr:
        assert await mgr.steps() == [1]


@pytest.mark.parametrize("filename", ["../escape", "/abs", ".", "..", ".aiosnap-tmp-x", "a/b", ""])
async def test_a_writer_refuses_a_filename_outside_its_directory(tmp_path: Path, filename: str) -> None:
    inside = tmp_path / "out"
    inside.mkdir()
    async with aiosnap.QueueWriter() as writer:
        with pytest.raises(ValueError, match="filename"):
            await writer(filename, str(inside), state(1))
    assert os.listdir(inside) == [] and sorted(os.listdir(tmp_path)) == ["out"]


async def test_a_committed_step_is_not_overwritten_unless_asked(tmp_path: Path) -> None:
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        await (await mgr.save(3, state(3))).wait()
        with pytest.raises(
            aiosnap.errors.StepExistsError, match="step 3 is committed already.*overwrite=True"
        ):
            await mgr.save(3, state(30), force=True)
        assert (await mgr.restore()).state["x"][0] == 3
        await (await mgr.save(3, {"x": torch.full((4,), 30.0), "step": 3}, overwrite=True)).wait()
        assert (await mgr.restore()).state["x"][0] == 30


# -- 4. a newest file that is not a checkpoint never blocks a resume ---------------------------------
def foreign_bytes(kind: str, tmp_path: Path) -> bytes:
    if kind == "zeros":
        return bytes(4096)
    if kind == "text":
        return b"step 9 went well\n" * 10
    if kind == "zip":
        path = tmp_path / "z.zip"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("a.txt", "hello")
        return path.read_bytes()
    if kind == "pickle":
        return pickle.dumps({"step": 9})
    path = tmp_path / "a.npy"
    np.save(path, np.arange(10))
    return path.read_bytes()


KINDS = ["zeros", "text", "zip", "pickle", "npy"]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_foreign_newest_file_is_skipped_with_a_warning(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    await save_steps(run, [1, 2])
    (run / "snapshot_iter_9").write_bytes(foreign_bytes(kind, tmp_path))
    async with aiosnap.CheckpointManager(str(run)) as mgr:
        assert await mgr.steps() == [1, 2]
        assert (await mgr.restore()).step == 2
    assert strays_warned(caplog, "snapshot_iter_9")


@pytest.mark.parametrize("kind", KINDS)
async def test_a_checkpoint_replaced_by_another_format_falls_back_with_a_warning(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    await save_steps(run, [1, 2], keep=aiosnap.retention.KeepLast(5))
    (run / "snapshot_iter_2").write_bytes(foreign_bytes(kind, tmp_path))  # the index still lists it
    async with aiosnap.CheckpointManager(str(run), keep=aiosnap.retention.KeepLast(5)) as mgr:
        restored = await mgr.restore()
        assert restored.step == 1 and restored.state["step"] == 1
        assert await mgr.steps() == [1]
        await (await mgr.save(3, state(3))).wait()
    assert (run / "snapshot_iter_2").read_bytes() == foreign_bytes(kind, tmp_path)  # never deleted
    assert any(
        "snapshot_iter_2" in r.getMessage() and "falling back" in r.getMessage() for r in caplog.records
    )


# -- 10. what allow_pickle trusts -------------------------------------------------------------------
class _Planted:
    """A pickle that runs code when unpickled: it creates the file ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


async def test_a_manager_never_unpickles_a_file_it_did_not_write(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    marker = tmp_path / "code-ran"
    async with aiosnap.CheckpointManager(str(run), allow_pickle=True) as mgr:
        for step in (1, 2):
            await (await mgr.save(step, {"x": torch.ones(2), "obj": {"a": (1, 2)}})).wait()
    # A co-tenant of the directory swaps step 2 for a torch.save file (the index lists it).
    torch.save({"x": _Planted(str(marker))}, run / "snapshot_iter_2")
    (run / "snapshot_iter_3").write_bytes((run / "snapshot_iter_2").read_bytes())  # and plants a step 3
    async with aiosnap.CheckpointManager(str(run), allow_pickle=True) as mgr:
        assert (await mgr.restore()).step == 1
    assert not marker.exists()
    # aiosnap.load trusts the file it is pointed at, with the opt-in: that is its contract.
    with pytest.raises(aiosnap.errors.PickleNotAllowedError):
        await aiosnap.load(str(run / "snapshot_iter_2"))
    await aiosnap.load(str(run / "snapshot_iter_2"), allow_pickle=True)
    assert marker.exists()


# -- 6. a cancelled save is either not written at all, or indexed and rotated like any other -------
async def cancel_at(coro: Coroutine[Any, Any, Any], k: int, *, waiting: bool) -> Any:
    """Run ``coro`` as a task would, and cancel it at its ``k``-th suspension: while it
    waits (``waiting``), or just as what it waited for has finished, before it resumes (the
    moment a plain ``task.cancel()`` from elsewhere can land, and a sleep cannot aim at).
    Returns the coroutine's result, or None if it ran to the end before ``k``."""
    n, value, error = 0, None, None
    while True:
        try:
            yielded = coro.throw(error) if error is not None else coro.send(value)
        except StopIteration as stop:
            return stop.value
        value, error, n = None, None, n + 1
        if n == k and waiting and isinstance(yielded, asyncio.Future):
            yielded.cancel()
        if isinstance(yielded, asyncio.Future):
            await asyncio.wait({yielded})
        else:
            await asyncio.sleep(0)
        if n == k:
            error = asyncio.CancelledError()


async def suspensions(coro: Coroutine[Any, Any, Any]) -> int:
    n = 0
    while True:
        try:
            yielded = coro.send(None)
        except StopIteration:
            return n
        n += 1
        await (asyncio.wait({yielded}) if isinstance(yielded, asyncio.Future) else asyncio.sleep(0))


@pytest.mark.parametrize("waiting", [False, True], ids=["as-it-resumes", "while-waiting"])
async def test_a_save_cancelled_at_any_await_leaves_no_file_the_manager_does_not_know(
    tmp_path: Path, waiting: bool
) -> None:
    big = {"x": torch.randn(1 << 20), "step": 0}  # 4 MiB: the capture takes a while
    async with aiosnap.CheckpointManager(str(tmp_path), keep=aiosnap.retention.KeepLast(2)) as mgr:
        total = await suspensions(mgr.save(0, big))
        await mgr.flush()
        assert total >= 1
        step, cancelled = 1, 0
        for k in range(1, total + 1):
            try:
                await cancel_at(mgr.save(step, big), k, waiting=waiting)
            except asyncio.CancelledError:
                cancelled += 1
            step += 1
        await mgr.flush()
        known = await mgr.steps()
    assert cancelled > 0
    on_disk = own_files(tmp_path)
    assert on_disk == [f"snapshot_iter_{s}" for s in known] and len(known) <= 2, (on_disk, known)
    assert [n for n in os.listdir(tmp_path) if n.startswith(aiosnap.storage.TEMP_PREFIX)] == []
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert [c["step"] for c in index["checkpoints"]] == known


# -- 7. a reader beside a rotating writer ----------------------------------------------------------------
async def test_a_read_only_manager_follows_a_rotating_writer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with aiosnap.CheckpointManager(str(tmp_path), keep=aiosnap.retention.KeepLast(2)) as writer:
        await (await writer.save(1, state(1))).wait()
        async with aiosnap.CheckpointManager(str(tmp_path), read_only=True) as reader:
            for step in range(2, 7):
                await (await writer.save(step, state(step))).wait()
                assert await reader.steps() == await writer.steps() == [step - 1, step]
                assert await reader.latest_step() == step
                restored = await reader.restore()
                assert (restored.step, restored.state["step"]) == (step, step)
            assert [r.step for r in await reader.records()] == [5, 6]
    assert not any("failed verification" in r.getMessage() for r in caplog.records)


# -- 8. the index failing after a commit ------------------------------------------------------------------
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
async def test_an_index_that_cannot_be_written_changes_nothing_retention_does(
    tmp_path: Path, code: int
) -> None:
    await save_steps(tmp_path, [1])
    index = str(tmp_path / INDEX_NAME)
    armed = [False]

    def hook(op: str, path: str) -> None:
        if armed[0] and op == "write" and target_of(path) == index:
            raise OSError(code, os.strerror(code), path)

    storage = aiosnap.storage.LocalStorage(posix=HookedPosix(hook))
    async with aiosnap.CheckpointManager(
        str(tmp_path), keep=aiosnap.retention.KeepLast(1), storage=storage
    ) as mgr:
        armed[0] = True
        handle = await mgr.save(2, state(2))
        with pytest.raises(aiosnap.errors.IndexWriteError, match="checkpoint was committed") as raised:
            await handle.wait()
        assert raised.value.errno == code and isinstance(raised.value.__cause__, OSError)
        assert await mgr.steps() == [2]  # committed, and step 1 went as KeepLast(1) says
        armed[0] = False
    assert own_files(tmp_path) == ["snapshot_iter_2"]
    async with aiosnap.CheckpointManager(str(tmp_path), keep=aiosnap.retention.KeepLast(1)) as mgr:
        assert await mgr.steps() == [2]  # nothing came back from beyond KeepLast
        assert (await mgr.restore()).step == 2


# -- 11. the lock dies with its holder, whatever its forked children do ---------------------------------
_HOLDER = r"""
import asyncio, os, sys, torch
import torch.utils.data._utils.worker as worker
import aiosnap

# A worker checks every MP_STATUS_CHECK_INTERVAL (5 s) that its parent lives, and exits if
# not: the test, however slow, must find them alive after the holder's death.
worker.MP_STATUS_CHECK_INTERVAL = 3600.0

class Data(torch.utils.data.Dataset):
    def __len__(self): return 64
    def __getitem__(self, i): return torch.tensor(i)

async def main():
    mgr = aiosnap.CheckpointManager(sys.argv[1])
    await mgr.__aenter__()
    loader = torch.utils.data.DataLoader(
        Data(), batch_size=4, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
    )
    it = iter(loader)
    next(it)
    print(" ".join(str(w.pid) for w in it._workers), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_the_lock_is_released_when_its_holder_dies_though_its_dataloader_workers_live(
    tmp_path: Path,
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    workers: list[int] = []
    try:
        assert holder.stdout is not None
        workers = [int(pid) for pid in holder.stdout.readline().split()]
        assert len(workers) == 2
        holder.kill()
        holder.wait()
        for pid in workers:
            os.kill(pid, 0)  # the workers outlive their parent for a while: they still run

        async def reopen() -> list[int]:
            async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
                return await mgr.steps()

        assert asyncio.run(reopen()) == []
        for pid in workers:
            os.kill(pid, 0)  # and the lock was free while they still held its descriptor
    finally:
        holder.kill()
        for pid in workers:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
