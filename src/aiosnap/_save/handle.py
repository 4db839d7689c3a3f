"""What a save call gives back: its handle, its capture's two stages, its stats.

A save's outcome reaches the caller through its handle (``await handle.wait()``), and
a failure also through the owner of the save (the next call, ``flush()``,
``aclose()``, ``take_failures()``). Whichever comes first reports it, and it is never
raised again: a failure is one ``SaveFailure`` record (``_base/tasks.py``), shared by
every handle and list that can report it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import final

import anyio

from .._base.tasks import SaveFailure


@final
@dataclass(frozen=True, slots=True)
class SaveStats:
    """How one save went. Seconds are wall-clock; ``stall_s`` is what the caller waited;
    ``bytes`` is the size of what was committed (an incremental save: its file and the
    blobs it wrote, not those it shares with earlier saves)."""

    path: str
    bytes: int
    stall_s: float
    stage_s: float
    write_s: float
    fsync_s: float
    total_s: float
    skipped: bool = False


@final
class Capture:
    """The capture of one save's state, in two stages: set by the writer once the state's
    tree is walked (``walked``), then once its tensors are copied (``set``, or the capture
    failed); awaited by whoever must not change the state before then. An eager save
    reaches both at once; a lazy one copies its tensors after it is walked.

    A wait cancelled before its stage ended calls ``on_abandon``: the writer drops the
    save whole, since its caller may be changing the state. Once the capture ended, a
    cancelled wait changes nothing: the save goes on and commits."""

    def __init__(self, on_abandon: Callable[[], None] | None = None) -> None:
        self._walked = anyio.Event()
        self._done = anyio.Event()
        self._error: BaseException | None = None
        self._walk_error: BaseException | None = None
        self._failure: SaveFailure | None = None
        self._on_abandon = on_abandon
        #: When a wait first returned: the end of the caller's stall.
        self.returned_at: float | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def walked(self) -> None:
        """The tree is walked: the save call may return (a lazy save's tensors are still
        being copied). Only the first call counts."""
        self._walked.set()

    def set(self, error: BaseException | None = None, failure: SaveFailure | None = None) -> None:
        """The state is copied (``error``: the capture failed; ``failure``: its record,
        reported when a wait raises it). Only the first call counts."""
        if self._done.is_set():
            return
        self._error, self._failure = error, failure
        if not self._walked.is_set():
            self._walk_error = error
            self._walked.set()
        self._done.set()

    async def wait_walked(self) -> None:
        """Until the tree is walked; raises what failed the walk."""
        await self._wait(self._walked)
        if self._walk_error is not None:
            raise self._walk_error

    async def wait(self) -> None:
        """Until the state is copied; raises what failed the capture."""
        await self._wait(self._done)
        if self._error is not None:
            if self._failure is not None:
                self._failure.reported = True
            raise self._error

    async def ended(self) -> None:
        """Until the capture ended, whichever way; a cancelled wait abandons nothing."""
        await self._done.wait()

    async def _wait(self, stage: anyio.Event) -> None:
        try:
            await stage.wait()
        except BaseException:
            if not self._done.is_set() and self._on_abandon is not None:
                self._on_abandon()
            raise
        if self.returned_at is None:
            self.returned_at = time.perf_counter()


@final
class SaveHandle:
    """The background half of a save.

    ``await handle.wait_captured()`` returns once the state of the save is copied: from
    then on it may change (a lazy save's call returns before that: see
    ``wait_walked``). ``await handle.wait()`` returns the SaveStats once the file
    is durable, or raises the exception that failed the save, with its original type. A
    skipped save (a full QueueWriter with ``when_full="skip"`` or ``"replace"``)
    resolves to stats with ``skipped=True``. Cancelling a ``wait()`` only stops
    waiting: the save goes on.
    """

    def __init__(self, path: str, capture: Capture | None = None) -> None:
        self.path = path
        #: The upload of this checkpoint to a manager's remote tier, if it has one.
        self.upload: SaveHandle | None = None
        self._done = anyio.Event()
        self._stats: SaveStats | None = None
        self._failure: SaveFailure | None = None
        if capture is None:  # nothing of the caller's to copy: captured already
            capture = Capture()
            capture.set()
        self._capture = capture

    def __repr__(self) -> str:
        done = "done" if self.done() else "pending"
        state = "skipped" if self.skipped else "failed" if self._failure else done
        return f"<SaveHandle {self.path!r} {state}>"

    def done(self) -> bool:
        """Whether the save has finished: committed, failed or skipped."""
        return self._done.is_set()

    @property
    def skipped(self) -> bool:
        return self._stats is not None and self._stats.skipped

    async def wait_captured(self) -> None:
        """Return once the state of this save is captured: from then on it may change.
        Raises the capture's failure. Cancelled before the capture ended, it drops the
        save whole (nothing is written, the handle fails with SaveCancelledError); after,
        the save goes on. A save that was skipped, or has ended, returns at once; so
        does an eager save once its call returned."""
        await self._capture.wait()

    async def wait_walked(self) -> None:
        """Return once the state's tree is walked: its structure and plain values are
        taken, and the optimizers in it are guarded. This is where a save call returns:
        for an eager save, every tensor is copied by then too; a lazy save (``capture=
        "lazy"``) still copies its tensors, and ``wait_captured()`` says when it is done.
        Raises what failed the walk; cancelled before the capture ended, it drops the
        save whole, as ``wait_captured`` does."""
        await self._capture.wait_walked()

    async def wait(self) -> SaveStats:
        """The stats once the save is durable; or raise its failure (which is then
        reported: no later call raises it again)."""
        await self._done.wait()
        if self._failure is not None:
            self._failure.reported = True
            raise self._failure.error
        assert self._stats is not None
        return self._stats

    def exception(self) -> BaseException | None:
        """The failure of a finished save (then reported), or None; raise if not done."""
        if not self.done():
            raise anyio.WouldBlock(f"the save of {self.path} has not finished")
        if self._failure is None:
            return None
        self._failure.reported = True
        return self._failure.error

    async def outcome(self) -> SaveStats | SaveFailure:
        """Once the save has ended: its stats, or its SaveFailure, which this does not
        report (``wait`` raises it and marks it reported). For whoever only needs to know
        that the save ended, and how: a manager's vote, an upload of the file."""
        await self._done.wait()
        if self._failure is not None:
            return self._failure
        assert self._stats is not None
        return self._stats


@final
class Resolver:
    """The side of a SaveHandle that ends the save: only its holder (a writer, a manager,
    an uploader) resolves the handle it made, once. ``Resolver(path)`` makes the handle;
    ``capture`` is the capture its callers wait for (none: nothing of theirs to copy), or
    ``following=`` another handle whose capture it shares (a manager's handle of a
    writer's save)."""

    def __init__(
        self, path: str, capture: Capture | None = None, *, following: SaveHandle | None = None
    ) -> None:
        self.handle = SaveHandle(path, capture if following is None else following._capture)

    def finish(self, stats: SaveStats) -> None:
        h = self.handle
        h._stats = stats
        h._capture.set()
        h._done.set()

    def fail(self, failure: SaveFailure | BaseException) -> None:
        """End the save failed: ``failure`` is a SaveFailure shared with whoever else may
        report it (a writer's list), or an exception reported only through this handle."""
        h = self.handle
        h._failure = failure if isinstance(failure, SaveFailure) else SaveFailure(h.path, failure)
        h._capture.set(h._failure.error, h._failure)
        h._done.set()

    def skip(self) -> None:
        self.finish(SaveStats(self.handle.path, 0, 0.0, 0.0, 0.0, 0.0, 0.0, skipped=True))


def skipped(path: str) -> SaveHandle:
    """A handle that is resolved already: a save that was not made."""
    resolver = Resolver(path)
    resolver.skip()
    return resolver.handle
