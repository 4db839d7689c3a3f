"""CheckpointManager in a process group: real gloo groups on 127.0.0.1, 2 to 4 processes."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Coroutine
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import aiosnap
from aiosnap._base.checksums import crc32c
from aiosnap._format.manifest import MANIFEST_NAME, Manifest, replicated_matcher
from aiosnap._format.tree import ExternalLeaves
from aiosnap._manager.triggers import deterministic

from .faults import HookedPosix, enospc, failing_writes

Scenario = Callable[..., Coroutine[Any, Any, Any]]


# -- running ranks ----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int, world: int, port: int, scenario: Scenario, args: tuple[Any, ...], out: Any, done: Any
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        result: Any = asyncio.run(scenario(rank, world, *args))
    except BaseException as exc:
        cause = exc.__cause__
        result = {
            "error": type(exc).__name__,
            "message": str(exc),
            "failed": sorted(getattr(exc, "failed", {})),
            "cause": type(cause).__name__ if cause else None,
            "trace": traceback.format_exc(),
        }
    out.put((rank, result))
    out.close()
    out.join_thread()
    if rank == 0:
        # Rank 0 hosts the group's store: gone, it resets the connections of ranks still
        # working (those of another subgroup, which never wait for it).
        done.wait(timeout=600)  # a bound only for a parent killed before it could set it
    os._exit(0)  # skip the teardown of a group whose peers may be dead


def run_ranks(world: int, scenario: Scenario, *args: Any, limit: float = 120) -> dict[int, Any]:
    """Run ``scenario(rank, world, *args)`` in ``world`` fresh processes; their results."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["aiosnap", "torch.distributed", "tests.test_distributed"])
    out, done = ctx.Queue(), ctx.Event()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, scenario, args, out, done)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + limit
    try:
        while len(results) < world and time.monotonic() < deadline:
            # Rank 0 lives on once it has reported (see _rank_main): only the others count.
            pending = [p for r, p in enumerate(procs) if r not in results]
            if all(not p.is_alive() for p in pending) and out.empty():
                break
            try:
                rank, result = out.get(timeout=0.2)
            except Exception:  # queue.Empty
                continue
            results[rank] = result
    finally:
        done.set()
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    return results


def state_of(rank: int, step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {
        "model": {"w": torch.randn(64, 32), "b": torch.arange(8, dtype=torch.float64) + step},
        "optim": {"m": torch.full((16,), float(rank * 100 + step))},
        "rank": rank,
        "step": step,
    }


async def failure_of(mgr: aiosnap.CheckpointManager, handle: aiosnap.SaveHandle) -> dict[str, Any]:
    """How a save failed (which ranks, the message), or that it committed."""
    try:
        await handle.wait()
    except aiosnap.errors.RankFailedError as exc:
        return {"failed": sorted(exc.failed), "message": str(exc)}
    finally:
        mgr.take_failures()  # these tests look only at the handle
    return {"committed": True}


def ok(results: dict[int, Any], world: int) -> None:
    assert sorted(results) == list(range(world)), results
    for rank, r in results.items():
        assert not (isinstance(r, dict) and "error" in r), f"rank {rank}: {r.get('trace')}"


# -- a round trip -----------------------------------------------------------------------
async def _round_trip(rank: int, world: int, directory: str) -> dict[str, Any]:
    async with aiosnap.CheckpointManager(
        directory, ranks=aiosnap.Ranks(replicated=["model.*"], timeout=30), keep=aiosnap.retention.KeepLast(2)
    ) as mgr:
        assert mgr.rank == rank
        for step in (1, 2, 3):
            handle = await mgr.save(step, state_of(rank, step), metrics={"loss": 1 / step})
        await handle.wait()
        steps = await mgr.steps()
        history = [h.step for h in await mgr.history()]
        restored = await mgr.restore()
        target = state_of(rank, 0)
        into = await mgr.restore(2, target=target)
    expect = state_of(rank, 3)
    for key in ("w", "b"):
        assert torch.equal(restored.state["model"][key], expect["model"][key])
    assert torch.equal(restored.state["optim"]["m"], expect["optim"]["m"])
    assert restored.state["rank"] == rank and restored.step == 3
    assert into.step == 2 and target["optim"]["m"][0] == rank * 100 + 2
    assert torch.equal(target["model"]["w"], state_of(rank, 2)["model"]["w"])
    return {"steps": steps, "history": history}


@pytest.mark.parametrize("world", [2, 4])
def test_a_group_saves_one_directory_per_step_and_restores(tmp_path: Path, world: int) -> None:
    results = run_ranks(world, _round_trip, str(tmp_path))
    ok(results, world)
    assert all(r == {"steps": [2, 3], "history": [1, 2, 3]} for r in results.values())
    step_dirs = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("snapshot_iter_"))
    assert step_dirs == ["snapshot_iter_2", "snapshot_iter_3"]
    step = tmp_path / "snapshot_iter_3"
    names = sorted(p.name for p in step.iterdir())
    assert names == [MANIFEST_NAME] + [f"rank_{r:05d}" for r in range(world)]
    manifest = Manifest.parse(str(step / MANIFEST_NAME), (step / MANIFEST_NAME).read_bytes())
    assert manifest.world_size == world and manifest.replicated == ["model.*"]
    # Replicated entries are stored once, by rank 0: the other files hold only their own.
    sizes = [(step / f"rank_{r:05d}").stat().st_size for r in range(world)]
    assert all(size < sizes[0] - 64 * 32 * 4 for size in sizes[1:])
    # Every file is a complete checkpoint of its own part, readable with its replicas.
    alone = asyncio.run(aiosnap.load(str(step / "rank_00001"), keys=["optim"]))
    assert alone["optim"]["m"][0] == 100 + 3
    with pytest.raises(aiosnap.errors.CheckpointError, match="replicas="):
        asyncio.run(aiosnap.load(str(step / "rank_00001")))
    index = json.loads((tmp_path / aiosnap._manager.catalog.INDEX_NAME).read_text())
    assert index["latest"] == 3 and index["checkpoints"][-1]["bytes"] == sum(sizes)
    assert index["checkpoints"][-1]["wall_time"] > 0 and index["checkpoints"][-1]["timings"]["fsync_s"] >= 0


# -- failures ---------------------------------------------------------------------------
def FailingStorage(victim: str, how: str) -> aiosnap.storage.Storage:
    """The real local storage; writes of one rank's file of one step fail, or kill it."""

    def fail(path: str) -> BaseException:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return enospc(path)

    return failing_writes(lambda path: path.endswith(victim), fail)


async def _failing_write(rank: int, world: int, directory: str, victim: int) -> dict[str, Any]:
    storage = FailingStorage(f"snapshot_iter_2/rank_{victim:05d}", "raise")
    writer = aiosnap.QueueWriter(storage=storage)
    async with aiosnap.CheckpointManager(
        directory, writer=writer, storage=storage, ranks=aiosnap.Ranks(replicated=["model.*"], timeout=20)
    ) as mgr:
        await (await mgr.save(1, state_of(rank, 1))).wait()
        handle = await mgr.save(2, state_of(rank, 2))
        try:
            await handle.wait()
            return {"error": "step 2 committed"}
        except aiosnap.errors.RankFailedError as exc:
            failure = {
                "failed": sorted(exc.failed),
                "message": str(exc),
                "cause": type(exc.__cause__).__name__,
            }
        # Reported through the handle: not raised again, and the next save goes through.
        await (await mgr.save(3, state_of(rank, 3))).wait()
        # The group goes on: an orderly failure does not break it.
        await (await mgr.save(4, state_of(rank, 4))).wait()
        failure["steps"] = await mgr.steps()
        return failure


@pytest.mark.parametrize(("world", "victim"), [(2, 1), (4, 0)])
def test_an_error_on_one_rank_commits_nothing_and_every_rank_raises(
    tmp_path: Path, world: int, victim: int
) -> None:
    results = run_ranks(world, _failing_write, str(tmp_path), victim)
    assert sorted(results) == list(range(world))
    for rank, r in results.items():
        assert r["failed"] == [victim], r
        assert f"rank {victim}" in r["message"] and "No space left" in r["message"]
        assert r["cause"] == ("OSError" if rank == victim else "NoneType")
        assert r["steps"] == [1, 3, 4]
    assert not (tmp_path / "snapshot_iter_2").exists()  # swept once a later step committed


async def _killed_mid_save(rank: int, world: int, directory: str, victim: int, silence: float) -> Any:
    storage = FailingStorage(f"snapshot_iter_2/rank_{victim:05d}", "kill")
    writer = aiosnap.QueueWriter(storage=storage)
    async with aiosnap.CheckpointManager(
        directory, writer=writer, storage=storage, ranks=aiosnap.Ranks(timeout=silence)
    ) as mgr:
        await (await mgr.save(1, state_of(rank, 1))).wait()
        return await failure_of(mgr, await mgr.save(2, state_of(rank, 2)))


async def _restart(rank: int, world: int, directory: str) -> Any:
    async with aiosnap.CheckpointManager(directory, ranks=aiosnap.Ranks(timeout=20)) as mgr:
        restored = await mgr.restore()
        return {"step": restored.step, "m": float(restored.state["optim"]["m"][0])}


@pytest.mark.parametrize(("world", "victim"), [(4, 2), (2, 0)])
def test_a_rank_killed_mid_save_fails_the_survivors_at_once_and_the_restart_resumes(
    tmp_path: Path, world: int, victim: int
) -> None:
    # A deadline far longer than the test may take: the survivors learn of the death
    # from the closed connection, never by waiting the deadline out.
    results = run_ranks(world, _killed_mid_save, str(tmp_path), victim, 600.0, limit=300)
    assert sorted(results) == [r for r in range(world) if r != victim]
    for r in results.values():
        assert r["failed"] == [victim], r
        assert "gone: its connection closed" in r["message"], r
    assert (tmp_path / "snapshot_iter_2").exists() and not (
        tmp_path / "snapshot_iter_2" / MANIFEST_NAME
    ).exists()
    restarted = run_ranks(world, _restart, str(tmp_path))
    ok(restarted, world)
    assert all(r == {"step": 1, "m": rank * 100 + 1.0} for rank, r in restarted.items())
    assert not (tmp_path / "snapshot_iter_2").exists()  # swept at the restart


async def _hung_rank(rank: int, world: int, directory: str, silence: float) -> Any:
    reported = os.path.join(directory, "rank0-reported")
    async with aiosnap.CheckpointManager(directory, ranks=aiosnap.Ranks(timeout=silence)) as mgr:
        await (await mgr.save(1, state_of(rank, 1))).wait()
        handle = await mgr.save(2, state_of(rank, 2))
        if rank == 0:
            failure = await failure_of(mgr, handle)
            Path(reported).touch()
            return failure
        # A stuck training step that never awaits, until rank 0 has named this rank: so
        # rank 0 did not wait for it. The cap only ends the test if rank 0 never does.
        deadline = time.monotonic() + 60 * silence
        while not os.path.exists(reported) and time.monotonic() < deadline:
            time.sleep(0.01)  # noqa: ASYNC251 - blocking on purpose
        failure = await failure_of(mgr, handle)
        failure["released_by_rank0"] = os.path.exists(reported)
        return failure


async def _timed_saves(rank: int, world: int, directory: str) -> float:
    """How long opening and one save take when every rank answers: the baseline."""
    t0 = time.monotonic()
    async with aiosnap.CheckpointManager(directory, ranks=aiosnap.Ranks(timeout=300)) as mgr:
        await (await mgr.save(1, state_of(rank, 1))).wait()
    return time.monotonic() - t0


def test_a_silent_rank_is_named_while_it_is_still_stuck(tmp_path: Path) -> None:
    # The silence that names a rank is a ratio to what answering takes on this machine,
    # measured here: a slow machine gets a longer one, so only the stuck rank is named.
    baseline = max(run_ranks(2, _timed_saves, str(tmp_path / "baseline")).values())
    silence = max(2, round(10 * baseline))
    results = run_ranks(2, _hung_rank, str(tmp_path / "run"), float(silence), limit=300 + 60 * silence)
    assert results[0]["failed"] == [1] and f"did not answer within {silence} s" in results[0]["message"]
    assert results[1]["released_by_rank0"], results[1]
    assert "failed" in results[1]  # it learns, once it runs again, that the step failed


# -- world sizes ------------------------------------------------------------------------
async def _save_at(rank: int, world: int, directory: str) -> Any:
    async with aiosnap.CheckpointManager(
        directory, ranks=aiosnap.Ranks(replicated=["model"], timeout=20)
    ) as mgr:
        await (await mgr.save(5, state_of(rank, 5))).wait()
    return {}


async def _restore_at(rank: int, world: int, directory: str, keys: list[str] | None) -> Any:
    async with aiosnap.CheckpointManager(
        directory, ranks=aiosnap.Ranks(replicated=["model"], timeout=20)
    ) as mgr:
        try:
            restored = await mgr.restore(keys=keys)
        except aiosnap.errors.StateMismatchError as exc:
            return {"mismatch": str(exc)}
    state = restored.state
    expect = state_of(rank, 5)
    assert torch.equal(state["model"]["w"], expect["model"]["w"])
    assert torch.equal(state["model"]["b"], expect["model"]["b"])
    return {"keys": sorted(state), "m": float(state["optim"]["m"][0]) if "optim" in state else None}


def test_per_rank_state_restores_only_at_its_world_size_and_the_rest_at_any(tmp_path: Path) -> None:
    four, two = tmp_path / "four", tmp_path / "two"
    ok(run_ranks(4, _save_at, str(four)), 4)
    ok(run_ranks(2, _save_at, str(two)), 2)
    # Another world size, fewer ranks or more: the state of each rank (optim.m and rank
    # differ between ranks) is nobody else's; every rank raises, naming it.
    for directory, world in ((four, 2), (two, 4)):
        results = run_ranks(world, _restore_at, str(directory), None)
        assert sorted(results) == list(range(world))
        for r in results.values():
            assert "optim.m, rank held state of each rank" in r["mismatch"], r
    # ...while what is the same everywhere (replicated entries, the step) restores.
    for directory, world in ((four, 2), (two, 4)):
        replicated = run_ranks(world, _restore_at, str(directory), ["model", "step"])
        ok(replicated, world)
        assert all(r == {"keys": ["model", "step"], "m": None} for r in replicated.values())
    # The same world size: every rank gets its own.
    same = run_ranks(2, _restore_at, str(two), None)
    ok(same, 2)
    assert same[1] == {"keys": ["model", "optim", "rank", "step"], "m": 105.0}


# -- subgroups --------------------------------------------------------------------------
async def _in_subgroups(rank: int, world: int, root: str) -> Any:
    # Two pipelines of two ranks each, checkpointing independently (group= a subgroup):
    # every rank creates both subgroups, as torch requires, and uses its own.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    directory = os.path.join(root, f"pair{rank // 2}")
    seen = []
    for round_ in range(2):  # a second manager over the same subgroup opens and works
        async with aiosnap.CheckpointManager(
            directory, ranks=aiosnap.Ranks(pair, replicated=["model"], timeout=20)
        ) as mgr:
            seen.append((mgr.rank, mgr.world_size))
            step = 10 * round_ + rank // 2
            await (await mgr.save(step, state_of(rank, step))).wait()
            restored = await mgr.restore()
        assert restored.step == step and restored.state["rank"] == rank
        assert float(restored.state["optim"]["m"][0]) == rank * 100 + step
    return {"seen": seen}


def test_managers_over_subgroups_checkpoint_independently(tmp_path: Path) -> None:
    results = run_ranks(4, _in_subgroups, str(tmp_path))
    ok(results, 4)
    assert [results[r]["seen"] for r in range(4)] == [[(0, 2), (0, 2)], [(1, 2), (1, 2)]] * 2
    for p, steps in ((0, [0, 10]), (1, [1, 11])):
        for step in steps:
            manifest_path = tmp_path / f"pair{p}" / f"snapshot_iter_{step}" / MANIFEST_NAME
            manifest = Manifest.parse(str(manifest_path), manifest_path.read_bytes())
            assert manifest.world_size == 2 and manifest.step == step


# -- agreement --------------------------------------------------------------------------
async def _clock_trigger(rank: int, world: int, directory: str) -> Any:
    # The ranks' clocks (here: their triggers) disagree; rank 0's decision is followed.
    trigger = aiosnap.triggers.EveryNSeconds(0.0 if rank == 0 else 1e9)
    async with aiosnap.CheckpointManager(
        directory, save_every=trigger, ranks=aiosnap.Ranks(timeout=20)
    ) as mgr:
        for step in range(3):
            await mgr.save(step, state_of(rank, step))
        await mgr.flush()
        return await mgr.steps()


def test_clock_triggers_follow_rank_0(tmp_path: Path) -> None:
    results = run_ranks(2, _clock_trigger, str(tmp_path))
    ok(results, 2)
    assert results == {0: [0, 1, 2], 1: [0, 1, 2]}
    assert not deterministic(aiosnap.triggers.EveryNSeconds(1)) and deterministic(
        aiosnap.triggers.EveryNSteps(2)
    )
    assert deterministic(
        aiosnap.triggers.AnyTrigger(aiosnap.triggers.AtSteps([1]), aiosnap.triggers.EveryNEpochs(1))
    )


async def _different_replicas(rank: int, world: int, directory: str) -> Any:
    async with aiosnap.CheckpointManager(
        directory, ranks=aiosnap.Ranks(replicated=["model.*"], timeout=20)
    ) as mgr:
        state = state_of(rank, 1)
        if rank == 1:
            state["model"]["w"] = torch.zeros(3)
        try:
            await (await mgr.save(1, state)).wait()
        except aiosnap.errors.RankFailedError as exc:
            return {"failed": sorted(exc.failed), "message": str(exc), "steps": await mgr.steps()}
    return {}


def test_replicated_entries_that_differ_in_shape_are_refused(tmp_path: Path) -> None:
    results = run_ranks(2, _different_replicas, str(tmp_path))
    for r in results.values():
        assert r["failed"] == [1] and "replicated entries" in r["message"] and r["steps"] == []


async def _out_of_step(rank: int, world: int, directory: str) -> Any:
    async with aiosnap.CheckpointManager(directory, ranks=aiosnap.Ranks(timeout=20)) as mgr:
        try:
            await (mgr.steps() if rank == 0 else mgr.history())
        except aiosnap.errors.RankFailedError as exc:
            first = str(exc)
        try:
            await mgr.steps()
        except aiosnap.errors.RankFailedError as exc:
            return {"first": first, "then": str(exc)}
    return {}


def test_ranks_calling_different_methods_are_caught(tmp_path: Path) -> None:
    results = run_ranks(2, _out_of_step, str(tmp_path))
    assert "out of step" in results[0]["first"]
    assert results[0]["then"] == results[0]["first"]  # the channel stays broken


async def _misconfigured(rank: int, world: int, directory: str) -> Any:
    try:
        async with aiosnap.CheckpointManager(
            directory, ranks=aiosnap.Ranks(replicated=["model"] if rank else [], timeout=20)
        ):
            pass
    except aiosnap.errors.RankFailedError as exc:
        return {"failed": sorted(exc.failed)}
    return {}


def test_ranks_must_agree_on_the_layout(tmp_path: Path) -> None:
    results = run_ranks(2, _misconfigured, str(tmp_path))
    assert results == {0: {"failed": [1]}, 1: {"failed": [1]}}


# -- pieces, in one process -------------------------------------------------------------
def test_replicated_globs_match_a_path_or_its_parents() -> None:
    matches = replicated_matcher(["model.*", "emb"])
    assert matches("model.w") and matches("model.layers.0.w") and matches("emb.table")
    assert not matches("model") and not matches("optim.model.w") and not matches("embedding")


async def test_external_entries_are_read_from_the_replicas_file(tmp_path: Path) -> None:
    state = {"model": {"w": torch.randn(4, 4), "n": torch.arange(3)}, "mine": torch.ones(2)}
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    await aiosnap.save(full, state)
    await aiosnap.save(part, ExternalLeaves(state, replicated_matcher(["model"])))
    assert os.path.getsize(part) < os.path.getsize(full) - 64
    back = await aiosnap.load(part, replicas=full)
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and torch.equal(back["mine"], state["mine"])
    assert (await aiosnap.verify(part)).tensors == 1
    target = {
        "model": {"w": torch.zeros(4, 4), "n": torch.zeros(3, dtype=torch.int64)},
        "mine": torch.zeros(2),
    }
    await aiosnap.load_into(part, target, replicas=full)
    assert torch.equal(target["model"]["n"], state["model"]["n"])
    other = str(tmp_path / "other")
    await aiosnap.save(other, {"model": {"w": torch.randn(4, 4).double(), "n": torch.arange(3)}})
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="replicated entry 'model.w'"):
        await aiosnap.load(part, replicas=other)


def test_a_damaged_manifest_is_refused(tmp_path: Path) -> None:
    manifest = Manifest(3, None, 2, ["rank_00000", "rank_00001"], ["0" * 8] * 2, [1, 2], ["m"], "rank_00000")
    raw = manifest.to_bytes()
    assert Manifest.parse("m", raw) == manifest
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="bad manifest"):
        Manifest.parse("m", raw.replace(b'"step":3', b'"step":4'))
    for field, value in [("files", ["rank_00000", "../../etc/passwd"]), ("sizes", "12"), ("world_size", 3)]:
        hostile = json.loads(raw)
        hostile["body"][field] = value
        body = json.dumps(hostile["body"], sort_keys=True, separators=(",", ":")).encode()
        hostile["crc32c"] = f"{crc32c(body):08x}"  # a consistent but hostile manifest
        with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="bad manifest"):
            Manifest.parse("m", json.dumps(hostile).encode())


class HeldCapture:
    """A Stateful value whose capture (``state_dict``, in the staging thread) says it has
    started, then holds until released."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def state_dict(self) -> dict[str, Any]:
        self.started.set()
        self.release.wait(120)
        return {"held": torch.ones(4)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


async def _cancelled_save(rank: int, world: int, directory: str) -> Any:
    async with aiosnap.CheckpointManager(directory, ranks=aiosnap.Ranks(timeout=20)) as mgr:
        await (await mgr.save(1, state_of(rank, 1))).wait()
        held = HeldCapture()
        big = {**state_of(rank, 2), "held": held}
        result: dict[str, Any] = {}
        if rank == 1:
            task = asyncio.create_task(mgr.save(2, big))
            assert await asyncio.to_thread(held.started.wait, 120)
            task.cancel()  # cancelled during the capture
            held.release.set()
            try:
                await task
                result["cancelled"] = False
            except asyncio.CancelledError:
                result["cancelled"] = True
            try:
                await mgr.save(3, state_of(rank, 3))  # the group's failure of step 2 is not its own
                result["next"] = "saved"
            except aiosnap.errors.RankFailedError:
                result["next"] = "RankFailedError"
        else:
            held.release.set()
            result.update(await failure_of(mgr, await mgr.save(2, big)))
            await mgr.save(3, state_of(rank, 3))
        await mgr.flush()
        result["steps"] = await mgr.steps()
        return result


def test_a_save_cancelled_on_one_rank_commits_nothing_and_the_group_goes_on(tmp_path: Path) -> None:
    results = run_ranks(2, _cancelled_save, str(tmp_path))
    assert results[1]["cancelled"] is True and results[1]["next"] == "saved", results[1]
    assert results[0]["failed"] == [1] and "cancelled" in results[0]["message"], results[0]
    assert results[0]["steps"] == results[1]["steps"] == [1, 3]
    assert not (tmp_path / "snapshot_iter_2" / MANIFEST_NAME).exists()


def test_a_rank_file_that_is_not_the_committed_one_sends_every_rank_back_a_step(tmp_path: Path) -> None:
    ok(run_ranks(2, _round_trip, str(tmp_path)), 2)
    # A valid checkpoint file, but not the one step 3's manifest committed (a stale copy).
    shutil.copy(tmp_path / "snapshot_iter_2" / "rank_00001", tmp_path / "snapshot_iter_3" / "rank_00001")
    restarted = run_ranks(2, _restart, str(tmp_path))
    ok(restarted, 2)
    assert restarted == {0: {"step": 2, "m": 2.0}, 1: {"step": 2, "m": 102.0}}
    index = json.loads((tmp_path / aiosnap._manager.catalog.INDEX_NAME).read_text())
    (three,) = [c for c in index["checkpoints"] if c["step"] == 3]
    assert "not the committed" in three["corrupt"] and "rank 1" in three["corrupt"]


async def _synchronous_loop_with_a_collective(rank: int, world: int, directory: str) -> dict[str, Any]:
    """A training loop that yields only in save() and then blocks its event loop in a
    collective (the torchrun example's all_reduce). Rank 1's file of step 1 becomes
    durable only once its save(3) has returned: its save(3) has nothing of step 1 to
    finish, and it is in the all_reduce of step 3 by the time rank 0's save(3) finds its
    own file of step 1 durable and that step's vote open."""
    passed = threading.Event()  # rank 1 is past its save(3)

    def hook(op: str, path: str) -> None:
        if rank == 1 and op == "rename" and "snapshot_iter_1" in path:
            passed.wait()

    storage = aiosnap.storage.LocalStorage(posix=HookedPosix(hook))
    writer = aiosnap.QueueWriter(storage=storage)
    mine = Path(directory, "snapshot_iter_1", f"rank_{rank:05d}")
    async with aiosnap.CheckpointManager(
        directory, writer=writer, storage=storage, ranks=aiosnap.Ranks(timeout=60)
    ) as mgr:
        for step in range(1, 5):
            if step == 3 and rank == 0:
                while not mine.exists():  # durable: renamed into place (a worker thread's)
                    await asyncio.sleep(0.01)
            await mgr.save(step, state_of(rank, step))
            if step == 3:
                passed.set()
            total = torch.ones(1)
            dist.all_reduce(total)  # blocks the event loop, as a training step does
        await mgr.flush()
        return {"steps": await mgr.steps(), "total": float(total)}


def test_a_save_never_waits_for_a_vote_that_needs_a_rank_blocked_in_a_collective(tmp_path: Path) -> None:
    # save() finishes the follow-ups of earlier durable saves (retention keeping up with a
    # synchronous loop), but a vote still open waits for the other ranks' event loops:
    # waiting for it there hung the torchrun example (rank 0 in save(), rank 1 in
    # all_reduce). Before, this run never ended.
    results = run_ranks(2, _synchronous_loop_with_a_collective, str(tmp_path), limit=120)
    assert sorted(results) == [0, 1], results
    for r in results.values():
        assert r.get("steps") == [1, 2, 3, 4] and r["total"] == 2.0, r


_CLOSE_SCRIPT = """
import weakref
import torch.distributed as dist
from aiosnap._dist.coord import GlooChannel, new_group

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
channel = GlooChannel(new_group(None, 30), timeout=30, destroy=True)
held = channel.close  # what an offload thread keeps of the last call it ran, for a while
group = weakref.ref(channel.transport.group)
channel.close()
del channel
print("freed" if group() is None else "alive")
dist.destroy_process_group()
"""


def test_a_closed_channel_frees_its_group_in_the_closing_thread() -> None:
    """An offload thread that still holds a closed channel must not be the one to free its
    process group: freeing one releases the GIL, and a thread caught there by the
    interpreter's shutdown aborts the process (the ppe example's rank 0, 1 run in 5)."""
    done = subprocess.run([sys.executable, "-c", _CLOSE_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["freed"]
