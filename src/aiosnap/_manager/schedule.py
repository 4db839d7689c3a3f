"""When a manager saves: its trigger, the last save, and a group's agreement on a clock.

A trigger (``aiosnap.triggers``) decides from the step, the epoch and the time since the
last save. Step and epoch triggers decide alike on every rank; a clock trigger may not,
so in a group rank 0's answer is taken by all.
"""

from __future__ import annotations

import time
from typing import final

from .site import Site
from .triggers import EveryNSteps, Moment, Trigger, deterministic


@final
class Schedule:
    """A manager's trigger (``save_every``: N steps, a Trigger, or None: every call)."""

    def __init__(self, save_every: int | Trigger | None, site: Site) -> None:
        self.trigger: Trigger | None = EveryNSteps(save_every) if isinstance(save_every, int) else save_every
        self._site = site
        self._last: Moment | None = None

    def should_save(self, step: int, epoch: int | None) -> bool:
        """This rank's view of whether the trigger calls for a save now."""
        if self.trigger is None:
            return True
        return self.trigger(Moment(step, epoch, time.monotonic()), self._last)

    async def due(self, step: int, epoch: int | None) -> bool:
        """Whether to save now: this rank's view, or in a group for a clock, rank 0's."""
        due = self.should_save(step, epoch)
        if self._site.group.size > 1 and self.trigger is not None and not deterministic(self.trigger):
            due = await self._site.agree_on_trigger(due)
        return due

    def saved(self, step: int, epoch: int | None) -> None:
        """A save of ``step`` was accepted now."""
        self._last = Moment(step, epoch, time.monotonic())
