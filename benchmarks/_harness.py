"""Measuring tools for the benchmarks: peak RSS, event-loop lag, cold caches."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def minor_faults() -> int:
    """Page faults of this process so far that needed no disk: on these VMs, most are
    the first touch of a page of memory (see ``cold_start``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class RssSampler:
    """Peak RSS above the level at entry, sampled every millisecond by a thread, and the
    bytes of the pages faulted in meanwhile (``faulted``: memory new to the process, or
    given back to the kernel since, which a load pays for and a reused buffer does not).

    (A thread, not a task: the peers block the event loop while they save.)
    """

    def __init__(self) -> None:
        self.peak_extra = 0
        self.faulted = 0

    def __enter__(self) -> RssSampler:
        self._base, self._faults = rss(), minor_faults()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak_extra = max(self.peak_extra, rss() - self._base)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_extra = max(self.peak_extra, rss() - self._base)
        self.faulted = (minor_faults() - self._faults) * _PAGE


@contextlib.contextmanager
def loop_lag(period: float = 0.002) -> Iterator[list[float]]:
    """Lateness of a task that wants to wake every ``period`` seconds, in seconds."""
    lags: list[float] = []
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        yield lags
        return

    async def tick() -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(period)
            lags.append(max(0.0, time.perf_counter() - t0 - period))

    task = asyncio.get_running_loop().create_task(tick())
    try:
        yield lags
    finally:
        task.cancel()


def drop_cache(path: Path | str) -> None:
    """Evict a file from the page cache, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cold_start(path: Path | str) -> None:
    """Set up a cold load of ``path``: evict it from the page cache, then fault in and
    free twice as much fresh memory as it holds (the page cache the read fills, and
    what the load returns), so that what the load allocates is memory the VM backs.

    These Firecracker guests hand memory that has been free for more than ~2 s back to
    the host (as free page reporting does); faulting it in again cost 0.6-2.3 s per GiB
    against 0.05 s for memory freed just before, serialised in the host (two threads
    took as long as one). Without this, a load's time depended on which row ran before it and
    how long ago: the same aiosnap load measured 0.29 s and 2.28 s in one run. Every
    cold-load row, peers included, starts from here. It narrows the spread; it does not
    remove it (docs/performance.md: "Cold loads: memory the VM has taken back").
    """
    drop_cache(path)
    fresh = np.empty(2 * os.stat(path).st_size, np.uint8)
    fresh[::_PAGE] = 0  # one store a page: each page faulted in
    del fresh


def fsync_path(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_store(path: Path) -> str:
    """A fresh FileStore's URL for ranks to meet at. A free TCP port found beforehand
    could be taken by another socket before rank 0 binds it (a smoke test failed so)."""
    path.unlink(missing_ok=True)
    return f"file://{path}"


def empty_dir(directory: Path) -> None:
    """Remove what a measured save left in ``directory`` (files, and directories of files)."""
    for p in directory.iterdir():
        if p.is_dir():
            for q in p.iterdir():
                q.unlink()
            p.rmdir()
        else:
            p.unlink()


def o_direct_supported(directory: Path) -> bool:
    probe = directory / ".odirect-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    probe.unlink()
    return hasattr(os, "O_DIRECT")


DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def publish(name: str, text: str, docs: Path = DOCS) -> None:
    """Put ``text`` into docs/benchmarks.md as the section ``name``: it replaces the text
    between that section's markers, or is appended with them; other sections stay."""
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    page = docs.read_text() if docs.exists() else "# Benchmarks\n"
    block = f"{begin}\n{text.strip()}\n{end}"
    head, found, rest = page.partition(begin)
    if found and end in rest:
        page = head + block + rest.partition(end)[2]
    else:
        page = page.rstrip("\n") + "\n\n" + block + "\n"
    docs.write_text(page)
