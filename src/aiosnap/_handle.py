"""What a save call gives back: a handle to await, and the stats it resolves to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

import anyio


@final
@dataclass(frozen=True, slots=True)
class SaveStats:
    """How one save went. Seconds are wall-clock; ``stall_s`` is what the caller waited."""

    path: str
    bytes: int
    stall_s: float
    stage_s: float
    write_s: float
    fsync_s: float
    total_s: float
    skipped: bool = False


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
        self._done = anyio.Event()
        self._stats: SaveStats | None = None
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        state = (
            "skipped" if self.skipped else "failed" if self._error else ("done" if self.done() else "pending")
        )
        return f"<SaveHandle {self.path!r} {state}>"

    def done(self) -> bool:
        """Whether the save has finished: committed, failed or skipped."""
        return self._done.is_set()

    @property
    def skipped(self) -> bool:
        return self._stats is not None and self._stats.skipped

    async def wait(self) -> SaveStats:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._stats is not None
        return self._stats

    def _finish(self, stats: SaveStats) -> None:
        self._stats = stats
        self._done.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def _skip(self) -> None:
        self._finish(SaveStats(self.path, 0, 0.0, 0.0, 0.0, 0.0, 0.0, skipped=True))
