"""Object storage under failure: a process killed mid-upload, and a network that resets
connections, answers 503 and stalls mid-body. A save commits after retries or fails
cleanly; a partial checkpoint is never visible."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import random
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

import aiosnap
from aiosnap.storage import from_url

from .conftest import wait_until
from .faults import StuckCommits


# -- killed mid-upload ------------------------------------------------------------------------
def _save_then_die_uploading(url: str, env: dict[str, str]) -> None:
    """Commit step 1, then start the multipart upload of step 2 and never complete it:
    the parent kills this process once the object store holds some of its parts."""
    os.environ.update(env)
    storage = StuckCommits(from_url(url))

    async def main() -> None:
        async with aiosnap.CheckpointManager(url, storage=storage, keep=aiosnap.retention.KeepLast(1)) as mgr:
            await (await mgr.save(1, {"w": torch.full((1000,), 1.0)})).wait()
            storage.stuck = True
            await (await mgr.save(2, {"w": torch.full((12 << 20,), 2.0)})).wait()  # 48 MiB: 3 parts

    asyncio.run(main())


def _parts_uploaded(s3: Any, bucket: str) -> bool:
    client = s3.client()
    for upload in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        parts = client.list_parts(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        if parts.get("Parts"):
            return True
    return False


async def test_a_process_killed_mid_upload_leaves_nothing_visible_and_its_parts_are_swept(
    s3: Any, caplog: pytest.LogCaptureFixture
) -> None:
    bucket = s3.bucket()
    url = f"s3://{bucket}/run"
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["aiosnap", "tests.test_remote_faults"])
    child = ctx.Process(target=_save_then_die_uploading, args=(url, s3.env))
    child.start()
    await wait_until(lambda: _parts_uploaded(s3, bucket) or not child.is_alive(), what="an upload's parts")
    os.kill(child.pid, signal.SIGKILL)
    await asyncio.to_thread(child.join)
    assert s3.incomplete_uploads(bucket) == ["run/snapshot_iter_2"]
    storage = from_url(url, **s3.options)
    # The dead holder ran on this host: its lease (60 s) is taken over at once, no waiting.
    async with aiosnap.CheckpointManager(url, storage=storage) as mgr:
        restored = await mgr.restore()
        assert restored.step == 1 and await mgr.steps() == [1]
    assert "may have died" not in caplog.text
    assert s3.incomplete_uploads(bucket) == []


# -- a faulty network --------------------------------------------------------------------------
class FaultyProxy:
    """HTTP/1.1 between a client and an upstream server, request by request; at requests
    the schedule picks it resets the connection, answers 503, or forwards half of the
    response and stalls until the client gives up."""

    def __init__(self, upstream: tuple[str, int], seed: int, rate: float) -> None:
        self.upstream, self.rng, self.rate = upstream, random.Random(seed), rate
        self.faults: dict[str, int] = {"reset": 0, "503": 0, "stall": 0}
        self.requests = itertools.count()

    def _fault(self) -> str | None:
        if self.rng.random() >= self.rate:
            return None
        fault = self.rng.choice(["reset", "reset", "503", "503", "stall"])
        self.faults[fault] += 1
        return fault

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    request = await _message(reader, body=True)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                next(self.requests)
                fault = self._fault()
                if fault == "reset":
                    writer.transport.abort()
                    return
                if fault == "503":
                    writer.write(b"HTTP/1.1 503 Slow Down\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
                up_writer.write(request)
                await up_writer.drain()
                response = await _message(up_reader, body=not request.startswith(b"HEAD "))
                up_writer.close()
                if fault == "stall":
                    writer.write(response[: len(response) // 2])
                    await writer.drain()
                    await reader.read()  # until the client times out and closes
                    return
                writer.write(response)
                await writer.drain()
        finally:
            writer.close()


async def _message(reader: asyncio.StreamReader, *, body: bool) -> bytes:
    """One HTTP message: its head, and (unless it answers a HEAD) a body of its
    Content-Length, or its chunks."""
    head = await reader.readuntil(b"\r\n\r\n")
    if not body:
        return head
    fields = {
        line.split(b":", 1)[0].strip().lower(): line.split(b":", 1)[1].strip()
        for line in head.split(b"\r\n")[1:]
        if b":" in line
    }
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        chunks = b""
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            chunks += size_line + await reader.readexactly(size + 2)
            if size == 0:
                return head + chunks
    return head + await reader.readexactly(int(fields.get(b"content-length", b"0")))


@contextlib.asynccontextmanager
async def faulty(s3: Any, seed: int, rate: float) -> AsyncIterator[tuple[FaultyProxy, dict[str, Any]]]:
    """A proxy in front of moto, and the storage options that go through it (requests
    time out after 2 s, so a stall costs little)."""
    host, port = s3.endpoint.removeprefix("http://").split(":")
    proxy = FaultyProxy((host, int(port)), seed, rate)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    endpoint = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = {"allow_http": True, "timeout": "2s"}
    try:
        yield proxy, {**s3.options, "endpoint": endpoint, "client_options": client}
    finally:
        server.close()


async def test_a_save_through_a_faulty_network_commits_after_retries_or_fails_cleanly(s3: Any) -> None:
    bucket = s3.bucket()
    url = f"s3://{bucket}/run"
    outcomes: list[str] = []
    async with faulty(s3, seed=7, rate=0.15) as (proxy, options):
        storage = from_url(url, deadline=30.0, part_size=5 << 20, **options)  # S3's least part
        for _ in range(3):  # opening may fail too: the lease and the index are requests
            try:
                async with aiosnap.CheckpointManager(
                    url, storage=storage, keep=aiosnap.retention.KeepLast(2)
                ) as mgr:
                    for step in range(1, 5):
                        size = (3 << 20) if step % 2 else 1000  # 12 MiB multipart uploads, single PUTs
                        try:
                            await (await mgr.save(step, {"w": torch.full((size,), float(step))})).wait()
                            outcomes.append("committed")
                        except aiosnap.errors.RemoteStorageError as exc:
                            outcomes.append(f"failed: {exc}")
                break
            except aiosnap.errors.RemoteStorageError as exc:
                outcomes.append(f"open failed: {exc}")
        assert sum(proxy.faults.values()) >= 5, proxy.faults
    assert "committed" in outcomes, outcomes
    assert all(url in o for o in outcomes if o != "committed"), outcomes  # each error names the URL
    # Whatever went through, every checkpoint visible is whole, and the newest restores.
    clean = from_url(url, **s3.options)
    async with aiosnap.CheckpointManager(url, storage=clean) as mgr:
        steps = await mgr.steps()
        for step in steps:
            await aiosnap.verify(f"{url}/snapshot_iter_{step}", storage=clean)
        restored = await mgr.restore()
        assert float(restored.state["w"][0]) == restored.step
    assert s3.incomplete_uploads(bucket) == []


async def test_reads_through_a_faulty_network_are_retried_and_verified(s3: Any) -> None:
    bucket = s3.bucket()
    url = f"s3://{bucket}/ckpt"
    state = {f"w{i}": torch.randn(1 << 20) for i in range(6)}  # 24 MiB: ranged reads in parallel
    await aiosnap.save(url, state, storage=from_url(url, **s3.options))
    async with faulty(s3, seed=3, rate=0.25) as (proxy, options):
        loaded = await aiosnap.load(url, storage=from_url(url, deadline=60.0, **options))
        assert sum(proxy.faults.values()) >= 1, proxy.faults
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor)
