"""Multi-process runs of the integrations: the checkpoints of a ``torch.distributed`` group.

In a run of several processes (torchrun, ``accelerate launch``), every rank saves its part
of a checkpoint through a ``CheckpointManager`` opened on the run's group: each rank
writes its own file into the step's directory, and rank 0 commits the step (its manifest)
only once every rank's file is durable. The state the main process alone owns (a DDP
model, its optimizer) is listed as *replicated*: rank 0 writes it once and every rank
reads it back from there; the rest (each rank's RNG states, its data loader's position)
is each rank's own. A rank whose save fails fails the step on every rank, raised at the
next save, ``flush`` or ``close``; a rank that dies or hangs is named once the group's
``timeout`` passes. See docs/sharded.md for the layout and the vote.

The frameworks call their hooks synchronously, so ``GroupSaver`` runs the manager in an
event loop of its own (an anyio blocking portal), as ``_bridge.SyncWriter`` does a writer.
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, ParamSpec, TypeVar

import anyio.from_thread

import aiosnap
from aiosnap._save.options import QueueOptions

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

#: Seconds of silence after which a rank counts as failed (the manager's default).
TIMEOUT = 300.0


def in_a_group() -> bool:
    """Whether this process is one of several ranks of an initialised torch.distributed
    group (torch.distributed is only looked at if the framework imported it)."""
    dist = sys.modules.get("torch.distributed")
    return bool(
        dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    )


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def group_manager(
    directory: str, name: str, *, keep: int | None, replicated: Sequence[str], options: QueueOptions
) -> aiosnap.CheckpointManager:
    """The one place the integrations build a manager: over the default process group,
    ``name`` a template with ``{step}``, the newest ``keep`` steps kept (all for None)."""
    allow_pickle = bool(options.get("allow_pickle", False))
    return aiosnap.CheckpointManager(
        directory,
        writer=aiosnap.QueueWriter(**options) if options else None,
        name=name,
        keep=None if keep is None else aiosnap.retention.KeepLast(keep),
        ranks=aiosnap.Ranks(replicated=replicated, timeout=TIMEOUT),
        allow_pickle=allow_pickle,
    )


class GroupSaver:
    """A blocking front over a group's ``CheckpointManager`` (see the module docstring),
    opened on first use; every rank must make the same calls in the same order."""

    def __init__(
        self,
        directory: str,
        name: str,
        *,
        keep: int | None,
        replicated: Sequence[str],
        options: QueueOptions,
    ) -> None:
        self._make = functools.partial(
            group_manager, directory, name, keep=keep, replicated=replicated, options=options
        )
        self.directory = directory
        self._portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal] | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._manager_cm: AbstractContextManager[aiosnap.CheckpointManager] | None = None
        self._manager: aiosnap.CheckpointManager | None = None
        #: The last save's handle: its group decision is waited for before the next save.
        self._last: aiosnap.SaveHandle | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def _open(self) -> tuple[anyio.from_thread.BlockingPortal, aiosnap.CheckpointManager]:
        if self._portal is None or self._manager is None:
            portal_cm = anyio.from_thread.start_blocking_portal()
            portal = portal_cm.__enter__()
            try:
                manager = portal.call(self._make)  # built in its loop: it opens its groups there
                manager_cm = portal.wrap_async_context_manager(manager)
                manager_cm.__enter__()
            except BaseException:
                portal_cm.__exit__(None, None, None)
                raise
            self._portal_cm, self._portal = portal_cm, portal
            self._manager_cm, self._manager = manager_cm, manager
            # A script that dies of an exception never calls close(): the manager is
            # closed at exit (its peers close theirs there too), else the portal's loop
            # would be left running tasks that wait on the group.
            self._finalizer = weakref.finalize(self, _close_quietly, manager_cm, portal_cm)
        return self._portal, self._manager

    def _call(self, fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        portal, _ = self._open()
        return portal.call(functools.partial(fn, *args, **kwargs))

    @property
    def manager(self) -> aiosnap.CheckpointManager:
        return self._open()[1]

    def save(self, step: int, state: object) -> None:
        """Save ``state`` as this rank's part of ``step``; return once it is captured.

        First waits for the group's decision on the previous save (usually long made: a
        save's commit overlaps the training steps until the next one) and raises its
        failure, so every rank raises at the same call: one rank leaving the training loop
        while another goes on into the next collective would hang the job."""
        self._call(self._save, step, state)

    async def _save(self, step: int, state: object) -> None:
        manager = self.manager
        last, self._last = self._last, None
        if last is not None:
            try:
                await last.wait()
            except Exception:
                manager.take_failures()  # raised here, on every rank alike: not again later
                raise
        self._last = await manager.save(step, state, force=True)

    def restore(self, step: int | None = None) -> aiosnap.Restored | None:
        """This rank's part of ``step`` (the newest valid one for None; None if none)."""
        if step is None:
            return self._call(self.manager.resume)
        return self._call(self.manager.restore, step)

    def steps(self) -> list[int]:
        return self._call(self.manager.steps)

    def flush(self) -> None:
        """Block until every save so far is committed by the group (or raise its failure)."""
        if self._manager is not None:
            self._last = None
            self._call(self._manager.flush)

    def close(self) -> None:
        """Flush, close the manager and stop the loop; raise a failure not reported yet."""
        manager_cm, portal_cm = self._manager_cm, self._portal_cm
        self._manager_cm = self._manager = self._portal_cm = self._portal = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if portal_cm is not None and manager_cm is not None:
            _close(manager_cm, portal_cm)


def _close(
    manager_cm: AbstractContextManager[aiosnap.CheckpointManager],
    portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal],
) -> None:
    try:
        manager_cm.__exit__(None, None, None)
    finally:
        portal_cm.__exit__(None, None, None)


def _close_quietly(
    manager_cm: AbstractContextManager[aiosnap.CheckpointManager],
    portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal],
) -> None:
    try:
        _close(manager_cm, portal_cm)
    except Exception:
        logger.exception("a checkpoint save of the group failed (found while closing at exit)")
