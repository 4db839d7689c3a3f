"""A replica of each rank's file on a partner node, and a restore that uses it.

With ``Ranks(replicas=1)`` in a group of several nodes (``nodes``), each rank's
committed file is copied, once the step is committed, to its **partner**: the rank at
the same place in the next node (nodes in the order of their leaders, the last one's
partner in the first), like NVRx's replication jump. The partner commits the bytes in
its node's directory under the sender's name (``step/rank_NNNNN``), durably and checked
(``_dist.peers``): its node then holds that rank's part of the step too. Replication
runs after the commit, in the save's background task: the training loop never waits
for it, and a copy that fails (a partner gone, a full disk) is a warning, never a
failed save, since the step is committed on the nodes already.

Before a restore reads a step, the ranks whose file is missing on their node get it
from the rank whose node holds a replica (``repair``), so a node that lost a file
restores from its partner, not from the remote tier or an older step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, final

import anyio

from .._base import offload as _offload
from .._base.errors import CheckpointError
from .._base.notice import notice
from .._dist.channel import Channel
from .._dist.peers import MAX_TAG, PeerLink, open_peer_link, recv_file, send_file
from .._format.manifest import Manifest, rank_file, read_manifest
from .._storage.protocol import Storage, exists
from .nodes import Nodes
from .records import CheckpointRecord

logger = logging.getLogger(__name__)


def partners(nodes: Nodes) -> list[int]:
    """Each rank's partner: the rank at its place in the next node (the same index, or
    the last one's if that node is smaller); -1 for every rank of a group of one node."""
    leaders = nodes.leaders
    if len(leaders) < 2:
        return [-1] * len(nodes.of)
    members = {lead: nodes.members(lead) for lead in leaders}
    out = []
    for rank, lead in enumerate(nodes.of):
        place = members[lead].index(rank)
        following = members[leaders[(leaders.index(lead) + 1) % len(leaders)]]
        out.append(following[min(place, len(following) - 1)])
    return out


@final
class Replicator:
    """This rank's replicas: its file sent to its partner, its sources' files received
    (see the module docstring). ``link`` is the group's PeerLink."""

    def __init__(self, link: PeerLink, storage: Storage, directory: str, nodes: Nodes) -> None:
        self.link, self.storage, self.directory = link, storage, directory
        self.rank = link.rank
        self.partners = partners(nodes)
        self.partner = self.partners[self.rank]
        #: The ranks whose files this rank keeps a replica of.
        self.sources = [s for s, p in enumerate(self.partners) if p == self.rank]
        #: One replication at a time, in commit order: the ranks' transfers pair up.
        self._order = anyio.Lock()
        #: Transfers made on the link so far, in the same order on every rank: a fresh tag
        #: for each (a failed transfer's tag is never used again, ``peers``).
        self._replications = 0
        self._repairs = 0

    @classmethod
    async def open(
        cls, parent: Any, silence: float, storage: Storage, directory: str, nodes: Nodes, rank: int
    ) -> Replicator:
        """Every rank at once (collective): the link, with this rank's partner and sources
        connected now, so a partner that dies is seen gone at once."""
        mates = partners(nodes)
        near = {mates[rank], *(s for s, p in enumerate(mates) if p == rank)} - {rank, -1}
        link = await open_peer_link(parent, silence, partners=sorted(near))
        return cls(link, storage, directory, nodes)

    def close(self) -> None:
        """Release the link. Blocking."""
        self.link.close()

    def _path(self, record: CheckpointRecord, rank: int) -> str:
        return self.storage.join(self.directory, record.file, rank_file(rank))

    def _tag(self, kind: int, count: int, src: int) -> int:
        """A tag no other transfer on the link has: replications and repairs apart, each
        numbered in the order every rank makes them, per source rank."""
        size = self.link.size
        return ((2 * count + kind) * size + src) % (MAX_TAG + 1)

    # -- after a commit ------------------------------------------------------------------
    async def replicate(self, record: CheckpointRecord, manifest: str) -> None:
        """Send this rank's file of ``record`` to its partner and take its sources' (the
        sizes from ``manifest``, the step's); a failure is a warning. Every rank calls it
        for every committed step, in commit order."""
        async with self._order:
            count = self._replications
            self._replications += 1
            sizes = Manifest.parse(record.file, manifest.encode()).sizes
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._send, record, count)
                    for src in self.sources:
                        tg.start_soon(self._receive, record, count, src, sizes[src])
            except* Exception as group:
                for exc in group.exceptions:
                    notice(logger, f"step {record.step}: a replica on a partner node was not made ({exc})")

    async def _send(self, record: CheckpointRecord, count: int) -> None:
        tag = self._tag(0, count, self.rank)
        await send_file(self.link, self.partner, tag, self.storage, self._path(record, self.rank))

    async def _receive(self, record: CheckpointRecord, count: int, src: int, size: int) -> None:
        tag = self._tag(0, count, src)
        await recv_file(self.link, src, tag, self.storage, self._path(record, src), expected_size=size)

    # -- before a restore ----------------------------------------------------------------
    async def repair(self, votes: Channel, record: CheckpointRecord) -> None:
        """Every member at once, before reading ``record``'s step: a rank whose file is
        missing on its node gets it from a rank whose node holds a replica of it. What
        cannot be had that way is left to the restore (another source, or an older step)."""
        count = self._repairs
        self._repairs += 1

        async def look() -> Any:
            missing = not await _offload.run_io(exists, self.storage, self._path(record, self.rank))
            held = [
                s for s in self.sources if await _offload.run_io(exists, self.storage, self._path(record, s))
            ]
            return {"missing": missing, "held": held}

        async def plan(bodies: list[Any]) -> Any:
            return moves([bool(b["missing"]) for b in bodies], [list(b["held"]) for b in bodies])

        async def done(_: list[Any]) -> Any:
            return None

        async with votes.turn("repair") as turn:
            planned = await turn.agree(look, plan)
            if planned:  # every rank waits for the moves: a rank reads another's file too
                mine = [(int(h), int(r)) for h, r in planned if self.rank in (h, r)]
                if mine:
                    await self._move(record, count, mine)
                await turn.exchange(None, done)

    async def _move(self, record: CheckpointRecord, count: int, mine: list[tuple[int, int]]) -> None:
        step_dir = self.storage.join(self.directory, record.file)
        try:
            sizes = (await _offload.run_io(read_manifest, self.storage, step_dir)).sizes
            async with anyio.create_task_group() as tg:
                for holder, rank in mine:
                    tag = self._tag(1, count, rank)
                    path = self._path(record, rank)
                    if holder == self.rank:
                        tg.start_soon(send_file, self.link, rank, tag, self.storage, path)
                    else:
                        tg.start_soon(_fetch, self.link, holder, tag, self.storage, path, sizes[rank])
        except* (CheckpointError, OSError) as group:
            for exc in group.exceptions:
                notice(logger, f"step {record.step}: a file could not be had from a partner node ({exc})")


async def _fetch(link: PeerLink, holder: int, tag: int, storage: Storage, path: str, size: int) -> None:
    await recv_file(link, holder, tag, storage, path, expected_size=size)
    logger.info("%s: taken from rank %d's node, which held a replica", path, holder)


def moves(missing: Sequence[bool], held: Sequence[Sequence[int]]) -> list[list[int]]:
    """Rank 0: [holder, rank] for each rank whose file is missing on its node and whose
    replica a rank holds (the first such)."""
    out = []
    for rank, lacks in enumerate(missing):
        if lacks:
            holder = next((h for h, got in enumerate(held) if rank in got), None)
            if holder is not None:
                out.append([holder, rank])
    return out
