"""How a directory's checkpoints lie on storage: a file per step, or a directory per step.

``Files``: one process's checkpoints, a file per step (the name may hold ``{rank}``).
A step is committed when its file is. ``StepDirectories``: a group's, a directory per
step with a file per rank and a manifest, written last (``_group``). A process on its
own that opens a directory of step directories reads and writes them as a group of
one. Both answer the same questions, so the manager and its members never ask which.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from .._base import heap as _heap
from .._base import offload as _offload
from .._base.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ForeignFileError,
    NotACheckpointError,
    StepExistsError,
)
from .._dist.messages import FileReport
from .._format.codec import written_by_aiosnap
from .._format.manifest import MANIFEST_NAME, Manifest, rank_file, read_manifest
from .._load.load import Step, load_blocking, load_step
from .._save.handle import SaveStats
from .._storage.protocol import Storage, describe, lstat, put
from .records import CheckpointRecord
from .step_dirs import StepDirs, file_report, has_step_dirs


class Layout(Protocol):
    #: Whether a step is committed by a manifest (which rank 0 writes last).
    manifests: bool
    #: The directory of the checkpoints, and its storage.
    storage: Storage
    directory: str

    @property
    def strays(self) -> list[str]:
        """What the last scan or removal found and left alone, as "name (why)": things
        bearing a checkpoint's name that aiosnap did not write."""

    async def scan(self) -> dict[int, str]:
        """The committed steps: step -> name."""

    async def owns(self, name: str) -> bool | None:
        """Whether the step ``name`` that ``scan`` found, which the index does not vouch
        for, is one aiosnap wrote (its own header, or its manifest); None if it is gone
        since (retention beside a reader removed it): neither aiosnap's nor another's."""

    async def remove(self, name: str, size: int) -> None:
        """Delete a committed step, if it is still the one aiosnap wrote (``size``: its
        bytes as the index has them, 0 if unknown); else leave it, as a stray."""

    async def sweep(self, below: int, busy: set[str]) -> None:
        """Remove what saves older than ``below`` that never committed left behind."""

    def spare(self, names: set[str]) -> None:
        """Never sweep the steps ``names``: committed on another node of the group."""

    def place(self, record: CheckpointRecord, rank: int) -> tuple[str, str]:
        """Where a rank writes its part of a step: (directory, file name)."""

    async def check_vacant(self, record: CheckpointRecord, committed: bool, overwrite: bool) -> None:
        """Before a save writes ``record``'s step: StepExistsError if it is committed
        (``committed``: the catalog knows it) and not to be overwritten; ForeignFileError
        if what stands at its name is not aiosnap's."""

    def path(self, record: CheckpointRecord) -> str:
        """Where a step lives."""

    async def report(
        self, stats: SaveStats, rank: int, replicated: list[str], compare: bool, *, stores: bool
    ) -> FileReport:
        """A rank's report of its durable part (``compare``: with other ranks';
        ``stores``: its file holds the replicated entries)."""

    async def commit(self, record: CheckpointRecord, manifest: Manifest) -> None:
        """Make a step visible once every rank's part is durable (rank 0)."""

    async def commit_copy(self, record: CheckpointRecord, data: bytes) -> None:
        """Make a step visible on another node: rank 0's manifest, as it wrote it."""

    async def load(
        self,
        record: CheckpointRecord,
        rank: int,
        world: int,
        target: Any,
        keys: Any,
        strict: bool,
        near: int = 0,
    ) -> tuple[str, Any]:
        """A rank's part of a step: (the path it read, the state); the replicated entries
        from rank ``near``'s file if it holds them (its node's leader), else rank 0's."""


class Files:
    """A file per step."""

    manifests = False

    def __init__(
        self, storage: Storage, directory: str, pattern: re.Pattern[str], rank: int, allow_pickle: bool
    ):
        self.storage, self.directory, self.pattern = storage, directory, pattern
        self.rank, self.allow_pickle = rank, allow_pickle
        self.strays: list[str] = []

    async def scan(self) -> dict[int, str]:
        entries = await _offload.run_io(self.storage.list, self.directory)
        found: dict[int, str] = {}
        self.strays = []
        for entry in entries:
            m = self.pattern.fullmatch(entry.name)
            if m is None or int(m.groupdict().get("rank") or self.rank) != self.rank:
                continue
            if entry.is_file:
                found[int(m.group("step"))] = entry.name
            else:  # a directory or a link named like a checkpoint is not one
                kind = "a directory" if entry.is_dir else "a symbolic link or special file"
                self.strays.append(f"{entry.name} ({kind})")
        return found

    async def owns(self, name: str) -> bool | None:
        path = self.storage.join(self.directory, name)
        return await _offload.run_io(_ownership, self.storage, path)

    async def remove(self, name: str, size: int) -> None:
        path = self.storage.join(self.directory, name)
        if await _offload.run_io(_still_own, self.storage, path, size):
            await _offload.run_io(self.storage.delete, path)
        else:
            self.strays.append(f"{name} (no longer the checkpoint aiosnap wrote)")

    async def sweep(self, below: int, busy: set[str]) -> None:
        """A failed save leaves at most a temp file, which the next open sweeps."""

    def place(self, record: CheckpointRecord, rank: int) -> tuple[str, str]:
        return self.directory, record.file

    async def check_vacant(self, record: CheckpointRecord, committed: bool, overwrite: bool) -> None:
        path = self.storage.join(self.directory, record.file)
        if committed:
            if not overwrite:
                raise StepExistsError(path, record.step)
            return
        entry = await _offload.run_io(lstat, self.storage, path)
        if entry is not None:
            raise ForeignFileError(path, describe(entry))

    def path(self, record: CheckpointRecord) -> str:
        return self.storage.join(self.directory, record.file)

    async def report(
        self, stats: SaveStats, rank: int, replicated: list[str], compare: bool, *, stores: bool
    ) -> FileReport:
        return FileReport(stats.skipped, bytes=stats.bytes)

    async def commit(self, record: CheckpointRecord, manifest: Manifest) -> None:
        """The file's own commit made it visible."""

    async def commit_copy(self, record: CheckpointRecord, data: bytes) -> None:
        """A file per step has no manifest."""

    def spare(self, names: set[str]) -> None:
        """Files of a group are never swept."""

    async def load(
        self,
        record: CheckpointRecord,
        rank: int,
        world: int,
        target: Any,
        keys: Any,
        strict: bool,
        near: int = 0,
    ) -> tuple[str, Any]:
        path = self.storage.join(self.directory, record.file)
        request = (keys, None, self.allow_pickle, target, strict)
        return path, await _offload.run_io(_load_own, self.storage, path, *request)


class StepDirectories:
    """A directory per step: a file per rank, committed by a manifest."""

    manifests = True

    def __init__(
        self,
        storage: Storage,
        directory: str,
        pattern: re.Pattern[str],
        allow_pickle: bool,
        *,
        writable: bool,
    ):
        self.storage, self.directory, self.allow_pickle = storage, directory, allow_pickle
        self.dirs = StepDirs(storage, directory, pattern, writable=writable)

    @property
    def strays(self) -> list[str]:
        return self.dirs.strays

    async def scan(self) -> dict[int, str]:
        return await self.dirs.scan()

    async def owns(self, name: str) -> bool | None:
        """A step directory is found only with its manifest, which aiosnap wrote."""
        return True

    async def remove(self, name: str, size: int) -> None:
        await self.dirs.remove(name)

    async def sweep(self, below: int, busy: set[str]) -> None:
        await self.dirs.sweep(below, busy)

    def spare(self, names: set[str]) -> None:
        self.dirs.spare = set(names)

    def place(self, record: CheckpointRecord, rank: int) -> tuple[str, str]:
        return self.storage.join(self.directory, record.file), rank_file(rank)

    async def check_vacant(self, record: CheckpointRecord, committed: bool, overwrite: bool) -> None:
        """Every rank looks for itself (the step's manifest tells all of them that it is
        committed): the directory may be new, or hold only what saves of aiosnap's left."""
        path = self.storage.join(self.directory, record.file)
        found = await _offload.run_io(self.dirs.occupant, path)
        if found == "committed":
            if not overwrite:
                raise StepExistsError(path, record.step)
        elif found is not None:
            raise ForeignFileError(path, found)

    def path(self, record: CheckpointRecord) -> str:
        return self.storage.join(self.directory, record.file)

    async def report(
        self, stats: SaveStats, rank: int, replicated: list[str], compare: bool, *, stores: bool
    ) -> FileReport:
        if stats.skipped:
            return FileReport(True)
        return await _offload.run_io(file_report, self.storage, stats.path, replicated, stores, compare)

    async def commit(self, record: CheckpointRecord, manifest: Manifest) -> None:
        path = self.storage.join(self.directory, record.file, MANIFEST_NAME)
        # Serialised in the worker thread too: a large group's manifest is seconds of work.
        await _offload.run_io(_put_manifest, self.storage, path, manifest)

    async def commit_copy(self, record: CheckpointRecord, data: bytes) -> None:
        await _offload.run_io(
            put, self.storage, self.storage.join(self.directory, record.file, MANIFEST_NAME), data
        )

    async def load(
        self,
        record: CheckpointRecord,
        rank: int,
        world: int,
        target: Any,
        keys: Any,
        strict: bool,
        near: int = 0,
    ) -> tuple[str, Any]:
        step_dir = self.storage.join(self.directory, record.file)
        manifest = await _offload.run_io(read_manifest, self.storage, step_dir)
        # On another node than rank 0's, its leader's file holds the replicated entries.
        replicas = rank_file(near) if rank_file(near) in manifest.node_replicas else None
        step = Step(step_dir, manifest, rank, world, replicas)
        state = await _offload.run_io(
            load_step, self.storage, step, keys, None, self.allow_pickle, target, strict
        )
        return step_dir, state


def _put_manifest(storage: Storage, path: str, manifest: Manifest) -> None:
    with _heap.gc_paused():  # its JSON is as many objects as the manifest's boxes
        data = manifest.to_bytes()
    put(storage, path, data)


def _load_own(storage: Storage, path: str, *request: Any) -> Any:
    """The state of the checkpoint at ``path``, which must be one aiosnap wrote: a manager
    never reads another program's file (a pickle a co-tenant of the directory left under a
    checkpoint's name), allow_pickle or not. One worker-thread call: a reader beside a
    rotating writer opens the file it listed as soon as it can. Blocking."""
    owned = _ownership(storage, path)
    if owned is None:
        raise CheckpointNotFoundError(path)
    if not owned:
        raise NotACheckpointError(
            path, "no longer a checkpoint aiosnap wrote; a manager reads only its own (aiosnap.load reads it)"
        )
    return load_blocking(storage, path, *request)


def _still_own(storage: Storage, path: str, size: int) -> bool:
    """Whether the file at ``path`` is still a checkpoint aiosnap wrote: its own header,
    or (a ``savefun``'s file, whose format is not aiosnap's) the size the index recorded
    for it. Blocking."""
    entry = storage.stat(path)
    if entry is None or not entry.is_file:
        return False
    return (size > 0 and entry.size == size) or _written_by_aiosnap(storage, path)


def replaceable(storage: Storage, path: str) -> bool:
    """Whether a step's rank file at ``path``, which a load found missing or damaged, may
    be replaced by a copy (a partner's, the remote tier's): nothing is there, or a regular
    file aiosnap wrote (a damaged checkpoint still begins as one). A user's file, a
    directory or a link in its place (a load follows links) is left as it is, and the
    step fails. Blocking."""
    entry = lstat(storage, path)
    return entry is None or (entry.is_file and _written_by_aiosnap(storage, path))


def _written_by_aiosnap(storage: Storage, path: str) -> bool:
    """Whether the file at ``path`` is one aiosnap wrote (False if it is gone). Blocking."""
    return bool(_ownership(storage, path))


def _ownership(storage: Storage, path: str) -> bool | None:
    """Whether the file at ``path`` is one aiosnap wrote; None if there is none (any
    more). Blocking."""
    try:
        reader = storage.open_read(path)
    except CheckpointNotFoundError:
        return None
    except CheckpointError:
        return False
    try:
        return written_by_aiosnap(reader)
    finally:
        reader.close()


async def choose_layout(
    storage: Storage,
    directory: str,
    name: str,
    pattern: re.Pattern[str],
    steps_are_dirs: bool | None,
    *,
    group_rank: int,
    in_group: bool,
    allow_pickle: bool,
    writable: bool,
) -> Layout:
    """A directory per step (``steps_are_dirs``; if None: in a group, or where a group
    committed its checkpoints); else a file per step."""
    if steps_are_dirs is None:
        steps_are_dirs = in_group or await _offload.run_io(has_step_dirs, storage, directory, pattern)
    if not steps_are_dirs:
        return Files(storage, directory, pattern, group_rank, allow_pickle)
    if "{rank}" in name:
        raise ValueError(f"name {name!r}: {directory} holds a directory per step; drop {{rank}}")
    return StepDirectories(storage, directory, pattern, allow_pickle, writable=writable)
