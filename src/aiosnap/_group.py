"""Checkpoints of a group: a directory per step, committed by a manifest.

    <directory>/<name of the step>/rank_00000        each rank's own file
                                  /rank_00001        (written by all ranks in parallel)
                                  /aiosnap-manifest.json   written last, by rank 0

Replicated entries (tree paths matching ``replicated`` globs) are stored only in rank
0's file; the other ranks' files mark them external and are read together with it.
A DTensor's boxes are stored by one rank each; the manifest indexes where every box
of every DTensor lies, so a restore at any world size reads exactly the bytes it
needs. A step exists once its manifest does; rank 0 writes it only after every rank
reported its file durable, with the crc32c of its header (which holds the checksum
of every entry), so a restore can tell that each file is the one that was committed.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, final

from . import _offload
from ._dtypes import TORCH_DTYPES
from ._errors import CheckpointNotFoundError, CorruptCheckpointError
from ._format import Header, TensorInfo, nbytes, read_header, written_by_aiosnap
from ._header import crc32c
from ._messages import FileReport, ShardBox, decode, encode
from ._shards import Box, tiles
from ._storage import TEMP_PREFIX, Storage, describe, get, lstat
from ._tree import format_path, walk_nodes

logger = logging.getLogger(__name__)

MANIFEST_NAME = "aiosnap-manifest.json"
MANIFEST_FORMAT = "aiosnap-manifest/2"
_OLD_FORMATS = ("aiosnap-manifest/1",)


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
class SavedBox:
    """A box of a DTensor, stored as entry ``name`` of file number ``file``."""

    file: int
    name: str
    offsets: list[int]
    lengths: list[int]

    @property
    def box(self) -> Box:
        return Box(tuple(self.offsets), tuple(self.lengths))


@final
@dataclass(frozen=True, slots=True)
class SavedTensor:
    """Every stored box of one DTensor (they tile its ``shape`` exactly)."""

    dtype: str
    shape: list[int]
    boxes: list[SavedBox]


def holds_box(info: TensorInfo | None, saved: SavedTensor, box: SavedBox) -> bool:
    """Whether a file's entry is the box of a DTensor the manifest says it is: a shard of
    the same dtype and whole shape, at the box's offsets, of its lengths. Only then does
    the entry's size (which the file justifies) bound what the box reads and allocates."""
    return (
        info is not None
        and info.kind == "tensor"
        and info.shard == (tuple(saved.shape), tuple(box.offsets))
        and list(info.shape) == box.lengths
        and info.dtype == saved.dtype
    )


def indexed(index: dict[str, SavedTensor], where: str, info: TensorInfo | None) -> SavedTensor | None:
    """The boxes of the DTensor at tree path ``where``, whose entry in the rank's file is
    ``info``; None if the index lacks them. A step indexes every DTensor that has bytes;
    one without any is read from its entry's description (the entry itself is only
    this rank's box: taken for the whole, it would have the box's shape)."""
    saved = index.get(where)
    if saved is None and info is not None and info.shard is not None and 0 in info.shard[0]:
        return SavedTensor(info.dtype, list(info.shard[0]), [])
    return saved


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
    #: Tree path -> where the boxes of that DTensor lie.
    shards: dict[str, SavedTensor] = field(default_factory=dict)
    #: Tree paths of the leaves whose values differed between ranks: state of its
    #: own rank, which a restore at another world size must not hand to another.
    per_rank: list[str] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        body = json.dumps(encode(self), sort_keys=True, separators=(",", ":"))
        return json.dumps(
            {"format": MANIFEST_FORMAT, "body": json.loads(body), "crc32c": f"{crc32c(body.encode()):08x}"},
            separators=(",", ":"),
        ).encode()

    @classmethod
    def parse(cls, path: str, raw: bytes) -> Manifest:
        try:
            outer = json.loads(raw)
            body = json.dumps(outer["body"], sort_keys=True, separators=(",", ":"))
            if (
                outer.get("format") not in (MANIFEST_FORMAT, *_OLD_FORMATS)
                or outer.get("crc32c") != f"{crc32c(body.encode()):08x}"
            ):
                raise ValueError("format or checksum mismatch")
            manifest = decode(cls, outer["body"])
        except RecursionError:  # json's C parser and encoder stop at the interpreter's limit
            raise CorruptCheckpointError(path, "bad manifest: nested too deeply") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(path, f"bad manifest: {exc}") from None
        problem = manifest._problem()
        if problem:
            raise CorruptCheckpointError(path, f"bad manifest: {problem}")
        return manifest

    def _problem(self) -> str:
        n = self.world_size
        if self.step < 0 or any(s < 0 for s in self.sizes):
            return "a negative step or size"
        if not (len(self.files) == len(self.checksums) == len(self.sizes) == n > 0):
            return "the lists do not match the world size"
        if not all(_plain_name(f) for f in [*self.files, self.replicas]):
            return "a file name leaves the step directory or is not one"
        if self.replicas not in self.files:  # no checksum would vouch for it
            return "the file of the replicated entries is not one of the step's"
        for path, saved in self.shards.items():
            dtype = TORCH_DTYPES.get(saved.dtype)
            # A shape torch cannot hold would fail inside torch.empty, with its own error.
            if (
                dtype is None
                or any(s < 0 for s in saved.shape)
                or nbytes(saved.shape, dtype.itemsize) is None
            ):
                return f"DTensor {path!r}: bad dtype or shape"
            if any(not len(b.offsets) == len(b.lengths) == len(saved.shape) for b in saved.boxes):
                return f"DTensor {path!r}: a box of another number of dimensions"
            if any(not 0 <= b.file < n for b in saved.boxes):
                return f"DTensor {path!r}: a box in a file that is not in the step"
            if not tiles(saved.shape, [b.box for b in saved.boxes]):
                return f"DTensor {path!r}: its boxes do not cover it exactly once"
        return ""


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


def file_report(storage: Storage, path: str, patterns: Sequence[str], rank: int, leaves: bool) -> FileReport:
    """Read back the header of a rank's committed file and report it: its checksum; a
    digest of the replicated entries it describes (stored by rank 0, external
    elsewhere), which must agree across ranks; the DTensor boxes it stored; and, when
    other ranks compare them (``leaves``), a digest of every other leaf. Blocking."""
    header, size = _header(storage, path)
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
    if rank == 0:
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


def leaf_count(boxes: Sequence[SavedBox]) -> int:
    return sum(math.prod(b.lengths) for b in boxes)


#: The name of a rank's file in a step directory.
_RANK_FILE = re.compile(r"rank_\d{5}")


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
            elif self.writable:
                await self._drop_uncommitted(name)
        return committed

    async def remove(self, name: str) -> None:
        # The manifest goes first: a half-removed step must not look committed.
        await _offload.run_io(self._remove_own, name, True)

    async def sweep(self, below: int, busy: set[str]) -> None:
        """Remove what failed or abandoned saves left in uncommitted step directories
        older than ``below`` that no save in progress is writing."""
        for step, name in (await _offload.run_io(self._steps)).items():
            if step < below and name not in busy and not await _offload.run_io(self._committed, name):
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
        if not _RANK_FILE.fullmatch(name):
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
