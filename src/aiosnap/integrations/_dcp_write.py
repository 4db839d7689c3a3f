"""A rank's share of a DCP save: its items, serialized as DCP serializes them, into
files committed through aiosnap's ``Storage`` (durable and atomic: a temp file written,
fsynced, renamed, the directory fsynced; or an object store's upload completed), with
the crc32c of every item recorded in its ``_StorageInfo``.

Everything here blocks: DCP calls ``write_data`` from the thread that saves (the
training thread, or the thread of ``async_save``) and waits for it.
"""

from __future__ import annotations

import io
import mmap
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from aiosnap._base.checksums import crc32c
from aiosnap._storage.protocol import Storage, Upload

from ._dcp_layout import storage_info

#: The pieces a rank's file is written in: aligned, so a local disk takes them with O_DIRECT.
PIECE = 8 << 20
#: Pieces in flight: one filled while the others are written.
DEPTH = 3


class _UploadStream(io.RawIOBase):
    """A binary file over an ``Upload``: what is written is checksummed, counted and
    gathered into page-aligned pieces of ``PIECE`` bytes, which a thread of the stream
    hands to the upload whole, front to back, while the next piece fills. A local disk
    writes them with O_DIRECT, past the page cache (whose dirty-page throttling holds a
    buffered writer to the disk's pace anyway, with no overlap); only the tail is
    written buffered. ``finish`` sends the tail and ends the thread; ``close`` ends it
    on any path."""

    def __init__(self, upload: Upload) -> None:
        super().__init__()
        self._upload = upload
        # A local file has the bytes once write_at returns: its pieces are reused.
        # Another backend may keep a piece until the commit: each gets a new one.
        self._reuse = upload.local_path is not None
        self._free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        for _ in range(DEPTH if self._reuse else 0):
            self._free.put(_new_piece())
        self._todo: queue.Queue[tuple[int, memoryview, int] | None] = queue.Queue(DEPTH)
        self.failure: BaseException | None = None  # of a piece's write, in the thread
        self._piece = self._next_piece()
        self._fill = 0
        self._at = 0  # the file offset of the piece
        self.crc = 0
        self.written = 0
        self._thread: threading.Thread | None = threading.Thread(
            target=self._send_all, name="aiosnap-dcp-write"
        )
        self._thread.start()

    def _next_piece(self) -> memoryview:
        return self._free.get() if self._reuse else _new_piece()

    def _send_all(self) -> None:
        while (job := self._todo.get()) is not None:
            at, piece, n = job
            if self.failure is None:
                try:
                    self._upload.write_at(at, piece[:n])
                except BaseException as exc:  # raised in the saving thread, at its next write
                    self.failure = exc
            if self._reuse:
                self._free.put(piece)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = whole = memoryview(data).cast("B")
        self.crc = crc32c(view, self.crc)
        self.written += len(view)
        while len(view):
            n = min(len(view), PIECE - self._fill)
            self._piece[self._fill : self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == PIECE:
                self._send()
        return len(whole)

    def _send(self) -> None:
        if self.failure is not None:
            raise self.failure
        self._todo.put((self._at, self._piece, self._fill))
        self._at += self._fill
        self._fill = 0
        self._piece = self._next_piece()

    def restart(self) -> None:
        """Start the next item's checksum."""
        self.crc = 0

    def finish(self) -> None:
        """Send the last, partial piece; return once every piece is written."""
        if self._fill:
            self._send()
        self.close()
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        if self._thread is not None:
            thread, self._thread = self._thread, None
            self._todo.put(None)
            thread.join()
        super().close()


def _new_piece() -> memoryview:
    return memoryview(mmap.mmap(-1, PIECE))  # anonymous maps are page-aligned


def _cpu_tensor(planner: SavePlanner, item: WriteItem) -> torch.Tensor:
    """The item's tensor on the CPU, holding only its own bytes: ``torch.save`` of a view
    would write the whole storage it views (DCP's FileSystemWriter does the same)."""
    tensor = planner.resolve_data(item)
    assert isinstance(tensor, torch.Tensor), f"{item.index.fqn}: a tensor item resolved to {type(tensor)}"
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor


def _write_items(
    out: _UploadStream, name: str, items: Sequence[WriteItem], planner: SavePlanner
) -> list[WriteResult]:
    results = []
    for item in items:
        offset = out.written
        out.restart()
        if item.type == WriteItemType.BYTE_IO:
            data = planner.resolve_data(item)
            assert isinstance(data, io.BytesIO), f"{item.index.fqn}: a bytes item resolved to {type(data)}"
            out.write(data.getbuffer())
        else:
            try:
                torch.save(_cpu_tensor(planner, item), cast(IO[bytes], out))  # a binary file that writes
            except Exception:
                # torch.save turns its file's error into "enforce fail ... unexpected pos":
                # the failed write's own error (ENOSPC, EIO, naming the file) is the one to raise.
                if out.failure is not None:
                    raise out.failure from None
                raise
        length = out.written - offset
        results.append(WriteResult(item.index, length, storage_info(name, offset, length, out.crc)))
    return results


def write_file(
    storage: Storage, path: str, name: str, items: Sequence[WriteItem], planner: SavePlanner
) -> list[WriteResult]:
    """Commit ``items`` into the file ``name`` at ``path`` (its full path); their results."""
    upload = storage.create(path, None)
    try:
        with _UploadStream(upload) as out:
            results = _write_items(out, name, items, planner)
            out.finish()
        upload.commit()
    except BaseException:
        upload.abort()
        raise
    return results


def item_size(item: WriteItem) -> int:
    """The bytes of an item's tensor (0 for a non-tensor)."""
    if item.tensor_data is None:
        return 0
    n = item.tensor_data.properties.dtype.itemsize
    for dim in item.tensor_data.size:
        n *= dim
    return n


def split(items: Sequence[WriteItem], files: int) -> list[list[WriteItem]]:
    """``items`` into at most ``files`` groups of about equal bytes (largest first into
    the lightest group), non-tensors spread round-robin; no group is empty, so a rank
    with nothing to write writes no file."""
    groups: list[list[WriteItem]] = [[] for _ in range(max(1, files))]
    loads = [0] * len(groups)
    others = [i for i in items if i.type == WriteItemType.BYTE_IO]
    for n, item in enumerate(others):
        groups[n % len(groups)].append(item)
    for item in sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=item_size, reverse=True):
        lightest = loads.index(min(loads))
        groups[lightest].append(item)
        loads[lightest] += item_size(item)
    return [g for g in groups if g]


def write_files(
    storage: Storage,
    jobs: Sequence[tuple[str, str, Sequence[WriteItem]]],
    planner: SavePlanner,
) -> list[WriteResult]:
    """Commit each ``(path, name, items)`` of ``jobs``, in threads of this call when there
    are several (each file is committed on its own; the call returns once all are, or
    raises the first failure once every thread has ended)."""
    if not jobs:
        return []
    if len(jobs) == 1:
        path, name, items = jobs[0]
        return write_file(storage, path, name, items, planner)
    with ThreadPoolExecutor(len(jobs), thread_name_prefix="aiosnap-dcp") as pool:
        futures = [pool.submit(write_file, storage, path, name, items, planner) for path, name, items in jobs]
    return [result for future in futures for result in future.result()]
