"""The remote tier's writer: copies checkpoints committed on the local tier, in the background.

A tiered CheckpointManager saves to its local directory and hands each committed
checkpoint to its remote tier (``_manager.tier``), whose writer is an ``UploadWriter``:
the remote save's "state" is a ``LocalCopy``, the local file once its own save
resolved. So an upload commits, is indexed and rotated exactly as a save is (in a
group: every rank copies its own file, rank 0 writes the manifest last).

The queue is bounded: when ``max_pending`` uploads wait behind the running one, the
oldest waiting one is dropped (its handle says skipped): the newest checkpoint is
never dropped. A copy that fails for a reason of the far end (the network, the store)
is tried again after an exponential backoff with jitter. After ``retries`` failed
tries in a row the remote tier is *unavailable*: the user is told once, and the
upload keeps being tried, at most ``max_backoff`` seconds apart, for as long as the
writer is open, while the uploads behind it wait; the first copy that goes through
makes it available again. Local saves never wait on any of this. ``abandon()`` ends
what is still pending (at a bounded close).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Self, final

import anyio
import anyio.abc

from .._base import offload as _offload
from .._base.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignFileError,
    RemoteStorageError,
    WriterClosedError,
)
from .._base.notice import notice
from .._base.tasks import Failures, SaveFailure, TaskGroupOwner, raise_first
from .._format.tree import ExternalLeaves
from .._save.engine import SaveFun
from .._save.handle import Resolver, SaveHandle, SaveStats
from .._save.transfer import copy_checkpoint
from .._storage.backends import resolve
from .._storage.protocol import Storage

logger = logging.getLogger(__name__)


@final
@dataclass(frozen=True, slots=True)
class LocalCopy:
    """What the remote tier saves: the local checkpoint file of ``committed``, once that
    save resolved (a failed or skipped local save is not uploaded)."""

    storage: Storage
    committed: SaveHandle


@dataclass(eq=False, slots=True)
class _Job:
    resolver: Resolver
    source: LocalCopy
    storage: Storage
    t0: float
    attempts: int = 0
    error: BaseException | None = None  # of its last try

    @property
    def handle(self) -> SaveHandle:
        return self.resolver.handle


@final
class UploadWriter(TaskGroupOwner):
    """A Writer whose saves copy ``LocalCopy`` files (see the module docstring)."""

    def __init__(
        self,
        *,
        storage: Storage | None = None,
        max_pending: int = 2,
        retries: int = 5,
        backoff: float = 1.0,
        max_backoff: float = 60.0,
    ) -> None:
        """Args:
        storage: where uploads go (by default, the remote tier's storage).
        max_pending: uploads that may wait behind the running one; when more come,
            the oldest waiting one is dropped (skipped), never the newest.
        retries: failed tries in a row after which the remote tier counts as
            unavailable (the user is told; the upload is still retried).
        backoff: the first delay between tries, in seconds, doubled each time.
        max_backoff: the longest delay between tries while the remote tier is
            unavailable.
        """
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, not {max_pending}")
        if retries < 0:
            raise ValueError(f"retries must be at least 0, not {retries}")
        self._storage = storage
        self.max_pending, self.retries, self.backoff = max_pending, retries, backoff
        self.max_backoff = max_backoff
        self._queue: collections.deque[_Job] = collections.deque()
        self._running: _Job | None = None
        self._wake = anyio.Event()
        self._failures = Failures()
        #: The last failure of a copy, while the remote tier is unavailable.
        self.unavailable: BaseException | None = None
        #: Grows with every piece handed over and every upload that ends.
        self.progress = 0
        self._progressed = anyio.Event()
        self._go = anyio.Event()
        self._go.set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def pause(self) -> None:
        """Copy nothing until ``resume()`` (the remote directory is not open yet): uploads
        queue meanwhile, as they do behind a running one."""
        self._go = anyio.Event()

    def resume(self) -> None:
        self._go.set()

    @property
    def storage(self) -> Storage | None:
        """Where uploads go: the storage given, or once bound, the remote tier's."""
        return self._storage

    def bind(self, storage: Storage) -> None:
        """Upload through the remote tier's storage (one made from its URL, unless given:
        ``Remote`` checks that one given is the tier's)."""
        if self._storage is None:
            self._storage = storage

    async def __aenter__(self) -> Self:
        self._opening("a writer can be opened only once")
        self._loop = asyncio.get_running_loop()
        tg = await self._open_tasks()
        self._opened()
        tg.start_soon(self._consume)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.aclose()
        finally:
            await self._close_tasks(cancel=True)  # the consumer waits for work for ever

    async def __call__(
        self, filename: str, out_dir: str, target: object, *, savefun: SaveFun | None = None
    ) -> SaveHandle:
        """Queue the upload of ``target`` (a LocalCopy) to ``out_dir/filename``; returns at once."""
        if not self._is_open:
            raise WriterClosedError("the upload writer is not open")
        if isinstance(target, ExternalLeaves):  # a group's replicated leaves: the file says so already
            target = target.state
        if not isinstance(target, LocalCopy) or savefun is not None:
            raise TypeError("an UploadWriter uploads committed local checkpoints (LocalCopy) only")
        storage, directory = resolve(out_dir, self._storage)
        job = _Job(Resolver(storage.join(directory, filename)), target, storage, time.perf_counter())
        if len(self._queue) >= self.max_pending:
            dropped = self._queue.popleft()
            logger.warning(
                "the upload of %s was dropped: %d newer uploads wait (the newest is never dropped)",
                dropped.handle.path,
                self.max_pending,
            )
            dropped.resolver.skip()
        self._queue.append(job)
        self._wake.set()
        return job.handle

    async def accept(
        self, filename: str, out_dir: str, target: object, *, savefun: SaveFun | None = None
    ) -> SaveHandle:
        """As the call: an upload has nothing of the caller's to capture."""
        return await self(filename, out_dir, target, savefun=savefun)

    async def _consume(self) -> None:
        with _offload.remote_io():
            while True:
                if not self._queue:
                    self._wake = anyio.Event()
                    await self._wake.wait()
                    continue
                await self._go.wait()
                if not self._queue:  # abandoned meanwhile
                    continue
                job = self._queue.popleft()
                self._running = job
                try:
                    await self._upload(job)
                finally:
                    self._running = None
                    self._advanced()

    def _advanced(self, nbytes: int = 0) -> None:
        """Progress: a piece was handed over, or an upload ended (from any thread)."""
        self.progress += 1
        event, self._progressed = self._progressed, anyio.Event()
        event.set()

    def nudge(self) -> None:
        """Wake whoever waits for progress (something else the uploads wait on moved)."""
        self._advanced()

    async def progressed(self) -> None:
        """Return at the next progress (a piece handed over, an upload ended)."""
        await self._progressed.wait()

    def _piece(self, nbytes: int) -> None:
        """From the copying thread: tell the loop a piece went."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._advanced, nbytes)
            except RuntimeError:
                pass  # the loop is closed: nobody waits for it any more

    async def _upload(self, job: _Job) -> None:
        outcome = await job.source.committed.outcome()
        if isinstance(outcome, SaveFailure) or outcome.skipped:
            job.resolver.skip()  # nothing committed locally: nothing to upload
            return
        src, dst = job.source.storage, job.handle.path
        attempt = 0
        while True:
            try:
                times = await _offload.run_io(
                    copy_checkpoint, src, outcome.path, job.storage, dst, self._piece
                )
                break
            except (CheckpointNotFoundError, CorruptCheckpointError, ForeignFileError) as exc:
                # the local file, or a user's in the remote's blob folder: no retry helps
                job.resolver.fail(self._failures.add(dst, exc))
                return
            except OSError as exc:  # RemoteStorageError included: the network, the far end
                attempt += 1
                job.attempts, job.error = attempt, exc
                delay = min(self.backoff * 2 ** min(attempt - 1, 30), self.max_backoff) * (
                    0.5 + random.random()
                )
                if attempt > self.retries and self.unavailable is None:
                    notice(
                        logger,
                        f"the remote tier is unavailable: uploading {dst} failed {attempt} times ({exc!r}); "
                        f"uploads wait and are tried again, at most {self.max_backoff:g} s apart; local "
                        "saves go on",
                    )
                if attempt > self.retries:
                    self.unavailable = exc
                logger.info("uploading %s failed (%r); try %d in %.1f s", dst, exc, attempt + 1, delay)
                await anyio.sleep(delay)
            except Exception as exc:
                job.resolver.fail(self._failures.add(dst, exc))
                return
        if self.unavailable is not None:
            self.unavailable = None
            logger.warning("the remote tier is available again: %s uploaded", dst)
        total = time.perf_counter() - job.t0
        job.resolver.finish(SaveStats(dst, times.bytes, 0.0, 0.0, times.write_s, times.fsync_s, total))

    def abandon(self, why: str, cause: BaseException | None = None) -> list[str]:
        """End every upload still pending, failed: each handle raises the last error of
        its copy (else ``cause``, else a RemoteStorageError saying ``why``) with a note
        saying so; one failure is reported for them all. Their files stay on the local
        tier (the next open uploads the newest). The paths of those abandoned."""
        jobs = [*([self._running] if self._running else []), *self._queue]
        self._queue.clear()
        jobs = [j for j in jobs if not j.handle.done()]
        if not jobs:
            return []
        paths = [j.handle.path for j in jobs]
        first = jobs[0]
        error = first.error if first.error is not None else cause
        if error is None:
            error = RemoteStorageError(f"{len(jobs)} upload(s) did not finish: {why}")
        error.add_note(
            f"aiosnap: {len(jobs)} upload(s) did not finish ({why}): {', '.join(paths)}; their "
            "checkpoints stay on the local tier, and the next open uploads the newest"
        )
        reported = self._failures.add(first.handle.path, error)
        first.resolver.fail(reported)
        for job in jobs[1:]:
            job.resolver.fail(SaveFailure(job.handle.path, error, reported=True))
        return paths

    def pending(self) -> int:
        """Uploads queued or running."""
        return len(self._queue) + (self._running is not None)

    def pending_paths(self) -> list[str]:
        """Where the uploads queued or running go."""
        return [j.handle.path for j in (*([self._running] if self._running else []), *self._queue)]

    def report(self, path: str, error: BaseException) -> SaveFailure:
        """Record a failure of an upload of ``path`` that only this writer's owner reports
        (the remote tier's index or retention, a member of a group that failed)."""
        return self._failures.add(path, error)

    async def flush_quietly(self) -> None:
        """Wait until every upload accepted so far has ended, raising nothing."""
        await self._wait()

    async def flush(self) -> None:
        """Wait until every upload accepted so far has ended; raise the first unreported failure."""
        await self._wait()
        raise_first(self._failures.take())

    async def _wait(self) -> None:
        for job in [*([self._running] if self._running else []), *self._queue]:
            await job.handle.outcome()

    async def aclose(self) -> None:
        """Wait for the uploads, raise any unreported failure. Idempotent. The task
        group is exited by ``__aexit__`` (task groups end in the order they began)."""
        if not self._closing():
            return
        try:
            await self._wait()
        finally:
            self._closed()
        raise_first(self._failures.take())

    def take_failures(self) -> list[SaveFailure]:
        return self._failures.take()
