"""Incremental saves refer only to blobs this process checked or wrote (issue 38).

A blob damaged on the disk (a flipped bit, a zstd frame cut short) or a foreign object
put under a blob's name on the remote tier is written again, never referred to unread:
the newest checkpoint restores after retention dropped the older ones. A save killed
while it wrote a blob leaves a temp file that the next open, ``prune()`` and ``aiosnap
prune`` remove, never one of a save in flight. A restart costs one read of each blob
the first save refers to, and nothing after.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap
from aiosnap._base.checksums import content_hash
from aiosnap.storage import FileStat, LocalStorage, Posix, from_url

from .faults import HookedPosix
from .test_cli import cli
from .test_incremental import BLOBS, ROWS, assert_equal, lora_state, make_base


def blob_path(directory: Path, tensor: torch.Tensor, suffix: str = "") -> Path:
    return directory / BLOBS / (content_hash(tensor.numpy().tobytes()) + suffix)


def flip_a_bit(path: Path) -> None:
    """One bit flipped in place, the file's mtime set back as it was (only its ctime,
    which nobody can set back, tells)."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(before.st_size // 2)
        byte = f.read(1)[0]
        f.seek(before.st_size // 2)
        f.write(bytes([byte ^ 0x10]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def cut_3_bytes(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 3)


def periodic_base() -> dict[str, torch.Tensor]:
    """A base that compresses (zstd blobs much smaller than the entries)."""
    return {
        f"layer{i}": ((torch.arange(4 * ROWS * 64) + i) % 7).float().reshape(4 * ROWS, 64) for i in range(3)
    }


DAMAGE = {
    "raw-flipped-bit": ({}, make_base, "", flip_a_bit),
    "zstd-cut-by-3-bytes": ({"compression": "zstd"}, periodic_base, ".zst", cut_3_bytes),
}


@pytest.mark.parametrize("reopen", [False, True], ids=["same-manager", "reopened"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
async def test_a_damaged_shared_blob_is_written_again_and_the_newest_checkpoint_restores(
    tmp_path: Path, damage: str, reopen: bool, caplog: pytest.LogCaptureFixture
) -> None:
    if "zstd" in damage:
        pytest.importorskip("zstandard")
    options, make, suffix, spoil = DAMAGE[damage]
    base = make()
    blob = blob_path(tmp_path, base["layer1"], suffix)

    def manager() -> aiosnap.CheckpointManager:
        return aiosnap.CheckpointManager(
            str(tmp_path), keep=aiosnap.retention.KeepLast(2), incremental=aiosnap.Incremental(**options)
        )

    mgr = await manager().__aenter__()
    try:
        await (await mgr.save(0, lora_state(0, base))).wait()
        good = blob.read_bytes()
        spoil(blob)
        if reopen:
            await mgr.__aexit__(None, None, None)
            mgr = await manager().__aenter__()
        with caplog.at_level(logging.WARNING, logger="aiosnap"):
            for step in (1, 2, 3):
                await (await mgr.save(step, lora_state(step, base))).wait()
        assert await mgr.steps() == [2, 3]  # retention dropped the older ones
        restored = await mgr.resume()
        assert restored is not None and restored.step == 3
        assert_equal(restored.state, lora_state(3, base))
        for step in (2, 3):
            await aiosnap.verify(str(tmp_path / mgr.filename(step)))
    finally:
        await mgr.__aexit__(None, None, None)
    assert blob.read_bytes() == good  # replaced whole, by the first save after the damage
    told = [r.getMessage() for r in caplog.records if str(blob) in r.getMessage()]
    assert len(told) == 1 and "written again" in told[0], told


FOREIGN = {
    "13-bytes": lambda good: b"not a blob!\n\n",
    "same-size": lambda good: bytes(b ^ 0xFF for b in good[:64]) + good[64:],
}


@pytest.mark.parametrize("foreign", sorted(FOREIGN))
@pytest.mark.parametrize("remote_kind", ["path", "memory"])
async def test_a_foreign_object_under_a_blobs_name_on_the_remote_is_replaced_not_trusted(
    tmp_path: Path, remote_kind: str, foreign: str
) -> None:
    base = make_base()
    good = base["layer0"].numpy().tobytes()
    name = content_hash(good)
    if remote_kind == "path":
        storage, remote = LocalStorage(), str(tmp_path / "remote")
    else:
        storage, remote = from_url("memory://"), f"memory://aiosnap-{uuid.uuid4().hex}/run"
    far = storage.join(remote, BLOBS, name)
    planted = FOREIGN[foreign](good)
    upload = storage.create(far, len(planted))
    upload.write_at(0, memoryview(planted))
    upload.commit()
    async with aiosnap.CheckpointManager(
        str(tmp_path / "local"), remote=aiosnap.Remote(remote, storage=storage), incremental=True
    ) as mgr:
        for step in (0, 1):
            handle = await mgr.save(step, lora_state(step, base))
            await handle.wait()
            assert handle.upload is not None
            await handle.upload.wait()
    reader = storage.open_read(far)
    try:
        now = bytearray(reader.size)
        reader.readinto(0, memoryview(now))
    finally:
        reader.close()
    assert bytes(now) == good
    for step in (0, 1):  # the remote tier alone restores each step
        loaded = await aiosnap.load(storage.join(remote, f"snapshot_iter_{step}"), storage=storage)
        assert_equal(loaded, lora_state(step, base))


# -- temp files of killed saves in the blob folders ----------------------------------------------
def _save_until_killed(directory: str, writing: Any) -> None:
    """Save incrementally, and stop for good at the fsync of the first blob (its temp file
    written whole, not renamed), once ``writing`` is set: the parent kills this process."""

    def hook(op: str, path: str) -> None:
        if op == "fsync" and f"{os.sep}{BLOBS}{os.sep}" in path:
            writing.set()
            threading.Event().wait()

    async def main() -> None:
        storage = LocalStorage(posix=HookedPosix(hook))
        async with aiosnap.CheckpointManager(directory, incremental=True, storage=storage) as mgr:
            await (await mgr.save(1, lora_state(1, make_base()))).wait()

    asyncio.run(main())


def _ctx() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["aiosnap", "tests.test_trusted_blobs"])
    return ctx


def temps(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith(aiosnap.storage.TEMP_PREFIX))


@pytest.mark.parametrize("how", ["open", "aiosnap-prune"])
def test_a_save_killed_while_writing_a_blob_leaves_a_temp_file_the_next_open_removes(
    tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = make_base()
    directory = tmp_path / "run"

    async def first() -> None:
        async with aiosnap.CheckpointManager(str(directory), incremental=True) as mgr:
            await (await mgr.save(0, lora_state(0, base))).wait()

    async def reopen() -> None:
        async with aiosnap.CheckpointManager(str(directory), incremental=True):
            pass

    asyncio.run(first())
    ctx = _ctx()
    writing = ctx.Event()
    child = ctx.Process(target=_save_until_killed, args=(str(directory), writing))
    child.start()
    try:
        assert writing.wait(120), "the child never wrote a blob"
    finally:
        child.kill()
        child.join()
    folder = directory / BLOBS
    (left,) = temps(folder)  # the killed save's: a blob's bytes, never renamed
    assert (folder / left).stat().st_size == 2 * ROWS * 64 * 4
    # What is not aiosnap's temp file stays: a link and a directory bearing its prefix.
    elsewhere = tmp_path / "users-file"
    elsewhere.write_text("not aiosnap's")
    (folder / f"{aiosnap.storage.TEMP_PREFIX}link").symlink_to(elsewhere)
    (folder / f"{aiosnap.storage.TEMP_PREFIX}dir").mkdir()
    if how == "open":
        asyncio.run(reopen())
    else:
        code, _, err = cli(capsys, "prune", str(directory), "--keep-last", "1")
        assert code == 0, err
    assert temps(folder) == sorted(
        [f"{aiosnap.storage.TEMP_PREFIX}dir", f"{aiosnap.storage.TEMP_PREFIX}link"]
    )
    assert elsewhere.read_text() == "not aiosnap's"
    assert_equal(aiosnap.load_sync(str(directory / "snapshot_iter_0")), lora_state(0, base))


async def test_prune_removes_a_dead_saves_temp_file_never_one_of_a_save_in_flight(tmp_path: Path) -> None:
    base = make_base()
    armed, stopped, go = threading.Event(), threading.Event(), threading.Event()

    def hook(op: str, path: str) -> None:
        if armed.is_set() and op == "fsync" and f"{os.sep}{BLOBS}{os.sep}" in path:
            armed.clear()
            stopped.set()
            go.wait()

    storage = LocalStorage(posix=HookedPosix(hook))
    folder = tmp_path / BLOBS
    async with aiosnap.CheckpointManager(str(tmp_path), incremental=True, storage=storage) as mgr:
        await (await mgr.save(0, lora_state(0, base))).wait()
        dead = folder / f"{aiosnap.storage.TEMP_PREFIX}{'0' * 32}.0123456789ab"
        dead.write_bytes(b"what a killed save left")
        armed.set()
        handle = await mgr.save(1, lora_state(1, base))  # its new blob stops before its fsync
        await asyncio.to_thread(stopped.wait)
        (flying,) = (n for n in temps(folder) if n != dead.name)
        try:
            assert await mgr.prune() == []
            assert temps(folder) == [flying]  # the dead one swept, never the one in flight
        finally:
            go.set()
        await handle.wait()
        assert temps(folder) == []
        restored = await mgr.restore()
        assert restored.step == 1
        assert_equal(restored.state, lora_state(1, base))


# -- the cost: one read of each blob the first save after a restart refers to --------------------
class CountingPosix(Posix):
    """The real calls, counting the bytes read from each file of a blob folder."""

    def __init__(self) -> None:
        self.paths: dict[int, str] = {}
        self.read: dict[str, int] = {}

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        self.paths[fd] = path
        return fd

    def fstat(self, fd: int) -> FileStat:
        return super().fstat(fd)

    def preadv(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        n = super().preadv(fd, bufs, offset)
        path = self.paths.get(fd, "")
        if f"{os.sep}{BLOBS}{os.sep}" in path:
            self.read[os.path.basename(path)] = self.read.get(os.path.basename(path), 0) + n
        return n


def _restart_and_save(directory: str, out: str) -> None:
    """A restarted process: two more saves, the bytes each read from the blob folder."""
    posix = CountingPosix()

    async def main() -> list[dict[str, int]]:
        reads = []
        storage = LocalStorage(posix=posix)
        async with aiosnap.CheckpointManager(directory, incremental=True, storage=storage) as mgr:
            for step in (1, 2):
                posix.read.clear()
                await (await mgr.save(step, lora_state(step, make_base()))).wait()
                reads.append(dict(posix.read))
        return reads

    Path(out).write_text(json.dumps(asyncio.run(main())))


def test_the_first_save_after_a_restart_reads_each_blob_it_refers_to_once_and_the_next_none(
    tmp_path: Path,
) -> None:
    base = make_base()

    async def first() -> None:
        async with aiosnap.CheckpointManager(str(tmp_path), incremental=True) as mgr:
            await (await mgr.save(0, lora_state(0, base))).wait()

    asyncio.run(first())
    child = _ctx().Process(target=_restart_and_save, args=(str(tmp_path), str(tmp_path / "reads.json")))
    child.start()
    child.join()
    assert child.exitcode == 0
    after_restart, next_save = json.loads((tmp_path / "reads.json").read_text())
    shared = {blob_path(tmp_path, t).name: t.nbytes for t in base.values()}
    assert after_restart == shared  # each base layer read once, whole; the new adapter not at all
    assert next_save == {}


async def test_a_link_under_a_blobs_name_is_neither_trusted_read_nor_replaced(tmp_path: Path) -> None:
    base = make_base()
    users = tmp_path / "users-file"
    users.write_bytes(bytes(base["layer0"].nbytes))  # of a blob's size, other bytes
    local, remote = tmp_path / "local", tmp_path / "remote"
    # Locally at layer0's blob; on the remote at layer1's (locally a blob as any other).
    links = [blob_path(local, base["layer0"]), blob_path(remote, base["layer1"])]
    for link in links:
        link.parent.mkdir(parents=True)
        link.symlink_to(users)
    async with aiosnap.CheckpointManager(str(local), remote=str(remote), incremental=True) as mgr:
        handle = await mgr.save(0, lora_state(0, base))
        await handle.wait()  # locally: the entry stays in the file, the link is left alone
        assert handle.upload is not None
        with pytest.raises(aiosnap.errors.ForeignFileError, match="symbolic link"):
            await mgr.flush()  # at once: a user's link is no outage to wait out
        with pytest.raises(aiosnap.errors.ForeignFileError):
            await handle.upload.wait()
    assert not (remote / "snapshot_iter_0").exists()
    assert all(link.is_symlink() for link in links)
    assert users.read_bytes() == bytes(base["layer0"].nbytes)
    assert_equal(await aiosnap.load(str(local / "snapshot_iter_0")), lora_state(0, base))
