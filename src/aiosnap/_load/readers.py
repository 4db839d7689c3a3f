"""Reading the values a tree refers to, verified, into the memory they end up in.

Plain entries are read in file order, neighbours with one scattered read, straight
into the tensors and arrays that are returned (or the target's own, for
``load_into``). External entries come from the file of replicated entries. A DTensor
of a group checkpoint is read from the boxes the manifest indexes (``_load/boxes.py``).
A load into a target writes nothing there until everything it reads is checked
(``_load/proof.py``).
"""

from __future__ import annotations

import ctypes
import operator
import pickle
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from .._base import heap as _heap
from .._base import offload as _offload
from .._base.checksums import crc32c
from .._base.errors import CorruptCheckpointError, PickleNotAllowedError
from .._base.heap import hand_over
from .._format import dtypes as _dtypes
from .._format.codec import Header, TensorInfo
from .._format.manifest import SavedTensor
from .._format.tree import format_path, walk_leaves
from .._storage.posix import HUGE_MIN, huge_pages, populate
from .._storage.protocol import Reader
from .boxes import NUMPY_ADVISES as _NUMPY_ADVISES
from .boxes import Shards as Shards
from .boxes import empty_bytes as _empty
from .boxes import plan_dtensor
from .boxes import split as split
from .proof import verify_entries
from .targets import SMALL, Destinations

#: Neighbouring entries are read together, up to this many bytes and buffers per read.
READ_GROUP = 64 << 20
READ_IOVECS = 512
#: Entries under SMALL bytes (see ``_targets``) are read with their neighbours into one
#: scratch buffer of at most this many bytes, checked there and copied out.
SMALL_GROUP = 4 << 20
#: Large entries of a local file are read this many bytes at a time, the next piece's
#: fresh pages faulted in by a helper thread meanwhile (see ``read_all``).
READ_PIECE = 8 << 20

MapLocation = str | torch.device | None
#: What a load made or found for each entry: the object, and where its bytes go: a flat
#: uint8 array, or for a tensor under SMALL bytes the address of its data; None for an
#: entry under SMALL bytes that is made as it is read (``_in_buffer``).
Made = dict[str, Any]


class Guard(Protocol):
    """What a load into a target checks at the two points it must: before anything is
    read, and before the first write into the target (see ``_load/fit.py``)."""

    def before_read(self) -> None: ...
    def before_write(self) -> None: ...


class EntryReader:
    """Reads the leaves a tree refers to: from the file, external ones from the file of
    replicated entries, DTensors from their boxes; checking that each is the entry the
    tree describes."""

    def __init__(
        self,
        f: Reader,
        header: Header,
        map_location: MapLocation,
        allow_pickle: bool,
        shards: Shards | None = None,
    ) -> None:
        self.sources: list[tuple[Reader, Header]] = [(f, header)]
        self.map_location, self.allow_pickle, self.shards = map_location, allow_pickle, shards
        self.made: dict[str, object] = {}

    def add_replicas(self, f: Reader, header: Header) -> None:
        own = self.sources[0][1]
        for name, want in own.external.items():
            have = header.tensors.get(name)
            if have is not None and want.shard is None and _spec(have) != _spec(want):
                raise CorruptCheckpointError(
                    f.path,
                    f"replicated entry {name!r} is {have.dtype} {have.shape}, not {want.dtype} {want.shape}",
                )
        self.sources.append((f, header))

    def source(self, name: str) -> int:
        if name in self.sources[0][1].tensors:
            return 0
        if len(self.sources) > 1 and name in self.sources[0][1].external:
            if name not in self.sources[1][1].tensors:
                raise CorruptCheckpointError(self.sources[1][0].path, f"no replicated entry {name!r}")
            return 1
        if name in self.sources[0][1].external:
            raise CorruptCheckpointError(
                self.sources[0][0].path,
                f"entry {name!r} is stored in another rank's file: load the step directory",
            )
        raise ValueError(f"the tree refers to a missing tensor {name!r}")

    def lookup(self, name: str) -> TensorInfo | None:
        info = self.sources[0][1].tensors.get(name)
        if info is not None:
            return info
        try:
            return self.sources[self.source(name)][1].tensors[name]
        except (ValueError, CorruptCheckpointError):
            return None

    def resolve(self, kind: str, name: str, path: tuple[object, ...]) -> object:
        return self.made[name]  # prefetch() read every leaf the tree refers to

    def prefetch(self, tree: Any, dests: Destinations, guard: Guard | None = None) -> None:
        """Check every leaf the tree refers to, then read them all in file order.

        Neighbouring entries are read with one scattered read each, straight into the
        memory of the tensors and arrays that will be returned; checksums follow. What
        goes to a target's memory is read last, once every checksum of the load was
        checked: a load that fails writes nothing there. ``guard`` is told when every
        reference of the tree was checked, before anything is read, and again before the
        first write into a target.
        """
        wanted: dict[str, TensorInfo] = {}
        sharded: dict[str, tuple[str, SavedTensor]] = {}
        by_source: list[list[TensorInfo]] = [[] for _ in self.sources]
        seen: dict[str, str] = {}  # name -> the kind the tree first called it
        own = self.sources[0][1]
        stored, plain = own.tensors, by_source[0]
        # Every tensor leaf under a known dict (see Destinations.known) is one that find
        # took as a common leaf of this file, read in place: taken from its list, those
        # subtrees are not walked again (~1 us a tensor; for a target that is such a
        # dict, nothing is), and as nothing resolves them, they are in no table of what
        # was made. Each is still a tensor to any other reference the walk meets.
        skip = dests.known if dests.known and len(self.sources) == 1 else None
        leaves = walk_leaves(tree, skip=skip)
        if skip is not None and leaves:
            seen.update((known.name, "tensor") for known in dests.infos)
        others = 0  # leaves that are not the common one: made objects to finish
        for path, kind, name in leaves:
            info = stored.get(name)
            if kind == "tensor" and info is not None and info.kind == "tensor" and not info.shard:
                # The common leaf, in this file (checked as the general case below).
                if seen.setdefault(name, kind) != kind:
                    raise ValueError(f"{format_path(path)} is a {kind} but {name!r} is a {seen[name]}")
                if name not in wanted:
                    wanted[name] = info
                    plain.append(info)
                continue
            others += 1
            if kind == "dtensor" and self.shards is not None:
                where = format_path(path)
                saved = self.shards.saved(where, own.tensors.get(name) or own.external.get(name))
                # One DTensor at two paths (tied weights) is read once, for both: the
                # index must say the same of both.
                first = sharded.setdefault(name, (where, saved))
                if first[1] != saved:
                    raise ValueError(f"{where} and {first[0]} are one DTensor {name!r}, indexed as two")
            # Every reference is checked, not only the first: a second one of another
            # kind would get the first's object (a tensor where the tree says ndarray).
            if name in seen:
                if seen[name] != kind:
                    raise ValueError(f"{format_path(path)} is a {kind} but {name!r} is a {seen[name]}")
                continue
            seen[name] = kind
            if kind == "dtensor" and self.shards is not None:
                continue
            src = self.source(name)
            info = self.sources[src][1].tensors[name]
            if info.kind != ("tensor" if kind == "dtensor" else kind) or (kind == "dtensor") != bool(
                info.shard
            ):
                raise ValueError(f"{format_path(path)} is a {kind} but {name!r} is not")
            if kind == "pickle" and not self.allow_pickle:
                raise PickleNotAllowedError(
                    f"{self.sources[src][0].path}: {format_path(path)} is pickled; loading it runs code "
                    "from the file, so it needs allow_pickle=True"
                )
            wanted[name] = info
            by_source[src].append(info)
        _heap.release(leaves)  # not at once: see release
        if guard is not None:
            guard.before_read()
        direct = dests.direct
        # None: an entry under SMALL bytes, made where its group is read (see _read_small).
        made: Made = {
            name: direct.get(name) or (_allocate(info) if info.end - info.start >= SMALL else None)
            for name, info in wanted.items()
        }
        reading = made
        if skip is not None:
            unwalked = [info for info in dests.infos if info.name not in wanted] if wanted else dests.infos
            if unwalked:
                plain += unwalked
                reading = {**direct, **made} if made else direct
        placed = self._read_unplaced(by_source, reading, direct)
        if reading is not made:  # what read_all made of small entries is in reading
            made = {name: reading[name] for name in made}
        self._finish_made(made, wanted, others)
        self._read_placed(sharded, dests, placed, guard)

    def _read_unplaced(
        self, by_source: list[list[TensorInfo]], reading: Made, direct: dict[str, Any]
    ) -> list[tuple[Reader, Header, list[TensorInfo]]]:
        """Read every wanted entry but those a target's own memory takes, in file order;
        those, per source, to be read last. All or nothing: what a target's memory takes
        is read once everything else is read and checked (see _load/proof.py)."""
        placed: list[tuple[Reader, Header, list[TensorInfo]]] = []
        for (f, header), infos in zip(self.sources, by_source, strict=True):
            infos.sort(key=_START)
            if direct:
                mine = [info for info in infos if info.name in direct]
                if mine:
                    placed.append((f, header, mine))
                    infos = [info for info in infos if info.name not in direct]
            if infos:
                self.read_all(f, header, infos, reading, direct)
        return placed

    def _finish_made(self, made: Made, wanted: dict[str, TensorInfo], others: int) -> None:
        """``self.made``: what was read, as the tree asks for it (``others``: leaves that
        are not plain tensors, which change)."""
        if self.map_location is None and not others:  # only tensors, as they were made
            self.made = _heap.zip_dict(list(made), list(map(_OBJECT, made.values())))
        elif self.map_location is None:  # a tensor is what was made: only the others change
            self.made = {
                name: obj if wanted[name].kind == "tensor" else self.finish(wanted[name], obj)
                for name, (obj, _) in made.items()
            }
        else:
            self.made = {name: self.finish(wanted[name], obj) for name, (obj, _) in made.items()}
        _heap.release(made)  # its pairs and arrays (the rest only refers to what lives on)

    def _read_placed(
        self,
        sharded: dict[str, tuple[str, SavedTensor]],
        dests: Destinations,
        placed: list[tuple[Reader, Header, list[TensorInfo]]],
        guard: Guard | None,
    ) -> None:
        """The DTensors; then, once every checksum of what goes to a target is checked
        and the guard has not refused, the entries a target's memory takes."""
        fills = []
        for name, (where, saved) in sharded.items():
            assert self.shards is not None
            target = dests.shards.get(name)
            fill = plan_dtensor(self.shards, saved, target, where)
            if target is None:
                self.made[name] = fill.run(self.map_location)
            else:
                fills.append((name, fill))
        for f, header, infos in placed:
            verify_entries(f, header, infos)
        for _, fill in fills:
            fill.verify()
        if guard is not None:
            guard.before_write()
        for f, header, infos in placed:
            self.read_all(f, header, infos, dests.direct, dests.direct)
        for name, fill in fills:
            self.made[name] = fill.run()

    def read_all(
        self, f: Reader, header: Header, infos: list[TensorInfo], made: Made, placed: Mapping[str, Any]
    ) -> None:
        """Read ``infos`` (in file order) into ``made``, verified. A helper thread works
        beside the reads: it faults in the pages of the next step's buffers that are not
        ``placed`` in a target's memory (those were allocated for this load; the faults
        would otherwise stop the read at every page) and checks the checksums of the
        entries the step before completed. Large entries of a local file are read
        READ_PIECE bytes at a time (``_pieces``): only the first piece's pages are
        faulted in before the disk starts."""
        most, iovecs = getattr(f, "batch_bytes", READ_GROUP), getattr(f, "batch_iovecs", READ_IOVECS)
        # An object store's batch is one round trip of parallel GETs: read whole.
        piece = most if hasattr(f, "batch_bytes") else READ_PIECE
        steps = [step for group in _groups(infos, most, iovecs) for step in _pieces(group, made, piece)]
        ahead = _buffer(steps[0], made) if steps else None
        if steps:
            _populate(made, steps[0], placed, ahead)
        behind: list[tuple[TensorInfo, memoryview]] = []
        scratch = None
        with _offload.side_thread() as side:
            for k, step in enumerate(steps):
                side.wait()
                buffer, ahead = ahead, _buffer(steps[k + 1], made) if k + 1 < len(steps) else None
                side.submit(_side_work, f.path, behind, made, steps[k + 1 : k + 2], placed, ahead)
                behind = []
                if isinstance(step, list):  # entries under SMALL bytes, read through one buffer
                    if buffer is None:  # every entry has its place already: read through scratch
                        if scratch is None:
                            scratch = _empty(min(SMALL_GROUP, infos[-1].end - step[0].start))
                        buffer = scratch
                    _read_small(f, header.data_start + step[0].start, step, made, buffer)
                    continue
                f.read_batch([(header.data_start + step.start, [p.data for p in step.parts])])
                behind = [(info, memoryview(made[info.name][1])) for info in step.finished]
            side.wait()
        _verify(f.path, behind)

    def finish(self, info: TensorInfo, obj: Any) -> object:
        if info.kind == "tensor":
            return obj if self.map_location is None else obj.to(self.map_location)
        if info.kind == "pickle":
            return pickle.loads(obj.tobytes())  # the caller opted in
        return obj[()] if info.kind == "npscalar" else obj


_START, _OBJECT = operator.attrgetter("start"), operator.itemgetter(0)


def _spec(info: TensorInfo) -> tuple[str, str, tuple[int, ...]]:
    return info.kind, info.dtype, info.shape


def _groups(infos: list[TensorInfo], most: int, iovecs: int) -> Iterator[list[TensorInfo]]:
    """Neighbouring entries, in runs of at most ``most`` bytes and ``iovecs`` buffers (a
    reader may take larger batches than a file's preadv: an object store's batch is a
    round trip, its GETs run in parallel); entries under SMALL bytes in runs of their
    own, of at most SMALL_GROUP bytes, each one read into a scratch buffer."""
    group: list[TensorInfo] = []
    small = False
    for info in infos:
        if group and (
            info.start != group[-1].end
            or (info.nbytes < SMALL) != small
            or (info.end - group[0].start > SMALL_GROUP if small else len(group) >= iovecs)
            or info.end - group[0].start > most
        ):
            yield group
            group = []
        if not group:
            small = info.nbytes < SMALL
        group.append(info)
    if group:
        yield group


def _read_small(
    f: Reader, start: int, group: list[TensorInfo], made: Made, buffer: np.ndarray[Any, np.dtype[np.uint8]]
) -> None:
    """Read a run of small entries into ``buffer`` at once and check each there. An
    entry that has a place (a target's memory) is copied to it; one that has none (None
    in ``made``) becomes a view of the buffer (``_in_buffer``)."""
    base = group[0].start
    buf = buffer[: group[-1].end - base]
    raw, address = buf.data, buf.ctypes.data
    f.read_batch([(start, [raw])])
    check, move, view = crc32c, ctypes.memmove, _in_buffer  # per entry, a global looked up costs
    for info in group:
        hand_over()
        at, end = info.start - base, info.end - base
        if info.crc is not None and check(raw[at:end]) != info.crc:
            raise CorruptCheckpointError(f.path, f"checksum mismatch in tensor {info.name!r}")
        pair = made[info.name]
        if pair is None:
            made[info.name] = view(info, buf, at)
            continue
        dest = pair[1]
        if type(dest) is int:
            move(dest, address + at, end - at)
        else:
            dest[:] = buf[at:end]


def _buffer(group: list[TensorInfo] | _Piece, made: Made) -> np.ndarray[Any, np.dtype[np.uint8]] | None:
    """The memory a run of small entries is read into, if some of them have no place
    yet: its own, which their objects then share (see ``_in_buffer``); else None."""
    if not isinstance(group, list) or all(made[info.name] is not None for info in group):
        return None
    nbytes = group[-1].end - group[0].start
    raw = _empty(nbytes + _ALIGNMENT)
    skip = -raw.ctypes.data % _ALIGNMENT  # as torch aligns what it allocates
    return raw[skip : skip + nbytes]


#: Where a buffer of small entries starts (torch's CPU allocator aligns to 64 bytes).
_ALIGNMENT = 64


def _in_buffer(info: TensorInfo, buf: np.ndarray[Any, np.dtype[np.uint8]], at: int) -> tuple[Any, Any]:
    """What a small entry becomes, made on its bytes at ``buf[at:]`` (a buffer of its
    group alone) where its alignment allows: a tensor or array that is a view of them,
    with a storage of its own bytes (``torch.save`` writes those alone; the buffer lives
    while any of its views does). Made so, an entry costs no allocation and no copy;
    the buffer's pages were faulted in beside the read, where fresh memory's faults
    cost most (see ``_populate``). Otherwise a copy in memory of its own."""
    nbytes = info.end - info.start
    if info.kind == "tensor":
        carrier = _carrier(info.dtype)
        if carrier is not None and nbytes and at % carrier[0].itemsize == 0:
            tensor = torch.from_numpy(np.ndarray(info.shape, carrier[0], buf, at))
            return (tensor if carrier[1] is None else tensor.view(carrier[1])), None
    else:
        dtype = np.dtype(info.dtype)
        if nbytes and at % dtype.itemsize == 0:
            return np.ndarray(info.shape, dtype, buf, at), None
    obj, dest = _allocate(info)
    if type(dest) is int:
        ctypes.memmove(dest, buf.ctypes.data + at, nbytes)
    else:
        dest[:] = buf[at : at + nbytes]
    return obj, None


#: torch dtype name -> (the NumPy dtype its elements are read as, the torch dtype to
#: view the result as when NumPy has no such dtype), or None: made by copying.
_CARRIERS: dict[str, tuple[np.dtype[Any], torch.dtype | None] | None] = {}


def _carrier(name: str) -> tuple[np.dtype[Any], torch.dtype | None] | None:
    if name not in _CARRIERS:
        _CARRIERS[name] = _find_carrier(_dtypes.TORCH_DTYPES[name])
    return _CARRIERS[name]


def _find_carrier(dtype: torch.dtype) -> tuple[np.dtype[Any], torch.dtype | None] | None:
    try:
        same = torch.empty(1, dtype=dtype).numpy().dtype
        if torch.from_numpy(np.empty(1, same)).dtype == dtype:
            return same, None
    except (TypeError, RuntimeError):  # no NumPy dtype: bfloat16, float8, complex32, ...
        pass
    size = dtype.itemsize
    if (dtype.is_floating_point or dtype.is_complex) and size in (1, 2, 4, 8):
        try:  # bfloat16, float8 and complex32 read as unsigned ints of their size
            carrier = np.dtype(f"<u{size}")
            if torch.from_numpy(np.empty(1, carrier)).view(dtype).dtype == dtype:
                return carrier, dtype
        except (TypeError, RuntimeError):
            pass
    return None  # sub-byte and bit types: copied


@dataclass(frozen=True, slots=True)
class _Piece:
    """At most READ_PIECE bytes of large entries, contiguous from ``start`` in the data
    section: the arrays they go to (slices of the entries' own), and the entries whose
    last byte is in it (checked once it is read)."""

    start: int
    parts: list[np.ndarray[Any, np.dtype[np.uint8]]]
    names: list[str]
    finished: list[TensorInfo]


def _pieces(group: list[TensorInfo], made: Made, size: int) -> Iterator[list[TensorInfo] | _Piece]:
    """A group of entries as the steps it is read in: entries under SMALL bytes as they
    are (read into one buffer), larger ones cut into pieces of at most ``size`` bytes."""
    if group[0].nbytes < SMALL:
        yield group
        return
    start, filled = group[0].start, 0
    parts: list[np.ndarray[Any, np.dtype[np.uint8]]] = []
    names: list[str] = []
    finished: list[TensorInfo] = []
    for info in group:
        array, lo = made[info.name][1], 0
        while lo < info.nbytes:
            n = min(info.nbytes - lo, size - filled)
            parts.append(array[lo : lo + n])
            names.append(info.name)
            lo, filled = lo + n, filled + n
            if lo == info.nbytes:
                finished.append(info)
            if filled == size:
                yield _Piece(start, parts, names, finished)
                start, filled, parts, names, finished = start + filled, 0, [], [], []
    if parts:
        yield _Piece(start, parts, names, finished)


def _side_work(
    path: str,
    behind: list[tuple[TensorInfo, memoryview]],
    made: Made,
    ahead: list[list[TensorInfo] | _Piece],
    placed: Mapping[str, Any],
    buffer: np.ndarray[Any, np.dtype[np.uint8]] | None,
) -> None:
    for step in ahead:  # first: the reader needs these pages next
        _populate(made, step, placed, buffer)
    _verify(path, behind)


def _verify(path: str, read: list[tuple[TensorInfo, memoryview]]) -> None:
    for info, view in read:
        if info.crc is not None and crc32c(view) != info.crc:
            raise CorruptCheckpointError(path, f"checksum mismatch in tensor {info.name!r}")


#: Buffers below this come from the allocator's heap, mostly faulted in already.
_POPULATE_MIN = 1 << 20


def _populate(
    made: Made,
    step: list[TensorInfo] | _Piece,
    placed: Mapping[str, Any],
    buffer: np.ndarray[Any, np.dtype[np.uint8]] | None,
) -> None:
    if buffer is not None:  # small entries' own buffer: fresh memory, all of it
        populate(buffer.ctypes.data, buffer.nbytes)
        return
    if isinstance(step, list):  # small entries, each in its place already
        return
    for name, part in zip(step.names, step.parts, strict=True):
        if name not in placed and made[name][1].nbytes >= _POPULATE_MIN:
            populate(part.ctypes.data, part.nbytes)


def _allocate(info: TensorInfo) -> tuple[Any, Any]:
    """The object an entry becomes, and where its bytes go (see Made)."""
    hand_over()  # per entry, in a worker thread: the event loop gets its turn
    if info.kind == "tensor":
        # Sizes as arguments, not a tuple: torch parses them in 0.6 us instead of 1.1.
        shape, dtype = info.shape, _dtypes.TORCH_DTYPES[info.dtype]
        tensor = torch.empty(*shape, dtype=dtype) if shape else torch.empty((), dtype=dtype)
        nbytes = info.end - info.start
        if nbytes < SMALL:
            return tensor, tensor.data_ptr()
        if nbytes >= HUGE_MIN:
            huge_pages(tensor.data_ptr(), nbytes)
        return tensor, tensor.reshape(-1).view(torch.uint8).numpy()
    array = np.empty(info.shape, dtype=np.dtype(info.dtype))
    if array.nbytes >= HUGE_MIN:
        huge_pages(array.ctypes.data, array.nbytes, numpy_advised=_NUMPY_ADVISES)
    return array, array.reshape(-1).view(np.uint8)
