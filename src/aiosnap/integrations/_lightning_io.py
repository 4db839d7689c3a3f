"""The CheckpointIO behind both Lightning packages (``lightning`` and the standalone
``pytorch_lightning``), which have distinct base classes: each module pairs this with
its own ``CheckpointIO`` base."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch

import aiosnap

from ._bridge import SyncWriter, run_sync
from ._files import remove_file, sweep_temps

M = TypeVar("M")

#: The file name of a SLURM requeue save (Lightning's ``hpc_save_path``): the job is
#: requeued right after the save returns, so that save returns only once durable.
HPC_PREFIX = "hpc_ckpt_"


def map_location_of(map_location: Any) -> str | torch.device | None:
    """A device for aiosnap.load from Lightning's ``map_location``; a function or a dict
    (torch.load's remapping forms) loads onto the CPU."""
    return map_location if isinstance(map_location, str | torch.device) else None


def _local(path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    if "://" in path:
        raise NotImplementedError(
            f"{path}: AiosnapCheckpointIO saves to local paths (removing a remote checkpoint is not "
            "implemented); save locally, or use aiosnap.CheckpointManager(..., remote=URL) to upload"
        )
    return path


class CheckpointIOBehaviour:
    """``save_checkpoint`` / ``load_checkpoint`` / ``remove_checkpoint`` / ``teardown``
    through aiosnap; see ``aiosnap.integrations.lightning.AiosnapCheckpointIO``."""

    def __init__(
        self,
        *,
        max_pending: int = 2,
        when_full: Literal["block", "skip", "replace"] = "block",
        offload: Literal["thread", "process"] = "thread",
        max_host_bytes: int | None = None,
        allow_pickle: bool = False,
    ) -> None:
        self.allow_pickle = allow_pickle
        self._bridge = SyncWriter(
            max_pending=max_pending,
            when_full=when_full,
            offload=offload,
            max_host_bytes=max_host_bytes,
            allow_pickle=allow_pickle,
        )
        #: Saves accepted per path: a removal asked for before a later save of the same
        #: path must not delete that later file.
        self._saves: dict[str, int] = {}
        self._swept: set[str] = set()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """Capture ``checkpoint`` and return; the file is committed in the background (a
        SLURM requeue save, ``hpc_ckpt_*``, returns once it is durable)."""
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
                f" is not supported for `{type(self).__name__}`."
            )
        path = _local(path)
        directory = os.path.dirname(os.path.abspath(path))
        if directory not in self._swept:
            self._swept.add(directory)
            sweep_temps(directory)
        self._saves[path] = self._saves.get(path, 0) + 1
        handle = self._bridge.save(path, checkpoint)
        if os.path.basename(path).startswith(HPC_PREFIX):
            self._bridge.wait(handle)

    def load_checkpoint(
        self, path: str | os.PathLike[str], map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read a checkpoint, verifying its checksums. It never unpickles, unless this
        plugin was made with ``allow_pickle=True`` (``weights_only`` is then moot)."""
        self._bridge.flush()  # a file still being written is read once durable
        loaded: dict[str, Any] = run_sync(
            aiosnap.load,
            os.fspath(path),
            map_location=map_location_of(map_location),
            allow_pickle=self.allow_pickle,
        )
        return loaded

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove ``path`` once every save accepted so far is durable, if it is an aiosnap
        checkpoint (other files are left, with a warning) and was not saved again since."""
        path = _local(path)
        self._bridge.after(functools.partial(self._remove, path, self._saves.get(path, 0)))

    def _remove(self, path: str, saves: int) -> None:
        if self._saves.get(path, 0) == saves:
            remove_file(path)

    def flush(self) -> None:
        """Wait until every save and removal so far is done; raise the first failure not
        reported yet, with its original type."""
        self._bridge.flush()

    def teardown(self) -> None:
        """Wait for every save, raise a failure not reported yet, stop the background loop.
        Lightning calls it after every fit, validate and test: the next save opens it again."""
        self._bridge.close()


def load_module(
    load_state: Callable[..., Any],
    cls: type[M],
    checkpoint_path: str | os.PathLike[str],
    map_location: Any,
    strict: bool | None,
    allow_pickle: bool,
    kwargs: dict[str, Any],
) -> M:
    """What Lightning's ``load_from_checkpoint`` does once it has the checkpoint dict,
    with ``load_state`` its own ``_load_state``; the dict comes from aiosnap."""
    checkpoint = run_sync(
        aiosnap.load,
        os.fspath(checkpoint_path),
        map_location=map_location_of(map_location),
        allow_pickle=allow_pickle,
    )
    key = cls.CHECKPOINT_HYPER_PARAMS_KEY  # type: ignore[attr-defined]
    checkpoint.setdefault(key, {})
    checkpoint[key].update(kwargs)
    module: M = load_state(cls, checkpoint, strict=strict, **kwargs)
    return module
