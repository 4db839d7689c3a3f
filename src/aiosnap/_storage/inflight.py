"""Which temp entries belong to work still in flight, in this process or in any other.

A commit's temp file (``TEMP_PREFIX...``) is garbage once nothing will finish it: a
process killed mid-commit leaves one, and the next open sweeps it. A temp file that a
live commit is writing must never be swept, whoever sweeps: another writer of this
process on the same directory (two ppe snapshot extensions each make their own), a
CheckpointManager opening it, a writer of another process. The name cannot tell them
apart; two marks do:

- **A lock the kernel keeps.** The commit holds an exclusive ``flock`` on its temp entry
  from the moment it creates it until it is renamed into place or deleted. The kernel
  drops the lock when the holder dies, by SIGKILL too, so a sweeper that can take the
  lock knows that no live process will finish the entry, and one that cannot leaves it
  (``reclaim``). A flock also excludes another descriptor of the same process, so this
  covers two writers of one process as well. Children forked meanwhile (a DataLoader's
  workers) close their copy at once: a killed holder's orphans must not keep it.
- **The names this process has in flight.** Where the filesystem does not lock (Lustre
  mounted without ``flock``), only this process's own entries can be told from a dead
  one's: those are kept, every other one is swept, as before.

A sweeper takes the lock before it deletes and holds it while it does; a creator that
finds its fresh file locked, or gone once it holds the lock, tries another name. So a
sweep and a creation racing in two processes never leave a commit without its file.
Imports only the standard library (the offload worker process creates temp files too).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
from collections.abc import Callable

from .posix import Posix

logger = logging.getLogger(__name__)

#: What ``flock`` answers where the filesystem has no locks: only the names tell.
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS})
#: Fresh names a creation tries before it gives up (each loss is a sweep racing it).
_TRIES = 16

_guard = threading.Lock()
#: The base names of this process's temp entries in flight (random tokens: unique).
_names: set[str] = set()
#: The descriptors holding those locks, which a forked child closes.
_held: set[int] = set()


def track(name: str) -> None:
    """Mark the temp entry ``name`` (a base name) as this process's, in flight."""
    with _guard:
        _names.add(name)


def forget(name: str, fd: int | None = None) -> None:
    """``name`` is no longer in flight (renamed into place, or deleted); ``fd``, its lock's
    descriptor, is about to be closed."""
    with _guard:
        _names.discard(name)
        if fd is not None:
            _held.discard(fd)


def tracked(name: str) -> bool:
    with _guard:
        return name in _names


def create(posix: Posix, directory: str, prefix: str) -> tuple[str, int]:
    """Create a fresh temp file ``directory/<prefix><token>`` (``O_EXCL``, no link
    followed), open for writing and holding its lock; its path and descriptor. The
    caller ends it with ``forget`` (after the rename or the unlink), then closes it."""
    for _ in range(_TRIES):
        name = f"{prefix}{secrets.token_hex(6)}"
        path = os.path.join(directory, name)
        track(name)
        try:
            fd = posix.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW)
        except BaseException:
            forget(name)
            raise
        try:
            if hold(posix, fd, path):
                return path, fd
        except BaseException:
            _drop(posix, fd, path)
            raise
        # A sweep of another process took it before we locked it: it deletes it.
        forget(name)
        posix.close(fd)
    raise OSError(errno.EAGAIN, f"every temp file created in {directory or '.'} was swept at once")


def create_dir(posix: Posix, parent: str, make_name: Callable[[str], str]) -> tuple[str, int]:
    """As ``create``, a fresh temp directory ``parent/make_name(token)``: its path and a
    descriptor holding its lock (``release`` it once renamed into place or deleted)."""
    for _ in range(_TRIES):
        name = make_name(secrets.token_hex(6))
        path = os.path.join(parent, name)
        track(name)
        try:
            posix.mkdir(path)
            fd = posix.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            forget(name)  # swept between our mkdir and our open
            continue
        except BaseException:
            forget(name)
            raise
        try:
            if hold(posix, fd, path):
                return path, fd
        except BaseException:
            release(posix, name, fd)
            raise
        release(posix, name, fd)
    raise OSError(errno.EAGAIN, f"every temp directory created in {parent or '.'} was swept at once")


def lock_aside(posix: Posix, path: str, name: str) -> int | None:
    """Hold the directory ``path``, about to be renamed to the temp name ``name`` (moved
    aside, to be deleted or put back): no sweep or repair of any writer or process acts
    on it meanwhile. The descriptor to ``release``; None where it cannot be opened or is
    held already (another process at the same work: only the name marks it then)."""
    track(name)
    try:
        fd = posix.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        posix.flock(fd)
    except OSError as exc:
        posix.close(fd)
        if isinstance(exc, BlockingIOError) or exc.errno in _NO_LOCKS:
            return None
        forget(name)
        raise
    if _is_real(fd, path):
        with _guard:
            _held.add(fd)
    return fd


def release(posix: Posix, name: str, fd: int | None) -> None:
    """The temp entry ``name`` is no longer in flight: forget it, close its descriptor."""
    forget(name, fd)
    if fd is not None:
        try:
            posix.close(fd)
        except OSError:
            pass  # closed all the same (Linux), and its lock dropped


def hold(posix: Posix, fd: int, path: str) -> bool:
    """Lock the temp entry ``path`` just created and opened as ``fd``: True if it is now
    held (or the filesystem has no locks), False if a sweep got to it first."""
    try:
        posix.flock(fd)
    except BlockingIOError:
        return False  # a sweeper holds it: it is deleting it
    except OSError as exc:
        if exc.errno not in _NO_LOCKS:
            raise
        return True  # no locks here: the name alone marks it, in this process
    now = posix.lstat(path)
    if now is None or now.version != posix.fstat(fd).version:
        return False  # swept between our create and our lock
    if _is_real(fd, path):  # not a simulated file system's descriptor
        with _guard:
            _held.add(fd)
    return True


def reclaim(posix: Posix, path: str, remove: Callable[[str], object]) -> bool:
    """Remove the temp entry ``path`` with ``remove`` if no live work holds it (see the
    module docstring); whether it did. Its lock is held while ``remove`` runs, so no
    creation takes the entry meanwhile."""
    if tracked(os.path.basename(path)):
        return False
    try:
        fd = posix.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False  # renamed into place or deleted meanwhile
    except OSError as exc:
        # A link (not ours, never followed), or an entry we may not open: whether it is
        # held cannot be told, so it stays.
        logger.debug("not sweeping %s: %s", path, exc)
        return False
    try:
        try:
            posix.flock(fd)
        except BlockingIOError:
            return False  # a live commit, of this process or another
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:
                raise
        try:
            mine = posix.fstat(fd)
        except IsADirectoryError:  # neither a file nor a directory
            return False
        now = posix.lstat(path)
        if now is None or now.version != mine.version:
            return False  # renamed into place (another entry may stand there now)
        remove(path)
        return True
    finally:
        posix.close(fd)


def _drop(posix: Posix, fd: int, path: str) -> None:
    """Undo a creation that failed: the file goes, then its descriptor."""
    forget(os.path.basename(path), fd)
    try:
        posix.unlink(path)
    except OSError:
        pass  # the next sweep takes it
    try:
        posix.close(fd)
    except OSError:
        pass


def _is_real(fd: int, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except OSError:
        return False


def _close_in_child() -> None:
    global _guard
    _guard = threading.Lock()  # a thread that held it at the fork does not exist here
    for fd in _held:
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)
