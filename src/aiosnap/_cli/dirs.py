"""What the command line asks of paths and checkpoint directories.

A path is a checkpoint file, a step directory (a group's checkpoint, committed by its
manifest), an integration's checkpoint folder (a Hugging Face Trainer's or Accelerate's
``checkpoint-N/``, which stands for the ``state.aiosnap`` in it), a DCP directory
(torch.distributed.checkpoint's, with a ``.metadata``) or a directory of checkpoints,
local or at a URL. A directory of checkpoints is a manager's, read through a read-only
CheckpointManager, which takes no lock and writes nothing, so all of this works while
training holds the directory (only ``prune`` opens one that writes); or an
integration's (``layouts``), read as it stands.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import re
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import anyio

from .._base import offload as _offload
from .._base.errors import CheckpointError, CheckpointNotFoundError, DirectoryLockedError
from .._base.names import template
from .._format.manifest import MANIFEST_NAME, read_manifest
from .._manager.catalog import INDEX_NAME
from .._manager.manager import CheckpointManager
from .._manager.records import CheckpointRecord
from .._manager.retention import RetentionPolicy
from .._storage.backends import object_deadline, resolve, scheme_of
from .._storage.protocol import Storage, exists, get
from . import layouts

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
    #: The integration's checkpoint folder the file stands for (``path`` is its
    #: ``state.aiosnap``), or None.
    folder: str | None = None


#: How the command line's user sets how long a remote store is waited for.
DEADLINE_OPTION = "--deadline SECONDS"
#: Seconds past the deadline that a call may still take: a store's last try (its own
#: request timeout is longer) gets this long to answer before it is given up.
ANSWER_MARGIN = 5.0


#: What the running command does, and how long a call of ``run`` may go unanswered.
_reach: contextvars.ContextVar[tuple[str, float | None] | None] = contextvars.ContextVar(
    "aiosnap_cli_reach", default=None
)


@contextlib.contextmanager
def reaching(doing: str, deadline: float | None, *paths: str) -> Iterator[None]:
    """Within (a command's body, on ``paths``): storages made for URLs retry a failing
    call for ``deadline`` seconds (``--deadline``; None: their own default); the calls
    ``run`` makes are named by ``doing`` (what the command does, in words: "listing
    s3://bucket/run") and, where a path is a URL, one still unanswered ANSWER_MARGIN
    seconds past the deadline is abandoned with RemoteStorageError (a store that accepts
    and never answers). A local disk is waited for as long as it takes, and so are the
    bulk reads and writes a command makes outside ``run`` (a verify, a convert)."""
    remote = any(scheme_of(p) not in (None, "file") for p in paths)
    token = _reach.set((doing, deadline + ANSWER_MARGIN if remote and deadline is not None else None))
    try:
        with object_deadline(deadline):
            yield
    finally:
        _reach.reset(token)


def run(fn: Callable[..., Awaitable[T]], *args: object) -> T:
    """``anyio.run(fn, *args)`` for a command: every storage call it makes is abandoned
    at Ctrl-C, and one that an object store holds up is told to the user within seconds
    (``offload.remote_io``), named and bounded as ``reaching`` says, as the command line
    reaches local paths and URLs alike."""
    doing, limit = _reach.get() or (None, None)

    async def remote() -> T:
        with _offload.remote_io(doing, limit=limit, knob=DEADLINE_OPTION):
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
    state = layouts.folder_state(storage, where)
    if state is not None:
        found = storage.stat(state)
        return Located(storage, state, "file", 0 if found is None else found.size, folder=where)
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

    step: int | None  # None: an integration's file that says none
    epoch: int | float | None  # the Hugging Face Trainer's is a fraction
    file: str  # the file or folder, in the listing's directory
    time: float | None  # when it was committed (None: the index did not record it)
    size: int
    metrics: dict[str, Any]
    corrupt: str | None
    latest: bool
    remote: bool | None = None  # uploaded to the remote tier (None: no remote tier asked about)
    local: bool = True  # False: only the remote tier holds it


@dataclass(frozen=True, slots=True)
class Listing:
    """The checkpoints of a directory: a manager's (``layout`` None, ``name`` its
    template) or an integration's (``layout`` says whose)."""

    directory: str
    name: str | None
    rows: list[Row]
    layout: layouts.Layout | None = None


def _record_row(r: CheckpointRecord, size: int, latest: bool, remote: bool | None, local: bool = True) -> Row:
    time = r.wall_time if r.timings else None  # every commit the index recorded has its timings
    return Row(r.step, r.epoch, r.file, time, size, r.metrics, r.corrupt, latest, remote, local)


async def listing(directory: str, name: str | None, remote: str | None) -> Listing:
    """The committed checkpoints of ``directory`` (and which of them ``remote`` holds);
    CheckpointNotFoundError where there are none."""
    place = await directory_at(directory)
    found = None if remote is not None else await _integration(place, name)
    if found is not None:
        top = max((i.step for i in found.items if i.step is not None), default=None)
        rows = [
            Row(
                i.step, i.epoch, i.name, None, i.size, i.metrics, i.corrupt, top is not None and i.step == top
            )
            for i in found.items
        ]
        return Listing(found.directory, name, rows, found)
    name = await _name_of(place, name)
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
        path = place.storage.join(place.path, r.file)
        size = r.bytes if r.bytes else await _offload.run_io(size_of, place.storage, path)
        rows.append(_record_row(r, size, r.step == latest, None if uploaded is None else r.step in uploaded))
    local = {r.step for r in records}
    rows += [_record_row(r, r.bytes, False, True, False) for r in far if r.step not in local]
    rows.sort(key=lambda row: row.step or 0)
    if not rows:
        raise await _offload.run_io(_nothing, directory, name, place)
    return Listing(directory, name, rows)


async def _name_of(place: Located, name: str | None) -> str:
    """``name``, or the name read off the directory's index."""
    if name is not None:
        return name
    guessed: str = await _offload.run_io(guess_name, place.storage, place.path)
    return guessed


async def _integration(place: Located, name: str | None) -> layouts.Layout | None:
    """The checkpoints of an integration in ``place`` (a manager's directory, which has
    an index, is none); with ``name``, folders named by that template."""
    storage, path = place.storage, place.path
    if name is None and await _offload.run_io(exists, storage, storage.join(path, INDEX_NAME)):
        return None
    return await _offload.run_io(layouts.find, storage, path, name)


def _nothing(directory: str, name: str, place: Located) -> CheckpointNotFoundError:
    """No checkpoint in ``directory``: what was looked for, and how to say what to look for."""
    looked = f"named like {name!r}"
    if name == DEFAULT_NAME and not exists(place.storage, place.storage.join(place.path, INDEX_NAME)):
        looked = (
            f"no index, nothing named like {name!r} (a manager's default), and none of the trainer "
            f"integrations' checkpoints ({layouts.DESCRIBED})"
        )
    reason = f"no checkpoints in {directory}: {looked}; --name sets the name"
    return CheckpointNotFoundError(directory, reason)


async def directory_at(path: str) -> Located:
    """``path``, which must be a directory of checkpoints."""
    place = await locate_async(path)
    if place.folder is not None:
        raise CheckpointError(
            f"{path} is one checkpoint (a trainer's checkpoint folder holding {layouts.STATE_NAME}), "
            "not a directory of them: inspect or verify it, or ls the directory above it"
        )
    if place.kind == "file":
        raise CheckpointError(f"{path} is a file, not a directory of checkpoints (see `aiosnap inspect`)")
    if place.kind == "step":
        raise CheckpointError(f"{path} is one checkpoint (a step directory), not a directory of them")
    if place.kind == "dcp":
        raise CheckpointError(f"{path} is a torch.distributed.checkpoint directory, not aiosnap's")
    return place


async def checkpoints(directory: str, name: str | None) -> list[tuple[str, int]]:
    """Every checkpoint of ``directory`` (path, bytes): a manager's committed ones, those
    marked corrupt included, or an integration's; CheckpointNotFoundError where there
    are none."""
    place = await directory_at(directory)
    found = await _integration(place, name)
    if found is not None:
        return [(i.path, i.size) for i in found.items]
    name = await _name_of(place, name)
    async with CheckpointManager(directory, name=name, read_only=True) as manager:
        records = await manager.records()
    if not records:
        raise await _offload.run_io(_nothing, directory, name, place)
    paths = [place.storage.join(place.path, r.file) for r in records]
    return [(path, await _offload.run_io(size_of, place.storage, path)) for path in paths]


async def prune(
    directory: str, name: str | None, keep: RetentionPolicy, *, dry_run: bool
) -> tuple[list[CheckpointRecord], list[CheckpointRecord]]:
    """Apply ``keep`` to ``directory`` as its manager would: (what went, or would go; what
    stays, those marked corrupt included: retention leaves them be). A dry run reads
    only; a real one takes the directory. CheckpointNotFoundError where there are no
    checkpoints; CheckpointError for an integration's directory, which its trainer rotates."""
    place = await directory_at(directory)
    found = await _integration(place, name)
    if found is not None:
        raise CheckpointError(
            f"{found.directory} holds {found.title} checkpoints, which the trainer rotates itself "
            "(its own limit on how many it keeps); prune applies retention to a CheckpointManager's directory"
        )
    name = await _name_of(place, name)
    try:
        async with CheckpointManager(directory, name=name, keep=keep, read_only=dry_run) as manager:
            gone = await manager.prune(dry_run=dry_run)
            records = await manager.records()
    except DirectoryLockedError as exc:
        raise DirectoryLockedError(
            f"{exc}. prune deletes checkpoints, so it needs the directory to itself: run it once "
            "training has stopped (--dry-run works meanwhile)"
        ) from None
    if not records and not gone:
        raise await _offload.run_io(_nothing, directory, name, place)
    gone_steps = {r.step for r in gone}
    return gone, [r for r in records if r.step not in gone_steps]
