"""A self-contained copy of a checkpoint that refers to blobs.

The copy holds every entry in its own data section, with the same tree, names,
descriptions and checksums: a plain aiosnap file (a safetensors file), which can be
copied alone. Each entry is read through ``follow`` and checked against its crc32c
before it is written, so a damaged blob is never copied into a file that would vouch
for it. The copy is committed as any save is (temp file, fsync, rename, fsync).
"""

from __future__ import annotations

import array
import dataclasses
import json

import numpy as np

from .._base import offload as _offload
from .._base.checksums import crc32c
from .._base.errors import CorruptCheckpointError
from .._format.codec import TensorInfo, header_template, read_header
from .._storage.backends import resolve
from .._storage.protocol import CommitTimes, Reader, Storage, Upload
from .refs import follow

#: Bytes copied per read and write.
_PIECE = 16 << 20
#: A whole file, as an entry to copy (no checksum of its own: the header's cover it).
_WHOLE = TensorInfo("", "tensor", "uint8", (0,), 0, 0, None)


async def standalone(src: str, dst: str, *, storage: Storage | None = None) -> int:
    """Write ``dst``, a self-contained copy of the checkpoint file ``src``: the entries it
    refers to (an incremental save's blobs) stored in the file itself. A file that
    refers to nothing is copied as it is. Returns the bytes written; raises
    CorruptCheckpointError if any entry's bytes fail their checksum."""
    times = await _offload.run_io(standalone_now, src, dst, storage)
    return times.bytes


def standalone_now(src: str, dst: str, storage: Storage | None = None) -> CommitTimes:
    """``standalone`` in the calling thread. Blocking."""
    storage, src = resolve(src, storage)
    storage, dst = resolve(dst, storage)
    f = storage.open_read(src)
    try:
        header = read_header(f)
        if not header.refs:  # self-contained already (a plain safetensors file too)
            whole = dataclasses.replace(_WHOLE, end=f.size)
            upload = storage.create(dst, f.size)
            try:
                _copy(f, 0, whole, upload, 0)
                return upload.commit()
            except BaseException:
                upload.abort()
                raise
        f, header = follow(storage, f, header)
        entries = sorted(header.tensors.values(), key=lambda t: t.start)
        placed: list[TensorInfo] = []
        pos = 0
        for info in entries:
            placed.append(dataclasses.replace(info, start=pos, end=pos + info.nbytes))
            pos += info.nbytes
        tree = json.dumps(header.tree, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
        template = header_template(placed, tree, list(header.external.values()) or None)
        crcs = array.array("q")
        for info in placed:
            crcs.extend(info.blocks or ())
            crcs.append(info.crc or 0)
        upload = storage.create(dst, template.size + pos)
        try:
            upload.write_at(0, memoryview(template.render(crcs)))
            for old, new in zip(entries, placed, strict=True):
                _copy(f, header.data_start, old, upload, template.size + new.start)
            return upload.commit()
        except BaseException:
            upload.abort()
            raise
    finally:
        f.close()


def _copy(f: Reader, data_start: int, info: TensorInfo, upload: Upload, at: int) -> None:
    """Copy one entry, checking its crc32c on the way."""
    crc, done = 0, 0
    while done < info.nbytes:
        piece = np.empty(min(_PIECE, info.nbytes - done), np.uint8)
        f.readinto(data_start + info.start + done, piece.data)
        crc = crc32c(piece.data, crc)
        upload.write_at(at + done, piece.data)
        done += len(piece)
    if info.crc is not None and crc != info.crc:
        raise CorruptCheckpointError(f.path, f"checksum mismatch in tensor {info.name!r}")
