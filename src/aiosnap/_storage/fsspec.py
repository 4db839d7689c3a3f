"""Any fsspec filesystem behind the Storage interface (``memory://``, GCS through gcsfs ...).

An upload writes a temp name beside its target (``.aiosnap-tmp-...``, never listed) and
renames it over the target at commit; a killed upload leaves only such a name, which
``sweep_incomplete`` removes. Reads are ranged (``cat_file``). A conditional replace
(the index, a lease) is as safe as the filesystem allows: on GCS (gcsfs) it is
conditioned on the object's generation, so two writers in different processes never
lose an update; elsewhere the version is the content's checksum and the check and
the write are atomic only within one process.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

from .._base.checksums import crc32c
from .._base.errors import (
    CheckpointNotFoundError,
    ConflictError,
    CorruptCheckpointError,
    RemoteStorageError,
)
from .lease import VersionedLease
from .protocol import LEASE_NAME, TEMP_PREFIX, CommitTimes, Entry, UrlPaths, Version

_locks: dict[str, threading.Lock] = {}
_locks_lock = threading.Lock()


def known_protocol(scheme: str) -> bool:
    """Whether fsspec is installed and knows ``scheme``."""
    try:
        from fsspec.registry import known_implementations
    except ImportError:
        return False
    return scheme in known_implementations


class FsspecStorage(UrlPaths):
    """An fsspec filesystem (see the module docstring). Build it with ``from_url``, which
    passes its keyword arguments on to this constructor.

    Args:
        protocol: fsspec's name of the filesystem (``memory``, ``gs``, ``sftp`` ...).
        **options: The filesystem's own options (``fsspec.filesystem(protocol, **options)``),
            such as gcsfs's ``project`` or ``token``.
    """

    random_access = False

    def __init__(self, protocol: str, **options: Any) -> None:
        self.protocol, self.options = protocol, options
        self._fs: Any = None

    @classmethod
    def from_url(cls, url: str, **options: Any) -> FsspecStorage:
        return cls(url.split("://", 1)[0].lower(), **options)

    def __repr__(self) -> str:
        return f"FsspecStorage({self.protocol}://)"

    def __getstate__(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["protocol"], **state["options"])  # type: ignore[misc]

    @property
    def fs(self) -> Any:
        if self._fs is None:
            try:
                import fsspec
            except ImportError:
                raise ImportError(
                    "fsspec filesystems need fsspec: pip install fsspec (aiosnap's fsspec extra)"
                ) from None
            self._fs = fsspec.filesystem(self.protocol, **self.options)
        return self._fs

    # -- paths -----------------------------------------------------------------------------
    def _p(self, path: str) -> str:
        """The filesystem's own form of a URL of this storage."""
        if not path.lower().startswith(self.protocol + "://"):
            raise ValueError(f"{path!r} is not a {self.protocol}:// URL")
        return str(self.fs._strip_protocol(path))

    # -- writing -----------------------------------------------------------------------------
    def create(self, path: str, size: int | None) -> _FsspecUpload:
        return _FsspecUpload(self, path, size)

    def replace_if(self, path: str, data: bytes, expect: Version | None) -> Version:
        if self.protocol in ("gs", "gcs"):
            return self._replace_gcs(path, data, expect)
        with _lock_of(f"{self.protocol}://{self._p(path)}"):
            try:
                current = self.read_versioned(path)[1]
            except CheckpointNotFoundError:
                current = None
            if current != expect:
                raise ConflictError(path)
            upload = self.create(path, len(data))
            try:
                upload.write_at(0, memoryview(data))
                upload.commit()
            except BaseException:
                upload.abort()
                raise
            return _checksum(data)

    def _replace_gcs(self, path: str, data: bytes, expect: Version | None) -> Version:
        """A simple upload through GCS's JSON API with an ``ifGenerationMatch``
        precondition (0: the object must not exist)."""
        from urllib.parse import quote

        fs = self.fs
        bucket, key = self._p(path).split("/", 1)
        meta = json.dumps({"name": key})
        body = (
            (
                "--==0==\nContent-Type: application/json; charset=UTF-8\n\n" + meta + "\n--==0==\n"
                "Content-Type: application/octet-stream\n\n"
            ).encode()
            + data
            + b"\n--==0==--"
        )
        try:
            out = fs.call(
                "POST",
                f"{fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
                uploadType="multipart",
                ifGenerationMatch=str(0 if expect is None else json.loads(expect)),
                headers={"Content-Type": 'multipart/related; boundary="==0=="'},
                data=body,
                json_out=True,
            )
        except Exception as exc:
            if "412" in str(exc) or "precondition" in str(exc).lower() or isinstance(exc, FileExistsError):
                raise ConflictError(path) from exc
            raise RemoteStorageError(f"{path}: {type(exc).__name__}: {exc}") from exc
        return json.dumps(int(out["generation"]))

    # -- reading -----------------------------------------------------------------------------
    def open_read(self, path: str) -> _FsspecReader:
        return _FsspecReader(self, path)

    def read_versioned(self, path: str) -> tuple[bytes, Version]:
        try:
            if self.protocol in ("gs", "gcs"):
                info = self.fs.info(self._p(path))
                data = self.fs.cat_file(self._p(path))
                return data, json.dumps(int(info["generation"]))
            data = self.fs.cat_file(self._p(path))
        except FileNotFoundError:
            raise CheckpointNotFoundError(path) from None
        return data, _checksum(data)

    def stat(self, path: str) -> Entry | None:
        try:
            info = self.fs.info(self._p(path))
        except FileNotFoundError:
            return None
        name = self.split(path)[1]
        if info.get("type") == "directory":
            return Entry(name, True)
        size = int(info.get("size") or 0)
        return Entry(name, False, size, identity=_identity(info, size))

    # -- removing ----------------------------------------------------------------------------
    def delete(self, path: str) -> None:
        try:
            self.fs.rm(self._p(path))
        except FileNotFoundError:
            pass

    def delete_tree(self, path: str) -> None:
        try:
            self.fs.rm(self._p(path), recursive=True)
        except FileNotFoundError:
            pass

    def incomplete(self, path: str) -> list[str]:
        """The names of the temp files of unfinished commits directly under ``path``."""
        return [e.name for e in self._entries(path) if e.name.startswith(TEMP_PREFIX) and e.is_file]

    def sweep_incomplete(self, path: str) -> list[str]:
        swept = self.incomplete(path)
        for name in swept:
            self.delete(self.join(path, name))
        return [self.join(path, name) for name in swept]

    def lease(self, path: str, ttl: float) -> VersionedLease:
        return VersionedLease(self, self.join(path, LEASE_NAME), ttl)

    def _entries(self, path: str) -> list[Entry]:
        try:
            found = self.fs.ls(self._p(path), detail=True)
        except FileNotFoundError:
            return []
        here = self._p(path).rstrip("/")
        entries = []
        for info in found:
            name = str(info["name"]).rstrip("/")
            if name == here:
                continue
            is_dir = info.get("type") == "directory"
            entries.append(
                Entry(name.rsplit("/", 1)[-1], is_dir, 0 if is_dir else int(info.get("size") or 0))
            )
        return entries

    # Last: below it, ``list`` would name this method in annotations.
    def list(self, path: str) -> list[Entry]:
        return sorted(
            (e for e in self._entries(path) if not e.name.startswith(TEMP_PREFIX)), key=lambda e: e.name
        )


#: What an fsspec ``info`` may hold that changes when an object is written or replaced.
_CHANGES = (
    "ETag",
    "etag",
    "generation",
    "VersionId",
    "version_id",
    "mtime",
    "LastModified",
    "created",
    "ino",
)


def _identity(info: dict[str, Any], size: int) -> str | None:
    """An object's ``Entry.identity``, from what its file system says of it; None if nothing."""
    found = {key: str(info[key]) for key in _CHANGES if info.get(key) is not None}
    return json.dumps([found, size], sort_keys=True) if found else None


def _lock_of(key: str) -> threading.Lock:
    with _locks_lock:
        return _locks.setdefault(key, threading.Lock())


def _checksum(data: bytes) -> Version:
    return f"crc32c:{crc32c(data):08x}:{len(data)}"


class _FsspecUpload:
    """A temp name beside the target, written front to back, renamed over it at commit."""

    random_access = False
    local_path: str | None = None

    def __init__(self, storage: FsspecStorage, path: str, size: int | None) -> None:
        self.path, self.size = path, size
        self._storage = storage
        directory, name = storage.split(path)
        self._tmp = storage.join(directory, f"{TEMP_PREFIX}{name}.{secrets.token_hex(6)}")
        self._file: Any = None
        self._pos, self._write_s = 0, 0.0
        self._done = False

    def write_at(self, offset: int, data: memoryview) -> None:
        if offset != self._pos:
            raise ValueError(
                f"{self.path}: a file here is written front to back (at {self._pos}, not {offset})"
            )
        if self.size is not None:
            data = data[: max(0, self.size - offset)]
        t0 = time.perf_counter()
        if self._file is None:
            self._file = self._storage.fs.open(self._storage._p(self._tmp), "wb")
        self._file.write(data)
        self._pos += len(data)
        self._write_s += time.perf_counter() - t0

    def commit(self) -> CommitTimes:
        t0 = time.perf_counter()
        fs = self._storage.fs
        try:
            if self._file is None:
                fs.pipe_file(self._storage._p(self._tmp), b"")
            else:
                self._file.close()
            fs.mv(self._storage._p(self._tmp), self._storage._p(self.path))
        except BaseException:
            self.abort()
            raise
        self._done = True
        return CommitTimes(self._write_s, time.perf_counter() - t0, self._pos)

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            if self._file is not None:
                self._file.close()
        except Exception:
            pass
        self._storage.delete(self._tmp)


class _FsspecReader:
    def __init__(self, storage: FsspecStorage, path: str) -> None:
        self.path, self._storage = path, storage
        entry = storage.stat(path)
        if entry is None:
            raise CheckpointNotFoundError(path)
        if entry.is_dir:
            raise CorruptCheckpointError(path, "is a directory, not a checkpoint file")
        self.size = entry.size

    def readinto(self, offset: int, buf: memoryview) -> None:
        self.read_batch([(offset, [buf])])

    def read_batch(self, requests: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        fs, p = self._storage.fs, self._storage._p(self.path)
        wanted = [(offset, sum(len(b) for b in bufs)) for offset, bufs in requests]
        got = fs.cat_ranges([p] * len(wanted), [o for o, _ in wanted], [o + n for o, n in wanted])
        for (offset, bufs), data, (_, n) in zip(requests, got, wanted, strict=True):
            if isinstance(data, BaseException):
                raise RemoteStorageError(f"{self.path}: {data}") from data
            if len(data) != n:
                raise CorruptCheckpointError(self.path, f"truncated: wanted {n} bytes at offset {offset}")
            view, at = memoryview(data), 0
            for buf in bufs:
                flat = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
                flat[:] = view[at : at + len(flat)]
                at += len(flat)

    def close(self) -> None:
        pass
