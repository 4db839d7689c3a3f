"""A manager with two tiers: saves commit to a local directory, then upload in the
background to a remote one (moto's S3, or a local directory whose system calls the test
controls), each tier rotated by its own policy; restore takes the newest valid step of
either."""

from __future__ import annotations

import asyncio
import errno
import multiprocessing
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap
from aiosnap.storage import from_url

from .conftest import wait_until
from .faults import HookedPosix, Injector, StuckCommits
from .test_distributed import ok, run_ranks


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(step)), "step": step}


class Gate:
    """A hook that holds every rename into the remote directory until opened: uploads
    stay pending for as long as a test needs."""

    def __init__(self, remote: Path) -> None:
        self.remote, self.open_ = str(remote), threading.Event()
        self.waiting = 0

    def __call__(self, op: str, path: str) -> None:
        if op == "rename" and path.startswith(self.remote):
            self.waiting += 1
            self.open_.wait()


async def test_saves_upload_in_the_background_and_each_tier_keeps_its_own(s3: Any, tmp_path: Path) -> None:
    bucket = s3.bucket()
    url = f"s3://{bucket}/run"
    async with aiosnap.CheckpointManager(
        str(tmp_path),
        remote=aiosnap.Remote(url, storage=from_url(url, **s3.options), keep=aiosnap.retention.KeepLast(3)),
        keep=aiosnap.retention.KeepLast(1),
    ) as mgr:
        for step in range(1, 6):
            handle = await mgr.save(step, _state(step), metrics={"loss": 1 / step})
            await handle.wait()  # committed locally
            assert handle.upload is not None
            uploaded = await handle.upload.wait()
            assert uploaded.path == f"{url}/snapshot_iter_{step}" and uploaded.bytes > 0
        assert await mgr.steps() == [5]
        assert await mgr.remote_steps() == [3, 4, 5]
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert {k for k in keys if "snapshot" in k} == {f"run/snapshot_iter_{s}" for s in (3, 4, 5)}
    # The remote tier is a checkpoint directory in its own right, with its index and history.
    storage = from_url(url, **s3.options)
    async with aiosnap.CheckpointManager(url, storage=storage, read_only=True) as remote:
        assert [r.step for r in await remote.history()] == [1, 2, 3, 4, 5]
        assert (await remote.history())[-1].metrics == {"loss": 0.2}
        restored = await remote.restore()
        assert restored.step == 5 and torch.equal(restored.state["w"], _state(5)["w"])


async def test_a_local_checkpoint_is_kept_until_its_upload_ends(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    gate = Gate(remote)
    async with aiosnap.CheckpointManager(
        str(local),
        remote=aiosnap.Remote(
            str(remote),
            storage=aiosnap.storage.LocalStorage(posix=HookedPosix(gate)),
            uploader=aiosnap.UploadWriter(max_pending=4),
        ),
        keep=aiosnap.retention.KeepLast(1),
    ) as mgr:
        first = await mgr.save(1, _state(1))
        await first.wait()
        await wait_until(lambda: gate.waiting == 1, what="the upload of step 1 at its commit")
        second = await mgr.save(2, _state(2))
        await second.wait()
        # KeepLast(1) lets step 1 go, but its upload reads it: it stays for now.
        assert sorted(p.name for p in local.glob("snapshot_iter_*")) == ["snapshot_iter_1", "snapshot_iter_2"]
        assert await mgr.steps() == [1, 2]
        gate.open_.set()
        await mgr.flush()
        assert first.upload is not None and second.upload is not None
        assert first.upload.done() and second.upload.done()
        assert await mgr.steps() == [2]
        assert sorted(p.name for p in local.glob("snapshot_iter_*")) == ["snapshot_iter_2"]
        assert await mgr.remote_steps() == [1, 2]


async def test_a_full_upload_queue_drops_the_oldest_waiting_never_the_newest(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    gate = Gate(remote)
    async with aiosnap.CheckpointManager(
        str(local),
        remote=aiosnap.Remote(
            str(remote),
            storage=aiosnap.storage.LocalStorage(posix=HookedPosix(gate)),
            uploader=aiosnap.UploadWriter(max_pending=1),
        ),
    ) as mgr:
        handles = []
        for step in range(1, 5):
            handles.append(await mgr.save(step, _state(step)))
            await handles[-1].wait()
            if step == 1:
                await wait_until(lambda: gate.waiting == 1, what="the upload of step 1 at its commit")
        # Step 1 is uploading; 2 and 3 were each dropped when a newer one came; 4 waits.
        uploads = [h.upload for h in handles]
        assert all(u is not None for u in uploads)
        assert [u.skipped for u in uploads if u is not None] == [False, True, True, False]
        gate.open_.set()
        await mgr.flush()
        assert await mgr.remote_steps() == [1, 4]
        assert await mgr.steps() == [1, 2, 3, 4]


async def test_a_failing_upload_is_retried_then_reported_with_its_own_type(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    remote.mkdir()
    failing = {"n": 0}

    def flaky(op: str, path: str) -> None:  # the first two checkpoint writes into the remote fail
        if op == "write" and path.startswith(str(remote / "snapshot_iter")) and failing["n"] < 2:
            failing["n"] += 1
            raise OSError(errno.EIO, "injected", path)

    async with aiosnap.CheckpointManager(
        str(local),
        remote=aiosnap.Remote(
            str(remote),
            storage=aiosnap.storage.LocalStorage(posix=HookedPosix(flaky)),
            uploader=aiosnap.UploadWriter(retries=3, backoff=0.01),
        ),
    ) as mgr:
        handle = await mgr.save(1, _state(1))
        assert handle.upload is not None
        await handle.upload.wait()  # the third attempt went through
        assert failing["n"] == 2 and await mgr.remote_steps() == [1]

    dead = Injector(1, errno.EIO, persistent=True)

    def dying(op: str, path: str) -> None:  # every checkpoint write into the remote fails
        if op == "write" and path.startswith(str(remote / "snapshot_iter")):
            dead(op, path)

    mgr = aiosnap.CheckpointManager(
        str(local),
        remote=aiosnap.Remote(
            str(remote),
            storage=aiosnap.storage.LocalStorage(posix=HookedPosix(dying)),
            uploader=aiosnap.UploadWriter(retries=2, backoff=0.01, max_backoff=0.05),
        ),
    )
    await mgr.__aenter__()
    handle = await mgr.save(2, _state(2))
    await handle.wait()  # the local commit is unaffected
    await wait_until(lambda: dead.calls >= 3, what="three tries of the upload")
    await wait_until(
        lambda: any("the remote tier is unavailable" in r.getMessage() for r in caplog.records),
        what="the user told once the tries in a row ran out",
    )
    # The remote tier is unavailable now: flush says so, once uploads made no progress for
    # the time it is given; they go on in the background.
    with pytest.raises(aiosnap.errors.RemoteStorageError, match="made no progress for 0.2 s") as stuck:
        await mgr.flush(upload_timeout=0.2)
    assert isinstance(stuck.value.__cause__, OSError) and stuck.value.__cause__.errno == errno.EIO
    assert handle.upload is not None and not handle.upload.done()
    # A close gives up on them likewise, and reports them once, with their own type.
    with pytest.raises(OSError) as raised:
        await mgr.aclose(upload_timeout=0.2)
    assert raised.value.errno == errno.EIO
    assert any("1 upload(s) did not finish" in note for note in raised.value.__notes__)
    assert handle.upload.exception() is raised.value
    assert sorted(p.name for p in local.glob("snapshot_iter_*")) == ["snapshot_iter_1", "snapshot_iter_2"]
    assert sorted(p.name for p in remote.glob("snapshot_iter_*")) == ["snapshot_iter_1"]


async def test_a_remote_tier_that_cannot_be_opened_never_holds_up_the_local_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    remote.mkdir()
    hung = threading.Event()

    def hanging(op: str, path: str) -> None:  # the remote does not answer: its lock is never taken
        if path.startswith(str(remote)) and op == "open":
            hung.wait()

    try:
        async with aiosnap.CheckpointManager(
            str(local),
            remote=aiosnap.Remote(
                str(remote), storage=aiosnap.storage.LocalStorage(posix=HookedPosix(hanging))
            ),
        ) as mgr:
            handle = await mgr.save(1, _state(1))
            await handle.wait()  # opened and committed locally while the remote hangs
            assert await mgr.steps() == [1] and handle.upload is not None and not handle.upload.done()
            with pytest.raises(OSError, match="did not finish"):
                await mgr.aclose(upload_timeout=0.2)
    finally:
        hung.set()  # lets the abandoned thread end
    assert [n for n in os.listdir(remote) if n.startswith("snapshot")] == []  # nothing uploaded
    async with aiosnap.CheckpointManager(str(local), remote=str(remote)) as mgr:  # the remote answers
        await mgr.flush()  # the next open catches up: the newest local step is uploaded
        assert await mgr.remote_steps() == [1]


async def test_restore_takes_the_newest_valid_step_of_either_tier(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    async with aiosnap.CheckpointManager(
        str(local), remote=aiosnap.Remote(str(remote), keep=aiosnap.retention.KeepLast(2))
    ) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, _state(step))).wait()
        await mgr.flush()
    # A new machine: the local disk is empty, so the remote tier serves the restore.
    shutil.rmtree(local)
    async with aiosnap.CheckpointManager(str(local), remote=str(remote)) as mgr:
        restored = await mgr.restore(target=_state(0))
        assert restored.step == 3 and restored.path == str(remote / "snapshot_iter_3")
        assert float(restored.state["w"][0]) == 3.0
        await (await mgr.save(4, _state(4))).wait()  # a newer local step: it wins
        restored = await mgr.restore()
        assert restored.step == 4 and restored.path == str(local / "snapshot_iter_4")
        # Step 4's local file rots: the same step is read from the remote tier.
        await mgr.flush()
        with open(local / "snapshot_iter_4", "r+b") as f:
            f.seek(-8, os.SEEK_END)
            f.write(b"\xff" * 8)
        restored = await mgr.restore()
        assert restored.step == 4 and restored.path == str(remote / "snapshot_iter_4")
        assert torch.equal(restored.state["w"], _state(4)["w"])
        restored = await mgr.restore(3)  # only the remote tier holds step 3
        assert restored.path == str(remote / "snapshot_iter_3")


async def test_a_step_in_neither_tier_is_not_found(tmp_path: Path) -> None:
    async with aiosnap.CheckpointManager(str(tmp_path / "l"), remote=str(tmp_path / "r")) as mgr:
        with pytest.raises(aiosnap.errors.CheckpointNotFoundError, match="no valid checkpoint"):
            await mgr.restore()
        await (await mgr.save(1, _state(1))).wait()
        with pytest.raises(aiosnap.errors.CheckpointNotFoundError, match="step 7 is in neither"):
            await mgr.restore(7)


async def test_manual_uploads_and_the_job_runner_upload_the_final_epoch(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    job = aiosnap.Job()
    model = torch.nn.Linear(4, 2)

    @job.epoch_group.add
    async def train(ctx: aiosnap.RunContext) -> None:
        with torch.no_grad():
            model.weight.add_(1.0)

    aiosnap.epoch_limiter(job, 3)
    async with aiosnap.CheckpointManager(
        str(local), remote=aiosnap.Remote(str(remote), upload="manual")
    ) as mgr:
        runner = aiosnap.JobRunner(job, mgr, state={"model": model}, upload=True)
        assert await runner.train() == 3
        assert await mgr.steps() == [0, 1, 2, 3]
        assert await mgr.remote_steps() == [3]  # Caffe2's upload: the final epoch's
        again = await mgr.upload(3)
        await again.wait()
        assert again.skipped  # there already: nothing copied
        await (await mgr.upload(1)).wait()
        assert await mgr.remote_steps() == [1, 3]
    with pytest.raises(ValueError, match="remote tier"):
        aiosnap.JobRunner(job, aiosnap.CheckpointManager(str(local)), state={}, upload=True)


async def test_the_caller_waits_for_the_local_capture_only(tmp_path: Path) -> None:
    """Uploads run while the caller trains: a save returns while every upload is held."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    gate = Gate(remote)
    async with aiosnap.CheckpointManager(
        str(local),
        remote=aiosnap.Remote(str(remote), storage=aiosnap.storage.LocalStorage(posix=HookedPosix(gate))),
    ) as mgr:
        for step in (1, 2, 3):
            await (await mgr.save(step, _state(step))).wait()
        assert await mgr.remote_steps() == []
        gate.open_.set()


# -- a crash mid-upload ------------------------------------------------------------------------
def _save_then_die_uploading(local: str, url: str, env: dict[str, str]) -> None:
    os.environ.update(env)
    remote = StuckCommits(from_url(url))

    async def main() -> None:
        async with aiosnap.CheckpointManager(local, remote=aiosnap.Remote(url, storage=remote)) as mgr:
            await (await mgr.save(1, _state(1))).wait()
            await mgr.flush()
            remote.stuck = True  # the next upload's parts go up, and it never completes
            big = {"w": torch.full((12 << 20,), 2.0)}  # 48 MiB: a multipart upload
            await (await mgr.save(2, big)).wait()
            await mgr.flush()

    asyncio.run(main())


async def test_a_crash_mid_upload_is_caught_up_at_the_next_open(s3: Any, tmp_path: Path) -> None:
    bucket = s3.bucket()
    url, local = f"s3://{bucket}/run", str(tmp_path / "local")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["aiosnap", "tests.test_tiered"])
    child = ctx.Process(target=_save_then_die_uploading, args=(local, url, s3.env))
    child.start()
    await wait_until(
        lambda: bool(s3.incomplete_uploads(bucket)) or not child.is_alive(), what="a multipart upload"
    )
    os.kill(child.pid, signal.SIGKILL)
    await asyncio.to_thread(child.join)
    storage = from_url(url, **s3.options)
    async with aiosnap.CheckpointManager(local, remote=aiosnap.Remote(url, storage=storage)) as mgr:
        assert await mgr.steps() == [1, 2]
        await mgr.flush()  # the upload the crash cut short, made again at open
        assert await mgr.remote_steps() == [1, 2]
    assert s3.incomplete_uploads(bucket) == []
    loaded = await aiosnap.load(f"{url}/snapshot_iter_2", storage=storage)
    assert float(loaded["w"][-1]) == 2.0


# -- a group ---------------------------------------------------------------------------------
async def _tiered_group(rank: int, world: int, local: str, remote: str) -> Any:
    state = {"model": {"w": torch.full((64,), 1.0)}, "mine": torch.full((8,), float(rank))}
    async with aiosnap.CheckpointManager(
        local,
        remote=remote,
        ranks=aiosnap.Ranks(replicated=["model"], timeout=60),
        keep=aiosnap.retention.KeepLast(1),
    ) as mgr:
        for step in (1, 2, 3):
            state["mine"] += 1
            await (await mgr.save(step, state)).wait()
        await mgr.flush()
        local_steps, remote_steps = await mgr.steps(), await mgr.remote_steps()
    return {"local": local_steps, "remote": remote_steps}


async def _restore_group(rank: int, world: int, local: str, remote: str) -> Any:
    async with aiosnap.CheckpointManager(
        local, remote=remote, ranks=aiosnap.Ranks(replicated=["model"], timeout=60)
    ) as mgr:
        restored = await mgr.restore()
    return {"step": restored.step, "path": restored.path, "mine": float(restored.state["mine"][0])}


def test_a_group_uploads_each_rank_its_file_and_rank_0_the_manifest(tmp_path: Path) -> None:
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    results = run_ranks(2, _tiered_group, local, remote)
    ok(results, 2)
    assert all(r == {"local": [3], "remote": [1, 2, 3]} for r in results.values()), results
    for step in (1, 2, 3):
        names = sorted(os.listdir(os.path.join(remote, f"snapshot_iter_{step}")))
        assert names == ["aiosnap-manifest.json", "rank_00000", "rank_00001"]
    shutil.rmtree(local)  # new machines: the group restores from the remote tier
    results = run_ranks(2, _restore_group, local, remote)
    ok(results, 2)
    for rank, r in results.items():
        assert r["step"] == 3 and r["path"] == os.path.join(remote, "snapshot_iter_3")
        assert r["mine"] == rank + 3.0
