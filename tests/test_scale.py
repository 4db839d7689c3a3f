"""Large groups in one process (issue 42): hundreds of ranks as tasks of one event loop,
voting through the real ``Member.vote`` over the in-process channel
(``aiosnap._dist.memory``), rank 0 writing the real manifest.

The commit's manifest is the one ``decisions.commit`` makes of every rank's whole
report, whether the ranks sent them whole or as digests; a silent, dead or failing
rank makes every other rank raise RankFailedError naming it, and nothing hangs.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
import pytest

from aiosnap._base.errors import RankFailedError
from aiosnap._dist.decisions import commit
from aiosnap._dist.messages import FileReport, ShardBox
from aiosnap._format.manifest import read_manifest
from aiosnap._save.handle import SaveStats
from aiosnap._storage.local import LocalStorage

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from scale_group import SimGroup
from scale_layouts import Layout


@dataclass(frozen=True)
class Tiny:
    """A state of 64 DTensors, each split over every rank, and a leaf of each rank's own:
    a small layout, the way of FSDP (the llama-7B one is ``scale_layouts.Layout``)."""

    size: int

    def report(self, rank: int) -> FileReport:
        shape = [2 * self.size, 4]
        shards = [
            ShardBox(f"model.w{i}", f"t{i}", "float32", shape, [2 * rank, 0], [2, 4]) for i in range(64)
        ]
        leaves = {**{f"optim.state.w{i}.step": "3f800000" for i in range(64)}, "rng": f"{rank:08x}"}
        return FileReport(False, f"{rank:08x}", 4096, ["0", "00000000"], shards, leaves)


class Steps:
    """The reports of ``layout``'s ranks at the current step: each rank's checksum and
    size change from step to step (its file does), its boxes do not unless told."""

    def __init__(self, layout: Layout | Tiny) -> None:
        self.layout, self.step = layout, 0
        self.changed: dict[int, FileReport] = {}

    def report(self, rank: int) -> FileReport:
        base = self.changed.get(rank) or self.layout.report(rank)
        return replace(base, checksum=f"{self.step:04x}{rank:04x}", bytes=base.bytes + self.step)

    def manifest(self, step: int) -> object:
        return commit(step, None, [self.report(r) for r in range(self.layout.size)], [])


async def saved(group: SimGroup, steps: Steps, step: int) -> tuple[list[int], list[int]]:
    """Every rank saves ``step``; the bytes and messages each rank sent to rank 0 for it."""
    steps.step = step
    traffic = group.votes.traffic
    sent, messages = list(traffic.sent), list(traffic.messages)
    outcomes = await group.save(step)
    assert all(isinstance(o, SaveStats) for o in outcomes), [
        o for o in outcomes if not isinstance(o, SaveStats)
    ]
    on_disk = read_manifest(LocalStorage(), str(group.directory / f"step_{step:08d}"))
    assert on_disk == steps.manifest(step)
    return (
        [b - a for a, b in zip(sent, traffic.sent, strict=True)],
        [b - a for a, b in zip(messages, traffic.messages, strict=True)],
    )


async def test_a_commit_of_256_ranks_is_the_manifest_of_their_whole_reports(tmp_path: Path) -> None:
    steps = Steps(Tiny(256))
    group = SimGroup(256, tmp_path, steps.report)
    sent, messages = await saved(group, steps, 1)
    assert min(sent[1:]) > 5000  # the first commit: whole reports
    sent, messages = await saved(group, steps, 2)
    # Steady state: a digest of the layout and of the leaves every rank shares, one
    # message to rank 0 and one back.
    assert max(sent[1:]) <= 1024, max(sent[1:])
    assert set(messages[1:]) == {2}


async def test_a_changed_layout_is_sent_whole_and_a_restarted_rank_0_asks_again(tmp_path: Path) -> None:
    steps = Steps(Tiny(64))
    group = SimGroup(64, tmp_path, steps.report)
    await saved(group, steps, 1)
    await saved(group, steps, 2)
    # Rank 3's boxes are renamed (a new entry name): its report goes whole, the others'
    # stay digests, and the manifest holds the new names.
    old = steps.layout.report(3)
    steps.changed[3] = replace(old, shards=[replace(b, name=b.name + "x") for b in old.shards])
    sent, messages = await saved(group, steps, 3)
    assert sent[3] > 5000 and max(sent[4:]) <= 1024
    assert set(messages[1:]) == {2}
    # A new leaf differs on rank 5 only: rank 0 cannot expand its leaves' digest, asks
    # it for its whole report in the same turn, and the manifest names the leaf per-rank.
    steps.changed[5] = replace(steps.layout.report(5), leaves={**steps.layout.report(5).leaves, "x": "5"})
    sent, messages = await saved(group, steps, 4)
    assert messages[5] == 4 and messages[6] == 4  # every rank takes the second exchange
    assert sent[5] > 5000 and sent[6] < 1024
    # Rank 0 restarted: it holds nobody's layout, so every rank sends its whole report again.
    group.restart(0)
    sent, messages = await saved(group, steps, 5)
    assert min(sent[1:]) > 1024 and set(messages[1:]) == {4}
    # A restarted rank 9 knows of no earlier commit: it sends whole at once.
    group.restart(9)
    sent, messages = await saved(group, steps, 6)
    assert sent[9] > 5000 and max(sent[10:]) <= 1024 and set(messages[1:]) == {2}
    # A save that failed (rank 7's disk) changes nobody's layout: the next goes on in digests.
    steps.step = 7
    failed = await group.save(7, failing={7: OSError("No space left on device")})
    assert all(isinstance(o, RankFailedError) for o in failed)
    sent, messages = await saved(group, steps, 8)
    assert max(sent[1:]) <= 1024 and set(messages[1:]) == {2}


def small(rank: int) -> FileReport:
    """A rank's report of a small state of 1,000 ranks: a box of a DTensor, a leaf of its own."""
    box = ShardBox("w", "t0", "float32", [1000], [rank], [1])
    return FileReport(False, f"{rank:08x}", 100, ["0", "00000000"], [box], {"step": "1", f"rng{rank}": "x"})


async def test_a_silent_rank_of_1000_fails_every_other_and_nothing_hangs(tmp_path: Path) -> None:
    group = SimGroup(1000, tmp_path, small, timeout=60.0, manual=True)
    silent = 617
    outcomes: list[object] = []

    async def run() -> None:
        outcomes.extend(await group.save(1, ranks=[r for r in range(1000) if r != silent]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await group.votes.waiting_for({silent}).wait()  # rank 0 waits for it alone
        assert group.clock is not None
        group.clock.advance(61.0)
    errors = [o for r, o in enumerate(outcomes) if r != silent]
    assert all(isinstance(e, RankFailedError) and set(e.failed) == {silent} for e in errors), errors[:3]
    assert "did not answer within 60 s" in str(errors[0])


async def test_a_failing_rank_of_1000_fails_every_other(tmp_path: Path) -> None:
    group = SimGroup(1000, tmp_path, small)
    outcomes = await group.save(1, failing={421: OSError("No space left on device")})
    assert all(isinstance(e, RankFailedError) and set(e.failed) == {421} for e in outcomes)
    assert isinstance(outcomes[421], RankFailedError) and isinstance(outcomes[421].__cause__, OSError)
    assert "No space left on device" in str(outcomes[17])
    # The failure was orderly: the group goes on, and the next save commits.
    assert all(isinstance(o, SaveStats) for o in await group.save(2))


async def test_a_dead_rank_of_1000_fails_every_other_at_once(tmp_path: Path) -> None:
    group = SimGroup(1000, tmp_path, small, timeout=3600.0)
    group.votes.kill(200)  # its process died: its connection closed
    outcomes = await group.save(1, ranks=[r for r in range(1000) if r != 200])
    errors = [o for r, o in enumerate(outcomes) if r != 200]
    assert all(isinstance(e, RankFailedError) and set(e.failed) == {200} for e in errors)
    assert "is gone" in str(errors[0])


@pytest.mark.slow
@pytest.mark.parametrize("size", [256, 1024])
async def test_a_commit_of_a_7b_fsdp_state_in_steady_state_sends_digests(tmp_path: Path, size: int) -> None:
    steps = Steps(Layout(size, size))
    group = SimGroup(size, tmp_path, steps.report)
    await saved(group, steps, 1)
    sent, messages = await saved(group, steps, 2)
    assert max(sent[1:]) <= 1024 and set(messages[1:]) == {2}


# -- a real group's connections ------------------------------------------------------------
def _sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            pass
    return count


async def _channels_connect_lazily(rank: int, world: int) -> dict[str, Any]:
    from aiosnap._dist import coord

    before = _sockets()
    votes, control = await coord.channels(None, 60.0)
    made = _sockets()

    async def total(bodies: list[Any]) -> int:
        return sum(bodies)

    async with votes.turn("sum") as turn:
        result = await turn.exchange(rank, total)
    async with control.turn("sum") as turn:
        again = await turn.exchange(rank, total)
    used = _sockets()
    votes.close()
    control.close()
    return {"opened": made - before, "after": used - before, "results": [result, again]}


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts sockets in /proc")
def test_a_real_groups_channels_connect_each_rank_to_rank_0_only() -> None:
    from .test_distributed import run_ranks

    results = run_ranks(4, _channels_connect_lazily)
    assert all(r["results"] == [6, 6] for r in results.values()), results
    # Each channel's group listens (a socket each) and connects each rank to rank 0 as it
    # is made: a rank other than 0 holds 4 sockets for the two channels, not the 8 of
    # gloo's full mesh (a listener and 3 peers each); one more if the store's is counted.
    assert all(results[r]["opened"] <= 5 for r in range(1, 4)), results
    assert all(results[r]["after"] <= 5 for r in range(1, 4)), results
