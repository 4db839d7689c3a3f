"""Lazy capture never saves values from after its call: the copy-on-write window.

Each test makes the in-place change right after a lazy save call, before the save's
staging thread copies the large tensors: a gate holds every large copy of the staging
thread until the change is made (or until the training thread waits in the optimizer's
guard), so a change that the capture did not hold back would reach the checkpoint every
time. Each checkpoint is compared bit for bit with the state at its call. A change the
window cannot see (another thread) fails the save loudly instead.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import aiosnap
from aiosnap._save import stage as _stage
from aiosnap._save.guard import Guard
from aiosnap._save.window import Window

from .conftest import WAIT_CAP, assert_tree_equal

WIDTH = 384  # each weight 576 KiB: over the small-leaf size, copied after the call


class Gate:
    """Holds the staging thread before each large tensor copy until ``open()`` -- or until
    the training thread waits in a guard (a held step cannot make the change). It holds
    the staging thread before it claims a tensor: a writer is never left waiting for a
    copy that the gate holds."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.trainer = threading.get_ident()
        self.opened = threading.Event()
        self.held: list[int] = []
        try:
            from aiosnap._save.lazy import LazyCopies
        except ImportError:  # the code before the window: hold the copy itself
            copy_leaf = _stage._copy  # type: ignore[attr-defined]

            def gated(leaf: Any, arena: Any, start: int, nbytes: int, side: Any) -> None:
                if threading.get_ident() != self.trainer and leaf.kind == "tensor" and nbytes >= 256 << 10:
                    self._wait()
                copy_leaf(leaf, arena, start, nbytes, side)

            monkeypatch.setattr(_stage, "_copy", gated)
            return
        take = LazyCopies.take

        def gated_take(copies: LazyCopies, i: int) -> bool:
            if threading.get_ident() != self.trainer:
                self._wait()
            return take(copies, i)

        monkeypatch.setattr(LazyCopies, "take", gated_take)

    def _wait(self) -> None:
        deadline = time.monotonic() + WAIT_CAP  # a hang detector, not a bound on time
        while not self.opened.wait(0.001):
            if self._trainer_in_guard():
                self.held.append(1)
                return
            assert time.monotonic() < deadline, "the gate was never opened"

    def _trainer_in_guard(self) -> bool:
        frame = sys._current_frames().get(self.trainer)
        while frame is not None:
            if frame.f_code is Guard._hold.__code__:
                return True
            frame = frame.f_back
        return False

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate(monkeypatch)
    yield g
    g.open()


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """The state as a save of it now must hold it."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        out[key] = copy.deepcopy(value.state_dict() if hasattr(value, "state_dict") else value)
    return out


async def save_then(tmp_path: Path, gate: Gate, state: dict[str, Any], change: Any) -> None:
    """A lazy save of ``state``, ``change()`` right after its call, then the file checked."""
    want = snapshot(state)
    async with aiosnap.QueueWriter(capture="lazy") as writer:
        handle = await writer("c", str(tmp_path), state)
        change()
        gate.open()
        await handle.wait()
    assert_tree_equal(await aiosnap.load(str(tmp_path / "c")), want)


async def test_an_ema_updated_after_the_call_is_saved_as_it_was(tmp_path: Path, gate: Gate) -> None:
    model, ema = mlp(0), mlp(1)

    def update() -> None:
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                e.lerp_(p, 0.5)

    await save_then(tmp_path, gate, {"model": model, "ema": ema}, update)


async def test_weights_clipped_through_data_are_saved_as_they_were(tmp_path: Path, gate: Gate) -> None:
    model = mlp(0)

    def clip() -> None:
        for p in model.parameters():
            p.data.clamp_(-1e-3, 1e-3)  # .data: no version counter moves

    await save_then(tmp_path, gate, {"model": model}, clip)


async def test_a_state_loaded_over_the_model_after_the_call(tmp_path: Path, gate: Gate) -> None:
    model, other = mlp(0), mlp(1)
    await save_then(tmp_path, gate, {"model": model}, lambda: model.load_state_dict(other.state_dict()))


async def test_a_hand_written_sgd_step(tmp_path: Path, gate: Gate) -> None:
    model = mlp(0)
    model(torch.randn(4, WIDTH)).square().mean().backward()

    def sgd() -> None:
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None
                p.add_(p.grad, alpha=-0.1)

    await save_then(tmp_path, gate, {"model": model}, sgd)


async def test_a_weights_only_save_of_a_run_with_an_optimizer(tmp_path: Path, gate: Gate) -> None:
    model = mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, WIDTH)).square().mean().backward()
    await save_then(tmp_path, gate, {"model": model}, opt.step)  # the optimizer is not in the state


class Wrapped:
    """An optimizer wrapper as some trainers write them: ``.optimizer``, no subclass."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def step(self) -> None:
        self.optimizer.step()


async def test_an_optimizer_wrapper_that_is_no_optimizer_is_guarded(tmp_path: Path, gate: Gate) -> None:
    model = mlp(0)
    opt = Wrapped(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for _ in range(2):  # moments exist: the step changes them in place
        model(torch.randn(4, WIDTH)).square().mean().backward()
        opt.step()
    await save_then(tmp_path, gate, {"model": model, "optimizer": opt}, opt.step)
    assert gate.held, "the wrapper's step was not held by the guard"


async def test_large_batchnorm_statistics_changed_by_the_next_forward(tmp_path: Path, gate: Gate) -> None:
    bn = nn.BatchNorm1d(100_000)  # 400 KB statistics: copied after the call
    x = torch.randn(4, 100_000)
    await save_then(tmp_path, gate, {"bn": bn}, lambda: bn(x))


async def test_an_array_changed_after_the_call_is_saved_as_it_was(tmp_path: Path, gate: Gate) -> None:
    """NumPy writes move no version counter and no dispatch mode sees them: arrays are
    copied before a lazy call returns, whatever their size."""
    array = np.arange(200_000, dtype=np.float32)  # 800 KB
    await save_then(tmp_path, gate, {"a": array, "model": mlp(0)}, lambda: array.fill(-1))


async def test_a_change_on_another_thread_fails_the_save_loudly(tmp_path: Path, gate: Gate) -> None:
    model = mlp(0)
    weight = model[0].weight
    async with aiosnap.QueueWriter(capture="lazy") as writer:
        handle = await writer("c", str(tmp_path), {"model": model})
        changer = threading.Thread(target=lambda: weight.detach().add_(1))  # not the loop's thread
        changer.start()
        changer.join()
        gate.open()
        with pytest.raises(aiosnap.errors.CaptureError, match=r"model\.0\.weight changed in place") as caught:
            await writer.flush()  # where background failures are reported, once
        assert "wait_captured()" in str(caught.value) and caught.value.entry == "model.0.weight"
        with pytest.raises(aiosnap.errors.CaptureError):
            await handle.wait()  # and by the save's own handle
    assert not (tmp_path / "c").exists()


async def test_a_window_is_gone_once_its_copies_ended(tmp_path: Path) -> None:
    """The mode sits on the caller's thread only while copies are pending: in a loop that
    does not yield, the first module call after the copies ended takes it off, and its
    global hooks go with it."""
    model = mlp(0)
    async with aiosnap.QueueWriter(capture="lazy") as writer:
        handle = await writer("c", str(tmp_path), {"model": model})
        window = _get_current_dispatch_mode()
        assert isinstance(window, Window) and torch.nn.modules.module._global_forward_pre_hooks
        assert window.finished.wait(WAIT_CAP)  # as a synchronous step would: the loop is held
        assert _get_current_dispatch_mode() is window  # nothing has taken it off yet
        model(torch.randn(2, WIDTH))  # a boundary: a module's forward
        assert _get_current_dispatch_mode() is None
        assert not torch.nn.modules.module._global_forward_pre_hooks
        await handle.wait()


@pytest.mark.parametrize(
    ("writer_capture", "manager_capture", "call_capture", "lazy"),
    [
        ("lazy", None, None, True),  # the writer's default, when the manager names none
        ("eager", None, None, False),
        ("lazy", "eager", None, False),  # the manager's capture= over the writer's
        ("eager", "lazy", None, True),
        ("lazy", "lazy", "eager", False),  # the call's over both
        ("eager", "eager", "lazy", True),
    ],
)
async def test_which_capture_a_manager_save_gets(
    tmp_path: Path,
    gate: Gate,
    writer_capture: str,
    manager_capture: str | None,
    call_capture: str | None,
    lazy: bool,
) -> None:
    """The call's capture, else the manager's, else the writer's default, else eager. A
    lazy save returns with its large copies pending (the gate holds them): its window is
    on the caller's thread then; an eager one's copies are done."""
    model = mlp(0)
    writer = aiosnap.QueueWriter(capture=writer_capture)  # type: ignore[arg-type]
    async with aiosnap.CheckpointManager(str(tmp_path), writer=writer, capture=manager_capture) as manager:  # type: ignore[arg-type]
        handle = await manager.save(1, {"model": model}, capture=call_capture)  # type: ignore[arg-type]
        assert isinstance(_get_current_dispatch_mode(), Window) is lazy
        gate.open()
        await handle.wait()


WARMED = """
import asyncio, sys, tempfile
import torch
import aiosnap

async def main(capture_at_open):
    with tempfile.TemporaryDirectory() as d:
        async with aiosnap.QueueWriter(capture=capture_at_open) as writer:
            opened = "torch._dynamo" in sys.modules
            handle = await writer("c", d, {"w": torch.zeros(1 << 18)}, capture="lazy")
            returned = "torch._dynamo" in sys.modules
            await handle.wait()
    print(opened, returned)

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.parametrize(("capture", "at_open"), [("lazy", "True"), ("eager", "False")])
def test_the_first_operator_under_a_window_imports_nothing(capture: str, at_open: str) -> None:
    """torch imports torch._dynamo at the first operator under any dispatch mode (1.3 s
    here): a lazy writer does it when it opens, and a lazy save of an eager writer before its
    call returns -- never in the training step after the call."""
    done = subprocess.run(
        [sys.executable, "-c", WARMED, capture], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [at_open, "True"]
