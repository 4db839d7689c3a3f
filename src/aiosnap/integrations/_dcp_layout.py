"""What a DCP checkpoint written by aiosnap is: its files' names, its metadata's bytes.

The layout is DCP's own ``FileSystemWriter`` layout, so DCP's own readers (and
``dcp.load(checkpoint_id=...)``, ``dcp_to_torch_save``) read it unchanged:

- ``.metadata``: the pickled ``Metadata``, committed last. aiosnap appends a trailer
  (``TRAILER``: a magic, the crc32c and the length of the pickle) after the pickle's
  STOP opcode, where ``pickle.load`` never reads; the trailer marks the checkpoint as
  aiosnap's and checks the metadata itself.
- ``__{rank}_{n}.{token}.distcp``: a rank's data, each item as DCP writes it (a tensor
  as ``torch.save`` bytes, a non-tensor as its serialized bytes), at the offset and
  length its ``_StorageInfo`` records. The token is new at every save, so a save into
  an existing checkpoint never writes over a file the committed metadata names.
- each item's ``_StorageInfo`` carries one more attribute, ``crc32c``: the checksum of
  its bytes. DCP's ``_StorageInfo`` pickles its ``__dict__``, so the attribute travels
  in the metadata and DCP's own readers ignore it.

The metadata is read with a restricted unpickler (``decode_metadata``): only the
classes DCP's metadata is made of are rebuilt, unless the caller allows pickle.
"""

from __future__ import annotations

import io
import pickle
import re
import struct
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

from aiosnap._base.checksums import crc32c
from aiosnap._base.errors import CorruptCheckpointError, PickleNotAllowedError

#: DCP's name for the metadata of a checkpoint saved with collectives (FileSystemWriter's).
METADATA_NAME = ".metadata"
#: The trailer after the pickle: magic, crc32c of the pickle, length of the pickle.
TRAILER = struct.Struct("<12sIQ")
MAGIC = b"aiosnap-dcp\x01"
#: The names aiosnap gives the data files (``data_name``): the only ones it ever deletes.
DATA_NAME = re.compile(r"^__\d+_\d+\.[0-9a-f]{12}\.distcp$")
#: The checksum attribute an item's ``_StorageInfo`` carries.
CRC_ATTR = "crc32c"


def metadata_name(rank: int | None) -> str:
    """The metadata's name: DCP's ``.metadata``, or ``__{rank}.metadata`` for a rank that
    saved without collectives (DCP's own names for both)."""
    return METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"


def data_name(prefix: str, n: int, token: str) -> str:
    """The name of a rank's ``n``-th data file in the save ``token``; ``prefix`` is the
    rank's, as DCP's global plan gives it (``__{rank}_``)."""
    return f"{prefix}{n}.{token}.distcp"


def encode_metadata(metadata: Metadata) -> bytes:
    """The bytes of ``.metadata``: the pickle DCP reads, then the trailer."""
    body = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    return body + TRAILER.pack(MAGIC, crc32c(body), len(body))


def is_ours(data: bytes) -> bool:
    """Whether the metadata ``data`` has aiosnap's trailer (checked or not)."""
    return len(data) >= TRAILER.size and data[-TRAILER.size :].startswith(MAGIC)


def decode_metadata(data: bytes, path: str, *, allow_pickle: bool = False) -> tuple[Metadata, bool]:
    """The metadata in ``data`` (the bytes of ``path``), and whether aiosnap wrote it (it
    has the trailer, whose checksum holds). A metadata without a trailer is DCP's own."""
    body, ours = data, False
    if len(data) >= TRAILER.size:
        magic, crc, length = TRAILER.unpack_from(data, len(data) - TRAILER.size)
        if magic == MAGIC:
            body, ours = data[: -TRAILER.size], True
            if length != len(body):
                raise CorruptCheckpointError(path, f"truncated metadata: {len(body)} bytes of {length}")
            if crc32c(body) != crc:
                raise CorruptCheckpointError(path, f"metadata checksum mismatch (stored crc32c {crc:08x})")
    try:
        found = pickle.loads(body) if allow_pickle else _MetadataUnpickler(io.BytesIO(body), path).load()
    except PickleNotAllowedError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(path, f"unreadable metadata ({type(exc).__name__}: {exc})") from exc
    if not isinstance(found, Metadata) or not isinstance(found.storage_data, dict):
        raise CorruptCheckpointError(path, f"not a DCP metadata (a {type(found).__name__})")
    return found, ours


def storage_info(name: str, offset: int, length: int, crc: int) -> _StorageInfo:
    """DCP's record of an item's bytes, with their checksum."""
    info = _StorageInfo(name, offset, length)
    setattr(info, CRC_ATTR, crc)
    return info


def checksum_of(info: Any) -> int | None:
    """The checksum an item's record carries, if it is an int (DCP's own records have none)."""
    crc = getattr(info, CRC_ATTR, None)
    return crc if isinstance(crc, int) else None


def check_name(name: object, path: str) -> str:
    """``name``, a data file's name from the metadata at ``path``, if it is a plain name
    in the checkpoint's directory: never a path that leads out of it."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name:
        raise CorruptCheckpointError(
            path, f"names the data file {name!r}, which is not a file of its directory"
        )
    return name


def check_record(info: object, path: str, fqn: str) -> _StorageInfo:
    """``info``, the metadata's record of where the item ``fqn`` is, if it is one: a data
    file of the checkpoint's directory, and an extent of non-negative integers."""
    if not isinstance(info, _StorageInfo):
        raise CorruptCheckpointError(path, f"records {fqn!r} as a {type(info).__name__}, not a file extent")
    check_name(info.relative_path, path)
    offset, length = info.offset, info.length
    if not (type(offset) is int and type(length) is int and offset >= 0 and length >= 0):
        raise CorruptCheckpointError(path, f"records {fqn!r} at the extent {offset!r}+{length!r}")
    return info


#: The globals DCP's metadata is made of (torch 2.4 - 2.13): its dataclasses, torch.Size,
#: dtypes, layouts, memory formats, and a path as checkpoint_id.
_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout):
            return getattr(torch, name)
        raise PickleNotAllowedError(
            f"{self._path}: the metadata would rebuild {module}.{name}, which is not part of DCP's "
            "metadata; pass allow_pickle=True to the reader if you trust the checkpoint"
        )
