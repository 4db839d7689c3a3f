"""What a save call gives back, and how failures of background saves are reported.

A save's outcome reaches the caller through its handle (``await handle.wait()``), and
a failure also through the owner of the save (the next call, ``flush()``,
``aclose()``, ``take_failures()``). Whichever comes first reports it, and it is never
raised again: a failure is one ``SaveFailure`` record, shared by every handle and
list that can report it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import final

import anyio

logger = logging.getLogger(__name__)


@final
@dataclass(frozen=True, slots=True)
class SaveStats:
    """How one save went. Seconds are wall-clock; ``stall_s`` is what the caller waited;
    ``bytes`` is the size of what was committed."""

    path: str
    bytes: int
    stall_s: float
    stage_s: float
    write_s: float
    fsync_s: float
    total_s: float
    skipped: bool = False


@final
@dataclass(eq=False, slots=True)
class SaveFailure:
    """A background save that failed: where it was going, and the exception (with its
    original type). ``reported`` once it was raised to the caller or taken."""

    path: str
    error: BaseException
    reported: bool = False


@final
class SaveHandle:
    """The background half of a save.

    ``await handle.wait()`` returns the SaveStats once the file is durable, or raises
    the exception that failed the save, with its original type. A skipped save (a full
    QueueWriter with ``when_full="skip"`` or ``"replace"``) resolves to stats with
    ``skipped=True``. Cancelling a ``wait()`` only stops waiting: the save goes on.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        #: The upload of this checkpoint to a manager's remote tier, if it has one.
        self.upload: SaveHandle | None = None
        self._done = anyio.Event()
        self._stats: SaveStats | None = None
        self._failure: SaveFailure | None = None

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

    async def _outcome(self) -> SaveStats | SaveFailure:
        """What ``wait`` would give, without reporting a failure (for aiosnap's own waits)."""
        await self._done.wait()
        if self._failure is not None:
            return self._failure
        assert self._stats is not None
        return self._stats

    def _finish(self, stats: SaveStats) -> None:
        self._stats = stats
        self._done.set()

    def _fail(self, failure: SaveFailure | BaseException) -> None:
        self._failure = failure if isinstance(failure, SaveFailure) else SaveFailure(self.path, failure)
        self._done.set()

    def _skip(self) -> None:
        self._finish(SaveStats(self.path, 0, 0.0, 0.0, 0.0, 0.0, 0.0, skipped=True))


@final
class Failures:
    """The failures of an owner's background saves that are still to be reported."""

    def __init__(self) -> None:
        self._items: list[SaveFailure] = []

    def add(self, path: str, error: BaseException) -> SaveFailure:
        failure = SaveFailure(path, error)
        self._items = [f for f in self._items if not f.reported]
        self._items.append(failure)
        return failure

    def take(self) -> list[SaveFailure]:
        """The unreported failures, oldest first; they count as reported from now on."""
        found = [f for f in self._items if not f.reported]
        self._items = []
        for failure in found:
            failure.reported = True
        return found

    def __bool__(self) -> bool:
        return any(not f.reported for f in self._items)


def raise_first(failures: list[SaveFailure], *, accepted: str | None = None) -> None:
    """Raise the oldest of ``failures`` (all now reported), noting the others and, if this
    is a save call, that its own save was accepted."""
    if not failures:
        return
    error, rest = failures[0].error, failures[1:]
    for other in rest:
        logger.error("the background save of %s failed too", other.path, exc_info=other.error)
    if rest:
        paths = ", ".join(f.path for f in rest)
        error.add_note(f"aiosnap: {len(rest)} more background save(s) failed ({paths}); see the log")
    if accepted is not None:
        error.add_note(
            f"aiosnap: this is the failure of an earlier save ({failures[0].path}); this call's "
            f"own save of {accepted} was accepted and goes on (flush() waits for it)"
        )
    raise error
