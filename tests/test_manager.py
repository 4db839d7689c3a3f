"""CheckpointManager: triggers, retention, index, verified restore, locking, emergencies."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiosnap
from aiosnap._manager.catalog import INDEX_NAME
from aiosnap._manager.retention import victims

from .conftest import temp_files
from .faults import HookedPosix, failing_writes
from .test_writers import Gate


def files(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("snapshot_iter_"))


async def test_saves_rotate_and_the_index_follows(tmp_path: Path) -> None:
    async with aiosnap.CheckpointManager(str(tmp_path), keep=aiosnap.retention.KeepLast(2)) as mgr:
        assert (mgr.rank, mgr.world_size) == (0, None)  # no process group
        for step in range(6):
            handle = await mgr.save(
                step, {"w": torch.full((10,), float(step))}, metrics={"loss": 1 / (step + 1)}
            )
        await handle.wait()
        assert await mgr.steps() == [4, 5]
        assert await mgr.latest_step() == 5
    assert files(tmp_path) == ["snapshot_iter_4", "snapshot_iter_5"]
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["latest"] == 5 and [c["step"] for c in index["checkpoints"]] == [4, 5]
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        history = await mgr.history()
        assert [h.step for h in history] == list(range(6))
        assert history[2].metrics == {"loss": 1 / 3} and history[2].bytes > 0
        assert history[2].timings["total_s"] >= history[2].timings["stall_s"] > 0
        restored = await mgr.restore()
        assert restored.step == 5 and float(restored.state["w"][0]) == 5.0


async def test_a_checkpoint_is_visible_only_after_its_commit(tmp_path: Path) -> None:
    gate = Gate()
    writer = aiosnap.QueueWriter()
    writer.add_post_save_hook(gate)
    async with aiosnap.CheckpointManager(str(tmp_path), writer=writer) as mgr:
        handle = await mgr.save(1, {"x": torch.ones(3)})
        await gate.entered.wait()  # the file is written; the manager has not heard of it yet
        assert await mgr.steps() == [] and not handle.done()
        gate.open()
        await handle.wait()
        assert await mgr.steps() == [1]


async def test_triggers(tmp_path: Path) -> None:
    async with aiosnap.CheckpointManager(str(tmp_path), save_every=3) as mgr:
        saved = [s for s in range(10) if not (await mgr.save(s, {"s": s})).skipped]
        assert saved == [0, 3, 6, 9]
        assert (await mgr.save(9, {"s": 9})).skipped  # step 9 was saved already
        assert not (await mgr.save(10, {"s": 10}, force=True)).skipped
    now = aiosnap.triggers.Moment(4, 2, 100.0)
    assert aiosnap.triggers.EveryNEpochs(2)(now, None) and not aiosnap.triggers.EveryNEpochs(2)(
        now, aiosnap.triggers.Moment(3, 2, 99.0)
    )
    assert not aiosnap.triggers.EveryNEpochs(3)(now, None) and not aiosnap.triggers.EveryNEpochs(2)(
        aiosnap.triggers.Moment(4, None, 0), None
    )
    assert aiosnap.triggers.EveryNSeconds(10)(now, aiosnap.triggers.Moment(1, 0, 89.0))
    assert not aiosnap.triggers.EveryNSeconds(10)(now, aiosnap.triggers.Moment(1, 0, 95.0))
    assert aiosnap.triggers.AtSteps([4, 8])(now, None) and not aiosnap.triggers.AtSteps([5])(now, None)
    assert aiosnap.triggers.AnyTrigger(aiosnap.triggers.AtSteps([5]), aiosnap.triggers.EveryNSteps(2))(
        now, None
    )


async def test_epoch_in_the_name(tmp_path: Path) -> None:
    name = "ckpt_e{epoch}_s{step}"
    async with aiosnap.CheckpointManager(
        str(tmp_path), name=name, save_every=aiosnap.triggers.EveryNEpochs(1)
    ) as mgr:
        await mgr.save(10, {"a": 1}, epoch=1)
        assert (await mgr.save(11, {"a": 1}, epoch=1)).skipped
        await mgr.save(20, {"a": 2}, epoch=2)
        with pytest.raises(ValueError, match="epoch"):
            await mgr.save(30, {"a": 2}, force=True)
    async with aiosnap.CheckpointManager(str(tmp_path), name=name) as mgr:
        assert await mgr.steps() == [10, 20]
        assert (await mgr.restore()).epoch == 2
    with pytest.raises(ValueError, match="step"):
        aiosnap.CheckpointManager(str(tmp_path), name="ckpt_{epoch}")
    with pytest.raises(ValueError, match="only"):
        aiosnap.CheckpointManager(str(tmp_path), name="ckpt_{step}_{host}")


def rec(step: int, loss: float | None = None, t: float = 0.0) -> aiosnap.CheckpointRecord:
    return aiosnap.CheckpointRecord(
        step, f"s{step}", wall_time=t, metrics={} if loss is None else {"loss": loss}
    )


def test_retention_policies() -> None:
    cps = [rec(0, 5.0, 0), rec(10, 1.0, 10), rec(20, 3.0, 20), rec(30, None, 30), rec(40, 2.0, 40)]
    assert aiosnap.retention.KeepLast(2).keep(cps, 50) == {30, 40}
    assert aiosnap.retention.KeepEvery(20).keep(cps, 50) == {0, 20, 40}
    assert aiosnap.retention.KeepBest("loss", "min", 2).keep(cps, 50) == {10, 40}
    assert aiosnap.retention.KeepBest("loss", "max", 1).keep(cps, 50) == {0}
    assert aiosnap.retention.KeepWithin(15).keep(cps, 50) == {40}
    assert aiosnap.retention.AnyPolicy(
        aiosnap.retention.KeepLast(1), aiosnap.retention.KeepBest("loss")
    ).keep(cps, 50) == {10, 40}
    # A NaN loss (a diverged run) or a bool is no score: NaN sorted first and was kept as best.
    odd = [rec(0, float("nan"), 0), rec(10, 1.0, 10), rec(20, True, 20), rec(30, 2.0, 30)]
    assert aiosnap.retention.KeepBest("loss", "min", 2).keep(odd, 50) == {10, 30}
    assert aiosnap.retention.KeepBest("loss", "max", 1).keep(odd, 50) == {30}
    # The newest is never a victim, whatever the policy says.
    assert victims(aiosnap.retention.KeepBest("loss"), cps, 50) == [0, 20, 30]
    for bad in (
        lambda: aiosnap.retention.KeepLast(0),
        lambda: aiosnap.retention.KeepBest("x", "avg"),
        lambda: aiosnap.retention.AnyPolicy(),
    ):
        with pytest.raises(ValueError):
            bad()


POLICIES = st.one_of(
    st.integers(1, 3).map(aiosnap.retention.KeepLast),
    st.integers(2, 4).map(aiosnap.retention.KeepEvery),
    st.tuples(st.sampled_from(["min", "max"]), st.integers(1, 2)).map(
        lambda a: aiosnap.retention.KeepBest("loss", *a)
    ),
    st.tuples(st.integers(1, 2), st.integers(2, 3)).map(
        lambda a: aiosnap.retention.AnyPolicy(
            aiosnap.retention.KeepLast(a[0]), aiosnap.retention.KeepEvery(a[1])
        )
    ),
)
OPS = st.lists(st.tuples(st.floats(0, 10, allow_nan=False), st.booleans()), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=POLICIES, ops=OPS)
def test_retention_rules_hold_for_any_sequence(tmp_path_factory: Any, policy: Any, ops: list[Any]) -> None:
    directory = tmp_path_factory.mktemp("ret")
    failing = {f"snapshot_iter_{i}" for i, (_, fail) in enumerate(ops) if fail}
    asyncio.run(_run_sequence(directory, policy, ops, failing))


async def _run_sequence(directory: Path, policy: Any, ops: list[Any], failing: set[str]) -> None:
    model: list[aiosnap.CheckpointRecord] = []
    storage = failing_writes(failing)
    async with aiosnap.CheckpointManager(str(directory), keep=policy, storage=storage) as mgr:
        for step, (loss, fail) in enumerate(ops):
            try:
                handle = await mgr.save(step, {"x": np.full(3, step)}, metrics={"loss": loss})
                await handle.wait()
            except OSError:
                assert fail
            else:
                assert not fail
                model.append(rec(step, loss))
                doomed = set(victims(policy, model, 0.0))
                model = [r for r in model if r.step not in doomed]
            await mgr.flush()  # a failure seen through its handle is not raised again
            expected = [r.step for r in model]
            assert await mgr.steps() == expected
            assert files(directory) == sorted(f"snapshot_iter_{s}" for s in expected)
            if model:  # the newest committed checkpoint always survives
                assert max(r.step for r in model) == max(
                    s for s, (_, f) in enumerate(ops[: step + 1]) if not f
                )
    assert temp_files(directory) == []


async def test_a_failure_is_reported_once_and_never_costs_the_next_checkpoint(tmp_path: Path) -> None:
    storage = failing_writes({"snapshot_iter_2", "snapshot_iter_4"})
    async with aiosnap.CheckpointManager(str(tmp_path), storage=storage) as mgr:
        await (await mgr.save(1, {"x": np.full(3, 1)})).wait()
        failed = await mgr.save(2, {"x": np.full(3, 2)})
        with pytest.raises(OSError, match="No space left"):
            await failed.wait()  # seen through the handle...
        await (await mgr.save(3, {"x": np.full(3, 3)})).wait()  # ...so not raised again
        unseen = await mgr.save(4, {"x": np.full(3, 4)})
        await unseen.outcome()
        with pytest.raises(OSError, match="snapshot_iter_4") as info:
            await mgr.save(5, {"x": np.full(3, 5)})  # unseen: raised by the next call...
        assert any("own save of" in n for n in info.value.__notes__)
        await mgr.flush()  # ...which kept its own checkpoint; and flush does not raise it again
        assert await mgr.steps() == [1, 3, 5]
        assert mgr.take_failures() == []


async def test_flush_that_raises_has_still_waited_for_every_save(tmp_path: Path) -> None:
    # The writer's flush raises save 1's failure once save 2's file is durable, but save
    # 2 is indexed only after that: a flush that raised before waiting left it unindexed
    # (the JobRunner then returned with its last epoch missing from steps()).
    accepted = threading.Event()

    def fail_once_both_are_accepted(op: str, path: str) -> None:
        if op == "write" and path.endswith("snapshot_iter_1"):
            accepted.wait()
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)

    storage = aiosnap.storage.LocalStorage(posix=HookedPosix(fail_once_both_are_accepted))
    async with aiosnap.CheckpointManager(str(tmp_path), storage=storage) as mgr:
        await mgr.save(1, {"x": np.full(3, 1)})
        kept = await mgr.save(2, {"x": np.full(3, 2)})
        accepted.set()
        with pytest.raises(OSError, match="snapshot_iter_1"):
            await mgr.flush()
        assert kept.done() and await mgr.steps() == [2]


async def test_take_failures_shows_an_index_failure_without_raising_it(tmp_path: Path) -> None:
    def fail_the_index(op: str, path: str) -> None:
        if op == "rename" and path.endswith(INDEX_NAME) and not os.path.exists(tmp_path / "go-on"):
            raise OSError(errno.EIO, "I/O error (injected)", path)

    storage = aiosnap.storage.LocalStorage(posix=HookedPosix(fail_the_index))
    async with aiosnap.CheckpointManager(str(tmp_path), storage=storage) as mgr:
        handle = await mgr.save(1, {"x": np.full(3, 1)})
        await handle.outcome()
        (failure,) = mgr.take_failures()
        assert isinstance(failure.error, OSError) and failure.error.errno == errno.EIO
        (tmp_path / "go-on").touch()
        await mgr.save(2, {"x": np.full(3, 2)})
        await mgr.flush()
        assert await mgr.steps() == [1, 2]  # the checkpoint committed; only its indexing failed
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert [c["step"] for c in index["checkpoints"]] == [1, 2]


async def test_corrupt_newest_falls_back_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        for step in (1, 2, 3):
            await mgr.save(step, {"step": step, "w": torch.full((100,), float(step))})
    newest = tmp_path / "snapshot_iter_3"
    data = bytearray(newest.read_bytes())
    data[-10] ^= 0x40
    newest.write_bytes(data)
    target = {"step": 0, "w": torch.zeros(100)}
    async with aiosnap.CheckpointManager(str(tmp_path), keep=aiosnap.retention.KeepLast(1)) as mgr:
        with caplog.at_level(logging.WARNING, logger="aiosnap"):
            restored = await mgr.restore(target=target)
        assert restored.step == 2 and target["step"] == 2 and float(target["w"][0]) == 2.0
        assert "snapshot_iter_3 failed verification" in caplog.text
        assert await mgr.steps() == [1, 2] and await mgr.latest_step() == 2
        with pytest.raises(aiosnap.errors.CorruptCheckpointError):
            await mgr.restore(3)
        await mgr.save(4, {"step": 4, "w": torch.zeros(100)})
        await mgr.flush()
    assert files(tmp_path) == ["snapshot_iter_4"]  # the corrupt one went with the rotation


async def test_restore_raises_when_nothing_is_valid(tmp_path: Path) -> None:
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(aiosnap.errors.CheckpointNotFoundError, match="no valid checkpoint"):
            await mgr.restore()
        await mgr.save(1, {"x": 1})
        await mgr.flush()
        (tmp_path / "snapshot_iter_1").write_bytes(b"garbage")
        with pytest.raises(aiosnap.errors.CheckpointNotFoundError):
            await mgr.restore()
        with pytest.raises(aiosnap.errors.CheckpointNotFoundError):
            await mgr.restore(7)


async def test_keys_and_partial_restore(tmp_path: Path) -> None:
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        await mgr.save(1, {"model": {"w": torch.ones(2)}, "opt": {"m": torch.zeros(2)}})
        await mgr.flush()
        restored = await mgr.restore(keys=["model"])
        assert set(restored.state) == {"model"}


async def test_lost_stale_or_garbage_index_is_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        for step in (1, 2):
            await mgr.save(step, {"x": step})
    (tmp_path / INDEX_NAME).unlink()
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        assert await mgr.steps() == [1, 2]
    (tmp_path / "snapshot_iter_2").unlink()  # the index now lists a file that is gone
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        assert await mgr.steps() == [1]
    (tmp_path / INDEX_NAME).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="aiosnap"):
        async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
            assert await mgr.steps() == [1]
    assert "rebuilding it from the directory" in caplog.text
    assert json.loads((tmp_path / INDEX_NAME).read_text())["latest"] == 1


async def test_startup_sweeps_temp_files_and_ignores_uncommitted(tmp_path: Path) -> None:
    (tmp_path / f"{aiosnap.storage.TEMP_PREFIX}snapshot_iter_9.abc").write_bytes(b"half a checkpoint")
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        assert await mgr.steps() == []
    assert temp_files(tmp_path) == []


async def test_two_managers_on_one_directory(tmp_path: Path) -> None:
    async with aiosnap.CheckpointManager(str(tmp_path)):
        with pytest.raises(aiosnap.errors.DirectoryLockedError, match="in use by another CheckpointManager"):
            async with aiosnap.CheckpointManager(str(tmp_path)):
                pass
    async with aiosnap.CheckpointManager(str(tmp_path)):
        pass


def _hold_lock(directory: str, ready: Any) -> None:
    async def main() -> None:
        async with aiosnap.CheckpointManager(directory):
            ready.set()
            await asyncio.Event().wait()  # until killed

    asyncio.run(main())


def _ctx() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["aiosnap", "numpy", "tests.test_manager"])
    return ctx


async def test_a_sigkilled_holder_does_not_block_the_next_run(tmp_path: Path) -> None:
    ctx = _ctx()
    ready = ctx.Event()
    proc = ctx.Process(target=_hold_lock, args=(str(tmp_path), ready))
    proc.start()
    assert await asyncio.to_thread(ready.wait, 60)
    with pytest.raises(aiosnap.errors.DirectoryLockedError, match=f"pid {proc.pid}"):
        async with aiosnap.CheckpointManager(str(tmp_path)):
            pass
    os.kill(proc.pid, signal.SIGKILL)
    await asyncio.to_thread(proc.join)
    async with aiosnap.CheckpointManager(str(tmp_path)):
        pass


async def test_save_on_error_saves_then_reraises(tmp_path: Path) -> None:
    state = {"w": torch.ones(3)}
    with pytest.raises(ZeroDivisionError) as info:
        async with aiosnap.CheckpointManager(str(tmp_path)) as mgr, mgr.save_on_error(lambda: (42, state)):
            _ = 1 / 0
    assert any("saved step 42" in n for n in info.value.__notes__)
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        assert (await mgr.restore()).step == 42


async def test_save_on_signal(tmp_path: Path) -> None:
    state = {"w": torch.ones(3)}

    async def state_fn() -> tuple[int, object]:
        return 7, state

    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save_on_signal(state_fn, signals=(signal.SIGUSR1,), deadline=30)
        os.kill(os.getpid(), signal.SIGUSR1)
        async with asyncio.timeout(30):
            await mgr.preempted.wait()
        assert await mgr.steps() == [7]
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the handler went with the manager


# -- crashes ---------------------------------------------------------------------------------------


def _train_until_killed(directory: str, seed: int, report: Any) -> None:
    async def main() -> None:
        rng = random.Random(seed)
        async with aiosnap.CheckpointManager(directory, keep=aiosnap.retention.KeepLast(2)) as mgr:
            step = await mgr.latest_step() or 0
            while True:
                step += 1
                n = rng.randint(1, 50_000)
                handle = await mgr.save(step, {"step": step, "x": np.full(n, step, dtype=np.int64)})
                if step == 1:
                    await handle.wait()  # the first run has a checkpoint before it is killed
                report.send(step)
                for _ in range(rng.randint(0, 20)):  # a training step of random length
                    await asyncio.sleep(0)

    asyncio.run(main())


async def _crash_and_restore(tmp_path: Path, runs: int) -> None:
    """Kill a saving child after a random number of save calls: the kill lands wherever
    its background commits, index writes and rotations then are."""
    ctx = _ctx()
    rng = random.Random(1234)
    last = 0
    for run in range(runs):
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_train_until_killed, args=(str(tmp_path), run, send))
        proc.start()
        send.close()
        for _ in range(rng.randint(1, 12)):
            await asyncio.to_thread(receive.recv)
        os.kill(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.join)
        receive.close()
        async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
            assert temp_files(tmp_path) == []
            restored = await mgr.restore()
            assert restored.state["step"] == restored.step >= last
            assert (restored.state["x"] == restored.step).all()
            last = restored.step


async def test_sigkill_at_random_points_always_leaves_a_valid_checkpoint(tmp_path: Path) -> None:
    await _crash_and_restore(tmp_path, runs=50)


@pytest.mark.slow
async def test_a_thousand_random_sigkills(tmp_path: Path) -> None:
    await _crash_and_restore(tmp_path, runs=1000)


@pytest.mark.parametrize("read_only", [False, True])
async def test_a_manager_on_a_file_says_so_in_our_error(tmp_path: Path, read_only: bool) -> None:
    """Not a raw NotADirectoryError from the lock file's open: what stands there, and that
    aiosnap leaves it alone."""
    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(aiosnap.errors.ForeignFileError, match=r"a_file is a file, not a directory"):
        async with aiosnap.CheckpointManager(str(tmp_path / "a_file"), read_only=read_only):
            pass
    assert (tmp_path / "a_file").read_text() == "mine"
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")  # a link to a directory is one
    async with aiosnap.CheckpointManager(str(tmp_path / "link")) as manager:
        await (await manager.save(1, {"x": 1})).wait()
    assert [p.name for p in (tmp_path / "real").iterdir() if p.name.startswith("snapshot")] == [
        "snapshot_iter_1"
    ]


_RESUME_UNCONFIGURED = """
import asyncio, sys, torch, aiosnap

async def main():
    target = {"step": 0, "w": torch.zeros(100)}
    async with aiosnap.CheckpointManager(sys.argv[1]) as mgr:
        print((await mgr.resume(target=target)).step)

asyncio.run(main())
"""


async def test_a_fallback_past_a_corrupt_checkpoint_is_shown_unconfigured(tmp_path: Path) -> None:
    """Steps are lost to the damage: the user is told, as a remote store's trouble is
    (an AiosnapWarning where no logging handler would show the WARNING)."""
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        for step in (1, 2):
            await mgr.save(step, {"step": step, "w": torch.full((100,), float(step))})
    newest = tmp_path / "snapshot_iter_2"
    data = bytearray(newest.read_bytes())
    data[-10] ^= 0x40
    newest.write_bytes(data)
    command = [sys.executable, "-c", _RESUME_UNCONFIGURED, str(tmp_path)]
    done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "1"
    assert "AiosnapWarning" in done.stderr and "snapshot_iter_2 failed verification" in done.stderr
    assert "falling back to an older one" in done.stderr


async def test_a_directory_used_with_another_name_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run resumed with another name= than it saved with would start afresh beside its
    checkpoints, in silence: it is told, and how to resume them."""
    async with aiosnap.CheckpointManager(str(tmp_path), name="ckpt-{step}") as mgr:
        for step in (100, 200):
            await mgr.save(step, {"step": step})
    with caplog.at_level(logging.WARNING, logger="aiosnap"):
        async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:  # the default name
            assert await mgr.resume(target={"step": 0}) is None
    (message,) = [r.getMessage() for r in caplog.records if "another name template" in r.getMessage()]
    assert "2 checkpoint(s)" in message and "ckpt-200" in message and "name='snapshot_iter_{step}'" in message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aiosnap"):
        async with aiosnap.CheckpointManager(str(tmp_path), name="ckpt-{step}") as mgr:
            assert (await mgr.resume(target={"step": 0})).step == 200
    assert "another name template" not in caplog.text
