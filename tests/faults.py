"""System calls with a hook in front: the seam tests use to fail, count or kill.

``HookedPosix(hook)`` makes the real calls of ``aiosnap.storage.Posix``, calling
``hook(op, path)`` before each one. ``op`` is one of OPS; ``path`` is the file the
call is about, with the temp file of an unfinished commit named by the file it will
become (``dir/.aiosnap-tmp-ckpt.1a2b3c`` -> ``dir/ckpt``), so a hook can pick "the
write of rank 1's file" without knowing temp names.

``StuckCommits(storage)`` is any storage whose uploads, once told, never complete: a
process killed between sending an object's bytes and making it visible.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from typing import Any

import aiosnap
from aiosnap.storage import FileStat, Posix, Storage, Upload

#: The kinds of calls a hook sees.
OPS = (
    "open",
    "write",
    "read",
    "fsync",
    "close",
    "truncate",
    "lock",
    "rename",
    "dirsync",
    "unlink",
    "mkdir",
    "rmdir",
)

Hook = Callable[[str, str], None]


def target_of(path: str) -> str:
    """The file a temp file of an unfinished commit will become."""
    directory, name = os.path.split(path)
    if name.startswith(aiosnap.storage.TEMP_PREFIX):
        name = name[len(aiosnap.storage.TEMP_PREFIX) :].rsplit(".", 1)[0]
    return os.path.join(directory, name)


def enospc(path: str) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device (injected)", path)


class HookedPosix(Posix):
    """The real calls, each preceded by ``hook(op, path)`` (which may raise)."""

    def __init__(self, hook: Hook) -> None:
        self.hook = hook
        self._paths: dict[int, str] = {}

    def _fd(self, op: str, fd: int) -> None:
        self.hook(op, self._paths.get(fd, ""))

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        self.hook("open", target_of(path))
        fd = super().open(path, flags, mode)
        self._paths[fd] = target_of(path)
        return fd

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        self._fd("write", fd)
        return super().pwrite(fd, data, offset)

    def preadv(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        self._fd("read", fd)
        return super().preadv(fd, bufs, offset)

    def ftruncate(self, fd: int, size: int) -> None:
        self._fd("truncate", fd)
        super().ftruncate(fd, size)

    def fsync(self, fd: int) -> None:
        self._fd("fsync", fd)
        super().fsync(fd)

    def flock(self, fd: int, *, exclusive: bool = True, wait: bool = False) -> None:
        self._fd("lock", fd)
        super().flock(fd, exclusive=exclusive, wait=wait)

    def close(self, fd: int) -> None:
        # Linux releases the descriptor (and its flock) even when close reports an error.
        path = self._paths.pop(fd, "")
        super().close(fd)
        self.hook("close", path)

    def fstat(self, fd: int) -> FileStat:
        return super().fstat(fd)

    def rename(self, src: str, dst: str) -> None:
        self.hook("rename", dst)
        super().rename(src, dst)

    def unlink(self, path: str) -> None:
        self.hook("unlink", target_of(path))
        super().unlink(path)

    def mkdir(self, path: str) -> None:
        self.hook("mkdir", path)
        super().mkdir(path)

    def rmdir(self, path: str) -> None:
        self.hook("rmdir", path)
        super().rmdir(path)

    def fsync_dir(self, path: str) -> None:
        self.hook("dirsync", path)
        super().fsync_dir(path)


def failing_writes(
    names: set[str] | Callable[[str], bool], error: Callable[[str], BaseException] = enospc
) -> Any:
    """A LocalStorage whose writes to the files ``names`` (base names, or a predicate on
    the path) fail, as a full disk fails them."""
    wanted = names if callable(names) else (lambda path: os.path.basename(path) in names)

    def hook(op: str, path: str) -> None:
        if op == "write" and wanted(path):
            raise error(path)

    return aiosnap.storage.LocalStorage(posix=HookedPosix(hook))


class Injector:
    """A hook that fails the ``n``-th call (counting from 1) with ``code``; with
    ``persistent``, every call after it too, as a dying disk does. ``calls`` counts
    them all (a run with n=0 only counts)."""

    def __init__(self, n: int = 0, code: int = errno.EIO, *, persistent: bool = False) -> None:
        self.n, self.code, self.persistent = n, code, persistent
        self.calls = 0
        self.failed: list[tuple[int, str, str]] = []
        self._lock = threading.Lock()

    def __call__(self, op: str, path: str) -> None:
        with self._lock:
            self.calls += 1
            hit = self.n and (self.calls == self.n or (self.persistent and self.calls > self.n))
            if hit:
                self.failed.append((self.calls, op, path))
        if hit:
            raise OSError(self.code, f"{os.strerror(self.code)} (injected: {op} #{self.calls})", path)


class StuckCommits:
    """``inner``, through the public Storage interface, except that the uploads created
    while ``stuck`` is set never commit: their bytes go up (an object store's parts), and
    ``commit()`` blocks for good, where a test kills the process."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.stuck = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # every other operation is inner's own

    def create(self, path: str, size: int | None) -> Upload:
        upload = self.inner.create(path, size)
        return _NeverCommits(upload) if self.stuck else upload


class _NeverCommits:
    def __init__(self, upload: Upload) -> None:
        self.upload = upload

    def __getattr__(self, name: str) -> Any:
        return getattr(self.upload, name)

    def commit(self) -> Any:
        threading.Event().wait()  # the bytes are up; completing them is what never happens
