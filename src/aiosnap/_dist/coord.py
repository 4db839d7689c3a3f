"""The channel of a real group: torch.distributed (gloo), over a process group of its own.

This and ``_shards`` (for DTensors, which only a user of torch.distributed has) are
the only modules that touch torch.distributed; a single process never imports them.

How the ranks exchange and agree (through rank 0, with deadlines, checked sequence
numbers) is ``group``'s, whatever carries the messages; here is what carries them
between processes: gloo's point-to-point sends and receives, each blocking call in a
coordination thread (``run_coord``) with a deadline of its own.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, final

import torch
import torch.distributed as dist

from .._base import offload as _offload
from .._base.typed import decode
from .group import (
    MAX_MESSAGE,
    Clock,
    DeadlineMissed,
    GroupChannel,
    GroupTurn,
    RealClock,
    accept,
    decode_json,
    encode_json,
    reason,
)
from .messages import Envelope, Outcome

logger = logging.getLogger(__name__)

_TAG = 7
_HELLO = 8  # the first message of each rank to rank 0, at the group's creation
#: The turns of a gloo group: ``group``'s, whatever carries the messages.
GlooTurn = GroupTurn


def rank_and_size(parent: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``parent`` (the default group if None), and its size."""
    if parent is not None:
        return dist.get_rank(parent), dist.get_world_size(parent)
    return dist.get_rank(), dist.get_world_size()


async def channels(parent: dist.ProcessGroup | None, silence: float) -> tuple[GlooChannel, GlooChannel]:
    """Two channels over gloo groups of their own: one for the votes, one for the
    triggers' decisions (those never wait behind a vote)."""
    made = []
    for _ in range(2):
        group = await _offload.run_coord(new_group, parent, silence)
        made.append(GlooChannel(group, timeout=silence, destroy=parent is None))
    return made[0], made[1]


def new_group(parent: dist.ProcessGroup | None, timeout: float) -> dist.ProcessGroup:
    """A gloo group over the ranks of ``parent`` (the default group if None). Blocking.

    Over a subgroup only its members call this, so the group synchronizes locally; such
    a group is named after its ranks, and a name freed by destroying it would be reused
    with the rendezvous keys of the old group still in the store (the next creation
    hangs). So only groups over all ranks are destroyed at close (see ``Channel.close``)."""
    group = lazy_group(parent, timeout)
    _connect_to_rank_0(group, timeout)
    return group


def lazy_group(parent: dist.ProcessGroup | None, timeout: float) -> dist.ProcessGroup:
    """A gloo group over the ranks of ``parent``, its pairs connected at their first
    message (``_lazy_connections``): ``new_group``'s, and ``peers``' links'. Blocking."""
    ranks = None if parent is None else dist.get_process_group_ranks(parent)
    with _lazy_connections():
        group = dist.new_group(
            ranks=ranks,
            backend="gloo",
            timeout=datetime.timedelta(seconds=timeout),
            use_local_synchronization=parent is not None,
        )
    assert isinstance(group, dist.ProcessGroup)  # this rank is a member
    return group


def _connect_to_rank_0(group: dist.ProcessGroup, timeout: float) -> None:
    """Connect each rank to rank 0 now, while every rank is here (it is making the group):
    a pair of a lazy group connects at its first message, and a first message to a rank
    that died meanwhile (with the store it hosted, rank 0) waits out the whole deadline,
    where a connection made before is seen closed at once. Blocking."""
    token = torch.zeros(1, dtype=torch.uint8)
    deadline = time.monotonic() + timeout
    if group.rank() == 0:
        works = [group.recv([torch.zeros(1, dtype=torch.uint8)], r, _HELLO) for r in range(1, group.size())]
    else:
        works = [group.send([token], 0, _HELLO)]
    for work in works:
        _wait_or_raise(work, deadline)


#: gloo connects every pair of ranks when a group is made, unless this is set as it is
#: made (read once per group, in torch 2.13): then a pair connects at its first message.
#: aiosnap's groups only ever talk to rank 0, so N-1 connections instead of N(N-1)/2.
LAZY_INIT = "TORCH_GLOO_LAZY_INIT"
_environ_lock = threading.Lock()


@contextlib.contextmanager
def _lazy_connections() -> Iterator[None]:
    """Make the gloo groups made meanwhile connect lazily; the user's own are left alone
    (the variable is set only for the call, and as it was before afterwards)."""
    with _environ_lock:
        before = os.environ.get(LAZY_INIT)
        os.environ[LAZY_INIT] = "1"
        try:
            yield
        finally:
            if before is None:
                del os.environ[LAZY_INIT]
            else:
                os.environ[LAZY_INIT] = before


class GlooChannel(GroupChannel):
    """Exchanges of JSON messages among the ranks of ``group`` (gloo), through rank 0."""

    def __init__(self, group: dist.ProcessGroup, *, timeout: float, destroy: bool) -> None:
        # The group only in the transport, which lets go of it at close (see its ``close``).
        super().__init__(GlooTransport(group, destroy=destroy), timeout=timeout)


@final
class GlooTransport:
    """Messages between processes: a length, then the JSON, each a gloo send."""

    clock: Clock = RealClock()

    def __init__(self, group: dist.ProcessGroup, *, destroy: bool) -> None:
        self.group = group
        self._destroy = destroy
        self.rank = group.rank()
        self.size = group.size()
        #: Buffers of receives that missed their deadline: gloo may still write to them.
        self._stale: list[object] = []

    def close(self) -> None:
        """Release the group (destroyed, if it can be: see ``new_group``), and let go of it
        here, in the closing thread. Blocking.

        The offload thread that ran this transport's last call may still hold the
        transport (anyio's worker drops the function it ran only after reporting back). Had
        the transport kept the group, that thread could be the one to free it, and freeing a
        ProcessGroup releases the GIL: if the interpreter began to shut down meanwhile,
        the thread is stopped inside a C++ destructor and the process aborts ("terminate
        called without an active exception", 1 run in 5 of the ppe example at 2 ranks)."""
        group = self.group
        del self.group
        if not self._destroy:
            return
        try:
            dist.destroy_process_group(group)
        except Exception as exc:  # the group may be broken already; closing must not fail
            logger.debug("destroying the coordination group: %r", exc)

    async def gather(self, envelope: Envelope, silence: float) -> tuple[list[Any], dict[int, str]]:
        return await _offload.run_coord(self._gather, envelope, silence)

    async def scatter(self, verdict: Outcome, skip: set[int], silence: float) -> None:
        await _offload.run_coord(self._scatter, verdict, skip, silence)

    async def send_and_receive(self, envelope: Envelope, silence: float) -> Outcome:
        return await _offload.run_coord(self._send_and_receive, envelope, silence)

    def _gather(self, envelope: Envelope, timeout: float) -> tuple[list[Any], dict[int, str]]:
        deadline = time.monotonic() + timeout
        peers = range(1, self.size)
        failed: dict[int, str] = {}
        lengths = {r: torch.zeros(1, dtype=torch.int64) for r in peers}
        waits = {r: self._post_recv(lengths[r], r, failed, timeout) for r in peers}
        buffers: dict[int, torch.Tensor] = {}
        for r in peers:
            if self._wait(waits[r], deadline, failed, r, lengths[r], timeout):
                n = int(lengths[r])
                if 0 < n <= MAX_MESSAGE:
                    buffers[r] = torch.empty(n, dtype=torch.uint8)
                else:
                    failed[r] = f"sent a message of {n} bytes"
        waits = {r: self._post_recv(buf, r, failed, timeout) for r, buf in buffers.items()}
        raw = {
            r: buf.numpy().tobytes()
            for r, buf in buffers.items()
            if self._wait(waits[r], deadline, failed, r, buf, timeout)
        }
        bodies, more = accept(envelope, raw)
        failed.update(more)
        return [envelope.body] + [bodies.get(r) for r in peers], failed

    def _scatter(self, verdict: Outcome, skip: set[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        data = _tensor(encode_json(verdict.to_json()))
        sends = []
        ignored: dict[int, str] = {}
        for r in range(1, self.size):
            try:
                if r not in skip:
                    sends.append((r, self.group.send([_length(data)], r, _TAG)))
                    sends.append((r, self.group.send([data], r, _TAG)))
            except RuntimeError as exc:  # the peer's connection is already closed
                ignored[r] = reason(exc, timeout)
        for r, work in sends:
            self._wait(work, deadline, ignored, r, None, timeout)
        for r, why in ignored.items():
            logger.warning("rank %d did not receive the outcome: it %s", r, why)

    def _send_and_receive(self, envelope: Envelope, timeout: float) -> Outcome:
        # Rank 0 may enter the exchange up to one deadline after this rank does, and
        # then waits up to one deadline for the others: two deadlines in all.
        deadline = time.monotonic() + 2 * timeout
        data = _tensor(encode_json(envelope.to_json()))
        for work in (self.group.send([_length(data)], 0, _TAG), self.group.send([data], 0, _TAG)):
            _wait_or_raise(work, deadline)
        length = torch.zeros(1, dtype=torch.int64)
        self._stale.append(length)
        _wait_or_raise(self.group.recv([length], 0, _TAG), deadline)
        n = int(length)
        if not 0 < n <= MAX_MESSAGE:
            raise RuntimeError(f"rank 0 sent an outcome of {n} bytes")
        buf = torch.empty(n, dtype=torch.uint8)
        self._stale.append(buf)
        _wait_or_raise(self.group.recv([buf], 0, _TAG), deadline)
        del self._stale[-2:]
        try:
            return decode(Outcome, decode_json(buf.numpy().tobytes()))
        except ValueError:
            raise RuntimeError("rank 0 sent a malformed outcome") from None

    def _post_recv(self, buf: torch.Tensor, r: int, failed: dict[int, str], timeout: float) -> Any:
        # Posting fails at once when the peer's connection is already closed.
        try:
            return self.group.recv([buf], r, _TAG)
        except RuntimeError as exc:
            failed[r] = reason(exc, timeout)
            return None

    def _wait(
        self, work: Any, deadline: float, failed: dict[int, str], r: int, buf: object, timeout: float
    ) -> bool:
        if r in failed:
            return False
        try:
            _wait_or_raise(work, deadline)
        except RuntimeError as exc:
            failed[r] = reason(exc, timeout)
            if buf is not None:
                self._stale.append(buf)
            return False
        return True


def _wait_or_raise(work: Any, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineMissed
    try:
        done = work.wait(datetime.timedelta(seconds=left))
    except RuntimeError as exc:
        # gloo enforces the time given itself, and says so only in words ("Timed out
        # waiting 5000ms for recv operation to complete"): translated here, once.
        if "Timed out" in str(exc):
            raise DeadlineMissed(str(exc)) from exc
        raise
    if not done:
        raise DeadlineMissed


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _length(data: torch.Tensor) -> torch.Tensor:
    return torch.tensor([data.numel()], dtype=torch.int64)
