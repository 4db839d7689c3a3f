"""Reading a rank's share of a DCP load: each item's bytes read through aiosnap's
``Storage``, checked against the crc32c its ``_StorageInfo`` records before anything
parses them, then handed to DCP's planner as DCP's own reader hands them.

Everything here blocks: DCP calls ``read_data`` from the loading thread and waits.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from aiosnap._base.checksums import crc32c
from aiosnap._base.errors import CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError
from aiosnap._storage.protocol import MemoryReader, Reader, ReaderFile, Storage

from ._dcp_layout import checksum_of


def item_name(req: ReadItem) -> str:
    """An item as a message names it: its FQN, and which chunk of it if it is one of several."""
    index = req.storage_index
    offsets = list(index.offset) if index.offset is not None else []
    return f"{index.fqn!r}" + (f" (the chunk at {offsets})" if any(offsets) else "")


class _Items:
    """The items of one data file, each read into one buffer reused from item to item (a
    new buffer per item cost its page faults: a quarter of the time of a 256 MiB load),
    and checked against its checksum. ``checksummed``: the metadata is aiosnap's, so
    every item must carry one."""

    def __init__(self, reader: Reader, checksummed: bool) -> None:
        self.reader, self._checksummed = reader, checksummed
        self._buffer = bytearray()

    def read(self, info: Any, req: ReadItem) -> memoryview:
        """The bytes the item's record names, valid until the next call."""
        path = self.reader.path
        offset, length = info.offset, info.length  # checked by check_record
        if offset + length > self.reader.size:
            raise CorruptCheckpointError(
                path,
                f"item {item_name(req)}: truncated, it ends at byte {offset + length} of {self.reader.size}",
            )
        if len(self._buffer) < length:
            self._buffer = bytearray(length)
        data = memoryview(self._buffer)[:length]
        self.reader.readinto(offset, data)
        recorded = checksum_of(info)
        if recorded is None:
            if self._checksummed:
                raise CorruptCheckpointError(path, f"item {item_name(req)}: its checksum is missing")
            return data
        found = crc32c(data)
        if found != recorded:
            raise CorruptCheckpointError(
                path,
                f"item {item_name(req)} ({length} bytes at offset {offset}): checksum mismatch, the bytes "
                f"were altered (crc32c {found:08x}, recorded {recorded:08x})",
            )
        return data


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


def _whole(data: memoryview, req: ReadItem, path: str) -> torch.Tensor:
    """The stored tensor in an item's (verified) bytes."""
    try:
        # Read in place: io.BytesIO would copy the item (torch.load took twice as long).
        item = cast(IO[bytes], ReaderFile(MemoryReader(path, data)))
        tensor = torch.load(item, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CorruptCheckpointError(path, f"item {item_name(req)}: not a tensor ({exc})") from exc
    if not isinstance(tensor, torch.Tensor):
        raise CorruptCheckpointError(
            path, f"item {item_name(req)}: holds a {type(tensor).__name__}, not a tensor"
        )
    return tensor


def _chunk(tensor: torch.Tensor, req: ReadItem, path: str) -> torch.Tensor:
    """The part of the stored tensor the request reads."""
    try:
        return _narrow(tensor, req.storage_offsets, req.lengths)
    except (RuntimeError, ValueError, IndexError) as exc:
        raise CorruptCheckpointError(
            path,
            f"item {item_name(req)}: a {list(tensor.shape)} tensor, which has no chunk {list(req.lengths)}",
        ) from exc


def read_file(
    storage: Storage,
    path: str,
    reqs: Sequence[ReadItem],
    records: Mapping[Any, Any],
    planner: LoadPlanner,
    *,
    checksummed: bool,
) -> None:
    """Read the items ``reqs`` of the data file at ``path`` into the planner's targets.
    ``checksummed``: the metadata is aiosnap's, so every item must carry its checksum."""
    try:
        reader = storage.open_read(path)
    except CheckpointNotFoundError:
        raise CorruptCheckpointError(
            path, f"missing: the metadata names it for {len(reqs)} item(s), {item_name(reqs[0])} first"
        ) from None
    try:
        items = _Items(reader, checksummed)
        last: tuple[Any, torch.Tensor] | None = None  # several chunks of one stored tensor
        for req in sorted(reqs, key=lambda r: records[r.storage_index].offset):
            info = records[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(items.read(info, req)))  # a copy: the buffer is reused
                continue
            if last is None or last[0] is not info:
                last = (info, _whole(items.read(info, req), req, path))
            tensor = _chunk(last[1], req, path)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise StateMismatchError(
                    f"{path}: item {item_name(req)} is {list(tensor.size())} where the target expects "
                    f"{list(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)
    finally:
        reader.close()
