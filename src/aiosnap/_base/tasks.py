"""The lifecycle of an object with background tasks: its task group, opened once and closed
once, and the failures of its background work, reported once.

Writers, the uploader, the manager and the AsyncLoader each run background tasks in a
task group of their own, entered when they open (``async with``) and exited when they
close. The rules every one of them must keep live here, once:

- an object is opened once and closed once: ``new`` -> ``opening`` -> ``open`` ->
  ``closing`` -> ``closed`` (a failed open goes straight to ``closed``; closing one that
  never opened closes it for good);
- task groups are exited the last entered first, each in the cancel scope it was entered
  in: never inside a shielding scope opened after it (anyio raises);
- exiting is done once, whatever path closes the object (a clean close, a failed open,
  a cancelled close), and a task group that may still run forever (a consumer waiting
  for work, a lease's renewal) is cancelled first;
- a failure of background work is kept (``Failures``) until it is reported, once: raised
  at the next call, ``flush()`` or the close, or taken with ``take_failures()``. A close
  raises the first thing that went wrong, with a note for each other one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, final

import anyio
import anyio.abc

from .errors import WriterClosedError

logger = logging.getLogger(__name__)

State = Literal["new", "opening", "open", "closing", "closed"]


@final
@dataclass(eq=False, slots=True)
class SaveFailure:
    """A background save that failed: where it was going, and the exception (with its
    original type). ``reported`` once it was raised to the caller or taken."""

    path: str
    error: BaseException
    reported: bool = False


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


def raise_collected(errors: list[Exception], failures: list[SaveFailure]) -> None:
    """What a close raises: the first of ``errors`` (the close's own), noting the others
    and every failure not reported yet; else the first of ``failures``."""
    if not errors:
        raise_first(failures)
        return
    first = errors[0]
    for other in errors[1:]:
        first.add_note(f"aiosnap: closing failed in another way too: {other!r}")
    for failure in failures:
        first.add_note(f"aiosnap: the save of {failure.path} failed too: {failure.error!r}")
    raise first


class TaskGroupOwner:
    """Mixin: the open-once/close-once state machine (``_opening``, ``_opened``,
    ``_closing``, ``_closed``) and the object's task group (``_open_tasks()`` enters it,
    ``_close_tasks()`` exits it)."""

    _owned_tasks: anyio.abc.TaskGroup | None = None
    _lifecycle: State = "new"

    @property
    def _tasks(self) -> anyio.abc.TaskGroup:
        """The task group background tasks are started in (``_open_tasks`` first)."""
        assert self._owned_tasks is not None, f"{type(self).__name__} is not open"
        return self._owned_tasks

    @property
    def _tasks_open(self) -> bool:
        return self._owned_tasks is not None

    @property
    def _is_open(self) -> bool:
        return self._lifecycle == "open"

    def _opening(self, again: str) -> None:
        """Begin to open: once (WriterClosedError saying ``again`` after that)."""
        if self._lifecycle != "new":
            raise WriterClosedError(again)
        self._lifecycle = "opening"

    def _opened(self) -> None:
        self._lifecycle = "open"

    def _closing(self) -> bool:
        """Begin to close: False where there is nothing to close (never opened, or closed
        or closing already); an object that never opened is closed from then on."""
        if self._lifecycle == "open":
            self._lifecycle = "closing"
            return True
        if self._lifecycle == "new":
            self._lifecycle = "closed"
        return False

    def _closed(self) -> None:
        self._lifecycle = "closed"

    async def _open_tasks(self) -> anyio.abc.TaskGroup:
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._owned_tasks = tg
        return tg

    async def _close_tasks(self, *, cancel: bool) -> None:
        """Exit the task group (once; later calls do nothing), after cancelling what still
        runs in it if ``cancel``; else after its tasks end on their own."""
        if self._owned_tasks is None:
            return
        tg, self._owned_tasks = self._owned_tasks, None
        if cancel:
            tg.cancel_scope.cancel()
        await tg.__aexit__(None, None, None)
