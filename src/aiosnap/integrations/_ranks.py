"""Every rank of a torch.distributed run agreeing on how a framework's save went.

A framework that saves from one rank (ppe's ``saver_rank``, Lightning's DDP: rank 0)
leaves the other ranks blind to that rank's failure: they wait at the next collective
until it times out, or train on while no checkpoint is written. ``RankAgreement`` is the
blocking front of aiosnap's own group exchange (``_dist.coord``: a gloo group of its own,
messages through rank 0, every wait bounded by ``timeout`` seconds of silence): each rank
says how its part went, and either every rank returns or every rank raises -- the
failing rank its own error, the others ``RankFailedError`` naming it. A rank that died
or went silent makes the others raise once the timeout passes; nothing waits forever.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import anyio.from_thread

from aiosnap._base.errors import RankFailedError

__all__ = ["RankAgreement", "group_size"]


def group_size(group: Any = None) -> tuple[int, int]:
    """This process's rank and the group's size: (0, 1) without torch.distributed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    from aiosnap._dist.coord import rank_and_size

    return rank_and_size(group)


class RankAgreement:
    """Agreements among the ranks of ``group`` (the default group if None); every rank
    calls ``agree`` with the same ``op`` at the same point of its program. Opened on the
    first agreement (which creates the gloo group, on every rank), closed with ``close``
    (or at exit: the loop's thread is a daemon, which would be frozen mid-call if the
    interpreter collected an open portal while shutting down).
    """

    def __init__(self, group: Any = None, *, timeout: float = 300.0) -> None:
        self._parent, self.timeout = group, timeout
        self.rank, self.size = group_size(group)
        self._open: _Open | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def open(self) -> None:
        """Start the loop and create the gloo group (a collective: every rank calls it,
        at the same point -- best where the ranks set up together, not in a save).
        Nothing to open in a process on its own."""
        if self.size == 1 or self._open is not None:
            return
        opened = _Open()
        self._finalizer = weakref.finalize(self, opened.close)
        self._open = opened
        opened.portal.call(functools.partial(opened.connect, self._parent, self.timeout))

    def agree(self, op: str, error: BaseException | None = None, value: Any = None) -> list[Any]:
        """Tell every rank how this rank's part of ``op`` went (``error``, or None and a
        JSON ``value``); return every rank's value, in rank order, once all are known.
        If any rank failed, raise here: ``error`` itself on the rank that had it (with a
        note), ``RankFailedError`` naming the failed ranks on every other."""
        if self.size == 1:
            if error is not None:
                raise error
            return [value]
        self.open()
        assert self._open is not None
        try:
            result: list[Any] = self._open.portal.call(functools.partial(self._open.agree, op, error, value))
        except RankFailedError as failed:
            if error is not None:
                error.add_note(f"aiosnap: every rank of the group raised ({failed})")
                raise error from None
            raise
        return result

    def close(self) -> None:
        """Release the gloo group and stop the loop; a later agreement opens them again."""
        finalizer, self._finalizer, self._open = self._finalizer, None, None
        if finalizer is not None:
            finalizer()


class _Open:
    """An open agreement's loop (a blocking portal) and channel."""

    def __init__(self) -> None:
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        self.channel: Any = None

    async def connect(self, parent: Any, silence: float) -> None:
        from aiosnap._base import offload
        from aiosnap._dist.coord import GlooChannel, new_group

        group = await offload.run_coord(new_group, parent, silence)
        self.channel = GlooChannel(group, timeout=silence, destroy=parent is None)

    async def agree(self, op: str, error: BaseException | None, value: Any) -> list[Any]:
        async def work() -> Any:
            if error is not None:
                raise error
            return value

        async def decide(values: list[Any]) -> list[Any]:
            return values

        async with self.channel.turn(op) as turn:
            result: list[Any] = await turn.agree(work, decide)
        return result

    def close(self) -> None:
        # The loop first, then the group, from the thread that closes (the channel lets go
        # of its group there: see ``GlooChannel.close``).
        try:
            self._portal_cm.__exit__(None, None, None)
        finally:
            if self.channel is not None:
                self.channel.close()
