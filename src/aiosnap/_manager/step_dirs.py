"""A group's checkpoints on storage: a directory per step, committed by its manifest.

    <directory>/<name of the step>/rank_00000        each rank's own file
                                  /rank_00001        (written by all ranks in parallel)
                                  /aiosnap-manifest.json   written last, by rank 0

Each rank reports its file once it is durable (``file_report``: what rank 0 needs to
write the manifest); ``StepDirs`` lists, sweeps and removes step directories for the
catalog, only ever deleting what aiosnap wrote there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Sequence
from typing import Any, final

from .._base import offload as _offload
from .._base.checksums import crc32c
from .._base.errors import CheckpointNotFoundError, CorruptCheckpointError
from .._dist.messages import FileReport, ShardBox
from .._format.codec import Header, read_header, written_by_aiosnap
from .._format.manifest import MANIFEST_NAME, rank_of, read_manifest, replicated_matcher
from .._format.tree import format_path, walk_nodes
from .._storage.protocol import TEMP_PREFIX, Storage, describe, lstat

logger = logging.getLogger(__name__)


def _header(storage: Storage, path: str) -> tuple[Header, int]:
    """The validated header of a file, and the file's size. Blocking."""
    f = storage.open_read(path)
    try:
        return read_header(f), f.size
    finally:
        f.close()


def file_report(
    storage: Storage, path: str, patterns: Sequence[str], stores: bool, leaves: bool
) -> FileReport:
    """Read back the header of a rank's committed file and report it: its checksum; a
    digest of the replicated entries it describes (stored if ``stores``: rank 0's and
    other nodes' leaders', external elsewhere), which must agree across ranks; the
    DTensor boxes it stored; and, when
    other ranks compare them (``leaves``), a digest of every other leaf. Blocking."""
    header, size = _header(storage, path)
    if header.refs:  # described as stored entries: the report is of what the file holds, where
        described = {**header.tensors, **{name: ref.info for name, ref in header.refs.items()}}
        header = dataclasses.replace(header, tensors=described)
    matches = replicated_matcher(patterns)
    firsts: dict[str, str] = {}
    shards, digests = [], {}
    for parts, node in walk_nodes(header.tree):
        where = format_path(parts)
        tag, name = (node.get("$"), str(node.get("n"))) if isinstance(node, dict) else (None, "")
        if tag in ("tensor", "ndarray", "npscalar", "pickle", "dtensor"):
            firsts.setdefault(name, where)
        if tag == "dtensor":
            info = header.tensors.get(name)
            if info is not None and info.shard is not None and info.nbytes:
                whole, offsets = info.shard
                shards.append(ShardBox(where, name, info.dtype, list(whole), list(offsets), list(info.shape)))
        elif leaves and not matches(where):  # replicated ones are compared by their own digest
            digests[where] = _digest(header, node)
    if stores:
        replicated = [header.tensors[n] for n, p in firsts.items() if n in header.tensors and matches(p)]
    else:
        replicated = [i for i in header.external.values() if i.shard is None]
    spec = sorted([i.name, i.kind, i.dtype, list(i.shape)] for i in replicated)
    digest = f"{crc32c(json.dumps(spec).encode()):08x}"
    return FileReport(False, header.checksum or "", size, [str(len(spec)), digest], shards, digests)


def _digest(header: Header, node: Any) -> str:
    """What a leaf holds: an entry's checksum and description, or a value's JSON."""
    if isinstance(node, dict) and node.get("$") in ("tensor", "ndarray", "npscalar", "pickle"):
        info = header.tensors.get(node.get("n", ""))
        if info is None:
            return "missing"
        return f"{info.kind}:{info.dtype}:{list(info.shape)}:{info.crc:08x}"
    return f"{crc32c(json.dumps(node, sort_keys=True).encode()):08x}"


@final
class StepDirs:
    """The layout of a group's directory for the catalog: steps are directories, and
    only those with a manifest are committed.

    A step directory is removed only by what aiosnap can tell it wrote there: its
    manifest, the rank files the manifest (or their own header) names as aiosnap's, and
    its temp files; the directory itself goes only once nothing else is in it. Whatever
    else is found (a user's notes, a symbolic link) stays, and is named in ``strays``.
    """

    def __init__(self, storage: Storage, directory: str, pattern: re.Pattern[str], *, writable: bool) -> None:
        self.storage, self.directory, self.pattern = storage, directory, pattern
        self.writable = writable
        #: Steps committed on another node of the group: their files here are never swept.
        self.spare: set[str] = set()
        #: What the last scan or removal left alone: "name (why)".
        self.strays: list[str] = []

    def _steps(self) -> dict[int, str]:
        """Step directories: real directories whose name the template gives (what else
        bears such a name is a stray)."""
        found = {}
        for entry in self.storage.list(self.directory):
            m = self.pattern.fullmatch(entry.name)
            if m is None:
                continue
            if entry.is_dir:
                found[int(m.group("step"))] = entry.name
            else:
                self.strays.append(f"{entry.name} ({describe(entry)}, not a step directory)")
        return found

    def _committed(self, name: str) -> bool:
        entries = self.storage.list(self.storage.join(self.directory, name))
        return any(e.name == MANIFEST_NAME and e.is_file for e in entries)

    async def scan(self) -> dict[int, str]:
        """Committed steps; what failed saves left in the others is removed (at open, when
        no save can be running; not by a reader)."""
        self.strays = []
        committed = {}
        for step, name in (await _offload.run_io(self._steps)).items():
            if await _offload.run_io(self._committed, name):
                committed[step] = name
                if self.writable:
                    path = self.storage.join(self.directory, name)
                    await _offload.run_io(self.storage.sweep_incomplete, path)
            elif self.writable and name not in self.spare:
                await self._drop_uncommitted(name)
        return committed

    async def remove(self, name: str) -> None:
        # The manifest goes first: a half-removed step must not look committed.
        await _offload.run_io(self._remove_own, name, True)

    async def sweep(self, below: int, busy: set[str]) -> None:
        """Remove what failed or abandoned saves left in uncommitted step directories
        older than ``below`` that no save in progress is writing."""
        for step, name in (await _offload.run_io(self._steps)).items():
            if (
                step < below
                and name not in busy | self.spare
                and not await _offload.run_io(self._committed, name)
            ):
                await self._drop_uncommitted(name)

    async def _drop_uncommitted(self, name: str) -> None:
        await _offload.run_io(self._remove_own, name, False)

    def _remove_own(self, name: str, committed: bool) -> None:
        """Delete what aiosnap wrote in step directory ``name``, the manifest first, and
        the directory once it is empty; leave the rest, as a stray. Blocking."""
        path = self.storage.join(self.directory, name)
        files: set[str] = set()
        if committed:
            try:
                files = set(read_manifest(self.storage, path).files)
            except (CorruptCheckpointError, CheckpointNotFoundError):
                pass  # its rank files are told by their own headers
            self.storage.delete(self.storage.join(path, MANIFEST_NAME))
        left = []
        for entry in self.storage.list(path):
            if entry.is_file and self._own(path, entry.name, files):
                self.storage.delete(self.storage.join(path, entry.name))
            elif not (committed and entry.name == MANIFEST_NAME):
                left.append(f"{entry.name} ({describe(entry)})")
        if left:
            self.strays.append(f"{name}/ (left in place, holding {', '.join(left)})")
            return
        if not committed:
            logger.info("removed %s: a save that never committed", path)
        self.storage.delete_tree(path)  # empty now: the directory itself

    def occupant(self, step_dir: str) -> str | None:
        """What stands at ``step_dir`` before a save writes it: None (nothing, or only
        what aiosnap's saves left), "committed" (its manifest), or what else it is, in
        words. Blocking."""
        entry = lstat(self.storage, step_dir)
        if entry is None:
            return None
        if not entry.is_dir:
            return describe(entry)
        entries = self.storage.list(step_dir)
        if any(e.name == MANIFEST_NAME and e.is_file for e in entries):
            return "committed"
        foreign = [e for e in entries if not (e.is_file and self._own(step_dir, e.name, set()))]
        if foreign:
            return f"a directory holding {', '.join(f'{e.name} ({describe(e)})' for e in foreign)}"
        return None

    def _own(self, step_dir: str, name: str, files: set[str]) -> bool:
        if name.startswith(TEMP_PREFIX) or name in files:
            return True
        if rank_of(name) is None:
            return False
        try:
            reader = self.storage.open_read(self.storage.join(step_dir, name))
        except CheckpointNotFoundError:
            return True  # gone since it was listed: nothing of anyone's to keep
        try:
            return written_by_aiosnap(reader)
        finally:
            reader.close()


def has_step_dirs(storage: Storage, directory: str, pattern: re.Pattern[str]) -> bool:
    """Whether ``directory`` holds a committed step directory (a group's checkpoint, with
    its manifest): a directory aiosnap did not write never makes it read as a group's.
    Blocking."""
    return any(
        e.is_dir
        and pattern.fullmatch(e.name)
        and any(f.name == MANIFEST_NAME and f.is_file for f in storage.list(storage.join(directory, e.name)))
        for e in storage.list(directory)
    )
