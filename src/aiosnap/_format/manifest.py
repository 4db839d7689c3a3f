"""A group's manifest: which files make up a step, and where every box of every DTensor lies.

A step of a group is a directory with a file per rank and this manifest, written
last by rank 0 (``_manager.step_dirs``). Replicated entries (tree paths matching
``replicated`` globs) are stored only in rank 0's file; the other ranks' files mark
them external and are read together with it.
A DTensor's boxes are stored by one rank each; the manifest indexes where every box
of every DTensor lies, so a restore at any world size reads exactly the bytes it
needs. Since format /3 a DTensor's boxes are a rule (``grids.Grid``: O(1) per DTensor,
whatever the number of ranks), or listed where no rule fits them; /1 and /2 listed
every box, and still read. A step exists once its manifest does; rank 0 writes it only after every rank
reported its file durable, with the crc32c of its header (which holds the checksum
of every entry), so a restore can tell that each file is the one that was committed.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, final

from .._base.checksums import crc32c
from .._base.errors import CorruptCheckpointError
from .._base.typed import decode, encode
from .._storage.protocol import Storage, get
from .codec import TensorInfo, nbytes
from .dtypes import TORCH_DTYPES
from .grids import Grid, SavedBox, grid_problem
from .shards import Box, tiles

logger = logging.getLogger(__name__)

MANIFEST_NAME = "aiosnap-manifest.json"
"""The manifest of a group's step directory: rank 0 writes it once every rank's file has
committed, so a step directory without it is no checkpoint (and is never loaded)."""
MANIFEST_FORMAT = "aiosnap-manifest/3"
#: Formats that list every box (no grids): still read.
_OLD_FORMATS = ("aiosnap-manifest/1", "aiosnap-manifest/2")


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}"


_RANK_FILE = re.compile(r"rank_(\d{5})")


def rank_of(name: str) -> int | None:
    """The rank whose file ``name`` is (``rank_file``'s inverse), or None for another name."""
    m = _RANK_FILE.fullmatch(name)
    return None if m is None else int(m.group(1))


def partners(of: Sequence[int]) -> list[int]:
    """Each rank's partner, whose node keeps a copy of its file (``copies``), given each
    rank's node (``of[rank]``: the node's lowest rank): the rank at its place in the next
    node, nodes in the order of their lowest ranks, the last one's partners in the first
    (the same index, or the next node's last rank if that node is smaller); -1 for every
    rank of one node."""
    leaders = sorted(set(of))
    if len(leaders) < 2:
        return [-1] * len(of)
    members: dict[int, list[int]] = {lead: [] for lead in leaders}
    place = []  # O(ranks) in all: a manifest's record of 10,000 one-rank nodes is cheap too
    for rank, lead in enumerate(of):
        place.append(len(members[lead]))
        members[lead].append(rank)
    following = {lead: members[leaders[(i + 1) % len(leaders)]] for i, lead in enumerate(leaders)}
    out = []
    for rank, lead in enumerate(of):
        mates = following[lead]
        out.append(mates[min(place[rank], len(mates) - 1)])
    return out


def node_runs(of: Sequence[int]) -> list[list[int]]:
    """``of`` (each rank's node) as runs of [node, ranks]: a node's ranks are usually
    consecutive, so a group of 10,000 ranks on 1,250 nodes is 1,250 pairs."""
    runs: list[list[int]] = []
    for lead in of:
        if runs and runs[-1][0] == lead:
            runs[-1][1] += 1
        else:
            runs.append([lead, 1])
    return runs


def replicated_matcher(patterns: Sequence[str]) -> Callable[[str], bool]:
    """Whether a dotted tree path is replicated: a glob matches it or one of its parents."""
    pats = list(patterns)

    def matches(path: str) -> bool:
        parts = path.split(".")
        prefixes = (".".join(parts[:i]) for i in range(len(parts), 0, -1))
        return any(fnmatch.fnmatchcase(p, pat) for p in prefixes for pat in pats)

    return matches


__all__ = ["Grid", "SavedBox"]  # re-exported: the manifest's parts


@final
@dataclass(frozen=True, slots=True)
class SavedTensor:
    """Where the stored boxes of one DTensor lie (they tile its ``shape`` exactly): a
    ``grid`` rule, or the list of ``boxes`` where no rule fits (never both)."""

    dtype: str
    shape: list[int]
    boxes: list[SavedBox] = field(default_factory=list)
    grid: Grid | None = None

    def every_box(self) -> Iterator[SavedBox]:
        """Every stored box (a verify, or a load of the whole, reads them all)."""
        return self.grid.every(self.shape) if self.grid is not None else iter(self.boxes)

    def overlapping(self, box: Box) -> Iterator[SavedBox]:
        """The stored boxes that share an element with ``box``: from a grid, only those
        (per dimension, the range of cells it meets); a list is searched."""
        if self.grid is not None:
            yield from self.grid.overlapping(self.shape, box)
            return
        for sb in self.boxes:
            overlap = sb.box.intersect(box)
            if overlap is not None and overlap.numel:
                yield sb

    def count(self) -> int:
        """The number of stored boxes."""
        return math.prod(self.grid.counts(self.shape)) if self.grid is not None else len(self.boxes)


def holds_box(info: TensorInfo | None, saved: SavedTensor, box: SavedBox) -> bool:
    """Whether a file's entry is the box of a DTensor the manifest says it is: a shard of
    the same dtype and whole shape, at the box's offsets, of its lengths. Only then does
    the entry's size (which the file justifies) bound what the box reads and allocates."""
    return (
        info is not None
        and info.kind == "tensor"
        and info.shard == (tuple(saved.shape), tuple(box.offsets))
        and list(info.shape) == box.lengths
        and info.dtype == saved.dtype
    )


def indexed(index: dict[str, SavedTensor], where: str, info: TensorInfo | None) -> SavedTensor | None:
    """The boxes of the DTensor at tree path ``where``, whose entry in the rank's file is
    ``info``; None if the index lacks them. A step indexes every DTensor that has bytes;
    one without any is read from its entry's description (the entry itself is only
    this rank's box: taken for the whole, it would have the box's shape)."""
    saved = index.get(where)
    if saved is None and info is not None and info.shard is not None and 0 in info.shard[0]:
        return SavedTensor(info.dtype, list(info.shard[0]), [])
    return saved


@final
@dataclass(frozen=True, slots=True)
class Manifest:
    """What rank 0 writes last: which files make up the step, and their summaries."""

    step: int
    epoch: int | None
    world_size: int
    files: list[str]
    checksums: list[str]  # header crc32c of each rank's file
    sizes: list[int]
    replicated: list[str]  # the globs
    replicas: str  # the file that holds the replicated entries
    #: Tree path -> where the boxes of that DTensor lie.
    shards: dict[str, SavedTensor] = field(default_factory=dict)
    #: Tree paths of the leaves whose values differed between ranks: state of its
    #: own rank, which a restore at another world size must not hand to another.
    per_rank: list[str] = field(default_factory=list)
    #: The files that hold the replicated entries as ``replicas`` does, on other nodes
    #: of the group (their leaders', ``_manager.nodes``): each node restores from its
    #: own. Left out of the JSON when empty: a shared directory's manifest is as before.
    node_replicas: list[str] = field(default_factory=list)
    #: In a group of several nodes, each rank's node as runs of [node, ranks] (a node is
    #: named by its lowest rank: ``node_runs``), and ``copies``: 1 if each file is also
    #: copied to its partner's node (``partners``), once the step is committed. Left out
    #: of the JSON when empty / 0. Which files a node's directory holds: ``holdings``.
    nodes: list[list[int]] = field(default_factory=list)
    copies: int = 0

    def node_of(self) -> list[int]:
        """Each rank's node (its lowest rank); [] if the manifest records none."""
        return [lead for lead, count in self.nodes for _ in range(count)]

    def holdings(self) -> dict[int, list[int]]:
        """Each node's (by its lowest rank) ranks whose files its directory holds once
        the step is replicated: its ranks', and with ``copies``, those whose partner is
        on it. {} if the manifest records no nodes."""
        of = self.node_of()
        out: dict[int, set[int]] = {lead: set() for lead in of}
        for rank, mate in enumerate(partners(of) if self.copies else [-1] * len(of)):
            out[of[rank]].add(rank)
            if mate >= 0:
                out[of[mate]].add(rank)
        return {lead: sorted(ranks) for lead, ranks in out.items()}

    def to_bytes(self) -> bytes:
        encoded = encode(self)
        for key in ("node_replicas", "nodes", "copies"):  # a shared directory's manifest is as before
            if not encoded[key]:
                del encoded[key]
        body = json.dumps(encoded, sort_keys=True, separators=(",", ":"))
        return json.dumps(
            {"format": MANIFEST_FORMAT, "body": json.loads(body), "crc32c": f"{crc32c(body.encode()):08x}"},
            separators=(",", ":"),
        ).encode()

    @classmethod
    def parse(cls, path: str, raw: bytes) -> Manifest:
        try:
            outer = json.loads(raw)
            body = json.dumps(outer["body"], sort_keys=True, separators=(",", ":"))
            if (
                outer.get("format") not in (MANIFEST_FORMAT, *_OLD_FORMATS)
                or outer.get("crc32c") != f"{crc32c(body.encode()):08x}"
            ):
                raise ValueError("format or checksum mismatch")
            manifest = _decode(cls, outer["body"])
            if outer["format"] in _OLD_FORMATS and any(s.grid for s in manifest.shards.values()):
                raise ValueError(f"a grid in a manifest of format {outer['format']}")
        except RecursionError:  # json's C parser and encoder stop at the interpreter's limit
            raise CorruptCheckpointError(path, "bad manifest: nested too deeply") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(path, f"bad manifest: {exc}") from None
        problem = manifest._problem()
        if problem:
            raise CorruptCheckpointError(path, f"bad manifest: {problem}")
        return manifest

    def _problem(self) -> str:
        n = self.world_size
        if self.step < 0 or any(s < 0 for s in self.sizes):
            return "a negative step or size"
        if not (len(self.files) == len(self.checksums) == len(self.sizes) == n > 0):
            return "the lists do not match the world size"
        if not all(_plain_name(f) for f in [*self.files, self.replicas]):
            return "a file name leaves the step directory or is not one"
        if not {self.replicas, *self.node_replicas} <= set(self.files):  # no checksum would vouch for it
            return "a file of the replicated entries is not one of the step's"
        problem = _nodes_problem(self)
        if problem:
            return problem
        for path, saved in self.shards.items():
            dtype = TORCH_DTYPES.get(saved.dtype)
            # A shape torch cannot hold would fail inside torch.empty, with its own error.
            if (
                dtype is None
                or any(s < 0 for s in saved.shape)
                or nbytes(saved.shape, dtype.itemsize) is None
            ):
                return f"DTensor {path!r}: bad dtype or shape"
            if saved.grid is not None:
                problem = "both a grid and boxes" if saved.boxes else grid_problem(saved.grid, saved.shape, n)
                if problem:
                    return f"DTensor {path!r}: {problem}"
                continue  # a grid tiles its shape by construction
            if any(not len(b.offsets) == len(b.lengths) == len(saved.shape) for b in saved.boxes):
                return f"DTensor {path!r}: a box of another number of dimensions"
            if any(not 0 <= b.file < n for b in saved.boxes):
                return f"DTensor {path!r}: a box in a file that is not in the step"
            if not tiles(saved.shape, [b.box for b in saved.boxes]):
                return f"DTensor {path!r}: its boxes do not cover it exactly once"
        return ""


def _nodes_problem(manifest: Manifest) -> str:
    """What is wrong with a manifest's ``nodes`` and ``copies`` ("" if nothing)."""
    if manifest.copies not in (0, 1) or (manifest.copies and not manifest.nodes):
        return "copies is not 0, or 1 with nodes"
    if not manifest.nodes:
        return ""
    if not all(len(run) == 2 and run[1] > 0 for run in manifest.nodes):
        return "a run of nodes is not [node, ranks > 0]"
    if sum(run[1] for run in manifest.nodes) != manifest.world_size:
        return "the runs of nodes do not cover the world size"
    of = manifest.node_of()
    if any(not 0 <= lead <= r or of[lead] != lead for r, lead in enumerate(of)):
        return "a node that is not its lowest rank's"
    return ""


def _decode(cls: type[Manifest], body: Any) -> Manifest:
    """The body as a Manifest, every field checked: the index of DTensors by hand (the
    typed decoder's generic walk took 40 ms for 873 DTensors), the rest by ``decode``."""
    if not isinstance(body, dict) or "shards" not in body:
        return decode(cls, body)
    rest = decode(cls, {k: v for k, v in body.items() if k != "shards"})
    shards = body["shards"]
    if not isinstance(shards, dict):
        raise ValueError("Manifest.shards: not an object")
    return dataclasses.replace(rest, shards={p: _saved(v, f"Manifest.shards.{p}") for p, v in shards.items()})


def _saved(data: Any, where: str) -> SavedTensor:
    _fields(data, where, {"dtype", "shape"}, {"boxes", "grid"})
    boxes = data.get("boxes", [])
    if type(boxes) is not list:
        raise ValueError(f"{where}.boxes: not a list")
    grid = data.get("grid")
    return SavedTensor(
        _str(data["dtype"], f"{where}.dtype"),
        _ints(data["shape"], f"{where}.shape"),
        [_box(b, f"{where}.boxes[{i}]") for i, b in enumerate(boxes)],
        None if grid is None else _grid(grid, f"{where}.grid"),
    )


def _box(data: Any, where: str) -> SavedBox:
    _fields(data, where, {"file", "name", "offsets", "lengths"}, set())
    return SavedBox(
        _int(data["file"], f"{where}.file"),
        _str(data["name"], f"{where}.name"),
        _ints(data["offsets"], f"{where}.offsets"),
        _ints(data["lengths"], f"{where}.lengths"),
    )


def _grid(data: Any, where: str) -> Grid:
    _fields(data, where, {"pieces", "first", "strides", "name"}, set())
    return Grid(
        _ints(data["pieces"], f"{where}.pieces"),
        _int(data["first"], f"{where}.first"),
        _ints(data["strides"], f"{where}.strides"),
        _str(data["name"], f"{where}.name"),
    )


def _fields(data: Any, where: str, required: set[str], optional: set[str]) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: not an object")
    if not data.keys() <= required | optional:
        raise ValueError(f"{where}: unknown fields {sorted(data.keys() - required - optional)}")
    if not required <= data.keys():
        raise ValueError(f"{where}: missing fields {sorted(required - data.keys())}")


def _int(value: Any, where: str) -> int:
    if type(value) is not int:  # not a bool, not a float
        raise ValueError(f"{where}: {value!r:.60} is not an int")
    return value


def _str(value: Any, where: str) -> str:
    if type(value) is not str:
        raise ValueError(f"{where}: {value!r:.60} is not a str")
    return value


def _ints(value: Any, where: str) -> list[int]:
    if type(value) is not list or not all(type(v) is int for v in value):
        raise ValueError(f"{where}: not a list of ints")
    return value


def _plain_name(name: str) -> bool:
    """Whether ``name`` names a file in the step directory that a file system can open: one
    path component (not "." or ".." or hidden), no NUL, UTF-8 (no lone surrogates), and
    at most NAME_MAX (255) bytes. Any other name would fail inside open(), with an error
    that is not the manifest's."""
    if not name or "/" in name or "\0" in name or name.startswith("."):
        return False
    try:
        return len(name.encode("utf-8")) <= 255
    except UnicodeEncodeError:
        return False


def read_manifest(storage: Storage, step_dir: str) -> Manifest:
    path = storage.join(step_dir, MANIFEST_NAME)
    return Manifest.parse(path, get(storage, path))


def leaf_count(boxes: Sequence[SavedBox]) -> int:
    return sum(math.prod(b.lengths) for b in boxes)


#: The name of a rank's file in a step directory.


def refused_per_rank(manifest: Manifest, world_size: int, asked: Sequence[str]) -> list[str]:
    """The per-rank leaves a restore at ``world_size`` must not hand out: at another
    world size, the state of one rank is nobody else's."""
    if world_size == manifest.world_size:
        return []
    per_rank = set(manifest.per_rank)
    return sorted(p for p in asked if p in per_rank)


def base_file(manifest: Manifest, rank: int, world_size: int) -> int:
    """The rank file a rank reads its tree and plain entries from: its own at the same
    world size; else its own if there is one (any rank's holds the shared leaves),
    else rank 0's."""
    return rank if rank < manifest.world_size else 0
