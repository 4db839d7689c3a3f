"""Copying a committed checkpoint from one storage to another, its blobs first.

The remote tier's uploads (``_manager/upload.py``) go through here: each object is
copied through the far end's commit protocol (invisible until whole), and a file that
refers to blobs (an incremental save's) is copied only after every blob it refers to
that the far end lacks, those blobs pinned meanwhile so that the far end's collector
keeps them. A blob this process has not checked is checked as it is copied
(``_save/trust.py``). Every function here is blocking: run it in a worker thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .._base.errors import CorruptCheckpointError, ForeignFileError
from .._format.blobs import blob_dir, blob_file
from .._format.codec import read_header, written_by_aiosnap
from .._storage.protocol import CommitTimes, Storage, describe, lstat
from .incremental import PINS, check_blob_folder
from .trust import TRUSTED, Check, verified, wrote

#: Bytes read from the local file and handed to the upload per call.
COPY_PIECE = 32 << 20


def copy_object(
    src: Storage,
    src_path: str,
    dst: Storage,
    dst_path: str,
    on_piece: Callable[[int], object] | None = None,
    check: Check | None = None,
) -> CommitTimes:
    """Copy a committed object to another storage, through its commit protocol (the copy
    is invisible until whole); ``on_piece(n)`` after each piece of ``n`` bytes is handed
    over. ``check``: a blob's, fed every piece; the copy is not committed unless it holds
    what its name says (CorruptCheckpointError). Blocking."""
    reader = src.open_read(src_path)
    try:
        size = reader.size
        upload = dst.create(dst_path, size)
        try:
            buf = memoryview(bytearray(min(COPY_PIECE, max(size, 1))))
            t0 = time.perf_counter()
            for offset in range(0, size, len(buf)):
                piece = buf[: min(len(buf), size - offset)]
                reader.readinto(offset, piece)
                if check is not None:
                    check.feed(piece)
                upload.write_at(offset, piece)
                if on_piece is not None:
                    on_piece(len(piece))
            write_s = time.perf_counter() - t0
            fault = None if check is None else check.fault()
            if fault is not None:
                raise CorruptCheckpointError(src_path, f"this blob is damaged ({fault}); it was not uploaded")
            times = upload.commit()
        except BaseException:
            upload.abort()
            raise
    finally:
        reader.close()
    return CommitTimes(write_s + times.write_s, times.fsync_s, size)


def copy_checkpoint(
    src: Storage,
    src_path: str,
    dst: Storage,
    dst_path: str,
    on_piece: Callable[[int], object] | None = None,
) -> CommitTimes:
    """Copy a committed checkpoint file (``copy_object``), and before it the blobs it
    refers to (an incremental save's) that the far end lacks; ``bytes``: all that was
    sent. The blobs are pinned meanwhile, so the far end's collector keeps them until the
    file that refers to them is there. Blocking."""
    blobs, rank_dir = _blobs_of(src, src_path)
    if not blobs:
        return copy_object(src, src_path, dst, dst_path, on_piece)
    here, there = blob_dir(src, src_path, rank_dir), blob_dir(dst, dst_path, rank_dir)
    check_blob_folder(dst, there, rank_dir)  # a user's link there would take the blobs out
    sent = write_s = fsync_s = 0.0
    for blob in blobs:
        PINS.pin(blob.blob)
    try:
        for blob in blobs:
            times = _copy_blob(
                src, src.join(here, blob.name), dst, dst.join(there, blob.name), blob, on_piece
            )
            sent, write_s, fsync_s = sent + times.bytes, write_s + times.write_s, fsync_s + times.fsync_s
        times = copy_object(src, src_path, dst, dst_path, on_piece)
    finally:
        PINS.unpin(blob.blob for blob in blobs)
    return CommitTimes(write_s + times.write_s, fsync_s + times.fsync_s, int(sent) + times.bytes)


@dataclass(frozen=True, slots=True)
class _BlobRef:
    blob: str  # its content hash
    name: str  # its file name
    nbytes: int  # the entry's bytes
    compression: str | None


def _copy_blob(
    src: Storage, here: str, dst: Storage, far: str, blob: _BlobRef, on_piece: Callable[[int], object] | None
) -> CommitTimes:
    """Copy one blob unless the far end has it: an object of its size there that this
    process uploaded or checked (see ``_save/trust``); anything else under its name (a
    foreign object, a damaged copy) is replaced; a link or a directory there is refused
    (ForeignFileError). A local blob this process has not checked is checked as it is
    copied. Blocking."""
    local = src.stat(here)
    entry = lstat(dst, far)
    if entry is not None and not entry.is_file:  # a user's link or directory: left alone
        raise ForeignFileError(far, describe(entry))
    if local is not None and entry is not None and entry.size == local.size:
        args = (blob.blob, blob.nbytes, blob.compression, "uploaded again", on_piece)
        if verified(dst, far, entry, *args):  # read back: progress, as a copy is
            return CommitTimes(0.0, 0.0, 0)
    trusted = TRUSTED.holds(here, local)
    check = None if trusted else Check(blob.blob, blob.nbytes, blob.compression, here)
    times = copy_object(src, here, dst, far, on_piece, check)
    if not trusted and local is not None:
        TRUSTED.add(here, local)
    wrote(dst, far)
    return times


def _blobs_of(storage: Storage, path: str) -> tuple[list[_BlobRef], str | None]:
    """The blobs the checkpoint file at ``path`` refers to, and the rank folder they are
    in (see ``blob_dir``)."""
    reader = storage.open_read(path)
    try:
        if not written_by_aiosnap(reader):
            return [], None
        header = read_header(reader)
    finally:
        reader.close()
    found = {}
    for r in header.refs.values():
        name = blob_file(r.blob, r.compression)
        found[name] = _BlobRef(r.blob, name, r.info.nbytes, r.compression)
    return [found[name] for name in sorted(found)], header.blob_dir
