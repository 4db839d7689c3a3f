"""Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallel) saving its sharded
checkpoints through aiosnap: the strategy's own save and load, with aiosnap's DCP
storage backend (``aiosnap.integrations.dcp``) in place of DCP's file system classes.

A sharded Lightning checkpoint is a directory: DCP's files (every rank's shards and the
``.metadata``) and the rest of the checkpoint dict (loops, callbacks, epoch; Lightning's
``meta.pt``, a pickle). Here the rest is an aiosnap file, ``lightning-meta-<token>``,
written by rank 0 *before* the DCP save, and named by a small tensor inside it: the
``.metadata``, committed last and atomically once every rank's file is durable, decides
which files make the checkpoint. A save killed at any point leaves the checkpoint before
it (or none), never its shards with another save's loop state; every byte is checksummed
and verified at load, and the loop state is read without unpickling.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import torch

import aiosnap
from aiosnap._base.errors import CorruptCheckpointError, RankFailedError

from ._bridge import run_sync
from ._files import is_aiosnap_file, remove_file
from .dcp import AiosnapStorageReader, AiosnapStorageWriter

#: The DCP key of the name of the loop state's file (rank 0's, UTF-8 bytes).
META_KEY = "aiosnap_lightning_meta"
META_PREFIX = "lightning-meta-"


def is_sharded(path: Path) -> bool:
    """Whether ``path`` is a sharded checkpoint this strategy wrote."""
    return path.is_dir() and (path / ".metadata").is_file() and any(_metas(path))


def _metas(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith(META_PREFIX))


def save_sharded(strategy: Any, checkpoint: dict[str, Any], path: Path, allow_pickle: bool) -> None:
    """Save ``checkpoint`` as a sharded checkpoint at ``path``; every rank calls it."""
    state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
    for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{i}"] = optimizer_state
    name, error = "", None
    if strategy.global_rank == 0:
        try:
            path.mkdir(parents=True, exist_ok=True)
            name = META_PREFIX + secrets.token_hex(8)
            run_sync(aiosnap.save, str(path / name), checkpoint, allow_pickle=allow_pickle)
        except Exception as exc:
            error = exc
    # Every rank learns how rank 0's part went before DCP's collectives, which would
    # wait for rank 0 until the default group's timeout (30 minutes).
    name, why = strategy.broadcast((name, "" if error is None else repr(error)))
    if error is not None:
        raise error
    if why:
        raise RankFailedError(f"rank 0 could not save the loop state: {why}", {0: why})
    if strategy.global_rank == 0:
        state[META_KEY] = torch.frombuffer(bytearray(name.encode()), dtype=torch.uint8)
    from torch.distributed.checkpoint.state_dict_saver import save

    save(state, checkpoint_id=path, storage_writer=AiosnapStorageWriter())
    if strategy.global_rank == 0:  # what earlier saves of this name left: aiosnap's own files
        for old in _metas(path):
            if old != name and is_aiosnap_file(str(path / old)):
                remove_file(str(path / old))


def load_sharded(strategy: Any, path: Path, allow_pickle: bool) -> dict[str, Any]:
    """Load the model's and optimizers' shards into the strategy's model and optimizers;
    return the rest of the checkpoint dict (as Lightning's own sharded load does)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load

    model = strategy.model
    module_state = {"state_dict": get_model_state_dict(model)}
    load(module_state, checkpoint_id=path, storage_reader=AiosnapStorageReader())
    model.load_state_dict(module_state["state_dict"], strict=strategy.lightning_module.strict_loading)
    for i, optimizer in enumerate(strategy.optimizers):
        key = f"optimizer_{i}"
        optimizer_state = {key: get_optimizer_state_dict(model, optimizer)}
        load(optimizer_state, checkpoint_id=path, storage_reader=AiosnapStorageReader())
        options = StateDictOptions(cpu_offload=True)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optimizer_state[key], options=options)
    reader = AiosnapStorageReader(path)
    size = reader.read_metadata().state_dict_metadata[META_KEY].size  # type: ignore[union-attr]
    named = {META_KEY: torch.empty(size, dtype=torch.uint8)}
    load(named, checkpoint_id=path, storage_reader=AiosnapStorageReader())
    name = named[META_KEY].numpy().tobytes().decode()
    if not name.startswith(META_PREFIX) or "/" in name:
        raise CorruptCheckpointError(str(path), f"the loop state's file is named {name!r}")
    meta: dict[str, Any] = run_sync(aiosnap.load, str(path / name), allow_pickle=allow_pickle)
    return meta


class ShardedStrategyBehaviour:
    """The save and load of ``AiosnapModelParallelStrategy`` (and its twin for the standalone
    ``pytorch_lightning`` package), before ``ModelParallelStrategy`` in the bases."""

    _save_distributed_checkpoint: bool

    def __init__(self, *args: Any, allow_pickle: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allow_pickle = allow_pickle

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, Path(filepath), storage_options)  # type: ignore[misc]
            return
        save_sharded(self, checkpoint, Path(self.broadcast(filepath)), self.allow_pickle)  # type: ignore[attr-defined]

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))  # type: ignore[attr-defined]
        if not is_sharded(path):
            loaded: dict[str, Any] = super().load_checkpoint(path, weights_only)  # type: ignore[misc]
            return loaded
        return load_sharded(self, path, self.allow_pickle)
