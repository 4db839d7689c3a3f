"""Which ranks of a group share a local directory: the group's nodes.

Real clusters rarely share one fast filesystem: each machine has its own disk, so each
rank passes a directory that only the ranks of its machine see, under the same path on
every machine or a path of its own. What a rank's directory *is* cannot be told from
its name, so the ranks find out: each writes a probe file in its directory, and tells
rank 0 which of the others' probes it sees there. Ranks that see each other's probes
share a directory, a node; the lowest rank of a node leads it (its lease, sweep,
catalog, index and retention) and holds the step's manifest there. A directory that
every rank shares (the usual case) is one node, led by rank 0: nothing changes for it.

At open, the leaders agree on what the nodes hold before any of them sweeps: a step
committed on any node is never swept from another (its rank files there are part of a
checkpoint), and a node that holds a committed step's rank files but not its manifest
(a crash between rank 0's commit and the others') gets the manifest back.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, final

from .._base import offload as _offload
from .._base.errors import CheckpointError, CheckpointNotFoundError
from .._dist.channel import Channel
from .._dist.decisions import Refused
from .._format.manifest import MANIFEST_NAME, rank_file
from .._storage.protocol import Storage, get, put

#: A probe file's name: aiosnap's reserved prefix (no checkpoint bears it), not the temp
#: prefix, which listings hide. A crashed open's probe is swept by the node's next open
#: (``sweep_probes``).
PROBE_PREFIX = ".aiosnap-probe-"


@final
@dataclass(frozen=True, slots=True)
class Nodes:
    """The group's nodes: ``of[rank]`` is the leader (lowest rank) of ``rank``'s node."""

    of: tuple[int, ...]

    @classmethod
    def one(cls, size: int) -> Nodes:
        """Every rank on one node (a shared directory, or a process on its own)."""
        return cls((0,) * size)

    @property
    def many(self) -> bool:
        return any(self.of)

    @property
    def leaders(self) -> list[int]:
        return sorted(set(self.of))

    def leads(self, rank: int) -> bool:
        return self.of[rank] == rank

    def members(self, leader: int) -> list[int]:
        return [r for r, lead in enumerate(self.of) if lead == leader]


def decide_nodes(seen: Sequence[Sequence[int]]) -> list[int]:
    """Rank 0: each rank's leader from which ranks' probes each rank saw. Sharing a
    directory is mutual: a rank that sees another's probe, which does not see its own
    or sees a different set, is a directory that changes under the group (a network
    filesystem's cache, a path that moved): refused, naming both."""
    for r, mine in enumerate(seen):
        if r not in mine:
            raise Refused({r: "cannot see the probe file it wrote in its own directory"})
        for other in mine:
            if sorted(seen[other]) != sorted(mine):
                raise Refused(
                    {
                        r: f"sees the probes of ranks {sorted(mine)} in its directory, but rank {other} "
                        f"sees those of ranks {sorted(seen[other])}: their directories must be one or apart"
                    }
                )
    return [min(mine) for mine in seen]


#: What a probe holds: a file under a probe's name that holds anything else is not one.
_PROBE = b"aiosnap: which ranks share this directory\n"


def _write_probe(storage: Storage, directory: str, token: str) -> None:
    put(storage, storage.join(directory, PROBE_PREFIX + token), _PROBE)


def _seen(storage: Storage, directory: str, tokens: list[str]) -> list[int]:
    names = {e.name for e in storage.list(directory) if e.is_file}
    return [r for r, token in enumerate(tokens) if PROBE_PREFIX + token in names]


async def find_nodes(votes: Channel, storage: Storage, directory: str, replicas: int = 0) -> Nodes:
    """Every rank at once: write a probe in its directory, see whose probes are there,
    learn rank 0's grouping; the probe is removed again, also on failure. Every rank
    must ask for as many ``replicas`` (the next step, a link between partners, is made
    by all or none)."""
    if votes.size == 1:
        return Nodes.one(1)
    token = secrets.token_hex(12)

    async def probe() -> Any:
        await _offload.run_io(_write_probe, storage, directory, token)
        return [token, replicas]

    async def tokens(bodies: list[Any]) -> Any:
        names = [b[0] if isinstance(b, list) and len(b) == 2 else None for b in bodies]
        if not all(isinstance(t, str) and t for t in names) or len(set(names)) != len(names):
            raise CheckpointError("ranks sent malformed probe names")
        differ = {
            r: f"asks for replicas={b[1]}, rank 0 for {bodies[0][1]}"
            for r, b in enumerate(bodies)
            if b[1] != bodies[0][1]
        }
        if differ:
            raise Refused(differ)
        return names

    async def group(bodies: list[Any]) -> Any:
        return decide_nodes([list(b) for b in bodies])

    try:
        async with votes.turn("nodes") as turn:
            names = await turn.agree(probe, tokens)
            seen = await _offload.run_io(_seen, storage, directory, [str(t) for t in names])
            of = await turn.exchange(seen, group)
    finally:
        await _offload.run_io(_remove, storage, storage.join(directory, PROBE_PREFIX + token))
    return Nodes(tuple(int(x) for x in of))


def _remove(storage: Storage, path: str) -> None:
    try:
        storage.delete(path)
    except CheckpointNotFoundError:
        pass  # never written, or swept by the leader's open already (``sweep_probes``)


def sweep_probes(storage: Storage, directory: str) -> list[str]:
    """Remove the probes of opens that crashed (at an open, under the lease: every probe
    of this group's open is done with by then): regular files of a probe's name and
    bytes, nothing else (a directory or a link is not listed as a file). A probe of this
    open may still be listed, its rank removing it as the leader sweeps (each rank
    removes its own after the grouping, unordered with the leader's open): one gone
    between the listing and the read is skipped. Blocking."""
    gone = []
    for e in storage.list(directory):
        if e.is_file and e.name.startswith(PROBE_PREFIX) and e.size == len(_PROBE):
            path = storage.join(directory, e.name)
            try:
                held = get(storage, path)
            except CheckpointNotFoundError:
                continue
            if held == _PROBE:
                _remove(storage, path)
                gone.append(e.name)
    return gone


# -- open: what the nodes hold, before any of them sweeps ---------------------------------
def committed_here(storage: Storage, directory: str, names: Sequence[str]) -> list[str]:
    """Which of the step directories ``names`` hold a manifest. Blocking."""
    return [
        n for n in names if any(e.name == MANIFEST_NAME for e in storage.list(storage.join(directory, n)))
    ]


def manifests_of(storage: Storage, directory: str, names: Sequence[str]) -> dict[str, str]:
    """The manifests of step directories ``names`` (as text; ``read_manifest`` checks each
    where it is used). Blocking."""
    return {n: get(storage, storage.join(directory, n, MANIFEST_NAME)).decode() for n in names}


def refill(storage: Storage, directory: str, manifests: dict[str, str], ranks: Sequence[int]) -> list[str]:
    """Write the manifest of each step in ``manifests`` that this node lacks but whose
    files of the node's ``ranks`` are all here: the step becomes whole on this node again.
    A node without those files gets no manifest (it would list a step it cannot load).
    The steps refilled. Blocking."""
    done = []
    for name, text in manifests.items():
        step_dir = storage.join(directory, name)
        if storage.stat(storage.join(step_dir, MANIFEST_NAME)) is not None:
            continue
        if all(storage.stat(storage.join(step_dir, rank_file(r))) is not None for r in ranks):
            put(storage, storage.join(step_dir, MANIFEST_NAME), text.encode())
            done.append(name)
    return done
