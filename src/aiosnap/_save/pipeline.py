"""The pipelined commit: the disk writes a save's first pieces while later ones are copied.

A save whose commit can start at once (no earlier save ahead of it, a thread engine,
no ``savefun``) is handed to its commit as soon as its image is laid out and its arena
taken. From then on the two sides share a ``Pipe``:

- the staging thread copies the leaves into the arena front to back and raises the
  pipe's watermark, the end of the bytes filled so far; when the copy ends the caller
  is released, and the same side checksums the entries and writes the header into the
  arena (``seal``), while the commit still writes;
- the commit thread writes each piece of the data section once the watermark has
  passed it (O_DIRECT where the filesystem allows it), then waits for the seal,
  writes the header, and makes the file durable (fsync, rename, fsync the directory).

A capture that fails or is given up fails the pipe: the commit aborts, and nothing
is visible. A commit that fails early waits until the staging side is done with the
arena before it returns, so the arena is never released under a running copy. An
upload written front to back (an object store) waits for the seal and then streams the
whole image, as a commit after the capture would.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from .._format.header import ALIGN
from .._storage.protocol import CommitTimes, Storage

if TYPE_CHECKING:
    from .arena import Arena

#: Bytes the commit writes per call: what the disk streams best (see ``_local``).
PIECE = 16 << 20


class CaptureEnded(Exception):
    """The capture failed or was given up after its commit had started (internal: the
    caller gets the capture's own error, and the commit reports nothing)."""


class Pipe:
    """What a staging thread and a commit thread share about one image (thread-safe)."""

    def __init__(self, arena: Arena, size: int, data_start: int) -> None:
        self.arena, self.size, self.data_start = arena, size, data_start
        self._cond = threading.Condition()
        self._filled = 0  # the file's bytes before this offset are staged
        self._sealed = False
        self._failed = False
        self._started = False

    # -- the staging side --------------------------------------------------------------
    def advance(self, filled: int) -> None:
        """Bytes before file offset ``filled`` are staged and will not change."""
        with self._cond:
            if filled > self._filled:
                self._filled = filled
                self._cond.notify_all()

    def seal(self) -> None:
        """The header is in the arena: the staging side is done with it."""
        with self._cond:
            self._filled, self._sealed = self.size, True
            self._cond.notify_all()

    def fail(self) -> None:
        """The capture failed or was given up: the commit must abort. Call it only once
        the staging side no longer touches the arena."""
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def wait_started(self) -> None:
        """Block until the commit thread runs (or the commit failed): a lazy capture's
        caller may then hold the event loop, which starts that thread, for a whole step."""
        with self._cond:
            self._cond.wait_for(lambda: self._started or self._failed)

    # -- the commit side ---------------------------------------------------------------
    def started(self) -> None:
        """The commit thread runs."""
        with self._cond:
            self._started = True
            self._cond.notify_all()

    @property
    def is_started(self) -> bool:
        return self._started

    def wait_filled(self, end: int) -> None:
        """Block until bytes before ``end`` are staged; CaptureEnded if they never will be."""
        with self._cond:
            self._cond.wait_for(lambda: self._failed or self._filled >= end)
            if self._failed:
                raise CaptureEnded

    def wait_sealed(self) -> None:
        """Block until the header is in the arena; CaptureEnded if it never will be."""
        self.wait_released()
        if self._failed:
            raise CaptureEnded

    def wait_released(self) -> None:
        """Block until the staging side is done with the arena, whichever way it ended."""
        with self._cond:
            self._cond.wait_for(lambda: self._failed or self._sealed)


def commit_pipelined(storage: Storage, path: str, pipe: Pipe) -> CommitTimes:
    """Write ``pipe``'s image to ``path`` as it is staged, then commit it (blocking: runs
    in a worker thread). Returns only once the staging side is done with the arena."""
    pipe.started()
    try:
        upload = storage.create(path, pipe.size)
    except BaseException:
        pipe.wait_released()
        raise
    try:
        end = -(-pipe.size // ALIGN) * ALIGN  # the arena runs on to an aligned length
        if upload.random_access:
            for start in range(pipe.data_start, end, PIECE):
                stop = min(start + PIECE, end)
                pipe.wait_filled(min(stop, pipe.size))
                upload.write_at(start, pipe.arena.view(start, stop))
            pipe.wait_sealed()
            upload.write_at(0, pipe.arena.view(0, pipe.data_start))
        else:
            pipe.wait_sealed()
            upload.write_at(0, pipe.arena.view(0, end))
        return upload.commit()
    except BaseException:
        upload.abort()
        pipe.wait_released()
        raise
