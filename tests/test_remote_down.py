"""A tiered manager whose remote tier is down: from the start, or dying mid-run and coming
back (moto stopped and started again on its port). The local tier is the safety net:
opening, saving and closing never wait on the remote one, Ctrl-C ends a close that waits
for it, the user is told without configuring logging, and a resume reads both tiers.

Times are bounded far above normal (seconds, where the remote tier used to hold a call
for its whole retry deadline, 120 s, once per pending upload), never raced.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap
from aiosnap.storage import from_url

from .faults import HookedPosix
from .servers import S3, free_port, start_moto

#: Bounds far above what these calls take with the remote tier up (well under a second).
OPEN_BOUND, CLOSE_BOUND, INTERRUPT_BOUND = 20.0, 30.0, 30.0


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(step)), "step": step}


@dataclass
class Moto:
    """moto on a port of its own, which a test may stop and start again."""

    port: int
    s3: S3

    def stop(self) -> None:
        self.s3.server.stop()

    def start(self) -> None:
        self.s3 = start_moto(self.port)


@pytest.fixture
def moto() -> Iterator[Moto]:
    port = free_port()
    server = Moto(port, start_moto(port))
    try:
        yield server
    finally:
        try:
            server.stop()
        except Exception:  # stopped already
            pass


def _storage(moto: Moto, url: str, deadline: float = 3.0) -> aiosnap.storage.Storage:
    return from_url(url, **moto.s3.options, deadline=deadline)


async def test_a_remote_tier_down_from_the_start_holds_up_no_save(moto: Moto, tmp_path: Path) -> None:
    bucket = moto.s3.bucket()
    url = f"s3://{bucket}/run"
    moto.stop()  # down before the manager opens
    storage = _storage(moto, url, deadline=120.0)  # a deadline as long as the default
    t0 = time.monotonic()
    mgr = aiosnap.CheckpointManager(str(tmp_path / "local"), remote=aiosnap.Remote(url, storage=storage))
    async with mgr:
        opened = time.monotonic() - t0
        handle = await mgr.save(1, _state(1))
        await handle.wait()  # committed locally
        saved = time.monotonic() - t0
        assert await mgr.steps() == [1] and handle.upload is not None and not handle.upload.done()
        with pytest.raises(aiosnap.errors.RemoteStorageError, match="did not finish"):
            await mgr.aclose(upload_timeout=1.0)
    closed = time.monotonic() - t0
    assert opened < OPEN_BOUND and saved < OPEN_BOUND and closed < CLOSE_BOUND, (opened, saved, closed)
    moto.start()  # it comes back: the next open catches up the newest local step
    async with aiosnap.CheckpointManager(
        str(tmp_path / "local"), remote=aiosnap.Remote(url, storage=_storage(moto, url))
    ) as mgr:
        await mgr.flush()
        assert await mgr.remote_steps() == [1]


async def test_a_remote_tier_that_dies_mid_run_is_waited_for_then_caught_up(
    moto: Moto, tmp_path: Path
) -> None:
    bucket = moto.s3.bucket()
    url, local = f"s3://{bucket}/run", str(tmp_path / "local")
    uploader = aiosnap.UploadWriter(retries=1, backoff=0.05, max_backoff=0.2)
    # The lease the close cannot give up while the store is down goes stale after lease_ttl:
    # a short one, so that the reopen below takes it over soon.
    async with aiosnap.CheckpointManager(
        local,
        remote=aiosnap.Remote(url, storage=_storage(moto, url), uploader=uploader),
        keep=aiosnap.retention.KeepLast(1),
        lease_ttl=2.0,
    ) as mgr:
        await (await mgr.save(1, _state(1))).wait()
        await mgr.flush()
        assert await mgr.remote_steps() == [1]
        moto.stop()
        second = await mgr.save(2, _state(2))
        await second.wait()  # the local tier does not wait
        t0 = time.monotonic()
        with pytest.raises(aiosnap.errors.RemoteStorageError, match="made no progress for 1 s"):
            await mgr.flush(upload_timeout=1.0)
        assert time.monotonic() - t0 < CLOSE_BOUND
        assert await mgr.steps() == [2]  # KeepLast(1): step 1 went, uploaded; step 2 stays, its upload waits
        moto.start()
        assert second.upload is not None
        await second.upload.wait()  # tried again until the store came back
        await mgr.flush()
        assert await mgr.remote_steps() == [1, 2] and await mgr.steps() == [2]
        moto.stop()
        third = await mgr.save(3, _state(3))
        await third.wait()
        t0 = time.monotonic()
        with pytest.raises(aiosnap.errors.RemoteStorageError):
            await mgr.aclose(upload_timeout=1.0)
        assert time.monotonic() - t0 < CLOSE_BOUND
    moto.start()
    async with aiosnap.CheckpointManager(
        local, remote=aiosnap.Remote(url, storage=_storage(moto, url)), lease_ttl=2.0
    ) as mgr:
        await mgr.flush()  # the upload the close gave up on, made at this open
        assert await mgr.remote_steps() == [1, 2, 3]


# -- Ctrl-C, and a user who configured no logging -------------------------------------------
_CLOSING = r"""
import asyncio, faulthandler, signal, sys, torch, aiosnap
faulthandler.register(signal.SIGUSR1)  # the test asks for every thread's stack if it hangs
# Ctrl-C as a terminal delivers it: a SIGINT ignored or blocked by the process that started
# this one (its state is inherited) is reported, then set as a shell sets it.
blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
inherited = signal.getsignal(signal.SIGINT)
print(f"SIGINT inherited: {inherited!r}, blocked: {blocked}", file=sys.stderr, flush=True)
signal.signal(signal.SIGINT, signal.default_int_handler)
from aiosnap.storage import from_url

def dump_tasks():
    for task in asyncio.all_tasks():
        task.print_stack(file=sys.stderr)
    sys.stderr.flush()

async def main():
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, dump_tasks)
    url = sys.argv[2]
    storage = from_url(url, endpoint=sys.argv[3], access_key_id="testing", secret_access_key="testing",
                       region="us-east-1", client_options={"allow_http": True})
    async with aiosnap.CheckpointManager(sys.argv[1], remote=aiosnap.Remote(url, storage=storage)) as mgr:
        await (await mgr.save(1, {"w": torch.ones(4)})).wait()
        print("closing", flush=True)
        await mgr.aclose(upload_timeout=None)  # would wait for the remote tier for ever

asyncio.run(main())
"""


def test_ctrl_c_ends_a_close_that_waits_for_a_remote_tier_that_does_not_answer(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    child = subprocess.Popen(
        [sys.executable, "-c", _CLOSING, str(tmp_path / "local"), "s3://ckpt/run", dead],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stderr is not None
        assert child.stdout.readline().strip() == "closing"
        # With no logging configured, the user is told why the call waits.
        seen = []
        for line in child.stderr:
            seen.append(line)
            if "AiosnapWarning" in line:
                break
        assert any("no answer for" in line or "cannot be opened" in line for line in seen), seen
        # The rest of stderr is read as it comes: a child blocked writing to a full pipe
        # would not exit.
        rest: list[str] = []
        dumped = threading.Event()  # faulthandler has reached its last thread

        def read_rest() -> None:
            for line in child.stderr or ():
                rest.append(line)
                if line.startswith("Current thread"):  # the last of the threads dumped
                    dumped.set()

        reader = threading.Thread(target=read_rest, daemon=True)
        reader.start()
        t0 = time.monotonic()
        child.send_signal(signal.SIGINT)
        try:
            child.wait(timeout=INTERRUPT_BOUND)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGUSR2)  # its tasks' stacks (if its loop still runs)
            child.send_signal(signal.SIGUSR1)  # its threads' stacks, for the failure's message
            dumped.wait(timeout=10)
            child.kill()
            reader.join(timeout=10)
            pytest.fail("the close did not end after Ctrl-C:\n" + "".join(seen + rest)[-20000:])
        assert time.monotonic() - t0 < INTERRUPT_BOUND
        assert child.returncode != 0  # interrupted, not finished
    finally:
        child.kill()
        child.wait()
    assert (tmp_path / "local" / "snapshot_iter_1").exists()


def test_ls_of_a_store_that_does_not_answer_says_so_within_seconds(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    child = subprocess.Popen(
        [sys.executable, "-m", "aiosnap", "ls", "s3://ckpt/run"], stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stderr is not None
        t0 = time.monotonic()
        line = child.stderr.readline()
        # It names what was asked for, never a function of aiosnap's (it said "_locate('s3://...')").
        assert line.startswith("aiosnap: warning: listing s3://ckpt/run: no answer for 5 s"), line
        assert "--deadline" in line and "_locate" not in line
        # The notice comes SLOW_REMOTE (5 s) after the call; the bound also holds the
        # child's start and imports, slow on a loaded machine. Without it: minutes.
        assert time.monotonic() - t0 < 2 * OPEN_BOUND
    finally:
        child.kill()
        child.wait()


# -- resuming across tiers ------------------------------------------------------------------
async def test_the_resume_pattern_reads_both_tiers(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    async with aiosnap.CheckpointManager(str(local), remote=str(remote)) as mgr:
        assert await mgr.resume() is None and await mgr.latest_step() is None  # a fresh start
        for step in (1, 2, 3):
            await (await mgr.save(step, _state(step))).wait()
        await mgr.flush()
    shutil.rmtree(local)  # a new machine: only the remote tier holds the run
    async with aiosnap.CheckpointManager(str(local), remote=str(remote)) as mgr:
        assert await mgr.steps() == [] and await mgr.latest_step() == 3
        target = _state(0)
        restored = await mgr.resume(target=target)
        assert (
            restored is not None and restored.step == 3 and restored.path == str(remote / "snapshot_iter_3")
        )
        assert float(target["w"][0]) == 3.0


async def test_a_resume_never_starts_afresh_while_the_remote_tier_cannot_be_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    remote.mkdir()

    def down(op: str, path: str) -> None:
        if path.startswith(str(remote)):
            raise OSError(errno.EIO, "injected: the remote tier is down", path)

    async with aiosnap.CheckpointManager(
        str(local),
        remote=aiosnap.Remote(str(remote), storage=aiosnap.storage.LocalStorage(posix=HookedPosix(down))),
    ) as mgr:
        with pytest.raises(aiosnap.errors.RemoteStorageError, match="unavailable"):
            await mgr.resume()  # it may hold checkpoints: not a fresh start
        await (await mgr.save(1, _state(1))).wait()
        assert await mgr.latest_step() == 1  # with a local step to go on with, and a warning
        restored = await mgr.resume()
        assert restored is not None and restored.step == 1
        with pytest.raises(OSError):
            await mgr.aclose(upload_timeout=0.5)
    assert any("going on with the local steps" in r.getMessage() for r in caplog.records)
