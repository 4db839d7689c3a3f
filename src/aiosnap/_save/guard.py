"""Lazy capture's guard: ``optimizer.step()`` waits until a save's tensors are copied.

A lazily captured save returns once its tree is walked; its tensors are copied in the
background, beside the training step. Forward and backward only read the parameters
and the optimizer's state, so the copy may run beside them; ``optimizer.step()``
changes them in place. So every optimizer found in the state gets a step pre-hook that
holds the step until the host copies are done and the device copies are queued, then
orders the step's device work after those copies (no host synchronisation).

The hook is one-shot, and never removed from inside itself: torch iterates an
optimizer's pre-hooks while they run, and a hook that removed itself there would make
it raise "OrderedDict mutated during iteration". It is added and removed on the event
loop's thread, between two of its callbacks: a step, which is synchronous code, never
runs there meanwhile (an async training loop steps on that thread). It does nothing
once the copy is done, and is removed as soon as the loop runs after that.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from .device import DeviceCopier
from .window import take_off_finished


class Guard:
    """Holds the step of the optimizers of one lazily captured save (thread-safe)."""

    def __init__(self, copier: DeviceCopier | None) -> None:
        self._copier = copier
        self._loop = asyncio.get_running_loop()
        self._ready = threading.Event()
        self._fence: object = None
        self._hooks: list[Any] = []
        self._released = False
        #: How many steps the guard held until the copies were ready.
        self.held = 0

    def arm(self, optimizers: list[Any]) -> None:
        """On the event loop's thread: hook the step of each of ``optimizers``, unless
        the capture has ended already."""
        if self._released:
            return
        for optimizer in dict.fromkeys(map(_innermost, optimizers)):
            self._hooks.append(optimizer.register_step_pre_hook(self._hold))

    def _hold(self, optimizer: Any, args: object, kwargs: object) -> None:
        if not self._ready.is_set():
            self.held += 1
            self._ready.wait()
        fence = self._fence
        if fence is not None and self._copier is not None:
            self._copier.order_after(fence)

    def ready(self, fence: object = None) -> None:
        """From the staging thread: the host copies are done, and the device copies that
        ``fence`` marks are queued; a step may go on, its device work after them."""
        self._fence = fence
        self._ready.set()

    def release(self) -> None:
        """The capture ended, whichever way (any thread; idempotent): let every step go
        on, and remove the hooks on the event loop's thread."""
        self._ready.set()
        if self._released:
            return
        self._released = True
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._disarm()
            return
        try:
            self._loop.call_soon_threadsafe(self._disarm)
        except RuntimeError:  # the loop is closed: no step of it runs any more
            self._disarm()

    @property
    def armed(self) -> bool:
        """Whether some optimizer still carries this guard's hook."""
        return bool(self._hooks)

    def _disarm(self) -> None:
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()
        take_off_finished()  # on the loop's thread: the save's copy-on-write window


def _innermost(optimizer: Any) -> Any:
    """The optimizer whose ``step`` updates the tensors: wrappers (Accelerate's,
    Lightning's) hold it as ``.optimizer``."""
    seen = {id(optimizer)}
    while hasattr(getattr(optimizer, "optimizer", None), "register_step_pre_hook"):
        optimizer = optimizer.optimizer
        if id(optimizer) in seen:
            break
        seen.add(id(optimizer))
    return optimizer
