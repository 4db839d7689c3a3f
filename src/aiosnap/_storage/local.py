"""LocalStorage: a local (or shared POSIX) filesystem, with durable atomic commits.

A commit writes a temp file with a random name in the target directory (``O_EXCL``),
fsyncs and closes it, renames it over the target and fsyncs the directory. On any
error the temp file is removed and the previous file is untouched; a crash can leave
only a temp file, which ``sweep_incomplete`` removes. Directories a commit creates
are made durable in their parent before the file is.

Staged images are written with O_DIRECT where the filesystem allows it -- it skips
the page cache, ~1.4x faster here -- and with buffered writes where it does not
(tmpfs, some network filesystems). Every system call goes through a ``Posix`` object
(``_posix``), the seam where tests inject faults, crashes and power loss.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from collections.abc import Sequence

from .._base.errors import (
    CheckpointNotFoundError,
    ConflictError,
    CorruptCheckpointError,
    DirectoryLockedError,
    ForeignFileError,
)
from . import inflight
from .posix import FileStat, Posix
from .protocol import ALIGN, LEASE_NAME, TEMP_PREFIX, CommitTimes, Entry, Version

#: Bytes handed to one write(2) or read(2): large enough to keep the disk streaming.
WRITE_PIECE = 16 << 20
_READ_PIECE = 64 << 20


def _is_aligned(view: memoryview) -> bool:
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):  # read-only or empty buffer
        return False
    return address % ALIGN == 0


def _size_text(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


class LocalStorage:
    """The local filesystem (see the module docstring).

    Args:
        direct: Write staged images with O_DIRECT where the filesystem allows it (it
            skips the page cache); False writes everything buffered.
        posix: The system calls to make: a subclass of ``Posix`` that fails, counts or
            stops them is how tests inject faults, crashes and power loss.
    """

    def __init__(self, *, direct: bool = True, posix: Posix | None = None) -> None:
        self.direct = direct
        self.posix = posix if posix is not None else Posix()

    def __repr__(self) -> str:
        return f"LocalStorage(direct={self.direct})"

    # -- paths -----------------------------------------------------------------------------
    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def split(self, path: str) -> tuple[str, str]:
        return os.path.split(path)

    @staticmethod
    def check(path: str) -> str:
        """``path``, refused if it is a URL: a URL is never taken for a local path."""
        if "://" in path:
            raise ValueError(
                f"{path!r} is a URL, not a local path: pass it without storage= (aiosnap picks the "
                "backend from the scheme) or use aiosnap.storage.from_url"
            )
        return path

    # -- writing -----------------------------------------------------------------------------
    def create(self, path: str, size: int | None) -> _LocalUpload:
        self._makedirs(os.path.dirname(self.check(path)))
        return _LocalUpload(self, path, size)

    def _makedirs(self, directory: str) -> None:
        """Create ``directory`` and its missing parents, each made durable in its parent."""
        if not directory or self.posix.stat(directory) is not None:
            return
        parent = os.path.dirname(directory.rstrip("/"))
        if parent and parent != directory:
            self._makedirs(parent)
        try:
            self.posix.mkdir(directory)
        except FileExistsError:
            return
        self.posix.fsync_dir(parent)

    def replace_if(self, path: str, data: bytes, expect: Version | None) -> Version:
        directory = os.path.dirname(self.check(path))
        self._makedirs(directory)
        # The directory's own flock serialises the check and the replace among processes.
        # A child forked while it is held (a DataLoader's worker) must not keep it: its
        # copy would hold the lock after ours is closed, and the next replace here would
        # wait for it as long as the worker lives (a docs example hung so in CI).
        dfd = self.posix.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY)
        _track_lock(dfd, directory or ".")
        try:
            self.posix.flock(dfd, wait=True)
            now = self.posix.lstat(path)
            if now is not None and (now.is_dir or now.special):
                raise ForeignFileError(path, _what(now))
            if (now.version if now is not None else None) != expect:
                raise ConflictError(path)
            upload = _LocalUpload(self, path, len(data))
            try:
                upload.write_at(0, memoryview(data))
                upload.commit()
            except BaseException:
                upload.abort()
                raise
            after = self.posix.stat(path)
            assert after is not None
            return after.version
        finally:
            _close_lock(self.posix, dfd)  # closing drops the flock

    # -- reading -----------------------------------------------------------------------------
    def open_read(self, path: str) -> _LocalReader:
        return _LocalReader(self.posix, self.check(path))

    def read_versioned(self, path: str) -> tuple[bytes, Version]:
        # The small objects aiosnap replaces (its index): a link there is not its own.
        reader = _LocalReader(self.posix, self.check(path), follow=False)
        try:
            buf = bytearray(reader.size)
            reader.readinto(0, memoryview(buf))
            return bytes(buf), reader.version
        finally:
            reader.close()

    def stat(self, path: str) -> Entry | None:
        st = self.posix.stat(self.check(path))
        if st is None:
            return None
        return _entry(os.path.basename(path.rstrip("/")), st, identity=True)

    def lstat(self, path: str) -> Entry | None:
        """As ``stat``, of a symbolic link itself (marked ``special``) rather than its target."""
        st = self.posix.lstat(self.check(path))
        return None if st is None else _entry(os.path.basename(path.rstrip("/")), st, identity=True)

    # -- removing ----------------------------------------------------------------------------
    def delete(self, path: str) -> None:
        try:
            self.posix.unlink(self.check(path))
        except FileNotFoundError:
            pass

    def delete_tree(self, path: str) -> None:
        top = self.posix.lstat(self.check(path))
        if top is None or top.special:
            return
        if not top.is_dir:
            self.delete(path)
            return
        for name, st in self.posix.scandir(path):
            child = os.path.join(path, name)
            if st.is_dir:
                self.delete_tree(child)
            elif not st.special:
                self.delete(child)
        try:
            self.posix.rmdir(path)
        except (FileNotFoundError, OSError) as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
                raise

    def incomplete(self, path: str) -> list[str]:
        """The names of the temp files of unfinished commits directly under ``path``:
        regular files only, never a directory or a symbolic link, whatever its name."""
        try:
            found = self.posix.scandir(self.check(path) or ".")
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [n for n, st in found if n.startswith(TEMP_PREFIX) and not (st.is_dir or st.special)]

    def sweep_incomplete(self, path: str) -> list[str]:
        """As the protocol says, and never a temp file that a live commit (of any writer,
        in this process or another) holds: see ``inflight``."""
        found = (os.path.join(path, n) for n in self.incomplete(path))
        return [tmp for tmp in found if inflight.reclaim(self.posix, tmp, self.delete)]

    def lease(self, path: str, ttl: float) -> _FlockLease:
        self._makedirs(self.check(path))
        return _FlockLease(self.posix, path)

    # Last: below it, ``list`` would name this method in annotations.
    def list(self, path: str) -> list[Entry]:
        try:
            found = self.posix.scandir(self.check(path) or ".")
        except (FileNotFoundError, NotADirectoryError):
            return []
        entries = (_entry(n, st) for n, st in found)
        return sorted((e for e in entries if not e.name.startswith(TEMP_PREFIX)), key=lambda e: e.name)


def _entry(name: str, st: FileStat, *, identity: bool = False) -> Entry:
    size = 0 if st.is_dir or st.special else st.size
    return Entry(name, st.is_dir, size, st.special, f"{st.version}-{st.changed}" if identity else None)


def _what(st: FileStat) -> str:
    """What a path that is not a regular file is, in words."""
    return "a directory" if st.is_dir else "a symbolic link or special file"


class _LocalUpload:
    """A temp file in the target directory, renamed over the target at commit."""

    random_access = True

    def __init__(self, storage: LocalStorage, path: str, size: int | None) -> None:
        self.path, self.size = path, size
        self._posix, self._direct_ok = storage.posix, storage.direct
        directory, name = os.path.split(path)
        self._directory = directory
        self._fd: int | None = None
        self._dfd: int | None = None
        self._end = 0  # the furthest byte written
        self._write_s = 0.0
        self._done = False
        try:
            # Held locked until it is renamed or deleted: no sweep, of any writer or
            # process, takes a live commit's temp file (see inflight).
            self.tmp, self._fd = inflight.create(self._posix, directory, f"{TEMP_PREFIX}{name}.")
        except OSError as exc:
            raise self._named(exc) from exc
        self.local_path: str | None = self.tmp

    def write_at(self, offset: int, data: memoryview) -> None:
        t0 = time.perf_counter()
        try:
            if not self._write_direct(offset, data):
                if self.size is not None:
                    data = data[: max(0, self.size - offset)]
                self._pwrite_all(self._fd, data, offset)
            self._end = max(self._end, offset + len(data))
        except OSError as exc:
            raise self._named(exc) from exc
        self._write_s += time.perf_counter() - t0

    def _write_direct(self, offset: int, data: memoryview) -> bool:
        direct = getattr(os, "O_DIRECT", 0)
        if not (self._direct_ok and direct and offset % ALIGN == 0 and len(data) % ALIGN == 0 and len(data)):
            return False
        if not _is_aligned(data):
            return False
        if self._dfd is None:
            try:
                self._dfd = self._posix.open(self.tmp, os.O_WRONLY | direct)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # tmpfs and friends
                    raise
                self._direct_ok = False
                return False
        try:
            self._pwrite_all(self._dfd, data, offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._direct_ok = False  # rewritten below with buffered writes
            return False
        return True

    def _pwrite_all(self, fd: int | None, data: memoryview, offset: int) -> None:
        assert fd is not None
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        for start in range(0, len(data), WRITE_PIECE):
            piece = data[start : start + WRITE_PIECE]
            at = offset + start
            while len(piece):
                n = self._posix.pwrite(fd, piece, at)
                piece, at = piece[n:], at + n

    def commit(self) -> CommitTimes:
        assert self._fd is not None, "the upload was aborted"
        try:
            t0 = time.perf_counter()
            if self._dfd is not None:
                self._posix.close(self._dfd)
                self._dfd = None
            size = self._end if self.size is None else self.size
            if self.size is None or self._end != self.size:
                # An aligned last write ran past the end; or a savefun wrote the file.
                size = self._posix.fstat(self._fd).size if self.size is None else self.size
                self._posix.ftruncate(self._fd, size)
            self._posix.fsync(self._fd)
            # Renamed before it is closed: closing drops the lock that keeps sweeps away.
            self._posix.rename(self.tmp, self.path)
        except OSError as exc:
            self.abort()
            raise self._named(exc) from exc
        except BaseException:
            self.abort()
            raise
        self._done = True
        fd, self._fd = self._fd, None
        assert fd is not None
        inflight.forget(os.path.basename(self.tmp), fd)
        try:
            self._posix.close(fd)
        except OSError:
            pass  # the data is durable (fsynced) and in place: Linux closed it all the same
        # The rename is only durable once the directory is: count it with the fsyncs.
        self._posix.fsync_dir(self._directory)
        return CommitTimes(self._write_s, time.perf_counter() - t0, size)

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        try:  # while its lock is held: a sweep never sees it unheld and still ours
            self._posix.unlink(self.tmp)
        except OSError:
            pass  # gone already, or unremovable: the next sweep takes it
        inflight.forget(os.path.basename(self.tmp), self._fd)
        for fd in (self._dfd, self._fd):
            if fd is not None:
                try:
                    self._posix.close(fd)
                except OSError:
                    pass
        self._dfd = self._fd = None

    def _named(self, exc: OSError) -> OSError:
        """``exc`` with the user's path instead of the hidden temp file's, and on a full
        disk how much space the commit needed."""
        reason = exc.strerror or str(exc)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            need = f"{_size_text(self.size)}" if self.size is not None else "an unknown size"
            free = self._posix.free_bytes(self._directory)
            room = f", {_size_text(free)} free" if free is not None else ""
            reason = f"{reason}: writing {self.path} needs {need}{room}"
        else:
            reason = f"{reason} (writing {self.path})"
        named = OSError(exc.errno, reason, self.path)
        return named


class _LocalReader:
    def __init__(self, posix: Posix, path: str, *, follow: bool = True) -> None:
        self.path, self._posix = path, posix
        try:
            self._fd = posix.open(path, os.O_RDONLY | (0 if follow else os.O_NOFOLLOW))
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointNotFoundError(path) from None
        except OSError as exc:
            if exc.errno != errno.ELOOP or follow:
                raise
            raise ForeignFileError(path, "a symbolic link") from None
        try:
            st = posix.fstat(self._fd)
        except BaseException:
            posix.close(self._fd)
            raise
        if st.is_dir:
            posix.close(self._fd)
            raise CorruptCheckpointError(path, "is a directory, not a checkpoint file")
        self.size, self.version = st.size, st.version

    def readinto(self, offset: int, buf: memoryview) -> None:
        done = 0
        while done < len(buf):
            n = self._posix.preadv(self._fd, [buf[done : done + _READ_PIECE]], offset + done)
            if n == 0:
                raise CorruptCheckpointError(
                    self.path, f"truncated: wanted {len(buf)} bytes at offset {offset}"
                )
            done += n

    def read_batch(self, requests: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        for offset, bufs in requests:
            self._readinto_many(offset, [b for b in bufs if len(b)])

    def _readinto_many(self, offset: int, bufs: list[memoryview]) -> None:
        done = self._posix.preadv(self._fd, bufs, offset) if bufs else 0
        for buf in bufs:  # a short read: finish buffer by buffer
            if done < len(buf):
                self.readinto(offset + done, buf[done:])
            done = max(0, done - len(buf))
            offset += len(buf)

    def close(self) -> None:
        self._posix.close(self._fd)


class _FlockLease:
    """``flock`` on a lock file: the kernel drops it when the holder dies, even by SIGKILL.

    A flock belongs to the open file, which children forked while it is held share: a
    DataLoader's workers would keep it after their parent was killed, and the restart
    would find the directory locked by a dead pid. So each forked child closes its copy
    of the descriptor at once (``os.register_at_fork``); an ``exec`` closes it anyway
    (the descriptor is opened ``O_CLOEXEC``)."""

    def __init__(self, posix: Posix, directory: str) -> None:
        self._posix = posix
        path = os.path.join(directory, LEASE_NAME)
        try:
            fd = posix.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR):
                raise ForeignFileError(path, "a symbolic link or a directory") from None
            raise
        try:
            try:
                if posix.fstat(fd).is_dir:
                    raise ForeignFileError(path, "a directory")
            except IsADirectoryError:  # neither a file nor a directory: a FIFO, a device
                raise ForeignFileError(path, "a special file") from None
            try:
                posix.flock(fd)
            except BlockingIOError:
                holder = bytearray(64)
                n = posix.preadv(fd, [memoryview(holder)], 0)
                pid = holder[:n].decode(errors="replace").strip()
                raise DirectoryLockedError(
                    f"{directory} is in use by another CheckpointManager (pid {pid or '?'}); "
                    "two managers on one directory would corrupt each other (open it with "
                    "read_only=True to read while it trains)"
                ) from None
            posix.ftruncate(fd, 0)
            posix.pwrite(fd, memoryview(f"{os.getpid()}\n".encode()), 0)
        except BaseException:
            posix.close(fd)  # an fd left open would hold the lock for the life of the process
            raise
        self._fd: int | None = fd
        _track_lock(fd, path)

    def renew(self) -> None:
        """A flock lasts as long as its holder: nothing to renew."""

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            _close_lock(self._posix, fd)  # closing drops the flock


#: The descriptors of the locks this process holds, which a forked child must not keep.
_held_locks: set[int] = set()
#: Held across a fork: a descriptor is tracked and closed under it, so no fork falls
#: between the two (a child would keep a lock, or close a number reused meanwhile).
_fork_guard = threading.Lock()


def _track_lock(fd: int, path: str) -> None:
    """Have forked children close ``fd``. Best called before the lock is taken: a fork in
    between would leave the child a copy that holds it."""
    if _is_real(fd, path):  # not a simulated file system's descriptor
        with _fork_guard:
            _held_locks.add(fd)


def _close_lock(posix: Posix, fd: int) -> None:
    with _fork_guard:
        _held_locks.discard(fd)
        posix.close(fd)


def _is_real(fd: int, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def _close_locks_in_child() -> None:
    for fd in _held_locks:
        try:
            os.close(fd)
        except OSError:
            pass
    _held_locks.clear()
    _fork_guard.release()


os.register_at_fork(
    before=_fork_guard.acquire, after_in_parent=_fork_guard.release, after_in_child=_close_locks_in_child
)
