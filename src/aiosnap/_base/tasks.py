"""The task group an object with background tasks owns.

Writers, the uploader, the manager and the AsyncLoader each run background tasks in a
task group of their own, entered when they open (``async with``) and exited when they
close. The two rules every one of them must keep live here, once:

- task groups are exited the last entered first, each in the cancel scope it was entered
  in: never inside a shielding scope opened after it (anyio raises);
- exiting is done once, whatever path closes the object (a clean close, a failed open,
  a cancelled close), and a task group that may still run forever (a consumer waiting
  for work, a lease's renewal) is cancelled first.
"""

from __future__ import annotations

import anyio
import anyio.abc


class TaskGroupOwner:
    """Mixin: ``_open_tasks()`` enters the object's task group, ``_close_tasks()`` exits it."""

    _owned_tasks: anyio.abc.TaskGroup | None = None

    @property
    def _tasks(self) -> anyio.abc.TaskGroup:
        """The task group background tasks are started in (``_open_tasks`` first)."""
        assert self._owned_tasks is not None, f"{type(self).__name__} is not open"
        return self._owned_tasks

    @property
    def _tasks_open(self) -> bool:
        return self._owned_tasks is not None

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
