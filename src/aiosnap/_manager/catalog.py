"""The committed checkpoints of a directory, the index that caches them, and retention.

The checkpoints on storage are the truth; the index (latest pointer, records, history)
is a cache, replaced atomically after each commit and rebuilt from storage whenever it
is missing, stale or unreadable. How a checkpoint looks on storage (a file, or a
directory committed by its manifest) is the layout's business: the catalog only
lists committed ones by name and asks for their removal.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Protocol, final

import anyio

from .._base import offload as _offload
from .._base.errors import CheckpointError, CheckpointNotFoundError, ForeignFileError, IndexWriteError
from .._base.notice import notice
from .._save.handle import SaveStats
from .._storage.protocol import Storage, Version
from .blobs import collect
from .records import CheckpointRecord
from .retention import RetentionPolicy, victims

logger = logging.getLogger(__name__)

INDEX_NAME = "aiosnap-index.json"
#: History entries kept in the index; older ones are dropped first.
HISTORY_LIMIT = 10_000
#: Scans a reader makes at most in one load while the index it reads keeps naming a
#: checkpoint the scan before did not see (see ``Catalog._scan``).
RESCANS = 8


class Steps(Protocol):
    """What the catalog asks of the layout of its directory (``_layouts``)."""

    @property
    def strays(self) -> list[str]:
        """What the last scan or removal left alone, as "name (why)"."""

    async def scan(self) -> dict[int, str]:
        """The committed checkpoints on storage, step -> name."""

    async def owns(self, name: str) -> bool | None:
        """Whether aiosnap wrote the checkpoint ``name`` (the index did not say); None if
        it is gone since the scan found it."""

    async def remove(self, name: str, size: int) -> None:
        """Delete checkpoint ``name`` (which the index records at ``size`` bytes, 0 if
        unknown), if it is still the one aiosnap wrote; else leave it, as a stray."""


@final
class Catalog:
    """What one directory holds, as its owner (the manager, or rank 0 of a group) sees it."""

    def __init__(
        self,
        storage: Storage,
        directory: str,
        pattern: re.Pattern[str],
        keep: RetentionPolicy | None,
        *,
        steps: Steps,
        writable: bool = True,
        name: str = "",
    ) -> None:
        self._storage, self._directory, self._pattern, self._keep = storage, directory, pattern, keep
        #: The name template ``pattern`` comes from (for messages).
        self._name = name
        self._steps = steps
        #: The warnings given: a reader rescans at every call, and says a thing once.
        self._warned: set[str] = set()
        self.records: dict[int, CheckpointRecord] = {}
        #: The history as parsed (``past``), or None while it is ``_unparsed`` still.
        self._history: list[CheckpointRecord] | None = []
        self._unparsed: list[object] = []
        self._lock = anyio.Lock()
        #: A reader's catalog (``read_only``) keeps everything in memory.
        self._writable = writable
        #: A reader's directory changes under it: a writer beside it commits and rotates.
        self._reader = not writable
        #: Whether the directory ever held a committed checkpoint, as far as the files and
        #: the index tell (the index keeps the history of what retention removed).
        self.committed_before = False
        #: Steps this catalog saw fail verification. Only they are removed for being
        #: corrupt: a mark read from the index (a cache) hides a checkpoint from steps(),
        #: but never deletes it.
        self._failed: set[int] = set()
        #: Steps retention must keep for now (their upload is pending): step -> holders.
        self._held: dict[int, int] = {}
        #: The steps rank 0 keeps, on another node's leader (``add``'s ``follow``): that
        #: node's retention is rank 0's, not a decision of its own.
        self._follow: set[int] | None = None
        #: The version of the index as this catalog last read or wrote it: the index is
        #: replaced only if it is still that one, so no other writer's update is lost.
        self._version: Version | None = None

    def steps(self) -> list[int]:
        """Committed steps that have not failed verification."""
        return sorted(s for s, r in self.records.items() if r.corrupt is None)

    def close(self) -> None:
        """Stop writing the index (the directory is about to be released)."""
        self._writable = False

    async def load(self) -> None:
        """Read the index and what is on storage: the index's records of what is there,
        and records made for what aiosnap wrote that the index does not know (a lost or
        stale index). What bears a checkpoint's name but is not aiosnap's is left alone,
        and named in one warning; what is gone since the scan found it is neither."""
        on_disk, indexed, history = await self._scan()
        strays = list(self._steps.strays)
        now = time.time()
        self.records = {}
        for step, name in sorted(on_disk.items()):
            known = indexed.get(step)
            if known is not None and known.file == name:
                self.records[step] = known
                continue
            owned = await self._steps.owns(name)
            if owned:
                self.records[step] = CheckpointRecord(step, name, self._epoch_of(name), wall_time=now)
            elif owned is not None:  # None: retention beside a reader removed it meanwhile
                strays.append(f"{name} (not a checkpoint aiosnap wrote)")
        self._history, self._unparsed = None, history
        self.committed_before = bool(self.records or indexed or history)
        self._warn_strays(strays)
        self._warn_other_names(indexed)
        if set(indexed) != set(self.records) and self._writable:
            await self._write_index_or_warn()

    async def _scan(self) -> tuple[dict[int, str], dict[int, CheckpointRecord], list[object]]:
        """What is on storage, and the index (records, history), read after it. A reader
        scans again while the index names a checkpoint the scan did not see and the index
        is a newer one than at the scan before: a listing does not see for sure a file
        renamed into place while it runs (a commit beside it), but every commit is in
        place before the index that names it is written, and retention removes a file
        only after writing an index without it. An index that names a file no scan finds
        twice over is stale (a file deleted by hand, an index write that failed)."""
        before: object = _UNREAD
        for _ in range(RESCANS if self._reader else 1):
            on_disk = await self._steps.scan()
            indexed, history = await self._read_index()
            missed = any(on_disk.get(step) != record.file for step, record in indexed.items())
            if not missed or self._version == before:
                break
            before = self._version
        return on_disk, indexed, history

    def mark(self) -> list[object]:
        """What a reader compares to tell that the directory moved on since it listed it:
        the index's version and the committed checkpoints (JSON, for the group's channel)."""
        return [self._version, [[step, r.file] for step, r in sorted(self.records.items())]]

    def _warn_strays(self, strays: list[str]) -> None:
        if strays:
            self._warn(
                f"{self._directory}: left alone, as aiosnap did not write them (it reads, follows and "
                f"deletes only its own checkpoints): {'; '.join(strays)}"
            )

    def _warn_other_names(self, indexed: dict[int, CheckpointRecord]) -> None:
        """The index names checkpoints of another name template (the directory was used
        with another ``name=``): this one neither lists, restores nor rotates them, and a
        resume would start afresh beside them. Said whether logging is configured or not."""
        other = sorted(r.file for r in indexed.values() if not self._pattern.fullmatch(r.file))
        if not other or "other names" in self._warned:
            return
        self._warned.add("other names")
        shown = ", ".join(other[-3:])
        notice(
            logger,
            f"{self._directory}: its index names {len(other)} checkpoint(s) saved under another name "
            f"template than name={self._name!r} (the newest: {shown}): they are not listed, restored "
            "or rotated by this manager. To resume from them, open the manager with the name= they "
            "were saved with (for example name='ckpt-{step}' for 'ckpt-100')",
        )

    def _warn(self, message: str) -> None:
        """Log ``message`` as a warning, unless this catalog has said it already."""
        if message not in self._warned:
            self._warned.add(message)
            logger.warning("%s", message)

    def _epoch_of(self, name: str) -> int | None:
        m = self._pattern.fullmatch(name)
        return int(m.group("epoch")) if m and "epoch" in m.groupdict() else None

    def kept_after(self, record: CheckpointRecord) -> list[int]:
        """The valid steps retention keeps once ``record`` is committed too (uploads in
        progress aside): what the other nodes of a group keep (``add``'s ``follow``)."""
        valid = [r for r in self.records.values() if r.corrupt is None and r.step != record.step]
        valid.append(record.replace(wall_time=time.time()))
        doomed = set(victims(self._keep, valid, time.time()))
        return sorted(r.step for r in valid if r.step not in doomed)

    async def add(
        self,
        record: CheckpointRecord,
        stats: SaveStats,
        nbytes: int | None = None,
        *,
        follow: list[int] | None = None,
    ) -> None:
        """Record a commit (its time, size and timings: ``nbytes`` if the checkpoint is
        more than the file of ``stats``), rewrite the index, then remove what retention
        lets go: ``follow``, on another node of a group, is what rank 0 keeps (its
        ``kept_after``), and what this node holds older than its newest goes."""
        timings = {
            "stall_s": stats.stall_s,
            "stage_s": stats.stage_s,
            "write_s": stats.write_s,
            "fsync_s": stats.fsync_s,
            "total_s": stats.total_s,
        }
        size = stats.bytes if nbytes is None else nbytes
        record = record.replace(wall_time=time.time(), bytes=size, timings=timings)
        async with self._lock:
            if not self._writable:
                raise CheckpointError(f"{self._directory}: a read-only catalog cannot record a commit")
            self.records[record.step] = record
            if follow is not None:
                self._follow = set(follow)
            self.committed_before = True
            self._history = [*(await self.past()), record][-HISTORY_LIMIT:]
            await self._prune()

    def hold(self, step: int) -> None:
        """Keep ``step`` from retention until as many ``release`` calls."""
        self._held[step] = self._held.get(step, 0) + 1

    async def release(self, step: int) -> None:
        """End a ``hold``; retention then removes the step if its policy lets it go."""
        left = self._held.pop(step, 1) - 1
        if left:
            self._held[step] = left
            return
        async with self._lock:
            if self._writable and self._doomed():
                await self._prune()

    async def _prune(self) -> None:
        """Write the index without what retention lets go, then remove that. The index is
        a cache: if it cannot be written, retention removes what it would have removed
        all the same (the next open rebuilds the index from what is on storage), and the
        failure is raised afterwards, as an IndexWriteError."""
        doomed = {step: self.records.pop(step) for step in self._doomed()}
        failed: OSError | None = None
        try:
            await self._write_index()
        except OSError as exc:
            failed = exc
        for record in doomed.values():
            await self._steps.remove(record.file, record.bytes)
            logger.info("retention removed %s", record.file)
        if doomed:
            await self._collect()
        self._warn_strays(list(self._steps.strays))
        if failed is not None:
            raise IndexWriteError(self._storage.join(self._directory, INDEX_NAME), failed) from failed

    async def _write_index_or_warn(self) -> None:
        """Write the index where a failure changes nothing but the cache (at open, after a
        mark): warn, and leave it to the next commit."""
        try:
            await self._write_index()
        except OSError as exc:
            logger.warning(
                "%s: the index could not be written (%r); it is rebuilt at the next open",
                self._directory,
                exc,
            )

    async def apply_retention(self, *, dry_run: bool = False) -> list[CheckpointRecord]:
        """Remove now what retention lets go (it otherwise runs after a commit); the
        records of what went, or with ``dry_run`` would go."""
        async with self._lock:
            gone = [self.records[step] for step in sorted(self._doomed())]
            if gone and not dry_run:
                if not self._writable:
                    raise CheckpointError(f"{self._directory}: a read-only catalog removes nothing")
                await self._prune()
            elif not dry_run and self._writable:
                await self._collect()  # blobs a crashed save left, which no checkpoint refers to
            return gone

    async def _collect(self) -> None:
        """Delete the blobs no checkpoint refers to any more (after the checkpoints that
        did are gone: see ``_blobs``)."""
        await _offload.run_io(collect, self._storage, self._directory)

    def _doomed(self) -> dict[int, str]:
        valid = [r for r in self.records.values() if r.corrupt is None]
        if self._follow is not None and self._follow:
            kept, top = self._follow, max(self._follow)
            doomed = [r.step for r in valid if r.step not in kept and r.step < top]
        else:
            doomed = victims(self._keep, valid, time.time())
        newest = max((r.step for r in valid), default=None)
        # Checkpoints that failed verification go once a newer valid one exists.
        doomed += [
            r.step
            for r in self.records.values()
            if r.corrupt is not None and r.step in self._failed and newest is not None and r.step < newest
        ]
        return {step: self.records[step].file for step in doomed if step not in self._held}

    async def mark_corrupt(self, step: int, reason: str) -> None:
        async with self._lock:
            record = self.records.get(step)
            if record is not None:
                self._failed.add(step)
                self.records[step] = record.replace(corrupt=reason)
                if self._writable:
                    await self._write_index_or_warn()

    async def mark_unreadable(self, step: int, reason: str) -> None:
        """Hide ``step`` from ``steps()`` for the life of this catalog: its file is no
        longer one aiosnap can read (something else replaced it). Unlike a corrupt one,
        retention never removes it: it may not be aiosnap's any more."""
        async with self._lock:
            record = self.records.get(step)
            if record is not None:
                self.records[step] = record.replace(corrupt=reason)

    async def _read_index(self) -> tuple[dict[int, CheckpointRecord], list[object]]:
        """The index's records, and its history still unparsed (``past`` parses it when
        asked: a reader reads the index at every call, and a full history takes a second
        to parse). Decoded in a worker thread: the event loop never parses a long index."""
        path = self._storage.join(self._directory, INDEX_NAME)
        try:
            raw, self._version = await _offload.run_io(self._storage.read_versioned, path)
            records, bad, history = await _offload.run_cpu(_decode_index, raw)
        except CheckpointNotFoundError:
            self._version = None
            return {}, []
        except ForeignFileError:
            if self._writable:
                raise  # a writer would replace it: refused, at open
            self._warn(f"{path} is not aiosnap's index; reading the directory without it")
            return {}, []
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            # RecursionError: json's C parser stops at the interpreter's nesting limit.
            self._warn(f"index {path} is unreadable ({exc!r}); rebuilding it from the directory")
            return {}, []
        self._warn_malformed(bad)
        return {r.step: r for r in records}, history

    async def past(self) -> list[CheckpointRecord]:
        """The history: every commit the index keeps, oldest first (parsed once per read
        of the index, in a worker thread)."""
        if self._history is not None:
            return self._history
        unparsed = self._unparsed
        parsed, bad = await _offload.run_cpu(_parse_records, unparsed)
        self._warn_malformed(bad)
        if self._history is None and self._unparsed is unparsed:  # no newer load meanwhile
            self._history, self._unparsed = parsed, []
        return parsed

    def _warn_malformed(self, bad: int) -> None:
        """A checkpoint whose record was malformed is taken as the directory shows it, as
        if the index never knew it; a history entry is dropped."""
        if bad:
            path = self._storage.join(self._directory, INDEX_NAME)
            self._warn(f"index {path}: {bad} malformed entries ignored")

    async def _write_index(self) -> None:
        valid = self.steps()
        checkpoints = [r for _, r in sorted(self.records.items())]
        latest = valid[-1] if valid else None
        blob = await _offload.run_cpu(_encode_index, latest, checkpoints, list(await self.past()))
        path = self._storage.join(self._directory, INDEX_NAME)
        self._version = await _offload.run_io(self._storage.replace_if, path, blob, self._version)


def _decode_index(raw: bytes) -> tuple[list[CheckpointRecord], int, list[object]]:
    """The index's well-formed checkpoint records, how many were not, and its history
    (cut as it is written: a longer one is not the writer's). Runs in a worker thread."""
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise TypeError(f"the index is a {type(data).__name__}, not an object")
    records, history = data["checkpoints"], data.get("history", [])
    if not isinstance(records, list) or not isinstance(history, list):
        raise TypeError("checkpoints or history is not a list")
    parsed, bad = _parse_records(records)
    return parsed, bad, history[-HISTORY_LIMIT:]


def _parse_records(entries: list[object]) -> tuple[list[CheckpointRecord], int]:
    """The well-formed records among index entries, and how many were not. Runs in a
    worker thread."""
    records, bad = [], 0
    for entry in entries:
        try:
            records.append(CheckpointRecord.from_json(entry))
        except (ValueError, TypeError):
            bad += 1
    return records, bad


#: No index read yet (None is the version of an index that does not exist).
_UNREAD = object()


def _encode_index(
    latest: int | None, checkpoints: list[CheckpointRecord], history: list[CheckpointRecord]
) -> bytes:
    """The index as JSON. Runs in a worker thread, with json's C encoder: ``indent=``
    selects the pure-Python one, which held the event loop for 2 s with a full history."""
    data = {
        "version": 1,
        "latest": latest,
        "checkpoints": [r.to_json() for r in checkpoints],
        "history": [r.to_json() for r in history],
    }
    return json.dumps(data, default=repr).encode()
