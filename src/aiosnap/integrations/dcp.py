"""torch.distributed.checkpoint (DCP): aiosnap as its storage backend.

``AiosnapStorageWriter`` and ``AiosnapStorageReader`` are DCP's ``StorageWriter`` and
``StorageReader``: pass them to ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` and
DCP plans, dedups, reshards and stages as ever, while aiosnap writes and reads the
bytes, on a local disk or any storage aiosnap knows (``s3://``, ``gs://``, ``az://``,
fsspec URLs, or a ``Storage`` of your own)::

    dcp.save(state, checkpoint_id=path, storage_writer=AiosnapStorageWriter())
    dcp.load(state, checkpoint_id=path, storage_reader=AiosnapStorageReader())

What it adds to DCP's ``FileSystemWriter``/``FileSystemReader``:

- every rank's file is committed atomically and durably (a temp file written, fsynced,
  renamed, the directory fsynced; an object store's upload completed), and under a
  name new at every save;
- the metadata is committed last, the same way, once every rank's file is durable
  (DCP's collectives fail the save on every rank if one rank's write fails). A
  checkpoint is *visible* when its ``.metadata`` is: a save killed at any point leaves
  the checkpoint that was there before (or none), never a mix;
- each item's crc32c, and the metadata's, are recorded and checked on load: a flipped
  byte is a ``CorruptCheckpointError`` naming the item and the file;
- the metadata is unpickled with a restricted unpickler, and aiosnap replaces only a
  checkpoint it wrote (``ForeignFileError`` otherwise), deleting only its own files.

The layout is DCP's own (``_dcp_layout``): DCP's ``FileSystemReader``, ``dcp.load(...,
checkpoint_id=path)`` and ``dcp_to_torch_save`` read these checkpoints unchanged
(without checking their checksums).

DCP's calls block, and so do these classes' methods: they run in the thread DCP saves
or loads from, as DCP's own storage classes do.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import secrets
import uuid
from typing import Any

from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from aiosnap._base.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignFileError,
    PickleNotAllowedError,
)
from aiosnap._storage.backends import OBJECT_SCHEMES, resolve, scheme_of
from aiosnap._storage.protocol import Storage, describe, get, lstat, put

from . import _dcp_layout as layout
from ._dcp_read import read_file
from ._dcp_write import split, write_files

__all__ = ["AiosnapStorageReader", "AiosnapStorageWriter"]

logger = logging.getLogger(__name__)


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class _Location:
    """Where a checkpoint is: a local path or URL, and the storage it lives on."""

    def __init__(self, path: str | os.PathLike[str] | None, storage: Storage | None) -> None:
        self._given = storage
        self.storage: Storage | None = storage
        self.path: str | None = None
        if path is not None:
            self.move(path)

    def move(self, checkpoint_id: str | os.PathLike[str]) -> None:
        self.storage, self.path = resolve(os.fspath(checkpoint_id), self._given)

    def directory(self) -> tuple[Storage, str]:
        """The storage, and the checkpoint's path on it."""
        if self.storage is None or self.path is None:
            raise ValueError("no checkpoint_id: pass one to the storage class or to dcp.save/dcp.load")
        return self.storage, self.path

    def at(self, name: str) -> tuple[Storage, str]:
        """The storage, and the full path of ``name`` in the checkpoint."""
        storage, path = self.directory()
        return storage, storage.join(path, name)


def _knows(checkpoint_id: str | os.PathLike[str]) -> bool:
    """Whether aiosnap has a storage for ``checkpoint_id`` (a local path, or a URL of a
    scheme it serves)."""
    scheme = scheme_of(os.fspath(checkpoint_id))
    if scheme is None or scheme == "file" or scheme in OBJECT_SCHEMES:
        return True
    from aiosnap._storage.fsspec import known_protocol

    return known_protocol(scheme)


class AiosnapStorageWriter(StorageWriter):
    """DCP's ``StorageWriter``, writing through aiosnap (see the module docstring).

    Args:
        path: The checkpoint: a directory, or a URL (``s3://bucket/run/step-100``). May be
            left out when every save passes ``checkpoint_id``.
        storage: The storage to write to; None picks it from the path (a local disk, or
            the object store or fsspec filesystem of the URL's scheme).
        overwrite: Whether a save may replace a checkpoint already committed at the
            path (as DCP's ``FileSystemWriter(overwrite=...)``); the new one replaces
            the old at once, whole, and the old one's files are deleted after. A
            checkpoint aiosnap did not write is never replaced.
        thread_count: Files per rank, written in as many threads.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        storage: Storage | None = None,
        overwrite: bool = True,
        thread_count: int = 1,
    ) -> None:
        super().__init__()
        if thread_count < 1:
            raise ValueError(f"thread_count must be at least 1, not {thread_count}")
        self._where = _Location(path, storage)
        self.overwrite = overwrite
        self.thread_count = thread_count
        self.save_id = str(uuid.uuid4())
        self.rank: int | None = None
        self.use_collectives = True
        self._token = secrets.token_hex(6)
        self._superseded: list[str] = []

    @property
    def checkpoint_id(self) -> str | None:
        """The checkpoint the next save writes (its path or URL)."""
        return self._where.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self._where.move(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        # New at every save, even one that reuses this writer without a checkpoint_id:
        # the files a committed metadata names are never written over.
        self._token = secrets.token_hex(6)
        self._superseded = []

    def _metadata_name(self) -> str:
        return layout.metadata_name(None if self.use_collectives else (self.rank or 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        storage, path = self._where.at(self._metadata_name())
        if not self.overwrite and storage.stat(path) is not None:
            raise FileExistsError(
                errno.EEXIST, f"Checkpoint already exists and overwrite=False: {self.checkpoint_id}", path
            )
        if not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.rank or 0}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # With collectives, only the coordinator runs this, while every rank waits for its
        # plan; without, every rank does, for its own plan and metadata.
        named = self._previous_files()
        self._superseded = sorted(named or ())
        if self.use_collectives:  # without, ranks would sweep each other's files
            self._sweep(named)
        return [
            plan
            if isinstance(plan.storage_data, _StoragePrefix)
            else dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_"))
            for i, plan in enumerate(plans)
        ]

    def _previous_files(self) -> set[str] | None:
        """The data files the committed metadata names (deleted once the new one is
        committed; None if it cannot be read); ForeignFileError if aiosnap did not write it."""
        storage, path = self._where.at(self._metadata_name())
        entry = lstat(storage, path)
        if entry is None:
            return set()
        if not entry.is_file:  # a link, a directory: not aiosnap's to read through or replace
            raise ForeignFileError(path, describe(entry))
        try:
            data = get(storage, path)
        except CheckpointNotFoundError:
            return set()
        if not layout.is_ours(data):
            raise ForeignFileError(path, "the metadata of a DCP checkpoint")
        try:
            previous, _ = layout.decode_metadata(data, path)
        except (CorruptCheckpointError, PickleNotAllowedError) as exc:
            logger.warning("replacing %s, whose files are left where they are: %s", path, exc)
            return None
        names = {getattr(info, "relative_path", None) for info in previous.storage_data.values()}
        return {n for n in names if isinstance(n, str) and layout.DATA_NAME.match(n)}

    def _sweep(self, named: set[str] | None) -> None:
        """Remove what failed and killed saves left: temp files, and data files of
        aiosnap's naming that the committed metadata does not name (``named``; None: it
        could not be read, so no data file is removed)."""
        storage, directory = self._where.directory()
        storage.sweep_incomplete(directory)
        if named is None:
            return
        for entry in storage.list(directory):
            if entry.is_file and layout.DATA_NAME.match(entry.name) and entry.name not in named:
                self._delete(entry.name)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = (
            plan.storage_data.prefix
            if isinstance(plan.storage_data, _StoragePrefix)
            else f"__{self.rank or 0}_"
        )
        jobs = []
        for n, items in enumerate(split(plan.items, self.thread_count)):
            name = layout.data_name(prefix, n, self._token)
            storage, path = self._where.at(name)
            jobs.append((path, name, items))
        storage, _ = self._where.directory()
        return _done(write_files(storage, jobs, planner))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        metadata.storage_meta = self.storage_meta()
        storage, path = self._where.at(self._metadata_name())
        put(storage, path, layout.encode_metadata(metadata))
        kept = {info.relative_path for info in metadata.storage_data.values()}
        for name in self._superseded:
            if name not in kept:
                self._delete(name)
        self._superseded = []

    def _delete(self, name: str) -> None:
        """Delete a data file no committed metadata names (any more). A failure leaves
        only such a file, swept at the next save: it is logged, not raised."""
        storage, path = self._where.at(name)
        try:
            storage.delete(path)
        except OSError as exc:
            logger.warning("could not delete %s, which no committed metadata names: %s", path, exc)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _knows(checkpoint_id)


class AiosnapStorageReader(StorageReader):
    """DCP's ``StorageReader``, reading through aiosnap (see the module docstring). It
    reads checkpoints DCP's own ``FileSystemWriter`` wrote too, without checksums to check.

    Args:
        path: The checkpoint: a directory, or a URL. May be left out when every load
            passes ``checkpoint_id``.
        storage: The storage to read from; None picks it from the path.
        allow_pickle: Unpickle the metadata with plain ``pickle`` (any class) rather
            than only the classes DCP's metadata is made of. (DCP's planner itself
            unpickles the non-tensor values it loads.)
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        storage: Storage | None = None,
        allow_pickle: bool = False,
    ) -> None:
        super().__init__()
        self._where = _Location(path, storage)
        self.allow_pickle = allow_pickle
        self.load_id = str(uuid.uuid4())
        self.storage_data: dict[Any, Any] = {}
        self._checksummed = False
        self._metadata_path = layout.METADATA_NAME  # the one read last, as errors name it

    @property
    def checkpoint_id(self) -> str | None:
        """The checkpoint the next load reads (its path or URL)."""
        return self._where.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self._where.move(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        storage, path = self._where.at(layout.metadata_name(kwargs.get("rank")))
        self._metadata_path = path
        metadata, self._checksummed = layout.decode_metadata(
            get(storage, path), path, allow_pickle=self.allow_pickle
        )
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise CorruptCheckpointError(str(self.checkpoint_id), "its metadata records no storage data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        storage, _ = self._where.directory()
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            fqn = req.storage_index.fqn
            info = layout.check_record(self.storage_data.get(req.storage_index), self._metadata_path, fqn)
            per_file.setdefault(info.relative_path, []).append(req)
        for name, reqs in per_file.items():
            _, path = self._where.at(name)
            read_file(storage, path, reqs, self.storage_data, planner, checksummed=self._checksummed)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _knows(checkpoint_id)
