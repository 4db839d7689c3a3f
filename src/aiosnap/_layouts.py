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

from . import _offload
from ._group import MANIFEST_NAME, Manifest, StepDirs, file_report, rank_file, read_manifest
from ._handle import SaveStats
from ._load import Step, load_blocking, load_step
from ._messages import FileReport
from ._records import CheckpointRecord
from ._storage import Storage, put


class Layout(Protocol):
    #: Whether a step is committed by a manifest (which rank 0 writes last).
    manifests: bool

    async def scan(self) -> dict[int, str]:
        """The committed steps: step -> name."""

    async def remove(self, name: str) -> None:
        """Delete a committed step."""

    async def sweep(self, below: int, busy: set[str]) -> None:
        """Remove what saves older than ``below`` that never committed left behind."""

    def place(self, record: CheckpointRecord, rank: int) -> tuple[str, str]:
        """Where a rank writes its part of a step: (directory, file name)."""

    def path(self, record: CheckpointRecord) -> str:
        """Where a step lives."""

    async def report(self, stats: SaveStats, rank: int, replicated: list[str], compare: bool) -> FileReport:
        """A rank's report of its durable part (``compare``: with other ranks')."""

    async def commit(self, record: CheckpointRecord, manifest: Manifest) -> None:
        """Make a step visible once every rank's part is durable (rank 0)."""

    async def load(
        self, record: CheckpointRecord, rank: int, world: int, target: Any, keys: Any, strict: bool
    ) -> tuple[str, Any]:
        """A rank's part of a step: (the path it read, the state)."""


class Files:
    """A file per step."""

    manifests = False

    def __init__(
        self, storage: Storage, directory: str, pattern: re.Pattern[str], rank: int, allow_pickle: bool
    ):
        self.storage, self.directory, self.pattern = storage, directory, pattern
        self.rank, self.allow_pickle = rank, allow_pickle

    async def scan(self) -> dict[int, str]:
        entries = await _offload.run_io(self.storage.list, self.directory)
        found: dict[int, str] = {}
        for name in (e.name for e in entries if not e.is_dir):
            m = self.pattern.fullmatch(name)
            if m is not None and int(m.groupdict().get("rank") or self.rank) == self.rank:
                found[int(m.group("step"))] = name
        return found

    async def remove(self, name: str) -> None:
        await _offload.run_io(self.storage.delete, self.storage.join(self.directory, name))

    async def sweep(self, below: int, busy: set[str]) -> None:
        """A failed save leaves at most a temp file, which the next open sweeps."""

    def place(self, record: CheckpointRecord, rank: int) -> tuple[str, str]:
        return self.directory, record.file

    def path(self, record: CheckpointRecord) -> str:
        return self.storage.join(self.directory, record.file)

    async def report(self, stats: SaveStats, rank: int, replicated: list[str], compare: bool) -> FileReport:
        return FileReport(stats.skipped, bytes=stats.bytes)

    async def commit(self, record: CheckpointRecord, manifest: Manifest) -> None:
        """The file's own commit made it visible."""

    async def load(
        self, record: CheckpointRecord, rank: int, world: int, target: Any, keys: Any, strict: bool
    ) -> tuple[str, Any]:
        path = self.storage.join(self.directory, record.file)
        state = await _offload.run_io(
            load_blocking, self.storage, path, keys, None, self.allow_pickle, target, strict
        )
        return path, state


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

    async def scan(self) -> dict[int, str]:
        return await self.dirs.scan()

    async def remove(self, name: str) -> None:
        await self.dirs.remove(name)

    async def sweep(self, below: int, busy: set[str]) -> None:
        await self.dirs.sweep(below, busy)

    def place(self, record: CheckpointRecord, rank: int) -> tuple[str, str]:
        return self.storage.join(self.directory, record.file), rank_file(rank)

    def path(self, record: CheckpointRecord) -> str:
        return self.storage.join(self.directory, record.file)

    async def report(self, stats: SaveStats, rank: int, replicated: list[str], compare: bool) -> FileReport:
        if stats.skipped:
            return FileReport(True)
        return await _offload.run_io(file_report, self.storage, stats.path, replicated, rank, compare)

    async def commit(self, record: CheckpointRecord, manifest: Manifest) -> None:
        path = self.storage.join(self.directory, record.file, MANIFEST_NAME)
        await _offload.run_io(put, self.storage, path, manifest.to_bytes())

    async def load(
        self, record: CheckpointRecord, rank: int, world: int, target: Any, keys: Any, strict: bool
    ) -> tuple[str, Any]:
        step_dir = self.storage.join(self.directory, record.file)
        manifest = await _offload.run_io(read_manifest, self.storage, step_dir)
        step = Step(step_dir, manifest, rank, world)
        state = await _offload.run_io(
            load_step, self.storage, step, keys, None, self.allow_pickle, target, strict
        )
        return step_dir, state
