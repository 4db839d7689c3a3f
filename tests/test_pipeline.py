"""The pipelined commit: the disk receives a save's first pieces while later ones are copied.

The overlap is proved without timing. The last leaf of the state is on a fake device whose
copy lands only once the disk has received bytes of the same save: a writer that commits
after its capture would never get there. The 120 s waits bound a deadlock; nothing is timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest
import torch

import aiosnap
from aiosnap._save import stage as _stage

from .conftest import temp_files
from .fake_device import FakeDevice
from .faults import HookedPosix

MiB = 1 << 20
GUARD = 120.0  # seconds: a deadlock bound, never a point to synchronise on


class GatedDevice(FakeDevice):
    """Device copies whose last lands only once ``wrote`` is set (the disk got bytes of
    the save), then once ``gate`` is set; or fails then with ``error``."""

    def __init__(self, tensors: list[torch.Tensor], wrote: threading.Event) -> None:
        super().__init__(tensors)
        self.wrote, self.gate = wrote, threading.Event()
        self.gate.set()
        self.error: BaseException | None = None
        self.overlapped: list[bool] = []
        self.wait_for_disk = True

    def _land(self, landed: Any) -> None:
        if any(landed(token) and token == self.started for token, _, _ in self.pending):
            self.overlapped.append(self.wrote.wait(GUARD if self.wait_for_disk else 0))
            assert self.gate.wait(GUARD), "the test never opened the gate"
            if self.error is not None:
                raise self.error
        super()._land(landed)


class Disk:
    """A LocalStorage that reports the first write into each checkpoint's temp file and
    the order of the renames; ``fail_writes`` makes writes fail (EIO)."""

    def __init__(self) -> None:
        self.wrote = threading.Event()
        self.renamed: list[str] = []
        self.fail_writes = False
        self.storage = aiosnap.storage.LocalStorage(posix=HookedPosix(self._hook))

    def _hook(self, op: str, path: str) -> None:
        if op == "write" and os.path.basename(path).startswith("ckpt"):
            self.wrote.set()
            if self.fail_writes:
                raise OSError(errno.EIO, "Input/output error (injected)", path)
        if op == "rename":
            self.renamed.append(os.path.basename(path))


def make_state(step: int) -> tuple[dict[str, Any], torch.Tensor]:
    gpu = torch.full((1 << 18,), float(step))  # 1 MiB "on the device", last in the tree
    # 40 MiB of host bytes ahead of it: two whole pieces of the commit's 16 MiB.
    return {"a_host": torch.full((10 << 20,), float(step)), "b_step": step, "z_gpu": gpu}, gpu


def next_state(step: int, fake: GatedDevice, disk: Disk) -> dict[str, Any]:
    """Step ``step``'s state, with its device tensor registered and the disk's signal reset."""
    state, gpu = make_state(step)
    fake.ids = {id(gpu)}
    disk.wrote.clear()
    return state


@contextlib.asynccontextmanager
async def after_first_save(
    tmp_path: Path, kind: type[Any] = aiosnap.QueueWriter
) -> AsyncIterator[tuple[Any, Disk, GatedDevice]]:
    """An open writer that has saved step 1 to ``ckpt``, through a gated fake device."""
    disk = Disk()
    fake = GatedDevice([], disk.wrote)
    async with kind(storage=disk.storage, device_copier=fake) as writer:
        await (await writer("ckpt", str(tmp_path), next_state(1, fake, disk))).wait()
        yield writer, disk, fake


async def assert_step(path: Path, step: int) -> None:
    loaded = await aiosnap.load(str(path))  # every checksum verified
    assert loaded["b_step"] == step
    assert bool((loaded["a_host"] == step).all()) and bool((loaded["z_gpu"] == step).all())


@pytest.mark.parametrize("kind", ["SimpleWriter", "StandardWriter", "QueueWriter"])
async def test_the_disk_receives_data_while_the_capture_is_still_copying(kind: str, tmp_path: Path) -> None:
    disk = Disk()
    state, gpu = make_state(1)
    fake = GatedDevice([gpu], disk.wrote)
    async with getattr(aiosnap, kind)(storage=disk.storage, device_copier=fake) as writer:
        for step in (1, 2):
            state = next_state(step, fake, disk)
            await (await writer("ckpt", str(tmp_path), state)).wait()
            await assert_step(tmp_path / "ckpt", step)
    assert fake.overlapped == [True, True], "the commit wrote nothing before the capture ended"
    assert temp_files(tmp_path) == []


async def test_pipeline_false_writes_nothing_before_the_capture_ends(tmp_path: Path) -> None:
    disk = Disk()
    state, gpu = make_state(1)
    fake = GatedDevice([gpu], disk.wrote)
    fake.wait_for_disk = False  # only look: did the disk get bytes before the copy landed?
    async with aiosnap.QueueWriter(storage=disk.storage, pipeline=False, device_copier=fake) as writer:
        await (await writer("ckpt", str(tmp_path), state)).wait()
    assert fake.overlapped == [False]
    await assert_step(tmp_path / "ckpt", 1)


async def test_device_copies_are_written_as_they_land(tmp_path: Path) -> None:
    # Four device tensors of 16 MiB: the disk gets the first ones before the last lands.
    disk = Disk()
    state = {f"d{i}": torch.full((4 << 20,), float(i)) for i in range(4)}
    fake = GatedDevice(list(state.values()), disk.wrote)
    async with aiosnap.QueueWriter(storage=disk.storage, device_copier=fake) as writer:
        await (await writer("ckpt", str(tmp_path), state)).wait()
    assert fake.overlapped == [True], "the commit waited for every device copy"
    loaded = await aiosnap.load(str(tmp_path / "ckpt"))
    assert all(bool((loaded[f"d{i}"] == i).all()) for i in range(4))


async def test_a_capture_failing_after_its_commit_started_leaves_the_previous_file(tmp_path: Path) -> None:
    async with after_first_save(tmp_path) as (writer, disk, fake):
        state = next_state(2, fake, disk)
        fake.error = RuntimeError("the device copy failed")
        with pytest.raises(RuntimeError, match="the device copy failed"):
            await writer("ckpt", str(tmp_path), state)
        assert fake.overlapped == [True, True]
        await writer.flush()  # reported once, to the caller: not again
        assert writer.take_failures() == []
        assert temp_files(tmp_path) == []
        await assert_step(tmp_path / "ckpt", 1)
        fake.error = None
        state = next_state(3, fake, disk)
        await (await writer("ckpt", str(tmp_path), state)).wait()  # the writer goes on
    await assert_step(tmp_path / "ckpt", 3)
    assert disk.renamed == ["ckpt", "ckpt"]


async def test_a_caller_cancelled_after_its_commit_started_commits_nothing(tmp_path: Path) -> None:
    async with after_first_save(tmp_path) as (writer, disk, fake):
        state = next_state(2, fake, disk)
        fake.gate.clear()
        call = asyncio.create_task(writer("ckpt2", str(tmp_path), state))  # plain asyncio
        assert await anyio.to_thread.run_sync(disk.wrote.wait, GUARD), "the commit never started"
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        fake.gate.set()
        await writer.flush()
        assert writer.take_failures() == []
    assert not (tmp_path / "ckpt2").exists()
    assert temp_files(tmp_path) == []
    assert disk.renamed == ["ckpt"]
    await assert_step(tmp_path / "ckpt", 1)


async def test_a_commit_failing_while_the_capture_copies_is_reported_once(tmp_path: Path) -> None:
    async with after_first_save(tmp_path, aiosnap.StandardWriter) as (writer, disk, fake):
        state = next_state(2, fake, disk)
        disk.fail_writes = True  # the commit's first write fails, mid-capture
        handle = await writer("ckpt", str(tmp_path), state)
        with pytest.raises(OSError, match="Input/output error") as caught:
            await writer.flush()
        assert caught.value.filename == str(tmp_path / "ckpt")  # the user's path, not a temp file
        assert handle.done() and fake.overlapped == [True, True]
        disk.fail_writes = False
        state = next_state(3, fake, disk)
        await (await writer("ckpt", str(tmp_path), state)).wait()
    assert temp_files(tmp_path) == []
    await assert_step(tmp_path / "ckpt", 3)


async def test_saves_queued_behind_a_pipelined_commit_land_in_order(tmp_path: Path) -> None:
    disk = Disk()
    async with aiosnap.QueueWriter(max_pending=8, storage=disk.storage) as writer:
        handles = []
        for step in range(8):
            state = {"a_host": torch.full((6 << 20,), float(step)), "b_step": step}  # 24 MiB
            handles.append(await writer(f"ckpt{step}", str(tmp_path), state))
        for handle in handles:
            await handle.wait()
    assert disk.renamed == [f"ckpt{step}" for step in range(8)]
    for step in range(8):
        loaded = await aiosnap.load(str(tmp_path / f"ckpt{step}"))
        assert loaded["b_step"] == step and bool((loaded["a_host"] == step).all())


@pytest.mark.parametrize("pipeline", [True, False])
async def test_large_copies_are_split_with_a_helper_thread_and_land_whole(
    pipeline: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sizes about the split threshold, odd ones, and a leaf copied in 64 MiB chunks when
    # pipelined. The copies are only watched (the real np.copyto does them): the second
    # half of every large one must be copied on the helper thread, and every byte land.
    threads: set[str] = set()
    copyto = np.copyto

    def watched(dst: Any, src: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(dst, "nbytes", 0) >= _stage._SPLIT_MIN // 2:
            threads.add(threading.current_thread().name)
        copyto(dst, src, *args, **kwargs)

    sizes = [_stage._SPLIT_MIN - 1, _stage._SPLIT_MIN, _stage._SPLIT_MIN + 4097, _stage._CHUNK + 3 * MiB + 5]
    generator = torch.Generator().manual_seed(7)
    state = {f"t{n}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in sizes}
    monkeypatch.setattr(np, "copyto", watched)
    async with aiosnap.QueueWriter(pipeline=pipeline) as writer:
        await (await writer("ckpt", str(tmp_path), state)).wait()
    monkeypatch.undo()
    assert any(name.startswith("aiosnap-side") for name in threads), threads
    assert any(not name.startswith("aiosnap-side") for name in threads), threads
    loaded = await aiosnap.load(str(tmp_path / "ckpt"))
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.parametrize("pipeline", [True, False])
async def test_a_failed_copy_on_the_helper_fails_the_save_and_keeps_the_previous_checkpoint(
    pipeline: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"w": torch.zeros(2 * _stage._SPLIT_MIN // 4)}  # split: its second half goes to the helper
    copyto = np.copyto

    def failing_on_the_helper(dst: Any, src: Any, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name.startswith("aiosnap-side"):
            raise OSError(errno.EIO, "injected on the helper")
        copyto(dst, src, *args, **kwargs)

    async with aiosnap.QueueWriter(pipeline=pipeline) as writer:
        await (await writer("ckpt", str(tmp_path), state)).wait()
        state["w"] += 1
        monkeypatch.setattr(np, "copyto", failing_on_the_helper)
        with pytest.raises(OSError, match="injected on the helper"):
            await (await writer("ckpt", str(tmp_path), state)).wait()
        monkeypatch.undo()
        await (await writer("next", str(tmp_path), state)).wait()  # the writer goes on
    assert bool((await aiosnap.load(str(tmp_path / "ckpt")))["w"].eq(0).all())
    assert bool((await aiosnap.load(str(tmp_path / "next")))["w"].eq(1).all())
    assert temp_files(tmp_path) == []
