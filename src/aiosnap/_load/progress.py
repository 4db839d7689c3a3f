"""Progress of a load: the bytes read so far, counted where every read passes.

A load reads through ``Storage.open_read`` readers; ``Counted`` wraps a storage so
that each reader it opens counts what it reads, and tells a ``progress(done, total)``
callback, where ``total`` is the bytes of the files the load has opened (a partial
load, ``keys=``, reads fewer: the last call then says ``total`` of ``total``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

from .._storage.protocol import Reader, Storage
from .verify import Progress


class _Tally:
    def __init__(self, progress: Progress) -> None:
        self.progress, self.done, self.total = progress, 0, 0
        self._lock = threading.Lock()

    def opened(self, size: int) -> None:
        with self._lock:
            self.total += size

    def read(self, n: int) -> None:
        with self._lock:  # told in order, even when ranges are read in parallel
            self.done += n
            self.progress(min(self.done, self.total), self.total)

    def finish(self) -> None:
        self.progress(self.total, self.total)


class _CountedReader:
    def __init__(self, reader: Reader, tally: _Tally) -> None:
        self._reader, self._tally = reader, tally
        self.path, self.size = reader.path, reader.size
        tally.opened(reader.size)

    def readinto(self, offset: int, buf: memoryview) -> None:
        self._reader.readinto(offset, buf)
        self._tally.read(buf.nbytes)

    def read_batch(self, requests: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        self._reader.read_batch(requests)
        self._tally.read(sum(b.nbytes for _, bufs in requests for b in bufs))

    def close(self) -> None:
        self._reader.close()

    def __getattr__(self, name: str) -> Any:  # a backend's batch hints (batch_bytes ...)
        return getattr(self._reader, name)


class Counted:
    """``storage``, whose readers count their bytes for ``progress``."""

    def __init__(self, storage: Storage, progress: Progress) -> None:
        self._storage, self.tally = storage, _Tally(progress)

    def open_read(self, path: str) -> Reader:
        return _CountedReader(self._storage.open_read(path), self.tally)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)


def counted(storage: Storage, progress: Progress | None) -> tuple[Storage, Callable[[], None]]:
    """The storage to load through, and what to call once the load is done."""
    if progress is None:
        return storage, lambda: None
    wrapped = Counted(storage, progress)
    return cast(Storage, wrapped), wrapped.tally.finish
