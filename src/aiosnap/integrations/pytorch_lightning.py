"""The standalone ``pytorch_lightning`` package: ``Trainer(plugins=[AiosnapCheckpointIO()])``.

Lightning's ``ModelCheckpoint`` and ``Trainer.save_checkpoint`` save through the plugin:
a save returns once the checkpoint dict is captured and the ``.ckpt`` file (an aiosnap
file) is committed in the background, durable and atomic: ``ckpt_path="last"`` never
sees a half-written one. ``remove_checkpoint`` waits until the newer file is durable.
The same names as ``aiosnap.integrations.lightning``, on ``lightning_fabric``'s base
class (a ``pytorch_lightning.Trainer`` accepts only plugins of its own packages).
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from lightning_fabric.plugins import CheckpointIO
from pytorch_lightning.core.saving import _load_state

from ._lightning_io import CheckpointIOBehaviour, load_module

__all__ = ["AiosnapCheckpointIO", "load_from_checkpoint"]

M = TypeVar("M")


class AiosnapCheckpointIO(CheckpointIOBehaviour, CheckpointIO):
    """A ``CheckpointIO`` that saves through aiosnap (``aiosnap.integrations.lightning``'s
    twin, on ``lightning_fabric``'s base).

    Options are ``aiosnap.QueueWriter``'s. ``allow_pickle=True`` lets values that are not
    tensors, arrays or plain containers (``hyper_parameters`` holding arbitrary objects)
    be stored pickled, and unpickled at load: leave it off unless the checkpoint holds
    such values (a save then raises ``aiosnap.UnsupportedTypeError`` naming the value).
    ``flush()`` waits for every save; ``teardown()`` (after each fit, validate, test)
    also stops the background loop, which the next save starts again.
    """


def load_from_checkpoint(
    cls: type[M],
    checkpoint_path: str | os.PathLike[str],
    *,
    map_location: Any = None,
    strict: bool | None = None,
    allow_pickle: bool = False,
    **kwargs: Any,
) -> M:
    """``cls.load_from_checkpoint(path)`` for an aiosnap checkpoint (Lightning's own calls
    ``torch.load``): the module is built from the saved ``hyper_parameters`` (updated by
    ``kwargs``) and loads the saved ``state_dict``, through Lightning's own loading code."""
    return load_module(_load_state, cls, checkpoint_path, map_location, strict, allow_pickle, kwargs)
