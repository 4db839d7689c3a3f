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
from types import ModuleType
from typing import TYPE_CHECKING, Any, final

import anyio

from .._base import offload as _offload
from .._base.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from .._base.notice import notice
from .._dist.channel import Channel
from .._format.manifest import MANIFEST_NAME, Manifest, rank_file, rank_of, read_manifest
from .._format.manifest import partners as partners_of
from .._storage.protocol import Storage, get
from .catalog import Catalog
from .nodes import Nodes, refill
from .records import CheckpointRecord

if TYPE_CHECKING:
    from .._dist.peers import PeerLink

logger = logging.getLogger(__name__)


def _peers() -> ModuleType:
    """``_dist.peers``, imported when a group first asks for replicas: it imports
    torch.distributed, which a process on its own never loads (``tests/test_shards.py``)."""
    from .._dist import peers

    return peers


def partners(nodes: Nodes) -> list[int]:
    """Each rank's partner (``_format.manifest.partners``); -1 for every rank of a group
    of one node."""
    return partners_of(nodes.of)


@final
class Replicator:
    """This rank's replicas: its file sent to its partner, its sources' files received
    (see the module docstring). ``link`` is the group's PeerLink."""

    def __init__(self, link: PeerLink, storage: Storage, directory: str, nodes: Nodes) -> None:
        self.link, self.storage, self.directory, self.nodes = link, storage, directory, nodes
        self.rank = link.rank
        self.partners = partners(nodes)
        self.partner = self.partners[self.rank]
        #: The ranks whose files this rank keeps a replica of.
        self.sources = [s for s, p in enumerate(self.partners) if p == self.rank]
        #: One replication at a time, in commit order (``ticket``): the ranks' transfers pair
        #: up, and each gets a fresh tag (a failed transfer's is never used again, ``peers``).
        self._issued = self._serving = 0
        self._turned = anyio.Event()
        self._repairs = 0

    @classmethod
    async def open(
        cls, parent: Any, silence: float, storage: Storage, directory: str, nodes: Nodes, rank: int
    ) -> Replicator:
        """Every rank at once (collective): the link, with this rank's partner and sources
        connected now, so a partner that dies is seen gone at once."""
        mates = partners(nodes)
        near = {mates[rank], *(s for s, p in enumerate(mates) if p == rank)} - {rank, -1}
        link = await _peers().open_peer_link(parent, silence, partners=sorted(near))
        return cls(link, storage, directory, nodes)

    def close(self) -> None:
        """Release the link. Blocking."""
        self.link.close()

    def _path(self, record: CheckpointRecord, rank: int) -> str:
        return self.storage.join(self.directory, record.file, rank_file(rank))

    def _tag(self, kind: int, count: int, index: int) -> int:
        """A tag no other transfer on the link has: replications (``index``: the source
        rank) and repairs (the move's place in the plan) apart, each numbered in the order
        every rank makes them."""
        span = 2 * self.link.size  # a repair plans at most two files per rank
        return ((2 * count + kind) * span + index) % (int(_peers().MAX_TAG) + 1)

    # -- after a commit ------------------------------------------------------------------
    def ticket(self) -> int:
        """The place of a commit among the replications, taken in its vote's turn: the same
        on every rank, whichever vote's task reaches ``replicate`` first."""
        self._issued += 1
        return self._issued - 1

    async def replicate(self, record: CheckpointRecord, manifest: str, count: int) -> None:
        """Send this rank's file of ``record`` to its partner and take its sources' (the
        sizes from ``manifest``, the step's), once the replications of the tickets before
        ``count`` are done; a failure is a warning. Every rank calls it for every commit."""
        while self._serving != count:
            await self._turned.wait()
        try:
            await self._replicate(record, manifest, count)
        finally:
            self._serving += 1
            turned, self._turned = self._turned, anyio.Event()
            turned.set()

    async def _replicate(self, record: CheckpointRecord, manifest: str, count: int) -> None:
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
        await _peers().send_file(self.link, self.partner, tag, self.storage, self._path(record, self.rank))

    async def _receive(self, record: CheckpointRecord, count: int, src: int, size: int) -> None:
        tag = self._tag(0, count, src)
        path = self._path(record, src)
        await _peers().recv_file(self.link, src, tag, self.storage, path, expected_size=size)

    async def holds(self, steps: dict[int, str]) -> dict[str, list[int]]:
        """Which ranks' files this node holds of each step (step -> its name), own or
        replicas, and (first) how many ranks saved it, from its manifest (0: none here):
        what a restore can have from it."""
        return {str(s): await _offload.run_io(self._held_in, name) for s, name in steps.items()}

    def _held_in(self, name: str) -> list[int]:
        step_dir = self.storage.join(self.directory, name)
        found = self.storage.list(step_dir)
        try:
            world = read_manifest(self.storage, step_dir).world_size
        except (CorruptCheckpointError, CheckpointNotFoundError):
            world = 0  # the restore says what is wrong with it, if the group tries it
        ranks = [rank_of(e.name) if e.is_file else None for e in found]
        return [world, *(r for r in ranks if r is not None)]

    # -- before a restore ----------------------------------------------------------------
    async def repair(
        self, votes: Channel, record: CheckpointRecord, catalog: Catalog | None, *, bad: Sequence[int] = ()
    ) -> None:
        """Every member at once, before reading ``record``'s step: each rank gets the files
        its node should hold (its own, its sources' replicas) and lacks from a rank whose
        node holds them, and a node that lacks the manifest gets rank 0's once its ranks'
        files are there (a node that came back empty is whole again for this step). What
        cannot be had that way is left to the restore (another tier, or an older step).
        The manifest is rank 0's node's or, if that node lacks it (replaced), that of the
        first node that holds it. ``bad``: files this rank found corrupt, fetched again as
        if missing (the copy replaces it, atomically, once whole and checked)."""
        count = self._repairs
        self._repairs += 1
        step_dir = self.storage.join(self.directory, record.file)

        async def look() -> Any:
            names = {e.name for e in await _offload.run_io(self.storage.list, step_dir)}
            want = [self.rank, *self.sources]
            held = [f for f in want if rank_file(f) in names and f not in bad]
            lacks = [f for f in want if f not in held]
            return {"held": held, "lacks": lacks, "manifest": MANIFEST_NAME in names}

        async def plan(bodies: list[Any]) -> Any:
            planned = moves([list(b["lacks"]) for b in bodies], [list(b["held"]) for b in bodies])
            if not planned and all(b["manifest"] for b in bodies):
                return None
            if not bodies[0]["manifest"]:  # rank 0's node replaced: another node's
                source = next((r for r, b in enumerate(bodies) if b["manifest"]), None)
                return None if source is None else {"moves": planned, "manifest": None, "from": source}
            text = await self._manifest(step_dir)
            if text is None:
                return None  # gone from rank 0's node since it was listed: the load says so
            return {"moves": planned, "manifest": text}

        async def done(_: list[Any]) -> Any:
            return None

        async with votes.turn("repair") as turn:
            planned = await turn.agree(look, plan)
            if planned is not None and planned["manifest"] is None:
                source = int(planned["from"])
                text = await self._manifest(step_dir) if source == self.rank else None
                planned["manifest"] = await turn.exchange(text, lambda bodies: _first(bodies, source))
                if planned["manifest"] is None:
                    planned = None  # gone from that node since: every rank leaves the moves
            if planned is not None:  # every rank waits for the moves: a rank reads another's file too
                await self._move(record, count, planned["moves"], planned["manifest"])
                await turn.exchange(None, done)  # all moved: the leaders may commit the step
                if catalog is not None and await self._refill(record, planned["manifest"]):
                    await catalog.load()
                await turn.exchange(None, done)

    async def _manifest(self, step_dir: str) -> str | None:
        """This node's manifest of a step, as text (None: gone)."""
        try:
            return (
                await _offload.run_io(get, self.storage, self.storage.join(step_dir, MANIFEST_NAME))
            ).decode()
        except CheckpointNotFoundError:
            return None

    async def _move(self, record: CheckpointRecord, count: int, planned: list[Any], manifest: str) -> None:
        try:
            sizes = Manifest.parse(record.file, manifest.encode()).sizes
            async with anyio.create_task_group() as tg:
                for i, (holder, rank, f) in enumerate(planned):
                    tag = self._tag(1, count, i)
                    path = self._path(record, f)
                    if holder == self.rank:
                        tg.start_soon(_peers().send_file, self.link, rank, tag, self.storage, path)
                    elif rank == self.rank:
                        tg.start_soon(_fetch, self.link, holder, tag, self.storage, path, sizes[f])
        except* (CheckpointError, OSError) as group:
            for exc in group.exceptions:
                notice(logger, f"step {record.step}: a file could not be had from another node ({exc})")

    async def _refill(self, record: CheckpointRecord, manifest: str) -> bool:
        """A leader whose node lacks the step's manifest writes rank 0's, if its ranks'
        files are all there now. Whether it wrote it."""
        ranks = self.nodes.members(self.rank)
        done = await _offload.run_io(refill, self.storage, self.directory, {record.file: manifest}, ranks)
        return bool(done)


async def _fetch(link: PeerLink, holder: int, tag: int, storage: Storage, path: str, size: int) -> None:
    await _peers().recv_file(link, holder, tag, storage, path, expected_size=size)
    logger.info("%s: taken from rank %d's node", path, holder)


async def _first(bodies: list[Any], source: int) -> Any:
    return bodies[source]


def moves(lacks: Sequence[Sequence[int]], held: Sequence[Sequence[int]]) -> list[list[int]]:
    """Rank 0: [holder, rank, file's rank] for each file a rank's node should hold and
    lacks, from the first other rank whose node holds it."""
    out = []
    for rank, files in enumerate(lacks):
        for f in files:
            holder = next((h for h, got in enumerate(held) if f in got and h != rank), None)
            if holder is not None:
                out.append([holder, rank, f])
    return out


def covered(held: Sequence[dict[str, list[int]]]) -> set[int]:
    """The steps each of whose files (one per rank that saved it) some node holds
    (``Replicator.holds`` of each node: [ranks that saved it, or 0, *files held])."""
    out = set()
    for s in {s for h in held for s in h}:
        world = max(h[s][0] for h in held if s in h)
        if world and set(range(world)) <= {r for h in held for r in h.get(s, [0])[1:]}:
            out.add(int(s))
    return out
