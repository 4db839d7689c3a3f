"""Which checkpoints a CheckpointManager keeps: ``CheckpointManager(..., keep=policy)``.

A policy names the steps it keeps out of the committed, valid checkpoints; the manager
keeps those and the newest, and deletes the rest only after a newer checkpoint has
committed. Policies compose with ``AnyPolicy``; any object with a ``keep`` method fits.

``AnyOf``, the former name of ``AnyPolicy``, still works: it is the same class, and
using it warns (DeprecationWarning).
"""

from __future__ import annotations

import typing as _typing

from ._manager.retention import AnyPolicy as AnyPolicy
from ._manager.retention import KeepBest as KeepBest
from ._manager.retention import KeepEvery as KeepEvery
from ._manager.retention import KeepLast as KeepLast
from ._manager.retention import KeepWithin as KeepWithin
from ._manager.retention import RetentionPolicy as RetentionPolicy
from ._manager.retention import former_name as _former_name

__all__ = ["AnyPolicy", "KeepBest", "KeepEvery", "KeepLast", "KeepWithin", "RetentionPolicy"]

if _typing.TYPE_CHECKING:
    AnyOf = AnyPolicy  # deprecated: the name AnyPolicy had before
else:

    def __getattr__(name: str) -> type:
        return _former_name(__name__, name)
