"""A DTensor's boxes as a rule: a grid of ``torch.chunk`` pieces and an affine map from
cell to file, so a manifest is O(DTensors + ranks), not O(DTensors x ranks).

The placements of a mesh cut each dimension of a tensor the way ``torch.chunk`` does:
pieces of one length, the last short, the empty ones stored by nobody. ``Shard(d)``
over a mesh dimension, several tensor dimensions over several mesh dimensions (2-D
meshes), and replica groups where only the first stores (HSDP) all give such a grid,
and the rank that stores a cell is an affine function of it on a row-major mesh:
``first + sum(cell[d] * strides[d])``. Rank 0 derives the rule from the boxes the
ranks reported (``derive``) and keeps it only if it regenerates exactly those boxes;
what it does not fit (boxes cut by hand, two mesh dimensions over one tensor
dimension) stays a list of boxes for that tensor alone.

A rule read from storage is checked in O(dims) (``grid_problem``): the pieces tile
each dimension by construction; the map must send every cell to a file of the step,
no two to the same one (so there are at most as many cells as files: a rule cannot
claim more boxes than the manifest lists files).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, final

import numpy as np

from .shards import Box


@final
@dataclass(frozen=True, slots=True)
class SavedBox:
    """A box of a DTensor, stored as entry ``name`` of file number ``file``."""

    file: int
    name: str
    offsets: list[int]
    lengths: list[int]

    @property
    def box(self) -> Box:
        return Box(tuple(self.offsets), tuple(self.lengths))


@final
@dataclass(frozen=True, slots=True)
class Grid:
    """Every box of a DTensor: dimension d cut in pieces of ``pieces[d]`` elements (the
    last short; the whole length: not cut), the cell ``c`` stored as entry ``name`` of
    file ``first + sum(c[d] * strides[d])``."""

    pieces: list[int]
    first: int
    strides: list[int]
    name: str

    def counts(self, shape: Sequence[int]) -> list[int]:
        """The number of cells along each dimension."""
        return [-(-n // s) for n, s in zip(shape, self.pieces, strict=True)]

    def cell(self, shape: Sequence[int], c: Sequence[int]) -> SavedBox:
        offsets = [i * s for i, s in zip(c, self.pieces, strict=True)]
        lengths = [min(s, n - o) for s, n, o in zip(self.pieces, shape, offsets, strict=True)]
        file = self.first + sum(i * k for i, k in zip(c, self.strides, strict=True))
        return SavedBox(file, self.name, offsets, lengths)

    def every(self, shape: Sequence[int]) -> Iterator[SavedBox]:
        """Every box, in row-major order of the cells."""
        for c in itertools.product(*(range(k) for k in self.counts(shape))):
            yield self.cell(shape, c)

    def overlapping(self, shape: Sequence[int], box: Box) -> Iterator[SavedBox]:
        """The boxes that share an element with ``box``: per dimension, the cells its
        range meets (range arithmetic; no other cell is looked at)."""
        spans = []
        for o, n, s, whole in zip(box.offsets, box.lengths, self.pieces, shape, strict=True):
            lo, hi = max(o, 0), min(o + n, whole)
            if hi <= lo:
                return
            spans.append(range(lo // s, -(-hi // s)))
        for c in itertools.product(*spans):
            yield self.cell(shape, c)


def grid_problem(grid: Grid, shape: Sequence[int], files: int) -> str:
    """What is wrong with ``grid`` as the rule of a DTensor of ``shape`` in a step of
    ``files`` files ("" if nothing), in O(dims): no cell is enumerated."""
    if not len(grid.pieces) == len(grid.strides) == len(shape):
        return "a grid of another number of dimensions"
    if any(not 1 <= s <= n for s, n in zip(grid.pieces, shape, strict=True)):
        return "a grid piece longer than its dimension, or empty"
    counts = grid.counts(shape)
    cells = 1
    for k in counts:  # stops early: a claim of 10^12 cells costs nothing
        cells *= k
        if cells > files:
            return "a grid of more cells than the step has files"
    steps = [(abs(k), c) for k, c in zip(grid.strides, counts, strict=True) if c > 1]
    low = grid.first + sum(min(0, k * (c - 1)) for k, c in zip(grid.strides, counts, strict=True))
    high = grid.first + sum(max(0, k * (c - 1)) for k, c in zip(grid.strides, counts, strict=True))
    if low < 0 or high >= files:
        return "a grid cell in a file that is not in the step"
    # Cells in distinct files: sorted by stride, each must step past every file the
    # cells along the smaller strides reach (a mixed-radix number, as a row-major mesh).
    reach = 0
    for k, c in sorted(steps):
        if k <= reach:
            return "a grid with two cells in one file"
        reach += k * (c - 1)
    return ""


class Reported(Protocol):
    """A box as a rank reports it (``_dist.messages.ShardBox``)."""

    @property
    def name(self) -> str: ...
    @property
    def offsets(self) -> list[int]: ...
    @property
    def lengths(self) -> list[int]: ...


def derive(shape: Sequence[int], files: Sequence[int], boxes: Sequence[Reported]) -> Grid | None:
    """The rule that gives exactly ``boxes`` (box i stored in file ``files[i]``), or None
    if no grid does. Every box is checked: the rule is kept only if it regenerates
    them all, each once, with its file and entry name. Vectorised: rank 0 runs this on
    every box of every rank (millions at 10,000 ranks)."""
    ndim, count = len(shape), len(boxes)
    if not boxes or 0 in shape or len({b.name for b in boxes}) != 1:
        return None
    offsets, lengths = [b.offsets for b in boxes], [b.lengths for b in boxes]
    if set(map(len, offsets)) != {ndim} or set(map(len, lengths)) != {ndim}:
        return None
    if ndim == 0:
        return Grid([], files[0], [], boxes[0].name) if count == 1 else None
    offs = np.fromiter(itertools.chain.from_iterable(offsets), np.int64, count * ndim).reshape(count, ndim)
    lens = np.fromiter(itertools.chain.from_iterable(lengths), np.int64, count * ndim).reshape(count, ndim)
    origin = np.flatnonzero(~offs.any(axis=1))
    if len(origin) != 1:
        return None
    o = int(origin[0])
    pieces, first = [int(n) for n in lens[o]], files[o]
    if any(not 1 <= s <= n for s, n in zip(pieces, shape, strict=True)):
        return None
    counts = [-(-n // s) for n, s in zip(shape, pieces, strict=True)]
    if math.prod(counts) != count:
        return None
    whole, step, cuts = np.array(shape), np.array(pieces), np.array(counts)
    cells, rest = np.divmod(offs, step)
    if rest.any() or (cells >= cuts).any() or (lens != np.minimum(step, whole - offs)).any():
        return None
    unit = np.array([math.prod(counts[d + 1 :]) for d in range(ndim)], np.int64)
    flat = cells @ unit  # each box's cell, row-major: each once, as there are as many as cells
    at = np.full(count, -1, np.int64)
    at[flat] = np.arange(count)
    if (at < 0).any():
        return None
    strides = [int(files[at[u]]) - first if c > 1 else 0 for u, c in zip(unit.tolist(), counts, strict=True)]
    grid = Grid(pieces, first, strides, boxes[0].name)
    if grid_problem(grid, shape, max(files) + 1):
        return None
    expect = first + cells @ np.array(strides, np.int64)
    if not np.array_equal(expect, np.fromiter(files, np.int64, count)):
        return None
    return grid
