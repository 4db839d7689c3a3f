"""DictStorage: a complete aiosnap storage backend that keeps objects in a dict.

docs/storage-backend.md explains it part by part, and tests/test_remote.py runs aiosnap's
storage contract tests against it (``pytest tests/test_remote.py -k dict``). Paths are
URLs (``dict://run/snapshot_iter_5``); the objects live in this process only, so it serves
the writers that commit in a thread (the default ones), not ProcessWriter's worker process.
``python examples/dict_storage.py`` runs the demo at the end.
"""

from __future__ import annotations

import asyncio
import itertools
import posixpath
import threading
import time
from collections.abc import Sequence

import torch

import aiosnap
from aiosnap.storage import CommitTimes, Entry, Version


class DictStorage:
    """Objects in a dict, by path. Every method is blocking and thread-safe: aiosnap calls
    them from its worker threads, several at once."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, Version]] = {}
        self.leases: dict[str, DictLease] = {}
        self.lock = threading.Lock()
        self._versions = itertools.count(1)

    def put(self, path: str, data: bytes) -> Version:
        """Store ``data`` at ``path`` whole, in one step (an upload's commit)."""
        with self.lock:
            return self._set(path, data)

    def _set(self, path: str, data: bytes) -> Version:
        version = str(next(self._versions))  # a new version at every change
        self.objects[path] = (data, version)
        return version

    # -- paths: URLs, joined and split at "/" ------------------------------------------------
    def join(self, *parts: str) -> str:
        head, *rest = parts
        return posixpath.join(head.rstrip("/"), *rest) if rest else head

    def split(self, path: str) -> tuple[str, str]:
        head, _, name = path.rstrip("/").rpartition("/")
        return head, name

    # -- writing: invisible until commit ----------------------------------------------------
    def create(self, path: str, size: int | None) -> DictUpload:
        return DictUpload(self, path, size)

    def replace_if(self, path: str, data: bytes, expect: Version | None) -> Version:
        with self.lock:  # the check and the change in one step: no update is lost
            now = self.objects.get(path)
            if (now[1] if now is not None else None) != expect:
                raise aiosnap.errors.ConflictError(path)
            return self._set(path, bytes(data))

    # -- reading: by byte ranges ------------------------------------------------------------
    def open_read(self, path: str) -> DictReader:
        with self.lock:
            found = self.objects.get(path)
        if found is None:
            raise aiosnap.errors.CheckpointNotFoundError(path)
        return DictReader(path, found[0])

    def read_versioned(self, path: str) -> tuple[bytes, Version]:
        with self.lock:
            found = self.objects.get(path)
        if found is None:
            raise aiosnap.errors.CheckpointNotFoundError(path)
        return found

    def stat(self, path: str) -> Entry | None:
        name = self.split(path)[1]
        with self.lock:
            if path in self.objects:
                return Entry(name, False, len(self.objects[path][0]))
            inside = any(key.startswith(path.rstrip("/") + "/") for key in self.objects)
        return Entry(name, True) if inside else None

    # -- removing ---------------------------------------------------------------------------
    def delete(self, path: str) -> None:
        with self.lock:
            self.objects.pop(path, None)

    def delete_tree(self, path: str) -> None:
        prefix = path.rstrip("/") + "/"
        with self.lock:
            for key in [k for k in self.objects if k == path or k.startswith(prefix)]:
                del self.objects[key]

    def sweep_incomplete(self, path: str) -> list[str]:
        return []  # an unfinished upload is a buffer of its process: nothing outlives it

    # -- one manager per directory ----------------------------------------------------------
    def lease(self, path: str, ttl: float) -> DictLease:
        return DictLease(self, path, ttl)

    # Last: below it, ``list`` in an annotation would name this method.
    def list(self, path: str) -> list[Entry]:
        prefix = path.rstrip("/") + "/"
        files: dict[str, int] = {}
        dirs: set[str] = set()
        with self.lock:
            for key, (data, _) in self.objects.items():
                if key.startswith(prefix):
                    name, sep, _rest = key[len(prefix) :].partition("/")
                    if sep:
                        dirs.add(name)
                    else:
                        files[name] = len(data)
        entries = [Entry(n, True) for n in dirs] + [Entry(n, False, s) for n, s in files.items()]
        return sorted(entries, key=lambda e: e.name)


class DictUpload:
    """A new object: bytes gathered in a buffer, stored whole by ``commit``."""

    local_path: str | None = None  # no local file a savefun could write: aiosnap streams one in
    random_access: bool = True  # pieces may come in any order

    def __init__(self, storage: DictStorage, path: str, size: int | None) -> None:
        self.storage, self.path, self.size = storage, path, size
        self.buf: bytearray | None = bytearray(size or 0)
        self.write_s = 0.0

    def write_at(self, offset: int, data: memoryview) -> None:
        assert self.buf is not None, "the upload was committed or aborted"
        t0 = time.perf_counter()
        data = data.cast("B")
        if self.size is not None:
            data = data[: max(0, self.size - offset)]  # an aligned write may run past the size
        if offset + len(data) > len(self.buf):
            self.buf.extend(bytes(offset + len(data) - len(self.buf)))
        self.buf[offset : offset + len(data)] = data  # a copy: the caller may reuse ``data``
        self.write_s += time.perf_counter() - t0

    def commit(self) -> CommitTimes:
        assert self.buf is not None, "the upload was committed or aborted"
        t0 = time.perf_counter()
        data, self.buf = bytes(self.buf), None
        self.storage.put(self.path, data)  # visible whole, in one step
        return CommitTimes(self.write_s, time.perf_counter() - t0, len(data))

    def abort(self) -> None:
        self.buf = None  # nothing was visible; calling it twice is fine


class DictReader:
    """A committed object, as it was when opened."""

    def __init__(self, path: str, data: bytes) -> None:
        self.path, self.size, self.data = path, len(data), data

    def readinto(self, offset: int, buf: memoryview) -> None:
        view = buf.cast("B")
        if offset + len(view) > self.size:
            raise aiosnap.errors.CorruptCheckpointError(self.path, f"truncated: {self.size} bytes")
        view[:] = self.data[offset : offset + len(view)]

    def read_batch(self, requests: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        for offset, bufs in requests:
            for buf in bufs:
                self.readinto(offset, buf)
                offset += buf.nbytes

    def close(self) -> None:
        pass


class DictLease:
    """One manager's hold on a directory, until released or not renewed for ``ttl``."""

    expires: float  # time.monotonic() of the end of the hold

    def __init__(self, storage: DictStorage, path: str, ttl: float) -> None:
        self.storage, self.path, self.ttl = storage, path, ttl
        with storage.lock:
            held = storage.leases.get(path)
            if held is not None and held.expires > time.monotonic():
                left = held.expires - time.monotonic()
                raise aiosnap.errors.DirectoryLockedError(
                    f"{path} is in use by another CheckpointManager", left
                )
            self.expires = time.monotonic() + ttl
            storage.leases[path] = self

    def renew(self) -> None:
        with self.storage.lock:
            if self.storage.leases.get(self.path) is not self:
                raise aiosnap.errors.LeaseLostError(f"{self.path}: another manager took the lease")
            self.expires = time.monotonic() + self.ttl

    def release(self) -> None:
        with self.storage.lock:
            if self.storage.leases.get(self.path) is self:
                del self.storage.leases[self.path]


# -- the demo ----------------------------------------------------------------------------------
async def main() -> None:
    storage = DictStorage()
    model = torch.nn.Linear(4, 2)
    async with aiosnap.CheckpointManager(
        "dict://run", storage=storage, keep=aiosnap.retention.KeepLast(2)
    ) as mgr:
        for step in range(1, 5):
            await mgr.save(step, {"model": model, "step": step})
    print(sorted(e.name for e in storage.list("dict://run")))
    async with aiosnap.CheckpointManager("dict://run", storage=storage) as mgr:
        restored = await mgr.restore()
    assert restored.step == restored.state["step"] == 4
    assert torch.equal(restored.state["model"]["weight"], model.weight)
    report = await aiosnap.verify("dict://run/snapshot_iter_4", storage=storage)
    print(f"step {restored.step} restored; {report.tensors} tensors verified")


if __name__ == "__main__":
    asyncio.run(main())
