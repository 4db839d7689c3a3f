"""Shards: where a piece of a distributed tensor sits in the whole, and which bytes to read.

A saved entry of a DTensor is one *box* of the global tensor (offsets and lengths per
dimension), stored C-contiguous. A box is derived from the mesh and placements alone,
with no communication: ``Shard(d)`` chunks dimension d as ``torch.chunk`` does (the
last chunks short or empty), ``Replicate()`` keeps the whole, and a box replicated
over some mesh dimensions is stored once, by the coordinate 0 along them. ``Partial``
is refused (its true value needs a reduction), and so is a ``_StridedShard`` order
whose local shard is not a box.

Restoring intersects the boxes a target needs with the saved ones and reads, of each
overlap, the minimal contiguous byte runs. torch.distributed is imported only when a
DTensor is met, and then it is already imported by whoever made it.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .._base.errors import UnsupportedTypeError


@dataclass(frozen=True, slots=True)
class Box:
    """A region of a tensor: ``offsets`` and ``lengths`` per dimension."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    def intersect(self, other: Box) -> Box | None:
        """The common region, or None if there is none."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(
            min(a + n, b + m)
            for a, n, b, m in zip(self.offsets, self.lengths, other.offsets, other.lengths, strict=True)
        )
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))

    def within(self, shape: Sequence[int]) -> bool:
        if not len(self.offsets) == len(self.lengths) == len(shape):
            return False
        dims = zip(self.offsets, self.lengths, shape, strict=True)
        return all(o >= 0 and n >= 0 and o + n <= s for o, n, s in dims)


@dataclass(frozen=True, slots=True)
class Shard:
    """What this rank holds of a DTensor: the local tensor and its box in the whole, and
    whether this rank is the one that stores it (one per replica group)."""

    local: Any  # torch.Tensor
    shape: tuple[int, ...]  # global
    box: Box
    writer: bool


def is_dtensor(obj: object) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, module.DTensor)


#: Indices of a dimension, as runs of consecutive ones: a dimension of 2^31 rows is one
#: range, not a list of 2^31 ints.
Indices = list[range]


def _chunk(indices: Indices, k: int) -> list[Indices]:
    """``torch.chunk``'s split: pieces of ceil(n/k), the last ones short or empty."""
    return [_piece(indices, k, c) for c in range(k)]


def _piece(indices: Indices, k: int, c: int) -> Indices:
    """Piece ``c`` of ``_chunk(indices, k)``, alone: a rank of 10,000 derives its box
    of each DTensor without the other 9,999 pieces."""
    n = sum(len(r) for r in indices)
    size = -(-n // k) if n else 0
    return _take(indices, min(n, c * size), min(n, c * size + size))


def _take(indices: Indices, start: int, stop: int) -> Indices:
    """Indices ``start`` to ``stop`` (positions in ``indices``)."""
    out, at = [], 0
    for r in indices:
        lo, hi = max(start - at, 0), min(stop - at, len(r))
        if lo < hi:
            out.append(r[lo:hi])
        at += len(r)
    return out


def local_box(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coord: Sequence[int],
    placements: Sequence[Any],
    where: str,
) -> Box:
    """The box of the shard at mesh coordinate ``coord``; UnsupportedTypeError if the
    placements are Partial or lay the shard out in pieces that are not one box."""
    from torch.distributed.tensor.placement_types import _StridedShard

    indices: list[Indices] = [[range(n)] for n in shape]
    for mdim, p in enumerate(placements):
        if p.is_partial():
            raise UnsupportedTypeError(
                f"the DTensor at {where} has a Partial placement: its value is a reduction over "
                "ranks; redistribute it to Replicate() (or Shard) before saving"
            )
        if isinstance(p, _StridedShard):
            k, c = mesh_shape[mdim], coord[mdim]
            pieces = _chunk(indices[p.dim], int(p.split_factor))
            indices[p.dim] = [r for piece in pieces for r in _piece(piece, k, c)]
        elif p.is_shard():
            indices[p.dim] = _piece(indices[p.dim], mesh_shape[mdim], coord[mdim])
        elif not p.is_replicate():
            raise UnsupportedTypeError(f"the DTensor at {where}: placement {p!r} is not supported")
    offsets, lengths = [], []
    for d, ix in enumerate(indices):
        if any(a.stop != b.start for a, b in itertools.pairwise(ix)):
            raise UnsupportedTypeError(
                f"the DTensor at {where} ({placements}) holds rows of dimension {d} that are not "
                "contiguous in the whole tensor; save it with another placement order"
            )
        offsets.append(ix[0].start if ix else 0)
        lengths.append(sum(len(r) for r in ix))
    return Box(tuple(offsets), tuple(lengths))


def is_writer(coord: Sequence[int], placements: Sequence[Any]) -> bool:
    """The one coordinate of a replica group that stores the box: 0 on every mesh
    dimension the tensor is replicated over."""
    return all(not p.is_replicate() or c == 0 for p, c in zip(placements, coord, strict=True))


def shard_of(t: Any, where: str) -> Shard | None:
    """This rank's part of DTensor ``t``; None if this rank is not in its mesh."""
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    shape = tuple(int(n) for n in t.shape)
    box = local_box(shape, tuple(mesh.shape), coord, t.placements, where)
    local = t.to_local()
    if tuple(local.shape) != box.lengths:  # padded or otherwise unusual layouts
        raise UnsupportedTypeError(
            f"the DTensor at {where}: its local tensor is {tuple(local.shape)}, not the {box.lengths} "
            "its placements give"
        )
    return Shard(local, shape, box, is_writer(coord, t.placements))


@dataclass(frozen=True, slots=True)
class Run:
    """A contiguous run of bytes of a saved box, and where it lands in a target box:
    ``src`` bytes into the saved entry, ``dst`` the index of its first element in the
    target (box-relative), ``shape`` of the elements it holds there."""

    src: int
    nbytes: int
    dst: tuple[int, ...]
    shape: tuple[int, ...]


def runs(saved: Box, target: Box, itemsize: int) -> Iterator[Run]:
    """The minimal contiguous byte runs of ``saved`` (stored C-contiguous) that cover
    its overlap with ``target``. Trailing dimensions the overlap covers whole merge
    into one run, so a row-sharded overlap is a single run."""
    overlap = saved.intersect(target)
    if overlap is None or overlap.numel == 0:
        return
    ndim = len(saved.lengths)
    if ndim == 0:
        yield Run(0, itemsize, (), ())
        return
    strides = [math.prod(saved.lengths[d + 1 :]) for d in range(ndim)]
    s = [lo - so for lo, so in zip(overlap.offsets, saved.offsets, strict=True)]
    t = [lo - to for lo, to in zip(overlap.offsets, target.offsets, strict=True)]
    k = ndim - 1
    while k > 0 and overlap.lengths[k] == saved.lengths[k]:
        k -= 1
    run_elems = overlap.lengths[k] * strides[k]
    shape = overlap.lengths[k:]
    outer = [range(n) for n in overlap.lengths[:k]]
    for index in itertools.product(*outer):
        start = sum((s[d] + i) * strides[d] for d, i in enumerate(index)) + s[k] * strides[k]
        dst = tuple(t[d] + i for d, i in enumerate(index)) + tuple(t[k:])
        yield Run(start * itemsize, run_elems * itemsize, dst, shape)


#: Boxes are checked for overlaps on the grid their edges cut, cell by cell, when it has
#: at most this many cells (or 4 per box): the boxes of placements on a mesh are one
#: cell each. Boxes on a larger grid are compared pair by pair, along a sweep, if there
#: are at most MAX_IRREGULAR of them, and refused if there are more: no placement lays
#: boxes out so, and a sweep over 4,096 bricks of a wall (every pair met) took 49 s.
GRID_CELLS = 1 << 18
MAX_IRREGULAR = 256


def tiles(shape: Sequence[int], boxes: Sequence[Box]) -> bool:
    """Whether ``boxes`` cover a tensor of ``shape`` exactly once (each inside it, no two
    overlapping, volumes adding up). With volumes adding up, an overlap means a hole:
    a reader would hand out memory no box filled."""
    if not all(b.within(shape) for b in boxes):
        return False
    if sum(b.numel for b in boxes) != math.prod(shape):
        return False
    nonempty = [b for b in boxes if b.numel]
    if len(nonempty) < 2:
        return True
    cuts = [
        sorted({x for b in nonempty for x in (b.offsets[d], b.offsets[d] + b.lengths[d])})
        for d in range(len(shape))
    ]
    if math.prod(len(c) - 1 for c in cuts) <= max(GRID_CELLS, 4 * len(nonempty)):
        return not _overlap_on_grid(nonempty, cuts)
    widest = max(range(len(cuts)), key=lambda d: len(cuts[d]))
    return len(nonempty) <= MAX_IRREGULAR and not _overlap_by_sweep(nonempty, widest)


def _overlap_on_grid(boxes: list[Box], cuts: list[list[int]]) -> bool:
    """Whether two boxes share a cell of the grid their edges cut (each box is a block of
    cells). Each cell is visited once, but the one that finds an overlap."""
    at = [{x: i for i, x in enumerate(c)} for c in cuts]
    strides, size = [0] * len(cuts), 1
    for d in range(len(cuts) - 1, -1, -1):
        strides[d], size = size, size * (len(cuts[d]) - 1)
    seen = bytearray(size)
    for b in boxes:
        spans = [
            range(at[d][o] * strides[d], at[d][o + n] * strides[d], strides[d])
            for d, (o, n) in enumerate(zip(b.offsets, b.lengths, strict=True))
        ]
        for cell in itertools.product(*spans):
            flat = sum(cell)
            if seen[flat]:
                return True
            seen[flat] = 1
    return False


def _overlap_by_sweep(boxes: list[Box], d: int) -> bool:
    """Whether two boxes overlap: each is compared with those it meets along dimension
    ``d`` (the one the boxes are cut most along, so that few meet)."""
    active: list[Box] = []
    for b in sorted(boxes, key=lambda b: b.offsets[d]):
        active = [a for a in active if a.offsets[d] + a.lengths[d] > b.offsets[d]]
        if any(a.intersect(b) is not None for a in active):
            return True
        active.append(b)
    return False
