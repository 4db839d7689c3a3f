"""The writer protocol: capture on call, handles, flush, aclose, failures, hooks."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aiosnap
from aiosnap._storage.posix import Posix

from .conftest import WAIT_CAP, assert_tree_equal, temp_files, training_state, wait_until
from .faults import HookedPosix


async def test_state_may_change_right_after_the_call(make_writer: Callable[[], Any], tmp_path: Path) -> None:
    big = torch.arange(1 << 20, dtype=torch.float32)
    state = {"big": big, "arr": np.ones(1000), "nested": {"list": [1, 2], "t": torch.zeros(3)}}
    async with make_writer() as writer:
        handle = await writer("ckpt", str(tmp_path), state)
        big.add_(1)
        state["arr"][:] = 7
        state["nested"]["list"].append(3)
        state["nested"]["t"].fill_(5)
        stats = await handle.wait()
    loaded = await aiosnap.load(str(tmp_path / "ckpt"))
    assert torch.equal(loaded["big"], torch.arange(1 << 20, dtype=torch.float32))
    assert (loaded["arr"] == 1).all()
    assert loaded["nested"]["list"] == [1, 2]
    assert torch.equal(loaded["nested"]["t"], torch.zeros(3))
    assert stats.bytes == (tmp_path / "ckpt").stat().st_size
    assert stats.total_s >= stats.stall_s > 0 and not stats.skipped
    assert temp_files(tmp_path) == []


async def test_training_state_round_trip(make_writer: Callable[[], Any], tmp_path: Path) -> None:
    state = training_state()
    async with make_writer() as writer:
        await writer("ckpt", str(tmp_path), state)
    fresh = training_state(seed=1)
    await aiosnap.load_into(str(tmp_path / "ckpt"), fresh)
    assert_tree_equal(state["model"].state_dict(), fresh["model"].state_dict())
    assert_tree_equal(state["optimizer"].state_dict(), fresh["optimizer"].state_dict())
    assert fresh["step"] == 7 and fresh["history"] == [0.5, 0.25]


async def test_flush_waits_for_every_accepted_save(tmp_path: Path) -> None:
    async with aiosnap.QueueWriter(max_pending=3) as writer:
        handles = [await writer(f"s{i}", str(tmp_path), {"x": torch.full((1000,), i)}) for i in range(5)]
        await writer.flush()
        assert all(h.done() for h in handles)
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"s{i}" for i in range(5)]


async def test_saves_to_one_file_commit_in_call_order(tmp_path: Path) -> None:
    async with aiosnap.QueueWriter(max_pending=4) as writer:
        async with asyncio.TaskGroup() as tg:
            for i in range(6):
                tg.create_task(writer("latest", str(tmp_path), {"i": torch.tensor(i)}))
                await asyncio.sleep(0)
    assert int((await aiosnap.load(str(tmp_path / "latest")))["i"]) == 5


async def test_skip_drops_new_saves_when_full(tmp_path: Path) -> None:
    gate = Gate()
    async with aiosnap.QueueWriter(max_pending=1, when_full="skip") as writer:
        writer.add_post_save_hook(gate)
        await writer("a", str(tmp_path), {"x": torch.ones(2)})
        await gate.entered.wait()  # "a" is committing: the queue is empty
        second = await writer("b", str(tmp_path), {"x": torch.ones(2)})
        third = await writer("c", str(tmp_path), {"x": torch.ones(2)})
        assert third.skipped and third.done() and (await third.wait()).skipped
        gate.open()
        assert not (await second.wait()).skipped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


async def test_replace_keeps_the_newest_waiting_save(tmp_path: Path) -> None:
    gate = Gate()
    async with aiosnap.QueueWriter(max_pending=1, when_full="replace") as writer:
        writer.add_post_save_hook(gate)
        await writer("a", str(tmp_path), {"x": torch.ones(2)})
        await gate.entered.wait()  # "a" is committing and holds at the hook
        b = await writer("b", str(tmp_path), {"x": torch.ones(2)})
        c = await writer("c", str(tmp_path), {"x": torch.ones(2)})
        assert b.skipped and not c.done()
        gate.open()
        assert not (await c.wait()).skipped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "c"]


async def test_block_waits_for_room(tmp_path: Path) -> None:
    gate = Gate()
    probe = CaptureProbe()
    async with aiosnap.QueueWriter(max_pending=1, when_full="block") as writer:
        writer.add_post_save_hook(gate)
        await writer("a", str(tmp_path), {"x": torch.ones(2)})
        await gate.entered.wait()  # "a" is committing: "b" fills the queue
        await writer("b", str(tmp_path), {"x": torch.ones(2)})
        blocked = asyncio.create_task(writer("c", str(tmp_path), {"x": torch.ones(2), "p": probe}))
        await settle()
        # No room: "c" waits before its capture starts, however long the commit holds.
        assert not blocked.done() and not probe.captured.is_set()
        gate.open()
        await (await blocked).wait()
        assert probe.captured.is_set()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]


class Gate:
    """A post-save hook that holds each commit until ``open()``; ``entered`` is set once
    a commit has reached it (so the consumer has taken that save off the queue)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self._open = asyncio.Event()

    async def __call__(self, stats: aiosnap.SaveStats) -> None:
        self.entered.set()
        await self._open.wait()

    def open(self) -> None:
        self._open.set()


class CaptureProbe:
    """A Stateful value: ``captured`` is set once a capture has called ``state_dict``."""

    def __init__(self) -> None:
        self.captured = threading.Event()

    def state_dict(self) -> dict[str, int]:
        self.captured.set()
        return {"probe": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


async def settle() -> None:
    """Let every task that can run without waiting for anything run."""
    for _ in range(100):
        await asyncio.sleep(0)


async def test_standard_writer_waits_for_the_previous_save(tmp_path: Path) -> None:
    order: list[str] = []
    gate = Gate()
    probe = CaptureProbe()

    async def hook(stats: aiosnap.SaveStats) -> None:
        order.append(Path(stats.path).name)

    async with aiosnap.ThreadWriter() as writer:
        writer.add_post_save_hook(gate)
        writer.add_post_save_hook(hook)
        first = await writer("a", str(tmp_path), {"x": torch.ones(2)})
        second = asyncio.create_task(writer("b", str(tmp_path), {"x": torch.ones(2), "p": probe}))
        await gate.entered.wait()
        await settle()
        # "a" is held at the gate: "b" has not even started its capture.
        assert not second.done() and not probe.captured.is_set()
        gate.open()
        await second
        assert first.done() and order == ["a"]
    assert order == ["a", "b"]


async def test_hooks_sync_and_async_see_the_stats(tmp_path: Path) -> None:
    seen: list[tuple[str, int]] = []

    def sync_hook(stats: aiosnap.SaveStats) -> None:
        seen.append(("sync", stats.bytes))

    async def async_hook(stats: aiosnap.SaveStats) -> None:
        seen.append(("async", stats.bytes))

    async with aiosnap.QueueWriter() as writer:
        writer.add_post_save_hook(sync_hook)
        writer.add_post_save_hook(async_hook)
        handle = await writer("a", str(tmp_path), {"x": torch.ones(2)})
        stats = await handle.wait()
    assert seen == [("sync", stats.bytes), ("async", stats.bytes)]


async def test_each_commit_logs_one_info_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="aiosnap"):
        async with aiosnap.QueueWriter() as writer:
            stats = await (await writer("ckpt", str(tmp_path), {"w": torch.ones(256)})).wait()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("saved ")]
    assert line.startswith(f"saved {tmp_path / 'ckpt'}: {stats.bytes} bytes, caller stalled ")
    assert "ms, durable after " in line


async def test_savefun_writes_the_captured_copy_durably(
    make_writer: Callable[[], Any], tmp_path: Path
) -> None:
    state = {"w": torch.arange(10.0), "meta": {"epoch": 3}, "obj": {1, 2}}
    async with make_writer() as writer:
        handle = await writer("ckpt.pt", str(tmp_path), state, savefun=torch.save)
        state["w"].zero_()
        await handle.wait()
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert torch.equal(loaded["w"], torch.arange(10.0))
    assert loaded["meta"] == {"epoch": 3} and loaded["obj"] == {1, 2}
    assert temp_files(tmp_path) == []


class Boom(Exception):
    pass


def failing_savefun(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        f.write(b"partial")
    raise Boom("disk on fire")


QUEUED = [
    pytest.param(lambda: aiosnap.ThreadWriter(), id="thread"),
    pytest.param(lambda: aiosnap.ProcessWriter(), id="process"),
    pytest.param(lambda: aiosnap.ThreadQueueWriter(), id="queue-thread"),
    pytest.param(lambda: aiosnap.ProcessQueueWriter(), id="queue-process"),
]


@pytest.mark.parametrize("make", QUEUED)
async def test_a_failure_seen_through_its_handle_is_not_raised_again(
    make: Callable[[], Any], tmp_path: Path
) -> None:
    (tmp_path / "ckpt").write_bytes(b"previous")
    async with make() as writer:
        handle = await writer("ckpt", str(tmp_path), {"x": torch.ones(3)}, savefun=failing_savefun)
        with pytest.raises(Boom, match="disk on fire") as info:
            await handle.wait()
        assert info.value.__cause__ is not None or writer.offload == "thread"
        # Reported once: the next save goes through, and nothing is left to report.
        await (await writer("next", str(tmp_path), {"x": torch.ones(3)})).wait()
        await writer.flush()
        assert writer.take_failures() == []
    assert (tmp_path / "ckpt").read_bytes() == b"previous"
    assert (await aiosnap.load(str(tmp_path / "next")))["x"].eq(1).all()
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("make", QUEUED)
async def test_the_next_call_reports_an_unseen_failure_and_keeps_its_own_save(
    make: Callable[[], Any], tmp_path: Path
) -> None:
    async with make() as writer:
        failed = await writer("ckpt", str(tmp_path), {"x": torch.ones(3)}, savefun=failing_savefun)
        await failed.outcome()  # finished, unseen by the caller
        state = {"x": torch.full((3,), 2.0)}
        with pytest.raises(Boom) as info:
            await writer("next", str(tmp_path), state)
        state["x"].zero_()  # the call had captured its state before it raised
        assert any("own save of" in n and "was accepted" in n for n in info.value.__notes__)
        await writer.flush()  # the accepted save commits; the failure is not raised twice
    assert (await aiosnap.load(str(tmp_path / "next")))["x"].eq(2).all()


async def test_take_failures_reports_them_once(tmp_path: Path) -> None:
    async with aiosnap.QueueWriter() as writer:
        handle = await writer("a", str(tmp_path), {"x": torch.ones(1)}, savefun=failing_savefun)
        await handle.outcome()
        (failure,) = writer.take_failures()
        assert failure.path == str(tmp_path / "a") and isinstance(failure.error, Boom) and failure.reported
        assert writer.take_failures() == []
        await (await writer("b", str(tmp_path), {"x": torch.ones(1)})).wait()
        await writer.flush()
    with pytest.raises(Boom):  # the handle still tells its own outcome
        await handle.wait()


@pytest.mark.parametrize("make", QUEUED)
async def test_failed_save_raises_from_flush(make: Callable[[], Any], tmp_path: Path) -> None:
    async with make() as writer:
        await writer("ckpt", str(tmp_path), {"x": torch.ones(3)}, savefun=failing_savefun)
        with pytest.raises(Boom):
            await writer.flush()
        await writer.flush()  # reported already
        await (await writer("next", str(tmp_path), {"x": torch.ones(3)})).wait()


@pytest.mark.parametrize("make", QUEUED)
async def test_failed_save_raises_from_aclose(make: Callable[[], Any], tmp_path: Path) -> None:
    with pytest.raises(Boom):
        async with make() as writer:
            await writer("ckpt", str(tmp_path), {"x": torch.ones(3)}, savefun=failing_savefun)
    await writer.aclose()  # idempotent, and the failure was already reported
    assert temp_files(tmp_path) == []


async def test_simple_writer_raises_from_the_call(tmp_path: Path) -> None:
    async with aiosnap.SimpleWriter() as writer:
        with pytest.raises(Boom):
            await writer("ckpt", str(tmp_path), {"x": torch.ones(3)}, savefun=failing_savefun)
        await writer.flush()


@pytest.mark.parametrize("make", QUEUED)
async def test_unwritable_directory_fails_without_hanging(make: Callable[[], Any], tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    async with make() as writer:
        handle = await writer("ckpt", str(blocker / "sub"), {"x": torch.ones(3)})
        with pytest.raises((NotADirectoryError, FileExistsError)):
            await handle.wait()
        await writer.flush()  # reported through the handle already
        await writer("ckpt", str(blocker / "sub"), {"x": torch.ones(3)})
        with pytest.raises(OSError, match=str(blocker)):  # unseen: flush reports it
            await writer.flush()


async def test_several_failures_are_all_reported(tmp_path: Path) -> None:
    accepted = threading.Event()

    def held_failing_savefun(obj: Any, path: str) -> None:
        assert accepted.wait(60), "the saves were never all accepted"
        failing_savefun(obj, path)

    with pytest.raises(Boom) as info:
        async with aiosnap.QueueWriter(max_pending=3) as writer:
            for i in range(3):
                await writer(f"c{i}", str(tmp_path), {"x": torch.ones(1)}, savefun=held_failing_savefun)
            accepted.set()  # all three saves are accepted before the first one fails
    assert any("2 more background save(s) failed" in n and "c2" in n for n in info.value.__notes__)


async def test_unsupported_values_are_refused_with_their_place(tmp_path: Path) -> None:
    async with aiosnap.QueueWriter() as writer:
        with pytest.raises(aiosnap.errors.UnsupportedTypeError, match=r"opt\.groups\.1"):
            await writer("c", str(tmp_path), {"opt": {"groups": [1, object()]}})
        with pytest.raises(aiosnap.errors.UnsupportedTypeError, match="contains itself"):
            loop: list[Any] = []
            loop.append(loop)
            await writer("c", str(tmp_path), {"loop": loop})
        with pytest.raises(aiosnap.errors.UnsupportedTypeError, match="key"):
            await writer("c", str(tmp_path), {("a", 1): 2})
    assert list(tmp_path.iterdir()) == []


async def test_pickle_is_opt_in_at_save_and_at_load(tmp_path: Path) -> None:
    state = {"obj": {1, 2, 3}, "t": torch.ones(2)}
    async with aiosnap.QueueWriter(allow_pickle=True) as writer:
        await writer("c", str(tmp_path), state)
    with pytest.raises(aiosnap.errors.PickleNotAllowedError, match="obj"):
        await aiosnap.load(str(tmp_path / "c"))
    assert (await aiosnap.load(str(tmp_path / "c"), allow_pickle=True))["obj"] == {1, 2, 3}
    assert torch.equal((await aiosnap.load(str(tmp_path / "c"), keys=["t"]))["t"], torch.ones(2))


async def test_writer_must_be_open(tmp_path: Path) -> None:
    writer = aiosnap.QueueWriter()
    with pytest.raises(aiosnap.errors.WriterClosedError, match="async with"):
        await writer("c", str(tmp_path), {})
    async with writer:
        pass
    with pytest.raises(aiosnap.errors.WriterClosedError):
        await writer("c", str(tmp_path), {})
    with pytest.raises(aiosnap.errors.WriterClosedError):
        async with writer:
            pass


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="offload"):
        aiosnap.QueueWriter(offload="fork")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="when_full"):
        aiosnap.QueueWriter(when_full="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_pending"):
        aiosnap.QueueWriter(max_pending=0)


async def test_memory_is_reused_across_saves(tmp_path: Path) -> None:
    state = {"x": torch.randn(1 << 18)}
    async with aiosnap.QueueWriter() as writer:
        for i in range(6):
            await (await writer(f"s{i}", str(tmp_path), state)).wait()
        assert writer.staging_memory().kept == 1  # one arena, handed from save to save


async def test_a_killed_worker_process_fails_one_save_and_is_replaced(tmp_path: Path) -> None:
    import os
    import signal

    async with aiosnap.ProcessQueueWriter() as writer:
        pid = writer.worker_pid
        assert pid is not None and aiosnap.ThreadQueueWriter().worker_pid is None
        os.kill(pid, signal.SIGKILL)
        await wait_until(lambda: _dead(pid), what="the worker's death")
        handle = await writer("a", str(tmp_path), {"x": torch.ones(3)})
        with pytest.raises(aiosnap.errors.WorkerCrashedError):
            await handle.wait()
        await writer.flush()  # reported through the handle
        await (await writer("b", str(tmp_path), {"x": torch.ones(3)})).wait()
    assert [p.name for p in tmp_path.iterdir()] == ["b"]


async def test_cancelling_wait_does_not_cancel_the_save(tmp_path: Path) -> None:
    gate = Gate()
    async with aiosnap.QueueWriter() as writer:
        writer.add_post_save_hook(gate)
        handle = await writer("a", str(tmp_path), {"x": torch.ones(3)})
        await gate.entered.wait()
        waiting = asyncio.create_task(handle.wait())
        await settle()
        waiting.cancel()  # the save is held at the gate: only the wait is cancelled
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.open()
        assert (await handle.wait()).bytes > 0


def _dead(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie until its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        # reaped between open and read: /proc answers ESRCH to the read
        return True


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_memory_stays_flat_across_20_saves(tmp_path: Path) -> None:
    state = {f"w{i}": torch.randn(1 << 20) for i in range(16)}  # 64 MiB
    async with aiosnap.QueueWriter() as writer:
        for i in range(20):
            await (await writer("ckpt", str(tmp_path), state)).wait()
            if i == 1:
                after_second = _rss()
        growth = _rss() - after_second
    assert growth < 8 << 20, f"RSS grew by {growth >> 20} MiB over 18 saves"


@pytest.mark.parametrize("offload", ["thread", "process"])
async def test_a_state_larger_than_the_budget_is_written_in_pieces(offload: str, tmp_path: Path) -> None:
    state = {"big": torch.randn(3 << 20), "t": torch.randn(64, 64).t(), "a": np.arange(10), "n": 3}  # 12 MiB
    async with aiosnap.QueueWriter(max_host_bytes=4 << 20, offload=offload) as writer:  # type: ignore[arg-type]
        handle = await writer("ckpt", str(tmp_path), state)
        assert handle.done()  # bounded memory: the save finished inside the call
        memory = writer.staging_memory()
        assert (memory.in_use, memory.kept, memory.kept_bytes) == (0, 0, 0)
        stats = await handle.wait()
        small = await writer("small", str(tmp_path), {"x": torch.ones(10)})
        await small.wait()
    assert stats.bytes == (tmp_path / "ckpt").stat().st_size
    loaded = await aiosnap.load(str(tmp_path / "ckpt"))
    assert torch.equal(loaded["big"], state["big"]) and torch.equal(loaded["t"], state["t"])
    assert (loaded["a"] == np.arange(10)).all() and loaded["n"] == 3
    assert temp_files(tmp_path) == []


async def test_queued_saves_count_against_the_budget(tmp_path: Path) -> None:
    gate = Gate()
    state = {"x": torch.randn(1 << 20)}  # 4 MiB: an arena of 5 MiB with the header
    async with aiosnap.QueueWriter(max_pending=3, max_host_bytes=12 << 20) as writer:
        writer.add_post_save_hook(gate)
        await writer("a", str(tmp_path), state)
        await writer("b", str(tmp_path), state)
        third = asyncio.create_task(writer("c", str(tmp_path), state))
        # Two arenas in use: the third waits for memory (in its staging thread) until one
        # is released.
        await wait_until(lambda: writer.staging_memory().waiting == 1)
        assert not third.done() and writer.staging_memory().in_use <= 12 << 20
        gate.open()
        await (await third).wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]


async def test_cancel_during_a_save_in_pieces_commits_nothing(tmp_path: Path) -> None:
    state = {f"w{i}": torch.randn(1 << 20) for i in range(16)}  # 64 MiB through a 2 MiB buffer
    writing, release = threading.Event(), threading.Event()

    def hold_the_first_write(op: str, path: str) -> None:
        if op == "write" and not writing.is_set():
            writing.set()
            assert release.wait(WAIT_CAP)

    storage = aiosnap.storage.LocalStorage(posix=HookedPosix(hold_the_first_write))
    async with aiosnap.QueueWriter(max_host_bytes=2 << 20, storage=storage) as writer:
        save = asyncio.create_task(writer("ckpt", str(tmp_path), state))
        assert await asyncio.to_thread(writing.wait, WAIT_CAP)  # the first piece is being written
        save.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await save
    assert not (tmp_path / "ckpt").exists() and temp_files(tmp_path) == []


class RecordingPosix(Posix):
    """The real calls; records each write as (O_DIRECT or not, offset, length)."""

    def __init__(self) -> None:
        self.direct: dict[int, bool] = {}
        self.writes: list[tuple[bool, int, int]] = []

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        self.direct[fd] = bool(flags & getattr(os, "O_DIRECT", 0))
        return fd

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        self.writes.append((self.direct.get(fd, False), offset, len(data)))
        return super().pwrite(fd, data, offset)


async def test_a_save_in_pieces_writes_whole_aligned_pieces_while_the_next_is_copied(tmp_path: Path) -> None:
    # Entries of odd sizes: every piece but the last is still a whole buffer, written
    # with O_DIRECT where the filesystem allows it.
    state = {f"w{i}": torch.randn((1 << 20) + 7 * i) for i in range(5)}  # ~20 MiB
    posix = RecordingPosix()
    storage = aiosnap.storage.LocalStorage(posix=posix)
    async with aiosnap.SimpleWriter(max_host_bytes=4 << 20, storage=storage) as writer:
        await writer("ckpt", str(tmp_path), state)
    loaded = await aiosnap.load(str(tmp_path / "ckpt"))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    data = [w for w in posix.writes if w[1] > 0]
    assert len(data) >= 10 and len({n for _, _, n in data[:-1]}) == 1  # pieces of 2 MiB
    if all(direct for direct, _, _ in posix.writes[:1]):  # O_DIRECT where the filesystem has it
        assert all(direct and off % 4096 == 0 and n % 4096 == 0 for direct, off, n in data[:-1])


async def test_a_one_call_save_of_a_large_state_streams_through_small_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import aiosnap._save.capture as capture

    budgets: list[int] = []
    streamed = capture.write_in_pieces

    def spy(layout: Any, upload: Any, budget: int, stop: Any) -> None:
        budgets.append(budget)
        streamed(layout, upload, budget, stop)

    monkeypatch.setattr(capture, "write_in_pieces", spy)
    state = {"big": torch.randn(12 << 20), "small": torch.ones(3)}  # 48 MiB
    await aiosnap.save(str(tmp_path / "ckpt"), state)
    await aiosnap.save(str(tmp_path / "tiny"), {"x": torch.ones(3)})  # staged whole
    assert budgets == [32 << 20]
    assert torch.equal((await aiosnap.load(str(tmp_path / "ckpt")))["big"], state["big"])
