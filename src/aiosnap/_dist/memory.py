"""A group of ranks in one event loop: tasks as ranks, messages in memory.

Tests and benchmarks of large groups (1,024 ranks and more on a laptop) run each rank
as an asyncio task of one loop, each with a ``GroupChannel`` of its own: the exchanges,
deadlines, sequence checks and verdicts are the real ones (``group``), only the
carriage differs. Messages are encoded as JSON bytes as gloo's are, so what is counted
is what a real group would send. Production never uses this: a real group is gloo's
(``coord``).

Deadlines run by a ``Clock``: the loop's own (``RealClock``), or a ``ManualClock``
that moves only when a test moves it, once it saw (``MemoryGroup.waiting_for``) that
rank 0 waits for nobody but the ranks it made silent. A rank made to die (``kill``)
looks as a dead process does to gloo: its connection closes.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, final

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._base import offload as _offload
from .._base.typed import decode
from .group import (
    MAX_MESSAGE,
    Clock,
    DeadlineMissed,
    GroupChannel,
    RealClock,
    accept,
    decode_json,
    encode_json,
)
from .messages import Envelope, Outcome

_GONE = "is gone: its connection closed (the process died or exited)"


@final
class ManualClock:
    """Time that passes only when ``advance`` says: deadlines without racing the clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self._scopes: dict[int, tuple[float, anyio.CancelScope]] = {}

    @contextmanager
    def move_on_after(self, seconds: float) -> Iterator[anyio.CancelScope]:
        with anyio.CancelScope() as scope:
            self._scopes[id(scope)] = (self.now + seconds, scope)
            try:
                yield scope
            finally:
                del self._scopes[id(scope)]

    def advance(self, seconds: float) -> None:
        """Move time on: every deadline now past cancels its scope."""
        self.now += seconds
        for deadline, scope in list(self._scopes.values()):
            if deadline <= self.now:
                scope.cancel()


@dataclass
class Traffic:
    """What the ranks of a ``MemoryGroup`` sent, counted since it was made."""

    #: Bytes each rank sent to rank 0.
    sent: list[int]
    #: Messages each rank sent or received.
    messages: list[int]
    #: Process CPU seconds from rank 0 having every message of an exchange to its
    #: verdict sent: the other ranks only wait meanwhile, so this is rank 0's work.
    rank0_cpu: float = 0.0
    #: The same spans in the loop's time (start, end): while the other ranks only wait.
    windows: list[tuple[float, float]] = field(default_factory=list)


@final
class MemoryGroup:
    """``size`` ranks in one event loop (see the module docstring); ``channel(r)`` is
    rank r's, made once each."""

    def __init__(self, size: int, *, timeout: float, clock: Clock | None = None) -> None:
        self.size, self.timeout = size, timeout
        self.clock: Clock = clock or RealClock()
        self.traffic = Traffic([0] * size, [0] * size)
        self.dead: set[int] = set()
        #: Rank 0's mail: each rank's messages, and the ranks in order of arrival.
        self._inbox: list[deque[bytes | None]] = [deque() for _ in range(size)]
        self._ready: deque[int] = deque()
        self._arrived = anyio.Event()
        self._down: list[tuple[MemoryObjectSendStream[bytes], MemoryObjectReceiveStream[bytes]]] = [
            anyio.create_memory_object_stream[bytes](math.inf) for _ in range(size)
        ]
        self._watch: list[tuple[set[int], anyio.Event]] = []
        self._started = (0.0, 0.0)

    def channel(self, rank: int) -> GroupChannel:
        return GroupChannel(MemoryTransport(self, rank), timeout=self.timeout)

    def kill(self, rank: int) -> None:
        """``rank``'s process died: its connections close (cancel its task yourself)."""
        self.dead.add(rank)
        if rank == 0:
            for send, _ in self._down:
                send.close()
        else:
            self._post(rank, None)

    def waiting_for(self, ranks: set[int]) -> anyio.Event:
        """Set once rank 0 waits in an exchange for none but (some of) ``ranks``."""
        event = anyio.Event()
        self._watch.append((set(ranks), event))
        return event

    def _post(self, rank: int, data: bytes | None) -> None:
        self._inbox[rank].append(data)
        self._ready.append(rank)
        self._arrived.set()

    def _waiting(self, pending: set[int]) -> None:
        for ranks, event in self._watch:
            if pending <= ranks:
                event.set()
        self._watch = [(r, e) for r, e in self._watch if not e.is_set()]

    async def gather(self, envelope: Envelope, silence: float) -> tuple[list[Any], dict[int, str]]:
        timeout = silence
        pending = set(range(1, self.size))
        raw: dict[int, bytes] = {}
        failed: dict[int, str] = {}
        later: list[int] = []  # ranks whose message is for a later exchange
        with self.clock.move_on_after(timeout):
            while pending:
                while self._ready and pending:
                    r = self._ready.popleft()
                    if r not in pending:
                        later.append(r)
                        continue
                    pending.discard(r)
                    data = self._inbox[r].popleft()
                    if data is None:
                        failed[r] = _GONE
                    elif len(data) > MAX_MESSAGE:
                        failed[r] = f"sent a message of {len(data)} bytes"
                    else:
                        raw[r] = data
                if pending:
                    self._arrived = anyio.Event()
                    self._waiting(pending)
                    await self._arrived.wait()
        self._ready.extend(later)
        failed.update({r: f"did not answer within {timeout:g} s" for r in pending})
        self._started = (time.process_time(), anyio.current_time())
        bodies, more = await _offload.run_coord(accept, envelope, raw)
        failed.update(more)
        return [envelope.body] + [bodies.get(r) for r in range(1, self.size)], failed

    async def scatter(self, verdict: Outcome, skip: set[int]) -> None:
        data = encode_json(verdict.to_json())
        for r in range(1, self.size):
            if r not in skip and r not in self.dead:
                self._down[r][0].send_nowait(data)
                self.traffic.messages[r] += 1
        cpu, start = self._started
        self.traffic.rank0_cpu += time.process_time() - cpu
        self.traffic.windows.append((start, anyio.current_time()))

    async def send_and_receive(self, rank: int, envelope: Envelope, silence: float) -> Outcome:
        timeout = silence
        if 0 in self.dead:
            raise RuntimeError("rank 0's connection closed")
        data = encode_json(envelope.to_json())
        self.traffic.sent[rank] += len(data)
        self.traffic.messages[rank] += 1
        self._post(rank, data)
        with self.clock.move_on_after(2 * timeout) as scope:
            try:
                answer = await self._down[rank][1].receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                raise RuntimeError("rank 0's connection closed") from None
        if scope.cancelled_caught:
            raise DeadlineMissed
        try:
            return decode(Outcome, decode_json(answer))
        except ValueError:
            raise RuntimeError("rank 0 sent a malformed outcome") from None


@final
class MemoryTransport:
    """One rank's carriage in a ``MemoryGroup``."""

    def __init__(self, group: MemoryGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size
        self.clock = group.clock

    async def gather(self, envelope: Envelope, silence: float) -> tuple[list[Any], dict[int, str]]:
        return await self.group.gather(envelope, silence)

    async def scatter(self, verdict: Outcome, skip: set[int], silence: float) -> None:
        await self.group.scatter(verdict, skip)

    async def send_and_receive(self, envelope: Envelope, silence: float) -> Outcome:
        if self.rank in self.group.dead:
            raise RuntimeError("this rank's connection closed")
        return await self.group.send_and_receive(self.rank, envelope, silence)

    def close(self) -> None:
        pass
