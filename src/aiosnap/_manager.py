"""CheckpointManager: steps, triggers, retention, verified resume, history.

The files are the truth. A checkpoint exists once its file has been committed (the
writer's durable atomic rename); the index next to them (latest pointer, history) is
a cache that is replaced atomically after each commit and rebuilt from the directory
whenever it is missing, stale or unreadable. Retention runs after a commit, deletes
only checkpoints older than the newest one, and never the newest one, so a crash at
any point leaves at least one valid checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import re
import signal
import string
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self, final

import anyio
import anyio.abc

from . import _offload
from ._errors import CheckpointNotFoundError, CorruptCheckpointError, WriterClosedError
from ._handle import SaveHandle, SaveStats
from ._load import load, load_into
from ._records import CheckpointRecord
from ._retention import RetentionPolicy, victims
from ._storage import LocalStorage, Storage, StorageLock
from ._triggers import EveryNSteps, Moment, Trigger
from ._writers import QueueWriter, Writer

logger = logging.getLogger(__name__)

INDEX_NAME = "aiosnap-index.json"
#: History entries kept in the index; older ones are dropped first.
HISTORY_LIMIT = 10_000

StateFn = Callable[[], "tuple[int, object] | Awaitable[tuple[int, object]]"]


@final
@dataclass(frozen=True, slots=True)
class Restored:
    """What ``restore`` loaded: which step, from where, and the state."""

    step: int
    epoch: int | None
    path: str
    state: Any


def _name_pattern(name: str) -> re.Pattern[str]:
    parts = []
    for literal, field, spec, conv in string.Formatter().parse(name):
        parts.append(re.escape(literal))
        if field is None:
            continue
        if field not in ("step", "epoch", "rank") or spec or conv:
            raise ValueError(f"name {name!r}: only {{step}}, {{epoch}} and {{rank}} may be used")
        parts.append(f"(?P<{field}>\\d+)")
    if "(?P<step>" not in "".join(parts):
        raise ValueError(f"name {name!r} must contain {{step}}")
    return re.compile("".join(parts))


@final
class CheckpointManager(anyio.abc.AsyncResource):
    """Owns a checkpoint directory: saves through a writer, keeps an index, rotates, restores.

    ``name`` is a format string with ``{step}`` and optionally ``{epoch}`` and ``{rank}``.
    ``save_every`` is a step count or a Trigger (see ``aiosnap.triggers``); ``keep`` a
    RetentionPolicy (None keeps everything). The writer, a QueueWriter by default, must
    be passed unopened: the manager opens and closes it. One manager per directory: a
    second one gets DirectoryLockedError, through a lock the OS drops when its holder
    dies.
    """

    def __init__(
        self,
        directory: str,
        *,
        writer: Writer | None = None,
        name: str = "snapshot_iter_{step}",
        keep: RetentionPolicy | None = None,
        save_every: int | Trigger | None = None,
        storage: Storage | None = None,
        rank: int = 0,
        allow_pickle: bool = False,
    ) -> None:
        self.directory = directory
        self.rank = rank
        self._storage = storage if storage is not None else LocalStorage()
        self._writer: Writer = writer if writer is not None else QueueWriter(storage=self._storage)
        self._name = name
        self._pattern = _name_pattern(name)
        self._keep = keep
        self._trigger: Trigger | None = EveryNSteps(save_every) if isinstance(save_every, int) else save_every
        self._allow_pickle = allow_pickle
        self._records: dict[int, CheckpointRecord] = {}
        self._history: list[CheckpointRecord] = []
        self._last: Moment | None = None
        self._index_lock = anyio.Lock()
        self._pending: set[SaveHandle] = set()
        self._errors: list[BaseException] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._lock: StorageLock | None = None
        self._signals: list[int] = []
        self._state = "new"
        #: Set once a signal given to ``save_on_signal`` has arrived and its save is done.
        self.preempted = anyio.Event()

    # -- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        if self._state != "new":
            raise WriterClosedError("a CheckpointManager can be opened only once")
        self._lock = await _offload.run_io(self._storage.lock, self.directory)
        try:
            swept = await _offload.run_io(self._storage.sweep_temp, self.directory)
            if swept:
                logger.info("removed %d temp file(s) of crashed saves in %s", len(swept), self.directory)
            await self._load_index()
            await self._writer.__aenter__()
        except BaseException:
            self._lock.release()
            raise
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._state = "open"
        return self

    async def aclose(self) -> None:
        """Wait for pending commits and the rotation they trigger; release the directory."""
        if self._state != "open":
            return
        self._state = "closing"
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.remove_signal_handler(sig)
        try:
            try:
                await self._writer.aclose()
            finally:
                await self._wait_pending()
                assert self._tg is not None
                await self._tg.__aexit__(None, None, None)
        finally:
            self._state = "closed"
            assert self._lock is not None
            self._lock.release()
        self._raise_pending()

    async def flush(self) -> None:
        """Wait until every accepted save is committed, indexed and rotated."""
        await self._writer.flush()
        await self._wait_pending()
        self._raise_pending()

    async def _wait_pending(self) -> None:
        for handle in list(self._pending):
            await handle._done.wait()

    def _raise_pending(self) -> None:
        if self._errors:
            error = self._errors.pop(0)
            raise error

    # -- saving --------------------------------------------------------------------------
    def should_save(self, step: int, *, epoch: int | None = None) -> bool:
        """Whether the triggers call for a save now (always, with no trigger)."""
        if self._trigger is None:
            return True
        return self._trigger(Moment(step, epoch, time.monotonic()), self._last)

    async def save(
        self,
        step: int,
        state: object,
        *,
        epoch: int | None = None,
        metrics: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        force: bool = False,
    ) -> SaveHandle:
        """Save ``state`` as ``step`` if the triggers say so (or ``force``).

        Returns once the state is captured. The handle resolves when the checkpoint is
        committed, indexed, and the retention it triggers is done; a save the triggers
        did not call for resolves at once, skipped.
        """
        if self._state != "open":
            raise WriterClosedError("the manager is not open: use `async with manager:`")
        self._raise_pending()
        if not force and not self.should_save(step, epoch=epoch):
            handle = SaveHandle(self._storage.join(self.directory, self.filename(step, epoch)))
            handle._skip()
            return handle
        filename = self.filename(step, epoch)
        inner = await self._writer(filename, self.directory, state)
        self._last = Moment(step, epoch, time.monotonic())
        outer = SaveHandle(inner.path)
        self._pending.add(outer)
        record = CheckpointRecord(
            step, filename, epoch, metrics=dict(metrics or {}), metadata=dict(metadata or {})
        )
        assert self._tg is not None
        self._tg.start_soon(self._after_commit, inner, outer, record)
        return outer

    def filename(self, step: int, epoch: int | None = None) -> str:
        if epoch is None and "{epoch}" in self._name:
            raise ValueError(f"name {self._name!r} uses {{epoch}}: pass epoch=")
        return self._name.format(step=step, epoch=epoch, rank=self.rank)

    async def _after_commit(self, inner: SaveHandle, outer: SaveHandle, record: CheckpointRecord) -> None:
        try:
            try:
                stats = await inner.wait()
            except Exception as exc:
                outer._fail(exc)  # the writer reports it too: do not raise it twice
                return
            if stats.skipped:
                outer._finish(stats)
                return
            try:
                await self._commit_record(record, stats)
            except Exception as exc:
                logger.error("indexing or rotation after step %d failed: %r", record.step, exc)
                self._errors.append(exc)
                outer._fail(exc)
            else:
                outer._finish(stats)
        finally:
            self._pending.discard(outer)
            if not outer.done():
                outer._fail(WriterClosedError("the manager closed before the save finished"))

    async def _commit_record(self, record: CheckpointRecord, stats: SaveStats) -> None:
        timings = {
            "stall_s": stats.stall_s,
            "stage_s": stats.stage_s,
            "write_s": stats.write_s,
            "fsync_s": stats.fsync_s,
            "total_s": stats.total_s,
        }
        record = record.replace(wall_time=time.time(), bytes=stats.bytes, timings=timings)
        async with self._index_lock:
            self._records[record.step] = record
            self._history = [*self._history, record][-HISTORY_LIMIT:]
            doomed = self._doomed()
            for step in doomed:
                self._records.pop(step)
            await self._write_index()
            for file in doomed.values():
                await _offload.run_io(self._storage.remove, self._storage.join(self.directory, file))
                logger.info("retention removed %s", file)

    def _doomed(self) -> dict[int, str]:
        valid = [r for r in self._records.values() if r.corrupt is None]
        doomed = victims(self._keep, valid, time.time())
        newest = max((r.step for r in valid), default=None)
        # Checkpoints that failed verification go once a newer valid one exists.
        doomed += [r.step for r in self._records.values() if r.corrupt and newest and r.step < newest]
        return {step: self._records[step].file for step in doomed}

    # -- the index -----------------------------------------------------------------------
    async def _load_index(self) -> None:
        names = await _offload.run_io(self._storage.listdir, self.directory)
        on_disk: dict[int, str] = {}
        for name in names:
            m = self._pattern.fullmatch(name)
            if m is None or int(m.groupdict().get("rank") or self.rank) != self.rank:
                continue
            on_disk[int(m.group("step"))] = name
        indexed, history = await self._read_index()
        now = time.time()
        self._records = {}
        for step, name in sorted(on_disk.items()):
            known = indexed.get(step)
            # A file the index does not know (a lost or stale index) is taken as it is.
            self._records[step] = (
                known
                if known and known.file == name
                else CheckpointRecord(step, name, self._epoch_of(name), wall_time=now)
            )
        self._history = history
        if set(indexed) != set(on_disk):
            await self._write_index()

    def _epoch_of(self, name: str) -> int | None:
        m = self._pattern.fullmatch(name)
        return int(m.group("epoch")) if m and "epoch" in m.groupdict() else None

    async def _read_index(self) -> tuple[dict[int, CheckpointRecord], list[CheckpointRecord]]:
        path = self._storage.join(self.directory, INDEX_NAME)
        try:
            raw = await _offload.run_io(self._storage.read_bytes, path)
            data = json.loads(raw)
            records = [CheckpointRecord.from_json(r) for r in data["checkpoints"]]
            history = [CheckpointRecord.from_json(r) for r in data.get("history", [])]
        except CheckpointNotFoundError:
            return {}, []
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("index %s is unreadable (%r); rebuilding it from the directory", path, exc)
            return {}, []
        return {r.step: r for r in records}, history

    async def _write_index(self) -> None:
        valid = [r.step for r in self._records.values() if r.corrupt is None]
        data = {
            "version": 1,
            "latest": max(valid, default=None),
            "checkpoints": [r.to_json() for _, r in sorted(self._records.items())],
            "history": [r.to_json() for r in self._history],
        }
        blob = json.dumps(data, indent=1, default=repr).encode()
        path = self._storage.join(self.directory, INDEX_NAME)
        await _offload.run_io(self._storage.write_atomic, path, [memoryview(blob)])

    # -- reading -------------------------------------------------------------------------
    async def steps(self) -> list[int]:
        """Steps of the committed checkpoints that have not failed verification."""
        return sorted(s for s, r in self._records.items() if r.corrupt is None)

    async def latest_step(self) -> int | None:
        steps = await self.steps()
        return steps[-1] if steps else None

    async def history(self) -> list[CheckpointRecord]:
        """Every commit this directory has seen (up to HISTORY_LIMIT), oldest first."""
        return list(self._history)

    async def restore(
        self, step: int | None = None, *, target: Any = None, keys: Sequence[str] | None = None
    ) -> Restored:
        """Load the latest (or the given) step, verifying it as it is read.

        If the latest checkpoint fails verification it is logged, marked, and the
        newest valid older one is tried; CheckpointNotFoundError only when none is valid.
        With ``target``, the state is loaded into it in place (only once it verified).
        """
        candidates = [step] if step is not None else sorted(await self.steps(), reverse=True)
        for candidate in candidates:
            record = self._records.get(candidate)
            if record is None:  # only an explicit step can be unknown
                raise CheckpointNotFoundError(self._storage.join(self.directory, f"<step {candidate}>"))
            path = self._storage.join(self.directory, record.file)
            try:
                state = await self._load(path, target, keys)
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                logger.warning(
                    "checkpoint %s failed verification (%s); falling back to an older one", path, exc
                )
                await self._mark_corrupt(candidate, str(exc))
                if step is not None:
                    raise
                continue
            return Restored(candidate, record.epoch, path, state)
        raise CheckpointNotFoundError(self.directory, f"no valid checkpoint in {self.directory!r}")

    async def _load(self, path: str, target: Any, keys: Sequence[str] | None) -> Any:
        if target is not None:
            if keys is not None:
                raise ValueError("restore takes target or keys, not both")
            return await load_into(path, target, allow_pickle=self._allow_pickle, storage=self._storage)
        return await load(path, keys=keys, allow_pickle=self._allow_pickle, storage=self._storage)

    async def _mark_corrupt(self, step: int, reason: str) -> None:
        async with self._index_lock:
            record = self._records.get(step)
            if record is not None:
                self._records[step] = record.replace(corrupt=reason)
                if self._state == "open":
                    await self._write_index()

    # -- saving when things go wrong -----------------------------------------------------
    def save_on_signal(
        self, state_fn: StateFn, *, signals: Sequence[int] = (signal.SIGTERM,), deadline: float = 60.0
    ) -> None:
        """On any of ``signals``, save ``state_fn()`` (a ``(step, state)`` pair) and flush it
        within ``deadline`` seconds, then set ``manager.preempted``. Training code should
        watch ``preempted`` and stop. Handlers are removed at ``aclose``."""
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal, sig, state_fn, deadline)
            self._signals.append(sig)

    def _on_signal(self, sig: int, state_fn: StateFn, deadline: float) -> None:
        if self._tg is not None and self._state == "open":
            self._tg.start_soon(self._save_for_signal, sig, state_fn, deadline)

    async def _save_for_signal(self, sig: int, state_fn: StateFn, deadline: float) -> None:
        try:
            with anyio.fail_after(deadline):
                step = await self._emergency_save(state_fn)
            logger.warning("saved step %d on signal %s", step, signal.Signals(sig).name)
        except Exception as exc:
            logger.error("the save on signal %s failed: %r", signal.Signals(sig).name, exc)
            self._errors.append(exc)
        finally:
            self.preempted.set()

    async def _emergency_save(self, state_fn: StateFn) -> int:
        result = state_fn()
        step, state = await result if inspect.isawaitable(result) else result
        handle = await self.save(step, state, force=True)
        await handle.wait()
        return step

    @contextlib.asynccontextmanager
    async def save_on_error(self, state_fn: StateFn) -> AsyncIterator[None]:
        """Save ``state_fn()`` (a ``(step, state)`` pair) when the body raises, then re-raise."""
        try:
            yield
        except (Exception, KeyboardInterrupt) as exc:
            try:
                step = await self._emergency_save(state_fn)
            except Exception as save_exc:
                exc.add_note(f"aiosnap: the save on error failed too: {save_exc!r}")
            else:
                exc.add_note(f"aiosnap: saved step {step} before re-raising")
            raise
