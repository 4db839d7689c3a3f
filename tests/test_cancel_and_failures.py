"""Cancellation at every await, I/O errors, and an event loop that never stalls."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import subprocess
import sys
import textwrap
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap
from aiosnap._base.heap import release

from .conftest import temp_files


async def _value(path: Path) -> float:
    x = (await aiosnap.load(str(path)))["x"]
    assert bool((x == x[0]).all()), "a torn checkpoint: values from two moments"
    return float(x[0])


async def test_cancel_at_every_await_commits_whole_or_nothing(
    make_writer: Callable[[], Any], tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    await aiosnap.save(str(path), {"x": torch.zeros(4096)})
    cancelled_at = []
    async with make_writer() as writer:
        for k in range(5000):
            state = {"x": torch.full((4096,), float(k + 1))}

            async def save(state: dict[str, torch.Tensor] = state) -> None:
                handle = await writer("ckpt", str(tmp_path), state)
                await handle.wait()

            task = asyncio.create_task(save())
            for _ in range(k):
                await asyncio.sleep(0)
            finished = task.done()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            state["x"].fill_(-1.0)  # what the caller does after the cancel must never be saved
            await writer.flush()
            assert await _value(path) in (0.0, *range(1, k + 2))
            if finished:
                break
            cancelled_at.append(k)
    assert len(cancelled_at) >= 2, "the save finished before any await could be cancelled"
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("offload", ["thread", "process"])
async def test_asyncio_timeout_during_saves(offload: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    async with aiosnap.QueueWriter(offload=offload) as writer:  # type: ignore[arg-type]
        for i, timeout in enumerate([0, 1e-4, 5e-4, 1e-3, 3e-3, 1e-2, 0.1]):
            state = {"x": torch.full((1 << 18,), float(i + 1))}
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await (await writer("ckpt", str(tmp_path), state)).wait()
            state["x"].fill_(-1.0)
            await writer.flush()
            if path.exists():
                assert await _value(path) in range(1, i + 2)
    assert temp_files(tmp_path) == []


IO_ERROR_SCRIPT = textwrap.dedent(
    """
    import asyncio, resource, signal, sys
    import torch, aiosnap

    async def main(directory, offload):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        await aiosnap.save(directory + "/ckpt", {"x": torch.zeros(1000)})
        # A file-size limit makes write(2) fail with EFBIG, as a full disk fails with ENOSPC.
        # It goes on the process that writes: with offload="process", only the worker.
        limit = (1 << 20, 1 << 20)
        async with aiosnap.QueueWriter(offload=offload) as writer:
            if offload == "process":
                resource.prlimit(writer.worker_pid, resource.RLIMIT_FSIZE, limit)
            else:
                resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            handle = await writer("ckpt", directory, {"x": torch.ones(1 << 20)})
            try:
                await handle.wait()
            except OSError as exc:
                print("wait", type(exc).__name__, exc.errno)
            try:
                await writer.flush()
                print("flush: reported already")
            except OSError as exc:
                print("flush", type(exc).__name__, exc.errno)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.mark.parametrize("offload", ["thread", "process"])
def test_io_error_leaves_the_previous_checkpoint(offload: str, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", IO_ERROR_SCRIPT, str(tmp_path), offload],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split("\n")[:2] == ["wait OSError 27", "flush: reported already"], out.stderr
    assert aiosnap.load_sync(str(tmp_path / "ckpt"))["x"].eq(0).all()
    assert temp_files(tmp_path) == []


@contextlib.asynccontextmanager
async def loop_gaps() -> AsyncIterator[list[float]]:
    """Time between the wake-ups of a task that sleeps 2 ms at a time: a stalled loop
    shows as a long gap."""
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    try:
        yield gaps
    finally:
        stop.set()
        await tick


def _run_bytecode(ticks: list[float], count: int) -> None:
    while len(ticks) < count:
        sum(range(1000))


#: A stall is a gap this many times the longest gap of the baseline.
STALL_RATIO = 4.0


async def assert_loop_never_stalls(work: Callable[[int], Awaitable[object]], attempts: int = 5) -> None:
    """``work(i)`` must never stall the event loop. The work runs (again, on a fast
    machine) until the loop has ticked more than 20 times. The bound is a ratio to a
    baseline measured right after each attempt, on whatever machine this runs: the
    longest gap while a worker thread runs Python bytecode for as many of the loop's
    ticks as the work lasted (counted, not timed: on a fast machine a timed baseline
    got too few) -- the GIL hand-over and the scheduler's noise, with no long C call
    and nothing on the loop. A real stall (blocking work on the loop, a long C call holding the GIL) shows in
    every attempt; noise seldom twice, so an attempt within the bound passes."""
    seen = []
    for i in range(attempts):
        async with loop_gaps() as gaps:
            await work(i)
            while len(gaps) <= 20:  # on a fast machine, again: enough ticks to judge by
                await work(i)
        async with loop_gaps() as baseline:
            await asyncio.to_thread(_run_bytecode, baseline, len(gaps))
        seen.append((max(gaps) * 1000, max(baseline) * 1000))
        if max(gaps) <= STALL_RATIO * max(baseline):
            return
    raise AssertionError(f"the loop stalled in every attempt: (longest gap, baseline's) in ms: {seen}")


@pytest.mark.parametrize("offload", ["thread", "process"])
async def test_event_loop_never_stalls_during_a_256mib_save(offload: str, tmp_path: Path) -> None:
    state = {f"w{i}": torch.randn(1 << 22) for i in range(16)}  # 16 x 16 MiB
    async with aiosnap.QueueWriter(offload=offload) as writer:  # type: ignore[arg-type]

        async def save(i: int) -> None:
            await (await writer(f"ckpt{i}", str(tmp_path), state)).wait()

        await assert_loop_never_stalls(save)


async def test_event_loop_never_stalls_while_a_large_tree_is_captured(tmp_path: Path) -> None:
    # 20,000 small tensors, as in a large optimizer state: the tree walk itself is heavy.
    state = {"optimizer": {"state": {i: {"exp_avg": torch.randn(64), "step": i} for i in range(20_000)}}}
    async with aiosnap.QueueWriter() as writer:

        async def save(i: int) -> None:
            await (await writer(f"ckpt{i}", str(tmp_path), state)).wait()

        await assert_loop_never_stalls(save)
    loaded = await aiosnap.load(str(tmp_path / "ckpt0"), keys=["optimizer.state.19999"])
    assert loaded["optimizer"]["state"][19999]["step"] == 19999


async def test_event_loop_never_stalls_while_a_writer_closes_after_large_saves(tmp_path: Path) -> None:
    state = {f"w{i}": torch.randn(1 << 22) for i in range(16)}  # 256 MiB of arenas to free

    async def save_then_close(i: int) -> None:
        async with aiosnap.QueueWriter(max_pending=2) as writer:
            for j in range(3):
                await writer(f"ckpt{i}-{j}", str(tmp_path), state)

    await assert_loop_never_stalls(save_then_close)


async def test_event_loop_never_stalls_while_a_large_tree_is_loaded(tmp_path: Path) -> None:
    # The header, the tree and the rebuilt state are each 100,000s of objects: parsed,
    # collected and freed, they must never hold the GIL for long.
    state = {
        "optimizer": {
            "state": {i: {"exp_avg": torch.randn(64), "step": torch.tensor(i)} for i in range(20_000)}
        }
    }
    await aiosnap.save(str(tmp_path / "ckpt"), state)

    async def load(i: int) -> None:
        loaded = await aiosnap.load(str(tmp_path / "ckpt"))
        assert int(loaded["optimizer"]["state"][19_999]["step"]) == 19_999
        # What the caller drops is freed where it drops it: 20,000 tensors freed at this
        # function's return, on the loop, were a 30 ms gap of the test's own making.
        await asyncio.to_thread(release, loaded["optimizer"]["state"])
        await aiosnap.load_into(str(tmp_path / "ckpt"), state)

    await assert_loop_never_stalls(load)


async def test_a_loaded_state_joins_the_oldest_generation_and_older_garbage_is_collected(
    tmp_path: Path,
) -> None:
    class Cycle:
        def __init__(self) -> None:
            self.me = self

    state = {str(i): torch.randn(8) for i in range(2000)}
    await aiosnap.save(str(tmp_path / "ckpt"), state)
    gc.collect()
    garbage = Cycle()
    dead = weakref.ref(garbage)
    del garbage
    loaded = await aiosnap.load(str(tmp_path / "ckpt"))
    # A young collection will not traverse what the caller keeps (nor a full one be set
    # off by it); what was garbage before the load was not promoted with it.
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert id(loaded) in oldest and id(loaded["1999"]) in oldest
    assert dead() is None


async def test_a_load_leaves_the_objects_the_process_froze_frozen(tmp_path: Path) -> None:
    # gc.freeze() before forking data-loader workers keeps their pages shared; the
    # promotion of a loaded state (freeze, then unfreeze) must not thaw them.
    await aiosnap.save(str(tmp_path / "ckpt"), {str(i): torch.randn(8) for i in range(100)})
    marker: list[object] = []  # tracked: a frozen one is in no generation
    gc.freeze()
    try:
        assert all(o is not marker for o in gc.get_objects())
        await aiosnap.load(str(tmp_path / "ckpt"))
        assert all(o is not marker for o in gc.get_objects())
    finally:
        gc.unfreeze()
