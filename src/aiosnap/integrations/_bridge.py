"""The one bridge from a framework's blocking training loop to aiosnap's async writer.

The frameworks call their checkpoint hooks synchronously, from the training thread.
``SyncWriter`` is a blocking front over an ``aiosnap.QueueWriter`` running in an event
loop of its own: an anyio blocking portal, opened and closed with the object. A
``save`` returns once the state is captured (the writer copied it; training may change
it at once) and the file becomes durable in the background.

What must follow a commit -- renaming a checkpoint directory into place, deleting an
older checkpoint -- is a *step*: a blocking function run in a worker thread of the
portal's loop once the saves it names are durable and every earlier step has run.
Steps run one at a time, in the order they were asked for, so a deletion asked for
after a save never runs before that save is durable; and it does not run at all if one
of the saves since the last deletion failed or was skipped (the old checkpoint is then
the newest good one). A save's own step runs its ``on_failure`` instead (removing a
half-filled temp directory).

Errors surface as aiosnap's writers surface them: a failed save or step is raised, with
its original type, at the next ``save``, at ``flush()`` and at ``close()``, once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager, AsyncExitStack
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ParamSpec, Self, TypeVar, cast

import anyio
import anyio.from_thread
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

import aiosnap
from aiosnap._save.options import QueueOptions

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")
Blocking = Callable[[], object]
"""A step's work: a blocking function, run in a worker thread."""


#: The options an integration passes on to its writer: a QueueWriter's.
_OPTION_NAMES = frozenset(QueueOptions.__annotations__)


#: ``aiosnap.QueueWriter``'s default ``max_pending``.
_MAX_PENDING = 2


def check_options(options: dict[str, Any] | None) -> QueueOptions:
    """``options`` (an integration's ``aiosnap_options``), refused if it names an unknown key."""
    options = dict(options or {})
    unknown = sorted(set(options) - _OPTION_NAMES)
    if unknown:
        raise TypeError(f"unknown aiosnap option(s) {unknown}; the options are {sorted(_OPTION_NAMES)}")
    return cast(QueueOptions, options)


@dataclass(eq=False)
class _Step:
    handles: Sequence[aiosnap.SaveHandle]
    then: Blocking | None = None
    on_failure: Blocking | None = None
    #: A save of this step was refused or raised: wait for every accepted save, then fail.
    incomplete: bool = False
    done: anyio.Event = field(default_factory=anyio.Event)


class _Core:
    """The async half: the writer, and the task that runs the steps in order."""

    def __init__(self, writer: aiosnap.QueueWriter) -> None:
        self.writer = writer
        self._send: MemoryObjectSendStream[_Step]
        self._receive: MemoryObjectReceiveStream[_Step]
        self._send, self._receive = anyio.create_memory_object_stream[_Step](math.inf)
        self._last: _Step | None = None
        #: The saves accepted since the last ``after`` step, which it waits on; the saves
        #: before the next save, so consecutive ``after`` steps wait on the same ones.
        self._window: list[aiosnap.SaveHandle] = []
        self._window_closed = False
        self._window_failed = False  # a save call of the window raised
        self._errors: list[BaseException] = []
        #: Errors already raised to the caller (by the writer's own call): never twice.
        self._raised: list[BaseException] = []
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> Self:
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(self.writer)
            # Entered after the writer, so left before it: the steps finish while it runs.
            tg = await stack.enter_async_context(anyio.create_task_group())
            tg.start_soon(self._run_steps)
            self._stack = stack.pop_all()
        # The first worker-thread hop of a process costs ~0.1 s: paid here, not in a save.
        await anyio.to_thread.run_sync(os.getpid)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self._wait_steps()
        finally:
            self._send.close()
            try:
                await self._stack.aclose()  # the writer's aclose raises what nobody reported
            except Exception as error:
                self._record(error)
        self.report()

    # -- called through the portal --------------------------------------------------------
    async def save(
        self,
        files: Sequence[tuple[str, object]],
        savefun: Callable[[Any, str], object] | None,
        then: Blocking | None,
        on_failure: Blocking | None,
    ) -> list[aiosnap.SaveHandle]:
        """Each ``(path, target)`` of ``files`` saved in turn, and one step for them all."""
        handles: list[aiosnap.SaveHandle] = []
        try:
            for path, target in files:
                directory, name = os.path.split(path)
                handles.append(await self.writer(name, directory, target, savefun=savefun))
        except Exception as exc:
            # The writer reports an earlier save's failure after accepting this one, whose
            # handle is then lost: the step waits for every accepted save instead.
            self._raised.append(exc)
            self._open_window()
            self._window_failed = True
            self._window.extend(handles)
            self.add_step(handles, None, on_failure, incomplete=True)
            raise
        self._open_window()
        self._window.extend(handles)
        self.add_step(handles, then, on_failure)
        self.report()
        return handles

    def _open_window(self) -> None:
        if self._window_closed:
            self._window, self._window_closed, self._window_failed = [], False, False

    def after(self, then: Blocking) -> None:
        self._window_closed = True
        self.add_step(list(self._window), then, _skipped(then), incomplete=self._window_failed)

    def add_step(
        self,
        handles: Sequence[aiosnap.SaveHandle],
        then: Blocking | None,
        on_failure: Blocking | None = None,
        *,
        incomplete: bool = False,
    ) -> None:
        step = _Step(handles, then, on_failure, incomplete)
        self._last = step
        self._send.send_nowait(step)

    async def wait(self, handle: aiosnap.SaveHandle) -> aiosnap.SaveStats:
        try:
            return await handle.wait()
        except Exception as exc:
            self._raised.append(exc)
            raise

    async def flush(self) -> None:
        await self._wait_steps()
        try:
            await self.writer.flush()
        except Exception as exc:
            self._record(exc)
        self.report()

    def report(self) -> None:
        """Raise the oldest failure not reported yet (noting the others)."""
        errors, self._errors = self._errors, []
        if not errors:
            return
        first, rest = errors[0], errors[1:]
        for other in rest:
            logger.error("another background save or step failed too", exc_info=other)
        if rest:
            first.add_note(f"aiosnap: {len(rest)} more background save(s) or step(s) failed; see the log")
        self._raised.append(first)
        raise first

    # -- the steps --------------------------------------------------------------------------
    async def _wait_steps(self) -> None:
        if self._last is not None:
            await self._last.done.wait()

    async def _run_steps(self) -> None:
        async with self._receive:
            async for step in self._receive:
                try:
                    await self._run(step)
                finally:
                    step.done.set()

    async def _run(self, step: _Step) -> None:
        ok = not step.incomplete
        for handle in step.handles:
            try:
                stats = await handle.wait()
            except Exception as exc:
                self._record(exc)
                ok = False
            else:
                ok = ok and not stats.skipped  # a skipped save wrote nothing
        if step.incomplete:
            try:
                await self.writer.flush()  # every accepted save, the lost one included
            except Exception as exc:
                self._record(exc)
        work = step.then if ok else step.on_failure
        if work is not None:
            try:
                await anyio.to_thread.run_sync(work)
            except Exception as exc:
                self._record(exc)

    def _record(self, exc: BaseException) -> None:
        if any(exc is raised for raised in self._raised):
            return
        if not any(exc is known for known in self._errors):
            self._errors.append(exc)


def _skipped(then: Blocking) -> Blocking:
    def log() -> None:
        logger.warning("skipped %s: a save before it failed or was skipped", getattr(then, "__name__", then))

    return log


class _Running:
    """A started portal and the core entered in it; closed once."""

    def __init__(self, options: QueueOptions, files_per_save: int) -> None:
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        self._loop = self.portal.call(asyncio.get_running_loop)
        try:
            # The queue holds files: room for max_pending saves of files_per_save files each.
            scaled = QueueOptions(**options)
            scaled["max_pending"] = options.get("max_pending", _MAX_PENDING) * files_per_save
            self.core = _Core(aiosnap.QueueWriter(**scaled))
            self._core_cm: AbstractContextManager[_Core] = self.portal.wrap_async_context_manager(self.core)
            self._core_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._core_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)
            _join_workers(self._loop)

    def close_quietly(self) -> None:
        """At interpreter exit or garbage collection: drain, and log what failed."""
        try:
            self.close()
        except Exception:
            logger.exception("a background checkpoint save failed (found while closing at exit)")


def _join_workers(loop: asyncio.AbstractEventLoop) -> None:
    """Wait for anyio's worker threads of ``loop``: they were told to stop when it ended,
    and would otherwise outlive ``close()`` for a moment (Lightning's tests flag any
    thread left after a test). None is busy: the core waited for every save and step."""
    for thread in threading.enumerate():
        if getattr(thread, "loop", None) is loop and thread is not threading.current_thread():
            thread.join()


class SyncWriter:
    """A blocking front over an ``aiosnap.QueueWriter`` (see the module docstring).

    Opens on first use (or ``open()``/``with``); ``close()`` waits for every save and
    step, raises a failure not reported yet, and stops the portal. A closed writer opens
    again on its next use, so a framework may tear it down between two runs.
    """

    def __init__(self, **options: Any) -> None:
        self._options = check_options(options)
        #: How many files each save of a caller writes (``save_files``): the queue, sized
        #: when the writer opens, holds ``max_pending`` such saves.
        self.files_per_save = 1
        self._running: _Running | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._lock = threading.Lock()

    @property
    def allow_pickle(self) -> bool:
        return bool(self._options.get("allow_pickle", False))

    @property
    def is_open(self) -> bool:
        """Whether the loop runs: saves or steps may be in flight."""
        return self._running is not None

    def __getstate__(self) -> dict[str, Any]:
        """A copy (a framework pickles itself to spawned processes) has the options only:
        the loop, its threads and its saves in flight belong to this process."""
        return {"_options": self._options, "files_per_save": self.files_per_save}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._options = check_options(state["_options"])
        self.files_per_save = state.get("files_per_save", 1)
        self._running = None
        self._finalizer = None
        self._lock = threading.Lock()

    def open(self) -> Self:
        self._open()
        return self

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open(self) -> _Running:
        with self._lock:
            if self._running is None:
                running = _Running(self._options, self.files_per_save)
                # Saves accepted but not yet durable are drained at exit (the portal's
                # thread is a daemon: left alone, it would die with them in flight).
                self._finalizer = weakref.finalize(self, running.close_quietly)
                self._running = running
            return self._running

    def close(self) -> None:
        """Wait until every save and step is done; raise the first failure not reported."""
        with self._lock:
            running, self._running = self._running, None
            if self._finalizer is not None:
                self._finalizer.detach()
                self._finalizer = None
        if running is not None:
            running.close()

    def _call(self, fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        running = self._open()
        return running.portal.call(functools.partial(fn, *args, **kwargs))

    def save(
        self,
        path: str,
        target: object,
        *,
        savefun: Callable[[Any, str], object] | None = None,
        then: Blocking | None = None,
        on_failure: Blocking | None = None,
    ) -> aiosnap.SaveHandle:
        """Save ``target`` to ``path``; return once it is captured. ``then`` runs once the
        file is durable (after every earlier step), ``on_failure`` if it failed or was
        skipped. Raises an earlier failure not reported yet, after accepting this save."""
        return self.save_files([(path, target)], savefun=savefun, then=then, on_failure=on_failure)[0]

    def save_files(
        self,
        files: Sequence[tuple[str, object]],
        *,
        savefun: Callable[[Any, str], object] | None = None,
        then: Blocking | None = None,
        on_failure: Blocking | None = None,
    ) -> list[aiosnap.SaveHandle]:
        """``save`` of several files, ``(path, target)`` each, in order: ``then`` runs once
        every one of them is durable, ``on_failure`` (once) if any failed or was skipped,
        or if a later one of them was refused (the others accepted are waited for first)."""
        return self._call(self._open().core.save, files, savefun, then, on_failure)

    def after(self, then: Blocking) -> None:
        """Run ``then`` once every save accepted so far is durable and every earlier step
        ran; not at all if a save accepted since the last ``after`` failed or was skipped
        (a deletion must not take the newest good checkpoint)."""
        running = self._open()
        running.portal.call(running.core.after, then)

    def wait(self, handle: aiosnap.SaveHandle) -> aiosnap.SaveStats:
        """Block until the save of ``handle`` is durable; raise its failure."""
        return self._call(self._open().core.wait, handle)

    def flush(self) -> None:
        """Block until every save and step so far is done; raise the first failure not
        reported yet, with its original type."""
        if self._running is not None:
            self._call(self._running.core.flush)


def run_sync(fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run an aiosnap coroutine function from blocking code, where no writer is open:
    in a loop of its own if this thread runs none, else through a short-lived portal."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return anyio.run(functools.partial(fn, *args, **kwargs))
    with anyio.from_thread.start_blocking_portal() as portal:
        return portal.call(functools.partial(fn, *args, **kwargs))
