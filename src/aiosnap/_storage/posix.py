"""The POSIX calls of LocalStorage, one method each.

LocalStorage makes every system call through a ``Posix`` object, so tests can stand
another one in its place: one that fails the Nth call with EIO or ENOSPC, one that
kills the process there, one that keeps only what was made durable when the
"power" goes. Imports nothing but the standard library (the offload worker process
uses it).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import stat
import sys
from typing import NamedTuple

_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
if _libc is not None:
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_populate_ok = _libc is not None
_THP = "/sys/kernel/mm/transparent_hugepage"
#: Fresh memory of at least this many bytes is worth huge pages (NumPy's threshold).
HUGE_MIN = 4 << 20


def thp_mode(name: str) -> str | None:
    """The setting of Linux's transparent huge pages named ``name`` (``enabled``,
    ``defrag``): the word in brackets; None where there is none."""
    try:
        with open(f"{_THP}/{name}") as f:
            words = f.read().split()
    except OSError:
        return None
    return next((w[1:-1] for w in words if w.startswith("[")), None)


def huge_pages_pay() -> bool:
    """Whether fresh memory faults in faster when advised ``MADV_HUGEPAGE``: where the
    kernel hands an advised region huge pages only if it has them free (``defrag`` is
    ``defer`` or ``never``). Where it compacts memory inside the fault to make them
    (``madvise``, ``defer+madvise``, ``always``), the fault stalls instead: with
    ``defrag=madvise`` a cold 256 MiB load in a new process took 1.0-2.1 s with the
    advice and 0.42-0.52 s without, against 0.26-0.29 s for torch.load (4 KiB pages).
    ``NUMPY_MADVISE_HUGEPAGE=0`` in the environment says no, as it does to NumPy."""
    if _libc is None or os.environ.get("NUMPY_MADVISE_HUGEPAGE", "1").strip() == "0":
        return False
    return advice_pays(thp_mode("enabled"), thp_mode("defrag"))


def advice_pays(enabled: str | None, defrag: str | None) -> bool:
    """``huge_pages_pay`` for the settings ``enabled`` and ``defrag`` of the kernel."""
    return enabled in ("always", "madvise") and defrag in ("defer", "never")


_huge_ok = huge_pages_pay()


def huge_pages(address: int, nbytes: int, *, numpy_advised: bool = False) -> None:
    """Give the whole pages of fresh memory at ``[address, address + nbytes)``, before
    anything touches them, the huge-page advice that pays on this kernel (see
    ``huge_pages_pay``): ``MADV_HUGEPAGE`` where it pays, as NumPy asks for its arrays of
    ``HUGE_MIN`` or more (glibc's ``malloc``, under torch's tensors, does not). Where it
    does not, memory NumPy advised (``numpy_advised``) is advised ``MADV_NOHUGEPAGE``
    instead, and other memory left as it is. In 4 KiB pages, 1 GiB is 262,144 faults,
    each a trap and a page zeroed; huge pages given without compaction save most of that
    (a cold 1 GiB load: 0.41 s in 4 KiB pages, 0.31 s in huge pages). Best effort."""
    global _huge_ok
    if _huge_ok:
        if _advise(address, nbytes, _MADV_HUGEPAGE) == 22:  # EINVAL: a kernel without them
            _huge_ok = False
    elif numpy_advised and _libc is not None:
        _advise(address, nbytes, _MADV_NOHUGEPAGE)


def advise_huge(address: int, nbytes: int) -> None:
    """``MADV_HUGEPAGE`` for the whole pages at ``[address, address + nbytes)``, whether or
    not it pays on this kernel (``aiosnap bench`` measures both). Best effort."""
    _advise(address, nbytes, _MADV_HUGEPAGE)


def populate(address: int, nbytes: int) -> None:
    """Fault in the whole pages of fresh memory at ``[address, address + nbytes)`` (the
    kernel zeroes them), so that a read into it later does not stop at every page.
    Best effort: a no-op where the kernel cannot (before Linux 5.14, other systems)."""
    global _populate_ok
    # ctypes releases the GIL for the call: the faults run beside the reading thread.
    if _populate_ok and _advise(address, nbytes, _MADV_POPULATE_WRITE) in (22, 38):  # EINVAL, ENOSYS
        _populate_ok = False


def _advise(address: int, nbytes: int, advice: int) -> int:
    """``madvise`` the whole pages in ``[address, address + nbytes)``: 0, or its errno."""
    start, end = -(-address // _PAGE) * _PAGE, (address + nbytes) // _PAGE * _PAGE
    if end <= start:
        return 0
    assert _libc is not None
    return 0 if _libc.madvise(start, end - start, advice) == 0 else ctypes.get_errno()


class FileStat(NamedTuple):
    """What LocalStorage needs to know of a path."""

    is_dir: bool
    size: int
    #: Changes whenever the file is replaced or written: inode, mtime and size.
    version: str
    #: Neither a regular file nor a directory: a symbolic link (not followed), a FIFO, a
    #: socket, a device. aiosnap makes none of these, so it reads, follows and deletes none.
    special: bool = False
    #: With ``version``, what tells this file from any other now or later at its path:
    #: its device and ctime (which no caller can set back, unlike mtime).
    changed: str = ""


def _stat(st: os.stat_result) -> FileStat:
    mode = st.st_mode
    return FileStat(
        stat.S_ISDIR(mode),
        st.st_size,
        f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}",
        not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)),
        f"{st.st_dev}-{st.st_ctime_ns}",
    )


class Posix:
    """The real calls. Every method is blocking."""

    # -- files -----------------------------------------------------------------------------
    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags | os.O_CLOEXEC, mode)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def preadv(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        return os.preadv(fd, bufs, offset)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def fstat(self, fd: int) -> FileStat:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(f"fd {fd} is neither a file nor a directory")
        return _stat(st)

    def flock(self, fd: int, *, exclusive: bool = True, wait: bool = False) -> None:
        """Raises BlockingIOError if another holder has it (and ``wait`` is false)."""
        op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        fcntl.flock(fd, op if wait else op | fcntl.LOCK_NB)

    # -- names -----------------------------------------------------------------------------
    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def mkdir(self, path: str) -> None:
        os.mkdir(path)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def stat(self, path: str) -> FileStat | None:
        try:
            return _stat(os.stat(path))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def lstat(self, path: str) -> FileStat | None:
        """As ``stat``, of a symbolic link itself (``special``) rather than its target."""
        try:
            return _stat(os.lstat(path))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def scandir(self, path: str) -> list[tuple[str, FileStat]]:
        """The entries of a directory, symbolic links not followed (``special``);
        FileNotFoundError if there is none."""
        found = []
        with os.scandir(path) as entries:
            for entry in entries:
                try:
                    found.append((entry.name, _stat(entry.stat(follow_symlinks=False))))
                except FileNotFoundError:
                    continue  # removed while we looked
        return found

    def free_bytes(self, path: str) -> int | None:
        """Space left for an unprivileged writer on the filesystem of ``path``."""
        try:
            st = os.statvfs(path or ".")
        except OSError:
            return None
        return st.f_bavail * st.f_frsize
