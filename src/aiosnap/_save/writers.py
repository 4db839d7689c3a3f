"""The writers: when capture, stage and commit run, and who waits for what.

Every save runs in a task of the writer's own task group: capture (copy into an
arena, in a worker thread) and then commit (engine). The caller awaits only the
capture, through an event, so plain-asyncio cancellation of the caller can never
interrupt a copy or a commit half-way: a save cancelled before its capture finished
is dropped whole; after it, it commits whole.

A save whose commit can start at once -- no earlier save ahead of it, a commit in a
thread, no ``savefun`` -- is *pipelined* (``_pipeline``): its commit is handed the
arena as soon as the image is laid out, and writes the first pieces while later ones
are still being copied. The commit then owns the end of the save: it settles it,
also when the capture fails (the caller gets that error, the writer reports nothing).

A *lazy* save (``capture="lazy"``) releases its caller once the tree is walked: the
staging thread goes on copying the tensors, with no help from the event loop, which a
synchronous training step holds until the next save; a ``Guard`` holds the step of
the optimizers in the state until the copies are done. A copy that fails after the
call returned is a background failure, reported as a failed commit is.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, Self, Unpack, final

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._base import offload as _offload
from .._base.errors import SaveCancelledError, WriterClosedError
from .._base.names import check_component
from .._base.tasks import Failures, SaveFailure, TaskGroupOwner, raise_first
from .._format.header import seal
from .._format.plans import Plan, PlanCache
from .._storage.backends import resolve
from .._storage.protocol import CommitTimes, Storage
from .arena import Arena, ArenaPool
from .device import DeviceCopier, default_copier
from .engine import Engine, ProcessEngine, SaveFun, ThreadEngine
from .guard import Guard
from .handle import Capture, Resolver, SaveHandle, SaveStats
from .incremental import Dedup, Known, commit_incremental
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
from .pipeline import CaptureEnded, Pipe, commit_pipelined
from .stage import GAVE_UP, Lazy, StagedImage, StageRequest, stage_or_plan, write_in_pieces
from .window import Window, take_off_finished
from .window import warm as warm_window

logger = logging.getLogger(__name__)

_After = Callable[["_Save"], Coroutine[Any, Any, None]]
"""What follows a save's capture: its commit, or its place in a queue."""
PostSaveHook = Callable[[SaveStats], object] | Callable[[SaveStats], Awaitable[object]]


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


@dataclass(eq=False, slots=True)
class _Save:
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

    @property
    def handle(self) -> SaveHandle:
        return self.resolver.handle


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
        #: Incremental saves' options and what they stored (None: full saves).
        self._dedup = None if options is None else Dedup.of(options)
        self._known = Known()
        self.offload = offload
        self._storage = storage
        self._engine: Engine = ProcessEngine() if offload == "process" else ThreadEngine()
        self._pool = ArenaPool(
            shared=self._engine.shared, keep=self._arenas_kept, budget=max_host_bytes, on_free=self._unpin
        )
        self._allow_pickle = allow_pickle
        self._pipeline = pipeline
        self._inflight: set[_Save] = set()
        self._failures = Failures()
        self._hooks: list[PostSaveHook] = []
        self._capture_lock = anyio.Lock()
        self._plans = PlanCache()  # used under the capture lock
        self._copier = (
            device_copier if device_copier is not None else default_copier(device_staging=device_staging)
        )
        self.capture: CaptureMode = capture

    # -- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        self._opening("a writer can be opened only once")
        try:
            tg = await self._open_tasks()
            await self._engine.start()
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
            await self._engine.aclose()
            # Unmapping hundreds of MiB takes ~100 ms: not on the event loop.
            with anyio.CancelScope(shield=True):
                await _offload.run_io(self._pool.close)
                await _offload.run_cpu(self._plans.clear)
            self._closed()
        raise_first(self._failures.take())

    async def flush(self) -> None:
        """Wait until every save accepted so far is durable; raise the first failure not
        reported yet (with a note naming any others)."""
        await self._wait_inflight()
        raise_first(self._failures.take())

    def take_failures(self) -> list[SaveFailure]:
        """The failed saves not reported yet, oldest first; from now on they count as
        reported, so no later call, ``flush`` or ``aclose`` raises them."""
        return self._failures.take()

    def add_post_save_hook(self, hook: PostSaveHook) -> None:
        """Call ``hook(stats)`` after each commit (async hooks are awaited, sync ones run
        in a worker thread). A failing hook fails its save's handle."""
        self._hooks.append(hook)

    def staging_memory(self) -> StagingMemory:
        """The host memory staging holds now (arenas of saves in flight, and those kept
        for the next saves), and how many captures wait for some to be released."""
        in_use, kept, kept_bytes, waiting = self._pool.usage()
        return StagingMemory(in_use, kept, kept_bytes, waiting)

    @property
    def incremental(self) -> bool:
        """Whether saves store their large entries as shared blobs (``incremental=``)."""
        return self._dedup is not None

    def keep_blobs_by_rank(self, rank_dir: str) -> None:
        """Saves whose files lie in step directories (``step/rank file``): keep their blobs
        in ``aiosnap-blobs/<rank_dir>`` beside the step directories, one folder that all of
        this rank's steps share and that this rank alone writes and collects (the
        CheckpointManager calls this for its step directories). A writer that is not
        incremental ignores it."""
        check_component(rank_dir, "rank_dir")
        if self._dedup is not None:
            self._dedup = dataclasses.replace(self._dedup, rank_dir=rank_dir)

    @property
    def worker_pid(self) -> int | None:
        """The process id of the offload worker (``offload="process"``, while open)."""
        return self._engine.pid

    def _unpin(self, array: object) -> None:
        if self._copier is not None:
            self._copier.unpin(array)

    def _on_open(self, tg: anyio.abc.TaskGroup) -> None:
        """Start the writer's own background tasks."""

    async def _drain(self) -> None:
        await self._wait_inflight()

    async def _wait_inflight(self) -> None:
        for save in list(self._inflight):
            await save.handle.outcome()

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
        if out_dir:
            check_component(filename, "filename")
            storage, directory = resolve(out_dir, self._storage)
            path = storage.join(directory, filename)
        else:
            storage, path = resolve(filename, self._storage)
            check_component(storage.split(path)[1], "the file name of")

        def abandon() -> None:
            # A caller that stops waiting before the capture ended may be changing the state.
            save.abandoned = True

        taken = Capture(on_abandon=abandon)
        save = _Save(Resolver(path, taken), storage, target, savefun, t0, taken)
        if mode == "lazy":
            save.guard = Guard(self._copier)
        if self._copier is not None:
            # Current streams are per thread: take the caller's here, on the loop thread.
            save.producers = self._copier.producer_streams()
        return await self._submit(save)

    @abc.abstractmethod
    async def _submit(self, save: _Save) -> SaveHandle:
        """Admit the save and start it (``_start``, with no await after it: the caller
        must get the handle of every save that started); return its handle."""

    def _start(self, save: _Save, after: _After) -> None:
        self._inflight.add(save)
        self._tasks.start_soon(self._capture_then, save, after)

    async def _capture_then(self, save: _Save, after: _After) -> None:
        begin = lazy = None
        if self._pipeline and not self._engine.shared and save.savefun is None and self._dedup is None:
            begin = functools.partial(_offload.from_loop, self._begin_pipeline, save, after)
        if save.guard is not None:
            lazy = Lazy(functools.partial(_offload.from_loop, self._walked, save), save.guard)
        request = StageRequest(
            allow_pickle=self._allow_pickle or save.savefun is not None,
            pool=self._pool,
            copier=self._copier,
            producers=save.producers,
            keep_tree=save.savefun is not None,
            begin=begin,
            plans=self._plans,
            stop=functools.partial(getattr, save, "abandoned"),
            lazy=lazy,
        )
        try:
            async with self._capture_lock:
                staged = await _offload.run_cpu(stage_or_plan, save.target, request)
                if isinstance(staged, Plan):
                    save.stats = await self._commit_in_pieces(save, staged)
                else:
                    save.staged, save.arena = staged, staged.arena
        except BaseException as exc:
            save.capture_error = exc
            if not isinstance(exc, Exception):
                if save.pipe is not None:
                    save.pipe.fail()  # its commit settles the save
                else:
                    self._drop(save, WriterClosedError("the writer closed during a capture"))
                raise
        finally:
            save.target = None
            if not save.walked:
                save.stall_s = time.perf_counter() - save.t0  # the caller's own figure replaces it
            save.capture.set(save.capture_error, self._late_failure(save))
        if save.pipe is not None:
            await self._seal(save, save.pipe)
            return
        if save.capture_error is not None or save.abandoned:
            self._drop(save, self._capture_failure(save))
            return
        if save.stats is not None:  # written in pieces during the capture: nothing follows
            self._settle(save, None, save.stats)
            self._dropped(save)
            return
        await after(save)

    def _walked(self, save: _Save, optimizers: list[Any], window: Window) -> None:
        """On the loop, asked by a lazy capture's staging thread: the tree is walked and
        the arena taken; guard the optimizers, open the copy-on-write window on the loop's
        thread, and let the caller return."""
        if save.abandoned:
            raise SaveCancelledError(GAVE_UP)
        assert save.guard is not None
        save.guard.arm(optimizers)
        window.put_on()
        save.walked = True
        save.stall_s = time.perf_counter() - save.t0
        save.capture.walked()

    def _late_failure(self, save: _Save) -> SaveFailure | None:
        """A lazy capture that failed after its call returned: its caller has not seen the
        error, so it is reported as a background failure (the next call, flush, aclose)."""
        error = save.capture_error
        if save.walked and isinstance(error, Exception) and not save.abandoned and save.failure is None:
            logger.warning("the background copy of %s failed: %r", save.handle.path, error)
            save.failure = self._failures.add(save.handle.path, error)
        return save.failure

    def _begin_pipeline(self, save: _Save, after: _After, pipe: Pipe) -> bool:
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

    def _hand_over(self, save: _Save, after: _After) -> None:
        self._tasks.start_soon(after, save)

    async def _seal(self, save: _Save, pipe: Pipe) -> None:
        """After a pipelined capture: checksum the staged entries and write the header
        into the arena while the commit writes the data, or make the commit abort."""
        staged = save.staged
        if staged is not None and staged.sealed:
            return  # by a lazy capture's staging thread
        if save.capture_error is not None or save.abandoned or staged is None:
            pipe.fail()
            return
        try:
            await _offload.run_cpu(seal, staged.image(), staged.template, staged.spans)
        except BaseException:
            pipe.fail()
            raise
        pipe.seal()

    def _capture_failure(self, save: _Save) -> SaveFailure | BaseException:
        """What a save whose capture did not complete ends with."""
        if save.failure is not None:
            return save.failure
        error = save.capture_error
        if isinstance(error, Exception):
            return error
        if save.abandoned:
            return SaveCancelledError("the caller gave the save up before its capture ended")
        return WriterClosedError("the writer closed during a capture")

    async def _commit_in_pieces(self, save: _Save, layout: Plan) -> SaveStats:
        """A state larger than ``max_host_bytes``: staged and written through a buffer of
        that size before the call returns (slower, but bounded). A caller cancelled
        meanwhile stops it between two pieces, and nothing is committed."""
        budget = self._pool.budget
        assert budget is not None
        storage, path = save.storage, save.handle.path

        def commit() -> CommitTimes:
            upload = storage.create(path, layout.size)
            try:
                write_in_pieces(layout, upload, budget, lambda: save.abandoned)
                return upload.commit()
            except BaseException:
                upload.abort()
                raise

        times = await _offload.run_io(commit)
        total = time.perf_counter() - save.t0
        stats = SaveStats(path, times.bytes, total, 0.0, times.write_s, times.fsync_s, total)
        await self._run_hooks(stats)
        return stats

    async def _run_hooks(self, stats: SaveStats) -> None:
        for hook in self._hooks:
            await _call_hook(hook, stats)

    def _drop(self, save: _Save, error: SaveFailure | BaseException) -> None:
        self._settle(save, error)
        self._dropped(save)

    def _dropped(self, save: _Save) -> None:
        """A save ended before it was handed on (capture failed or was abandoned)."""

    async def _commit(self, save: _Save) -> None:
        try:
            if save.pipe is not None:
                try:
                    times = await _offload.run_commit(
                        commit_pipelined, save.storage, save.handle.path, save.pipe
                    )
                except BaseException:
                    if not save.pipe.is_started:  # cancelled before its thread ran
                        save.pipe.fail()
                    raise
                # A lazy capture's staging thread seals the pipe itself: the commit may end
                # before the loop has taken the capture's result (save.staged).
                await save.capture.ended()
            elif self._dedup is not None and save.savefun is None:
                assert save.staged is not None
                # In a thread of this process whatever the engine: the arena is shared.
                times = await _offload.run_io(
                    commit_incremental, save.storage, save.handle.path, save.staged, self._dedup, self._known
                )
            else:
                assert save.staged is not None
                times = await self._engine.commit(save.storage, save.handle.path, save.staged, save.savefun)
            assert save.staged is not None
            returned = save.capture.returned_at
            stats = SaveStats(
                save.handle.path,
                times.bytes,
                save.stall_s if returned is None else returned - save.t0,
                save.staged.stage_s,
                times.write_s,
                times.fsync_s,
                time.perf_counter() - save.t0,
            )
            await self._run_hooks(stats)
        except Exception as exc:
            captured = not (isinstance(exc, CaptureEnded) or save.capture_error is not None or save.abandoned)
            if save.pipe is not None and not captured:
                # The capture failed: its caller has the error (a lazy capture's is reported
                # as a background failure). A lazy capture fails its pipe from its staging
                # thread: its error may not be recorded yet.
                await save.capture.ended()
                self._settle(save, self._capture_failure(save))
                return
            logger.warning("background save of %s failed: %r", save.handle.path, exc)
            self._settle(save, self._failures.add(save.handle.path, exc))
        except BaseException:
            self._settle(save, WriterClosedError("the writer closed during a commit"))
            raise
        else:
            self._settle(save, None, stats)

    def _settle(
        self, save: _Save, error: SaveFailure | BaseException | None, stats: SaveStats | None = None
    ) -> None:
        arena, save.arena, save.staged = save.arena, None, None
        if arena is not None:
            self._pool.release(arena)
        if save.guard is not None:
            save.guard.release()  # also where the staging thread never ran
        self._inflight.discard(save)
        if save.handle.done():
            return
        if stats is not None:
            logger.info(
                "saved %s: %d bytes, caller stalled %.1f ms, durable after %.1f ms",
                stats.path,
                stats.bytes,
                stats.stall_s * 1e3,
                stats.total_s * 1e3,
            )
            save.resolver.finish(stats)
        elif error is not None:
            save.resolver.fail(error)
        else:
            save.resolver.skip()


@final
@dataclass(frozen=True, slots=True)
class StagingMemory:
    """A writer's staging memory at one moment (``staging_memory()``): bytes of arenas
    held by saves in flight, arenas kept for the next saves and their bytes, and
    captures waiting for memory (``max_host_bytes``)."""

    in_use: int
    kept: int
    kept_bytes: int
    waiting: int


async def _call_hook(hook: PostSaveHook, stats: SaveStats) -> None:
    if inspect.iscoroutinefunction(hook) or inspect.iscoroutinefunction(
        getattr(hook, "__call__", None)  # noqa: B004 - async callable objects
    ):
        await hook(stats)  # type: ignore[misc]
        return
    result = await _offload.run_io(hook, stats)
    if inspect.isawaitable(result):
        await result


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

    async def _submit(self, save: _Save) -> SaveHandle:
        self._start(save, self._commit)
        return save.handle


class StandardWriter(_WriterBase):
    """One save in flight: a call first waits for the previous save to be durable."""

    def __init__(self, *, offload: Offload = "thread", **options: Unpack[WriterOptions]) -> None:
        super().__init__(offload=offload, **options)
        self._last: _Save | None = None
        self._turn = anyio.Lock()

    async def _submit(self, save: _Save) -> SaveHandle:
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
        self._slots = anyio.Semaphore(max_pending)
        self._send: MemoryObjectSendStream[_Save]
        self._receive: MemoryObjectReceiveStream[_Save]
        self._send, self._receive = anyio.create_memory_object_stream[_Save](max_pending)

    def _on_open(self, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self._consume)

    async def _consume(self) -> None:
        async with self._receive:
            async for save in self._receive:
                self._slots.release()
                await self._commit(save)

    async def _drain(self) -> None:
        await super()._drain()
        self._send.close()

    async def _submit(self, save: _Save) -> SaveHandle:
        if not await self._take_slot():
            save.resolver.skip()
            return save.handle
        self._start(save, self._enqueue)
        return save.handle

    async def _take_slot(self) -> bool:
        try:
            self._slots.acquire_nowait()
            return True
        except anyio.WouldBlock:
            if self.when_full == "skip":
                return False
        if self.when_full == "replace":
            try:
                oldest = self._receive.receive_nowait()
            except anyio.WouldBlock:
                pass
            else:
                self._settle(oldest, None)  # its slot passes to the new save
                return True
        await self._slots.acquire()
        return True

    async def _enqueue(self, save: _Save) -> None:
        self._send.send_nowait(save)

    def _commit_free(self) -> bool:
        # The consumer waits, so nothing is queued or being committed: a save sent now
        # goes straight to it, and can never be dropped by ``when_full="replace"``.
        queue = self._receive.statistics()
        return queue.tasks_waiting_receive > 0 and queue.current_buffer_used == 0

    def _hand_over(self, save: _Save, after: _After) -> None:
        self._send.send_nowait(save)

    def _dropped(self, save: _Save) -> None:
        self._slots.release()


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
