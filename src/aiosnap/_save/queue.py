"""A bounded queue of captured saves, and the slots that bound it (``QueueWriter``).

A save takes a slot when it is admitted and gives it back when the consumer takes it
from the queue, or when it ends before it was queued. ``max_pending`` saves may wait
behind the one being committed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .job import SaveJob
from .options import WhenFull


class SaveQueue:
    """Saves waiting for their commit, committed in order by one consumer (``consume``)."""

    def __init__(self, max_pending: int) -> None:
        self._slots = anyio.Semaphore(max_pending)
        self._send: MemoryObjectSendStream[SaveJob]
        self._receive: MemoryObjectReceiveStream[SaveJob]
        self._send, self._receive = anyio.create_memory_object_stream[SaveJob](max_pending)

    async def admit(self, when_full: WhenFull, skip: Callable[[SaveJob], None]) -> bool:
        """Take a slot for a new save. When none is free: ``"skip"`` refuses the save
        (False), ``"replace"`` takes the oldest waiting save's (ended with ``skip``), and
        ``"block"`` (or a replace with nothing waiting) waits for one."""
        try:
            self._slots.acquire_nowait()
            return True
        except anyio.WouldBlock:
            if when_full == "skip":
                return False
        if when_full == "replace":
            try:
                oldest = self._receive.receive_nowait()
            except anyio.WouldBlock:
                pass
            else:
                skip(oldest)  # its slot passes to the new save
                return True
        await self._slots.acquire()
        return True

    def put(self, job: SaveJob) -> None:
        """Queue ``job``, which holds a slot (so there is room)."""
        self._send.send_nowait(job)

    def free(self) -> None:
        """A save ended before it was queued: its slot is free."""
        self._slots.release()

    def idle(self) -> bool:
        """Whether the consumer waits, so nothing is queued or being committed: a save
        put now goes straight to it, and can never be dropped by ``"replace"``."""
        queue = self._receive.statistics()
        return queue.tasks_waiting_receive > 0 and queue.current_buffer_used == 0

    async def consume(self, commit: Callable[[SaveJob], Awaitable[None]]) -> None:
        """Commit the queued saves in order, until the queue is closed."""
        async with self._receive:
            async for job in self._receive:
                self._slots.release()
                await commit(job)

    def close(self) -> None:
        """No save is queued any more: the consumer ends once the queue is empty."""
        self._send.close()
