"""Where checkpoint bytes live: a small interface, and the local filesystem behind it.

Everything above this module speaks in storage paths (strings joined by the storage),
never in POSIX calls, so a remote tier (fsspec) can stand behind the same interface.
Every method is blocking and is called from a worker thread or the worker process;
this module imports nothing but the standard library, so the worker process starts
fast.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from ._errors import CheckpointNotFoundError, CorruptCheckpointError, DirectoryLockedError

#: Temp files of unfinished commits start with this; nothing else does.
TEMP_PREFIX = ".aiosnap-tmp-"

#: Bytes handed to one write(2); large enough to keep the disk streaming.
WRITE_PIECE = 16 << 20
#: O_DIRECT wants buffers, offsets and lengths aligned to the logical block; 4096 covers all.
ALIGN = 4096


class CommitTimes(NamedTuple):
    """Seconds spent writing and making durable one file."""

    write_s: float
    fsync_s: float


class ReadHandle(Protocol):
    """An open checkpoint file, read by offset."""

    size: int
    path: str

    def readinto(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from ``offset``; a short read raises CorruptCheckpointError."""

    def readinto_many(self, offset: int, bufs: list[memoryview]) -> None:
        """Fill ``bufs`` one after the other from ``offset`` (a scattered read)."""

    def close(self) -> None:
        """Release the file."""


@runtime_checkable
class Storage(Protocol):
    """The operations the save and load paths need, and no more."""

    def join(self, *parts: str) -> str:
        """Join path parts the way this storage does."""

    def split(self, path: str) -> tuple[str, str]:
        """Split a path into (directory, name)."""

    def write_atomic(self, path: str, data: Sequence[memoryview]) -> CommitTimes:
        """Durably replace ``path`` with ``data``, or leave it as it was."""

    def write_atomic_with(self, path: str, produce: Callable[[str], object]) -> CommitTimes:
        """Like write_atomic, with ``produce(temp_path)`` writing the bytes."""

    def write_image(self, path: str, image: memoryview, size: int) -> CommitTimes:
        """Like write_atomic for ``image[:size]``; ``image`` is page-aligned and extends to a
        multiple of ALIGN past ``size``, so the storage may write it with O_DIRECT."""

    def open_read(self, path: str) -> ReadHandle:
        """Open a checkpoint for reading."""

    def exists(self, path: str) -> bool:
        """Whether a committed file is at ``path``."""

    def remove(self, path: str) -> None:
        """Delete a committed file; a missing one is not an error."""

    def remove_tree(self, path: str) -> None:
        """Delete a directory and everything in it; a missing one is not an error."""

    def isdir(self, path: str) -> bool:
        """Whether ``path`` is a directory."""

    def listdir(self, path: str) -> list[str]:
        """Names in a directory, temp files of unfinished commits excluded."""

    def sweep_temp(self, path: str) -> list[str]:
        """Delete temp files that crashed commits left in a directory."""

    def read_bytes(self, path: str) -> bytes:
        """The whole content of a small file (an index)."""

    def lock(self, path: str) -> StorageLock:
        """Take the exclusive lock of a directory, or raise DirectoryLockedError."""


class StorageLock(Protocol):
    """An exclusive hold on a directory; released by ``release`` or by the holder's death."""

    def release(self) -> None:
        """Give the lock up."""


class _LocalReadHandle:
    def __init__(self, path: str) -> None:
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CheckpointNotFoundError(path) from None
        self.path = path
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(self._fd)
            raise CorruptCheckpointError(path, "is not a regular file (a directory?)")
        self.size = st.st_size

    def readinto(self, offset: int, buf: memoryview) -> None:
        done = 0
        while done < len(buf):
            n = os.preadv(self._fd, [buf[done : done + WRITE_PIECE * 4]], offset + done)
            if n == 0:
                raise CorruptCheckpointError(
                    self.path, f"truncated: wanted {len(buf)} bytes at offset {offset}"
                )
            done += n

    def readinto_many(self, offset: int, bufs: list[memoryview]) -> None:
        bufs = [b for b in bufs if len(b)]
        done = os.preadv(self._fd, bufs, offset) if bufs else 0
        for buf in bufs:  # a short read: finish buffer by buffer
            if done < len(buf):
                self.readinto(offset + done, buf[done:])
            done = max(0, done - len(buf))
            offset += len(buf)

    def close(self) -> None:
        os.close(self._fd)


def _write_all(fd: int, data: Sequence[memoryview]) -> None:
    for view in data:
        view = view.cast("B")
        for start in range(0, len(view), WRITE_PIECE):
            piece = view[start : start + WRITE_PIECE]
            while len(piece):
                piece = piece[os.write(fd, piece) :]


def _is_aligned(view: memoryview) -> bool:
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):  # read-only or empty buffer
        return False
    return address % ALIGN == 0


def _write_direct(tmp: str, image: memoryview, size: int) -> bool:
    """Write ``image[:size]`` rounded up to ALIGN through O_DIRECT; False if not possible."""
    length = -(-size // ALIGN) * ALIGN
    direct = getattr(os, "O_DIRECT", 0)
    if not direct or size == 0 or len(image) < length or not _is_aligned(image):
        return False
    try:
        dfd = os.open(tmp, os.O_WRONLY | direct | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # tmpfs and friends
            return False
        raise
    try:
        _write_all(dfd, [image[:length]])
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False  # the caller rewrites the file with buffered writes
    finally:
        os.close(dfd)
    return True


def _fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """The local filesystem, with durable atomic commits.

    A commit writes a temp file with a random name in the target directory
    (``O_EXCL``), fsyncs and closes it, renames it over the target and fsyncs the
    directory. On any error the temp file is removed and the previous file is
    untouched; a crash can leave only a temp file, which ``sweep_temp`` removes.

    Staged images are written with O_DIRECT (``direct=True``, the default) where the
    filesystem allows it -- it skips the page cache, ~1.4x faster here -- and with
    buffered writes where it does not (tmpfs, some network filesystems).
    """

    def __init__(self, *, direct: bool = True) -> None:
        self.direct = direct

    def __reduce__(self) -> tuple[type[LocalStorage], tuple[()], dict[str, bool]]:
        return (LocalStorage, (), {"direct": self.direct})

    def __setstate__(self, state: dict[str, bool]) -> None:
        self.direct = state["direct"]

    def write_image(self, path: str, image: memoryview, size: int) -> CommitTimes:
        return self._commit(path, lambda fd, tmp: self._write_image(fd, tmp, image, size))

    def _write_image(self, fd: int, tmp: str, image: memoryview, size: int) -> None:
        if self.direct and _write_direct(tmp, image, size):
            os.ftruncate(fd, size)  # the last aligned write went past the end
            return
        os.lseek(fd, 0, os.SEEK_SET)
        _write_all(fd, [image[:size]])

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def split(self, path: str) -> tuple[str, str]:
        return os.path.split(path)

    def write_atomic(self, path: str, data: Sequence[memoryview]) -> CommitTimes:
        return self._commit(path, lambda fd, tmp: _write_all(fd, data))

    def write_atomic_with(self, path: str, produce: Callable[[str], object]) -> CommitTimes:
        return self._commit(path, lambda fd, tmp: produce(tmp))

    def _commit(self, path: str, fill: Callable[[int, str], object]) -> CommitTimes:
        directory, name = os.path.split(path)
        if directory and not os.path.isdir(directory):
            os.makedirs(directory, exist_ok=True)
            _fsync_dir(os.path.dirname(os.path.abspath(directory)))  # the new directory's entry
        tmp = os.path.join(directory, f"{TEMP_PREFIX}{name}.{secrets.token_hex(6)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                t0 = time.perf_counter()
                fill(fd, tmp)
                t1 = time.perf_counter()
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        _fsync_dir(directory)
        # The rename is only durable once the directory is: count it with the fsyncs.
        return CommitTimes(t1 - t0, time.perf_counter() - t1)

    def open_read(self, path: str) -> ReadHandle:
        return _LocalReadHandle(path)

    def exists(self, path: str) -> bool:
        return os.path.isfile(path)

    def remove(self, path: str) -> None:
        _unlink_quietly(path)

    def remove_tree(self, path: str) -> None:
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def listdir(self, path: str) -> list[str]:
        try:
            names = os.listdir(path)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if not n.startswith(TEMP_PREFIX))

    def sweep_temp(self, path: str) -> list[str]:
        try:
            names = os.listdir(path)
        except FileNotFoundError:
            return []
        swept = [os.path.join(path, n) for n in names if n.startswith(TEMP_PREFIX)]
        for tmp in swept:
            _unlink_quietly(tmp)
        return swept

    def read_bytes(self, path: str) -> bytes:
        f = self.open_read(path)
        try:
            buf = bytearray(f.size)
            f.readinto(0, memoryview(buf))
            return bytes(buf)
        finally:
            f.close()

    def lock(self, path: str) -> StorageLock:
        return _FlockLock(path)


class _FlockLock:
    """``flock`` on a lock file: the kernel drops it when the holder dies, even by SIGKILL."""

    NAME = ".aiosnap.lock"

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, self.NAME)
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip()
            os.close(self._fd)
            raise DirectoryLockedError(
                f"{directory} is in use by another CheckpointManager (pid {holder or '?'}); "
                "two managers on one directory would corrupt each other"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
