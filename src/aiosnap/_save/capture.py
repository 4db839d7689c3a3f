"""The capture of a save: the tree walked and copied into an arena in a worker thread
(``stage.py``), with the hand-offs to the event loop that a pipelined commit and a lazy
capture make on the way, the header sealed after a pipelined capture, and a state
larger than the memory budget written in pieces before the call returns.

A save whose commit can start at once -- no earlier save ahead of it, a commit in a
thread, no ``savefun`` -- is *pipelined*: its commit is handed the arena as soon as the
image is laid out, and writes the first pieces while later ones are still being copied.
The commit then owns the end of the save: it settles it, also when the capture fails
(the caller gets that error, the writer reports nothing).

A *lazy* save (``capture="lazy"``) releases its caller once the tree is walked: the
staging thread goes on copying the tensors, with no help from the event loop, which a
synchronous training step holds until the next save; a ``Guard`` holds the step of
the optimizers in the state until the copies are done. A copy that fails after the
call returned is a background failure, reported as a failed commit is.

What follows the capture (the commit, a place in a queue) is the writer's.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import anyio

from .._base import offload as _offload
from .._base.errors import SaveCancelledError, WriterClosedError
from .._base.tasks import Failures, SaveFailure
from .._format.header import seal
from .._format.plans import Plan, PlanCache
from .._storage.protocol import CommitTimes
from .arena import ArenaPool
from .commit import Hooks
from .device import DeviceCopier
from .handle import SaveStats
from .job import SaveJob, logger
from .pipeline import Pipe
from .stage import GAVE_UP, Lazy, StageRequest, stage_or_plan, write_in_pieces
from .window import Window

Drop = Callable[[SaveJob, BaseException], None]


class Capturer:
    """Captures a writer's saves, one at a time (a lock: the arena pool and the layout
    cache are used by one staging thread at once)."""

    def __init__(
        self,
        *,
        pool: ArenaPool,
        copier: DeviceCopier | None,
        allow_pickle: bool,
        hooks: Hooks,
        failures: Failures,
    ) -> None:
        self.pool = pool
        self.plans = PlanCache()  # used under the lock
        self._copier = copier
        self._allow_pickle = allow_pickle
        self._hooks = hooks
        self._failures = failures
        self._lock = anyio.Lock()

    async def run(self, job: SaveJob, begin: Callable[[Pipe], bool] | None, drop: Drop) -> None:
        """Capture ``job`` into an arena (``job.staged``), or write it in pieces now
        (``job.stats``). A capture that fails leaves its error in ``job.capture_error``;
        one stopped by a cancellation fails its pipe, or is dropped, and raises."""
        request = self._request(job, begin)
        try:
            async with self._lock:
                staged = await _offload.run_cpu(stage_or_plan, job.target, request)
                if isinstance(staged, Plan):
                    job.stats = await self._in_pieces(job, staged)
                else:
                    job.staged, job.arena = staged, staged.arena
        except BaseException as exc:
            job.capture_error = exc
            if not isinstance(exc, Exception):
                if job.pipe is not None:
                    job.pipe.fail()  # its commit settles the save
                else:
                    drop(job, WriterClosedError("the writer closed during a capture"))
                raise
        finally:
            job.target = None
            if not job.walked:
                job.stall_s = time.perf_counter() - job.t0  # the caller's own figure replaces it
            job.capture.set(job.capture_error, self._late_failure(job))

    def _request(self, job: SaveJob, begin: Callable[[Pipe], bool] | None) -> StageRequest:
        lazy = None
        if job.guard is not None:
            lazy = Lazy(functools.partial(_offload.from_loop, _walked, job), job.guard)
        return StageRequest(
            allow_pickle=self._allow_pickle or job.savefun is not None,
            pool=self.pool,
            copier=self._copier,
            producers=job.producers,
            keep_tree=job.savefun is not None,
            begin=begin,
            plans=self.plans,
            stop=functools.partial(getattr, job, "abandoned"),
            lazy=lazy,
        )

    def _late_failure(self, job: SaveJob) -> SaveFailure | None:
        """A lazy capture that failed after its call returned: its caller has not seen the
        error, so it is reported as a background failure (the next call, flush, aclose)."""
        error = job.capture_error
        if job.walked and isinstance(error, Exception) and not job.abandoned and job.failure is None:
            logger.warning("the background copy of %s failed: %r", job.handle.path, error)
            job.failure = self._failures.add(job.handle.path, error)
        return job.failure

    async def seal(self, job: SaveJob, pipe: Pipe) -> None:
        """After a pipelined capture: checksum the staged entries and write the header
        into the arena while the commit writes the data, or make the commit abort."""
        staged = job.staged
        if staged is not None and staged.sealed:
            return  # by a lazy capture's staging thread
        if job.capture_error is not None or job.abandoned or staged is None:
            pipe.fail()
            return
        try:
            await _offload.run_cpu(seal, staged.image(), staged.template, staged.spans)
        except BaseException:
            pipe.fail()
            raise
        pipe.seal()

    async def _in_pieces(self, job: SaveJob, layout: Plan) -> SaveStats:
        """A state larger than ``max_host_bytes``: staged and written through a buffer of
        that size before the call returns (slower, but bounded). A caller cancelled
        meanwhile stops it between two pieces, and nothing is committed."""
        budget = self.pool.budget
        assert budget is not None
        storage, path = job.storage, job.handle.path

        def commit() -> CommitTimes:
            upload = storage.create(path, layout.size)
            try:
                write_in_pieces(layout, upload, budget, lambda: job.abandoned)
                return upload.commit()
            except BaseException:
                upload.abort()
                raise

        times = await _offload.run_io(commit)
        total = time.perf_counter() - job.t0
        stats = SaveStats(path, times.bytes, total, 0.0, times.write_s, times.fsync_s, total)
        await self._hooks.run(stats)
        return stats


def _walked(job: SaveJob, optimizers: list[Any], window: Window) -> None:
    """On the loop, asked by a lazy capture's staging thread: the tree is walked and
    the arena taken; guard the optimizers, open the copy-on-write window on the loop's
    thread, and let the caller return."""
    if job.abandoned:
        raise SaveCancelledError(GAVE_UP)
    assert job.guard is not None
    job.guard.arm(optimizers)
    window.put_on()
    job.walked = True
    job.stall_s = time.perf_counter() - job.t0
    job.capture.walked()
