"""Following an incremental checkpoint's references into its blobs.

A file that refers to blobs is read as one file that holds them all: ``follow`` gives
a Reader whose bytes past the file's own end are the blobs', each at an offset of its
own (a gap between two, so that no read runs from one into the next), and a Header in
which each referred entry is a stored entry at that offset, with the checksum the
referring file recorded. Every reader above (load, load_into, verify, DTensor boxes)
then reads blobs as it reads the file, and verifies them as it verifies the file. A
compressed blob is decompressed whole, once, at its first read (see ``_Blob``).

Each blob is found and its size checked before anything is allocated: a reference to
a missing blob, or to one of another size than the header says, is refused here.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from .._base.errors import CorruptCheckpointError
from .._base.names import BLOB_DIR
from .._format.blobs import blob_dir, blob_file
from .._format.codec import Header, Ref, TensorInfo
from .._format.compress import FRAME_HEAD, Stream, check_frame, decompress
from .._storage.protocol import ALIGN, Reader, Storage


def follow(storage: Storage, f: Reader, header: Header) -> tuple[Reader, Header]:
    """``f`` and its header as one file holding its blobs (``f`` itself if it refers to
    none). The returned reader owns ``f`` (closing it closes ``f``)."""
    if not header.refs:
        return f, header
    blobs: list[_Blob] = []
    tensors = dict(header.tensors)
    at = _aligned(f.size - header.data_start + 1)
    try:
        at = _place(storage, f, header, blobs, tensors, at)
    except BaseException:
        for blob in blobs:
            blob.close()
        raise
    return _Referring(f, blobs, header.data_start + at), dataclasses.replace(header, tensors=tensors)


def _place(
    storage: Storage, f: Reader, header: Header, blobs: list[_Blob], tensors: dict[str, TensorInfo], at: int
) -> int:
    """Find and check each blob of ``header``; put its entry at ``at`` on in ``tensors``
    (past the file's own bytes); where the next would go."""
    folder = blob_dir(storage, f.path, header.blob_dir)
    for name, ref in header.refs.items():
        path = storage.join(folder, blob_file(ref.blob, ref.compression))
        entry = storage.stat(path)
        if entry is None or not entry.is_file:
            raise CorruptCheckpointError(
                f.path,
                f"entry {name!r} refers to the missing blob {path}: an incremental save's file keeps "
                f"its large entries in the {BLOB_DIR}/ folder beside it; copy that folder with it, or "
                "make a file that needs none: `aiosnap convert --standalone SRC DST` in the directory "
                "it was saved in",
            )
        if entry.size != ref.stored:
            raise CorruptCheckpointError(
                f.path, f"entry {name!r} refers to the blob {path} as {ref.stored} bytes; it has {entry.size}"
            )
        nbytes = ref.info.nbytes
        blob = _Blob(header.data_start + at, nbytes, storage, path, ref, f.path)
        blobs.append(blob)
        if ref.compression is not None:  # what it holds is in its frame's header
            head = bytearray(min(FRAME_HEAD, ref.stored))
            blob.open().readinto(0, memoryview(head))
            check_frame(bytes(head), ref.stored, nbytes, f.path, path)
        tensors[name] = dataclasses.replace(ref.info, start=at, end=at + nbytes)
        at = _aligned(at + nbytes + 1)
    return at


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Blob:
    """One blob, at ``start`` in the referring file's reading: opened at its first read;
    a compressed one is decompressed whole then (its entry is read at most once)."""

    def __init__(self, start: int, nbytes: int, storage: Storage, path: str, ref: Ref, owner: str) -> None:
        self.start, self.nbytes, self.storage, self.path = start, nbytes, storage, path
        self.ref, self.owner = ref, owner
        self.reader: Reader | None = None
        self.plain: memoryview | None = None
        self.stream: Stream | None = None
        self.pos = 0  # where the stream is, in the entry's bytes

    def open(self) -> Reader:
        if self.reader is None:
            try:
                self.reader = self.storage.open_read(self.path)
            except FileNotFoundError:
                raise CorruptCheckpointError(self.owner, f"the blob {self.path} is missing") from None
            if self.reader.size != self.ref.stored:
                raise CorruptCheckpointError(self.owner, f"the blob {self.path} changed size")
        return self.reader

    def read(self, offset: int, bufs: Sequence[memoryview]) -> None:
        """Fill ``bufs`` from ``offset`` of the entry's bytes. A compressed entry read front
        to back (as a load reads it) is decompressed straight into them; any other read of
        it slices a decompressed copy."""
        if self.ref.compression is None:
            self.open().read_batch([(offset, bufs)])
            return
        if self.plain is None and offset == self.pos:
            if self.stream is None:
                self.stream = Stream(self.packed(), self.nbytes, self.ref.compression, self.owner, self.path)
            for buf in bufs:
                self.stream.readinto(buf.cast("B"))
                self.pos += buf.nbytes
            return
        plain = self.decompressed()
        for buf in bufs:
            n = buf.nbytes
            buf.cast("B")[:] = plain[offset : offset + n]
            offset += n

    def packed(self) -> bytearray:
        f = self.open()
        packed = bytearray(f.size)
        f.readinto(0, memoryview(packed))
        return packed

    def decompressed(self) -> memoryview:
        if self.plain is None:
            self.stream = None
            self.plain = decompress(
                self.packed(), self.nbytes, self.ref.compression or "", self.owner, self.path
            )
        return self.plain

    def close(self) -> None:
        reader, self.reader, self.plain, self.stream = self.reader, None, None, None
        if reader is not None:
            reader.close()


class _Referring:
    """The referring file and its blobs, as one Reader (see the module's docstring)."""

    def __init__(self, f: Reader, blobs: list[_Blob], size: int) -> None:
        self.f, self.blobs, self.path, self.size = f, blobs, f.path, size
        self._starts = [b.start for b in blobs]
        for name in ("batch_bytes", "batch_iovecs"):  # an object store's batching
            if hasattr(f, name):
                setattr(self, name, getattr(f, name))

    def _blob(self, offset: int, n: int) -> _Blob | None:
        """The blob ``n`` bytes from ``offset`` lie in; None for the file's own bytes."""
        if offset + n <= self.f.size:
            return None
        i = bisect.bisect_right(self._starts, offset) - 1
        blob = self.blobs[i] if i >= 0 else None
        if blob is None or offset + n > blob.start + blob.nbytes:
            raise CorruptCheckpointError(self.path, f"read of {n} bytes at {offset} crosses a blob's bounds")
        return blob

    def readinto(self, offset: int, buf: memoryview) -> None:
        self.read_batch([(offset, [buf])])

    def read_batch(self, requests: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        own: list[tuple[int, Sequence[memoryview]]] = []
        for offset, bufs in requests:
            blob = self._blob(offset, sum(b.nbytes for b in bufs))
            if blob is None:
                own.append((offset, bufs))
            else:
                blob.read(offset - blob.start, bufs)
        if own:
            self.f.read_batch(own)

    def close(self) -> None:
        try:
            for blob in self.blobs:
                blob.close()
        finally:
            self.f.close()
