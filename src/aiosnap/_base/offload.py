"""The only door from the event loop to blocking work.

Every file operation, copy, checksum and pickle of aiosnap goes through here, with an
explicit capacity limiter per kind of work, so that the loop keeps serving other tasks
(data loading, the training step) while checkpoints are staged and written.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import queue
import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread
from anyio.lowlevel import RunVar

from .errors import RemoteStorageError
from .notice import notice

logger = logging.getLogger(__name__)

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")

#: Bulk writes and fsyncs: the disk is the bottleneck, a few threads keep it busy.
IO_THREADS = 4
#: Copies, checksums, pickling: bounded by the cores (2 on the reference machine).
CPU_THREADS = 2
#: Pipelined commits: each waits on its own staging thread most of the time, so they
#: must not hold the threads of other file I/O meanwhile.
COMMIT_THREADS = 4
#: Messages between ranks: each waits on the network, never on the disk or a core, and
#: must not queue behind bulk I/O (a rank that waits too long is reported as failed).
COORD_THREADS = 4
#: Waits of files moving between ranks (``_dist/peers``): each may last a deadline, several
#: at once; on the coordination threads they would hold up votes (a late rank is failed).
PEER_THREADS = 4
#: Calls to a remote tier (``remote_io``): they wait on the network, and must never hold
#: the threads of the local disk (a remote tier that is down would stall local saves).
REMOTE_THREADS = 8

#: Limiters belong to one event loop: one set per running loop (anyio forgets a loop's
#: set when the loop is gone).
_limiters: RunVar[dict[str, anyio.CapacityLimiter]] = RunVar("aiosnap_limiters")


def _limiter(kind: str) -> anyio.CapacityLimiter:
    per_loop = _limiters.get(None)
    if per_loop is None:
        per_loop = {
            "io": anyio.CapacityLimiter(IO_THREADS),
            "cpu": anyio.CapacityLimiter(CPU_THREADS),
            "coord": anyio.CapacityLimiter(COORD_THREADS),
            "peer": anyio.CapacityLimiter(PEER_THREADS),
            "commit": anyio.CapacityLimiter(COMMIT_THREADS),
            "remote": anyio.CapacityLimiter(REMOTE_THREADS),
        }
        _limiters.set(per_loop)
    return per_loop[kind]


async def run_io(fn: Callable[..., T], *args: object) -> T:
    """Run blocking file I/O in a worker thread. Inside ``remote_io()``, the call has
    threads of its own, and a cancelled caller abandons it to them."""
    remote = _remote.get()
    if remote is not None:
        return await _remote_call(remote, fn, *args)
    return await anyio.to_thread.run_sync(_unpinned, fn, *args, limiter=_limiter("io"))


#: A remote call that has not answered after this many seconds is told to the user.
SLOW_REMOTE = 5.0
#: How a user sets an object store's retry deadline, from Python.
DEADLINE_KNOB = "aiosnap.storage.from_url(url, deadline=...)"


@dataclass(frozen=True, slots=True)
class Remote:
    """What the calls inside ``remote_io`` are for, as the user would say it.

    Attributes:
        doing: What the user asked for, in words ("listing s3://bucket/run"); the
            notices and errors of its calls name it.
        limit: Seconds a call may go unanswered before it is abandoned and fails with
            RemoteStorageError (None: as long as the store keeps retrying).
        knob: How the user sets how long calls wait (an option, a parameter).
    """

    doing: str | None = None
    limit: float | None = None
    knob: str = DEADLINE_KNOB


#: Set while calls go to a remote store (``remote_io``): what they are for.
_remote: contextvars.ContextVar[Remote | None] = contextvars.ContextVar("aiosnap_remote_io", default=None)


async def _remote_call(remote: Remote, fn: Callable[..., T], *args: object) -> T:
    outcome: list[T] = []
    error: list[Exception] = []
    context = contextvars.copy_context()  # the pool's threads run the call in the caller's
    async with anyio.create_task_group() as tg:
        tg.start_soon(_watch, remote, fn, args)
        try:
            async with _limiter("remote"):
                with anyio.move_on_after(remote.limit) as waited:
                    future = _remote_pool().submit(context.run, _unpinned, fn, *args)
                    outcome.append(await asyncio.wrap_future(future))
                if waited.cancelled_caught:  # abandoned to its thread, as at a Ctrl-C
                    error.append(_no_answer(remote, fn, args))
        except Exception as exc:  # raised outside the task group, which would wrap it in a group
            error.append(exc)
        finally:
            tg.cancel_scope.cancel()
    if error:
        raise error[0]
    return outcome[0]


def _no_answer(remote: Remote, fn: Callable[..., object], args: tuple[object, ...]) -> Exception:
    error = RemoteStorageError(
        f"{describe_call(remote, fn, args)}: no answer within {remote.limit:g} s; "
        f"check the endpoint and the network ({remote.knob} sets how long to wait)"
    )
    error.permanent = True  # its deadline is spent: trying again is the caller's choice
    return error


class _DaemonPool:
    """Threads for calls to a remote store, which a cancelled caller abandons. They are
    daemon threads: an abandoned call that an object store holds for its whole retry
    deadline must not hold the process at its exit (Ctrl-C) as well; what it was doing
    is left for the next open to sweep."""

    def __init__(self, size: int) -> None:
        self._size, self._started = size, 0
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = (
            queue.SimpleQueue()
        )
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        with self._lock:
            if self._idle == 0 and self._started < self._size:
                self._started += 1
                threading.Thread(target=self._work, name="aiosnap-remote", daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            future, fn, args = self._jobs.get()
            with self._lock:
                self._idle -= 1
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)


_remote_threads: _DaemonPool | None = None


def _remote_pool() -> _DaemonPool:
    global _remote_threads
    with _side_lock:
        if _remote_threads is None:
            _remote_threads = _DaemonPool(REMOTE_THREADS)
        return _remote_threads


async def _watch(remote: Remote, fn: Callable[..., object], args: tuple[object, ...]) -> None:
    await anyio.sleep(SLOW_REMOTE)
    notice(
        logger,
        f"{describe_call(remote, fn, args)}: no answer for {SLOW_REMOTE:g} s; a remote store is retried "
        f"until its deadline ({remote.knob} sets it), then fails; Ctrl-C stops waiting",
    )


#: The calls to a storage and a lease, in words (what a notice or an error says).
_VERBS = {
    "stat": "looking up",
    "list": "listing",
    "open_read": "opening",
    "read_versioned": "reading",
    "replace_if": "writing",
    "create": "uploading",
    "delete": "deleting",
    "delete_tree": "deleting",
    "sweep_incomplete": "sweeping unfinished uploads under",
    "lease": "taking the lease of",
    "take": "taking the lease of",
    "renew": "renewing the lease",
    "release": "releasing the lease",
}


def describe_call(remote: Remote, fn: Callable[..., object], args: tuple[object, ...]) -> str:
    """A remote call as the user knows it: what they asked for and the URL or path the
    call reaches, never the name of a function of aiosnap's."""
    where = next((a for a in args if isinstance(a, str) and a), None)
    owner_path = getattr(getattr(fn, "__self__", None), "path", None)
    if where is None and isinstance(owner_path, str):
        where = owner_path  # a lease: its lock object
    name = getattr(fn, "__name__", "")
    verb = _VERBS.get(name)
    call = f"{verb} {where}" if verb and where else f"a call to {where}" if where else "a remote call"
    if remote.doing is None:
        return call
    return remote.doing if where is not None and remote.doing.endswith(where) else f"{remote.doing} ({call})"


@contextlib.contextmanager
def remote_io(
    doing: str | None = None, *, limit: float | None = None, knob: str | None = None
) -> Iterator[None]:
    """Within (and in tasks started within): ``run_io`` calls go to a remote store. An
    object store that does not answer retries for up to its deadline in one call; a
    caller cancelled meanwhile (Ctrl-C, a timeout) leaves at once, abandoning the
    thread, which ends on its own. What such a call was doing is left for the next
    open to sweep (an upload never completed is never visible).

    ``doing`` says what the calls are for, in words, for the notice of a call held up
    and its error; ``limit`` abandons a call unanswered for that many seconds with
    RemoteStorageError; ``knob`` says how the user sets that. Unset, each is the
    enclosing block's."""
    outer = _remote.get() or Remote()
    token = _remote.set(
        Remote(
            outer.doing if doing is None else doing,
            outer.limit if limit is None else limit,
            outer.knob if knob is None else knob,
        )
    )
    try:
        yield
    finally:
        _remote.reset(token)


async def run_cpu(fn: Callable[..., T], *args: object) -> T:
    """Run a blocking copy, checksum or (un)pickle in a worker thread."""
    return await anyio.to_thread.run_sync(_unpinned, fn, *args, limiter=_limiter("cpu"))


async def run_commit(fn: Callable[..., T], *args: object) -> T:
    """Run a pipelined commit, which waits for its staging, in a worker thread."""
    return await anyio.to_thread.run_sync(_unpinned, fn, *args, limiter=_limiter("commit"))


def _unpinned(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``, its failure raised with the local variables of its traceback's
    frames cleared. An idle anyio worker thread holds its last job, and so that job's
    exception and every frame the exception went through, until it takes another job:
    a failed load of a 62 MB header kept two copies of it alive, per thread."""
    try:
        return fn(*args)
    except BaseException as exc:
        _clear_frames(exc)
        raise


def _clear_frames(exc: BaseException) -> None:
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # skips the frames still running
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]


def from_loop(fn: Callable[..., T], *args: object) -> T:
    """From a worker thread of ``run_*``: run ``fn`` on the event loop and return its
    result (a decision only the loop can take, such as starting a task)."""
    return anyio.from_thread.run_sync(fn, *args)


async def run_coord(fn: Callable[..., T], *args: object) -> T:
    """Run a blocking exchange with other ranks in a worker thread. Every such call has
    its own deadline; a cancelled caller abandons the thread to it."""
    return await anyio.to_thread.run_sync(
        _unpinned, fn, *args, limiter=_limiter("coord"), abandon_on_cancel=True
    )


async def run_peer(fn: Callable[..., T], *args: object) -> T:
    """``run_coord`` for the waits of files moving between ranks (``PEER_THREADS``)."""
    return await anyio.to_thread.run_sync(
        _unpinned, fn, *args, limiter=_limiter("peer"), abandon_on_cancel=True
    )


#: Helper threads beside worker threads (``side_thread``): one core's worth each.
SIDE_THREADS = CPU_THREADS
_side_slots = threading.BoundedSemaphore(SIDE_THREADS)
_side_lock = threading.Lock()
_side_pool: ThreadPoolExecutor | None = None


def _side_executor() -> ThreadPoolExecutor:
    """The process's helper threads: started at first use, then kept. Started per load
    or save, each cost ~100 us; and under an address-space limit (RLIMIT_AS) a new thread
    that fails to allocate as it starts leaves ``Thread.start()`` waiting for it forever
    (CPython 3.11): that hung a load in a fuzzing run."""
    global _side_pool
    with _side_lock:
        if _side_pool is None:
            _side_pool = ThreadPoolExecutor(SIDE_THREADS, thread_name_prefix="aiosnap-side")
        return _side_pool


def _forget_side_threads() -> None:
    # A forked child has none of its parent's threads: a job given to them never runs.
    global _side_pool, _side_lock, _side_slots, _remote_threads
    _side_pool, _side_lock, _remote_threads = None, threading.Lock(), None
    _side_slots = threading.BoundedSemaphore(SIDE_THREADS)


os.register_at_fork(after_in_child=_forget_side_threads)


class Side:
    """One job at a time on a helper thread, beside the worker thread that submits it;
    inline, at ``submit``, when no helper was free."""

    def __init__(self, executor: ThreadPoolExecutor | None) -> None:
        self._executor = executor
        self._job: Future[None] | None = None

    def submit(self, fn: Callable[..., None], *args: object) -> None:
        """Start ``fn(*args)``; ``wait`` for the previous job first."""
        assert self._job is None, "wait() for the previous job first"
        if self._executor is None:
            fn(*args)
        else:
            self._job = self._executor.submit(fn, *args)

    def wait(self) -> None:
        """Wait for the job submitted last; raise what it raised."""
        job, self._job = self._job, None
        if job is not None:
            job.result()


@contextlib.contextmanager
def side_thread() -> Iterator[Side]:
    """A helper thread for a worker thread's side work (half of a large copy, page
    population and checksums beside a read, on the other core), its job waited for
    before the block ends. At most SIDE_THREADS at once in the process, so a job never
    queues behind another; beyond that the work runs inline."""
    slots = _side_slots
    if not slots.acquire(blocking=False):
        yield Side(None)
        return
    try:
        side = Side(_side_executor())
        try:
            yield side
        finally:
            with contextlib.suppress(BaseException):
                side.wait()  # the job's own error is not the one to raise here
    finally:
        slots.release()


async def warm() -> None:
    """Pay the one-time costs (backend import, first thread) before the first save."""
    async with anyio.create_task_group():
        pass
    await run_io(int)
    await run_cpu(int)
