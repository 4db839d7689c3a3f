"""The writers: when capture, stage and commit run, and who waits for what.

Every save runs in a task of the writer's own task group: capture (copy into an
arena, in a worker thread) and then commit (engine). The caller awaits only the
capture, through an event, so plain-asyncio cancellation of the caller can never
interrupt a copy or a commit half-way: a save cancelled before its capture finished
is dropped whole; after it, it commits whole.

A save is a ``SaveJob`` (``job.py``, which also settles it), captured by the writer's
``Capturer`` (``capture.py``: pipelined and lazy captures) and committed by its
``Committer`` (``commit.py``); each writer class is its admission policy: when a save
may start, and what follows its capture.
"""

from __future__ import annotations

import abc
import functools
import time
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, Protocol, Self, Unpack, final

import anyio
import anyio.abc

from .._base import offload as _offload
from .._base.errors import WriterClosedError
from .._base.names import check_component
from .._base.tasks import Failures, SaveFailure, TaskGroupOwner, raise_first
from .._storage.protocol import Storage
from .arena import ArenaPool, StagingMemory
from .capture import Capturer
from .commit import Committer, Hooks, PostSaveHook
from .device import DeviceCopier, default_copier
from .engine import ProcessEngine, SaveFun, ThreadEngine
from .handle import SaveHandle
from .incremental import Dedup
from .job import Jobs, SaveJob, place
from .options import (
    CaptureMode,
    Incremental,
    Offload,
    WhenFull,
    WriterOptions,
    check_capture,
    check_queue,
    check_writer,
    incremental_of,
)
from .pipeline import Pipe
from .queue import SaveQueue
from .window import take_off_finished
from .window import warm as warm_window

_After = Callable[[SaveJob], Coroutine[Any, Any, None]]
"""What follows a save's capture: its commit, or its place in a queue."""


class Writer(Protocol):
    """What every writer does; user code should depend on this, not a class.

    ``accept`` takes a save and returns its handle before its state is captured; the
    caller then awaits ``handle.wait_captured()``. A CheckpointManager uses it, so that
    its record of a save follows the save's own outcome whatever happens to the call (a
    cancellation included). A writer of one's own may leave it out: the manager then
    calls the writer itself, and a save cancelled right after its capture may commit a
    file that the manager does not record.
    """

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    async def __call__(
        self, filename: str, out_dir: str, target: object, *, savefun: SaveFun | None = None
    ) -> SaveHandle: ...

    async def accept(
        self, filename: str, out_dir: str, target: object, *, savefun: SaveFun | None = None
    ) -> SaveHandle: ...

    async def flush(self) -> None: ...

    async def aclose(self) -> None: ...

    def take_failures(self) -> list[SaveFailure]: ...


class _WriterBase(TaskGroupOwner, abc.ABC):
    """Behaviour shared by all writers; subclasses decide what follows a capture."""

    _arenas_kept = 1
    #: Whether the call returns once the save is durable (a CheckpointManager's save with
    #: it then does too): SimpleWriter's does.
    returns_durable = False

    def __init__(
        self,
        *,
        offload: Offload = "thread",
        storage: Storage | None = None,
        allow_pickle: bool = False,
        max_host_bytes: int | None = None,
        pipeline: bool = True,
        capture: CaptureMode = "eager",
        device_copier: DeviceCopier | None = None,
        device_staging: bool = False,
        incremental: bool | Incremental | None = None,
    ) -> None:
        options = incremental_of(incremental)
        check_writer(
            offload=offload,
            capture=capture,
            max_host_bytes=max_host_bytes,
            device_copier=device_copier,
            device_staging=device_staging,
        )
        self.offload = offload
        self._storage = storage
        engine = ProcessEngine() if offload == "process" else ThreadEngine()
        self._copier = (
            device_copier if device_copier is not None else default_copier(device_staging=device_staging)
        )
        unpin = None if self._copier is None else self._copier.unpin  # an arena's pages, when freed
        self._pool = ArenaPool(
            shared=engine.shared, keep=self._arenas_kept, budget=max_host_bytes, on_free=unpin
        )
        self._pipeline = pipeline
        self._failures = Failures()
        self._hooks = Hooks()
        #: The three pieces of a save: its settling, its capture, its commit.
        self._jobs = Jobs(self._pool)
        self._capturer = Capturer(
            pool=self._pool,
            copier=self._copier,
            allow_pickle=allow_pickle,
            hooks=self._hooks,
            failures=self._failures,
        )
        self._committer = Committer(engine, options, self._hooks, self._failures)
        self.capture: CaptureMode = capture

    # -- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        self._opening("a writer can be opened only once")
        try:
            tg = await self._open_tasks()
            await self._committer.engine.start()
            if self.capture == "lazy":
                await _offload.run_cpu(warm_window)  # not in the first lazy save's stall
            self._on_open(tg)
        except BaseException:
            self._closed()
            await self._close_tasks(cancel=True)
            raise
        self._opened()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # The body's own exception propagates as it is, never wrapped in a group: the
        # task group is exited clean, after aclose() has drained every save.
        try:
            await self.aclose()
        except BaseException as error:
            await self._close_tasks(cancel=not isinstance(error, Exception))
            raise
        await self._close_tasks(cancel=False)

    async def aclose(self) -> None:
        """Wait for every accepted save, stop the workers, raise any unreported failure.

        Idempotent. Cancelling it stops the wait, not the saves that are running.
        """
        if not self._closing():
            return
        try:
            await self._drain()
        finally:
            await self._committer.engine.aclose()
            # Unmapping hundreds of MiB takes ~100 ms: not on the event loop.
            with anyio.CancelScope(shield=True):
                await _offload.run_io(self._pool.close)
                await _offload.run_cpu(self._capturer.plans.clear)
            self._closed()
        raise_first(self._failures.take())

    async def flush(self) -> None:
        """Wait until every save accepted so far is durable; raise the first failure not
        reported yet (with a note naming any others)."""
        await self._jobs.wait()
        raise_first(self._failures.take())

    def take_failures(self) -> list[SaveFailure]:
        """The failed saves not reported yet, oldest first; from now on they count as
        reported, so no later call, ``flush`` or ``aclose`` raises them."""
        return self._failures.take()

    def add_post_save_hook(self, hook: PostSaveHook) -> None:
        """Call ``hook(stats)`` after each commit (async hooks are awaited, sync ones run
        in a worker thread). A failing hook fails its save's handle."""
        self._hooks.add(hook)

    def staging_memory(self) -> StagingMemory:
        """The host memory staging holds now (arenas of saves in flight, and those kept
        for the next saves), and how many captures wait for some to be released."""
        in_use, kept, kept_bytes, waiting = self._pool.usage()
        return StagingMemory(in_use, kept, kept_bytes, waiting)

    @property
    def incremental(self) -> bool:
        """Whether saves store their large entries as shared blobs (``incremental=``)."""
        return self._dedup is not None

    @property
    def _dedup(self) -> Dedup | None:
        """Incremental saves' options (None: full saves)."""
        return self._committer.dedup

    def keep_blobs_by_rank(self, rank_dir: str) -> None:
        """Saves whose files lie in step directories (``step/rank file``): keep their blobs
        in ``aiosnap-blobs/<rank_dir>`` beside the step directories, one folder that all of
        this rank's steps share and that this rank alone writes and collects (the
        CheckpointManager calls this for its step directories). A writer that is not
        incremental ignores it."""
        check_component(rank_dir, "rank_dir")
        self._committer.keep_blobs_by_rank(rank_dir)

    @property
    def worker_pid(self) -> int | None:
        """The process id of the offload worker (``offload="process"``, while open)."""
        return self._committer.engine.pid

    def _on_open(self, tg: anyio.abc.TaskGroup) -> None:
        """Start the writer's own background tasks."""

    async def _drain(self) -> None:
        await self._jobs.wait()

    # -- one save ------------------------------------------------------------------------
    async def __call__(
        self,
        filename: str,
        out_dir: str,
        target: object,
        *,
        savefun: SaveFun | None = None,
        capture: CaptureMode | None = None,
    ) -> SaveHandle:
        """Capture ``target`` now and write it to ``out_dir/filename``.

        ``filename`` is one name inside ``out_dir`` (ValueError for ``"../x"``, ``"/abs"``,
        ``"."`` or a name starting like aiosnap's own files); with ``out_dir=""`` it is
        the whole path.

        Returns once the state is captured: from then on ``target`` may change. The
        capture (the tree walk, ``state_dict()`` calls, tensor copies) runs in a worker
        thread so the event loop keeps serving other tasks; those tasks must not change
        ``target`` while the call is pending. With a
        ``savefun(obj, path)`` (such as ``torch.save``) that function writes the file
        from the captured copy, still through the durable atomic commit; it implies
        ``allow_pickle`` for values that are not state types.

        ``capture="lazy"`` (or the writer's ``capture``) returns once the tree is walked,
        its plain values taken (a list appended to later is saved as it was), and copies
        the tensors in the background: ``optimizer.step()`` of each optimizer in
        ``target`` waits for them, and any other in-place write on the caller's thread
        copies the tensor it writes first (the copy-on-write window, docs/concepts.md);
        a change on another thread fails the save (``CaptureError``) unless it waits for
        ``handle.wait_captured()``. ``capture="eager"`` overrides a lazy default.

        If an earlier background save failed and that was not reported yet, the call
        raises that failure -- after it has accepted its own save, which goes on.
        """
        handle = await self.accept(filename, out_dir, target, savefun=savefun, capture=capture)
        await handle.wait_walked()
        raise_first(self._failures.take(), accepted=handle.path)
        return handle

    async def accept(
        self,
        filename: str,
        out_dir: str,
        target: object,
        *,
        savefun: SaveFun | None = None,
        capture: CaptureMode | None = None,
    ) -> SaveHandle:
        """Take a save, as ``__call__`` does, and return its handle as soon as the writer
        has it (a slot in its queue, its turn), before the state is captured: the caller
        must ``await handle.wait_walked()`` (a lazy save: and let only the guarded step
        change it) or ``handle.wait_captured()`` before it changes ``target``. Earlier
        failures are not raised here (``flush()``, ``take_failures()``)."""
        t0 = time.perf_counter()
        take_off_finished()  # a boundary: the last lazy save's window, if its copies ended
        mode = self.capture if capture is None else check_capture(capture)
        if not self._is_open:
            raise WriterClosedError(
                "the writer is closed"
                if self._lifecycle not in ("new", "opening")
                else "the writer is not open: use `async with writer:` around the saves"
            )
        storage, path = place(filename, out_dir, self._storage)
        return await self._submit(SaveJob.new(storage, path, target, savefun, t0, mode, self._copier))

    @abc.abstractmethod
    async def _submit(self, save: SaveJob) -> SaveHandle:
        """Admit the save and start it (``_start``, with no await after it: the caller
        must get the handle of every save that started); return its handle."""

    def _start(self, save: SaveJob, after: _After) -> None:
        self._jobs.add(save)
        self._tasks.start_soon(self._capture_then, save, after)

    async def _capture_then(self, save: SaveJob, after: _After) -> None:
        begin = None
        if self._pipeline and self._committer.can_pipeline(save):
            begin = functools.partial(_offload.from_loop, self._begin_pipeline, save, after)
        await self._capturer.run(save, begin, self._drop)
        if save.pipe is not None:
            await self._capturer.seal(save, save.pipe)
            return
        if save.capture_error is not None or save.abandoned:
            self._drop(save, save.capture_failure())
            return
        if save.stats is not None:  # written in pieces during the capture: nothing follows
            self._jobs.settle(save, None, save.stats)
            self._dropped(save)
            return
        await after(save)

    def _begin_pipeline(self, save: SaveJob, after: _After, pipe: Pipe) -> bool:
        """On the loop, asked by the staging thread once the arena is taken: start the
        commit now, if nothing is ahead of it. True if it started."""
        if save.abandoned or not self._is_open or not self._commit_free():
            return False
        save.pipe, save.arena = pipe, pipe.arena
        self._hand_over(save, after)
        return True

    def _commit_free(self) -> bool:
        """Whether a save handed over now would be committed at once, behind no other."""
        return True

    def _hand_over(self, save: SaveJob, after: _After) -> None:
        self._tasks.start_soon(after, save)

    def _drop(self, save: SaveJob, error: SaveFailure | BaseException) -> None:
        self._jobs.settle(save, error)
        self._dropped(save)

    def _dropped(self, save: SaveJob) -> None:
        """A save ended before it was handed on (capture failed or was abandoned)."""

    async def _commit(self, save: SaveJob) -> None:
        try:
            stats = await self._committer.commit(save)
        except Exception as exc:
            self._jobs.settle(save, await self._committer.failure(save, exc))
        except BaseException:
            self._jobs.settle(save, WriterClosedError("the writer closed during a commit"))
            raise
        else:
            self._jobs.settle(save, None, stats)


@final
class SimpleWriter(_WriterBase):
    """Persists before returning: the call ends when the file is durable."""

    #: Its call returns once the save is durable (a CheckpointManager's save with it too).
    returns_durable = True

    async def __call__(
        self,
        filename: str,
        out_dir: str,
        target: object,
        *,
        savefun: SaveFun | None = None,
        capture: CaptureMode | None = None,
    ) -> SaveHandle:
        """Capture ``target`` and write it to ``out_dir/filename``; return once the file
        is durable, or raise what failed the save (``capture`` changes nothing here)."""
        handle = await self.accept(filename, out_dir, target, savefun=savefun, capture=capture)
        await handle.wait_walked()
        await handle.wait()  # raised here, to the caller: reported
        return handle

    async def _submit(self, save: SaveJob) -> SaveHandle:
        self._start(save, self._commit)
        return save.handle


class StandardWriter(_WriterBase):
    """One save in flight: a call first waits for the previous save to be durable."""

    def __init__(self, *, offload: Offload = "thread", **options: Unpack[WriterOptions]) -> None:
        super().__init__(offload=offload, **options)
        self._last: SaveJob | None = None
        self._turn = anyio.Lock()

    async def _submit(self, save: SaveJob) -> SaveHandle:
        async with self._turn:
            if self._last is not None:
                await self._last.handle.outcome()
            self._start(save, self._commit)
            self._last = save
        return save.handle


@final
class ThreadWriter(StandardWriter):
    """StandardWriter committing in a worker thread (the seeds' ThreadWriter)."""

    def __init__(self, **options: Unpack[WriterOptions]) -> None:
        super().__init__(offload="thread", **options)


@final
class ProcessWriter(StandardWriter):
    """StandardWriter committing in a worker process (the seeds' ProcessWriter)."""

    def __init__(self, **options: Unpack[WriterOptions]) -> None:
        super().__init__(offload="process", **options)


class QueueWriter(_WriterBase):
    """A bounded queue of captured saves, committed in order by one consumer task.

    ``max_pending`` saves may wait behind the one being committed. When the queue is
    full, ``when_full`` decides: ``"block"`` waits for room, ``"skip"`` drops the new
    save (its handle says skipped), ``"replace"`` drops the oldest waiting save so the
    newest state always gets written. Host memory is bounded by ``max_pending + 1``
    staged images, reused across saves.
    """

    def __init__(
        self,
        *,
        max_pending: int = 2,
        when_full: WhenFull = "block",
        offload: Offload = "thread",
        **options: Unpack[WriterOptions],
    ) -> None:
        check_queue(max_pending, when_full)
        self._arenas_kept = max_pending + 1
        super().__init__(offload=offload, **options)
        self.max_pending = max_pending
        self.when_full = when_full
        self._queue = SaveQueue(max_pending)

    def _on_open(self, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self._queue.consume, self._commit)

    async def _drain(self) -> None:
        await super()._drain()
        self._queue.close()

    async def _submit(self, save: SaveJob) -> SaveHandle:
        if not await self._queue.admit(self.when_full, self._jobs.settle):
            save.resolver.skip()
            return save.handle
        self._start(save, self._enqueue)
        return save.handle

    async def _enqueue(self, save: SaveJob) -> None:
        self._queue.put(save)

    def _commit_free(self) -> bool:
        return self._queue.idle()

    def _hand_over(self, save: SaveJob, after: _After) -> None:
        self._queue.put(save)

    def _dropped(self, save: SaveJob) -> None:
        self._queue.free()


@final
class ThreadQueueWriter(QueueWriter):
    """QueueWriter committing in a worker thread (the seeds' ThreadQueueWriter)."""

    def __init__(
        self, *, max_pending: int = 2, when_full: WhenFull = "block", **options: Unpack[WriterOptions]
    ) -> None:
        super().__init__(max_pending=max_pending, when_full=when_full, offload="thread", **options)


@final
class ProcessQueueWriter(QueueWriter):
    """QueueWriter committing in a worker process (the seeds' ProcessQueueWriter)."""

    def __init__(
        self, *, max_pending: int = 2, when_full: WhenFull = "block", **options: Unpack[WriterOptions]
    ) -> None:
        super().__init__(max_pending=max_pending, when_full=when_full, offload="process", **options)
