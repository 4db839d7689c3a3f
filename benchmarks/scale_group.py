"""A large group's save votes in one process: each rank an asyncio task, through the real
``Member.vote``, its channel a ``MemoryGroup``'s (``aiosnap._dist.memory``), rank 0
committing with the real ``StepDirectories`` (the manifest written to disk).

What a rank's file would say is given (``reports``: rank -> FileReport, such as
``scale_layouts.Layout.report``), computed in a worker thread as the real report is
read back from the file there. The scale benchmark and tests (issue 42) use it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from aiosnap._base import heap, offload
from aiosnap._base.tasks import SaveFailure
from aiosnap._dist.memory import ManualClock, MemoryGroup
from aiosnap._dist.messages import FileReport
from aiosnap._manager.layouts import StepDirectories
from aiosnap._manager.member import Member
from aiosnap._manager.records import CheckpointRecord
from aiosnap._save.handle import Resolver, SaveHandle, SaveStats
from aiosnap._storage.local import LocalStorage

Reports = Callable[[int], FileReport]


class ReportedLayout(StepDirectories):
    """A group's directory of step directories, whose ranks' reports are given."""

    def __init__(self, directory: str, reports: Reports) -> None:
        pattern = re.compile(r"step_(?P<step>\d+)")
        super().__init__(LocalStorage(), directory, pattern, False, writable=True)
        self.reports = reports

    async def report(
        self, stats: SaveStats, rank: int, replicated: list[str], compare: bool, *, stores: bool
    ) -> FileReport:
        return await offload.run_io(self._report, rank)

    def _report(self, rank: int) -> FileReport:
        # Each rank's report is built in a heap of its own in a real group: here, the
        # collections its objects would set off would stall rank 0 as they do not there.
        with heap.gc_paused(keep=True):
            return self.reports(rank)


class SimGroup:
    """``size`` members voting on saves in one event loop (see the module docstring)."""

    def __init__(
        self, size: int, directory: Path, reports: Reports, *, timeout: float = 300.0, manual: bool = False
    ) -> None:
        self.size, self.directory = size, directory
        self.clock = ManualClock() if manual else None
        self.votes = MemoryGroup(size, timeout=timeout, clock=self.clock)
        self.control = MemoryGroup(size, timeout=timeout, clock=self.clock)
        self.layout = ReportedLayout(str(directory), reports)
        self.members = [self.member(r) for r in range(size)]

    def member(self, rank: int) -> Member:
        """A fresh member of ``rank`` (a restarted process), with channels of its own."""
        votes, control = self.votes.channel(rank), self.control.channel(rank)
        return Member(votes, control, layout=self.layout, catalog=None, replicated=[])

    def restart(self, rank: int) -> None:
        """``rank``'s process starts again: what its member remembered is gone (its
        channels' places in the order of exchanges are kept, as a real group's would be
        agreed again at open)."""
        old = self.members[rank]
        fresh = Member(old.votes, old.channel(True), layout=self.layout, catalog=None, replicated=[])
        self.members[rank] = fresh

    async def save(
        self,
        step: int,
        *,
        ranks: range | list[int] | None = None,
        failing: dict[int, Exception] | None = None,
        voted: Callable[[int], Any] | None = None,
    ) -> list[SaveStats | SaveFailure | BaseException | None]:
        """Every rank of ``ranks`` (all) votes on ``step``: each one's outcome (None for a
        rank that did not vote). ``failing``: ranks whose own save failed, with what.
        ``voted(rank)`` is called as each rank's vote ends."""
        record = CheckpointRecord(step, f"step_{step:08d}")
        (self.directory / record.file).mkdir(parents=True, exist_ok=True)
        outcomes: list[SaveStats | SaveFailure | BaseException | None] = [None] * self.size
        failing = failing or {}

        async def vote(rank: int) -> None:
            member = self.members[rank]
            turn = member.votes.turn(f"save step {record.step}")
            path = str(self.directory / record.file / f"rank_{rank:05d}")
            inner: SaveHandle | BaseException
            if rank in failing:
                inner = failing[rank]
            else:
                done = Resolver(path)
                done.finish(SaveStats(path, 1, 0.0, 0.0, 0.0, 0.0, 0.0))
                inner = done.handle
            outer = Resolver(path)
            await member.vote(turn, inner, record, outer, lambda exc: SaveFailure(path, exc))
            result = await outer.handle.outcome()
            outcomes[rank] = result.error if isinstance(result, SaveFailure) else result
            if voted is not None:
                voted(rank)

        async with anyio.create_task_group() as tg:
            for r in range(self.size) if ranks is None else ranks:
                tg.start_soon(vote, r)
        return outcomes


class Heartbeat:
    """A task that ticks every millisecond on the loop: how late it woke, at worst, is
    how long the loop was blocked."""

    def __init__(self) -> None:
        self.worst = 0.0
        #: (when it woke, how late) of each tick.
        self.ticks: list[tuple[float, float]] = []
        self._stop = anyio.Event()

    def reset(self) -> None:
        self.worst = 0.0
        self.ticks = []

    async def run(self) -> None:
        while not self._stop.is_set():
            start = anyio.current_time()
            await anyio.sleep(0.001)
            woke = anyio.current_time()
            self.ticks.append((woke, woke - start - 0.001))
            self.worst = max(self.worst, woke - start - 0.001)

    def worst_within(self, windows: list[tuple[float, float]]) -> float:
        """The worst block that overlapped one of ``windows`` (loop time): rank 0's
        work, while the other ranks of the simulation only wait for its verdict."""
        return max(
            (late for woke, late in self.ticks for s, e in windows if woke >= s and woke - late <= e),
            default=0.0,
        )

    def stop(self) -> None:
        self._stop.set()
