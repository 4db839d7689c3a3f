"""Rank 0 of a large group frees what it decoded of the ranks' reports in worker threads,
a rank at a time, never on the event loop (issue 42: "the event loop never blocked for
more than 50 ms during a commit" at 1,024 ranks).

At 1,024 ranks a first commit's decoded reports are a million objects: dropped on the
loop, their deallocation, and the memory arenas it gave back to the system, stalled it
~0.3 s twice per commit, and the digests held from one commit to the next (the last
objects left in ~1 GiB of arenas) ~0.1 s at the next (``benchmarks/scale_rank0.py``).
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from aiosnap._dist.group import GroupChannel, RealClock
from aiosnap._dist.messages import Envelope, FileReport, Outcome, ShardBox
from aiosnap._manager.reports import Collected, Keeper, Sender

RANKS = 100  # over the 64 ranks whose messages rank 0 handles on the loop


class Witness:
    """A rank's decoded message, as far as the channel knows: it notes the thread it died on."""

    died: ClassVar[list[int]] = []

    def __del__(self) -> None:
        Witness.died.append(threading.get_ident())


class Given:
    """Rank 0's transport, each other rank's body a ``Witness``."""

    rank, size, clock = 0, RANKS, RealClock()

    async def gather(self, envelope: Envelope, silence: float) -> tuple[list[Any], dict[int, str]]:
        return [envelope.body] + [Witness() for _ in range(1, self.size)], {}

    async def scatter(self, verdict: Outcome, skip: set[int], silence: float) -> None:
        pass

    async def send_and_receive(self, envelope: Envelope, silence: float) -> Outcome:
        raise AssertionError("rank 0 only gathers and scatters")

    def close(self) -> None:
        pass


async def test_rank_0_frees_a_large_groups_messages_in_a_worker_thread() -> None:
    channel = GroupChannel(Given(), timeout=60.0)
    seen: list[int] = []

    async def decide(bodies: list[Any]) -> Any:
        seen.append(len(bodies))
        return "ok"

    Witness.died.clear()
    assert await channel.exchange("save", None, decide) == "ok"
    assert seen == [RANKS]
    loop = threading.get_ident()
    assert len(Witness.died) == RANKS - 1, "every message is freed by the time the exchange returns"
    assert loop not in Witness.died, "a message was freed on the event loop"


def report(rank: int) -> FileReport:
    """A rank's report: 32 DTensors split over every rank, and a leaf of its own."""
    shards = [ShardBox(f"w{i}", f"t{i}", "float32", [RANKS, 4], [rank, 0], [1, 4]) for i in range(32)]
    return FileReport(False, f"{rank:08x}", 4096, ["0", "00000000"], shards, {"rng": f"{rank:08x}"})


def test_a_large_settle_leaves_nothing_of_the_reports_to_free_and_adopt_frees_the_last_commits() -> None:
    # Member runs both calls in a worker thread for a large group: whatever they do not
    # free, the event loop frees when the vote's frames end.
    keeper, senders = Keeper(), [Sender() for _ in range(RANKS)]
    held = []
    for step in (1, 2):
        bodies = [senders[r].prepare(report(r), r == 0)[0] for r in range(RANKS)]
        first = Collected()
        settled = keeper.settle(step, None, bodies, first, [])
        assert settled.manifest is not None and not settled.resend
        assert first.reports == [], "the decoded reports are left for the vote's end"
        assert settled.held is not None
        keeper.adopt(settled.held)
        held.append(settled.held)
        for r in range(RANKS):
            senders[r].committed(senders[r].prepare(report(r), r == 0)[1], list(settled.manifest.per_rank))
    assert keeper.held is held[1] and len(held[1].layouts) == RANKS
    assert held[0].layouts == {}, "the last commit's layouts are left to whoever drops them"
