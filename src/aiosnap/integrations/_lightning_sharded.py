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

A save returns once the state is staged (DCP's ``async_save``: a copy in memory); the
files are written and committed in DCP's background thread, whose collectives run on a
gloo group of the strategy's own (the training's run on the default group meanwhile).
The next save, a load and the strategy's teardown (the end of every fit) wait for it
first, and raise its error on every rank.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import aiosnap
from aiosnap._base.errors import CorruptCheckpointError, RankFailedError

from ._bridge import run_sync
from ._files import remove_file
from .dcp import AiosnapStorageReader, AiosnapStorageWriter

#: The DCP key of the name of the loop state's file (rank 0's, UTF-8 bytes).
META_KEY = "aiosnap_lightning_meta"
META_PREFIX = "lightning-meta-"


def is_sharded(path: Path) -> bool:
    """Whether ``path`` is a sharded checkpoint this strategy wrote."""
    return path.is_dir() and (path / ".metadata").is_file() and any(_metas(path))


def _metas(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith(META_PREFIX))


@contextlib.contextmanager
def dcp_errors(rank: int, what: str) -> Iterator[None]:
    """DCP's errors as aiosnap's: DCP gathers every rank's failure into one
    ``CheckpointException``, a BaseException (an ``except Exception`` lets it through).
    Here the rank that failed raises its own error, every other ``RankFailedError``
    naming the failed ranks; both chained from DCP's."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        failures = {r: pair[0] for r, pair in exc.failures.items()}
        mine = failures.get(rank)
        if isinstance(mine, Exception):
            mine.add_note(f"aiosnap: {what} failed on every rank")
            raise mine from exc
        failed = {r: f"{type(e).__name__}: {e}" for r, e in sorted(failures.items())}
        detail = "; ".join(f"rank {r} {why}" for r, why in failed.items())
        raise RankFailedError(f"{what} failed: {detail}", failed) from exc


@dataclass(frozen=True, slots=True)
class Pending:
    """A save in DCP's background thread: its future, its directory and loop state file."""

    future: Future[Any]
    path: Path
    name: str

    def settle(self, rank: int) -> None:
        """Wait for the save (raising its error); then on rank 0 remove the loop state files
        the earlier saves of this directory left (aiosnap's own)."""
        with dcp_errors(rank, f"the sharded save at {self.path}"):
            self.future.result()
        if rank == 0:
            for old in _metas(self.path):
                if old != self.name:
                    remove_file(str(self.path / old))  # only an aiosnap file; a stray stays, named


def save_sharded(
    strategy: Any, checkpoint: dict[str, Any], path: Path, allow_pickle: bool, group: Any
) -> Pending:
    """Start saving ``checkpoint`` as a sharded checkpoint at ``path`` (every rank calls
    it); DCP's collectives of the save run on ``group``."""
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
    # wait for rank 0 until the group's timeout (30 minutes).
    name, why = strategy.broadcast((name, "" if error is None else repr(error)))
    if error is not None:
        raise error
    if why:
        raise RankFailedError(f"rank 0 could not save the loop state: {why}", {0: why})
    if strategy.global_rank == 0:
        state[META_KEY] = torch.frombuffer(bytearray(name.encode()), dtype=torch.uint8)
    from torch.distributed.checkpoint.state_dict_saver import async_save

    writer = AiosnapStorageWriter()
    future = async_save(state, checkpoint_id=path, storage_writer=writer, process_group=group)
    assert isinstance(future, Future)  # the default stager stages before returning
    return Pending(future, path, name)


def load_sharded(strategy: Any, path: Path, allow_pickle: bool) -> dict[str, Any]:
    """Load the model's and optimizers' shards into the strategy's model and optimizers;
    return the rest of the checkpoint dict (as Lightning's own sharded load does)."""
    with dcp_errors(strategy.global_rank, f"loading {path}"):
        return _load(strategy, path, allow_pickle)


def _load(strategy: Any, path: Path, allow_pickle: bool) -> dict[str, Any]:
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
    global_rank: int

    def __init__(self, *args: Any, allow_pickle: bool = False, timeout: float = 300.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allow_pickle, self.timeout = allow_pickle, timeout
        self._pending: Pending | None = None
        self._save_group: Any = None

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        import torch.distributed as dist

        # Every rank sets up here, together: the one place to make a group (a collective).
        # Its timeout bounds how long a save waits for a rank that died or went silent.
        self._save_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, Path(filepath), storage_options)  # type: ignore[misc]
            return
        self.settle()
        path = Path(self.broadcast(filepath))  # type: ignore[attr-defined]
        self._pending = save_sharded(self, checkpoint, path, self.allow_pickle, self._save_group)

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None
    ) -> dict[str, Any]:
        self.settle()
        path = Path(self.broadcast(checkpoint_path))  # type: ignore[attr-defined]
        if not is_sharded(path):
            loaded: dict[str, Any] = super().load_checkpoint(path, weights_only)  # type: ignore[misc]
            return loaded
        return load_sharded(self, path, self.allow_pickle)

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        """Lightning's retention removes an older checkpoint once a newer one's save call
        returned: here, once the newer one is committed (or its failure raised, and
        nothing removed)."""
        self.settle()
        super().remove_checkpoint(filepath)  # type: ignore[misc]

    def settle(self) -> None:
        """Wait until the save in flight is committed; raise its error (on every rank)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.settle(self.global_rank)

    def teardown(self) -> None:
        """At the end of each fit: the last save committed, then the strategy's teardown."""
        try:
            self.settle()
        finally:
            group, self._save_group = self._save_group, None
            if group is not None:
                import torch.distributed as dist

                # Destroyed here, in the thread that made it (see ``GlooChannel.close``).
                if dist.is_initialized():
                    dist.destroy_process_group(group)
            super().teardown()  # type: ignore[misc]
