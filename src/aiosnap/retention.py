"""Which checkpoints a CheckpointManager keeps: ``CheckpointManager(..., keep=policy)``.

A policy names the steps it keeps out of the committed, valid checkpoints; the manager
keeps those and the newest, and deletes the rest only after a newer checkpoint has
committed. Policies compose with ``AnyOf``; any object with a ``keep`` method fits.
"""

from __future__ import annotations

from ._manager.retention import AnyOf as AnyOf
from ._manager.retention import KeepBest as KeepBest
from ._manager.retention import KeepEvery as KeepEvery
from ._manager.retention import KeepLast as KeepLast
from ._manager.retention import KeepWithin as KeepWithin
from ._manager.retention import RetentionPolicy as RetentionPolicy

__all__ = ["AnyOf", "KeepBest", "KeepEvery", "KeepLast", "KeepWithin", "RetentionPolicy"]
