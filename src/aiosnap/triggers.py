"""When a CheckpointManager saves: ``CheckpointManager(..., save_every=trigger)``.

``save_every=N`` (an int) is ``EveryNSteps(N)``: a save when ``step % N == 0`` -- step 0
included -- at most once per step. A trigger is any callable ``(now, last) -> bool``
over ``Moment`` records; those that depend only on steps and epochs may say so with
``deterministic = True``, so the ranks of a group decide alone.
"""

from __future__ import annotations

from ._manager.triggers import AnyTrigger as AnyTrigger
from ._manager.triggers import AtSteps as AtSteps
from ._manager.triggers import EveryNEpochs as EveryNEpochs
from ._manager.triggers import EveryNSeconds as EveryNSeconds
from ._manager.triggers import EveryNSteps as EveryNSteps
from ._manager.triggers import Moment as Moment
from ._manager.triggers import Trigger as Trigger

__all__ = ["AnyTrigger", "AtSteps", "EveryNEpochs", "EveryNSeconds", "EveryNSteps", "Moment", "Trigger"]
