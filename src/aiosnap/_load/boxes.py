"""DTensors of a group checkpoint: read from the boxes the manifest indexes.

Only the byte runs of each saved box that overlap the box wanted (a target's local
shard, or the whole) are read, each checked against the checksums of the blocks it
lies in. A load into a target checks them all first (``Fill.verify``), and only then
writes them (``Fill.run``): a corrupt box leaves the target as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._base.checksums import crc32c
from .._base.errors import CorruptCheckpointError, StateMismatchError
from .._format import dtypes as _dtypes
from .._format.codec import Header, TensorInfo
from .._format.dtypes import as_copyable
from .._format.header import BLOCK
from .._format.manifest import SavedTensor, holds_box, indexed
from .._format.shards import Box, Run, is_dtensor, runs, shard_of
from .._storage.posix import HUGE_MIN, huge_pages
from .._storage.protocol import Reader

#: Bytes of shard read through a scratch buffer at a time (partial reads, devices).
SCRATCH = 64 << 20
#: Opens rank file ``i`` of the step (cached by the caller), checked against the manifest.
OpenRank = Callable[[int], tuple[Reader, Header]]
#: The reads that fill a box: for each saved box it overlaps, its file, where the file's
#: data starts, its entry and the runs to read of it.
Plan = list[tuple[Reader, int, TensorInfo, list[Run]]]


@dataclass(frozen=True, slots=True)
class Shards:
    """A group checkpoint's DTensors, for a reader: where their boxes lie (as the
    manifest at ``path`` says)."""

    index: dict[str, SavedTensor]
    open: OpenRank
    path: str = ""

    def saved(self, where: str, info: TensorInfo | None) -> SavedTensor:
        """The boxes of the DTensor at tree path ``where`` (see ``indexed``): a DTensor
        with bytes that the manifest does not index means it is not this step's."""
        saved = indexed(self.index, where, info)
        if saved is None:
            raise CorruptCheckpointError(self.path, f"no boxes of the DTensor at {where}")
        return saved


@dataclass(slots=True)
class Fill:
    """The reads of one DTensor of a step into ``dest`` (a target's local shard, a whole
    target, or None: a whole tensor made for it); ``result``: what the load makes of it
    (the target, or None: the whole, once made)."""

    plan: Plan
    dest: torch.Tensor | None
    result: Any
    dtype: torch.dtype
    shape: tuple[int, ...]

    def verify(self) -> None:
        """Check every block the reads lie in, keeping none of their bytes."""
        for f, data_start, info, pieces in self.plan:
            _BoxReader(f, data_start, info, None).verify(pieces)

    def run(self, map_location: Any = None) -> Any:
        """Read the boxes into their place; what the load holds for the DTensor."""
        whole = self.dest
        if whole is None:
            whole = torch.empty(self.shape, dtype=self.dtype)
            if whole.nbytes >= HUGE_MIN:
                huge_pages(whole.data_ptr(), whole.nbytes)
        for f, data_start, info, pieces in self.plan:
            _BoxReader(f, data_start, info, whole).read(pieces)
        if self.result is not None:
            return self.result
        return whole if map_location is None else whole.to(map_location)


def plan_dtensor(shards: Shards, saved: SavedTensor, target: Any, where: str) -> Fill:
    """How to fill ``target`` (a DTensor: its local shard; a tensor: the whole) from the
    saved boxes, or to assemble the whole tensor when there is no target. The boxes are
    found in their files before anything is allocated: only entries the files hold, of
    the manifest's sizes, justify the memory."""
    dtype, shape = _dtypes.TORCH_DTYPES[saved.dtype], tuple(saved.shape)
    if target is not None and (tuple(target.shape) != shape or target.dtype != dtype):
        raise StateMismatchError(
            f"{where}: checkpoint has {dtype} {shape}, target {target.dtype} {tuple(target.shape)}"
        )
    if is_dtensor(target):
        mine = shard_of(target, where)
        if mine is None:  # this rank holds none of it
            return Fill([], None, target, dtype, shape)
        return Fill(_plan(shards, saved, mine.box, where), mine.local, target, dtype, shape)
    return Fill(_plan(shards, saved, Box((0,) * len(shape), shape), where), target, target, dtype, shape)


def _plan(shards: Shards, saved: SavedTensor, box: Box, where: str) -> Plan:
    itemsize = _dtypes.TORCH_DTYPES[saved.dtype].itemsize
    plan = []
    for sb in saved.overlapping(box):  # a grid's: only the cells the box meets
        # The entry first: the runs of a box no file holds could be any number.
        f, header = shards.open(sb.file)
        info = header.tensors.get(sb.name)
        if not holds_box(info, saved, sb):
            raise CorruptCheckpointError(f.path, f"does not hold the box of {where} its manifest says")
        assert info is not None
        pieces = [r for run in runs(sb.box, box, itemsize) for r in split(run, SCRATCH, itemsize)]
        plan.append((f, header.data_start, info, pieces))
    return plan


class _BoxReader:
    """Reads runs of one saved box into a local tensor, verifying what it reads; or
    only verifies them (``local`` None)."""

    def __init__(self, f: Reader, data_start: int, info: TensorInfo, local: torch.Tensor | None) -> None:
        self.f, self.info, self.local = f, info, local
        self.base = data_start + info.start

    def verify(self, pieces: list[Run]) -> None:
        """Check the blocks the runs lie in (the whole entry, if it has none), through
        one scratch buffer: what ``read`` would check, without writing anything."""
        if self.info.blocks is None:
            buf = empty_bytes(self.info.nbytes)
            self.f.readinto(self.base, buf.data)
            if crc32c(buf.data) != self.info.crc:
                raise CorruptCheckpointError(self.f.path, f"checksum mismatch in tensor {self.info.name!r}")
            return
        spans: list[tuple[int, int]] = []
        for run in sorted(pieces, key=lambda r: r.src):
            lo, hi = self._span(run)
            if spans and lo <= spans[-1][1] and hi - spans[-1][0] <= SCRATCH:
                spans[-1] = (spans[-1][0], max(hi, spans[-1][1]))
            else:
                spans.append((lo, hi))
        scratch = empty_bytes(max((hi - lo for lo, hi in spans), default=0))
        for lo, hi in spans:
            raw = scratch[: hi - lo].data
            self.f.readinto(self.base + lo, raw)
            self._check(lo, raw)

    def read(self, pieces: list[Run]) -> None:
        if self.info.blocks is None:  # small: read it whole, once, and check it whole
            buf = empty_bytes(self.info.nbytes)
            self.f.readinto(self.base, buf.data)
            if crc32c(buf.data) != self.info.crc:
                raise CorruptCheckpointError(self.f.path, f"checksum mismatch in tensor {self.info.name!r}")
            for run in pieces:
                self._copy(run, buf[run.src : run.src + run.nbytes])
            return
        pieces = sorted(pieces, key=lambda r: r.src)
        i = 0
        while i < len(pieces):
            run = pieces[i]
            lo, hi = self._span(run)
            dest = self._view(run)
            if (lo, hi) == (run.src, run.src + run.nbytes) and _is_host_contiguous(dest):
                raw = _bytes_of(dest).data  # the run is whole blocks: read in place
                self.f.readinto(self.base + lo, raw)
                self._check(lo, raw)
                i += 1
                continue
            # Runs whose blocks meet share one read (a column shard is a run per row:
            # each block is read once, not once per row), within the scratch bound.
            j = i + 1
            while j < len(pieces):
                lo_j, hi_j = self._span(pieces[j])
                if lo_j > hi or hi_j - lo > SCRATCH:
                    break
                hi = max(hi, hi_j)
                j += 1
            buf = empty_bytes(hi - lo)
            self.f.readinto(self.base + lo, buf.data)
            self._check(lo, buf.data)
            for piece in pieces[i:j]:
                self._copy(piece, buf[piece.src - lo : piece.src - lo + piece.nbytes])
            i = j

    def _span(self, run: Run) -> tuple[int, int]:
        """The blocks a run lies in, as a byte range of the entry."""
        end = -(-(run.src + run.nbytes) // BLOCK) * BLOCK
        return run.src // BLOCK * BLOCK, min(self.info.nbytes, end)

    def _check(self, lo: int, raw: memoryview) -> None:
        assert self.info.blocks is not None
        first = lo // BLOCK
        got = [crc32c(raw[i : i + BLOCK]) for i in range(0, len(raw), BLOCK)]
        if got != list(self.info.blocks[first : first + len(got)]):
            raise CorruptCheckpointError(self.f.path, f"checksum mismatch in tensor {self.info.name!r}")

    def _view(self, run: Run) -> torch.Tensor:
        assert self.local is not None  # only a read writes
        k = len(run.dst) - len(run.shape)
        index = tuple(run.dst[:k]) + tuple(
            slice(d, d + n) for d, n in zip(run.dst[k:], run.shape, strict=True)
        )
        return self.local[index] if index else self.local

    def _copy(self, run: Run, raw: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        dest = self._view(run)
        src = as_copyable(torch.from_numpy(raw).view(dest.dtype)).view(run.shape)
        with torch.no_grad():
            as_copyable(dest).copy_(src)


def _is_host_contiguous(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _bytes_of(t: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    raw: np.ndarray[Any, np.dtype[np.uint8]] = as_copyable(t.detach()).reshape(-1).view(torch.uint8).numpy()
    return raw


def split(run: Run, limit: int, itemsize: int) -> Iterator[Run]:
    """``run`` in pieces of at most ``limit`` bytes (but never less than one element),
    cut along its leading dimensions, so each piece still lands in one box."""
    if run.nbytes <= limit or not run.shape:
        yield run
        return
    k = len(run.dst) - len(run.shape)
    rows, row_bytes = run.shape[0], run.nbytes // run.shape[0]
    if row_bytes <= limit:
        step = max(1, limit // row_bytes)
        for i in range(0, rows, step):
            n = min(step, rows - i)
            dst = (*run.dst[:k], run.dst[k] + i, *run.dst[k + 1 :])
            yield Run(run.src + i * row_bytes, n * row_bytes, dst, (n, *run.shape[1:]))
        return
    for i in range(rows):  # a row alone is too long: one row at a time, cut further
        dst = (*run.dst[:k], run.dst[k] + i, *run.dst[k + 1 :])
        yield from split(Run(run.src + i * row_bytes, row_bytes, dst, run.shape[1:]), limit, itemsize)


def empty_bytes(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Fresh bytes, with the huge-page advice that pays here (see ``huge_pages``)."""
    raw = np.empty(nbytes, np.uint8)
    if nbytes >= HUGE_MIN:
        huge_pages(raw.ctypes.data, nbytes, numpy_advised=NUMPY_ADVISES)
    return raw


#: Whether NumPy asks for huge pages for its large arrays (NUMPY_MADVISE_HUGEPAGE).
NUMPY_ADVISES: bool = getattr(getattr(np, "_core", np).multiarray, "_get_madvise_hugepage", lambda: False)()
