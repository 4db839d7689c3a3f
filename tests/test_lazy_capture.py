"""Lazy capture: the save call returns once the tree is walked; the tensors are copied in
the background, and each optimizer's step waits for them (the guard).

The guard is proved without timing: a fake device starts its copies only once the training
thread is seen waiting inside the guard -- or, with no guard, once the step has finished --
so a step that was not held changes the tensors before they are copied, every time. Every
checkpoint is compared bit for bit with the state at its call.
"""

from __future__ import annotations

import asyncio
import copy
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import aiosnap
from aiosnap._save.guard import Guard

from .conftest import WAIT_CAP, assert_tree_equal, temp_files
from .fake_device import FakeDevice
from .test_distributed import ok, run_ranks

SEVEN = [
    aiosnap.SimpleWriter,
    aiosnap.StandardWriter,
    aiosnap.ThreadWriter,
    aiosnap.ProcessWriter,
    aiosnap.QueueWriter,
    aiosnap.ThreadQueueWriter,
    aiosnap.ProcessQueueWriter,
]


def make_state(seed: int = 0, width: int = 512) -> tuple[dict[str, Any], torch.Tensor]:
    """A model with a BatchNorm (its forward changes its statistics in place) and AdamW,
    one step in: ~6 MiB at the default width, every weight over the small-leaf size."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Linear(width, width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, width)
    state = {"model": model, "optimizer": opt, "history": [1.0], "step": 1}
    train(state, x)
    return state, x


def train(state: dict[str, Any], x: torch.Tensor) -> None:
    """One synchronous training step: forward, backward, ``optimizer.step()``."""
    model, opt = state["model"], state["optimizer"]
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    state["history"].append(float(state["step"]))  # a list changed after the call
    state["step"] += 1


def expected(state: dict[str, Any]) -> dict[str, Any]:
    """The state as a save of it now must hold it (tensors cloned)."""
    return copy.deepcopy(
        {
            "model": state["model"].state_dict(),
            "optimizer": state["optimizer"].state_dict(),
            "history": state["history"],
            "step": state["step"],
        }
    )


async def assert_saved(path: Path, want: dict[str, Any]) -> None:
    assert_tree_equal(await aiosnap.load(str(path)), want)


def hooks(state: dict[str, Any]) -> int:
    return len(state["optimizer"]._optimizer_step_pre_hooks)


class HeldDevice(FakeDevice):
    """The model's parameters are on this fake device. Each save's large copies wait for
    ``gate``; with ``hold_step``, the first then waits until the training thread is held
    by a guard (``waited`` gets "held") or, with none, until its step has run
    ("stepped"); then ``error``, if set, fails it."""

    def __init__(self, model: nn.Module, *, hold_step: bool = True) -> None:
        super().__init__([])
        self.ptrs = {p.data_ptr() for p in model.parameters()}
        self.trainer = threading.get_ident()
        self.gate, self.stepped = threading.Event(), threading.Event()
        self.gate.set()
        self.hold_step = hold_step
        self.waited: list[str] = []
        self.error: BaseException | None = None
        self.host_waits_on_trainer = 0
        self._first = True

    def start(self, src: torch.Tensor, dst: torch.Tensor, producers: Any) -> int:
        if self._first and src.nbytes >= 256 << 10:  # small ones are copied during the call
            self._first = False
            assert self.gate.wait(WAIT_CAP), "the test never opened the gate"
            if self.hold_step:
                self.waited.append(self._wait_for_the_step())
            if self.error is not None:
                raise self.error
        return super().start(src, dst, producers)

    def _wait_for_the_step(self) -> str:
        deadline = time.monotonic() + WAIT_CAP
        while time.monotonic() < deadline:
            if self._trainer_in_guard():
                return "held"
            if self.stepped.wait(0.001):
                return "stepped"
        raise AssertionError("no step came")

    def _trainer_in_guard(self) -> bool:
        frame = sys._current_frames().get(self.trainer)
        while frame is not None:
            if frame.f_code is Guard._hold.__code__:
                return True
            frame = frame.f_back
        return False

    def finish(self) -> None:
        self._first = True  # the next save waits again
        self.host_waits_on_trainer += threading.get_ident() == self.trainer
        super().finish()

    def wait(self, token: object) -> None:
        self.host_waits_on_trainer += threading.get_ident() == self.trainer
        super().wait(token)


@pytest.mark.parametrize("kind", SEVEN, ids=[k.__name__ for k in SEVEN])
async def test_a_lazy_save_holds_the_state_of_its_call(kind: type[Any], tmp_path: Path) -> None:
    state, x = make_state()
    async with kind(capture="lazy") as writer:
        assert writer.capture == "lazy"
        for i in range(2):
            want = expected(state)
            handle = await writer(f"c{i}", str(tmp_path), state)
            # The next step at once: its forward changes the BatchNorm statistics, its
            # step every weight and moment, the list grows.
            train(state, x)
            await handle.wait()
            await assert_saved(tmp_path / f"c{i}", want)
    assert hooks(state) == 0
    assert temp_files(tmp_path) == []


async def test_the_guard_holds_the_step_until_the_tensors_are_copied(tmp_path: Path) -> None:
    state, x = make_state()
    device = HeldDevice(state["model"])
    state["optimizer"].register_step_post_hook(lambda *args: device.stepped.set())
    async with aiosnap.QueueWriter(capture="lazy", device_copier=device) as writer:
        want = expected(state)
        handle = await writer("c", str(tmp_path), state)
        train(state, x)  # synchronous: held until the copies are queued
        await handle.wait()
    assert device.waited == ["held"], "the step ran before the tensors were copied"
    await assert_saved(tmp_path / "c", want)
    # On a device the step's work is ordered after the copies by the stream, from the
    # training thread, with no host synchronisation there (by the guard; and by the
    # copy-on-write window for each write it sees while the copies are pending).
    ordered = [c[2] for c in device.calls if c[0] == "order_after"]
    assert ordered and all(ordered)
    assert device.host_waits_on_trainer == 0
    assert hooks(state) == 0


async def test_no_hook_is_left_once_the_capture_is_done(tmp_path: Path) -> None:
    state, x = make_state()
    other = state["optimizer"].register_step_pre_hook(lambda *args: None)  # the user's own
    async with aiosnap.QueueWriter(capture="lazy") as writer:
        handle = await writer("a", str(tmp_path), state)
        train(state, x)  # a step, maybe while the guard is on (its removal is not in it)
        await handle.wait_captured()
        assert hooks(state) == 1
        handle = await writer("b", str(tmp_path), state)
        await handle.wait_captured()  # no step ran: removed all the same
        assert hooks(state) == 1
        train(state, x)
    other.remove()
    assert hooks(state) == 0


async def test_lazy_saves_in_flight_are_committed_in_order(tmp_path: Path) -> None:
    state, x = make_state()
    order: list[str] = []
    entered, release = asyncio.Event(), asyncio.Event()

    async def hold_the_first(stats: aiosnap.SaveStats) -> None:
        order.append(Path(stats.path).name)
        entered.set()
        await release.wait()

    wants = []
    async with aiosnap.QueueWriter(capture="lazy", max_pending=2) as writer:
        writer.add_post_save_hook(hold_the_first)
        handles = []
        for i in range(3):
            wants.append(expected(state))
            handles.append(await writer(f"c{i}", str(tmp_path), state))
            train(state, x)
            if i == 0:
                await entered.wait()  # c0 is committed; c1 and c2 queue behind it
        assert not any(h.done() for h in handles[1:])
        release.set()
        await writer.flush()
    assert order == ["c0", "c1", "c2"]
    for i, want in enumerate(wants):
        await assert_saved(tmp_path / f"c{i}", want)


async def test_a_failing_copy_fails_the_save_releases_the_step_and_is_reported(tmp_path: Path) -> None:
    state, x = make_state()
    device = HeldDevice(state["model"])
    device.error = RuntimeError("the device copy failed")
    async with aiosnap.QueueWriter(capture="lazy", device_copier=device) as writer:
        handle = await writer("c", str(tmp_path), state)
        train(state, x)  # held, then let go when the copy failed: no deadlock
        assert device.waited == ["held"]
        device.error, device.hold_step = None, False
        # Reported at the next call, with its type, once; that call's save goes on.
        with pytest.raises(RuntimeError, match="the device copy failed") as caught:
            await writer("d", str(tmp_path), state)
        assert "this call's own save" in "\n".join(caught.value.__notes__)
        await writer.flush()
        with pytest.raises(RuntimeError, match="the device copy failed"):
            await handle.wait()
    assert not (tmp_path / "c").exists() and (tmp_path / "d").exists()
    assert temp_files(tmp_path) == []
    assert hooks(state) == 0


async def test_a_wait_cancelled_during_the_copy_drops_the_save_and_releases_the_guard(tmp_path: Path) -> None:
    state, x = make_state()
    device = HeldDevice(state["model"], hold_step=False)
    device.gate.clear()  # the copies wait
    async with aiosnap.QueueWriter(capture="lazy", device_copier=device) as writer:
        handle = await writer("c", str(tmp_path), state)
        assert hooks(state) == 1
        waiting = asyncio.create_task(handle.wait_captured())
        await asyncio.sleep(0)
        waiting.cancel()  # plain asyncio: the caller gives the save up
        with pytest.raises(asyncio.CancelledError):
            await waiting
        device.gate.set()
        with pytest.raises(aiosnap.errors.SaveCancelledError):
            await handle.wait()
        assert hooks(state) == 0
        train(state, x)  # not held
        await writer.flush()  # the caller knows: not reported again
    assert not (tmp_path / "c").exists() and temp_files(tmp_path) == []


class SlowWalk:
    """A Stateful value whose ``state_dict`` waits until the test lets it go."""

    def __init__(self) -> None:
        self.entered, self.go = threading.Event(), threading.Event()

    def state_dict(self) -> dict[str, int]:
        self.entered.set()
        assert self.go.wait(WAIT_CAP)
        return {"x": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


async def test_a_call_cancelled_during_the_walk_leaves_no_guard(tmp_path: Path) -> None:
    state, x = make_state()
    slow = SlowWalk()
    async with aiosnap.QueueWriter(capture="lazy") as writer:
        call = asyncio.create_task(writer("c", str(tmp_path), {**state, "slow": slow}))
        assert await asyncio.to_thread(slow.entered.wait, WAIT_CAP)
        call.cancel()
        slow.go.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        await writer.flush()
        assert hooks(state) == 0
        train(state, x)
    assert not (tmp_path / "c").exists() and temp_files(tmp_path) == []


async def test_closing_the_writer_lets_the_copy_finish_and_removes_the_guard(tmp_path: Path) -> None:
    state, _ = make_state()
    device = HeldDevice(state["model"], hold_step=False)
    device.gate.clear()
    want = expected(state)
    writer = aiosnap.QueueWriter(capture="lazy", device_copier=device)
    async with writer:
        await writer("c", str(tmp_path), state)
        closing = asyncio.create_task(writer.aclose())
        await asyncio.sleep(0)
        assert not closing.done() and hooks(state) == 1
        device.gate.set()
        await closing
    assert hooks(state) == 0
    await assert_saved(tmp_path / "c", want)


def train_then_block_until(state: dict[str, Any], x: torch.Tensor, path: Path) -> None:
    """A synchronous step, then a wait for ``path`` to appear that keeps the loop blocked."""
    train(state, x)
    deadline = time.monotonic() + WAIT_CAP
    while not path.exists():
        assert time.monotonic() < deadline, "the commit waited for the event loop"
        time.sleep(0.001)


async def test_a_lazy_save_is_committed_while_a_synchronous_step_holds_the_loop(tmp_path: Path) -> None:
    state, x = make_state(width=1024)  # ~24 MiB, written as it is copied
    want = expected(state)
    async with aiosnap.QueueWriter(capture="lazy") as writer:
        handle = await writer("c", str(tmp_path), state)
        # From here on the event loop does not run until the file is durable: the step,
        # then a wait for the file, block it. Copy, checksums and commit need no loop.
        train_then_block_until(state, x, tmp_path / "c")
        assert (await handle.wait()).bytes == (tmp_path / "c").stat().st_size
    await assert_saved(tmp_path / "c", want)


async def test_capture_is_checked_and_a_call_overrides_the_default(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="capture"):
        aiosnap.QueueWriter(capture="later")  # type: ignore[arg-type]
    state, _ = make_state()
    device = HeldDevice(state["model"], hold_step=False)
    device.gate.clear()
    async with aiosnap.QueueWriter(capture="lazy", device_copier=device) as writer:
        with pytest.raises(ValueError, match="capture"):
            await writer("x", str(tmp_path), state, capture="soon")  # type: ignore[arg-type]
        call = asyncio.create_task(writer("e", str(tmp_path), state, capture="eager"))
        for _ in range(100):
            await asyncio.sleep(0)
        assert not call.done()  # an eager call waits for its copies, held at the gate
        device.gate.set()
        await (await call).wait()
    device.gate.clear()
    async with aiosnap.QueueWriter(device_copier=device) as writer:
        handle = await writer("l", str(tmp_path), state, capture="lazy")  # returns, copies held
        assert hooks(state) == 1 and not handle.done()
        device.gate.set()
        await handle.wait_captured()
        assert hooks(state) == 0
        await handle.wait()


# -- the manager ---------------------------------------------------------------------------
async def test_a_lazy_manager_save_commits_and_uploads_as_an_eager_one(tmp_path: Path) -> None:
    state, x = make_state()
    local, remote = tmp_path / "local", tmp_path / "remote"
    wants = {}
    async with aiosnap.CheckpointManager(
        str(local), remote=str(remote), capture="lazy", keep=aiosnap.retention.KeepLast(2)
    ) as mgr:
        for step in (1, 2, 3):
            wants[step] = expected(state)
            handle = await mgr.save(step, state, capture="eager" if step == 2 else None)
            train(state, x)
        await mgr.flush()
        assert handle.upload is not None and (await handle.upload.wait()).bytes > 0
        assert await mgr.steps() == [2, 3]
    assert hooks(state) == 0
    for directory in (local, remote):
        async with aiosnap.CheckpointManager(str(directory), read_only=True) as reader:
            for step in (2, 3):
                assert_tree_equal((await reader.restore(step)).state, wants[step])


async def _lazy_group(rank: int, world: int, directory: str) -> bool:
    state, x = make_state(seed=rank, width=256)
    wants = {}
    async with aiosnap.CheckpointManager(directory, capture="lazy", ranks=aiosnap.Ranks(timeout=60)) as mgr:
        for step in (1, 2):
            wants[step] = expected(state)
            handle = await mgr.save(step, state)
            train(state, x)
        await handle.wait()
        for step in (1, 2):
            assert_tree_equal((await mgr.restore(step)).state, wants[step])
    assert hooks(state) == 0
    return True


def test_a_lazy_save_of_a_group_holds_every_rank_s_state_of_the_call(tmp_path: Path) -> None:
    results = run_ranks(2, _lazy_group, str(tmp_path))
    ok(results, 2)


async def test_small_device_tensors_are_copied_and_the_callers_stream_held_before_a_lazy_call_returns(
    tmp_path: Path,
) -> None:
    # A BatchNorm's statistics on a device: the next forward changes them in place, on the
    # caller's stream. Their copies start during the call, and that stream waits for them.
    state, x = make_state()
    bn = state["model"][1]
    device = HeldDevice(state["model"], hold_step=False)
    device.ptrs |= {b.data_ptr() for b in bn.buffers()}
    want = expected(state)
    async with aiosnap.QueueWriter(capture="lazy", device_copier=device) as writer:
        device.gate.clear()  # the large copies wait; the small ones start in the call
        handle = await writer("c", str(tmp_path), state)
        returned = list(device.calls)
        device.gate.set()
        train(state, x)
        await handle.wait()
    on_device = [t for t in want["model"].values() if t.nbytes < 256 << 10]  # cloned: same sizes
    assert len(on_device) == 7  # biases, BatchNorm's weight, bias and 3 statistics
    names = [c[0] for c in returned]
    assert names.count("copy") == len(on_device)
    # The caller's stream is held last in the call; only the arena's pinning for the large
    # copies, in a worker thread of its own, may be recorded after it by the time the call
    # returns (seen with a CPU hog beside the suite).
    held = names.index("hold_producers")
    assert set(names[held + 1 :]) <= {"pin"}, names
    await assert_saved(tmp_path / "c", want)
