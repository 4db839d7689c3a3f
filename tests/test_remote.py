"""Object storage: the Storage contract on every backend (local disk; S3 on moto; Azure on
azurite; fsspec's memory://; GCS through gcsfs on fake-gcs-server, and read through
obstore; the in-memory example backend of docs/storage-backend.md), and checkpoints by URL.

A backend of your own runs these contract tests once it is a kind of the ``backend``
fixture, as ``dict`` is: ``pytest tests/test_remote.py -k dict``.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap
from aiosnap.storage import from_url

from .conftest import assert_tree_equal, training_state, wait_until
from .servers import gcsfs_options

BACKENDS = ["local", "s3", "azure", "memory", "gcs-fsspec", "dict"]
ROOT = Path(__file__).resolve().parent.parent


def _example_backend() -> Any:
    """examples/dict_storage.py, the backend docs/storage-backend.md builds."""
    spec = importlib.util.spec_from_file_location("dict_storage", ROOT / "examples" / "dict_storage.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DictStorage()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[aiosnap.storage.Storage, str]]:
    """A storage and a fresh directory (a path or a URL) on it."""
    kind = request.param
    if kind == "local":
        yield aiosnap.storage.LocalStorage(), str(tmp_path / "run")
    elif kind == "s3":
        s3 = request.getfixturevalue("s3")
        bucket = s3.bucket()
        yield from_url(f"s3://{bucket}", **s3.options), f"s3://{bucket}/run"
    elif kind == "azure":
        azure = request.getfixturevalue("azure")
        container = azure.container()
        yield from_url(f"az://{container}", **azure.options()), f"az://{container}/run"
    elif kind == "memory":
        yield from_url("memory://"), f"memory://aiosnap-{uuid.uuid4().hex}/run"
    elif kind == "dict":
        yield _example_backend(), "dict://run"
    else:
        gcs = request.getfixturevalue("gcs")
        bucket = gcs.bucket()
        storage = from_url(f"gs://{bucket}", backend="fsspec", **gcsfs_options(gcs))
        yield storage, f"gs://{bucket}/run"


def _put(storage: aiosnap.storage.Storage, path: str, data: bytes) -> None:
    upload = storage.create(path, len(data))
    for at in range(0, len(data), 7000):  # front to back, in pieces
        upload.write_at(at, memoryview(data)[at : at + 7000])
    upload.commit()


def _read(storage: aiosnap.storage.Storage, path: str) -> bytes:
    reader = storage.open_read(path)
    try:
        buf = bytearray(reader.size)
        reader.readinto(0, memoryview(buf))
        return bytes(buf)
    finally:
        reader.close()


def test_an_upload_is_invisible_until_its_commit_and_gone_after_an_abort(
    backend: tuple[aiosnap.storage.Storage, str],
) -> None:
    storage, root = backend
    path = storage.join(root, "obj")
    data = os.urandom(50_000)
    upload = storage.create(path, len(data))
    upload.write_at(0, memoryview(data)[:30_000])
    assert storage.stat(path) is None and [e.name for e in storage.list(root)] == []
    upload.write_at(30_000, memoryview(data)[30_000:])
    times = upload.commit()
    assert times.bytes == len(data)
    entry = storage.stat(path)
    assert entry is not None and (entry.name, entry.is_dir, entry.size) == ("obj", False, len(data))
    aborted = storage.create(storage.join(root, "other"), 10)
    aborted.write_at(0, memoryview(b"0123456789"))
    aborted.abort()
    assert [e.name for e in storage.list(root)] == ["obj"]
    assert storage.sweep_incomplete(root) == [] or backend[1].startswith(("s3", "az"))
    reader = storage.open_read(path)
    try:
        assert reader.size == len(data)
        a, b = bytearray(100), bytearray(200)
        reader.read_batch([(10, [memoryview(a), memoryview(b)]), (40_000, [memoryview(bytearray(5))])])
        assert bytes(a + b) == data[10:310]
        whole = bytearray(len(data))
        reader.readinto(0, memoryview(whole))
        assert whole == data
        with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="truncated"):
            reader.readinto(len(data) - 5, memoryview(bytearray(10)))
    finally:
        reader.close()


def test_a_writer_may_reuse_its_buffer_once_write_at_returns(
    backend: tuple[aiosnap.storage.Storage, str],
) -> None:
    # obstore's writer kept the buffers it was given until their part was sent: a saver
    # that refills one buffer (the pieces of a large save, an upload's copy) sent the
    # last piece's bytes in place of the first ones.
    storage, root = backend
    path, piece = storage.join(root, "reused"), 24 << 20  # more than one part
    upload, buf = storage.create(path, 2 * piece), bytearray(piece)
    for i in range(2):
        buf[:] = bytes([i + 1]) * piece
        upload.write_at(i * piece, memoryview(buf))
    upload.commit()
    # Read back into destinations that do not follow the parts: a range cut across them,
    # two requests that continue each other, and one elsewhere.
    reader, got, tail = storage.open_read(path), bytearray(2 * piece), bytearray(5)
    view, cut = memoryview(got), piece - 3
    reader.read_batch([(0, [view[:7], view[7:cut]]), (cut, [view[cut:]]), (piece - 5, [memoryview(tail)])])
    reader.close()
    assert got == b"\x01" * piece + b"\x02" * piece and tail == b"\x01" * 5


async def test_a_save_larger_than_its_memory_budget_round_trips(
    backend: tuple[aiosnap.storage.Storage, str],
) -> None:
    storage, root = backend
    state = {f"w{i}": torch.full((3 << 20,), float(i)) for i in range(4)}  # 4 x 12 MiB
    path = storage.join(root, "big")
    async with aiosnap.QueueWriter(max_host_bytes=8 << 20, storage=storage) as writer:
        await (await writer("big", root, state)).wait()  # through one 8 MiB buffer
    assert_tree_equal(await aiosnap.load(path, storage=storage), state)


def test_listing_directories_and_deleting_trees(backend: tuple[aiosnap.storage.Storage, str]) -> None:
    storage, root = backend
    for name in ("a/x", "a/y", "b"):
        _put(storage, storage.join(root, name), b"data")
    assert [(e.name, e.is_dir) for e in storage.list(root)] == [("a", True), ("b", False)]
    entry = storage.stat(storage.join(root, "a"))
    assert entry is not None and entry.is_dir
    assert (
        storage.stat(storage.join(root, "nothing")) is None and storage.list(storage.join(root, "no")) == []
    )
    storage.delete_tree(storage.join(root, "a"))
    storage.delete(storage.join(root, "missing"))  # not an error
    assert [e.name for e in storage.list(root)] == ["b"]
    with pytest.raises(aiosnap.errors.CheckpointNotFoundError):
        storage.open_read(storage.join(root, "a/x"))


def test_a_conditional_replace_never_loses_an_update(backend: tuple[aiosnap.storage.Storage, str]) -> None:
    storage, root = backend
    path = storage.join(root, "index")
    first = storage.replace_if(path, b"one", None)
    with pytest.raises(aiosnap.errors.ConflictError):
        storage.replace_if(path, b"two", None)  # it exists already
    data, version = storage.read_versioned(path)
    assert data == b"one" and version == first
    second = storage.replace_if(path, b"two", version)
    with pytest.raises(aiosnap.errors.ConflictError):
        storage.replace_if(path, b"three", first)  # a writer that read the old version
    assert storage.read_versioned(path) == (b"two", second)


def test_a_lease_excludes_a_second_holder_until_released_or_stale(
    backend: tuple[aiosnap.storage.Storage, str],
) -> None:
    storage, root = backend
    held = storage.lease(root, 600.0)
    with pytest.raises(aiosnap.errors.DirectoryLockedError, match="in use by another CheckpointManager"):
        storage.lease(root, 600.0)
    held.renew()
    held.release()
    again = storage.lease(root, 600.0)
    again.release()
    if root.startswith(("s3", "az", "gs", "memory", "dict")):
        # A holder that stopped renewing (here: a ttl already past) is taken over, and
        # learns it at its next renewal: it must stop writing.
        stale = storage.lease(root, 0.0)
        taker = storage.lease(root, 600.0)
        with pytest.raises(aiosnap.errors.LeaseLostError):
            stale.renew()
        taker.release()


@pytest.mark.parametrize("backend", ["s3", "azure", "memory", "gcs-fsspec", "dict"], indirect=True)
async def test_checkpoints_by_url_round_trip(backend: tuple[aiosnap.storage.Storage, str]) -> None:
    storage, root = backend
    state = training_state()
    path = storage.join(root, "ckpt")
    stats = await aiosnap.save(path, state, storage=storage)
    assert stats.bytes > 0
    fresh = training_state(seed=1)
    await aiosnap.load_into(path, fresh, storage=storage)
    assert_tree_equal(state["model"].state_dict(), fresh["model"].state_dict())
    report = await aiosnap.verify(path, storage=storage)
    assert report.checksummed and report.tensors > 4
    part = await aiosnap.load(path, keys=["step"], storage=storage)
    assert part == {"step": 7}


async def test_load_reports_its_progress_in_bytes(backend: tuple[aiosnap.storage.Storage, str]) -> None:
    storage, root = backend
    state = {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(8)}  # 8 x 1 MiB
    path = storage.join(root, "ckpt")
    stats = await aiosnap.save(path, state, storage=storage)
    calls: list[tuple[int, int]] = []
    loaded = await aiosnap.load(
        path, storage=storage, progress=lambda done, total: calls.append((done, total))
    )
    assert_tree_equal(loaded, state)
    assert len(calls) >= 2 and calls[-1] == (stats.bytes, stats.bytes)
    assert all(done <= total for done, total in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    calls.clear()
    target = {f"w{i}": torch.zeros(1 << 18) for i in range(8)}
    await aiosnap.load_into(path, target, storage=storage, progress=lambda d, t: calls.append((d, t)))
    assert_tree_equal(target, state) and calls[-1] == (stats.bytes, stats.bytes)


async def test_urls_configure_themselves_from_the_environment(
    s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    url = f"s3://{s3.bucket()}/run/ckpt"
    state = {"w": torch.arange(10.0), "n": 3}
    async with aiosnap.QueueWriter() as writer:  # out_dir a URL: the storage is picked by scheme
        await (await writer("ckpt", url.rsplit("/", 1)[0], state)).wait()
    assert_tree_equal(state, await aiosnap.load(url))
    assert (await aiosnap.verify(url)).tensors == 1


async def test_an_object_larger_than_part_size_goes_up_in_parts_as_it_is_written(s3: Any) -> None:
    # A smaller object waits for its commit, one request; parts go up as they are written.
    bucket = s3.bucket()
    storage = from_url(f"s3://{bucket}", part_size=5 << 20, **s3.options)
    data = os.urandom(11 << 20)
    upload = storage.create(f"s3://{bucket}/parts", len(data))
    upload.write_at(0, memoryview(data))
    await wait_until(lambda: s3.incomplete_uploads(bucket) == ["parts"], what="a multipart upload")
    assert storage.stat(f"s3://{bucket}/parts") is None  # invisible until the commit
    upload.commit()
    assert _read(storage, f"s3://{bucket}/parts") == data and s3.incomplete_uploads(bucket) == []
    assert pickle.loads(pickle.dumps(storage)).part_size == 5 << 20  # as a worker process gets it
    with pytest.raises(ValueError, match="at least"):
        from_url(f"s3://{bucket}", part_size=1 << 20)


async def test_gcs_checkpoints_read_through_obstore(gcs: Any, tmp_path: Path) -> None:
    """fake-gcs-server does not serve the XML API obstore writes with: the objects are
    put through the JSON API, and read (whole, by keys, verified) through obstore."""
    state = training_state()
    local = tmp_path / "ckpt"
    await aiosnap.save(str(local), state)
    bucket = gcs.bucket()
    gcs.put(bucket, "run/ckpt", local.read_bytes())
    storage = from_url(f"gs://{bucket}", **gcs.obstore_options(tmp_path))
    url = f"gs://{bucket}/run/ckpt"
    fresh = training_state(seed=1)
    await aiosnap.load_into(url, fresh, storage=storage)
    assert_tree_equal(state["model"].state_dict(), fresh["model"].state_dict())
    assert (await aiosnap.verify(url, storage=storage)).checksummed
    assert _read(storage, url) == local.read_bytes()
