"""When a CheckpointManager saves: ``CheckpointManager(..., save_every=trigger)``.

``save_every=N`` (an int) is ``EveryNSteps(N)``: a save when ``step % N == 0`` -- step 0
included -- at most once per step. A trigger is any callable ``(now, last) -> bool``
over ``Moment`` records; those that depend only on steps and epochs may say so with
``deterministic = True``, so the ranks of a group decide alone.
"""

from __future__ import annotations

from ._triggers import AnyTrigger as AnyTrigger
from ._triggers import AtSteps as AtSteps
from ._triggers import EveryNEpochs as EveryNEpochs
from ._triggers import EveryNSeconds as EveryNSeconds
from ._triggers import EveryNSteps as EveryNSteps
from ._triggers import Moment as Moment
from ._triggers import Trigger as Trigger

__all__ = ["AnyTrigger", "AtSteps", "EveryNEpochs", "EveryNSeconds", "EveryNSteps", "Moment", "Trigger"]
