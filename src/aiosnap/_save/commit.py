"""The commit of a captured save: pipelined (started during the capture, ``pipeline.py``),
incremental (blobs, ``incremental.py``) or whole through the engine (a thread or the
worker process); then its figures (``SaveStats``) and the post-save hooks.

``Committer.commit`` returns the stats or raises; ``Committer.failure`` says what a
failed commit ends its save with. Settling the save is the writer's (``job.py``).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Awaitable, Callable

from .._base import offload as _offload
from .._base.tasks import Failures, SaveFailure
from .._storage.protocol import CommitTimes
from .engine import Engine
from .handle import SaveStats
from .incremental import Dedup, Known, commit_incremental
from .job import SaveJob, logger
from .options import Incremental
from .pipeline import CaptureEnded, commit_pipelined

PostSaveHook = Callable[[SaveStats], object] | Callable[[SaveStats], Awaitable[object]]


class Hooks:
    """What runs after each commit: async hooks awaited, sync ones in a worker thread."""

    def __init__(self) -> None:
        self._hooks: list[PostSaveHook] = []

    def add(self, hook: PostSaveHook) -> None:
        self._hooks.append(hook)

    async def run(self, stats: SaveStats) -> None:
        for hook in self._hooks:
            await _call_hook(hook, stats)


async def _call_hook(hook: PostSaveHook, stats: SaveStats) -> None:
    if inspect.iscoroutinefunction(hook) or inspect.iscoroutinefunction(
        getattr(hook, "__call__", None)  # noqa: B004 - async callable objects
    ):
        await hook(stats)  # type: ignore[misc]
        return
    result = await _offload.run_io(hook, stats)
    if inspect.isawaitable(result):
        await result


class Committer:
    """Writes captured saves durably, one way or another, and reports on them.

    ``dedup``: incremental saves' options (None: full saves, ``incremental=None``);
    ``known``: the blobs they stored; ``failures``: the writer's list, where a failed commit is kept."""

    def __init__(
        self, engine: Engine, incremental: Incremental | None, hooks: Hooks, failures: Failures
    ) -> None:
        self.engine = engine
        self.dedup = None if incremental is None else Dedup.of(incremental)
        self.known = Known()
        self.hooks = hooks
        self._failures = failures

    def keep_blobs_by_rank(self, rank_dir: str) -> None:
        """Incremental saves keep their blobs in the rank's own folder (``rank_dir``)."""
        if self.dedup is not None:
            self.dedup = dataclasses.replace(self.dedup, rank_dir=rank_dir)

    def can_pipeline(self, job: SaveJob) -> bool:
        """Whether ``job``'s commit may start during its capture: in a thread of this
        process, the image written whole, with no ``savefun``."""
        return not self.engine.shared and job.savefun is None and self.dedup is None

    async def commit(self, job: SaveJob) -> SaveStats:
        """Make ``job`` durable; its stats, once the hooks have run."""
        times = await self._write(job)
        assert job.staged is not None
        returned = job.capture.returned_at
        stats = SaveStats(
            job.handle.path,
            times.bytes,
            job.stall_s if returned is None else returned - job.t0,
            job.staged.stage_s,
            times.write_s,
            times.fsync_s,
            time.perf_counter() - job.t0,
        )
        await self.hooks.run(stats)
        return stats

    async def _write(self, job: SaveJob) -> CommitTimes:
        if job.pipe is not None:
            try:
                times = await _offload.run_commit(commit_pipelined, job.storage, job.handle.path, job.pipe)
            except BaseException:
                if not job.pipe.is_started:  # cancelled before its thread ran
                    job.pipe.fail()
                raise
            # A lazy capture's staging thread seals the pipe itself: the commit may end
            # before the loop has taken the capture's result (job.staged).
            await job.capture.ended()
            return times
        assert job.staged is not None
        if self.dedup is not None and job.savefun is None:
            # In a thread of this process whatever the engine: the arena is shared.
            return await _offload.run_io(
                commit_incremental, job.storage, job.handle.path, job.staged, self.dedup, self.known
            )
        return await self.engine.commit(job.storage, job.handle.path, job.staged, job.savefun)

    async def failure(self, job: SaveJob, exc: Exception) -> SaveFailure | BaseException:
        """What a save whose commit raised ``exc`` ends with."""
        captured = not (isinstance(exc, CaptureEnded) or job.capture_error is not None or job.abandoned)
        if job.pipe is not None and not captured:
            # The capture failed: its caller has the error (a lazy capture's is reported
            # as a background failure). A lazy capture fails its pipe from its staging
            # thread: its error may not be recorded yet.
            await job.capture.ended()
            return job.capture_failure()
        logger.warning("background save of %s failed: %r", job.handle.path, exc)
        return self._failures.add(job.handle.path, exc)
