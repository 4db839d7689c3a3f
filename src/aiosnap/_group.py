"""Checkpoints of a process group: a directory per step, committed by a manifest.

    <directory>/<name of the step>/rank_00000        each rank's own file
                                  /rank_00001        (written by all ranks in parallel)
                                  /aiosnap-manifest.json   written last, by rank 0

Replicated entries (tree paths matching ``replicated`` globs) are stored only in rank
0's file; the other ranks' files mark them external and are read together with it. A
step exists once its manifest does; rank 0 writes it only after every rank reported
its file durable, with the crc32c of its header (which holds the checksum of every
entry), so a restore can tell that each file is the one that was committed.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, final

from . import _offload
from ._errors import CheckpointError, CorruptCheckpointError
from ._format import Header, read_header
from ._header import crc32c
from ._storage import Storage, exists, get
from ._tree import format_path, walk_leaves

logger = logging.getLogger(__name__)

MANIFEST_NAME = "aiosnap-manifest.json"
MANIFEST_FORMAT = "aiosnap-manifest/1"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}"


def replicated_matcher(patterns: Sequence[str]) -> Callable[[str], bool]:
    """Whether a dotted tree path is replicated: a glob matches it or one of its parents."""
    pats = list(patterns)

    def matches(path: str) -> bool:
        parts = path.split(".")
        prefixes = (".".join(parts[:i]) for i in range(len(parts), 0, -1))
        return any(fnmatch.fnmatchcase(p, pat) for p in prefixes for pat in pats)

    return matches


@final
@dataclass(frozen=True, slots=True)
class Manifest:
    """What rank 0 writes last: which files make up the step, and their summaries."""

    step: int
    epoch: int | None
    world_size: int
    files: list[str]
    checksums: list[str]  # header crc32c of each rank's file
    sizes: list[int]
    replicated: list[str]  # the globs
    replicas: str  # the file that holds the replicated entries

    def well_typed(self) -> bool:
        def strs(v: object) -> bool:
            return isinstance(v, list) and all(isinstance(x, str) for x in v)

        ints = (self.step, self.world_size, *(self.sizes if isinstance(self.sizes, list) else [None]))
        return (
            all(type(v) is int for v in ints)
            and (self.epoch is None or type(self.epoch) is int)
            and strs(self.files)
            and strs(self.checksums)
            and strs(self.replicated)
            and isinstance(self.replicas, str)
        )

    def to_bytes(self) -> bytes:
        body = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return json.dumps(
            {"format": MANIFEST_FORMAT, "body": json.loads(body), "crc32c": f"{crc32c(body.encode()):08x}"},
            indent=1,
        ).encode()

    @classmethod
    def parse(cls, path: str, raw: bytes) -> Manifest:
        try:
            outer = json.loads(raw)
            body = json.dumps(outer["body"], sort_keys=True, separators=(",", ":"))
            if (
                outer.get("format") != MANIFEST_FORMAT
                or outer.get("crc32c") != f"{crc32c(body.encode()):08x}"
            ):
                raise ValueError("format or checksum mismatch")
            manifest = cls(**outer["body"])
        except RecursionError:  # json's C parser and encoder stop at the interpreter's limit
            raise CorruptCheckpointError(path, "bad manifest: nested too deeply") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(path, f"bad manifest: {exc}") from None
        if not manifest.well_typed():
            raise CorruptCheckpointError(path, "bad manifest: a field has the wrong type")
        n = manifest.world_size
        if not (len(manifest.files) == len(manifest.checksums) == len(manifest.sizes) == n > 0):
            raise CorruptCheckpointError(path, "bad manifest: the lists do not match the world size")
        if not all(_plain_name(f) for f in [*manifest.files, manifest.replicas]):
            raise CorruptCheckpointError(
                path, "bad manifest: a file name leaves the step directory or is not one"
            )
        return manifest


def _plain_name(name: str) -> bool:
    """Whether ``name`` names a file in the step directory that a file system can open: one
    path component (not "." or ".." or hidden), no NUL, UTF-8 (no lone surrogates), and
    at most NAME_MAX (255) bytes. Any other name would fail inside open(), with an error
    that is not the manifest's."""
    if not name or "/" in name or "\0" in name or name.startswith("."):
        return False
    try:
        return len(name.encode("utf-8")) <= 255
    except UnicodeEncodeError:
        return False


def read_manifest(storage: Storage, step_dir: str) -> Manifest:
    path = storage.join(step_dir, MANIFEST_NAME)
    return Manifest.parse(path, get(storage, path))


def _header(storage: Storage, path: str) -> tuple[Header, int]:
    """The validated header of a file, and the file's size. Blocking."""
    f = storage.open_read(path)
    try:
        return read_header(f), f.size
    finally:
        f.close()


def _first_paths(tree: Any) -> dict[str, str]:
    """Each leaf's name -> the dotted path where capture first reached it (and named it)."""
    seen: dict[str, str] = {}
    for p, _, name in walk_leaves(tree):
        seen.setdefault(name, format_path(p))
    return seen


def file_summary(storage: Storage, path: str, patterns: Sequence[str], rank: int) -> dict[str, Any]:
    """Read back the header of a rank's committed file: its checksum, and a digest of
    the replicated entries it describes (stored by rank 0, external elsewhere), which
    must agree across ranks. Blocking."""
    header, size = _header(storage, path)
    if rank == 0:
        matches = replicated_matcher(patterns)
        paths = _first_paths(header.tree)
        replicated = [header.tensors[n] for n, p in paths.items() if n in header.tensors and matches(p)]
    else:
        replicated = list(header.external.values())
    spec = sorted([i.name, i.kind, i.dtype, list(i.shape)] for i in replicated)
    digest = f"{crc32c(json.dumps(spec).encode()):08x}"
    return {"checksum": header.checksum, "bytes": size, "replicated": [len(spec), digest]}


def leaf_paths(storage: Storage, path: str) -> list[str]:
    """Dotted paths of the leaves of a file's tree, first occurrence of each. Blocking."""
    return list(_first_paths(_header(storage, path)[0].tree).values())


def only_replicated(keys: Sequence[str] | None, manifest: Manifest, paths: list[str], where: str) -> None:
    """A rank the step was not saved by may restore replicated entries, and only them."""
    matches = replicated_matcher(manifest.replicated)
    why = (
        f"{where} was saved by {manifest.world_size} ranks, so this rank has no entries of its own "
        f"in it; only replicated entries ({manifest.replicated}) can be restored, with keys=[...]"
    )
    if keys is None:
        raise CheckpointError(why)
    for key in keys:
        under = [p for p in paths if p == key or p.startswith(key + ".")]
        if not matches(key) and (not under or not all(matches(p) for p in under)):
            raise CheckpointError(f"{why}: {key!r} is not replicated")


@final
class StepDirs:
    """The layout of a group's directory for the catalog: steps are directories, and
    only those with a manifest are committed."""

    def __init__(self, storage: Storage, directory: str, pattern: re.Pattern[str]) -> None:
        self.storage, self.directory, self.pattern = storage, directory, pattern

    def _steps(self) -> dict[int, str]:
        found = {}
        for entry in self.storage.list(self.directory):
            m = self.pattern.fullmatch(entry.name)
            if m is not None and entry.is_dir:
                found[int(m.group("step"))] = entry.name
        return found

    def _committed(self, name: str) -> bool:
        return exists(self.storage, self.storage.join(self.directory, name, MANIFEST_NAME))

    async def scan(self) -> dict[int, str]:
        """Committed steps; the directories of failed saves are removed (at open, when
        no save can be running)."""
        committed = {}
        for step, name in (await _offload.run_io(self._steps)).items():
            if await _offload.run_io(self._committed, name):
                committed[step] = name
                await _offload.run_io(self.storage.sweep_incomplete, self.storage.join(self.directory, name))
            else:
                await self._drop_uncommitted(name)
        return committed

    async def remove(self, name: str) -> None:
        # The manifest goes first: a half-removed step must not look committed.
        path = self.storage.join(self.directory, name)
        await _offload.run_io(self.storage.delete, self.storage.join(path, MANIFEST_NAME))
        await _offload.run_io(self.storage.delete_tree, path)

    async def sweep(self, below: int, busy: set[str]) -> None:
        """Remove uncommitted step directories older than ``below`` that no save in
        progress is writing: what failed or abandoned saves left."""
        for step, name in (await _offload.run_io(self._steps)).items():
            if step < below and name not in busy and not await _offload.run_io(self._committed, name):
                await self._drop_uncommitted(name)

    async def _drop_uncommitted(self, name: str) -> None:
        logger.info("removing %s: a save that never committed", name)
        await _offload.run_io(self.storage.delete_tree, self.storage.join(self.directory, name))
