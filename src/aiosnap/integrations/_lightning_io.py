"""The CheckpointIO behind both Lightning packages (``lightning`` and the standalone
``pytorch_lightning``), which have distinct base classes: each module pairs this with
its own ``CheckpointIO`` base and names its package (``framework``)."""

from __future__ import annotations

import functools
import logging
import os
import sys
import weakref
from typing import Any, ClassVar, Literal

import torch

import aiosnap
from aiosnap.storage import LocalStorage

from ._bridge import SyncWriter, run_sync
from ._files import is_aiosnap_file, remove_file, sweep_temps
from ._lightning_trainer import calling_trainer, refuse_wrapper, watch_names
from ._ranks import RankAgreement, group_size

logger = logging.getLogger(__name__)

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

    #: The Lightning package whose Trainer calls the plugin (``lightning.pytorch`` or
    #: ``pytorch_lightning``): set by each twin module.
    framework: ClassVar[str]

    def __init__(
        self,
        *,
        max_pending: int = 2,
        when_full: Literal["block", "skip", "replace"] = "block",
        offload: Literal["thread", "process"] = "thread",
        max_host_bytes: int | None = None,
        allow_pickle: bool = False,
        timeout: float = 300.0,
    ) -> None:
        self.allow_pickle = allow_pickle
        #: Seconds of silence after which a rank counts as failed in teardown's agreement.
        self.timeout = timeout
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
        #: The last save accepted per absolute path, while it may still be committing.
        self._in_flight: dict[str, aiosnap.SaveHandle] = {}
        _live.add(self)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``ddp_spawn`` pickles the Trainer to each process; ``torch.save(trainer)``)
        is a plugin with no saves in flight: this one's stay with it, and so do its loop and
        threads (the bridge pickles its options only); the copy starts its own on first use."""
        state = self.__dict__.copy()
        state["_in_flight"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _live.add(self)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """Capture ``checkpoint`` and return; the file is committed in the background (a
        SLURM requeue save, ``hpc_ckpt_*``, returns once it is durable)."""
        caller = sys._getframe(1)
        refuse_wrapper(caller, self.framework)
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
        self._in_flight = {p: h for p, h in self._in_flight.items() if not h.done()}
        self._in_flight[os.path.abspath(path)] = handle
        trainer = calling_trainer(caller, self.framework)
        if trainer is not None:
            watch_names(trainer, self.framework)
        if os.path.basename(path).startswith(HPC_PREFIX):
            self._bridge.wait(handle)

    def committing(self, path: str | os.PathLike[str]) -> bool:
        """Whether a save of ``path`` was accepted and has not ended yet: the file is not
        there yet, but the name is taken (``ModelCheckpoint`` counts it as existing)."""
        handle = self._in_flight.get(os.path.abspath(os.fspath(path)))
        return handle is not None and not handle.done()

    def exists(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` exists, or a save of it is still being committed."""
        return os.path.exists(path) or self.committing(path)

    def load_checkpoint(
        self, path: str | os.PathLike[str], map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read a checkpoint, verifying its checksums. It never unpickles, unless this
        plugin was made with ``allow_pickle=True`` (``weights_only`` is then moot)."""
        refuse_wrapper(sys._getframe(1), self.framework)
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
        checkpoint (other files are left, with a warning) and was not saved again since;
        or, if it is a symbolic link (``save_last="link"``), the link alone, where it
        points at a checkpoint of this plugin, an aiosnap file, or nothing."""
        refuse_wrapper(sys._getframe(1), self.framework)
        path = _local(path)
        remove = functools.partial(self._remove, path, self._saves.get(path, 0))
        if self._bridge.is_open:
            self._bridge.after(remove)
        else:
            remove()  # nothing in flight: no loop (and no thread) started for it

    def _remove(self, path: str, saves: int) -> None:
        if self._saves.get(path, 0) != saves:
            return
        if os.path.islink(path):
            self._remove_link(path)
        else:
            remove_file(path)

    def _remove_link(self, path: str) -> None:
        """Unlink ``path`` (never what it points at) if it points at a checkpoint this
        plugin saved, an aiosnap file or nothing; else leave it, with a warning."""
        target = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), os.readlink(path)))
        saved = {os.path.abspath(p) for p in list(self._saves)}
        if target in saved or not os.path.lexists(target) or is_aiosnap_file(target):
            _disk.delete(path)
            return
        logger.warning(
            "not removing the link %s: it points at %s, which is not an aiosnap checkpoint "
            "(aiosnap deletes only its own)",
            path,
            target,
        )

    def flush(self) -> None:
        """Wait until every save and removal so far is done; raise the first failure not
        reported yet, with its original type."""
        self._bridge.flush()

    def teardown(self) -> None:
        """Wait for every save, raise a failure not reported yet, stop the background loop.
        Lightning calls it after every fit, validate and test: the next save opens it again.

        In a torch.distributed run (``strategy="ddp"``: rank 0 alone saves), every rank
        calls it, and every rank returns only once rank 0's saves are durable, or raises
        (rank 0 its own error, the others ``aiosnap.errors.RankFailedError``); a rank silent for
        ``timeout`` seconds makes the others raise. A teardown after a failure of the run
        (Lightning tears down while the exception is handled) does not wait for the
        others: they may never come, and they raise once this process ends."""
        error: Exception | None = None
        try:
            self._bridge.close()
        except Exception as exc:
            error = exc
        if group_size()[1] == 1 or sys.exc_info()[1] is not None:
            if error is not None:
                raise error
            return
        agreement = RankAgreement(timeout=self.timeout)
        try:
            agreement.agree("lightning teardown", error)
        finally:
            agreement.close()


#: The local disk link removals go through.
_disk = LocalStorage()
#: Every plugin of this process, for ``settle``.
_live: weakref.WeakSet[CheckpointIOBehaviour] = weakref.WeakSet()


def settle(path: str | os.PathLike[str]) -> None:
    """Wait until no plugin of this process is committing ``path`` (raising a failed save,
    as ``flush`` does): ``trainer.save_checkpoint(p)`` then ``Model.load_from_checkpoint(p)``
    reads the new file, never the one it replaces nor none."""
    for plugin in list(_live):
        if plugin.committing(path):
            plugin.flush()
