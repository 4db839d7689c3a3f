"""The standalone ``pytorch_lightning`` package: ``Trainer(plugins=[AiosnapCheckpointIO()])``.

The same names as ``aiosnap.integrations.lightning``, on ``lightning_fabric``'s base
class and ``pytorch_lightning``'s Trainer, callbacks and loading code (a
``pytorch_lightning.Trainer`` accepts only plugins of its own packages).
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from lightning_fabric.plugins import CheckpointIO
from pytorch_lightning.strategies import ModelParallelStrategy

from ._lightning_io import CheckpointIOBehaviour
from ._lightning_load import LoadMixinBehaviour, export_safetensors, load_module
from ._lightning_sharded import ShardedStrategyBehaviour

__all__ = [
    "AiosnapCheckpointIO",
    "AiosnapLoadMixin",
    "AiosnapModelParallelStrategy",
    "export_safetensors",
    "load_from_checkpoint",
]

M = TypeVar("M")
FRAMEWORK = "pytorch_lightning"


class AiosnapCheckpointIO(CheckpointIOBehaviour, CheckpointIO):
    """A ``CheckpointIO`` that saves through aiosnap: ``aiosnap.integrations.lightning
    .AiosnapCheckpointIO``'s twin, on ``lightning_fabric``'s base."""

    framework = FRAMEWORK


class AiosnapModelParallelStrategy(ShardedStrategyBehaviour, ModelParallelStrategy):
    """``aiosnap.integrations.lightning.AiosnapModelParallelStrategy`` for ``pytorch_lightning``."""


class AiosnapLoadMixin(LoadMixinBehaviour):
    """``aiosnap.integrations.lightning.AiosnapLoadMixin`` for ``pytorch_lightning`` modules."""

    framework = FRAMEWORK


def load_from_checkpoint(
    cls: type[M],
    checkpoint_path: str | os.PathLike[str],
    *,
    map_location: Any = None,
    hparams_file: str | os.PathLike[str] | None = None,
    strict: bool | None = None,
    allow_pickle: bool = False,
    **kwargs: Any,
) -> M:
    """``aiosnap.integrations.lightning.load_from_checkpoint`` for ``pytorch_lightning``
    modules."""
    path, hparams = checkpoint_path, hparams_file
    return load_module(FRAMEWORK, cls, path, map_location, hparams, strict, allow_pickle, kwargs)
