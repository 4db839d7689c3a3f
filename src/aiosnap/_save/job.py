"""One save in flight (``SaveJob``) and its settling (``Jobs``): the arena back to the
pool, the guard released, the handle resolved -- once, whichever step ends the save.

A job is shared by the writer's task that runs it and the staging thread that captures
it (``capture.py``); the commit (``commit.py``) reads what the capture left in it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .._base.errors import SaveCancelledError, WriterClosedError
from .._base.names import check_component
from .._base.tasks import SaveFailure
from .._storage.backends import resolve
from .._storage.protocol import Storage
from .arena import Arena, ArenaPool
from .device import DeviceCopier
from .engine import SaveFun
from .guard import Guard
from .handle import Capture, Resolver, SaveHandle, SaveStats
from .options import CaptureMode
from .pipeline import Pipe
from .stage import StagedImage

logger = logging.getLogger("aiosnap._save.writers")  # the writers' log, as it always was


@dataclass(eq=False, slots=True)
class SaveJob:
    """What one save is at each moment, from its admission to its settling."""

    resolver: Resolver
    storage: Storage
    target: object  # walked in the staging thread, while the caller waits
    savefun: SaveFun | None
    t0: float
    capture: Capture
    guard: Guard | None = None  # a lazy capture's
    walked: bool = False  # a lazy capture's caller was released
    failure: SaveFailure | None = None  # a lazy capture failed after its call returned
    staged: StagedImage | None = None
    arena: Arena | None = None  # released when the save settles
    pipe: Pipe | None = None  # set once a pipelined commit has taken the save
    capture_error: BaseException | None = None
    abandoned: bool = False
    stall_s: float = 0.0
    producers: object = None  # the device streams producing the tensors, seen from the loop
    stats: SaveStats | None = None  # set when the save was written in pieces during capture

    @classmethod
    def new(
        cls,
        storage: Storage,
        path: str,
        target: object,
        savefun: SaveFun | None,
        t0: float,
        capture: CaptureMode,
        copier: DeviceCopier | None,
    ) -> SaveJob:
        """A save just accepted, on the loop's thread, its capture not begun."""

        def abandon() -> None:
            # A caller that stops waiting before the capture ended may be changing the state.
            job.abandoned = True

        taken = Capture(on_abandon=abandon)
        job = cls(Resolver(path, taken), storage, target, savefun, t0, taken)
        if capture == "lazy":
            job.guard = Guard(copier)
        if copier is not None:
            # Current streams are per thread: take the caller's here, on the loop thread.
            job.producers = copier.producer_streams()
        return job

    @property
    def handle(self) -> SaveHandle:
        return self.resolver.handle

    def capture_failure(self) -> SaveFailure | BaseException:
        """What a save whose capture did not complete ends with."""
        if self.failure is not None:
            return self.failure
        error = self.capture_error
        if isinstance(error, Exception):
            return error
        if self.abandoned:
            return SaveCancelledError("the caller gave the save up before its capture ended")
        return WriterClosedError("the writer closed during a capture")


def place(filename: str, out_dir: str, storage: Storage | None) -> tuple[Storage, str]:
    """Where a save of ``filename`` in ``out_dir`` goes (``storage``: the writer's, if it
    has one): the storage and the path in it. ``filename`` must be one name (ValueError)."""
    if out_dir:
        check_component(filename, "filename")
        found, directory = resolve(out_dir, storage)
        return found, found.join(directory, filename)
    found, path = resolve(filename, storage)
    check_component(found.split(path)[1], "the file name of")
    return found, path


class Jobs:
    """A writer's saves in flight, and how each one ends."""

    def __init__(self, pool: ArenaPool) -> None:
        self._pool = pool
        self._inflight: set[SaveJob] = set()

    def add(self, job: SaveJob) -> None:
        self._inflight.add(job)

    async def wait(self) -> None:
        """Until every save in flight now has an outcome."""
        for job in list(self._inflight):
            await job.handle.outcome()

    def settle(
        self, job: SaveJob, error: SaveFailure | BaseException | None = None, stats: SaveStats | None = None
    ) -> None:
        """End ``job``: its arena back to the pool, its guard released, its handle given
        ``stats`` (durable), ``error`` (failed), or neither (skipped); a handle resolved
        already keeps its outcome."""
        arena, job.arena, job.staged = job.arena, None, None
        if arena is not None:
            self._pool.release(arena)
        if job.guard is not None:
            job.guard.release()  # also where the staging thread never ran
        self._inflight.discard(job)
        if job.handle.done():
            return
        if stats is not None:
            logger.info(
                "saved %s: %d bytes, caller stalled %.1f ms, durable after %.1f ms",
                stats.path,
                stats.bytes,
                stats.stall_s * 1e3,
                stats.total_s * 1e3,
            )
            job.resolver.finish(stats)
        elif error is not None:
            job.resolver.fail(error)
        else:
            job.resolver.skip()
