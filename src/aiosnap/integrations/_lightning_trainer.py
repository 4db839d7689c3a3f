"""What the Lightning plugin learns of the Trainer that calls it, and tells it.

A ``CheckpointIO`` is handed no Trainer, yet two of Lightning's contracts are the
Trainer's, not the plugin's:

- ``ModelCheckpoint`` picks the next free name with its filesystem's ``exists``
  (``file_exists``, its version counter: ``ckpt.ckpt``, ``ckpt-v1.ckpt``...). A save
  still committing is not there yet, so the next save would take its name and replace
  it. At a save, the plugin finds the Trainer on the call stack (its ``save_checkpoint``
  is always the caller of the strategy's, which calls the plugin) and gives each of
  its ModelCheckpoint callbacks a ``file_exists`` that also counts the plugin's saves
  in flight (``watch_names``).
- ``AsyncCheckpointIO`` wrapping the plugin never calls the plugin's ``teardown``: fit
  would return before the files exist and a failed save would never be raised. The
  wrap is refused at the first call it forwards (``refuse_wrapper``).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import weakref
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

#: How many callers up a Trainer's ``save_checkpoint`` is looked for: it calls the
#: strategy's, which calls the plugin (a subclass of the plugin may add a frame or two).
_TRAINER_DEPTH = 8
#: How many callers up a wrapping ``AsyncCheckpointIO`` is looked for (its worker's
#: closure, or ``_WrappingCheckpointIO``'s forwarding method, calls the plugin; a
#: subclass of the plugin, or a ``Mock(wraps=...)`` of its method, adds frames).
_WRAPPER_DEPTH = 6
#: ModelCheckpoint callbacks already looked at (given our ``file_exists``, or warned about).
_watched: weakref.WeakSet[Any] = weakref.WeakSet()


def refuse_wrapper(frame: FrameType | None, framework: str) -> None:
    """Raise TypeError if one of the callers from ``frame`` up is Lightning's
    ``AsyncCheckpointIO`` (of package ``framework``) forwarding a call to the plugin."""
    module = sys.modules.get(f"{framework}.plugins.io.async_plugin")
    wrapper = getattr(module, "AsyncCheckpointIO", None)
    if wrapper is None:
        return  # never imported: nothing can have wrapped the plugin
    for _ in range(_WRAPPER_DEPTH):
        if frame is None:
            return
        if isinstance(frame.f_locals.get("self"), wrapper):
            raise TypeError(
                "AsyncCheckpointIO(AiosnapCheckpointIO()) is not supported: AiosnapCheckpointIO saves in "
                "the background already, and AsyncCheckpointIO never tears down the plugin it wraps, so fit "
                "would return before the checkpoints are durable and a failed save would never be raised. "
                "Pass the plugin alone: Trainer(plugins=[AiosnapCheckpointIO()])"
            )
        frame = frame.f_back


def calling_trainer(frame: FrameType | None, framework: str) -> Any:
    """The Trainer (of package ``framework``) whose ``save_checkpoint`` is one of the
    callers from ``frame`` up, or None (a save from elsewhere: Fabric, a launcher)."""
    module = sys.modules.get(f"{framework}.trainer.trainer")
    trainer_cls = getattr(module, "Trainer", None)
    if trainer_cls is None:
        return None
    code = trainer_cls.save_checkpoint.__code__
    for _ in range(_TRAINER_DEPTH):
        if frame is None:
            return None
        if frame.f_code is code:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def watch_names(trainer: Any, framework: str) -> None:
    """Give each ModelCheckpoint of ``trainer`` a ``file_exists`` that counts the saves
    the Trainer's plugin is still committing (``_file_exists``), once per callback. A
    subclass with a ``file_exists`` of its own keeps it, with a warning."""
    base = sys.modules[f"{framework}.callbacks.model_checkpoint"].ModelCheckpoint
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, base) or callback in _watched:
            continue
        _watched.add(callback)
        if type(callback).file_exists is not base.file_exists:
            logger.warning(
                "%s has a file_exists of its own: it does not see the checkpoints still being committed, "
                "so a later save may take one's name and replace it (give each checkpoint a name of its own, "
                "or count the plugin's `committing(path)` as existing)",
                type(callback).__qualname__,
            )
            continue
        callback.file_exists = functools.partial(_file_exists, callback)


def _file_exists(callback: Any, filepath: str | os.PathLike[str], trainer: Any) -> bool:
    """``ModelCheckpoint.file_exists`` (rank 0 looks, every rank gets its answer, in one
    collective as there), where a name the plugin is still committing exists too."""
    exists = False
    if trainer.is_global_zero:
        committing = getattr(trainer.strategy.checkpoint_io, "committing", None)
        exists = bool(callback._fs.exists(filepath)) or (callable(committing) and bool(committing(filepath)))
    return bool(trainer.strategy.reduce_boolean_decision(exists, all=False))
