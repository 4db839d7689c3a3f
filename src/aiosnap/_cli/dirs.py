"""What the command line asks of paths and checkpoint directories.

A path is a checkpoint file, a step directory (a group's checkpoint, committed by its
manifest), a DCP directory (torch.distributed.checkpoint's, with a ``.metadata``) or a
directory of checkpoints, local or at a URL. Directories are read through a read-only
CheckpointManager, which takes no lock and writes nothing, so all of this works while
training holds the directory; only ``prune`` opens one that writes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

import anyio

from .._base import offload as _offload
from .._base.errors import CheckpointError, CheckpointNotFoundError, DirectoryLockedError
from .._base.names import template
from .._format.manifest import MANIFEST_NAME, read_manifest
from .._manager.catalog import INDEX_NAME
from .._manager.manager import CheckpointManager
from .._manager.records import CheckpointRecord
from .._manager.retention import RetentionPolicy
from .._storage.backends import resolve
from .._storage.protocol import Storage, exists, get

T = TypeVar("T")

DEFAULT_NAME = "snapshot_iter_{step}"
#: What torch.distributed.checkpoint writes last into its directory.
DCP_METADATA = ".metadata"

Kind = Literal["file", "step", "dcp", "directory"]


@dataclass(frozen=True, slots=True)
class Located:
    """A path that exists, on its storage."""

    storage: Storage
    path: str
    kind: Kind
    size: int  # of a file; 0 for a directory


def run(fn: Callable[..., Awaitable[T]], *args: object) -> T:
    """``anyio.run(fn, *args)`` for a command: every storage call it makes is abandoned
    at Ctrl-C, and one that an object store holds up is told to the user within seconds
    (``offload.remote_io``), as the command line reaches local paths and URLs alike."""

    async def remote() -> T:
        with _offload.remote_io():
            return await fn(*args)

    return anyio.run(remote)


def locate(path: str) -> Located:
    """What is at ``path``; CheckpointNotFoundError if nothing is."""
    return run(locate_async, path)


async def locate_async(path: str) -> Located:
    """``locate``, from async code."""
    storage, where = resolve(path)
    return await _offload.run_io(_locate, storage, path, where)


def _locate(storage: Storage, path: str, where: str) -> Located:
    entry = storage.stat(where)
    if entry is None:
        raise CheckpointNotFoundError(path, f"{path}: no such file or directory")
    if not entry.is_dir:
        return Located(storage, where, "file", entry.size)
    if exists(storage, storage.join(where, MANIFEST_NAME)):
        return Located(storage, where, "step", 0)
    if exists(storage, storage.join(where, DCP_METADATA)):
        return Located(storage, where, "dcp", 0)
    return Located(storage, where, "directory", 0)


def size_of(storage: Storage, path: str) -> int:
    """The bytes of a checkpoint: a file's, or the sum of a step directory's files."""
    entry = storage.stat(path)
    if entry is None:
        return 0
    if not entry.is_dir:
        return entry.size
    try:
        return sum(read_manifest(storage, path).sizes)
    except CheckpointError:
        return 0


def guess_name(storage: Storage, directory: str) -> str:
    """The ``name`` a manager gave the checkpoints of ``directory``, read off its index
    (the default if there is none, or it tells nothing)."""
    try:
        data = json.loads(get(storage, storage.join(directory, INDEX_NAME)))
        entries = data["checkpoints"]
        records = [CheckpointRecord.from_json(e) for e in entries]
    except (CheckpointError, ValueError, KeyError, TypeError, RecursionError):
        return DEFAULT_NAME
    for record in records:
        name = _template(record)
        if name is not None and all(template(name).fullmatch(r.file) for r in records):
            return name
    return DEFAULT_NAME


def _template(record: CheckpointRecord) -> str | None:
    """``record.file`` with its step (and epoch) put back as ``{step}`` (``{epoch}``)."""
    runs = list(re.finditer(r"\d+", record.file))
    steps = [m for m in runs if int(m.group()) == record.step]
    if not steps:
        return None
    fields = {steps[-1].start(): (steps[-1], "{step}")}
    epochs = [m for m in runs if m is not steps[-1] and int(m.group()) == record.epoch]
    if epochs:
        fields[epochs[-1].start()] = (epochs[-1], "{epoch}")
    out, pos = [], 0
    for start in sorted(fields):
        match, field = fields[start]
        out += [_literal(record.file[pos:start]), field]
        pos = match.end()
    name = "".join([*out, _literal(record.file[pos:])])
    try:
        template(name)
    except ValueError:
        return None
    return name


def _literal(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


@dataclass(frozen=True, slots=True)
class Row:
    """One checkpoint of a listing."""

    record: CheckpointRecord
    size: int
    indexed: bool  # False: the index did not know it (its time is unknown)
    latest: bool
    remote: bool | None  # uploaded to the remote tier (None: no remote tier asked about)
    local: bool = True  # False: only the remote tier holds it


@dataclass(frozen=True, slots=True)
class Listing:
    directory: str
    name: str
    rows: list[Row]


async def listing(directory: str, name: str | None, remote: str | None) -> Listing:
    """The committed checkpoints of ``directory`` (and which of them ``remote`` holds)."""
    place = await directory_at(directory)
    name = name or guess_name(place.storage, place.path)
    async with CheckpointManager(directory, name=name, read_only=True) as manager:
        records = await manager.records()
        steps = await manager.steps()
    far: list[CheckpointRecord] = []
    uploaded: set[int] | None = None
    if remote is not None:  # the remote tier of a tiered manager: its uploads commit as saves do
        async with CheckpointManager(remote, name=name, read_only=True) as tier:
            far, uploaded = await tier.records(), set(await tier.steps())
    latest = steps[-1] if steps else None
    rows = []
    for r in records:
        indexed = bool(r.timings)  # every commit the index recorded has its timings
        path = place.storage.join(place.path, r.file)
        size = r.bytes if r.bytes else size_of(place.storage, path)
        rows.append(Row(r, size, indexed, r.step == latest, None if uploaded is None else r.step in uploaded))
    local = {r.step for r in records}
    rows += [Row(r, r.bytes, bool(r.timings), False, True, False) for r in far if r.step not in local]
    rows.sort(key=lambda row: row.record.step)
    return Listing(directory, name, rows)


async def directory_at(path: str) -> Located:
    """``path``, which must be a directory of checkpoints."""
    place = await locate_async(path)
    if place.kind == "file":
        raise CheckpointError(f"{path} is a file, not a directory of checkpoints (see `aiosnap inspect`)")
    if place.kind == "step":
        raise CheckpointError(f"{path} is one checkpoint (a step directory), not a directory of them")
    if place.kind == "dcp":
        raise CheckpointError(f"{path} is a torch.distributed.checkpoint directory, not aiosnap's")
    return place


async def checkpoints(directory: str, name: str | None) -> list[tuple[CheckpointRecord, str, int]]:
    """Every committed checkpoint of ``directory``, those marked corrupt included:
    (record, path, bytes)."""
    place = await directory_at(directory)
    name = name or guess_name(place.storage, place.path)
    async with CheckpointManager(directory, name=name, read_only=True) as manager:
        records = await manager.records()
    found = []
    for r in records:
        path = place.storage.join(place.path, r.file)
        found.append((r, path, size_of(place.storage, path)))
    return found


async def prune(
    directory: str, name: str | None, keep: RetentionPolicy, *, dry_run: bool
) -> tuple[list[CheckpointRecord], list[CheckpointRecord]]:
    """Apply ``keep`` to ``directory`` as its manager would: (what went, or would go; what
    stays, those marked corrupt included: retention leaves them be). A dry run reads
    only; a real one takes the directory."""
    place = await directory_at(directory)
    name = name or guess_name(place.storage, place.path)
    try:
        async with CheckpointManager(directory, name=name, keep=keep, read_only=dry_run) as manager:
            gone = await manager.prune(dry_run=dry_run)
            records = await manager.records()
    except DirectoryLockedError as exc:
        raise DirectoryLockedError(
            f"{exc}. prune deletes checkpoints, so it needs the directory to itself: run it once "
            "training has stopped (--dry-run works meanwhile)"
        ) from None
    gone_steps = {r.step for r in gone}
    return gone, [r for r in records if r.step not in gone_steps]
