"""Checksums checked before a load writes into a target (``load_into`` is all or nothing).

The entries a load reads straight into a target's memory are checked first, without
keeping their bytes: read a piece at a time into one of two scratch buffers, the helper
thread computing the checksums of one piece while the next is read. Only once every
one is good does the load read them again, into the target. From a local file the
second read is served by the page cache the first one filled: a copy, not a disk read.
Nothing of the state is held twice: the scratch is two pieces.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._base import offload as _offload
from .._base.checksums import crc32c
from .._base.errors import CorruptCheckpointError
from .._format.codec import Header, TensorInfo
from .._storage.protocol import Reader
from .boxes import empty_bytes

#: Bytes read per piece from a local file (the loads' own piece: see ``readers``).
PIECE = 8 << 20
#: From a reader that takes batches (an object store: one round trip of parallel
#: GETs), a piece is this many bytes, in requests of PIECE bytes.
BATCH_PIECE = 64 << 20


@dataclass(slots=True)
class _Piece:
    """Byte ranges of the file read into one scratch buffer, each a request of one
    view (file order is buffer order), and the parts of entries they hold: (the entry,
    the part's bytes, whether the entry ends there)."""

    buffer: np.ndarray[Any, np.dtype[np.uint8]]
    requests: list[tuple[int, list[memoryview]]] = field(default_factory=list)
    parts: list[tuple[TensorInfo, memoryview, bool]] = field(default_factory=list)
    filled: int = 0
    #: Where the last request starts in the buffer, and where it ends in the file.
    request_at: int = 0
    request_end: int = -1

    def add(self, offset: int, n: int, most: int) -> memoryview:
        """Bytes ``offset`` to ``offset + n`` of the file, next in the buffer: joined to
        the last request if they follow it and it stays within ``most`` bytes."""
        at, self.filled = self.filled, self.filled + n
        if offset != self.request_end or self.filled - self.request_at > most:
            self.request_at = at
            self.requests.append((offset, []))
        view = memoryview(self.buffer[self.request_at : self.filled])  # type: ignore[arg-type]
        self.requests[-1] = (self.requests[-1][0], [view])
        self.request_end = offset + n
        return view[at - self.request_at :]


def verify_entries(f: Reader, header: Header, infos: list[TensorInfo]) -> None:
    """Check the checksums of ``infos`` (in file order), keeping none of their bytes;
    CorruptCheckpointError names the first that fails."""
    infos = [info for info in infos if info.crc is not None and info.nbytes]
    if not infos:
        return
    batched = hasattr(f, "batch_bytes")
    size = min(BATCH_PIECE if batched else PIECE, sum(info.nbytes for info in infos))
    buffers = (empty_bytes(size), empty_bytes(size))
    crcs: dict[str, int] = {}
    with _offload.side_thread() as side:
        for piece in _pieces(header.data_start, infos, buffers, PIECE if batched else size):
            f.read_batch(piece.requests)
            side.wait()  # the piece before: its buffer is the next one's
            side.submit(_check, f.path, piece.parts, crcs)
        side.wait()


def _pieces(
    data_start: int, infos: list[TensorInfo], buffers: tuple[np.ndarray[Any, Any], ...], most: int
) -> Iterator[_Piece]:
    """The pieces the entries are read in, each filling one of the buffers, in turn;
    requests of at most ``most`` bytes."""
    k = 0
    piece = _Piece(buffers[0])
    for info in infos:
        at = info.start
        while at < info.end:
            if piece.filled == len(piece.buffer):
                yield piece
                k += 1
                piece = _Piece(buffers[k % 2])
            n = min(info.end - at, len(piece.buffer) - piece.filled)
            view = piece.add(data_start + at, n, most)
            at += n
            piece.parts.append((info, view, at == info.end))
    if piece.parts:
        yield piece


def _check(path: str, parts: list[tuple[TensorInfo, memoryview, bool]], crcs: dict[str, int]) -> None:
    """The checksums of the parts, each entry's carried on from its parts before."""
    for info, view, last in parts:
        crc = crc32c(view, crcs.pop(info.name, 0))
        if not last:
            crcs[info.name] = crc
        elif crc != info.crc:
            raise CorruptCheckpointError(path, f"checksum mismatch in tensor {info.name!r}")
