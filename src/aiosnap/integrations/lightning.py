"""Lightning (the ``lightning`` package): ``Trainer(plugins=[AiosnapCheckpointIO()])``.

Lightning's ``ModelCheckpoint`` and ``Trainer.save_checkpoint`` save through the plugin:
a save returns once the checkpoint dict is captured and the ``.ckpt`` file (an aiosnap
file) is committed in the background, durable and atomic: ``ckpt_path="last"`` never
sees a half-written one. ``remove_checkpoint`` waits until the newer file is durable.
``AiosnapLoadMixin`` makes ``MyModule.load_from_checkpoint(path)`` read aiosnap files;
``export_safetensors`` writes a checkpoint's weights as a plain safetensors file.
``AiosnapModelParallelStrategy`` is Lightning's ``ModelParallelStrategy`` (FSDP2, tensor
parallel) saving its sharded checkpoints through aiosnap's DCP backend.
Users of the standalone ``pytorch_lightning`` package import the same names from
``aiosnap.integrations.pytorch_lightning``.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy

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
FRAMEWORK = "lightning.pytorch"


class AiosnapCheckpointIO(CheckpointIOBehaviour, CheckpointIO):
    """A ``CheckpointIO`` that saves through aiosnap (see the module docstring).

    Options are ``aiosnap.QueueWriter``'s. ``allow_pickle=True`` lets values that are not
    tensors, arrays or plain containers (``hyper_parameters`` holding arbitrary objects)
    be stored pickled, and unpickled at load: leave it off unless the checkpoint holds
    such values (a save then raises ``aiosnap.errors.UnsupportedTypeError`` naming the value).
    ``flush()`` waits for every save; ``teardown()`` (after each fit, validate, test)
    also stops the background loop, which the next save starts again. ``committing(path)``
    says whether a save of ``path`` is still in flight: the Trainer's ``ModelCheckpoint``
    callbacks count such a name as taken. The plugin pickles (``ddp_spawn``,
    ``torch.save(trainer)``) as a plugin with the same options and nothing in flight.
    Under ``strategy="ddp"`` rank 0 saves, and ``teardown()`` on every rank returns only
    once rank 0's saves are durable, or raises on every rank (``timeout``: seconds of
    silence after which a rank counts as failed).
    """

    framework = FRAMEWORK


class AiosnapModelParallelStrategy(ShardedStrategyBehaviour, ModelParallelStrategy):
    """``ModelParallelStrategy`` whose sharded checkpoints (``save_distributed_checkpoint=True``,
    the default) are written and read through aiosnap: every rank's shards committed
    durably and atomically by aiosnap's DCP storage writer, the loop state (Lightning's
    ``meta.pt``) an aiosnap file that the checkpoint's ``.metadata`` names, so a save killed
    at any point leaves the checkpoint before it whole; every byte verified at load,
    nothing unpickled (``allow_pickle=True`` lets ``hyper_parameters`` hold arbitrary
    objects). A save returns once staged and commits in the background; the next save,
    a load and ``teardown()`` wait for it and raise its error on every rank (``timeout``:
    seconds after which a silent rank fails the save). Resume with ``fit(ckpt_path=...)``.
    Loading a checkpoint Lightning's own strategy wrote still works. With
    ``save_distributed_checkpoint=False`` the full checkpoint goes through the
    CheckpointIO plugin (``AiosnapCheckpointIO``, if given). Other arguments are
    ``ModelParallelStrategy``'s."""


class AiosnapLoadMixin(LoadMixinBehaviour):
    """Put it before ``LightningModule`` (or ``LightningDataModule``) in the bases:
    ``class MyModule(AiosnapLoadMixin, L.LightningModule)``. ``MyModule.load_from_checkpoint
    (path, ...)`` then reads an aiosnap checkpoint through aiosnap (Lightning's own calls
    ``torch.load``, which cannot read one), and any other file through Lightning's own;
    same arguments. ``weights_only=False`` lets pickled values of the file be unpickled."""

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
    """``cls.load_from_checkpoint(path)`` for an aiosnap checkpoint, with any module class
    (``AiosnapLoadMixin`` does the same from the class method): the module is built from
    the saved ``hyper_parameters`` (updated by ``kwargs``) and loads the saved
    ``state_dict``, through Lightning's own loading code."""
    path, hparams = checkpoint_path, hparams_file
    return load_module(FRAMEWORK, cls, path, map_location, hparams, strict, allow_pickle, kwargs)
