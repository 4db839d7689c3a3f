"""Plan: lay a captured snapshot out as a file image (entries, offsets, header template),
before any byte is copied; and reuse the last layout while the state keeps its structure.

A training loop saves the same tree of the same tensors again and again. Laying out
its header costs ~3 us per tensor (a TensorInfo per entry, its JSON twice: the aiosnap
description and the safetensors entry); finding that nothing changed costs ~1 us: each
leaf's (name, kind, dtype, shape, bytes, shard), compared with the last save's. The
entries depend on nothing else, so equal leaves get the last save's entries, object for
object; and its header template too if the skeleton's JSON is the same, else one that
only ends differently (the skeleton ends the header, and holds the state's plain
values: a learning rate, a step count).

Everything here blocks: it runs in a worker thread through ``_offload``.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from .._base import heap as _heap
from . import codec as _format
from . import dtypes as _dtypes
from .codec import EntryPieces, TensorInfo
from .header import HeaderTemplate
from .tree import Leaf, Snapshot

#: What the layout of a leaf depends on: name, kind, file dtype, shape, bytes, shard.
Described = tuple[str, str, str, tuple[int, ...], int, tuple[tuple[int, ...], tuple[int, ...]] | None]


@dataclass(slots=True)
class Plan:
    """The layout of a file image, fixed before any byte is copied."""

    leaves: list[Leaf]
    #: This save's own list (a stage may empty it); the entries in it may be shared
    #: with other saves' plans, and are never changed.
    tensors: list[TensorInfo]
    template: HeaderTemplate
    tree: str

    @property
    def data_start(self) -> int:
        return self.template.size

    @property
    def size(self) -> int:
        return self.template.size + (self.tensors[-1].end if self.tensors else 0)


@dataclass(slots=True)
class _Layout:
    described: list[Described]
    tensors: list[TensorInfo]
    laid: EntryPieces
    #: The last template made of these entries, and the skeleton, external leaves and
    #: metadata it was made with.
    tree: str
    external: list[Described]
    template: HeaderTemplate
    metadata: dict[str, str] | None = None


class PlanCache:
    """The last layout a writer planned, for its next save (see the module's text).

    Used by one capture at a time (a writer captures under a lock). Holds the last
    save's entries and header template (~25 MB for 100,000 tensors) until ``clear``.
    """

    def __init__(self) -> None:
        self._last: _Layout | None = None

    def clear(self) -> None:
        """Drop the kept layout (blocking: a large one is freed a slice at a time)."""
        last, self._last = self._last, None
        if last is not None:
            _heap.release(last.described, last.tensors, last.laid.pieces, last.external)


def plan(snapshot: Snapshot, cache: PlanCache | None = None) -> Plan:
    """Pickle what must be pickled and lay the image out; with ``cache``, reuse the
    last layout of the same leaves (and its template, if the skeleton is the same too)."""
    leaves = [_pickled(leaf) for leaf in snapshot.leaves]
    described = list(map(_describe, leaves))
    external = list(map(_describe, snapshot.external))
    last = cache._last if cache is not None else None
    if last is None or last.described != described:
        if cache is not None:
            cache.clear()  # before the new layout is made: never two at once
        infos, pos = [], 0
        for name, kind, dtype, shape, nbytes, shard in described:
            infos.append(TensorInfo(name, kind, dtype, shape, pos, pos + nbytes, 0, shard))
            pos += nbytes
        laid = _format.entry_pieces(infos)
        template = _format.header_template(
            infos, snapshot.tree, _outside(external), laid, metadata=snapshot.metadata
        )
        if cache is not None:
            cache._last = _Layout(
                described, list(infos), laid, snapshot.tree, external, template, snapshot.metadata
            )
        return Plan(leaves, infos, template, snapshot.tree)
    if last.tree != snapshot.tree or last.external != external or last.metadata != snapshot.metadata:
        # A skeleton holds the state's plain values (a learning rate, a step count):
        # only the end of the last piece changes.
        last.template = _format.header_template(
            last.tensors, snapshot.tree, _outside(external), last.laid, metadata=snapshot.metadata
        )
        last.tree, last.external, last.metadata = snapshot.tree, external, snapshot.metadata
    else:
        _heap.release(external)
    _heap.release(described)  # equal to the kept one; freed a slice at a time
    return Plan(leaves, list(last.tensors), last.template, snapshot.tree)


def _outside(external: list[Described]) -> list[TensorInfo]:
    return [
        TensorInfo(name, kind, dtype, shape, 0, 0, None, shard)
        for name, kind, dtype, shape, _, shard in external
    ]


def _describe(leaf: Leaf) -> Described:
    """What a leaf's layout depends on; pickles must already be bytes."""
    value = leaf.value
    if leaf.kind == "tensor":
        return (
            leaf.name,
            "tensor",
            _dtypes.torch_name(value.dtype),
            tuple(value.shape),
            value.nbytes,
            leaf.shard,
        )
    if leaf.kind == "pickle":
        return leaf.name, "pickle", "|u1", (len(value),), len(value), leaf.shard
    dtype = _dtypes.numpy_file_dtype(value.dtype)
    assert dtype is not None
    return leaf.name, leaf.kind, dtype.str, tuple(value.shape), value.nbytes, leaf.shard


def _pickled(leaf: Leaf) -> Leaf:
    if leaf.kind != "pickle":
        return leaf
    return Leaf(leaf.name, leaf.kind, pickle.dumps(leaf.value, protocol=pickle.HIGHEST_PROTOCOL))
