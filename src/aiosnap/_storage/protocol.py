"""Where checkpoint bytes live: the interface every backend implements.

Everything above this line knows bytes and object names; nothing above it knows
POSIX, S3 or fsspec. A checkpoint is written through an ``Upload`` that is invisible
until ``commit()`` makes it visible whole (a durable rename on a local disk, the
completion of a multipart upload on an object store); it is read through a
``Reader`` by byte ranges. A small object that several writers may race to replace
(the index, a lease) is replaced only if it is still the version that was read.

Every method is blocking: callers run them in worker threads (``_offload``) or in the
offload worker process, which is why this module imports only the standard library.
Paths are strings in the backend's own form: OS paths for LocalStorage, URLs
(``s3://bucket/run/step_5``) for the others.
"""

from __future__ import annotations

import errno
import io
import os
import posixpath
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from .._base.errors import CorruptCheckpointError

TEMP_PREFIX = ".aiosnap-tmp-"
"""Temp files and uploads of unfinished commits start with this; nothing else does."""
LEASE_NAME = ".aiosnap.lock"
"""The lease of a checkpoint directory (a lock file, or a lock object)."""
ALIGN = 4096
"""The alignment O_DIRECT asks of buffers, offsets and lengths (4096 covers every logical
block size): staged images, their data sections and their arenas are laid out on it, so a
backend can write an image whole, past its size (see ``write_image``)."""

Version = str
"""An opaque version of a stored object: an ETag, a generation, inode and mtime."""


class CommitTimes(NamedTuple):
    """How one commit went (what ``Upload.commit`` returns).

    Attributes:
        write_s: Seconds spent writing the bytes.
        fsync_s: Seconds spent making them durable and visible.
        bytes: The bytes committed.
    """

    write_s: float
    fsync_s: float
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class Entry:
    """A committed object, or a directory (a common prefix on an object store), as
    ``Storage.list`` and ``Storage.stat`` describe it.

    Attributes:
        name: The last component of its path.
        is_dir: Whether it is a directory.
        size: Its bytes (0 for a directory).
        special: Neither an object (a regular file) nor a directory: a symbolic link, a
            FIFO, a device. aiosnap never makes one, so it never reads, follows or
            deletes one.
        identity: What changes whenever the object is written or replaced, where the
            backend tells it (``stat`` only; None in listings): a file's device, inode,
            size, mtime and ctime; an object's ETag and version, or generation.
    """

    name: str
    is_dir: bool
    size: int = 0
    special: bool = False
    identity: str | None = None

    @property
    def is_file(self) -> bool:
        """An object or a regular file (not a directory, not ``special``)."""
        return not (self.is_dir or self.special)


class Upload(Protocol):
    """A new object being written; invisible until ``commit``."""

    path: str
    #: A local file that holds the object's bytes until the commit, if the backend has
    #: one (LocalStorage's temp file): a ``savefun`` writes straight into it.
    local_path: str | None
    #: Whether pieces may come in any order (a local file); else front to back (an
    #: object store's streamed upload).
    random_access: bool

    def write_at(self, offset: int, data: memoryview) -> None:
        """Write ``data`` at ``offset`` (in any order if ``random_access``). Bytes at or
        past the size given to ``create`` are dropped (aligned writes may run over). The
        backend may keep ``data`` until ``commit`` (an object store's part not sent yet):
        the caller must not change it before then."""

    def commit(self) -> CommitTimes:
        """Make the object durable and visible whole, replacing any object at ``path``."""

    def abort(self) -> None:
        """Forget the upload; nothing becomes visible. Idempotent."""


class Reader(Protocol):
    """A committed object, read by offset."""

    path: str
    size: int

    def readinto(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from ``offset``; reading past the end raises CorruptCheckpointError."""

    def read_batch(self, requests: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        """For each ``(offset, bufs)``, fill ``bufs`` one after the other from ``offset``.
        A backend may serve the requests concurrently (ranged GETs in parallel)."""

    def close(self) -> None:
        """Release the object."""


class Lease(Protocol):
    """An exclusive hold on a checkpoint directory by one manager."""

    def renew(self) -> None:
        """Extend the hold (object stores); raise LeaseLostError if another took it."""

    def release(self) -> None:
        """Give the hold up. Idempotent."""


@runtime_checkable
class Storage(Protocol):
    """The operations checkpoints need, and no more (see the module docstring)."""

    def join(self, *parts: str) -> str:
        """Join path parts the way this storage does."""

    def split(self, path: str) -> tuple[str, str]:
        """Split a path into (directory, name)."""

    def create(self, path: str, size: int | None) -> Upload:
        """Start writing a new object of ``size`` bytes (None: not known in advance, so
        written front to back)."""

    def open_read(self, path: str) -> Reader:
        """Open a committed object; CheckpointNotFoundError if there is none."""

    def stat(self, path: str) -> Entry | None:
        """The committed object (or directory) at ``path``, or None."""

    def delete(self, path: str) -> None:
        """Delete an object; a missing one is not an error."""

    def delete_tree(self, path: str) -> None:
        """Delete every object under ``path``, and the directories left empty; a missing
        path is not an error. Never follows a symbolic link: a link is left where it is
        (with the directory that holds it)."""

    def read_versioned(self, path: str) -> tuple[bytes, Version]:
        """The content of a small object and its version; CheckpointNotFoundError."""

    def replace_if(self, path: str, data: bytes, expect: Version | None) -> Version:
        """Durably replace a small object if it is still at version ``expect`` (None: if
        there is none); raise ConflictError otherwise. Returns the new version."""

    def sweep_incomplete(self, path: str) -> list[str]:
        """Remove what killed commits left directly under ``path`` (temp files, incomplete
        multipart uploads), and nothing else: never a directory or a symbolic link, whatever
        its name; what was removed."""

    def lease(self, path: str, ttl: float) -> Lease:
        """Take the exclusive lease of a checkpoint directory, or raise
        DirectoryLockedError. ``ttl``: how long a holder that stopped renewing keeps it."""

    # Last: below it, ``list`` would name this method in annotations.
    def list(self, path: str) -> list[Entry]:
        """The committed objects and directories directly under ``path``, with what is
        neither marked ``special`` (symbolic links are not followed); [] if none."""


def put(storage: Storage, path: str, data: bytes | memoryview) -> CommitTimes:
    """Durably write a whole object in one upload."""
    view = memoryview(data).cast("B")
    upload = storage.create(path, len(view))
    try:
        upload.write_at(0, view)
        return upload.commit()
    except BaseException:
        upload.abort()
        raise


def write_image(storage: Storage, path: str, image: memoryview, size: int) -> CommitTimes:
    """Commit ``image[:size]``, a staged file image; the image may extend past ``size`` to
    an aligned length, so the backend can write it whole (O_DIRECT)."""
    upload = storage.create(path, size)
    try:
        upload.write_at(0, image)
        return upload.commit()
    except BaseException:
        upload.abort()
        raise


#: Bytes copied per call when a scratch file is streamed into an upload.
_STREAM_PIECE = 16 << 20


def write_with(storage: Storage, path: str, produce: Callable[[str], object]) -> CommitTimes:
    """Commit the file that ``produce(local_path)`` writes (a ``savefun`` such as
    ``torch.save``): into the upload's own local file where it has one, else into a
    scratch file that is then streamed into the upload."""
    upload = storage.create(path, None)
    try:
        if upload.local_path is not None:
            _produce(produce, upload.local_path, path)
        else:
            with tempfile.TemporaryDirectory(prefix="aiosnap-") as scratch:
                local = os.path.join(scratch, "object")
                _produce(produce, local, path)
                _stream(local, upload)
        return upload.commit()
    except BaseException:
        upload.abort()
        raise


#: Less room than this left on a file system, after a savefun failed, is a full disk.
_FULL = 1 << 20


def _produce(produce: Callable[[str], object], local: str, path: str) -> None:
    """``produce(local)``; a failure that a full disk caused is an OSError(ENOSPC) naming
    ``path``, whatever the savefun raised (torch.save: "enforce fail ... unexpected pos")."""
    try:
        produce(local)
    except OSError:
        raise
    except Exception as exc:
        free = _free_bytes(os.path.dirname(local))
        if free is None or free >= _FULL:
            raise
        raise OSError(
            errno.ENOSPC,
            f"No space left on device: writing {path} failed, {free} bytes free "
            f"({type(exc).__name__}: {str(exc).strip()[:200]})",
            path,
        ) from exc


def _free_bytes(directory: str) -> int | None:
    try:
        st = os.statvfs(directory or ".")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _stream(local: str, upload: Upload) -> None:
    buf = bytearray(_STREAM_PIECE)
    with open(local, "rb", buffering=0) as f:
        offset = 0
        while n := f.readinto(buf):
            upload.write_at(offset, memoryview(buf)[:n])
            offset += n


class UrlPaths:
    """``join`` and ``split`` of a backend whose paths are URLs (``s3://bucket/run/x``)."""

    def join(self, *parts: str) -> str:
        head, *rest = parts
        return posixpath.join(head.rstrip("/"), *rest) if rest else head

    def split(self, path: str) -> tuple[str, str]:
        head, _, name = path.rstrip("/").rpartition("/")
        return head, name


def get(storage: Storage, path: str) -> bytes:
    """The whole content of a small object."""
    reader = storage.open_read(path)
    try:
        buf = bytearray(reader.size)
        reader.readinto(0, memoryview(buf))
        return bytes(buf)
    finally:
        reader.close()


def lstat(storage: Storage, path: str) -> Entry | None:
    """What is at ``path`` itself: a symbolic link is not followed but marked ``special``,
    on a storage that has links (one with an ``lstat`` method, as LocalStorage); on the
    others, ``stat``."""
    own = getattr(storage, "lstat", None)
    found: Entry | None = own(path) if own is not None else storage.stat(path)
    return found


def describe(entry: Entry) -> str:
    """What an entry is, in words."""
    if entry.is_dir:
        return "a directory"
    return "a symbolic link or special file" if entry.special else "a file"


def exists(storage: Storage, path: str) -> bool:
    """Whether a committed object is at ``path``."""
    entry = storage.stat(path)
    return entry is not None and entry.is_file


class ReaderFile(io.RawIOBase):
    """A Reader as a seekable binary file, for readers that want one (zipfile, torch.load)."""

    def __init__(self, reader: Reader) -> None:
        super().__init__()
        self._reader, self._pos = reader, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._reader.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self._reader.size - self._pos))
        if n:
            self._reader.readinto(self._pos, view[:n])
            self._pos += n
        return n


class MemoryReader:
    """Bytes in memory as a Reader, without a copy: a staged image whose sealed header is
    parsed, a verified item that torch.load reads through ``ReaderFile``. ``what`` names
    them in the error a read past their end raises."""

    def __init__(self, path: str, data: memoryview, what: str = "the bytes in memory") -> None:
        self.path, self.size, self._data, self._what = path, len(data), data, what

    def readinto(self, offset: int, buf: memoryview) -> None:
        if offset + buf.nbytes > self.size:
            raise CorruptCheckpointError(self.path, f"read past the end of {self._what}")
        buf.cast("B")[:] = self._data[offset : offset + buf.nbytes]

    def read_batch(self, requests: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        for offset, bufs in requests:
            for buf in bufs:
                self.readinto(offset, buf)
                offset += buf.nbytes

    def close(self) -> None:
        pass
