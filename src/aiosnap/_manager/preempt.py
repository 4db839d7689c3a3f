"""Saving when things go wrong: on a signal (preemption) and when the training code raises.

A manager's ``save_on_signal`` and ``save_on_error`` are this part's: it saves the state
of the moment over a save of the same step (it is newer), waits for it to be durable (and
on a signal, uploaded, within the deadline), and reports what failed as a failed save is.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import final

import anyio
import anyio.abc

from .._base.tasks import Failures
from .._save.handle import SaveHandle

logger = logging.getLogger(__name__)

StateFn = Callable[[], "tuple[int, object] | Awaitable[tuple[int, object]]"]
#: The manager's save of the moment: (step, state) -> its handle, forced over that step.
SaveNow = Callable[[int, object], Awaitable[SaveHandle]]


@final
class Preemption:
    """The signal handlers of a manager and its saves on a signal or an error."""

    def __init__(self, save: SaveNow, failures: Failures) -> None:
        self._save, self._failures = save, failures
        self._signals: list[int] = []
        self._tg: anyio.abc.TaskGroup | None = None
        #: Set once a signal given to ``save_on_signal`` has arrived and its save is done.
        self.preempted = anyio.Event()

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Saves on a signal run in ``tg`` from now on (the manager is open)."""
        self._tg = tg

    def stop(self) -> None:
        """Remove the signal handlers; a signal no longer saves (the manager closes)."""
        self._tg = None
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.remove_signal_handler(sig)

    def on_signal(self, state_fn: StateFn, signals: Sequence[int], deadline: float) -> None:
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal, sig, state_fn, deadline)
            self._signals.append(sig)

    def _on_signal(self, sig: int, state_fn: StateFn, deadline: float) -> None:
        if self._tg is not None:
            self._tg.start_soon(self._save_for_signal, sig, state_fn, deadline)

    async def _save_for_signal(self, sig: int, state_fn: StateFn, deadline: float) -> None:
        name = signal.Signals(sig).name
        try:
            with anyio.fail_after(deadline) as scope:
                step, handle = await self._save_now(state_fn)
            logger.warning("saved step %d on signal %s", step, name)
            if handle.upload is not None:  # the node may not outlive the signal: upload it too
                with anyio.move_on_after(max(0.0, scope.deadline - anyio.current_time())):
                    await handle.upload.wait()
                    logger.warning("uploaded step %d on signal %s", step, name)
                if not handle.upload.done():
                    logger.error("step %d was not uploaded within the deadline of signal %s", step, name)
        except Exception as exc:
            logger.error("the save on signal %s failed: %r", name, exc)
            self._failures.add(f"<save on {name}>", exc)
        finally:
            self.preempted.set()

    async def _save_now(self, state_fn: StateFn) -> tuple[int, SaveHandle]:
        result = state_fn()
        step, state = await result if inspect.isawaitable(result) else result
        handle = await self._save(step, state)
        await handle.wait()
        return step, handle

    @contextlib.asynccontextmanager
    async def on_error(self, state_fn: StateFn) -> AsyncIterator[None]:
        try:
            yield
        except (Exception, KeyboardInterrupt) as exc:
            try:
                step, _ = await self._save_now(state_fn)
            except Exception as save_exc:
                exc.add_note(f"aiosnap: the save on error failed too: {save_exc!r}")
            else:
                exc.add_note(f"aiosnap: saved step {step} before re-raising")
            raise
