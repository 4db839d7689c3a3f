"""CheckpointManager: steps, triggers, retention, verified resume, history.

The files are the truth. A checkpoint exists once its file has been committed (the
writer's durable atomic rename) -- in a process group, once rank 0 wrote the step's
manifest (``_ranks``); the index next to them (latest pointer, history; ``_catalog``)
is a cache that is replaced atomically after each commit and rebuilt from the
directory whenever it is missing, stale or unreadable. Retention runs after a commit,
deletes only checkpoints older than the newest one, and never the newest one, so a
crash at any point leaves at least one valid checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import re
import signal
import string
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self, final

import anyio
import anyio.abc
import torch.distributed as dist

from . import _offload
from ._backends import resolve
from ._catalog import Catalog
from ._coord import Turn
from ._errors import CheckpointNotFoundError, CorruptCheckpointError, WriterClosedError
from ._group import StepDirs, rank_file
from ._handle import Failures, SaveFailure, SaveHandle, raise_first
from ._load import load, load_into
from ._ranks import Ranks
from ._records import CheckpointRecord
from ._retention import RetentionPolicy
from ._storage import Lease, Storage
from ._tree import ExternalLeaves
from ._triggers import EveryNSteps, Moment, Trigger, deterministic
from ._writers import QueueWriter, Writer

logger = logging.getLogger(__name__)

StateFn = Callable[[], "tuple[int, object] | Awaitable[tuple[int, object]]"]
#: How long a lease on an object store outlives a holder that stopped renewing it.
LEASE_TTL = 60.0


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
    ``save_every=N`` saves when ``step % N == 0`` (step 0 included), at most once per
    step; or pass a Trigger (``aiosnap.triggers``); None saves at every call. ``keep``
    is a RetentionPolicy (``aiosnap.retention``); None keeps everything. The writer, a
    QueueWriter by default, must be passed unopened: the manager opens and closes it.
    One manager per directory: a second one gets DirectoryLockedError, through a lock
    the OS drops when its holder dies.

    **Process groups.** When torch.distributed is initialised (or ``group=`` is given;
    ``group=False`` opts out), every rank of the group opens a manager on the same
    directory (a shared filesystem) and calls the same methods in the same order.
    Each step is then a directory (``name``, which must not use ``{rank}``) with one
    file per rank, written in parallel, and a manifest that rank 0 writes last, once
    every rank's file is durable. Rank 0 decides everything that must agree (which
    step is latest, what a restore takes, retention, the index) and tells the others
    over a gloo group the manager creates; every wait has a deadline of ``timeout``
    seconds of silence, so a failed, dead or hung rank makes every live rank raise
    RankFailedError naming it, instead of hanging. Tree paths matching a
    ``replicated`` glob (``["model.*"]``) must hold the same values on every rank: rank
    0 alone stores them and every rank reads them back, at any world size.
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
        group: dist.ProcessGroup | Literal[False] | None = None,
        replicated: Sequence[str] = (),
        timeout: float = 300.0,
    ) -> None:
        self._storage, self.directory = resolve(directory, storage)
        self._writer: Writer = writer if writer is not None else QueueWriter(storage=self._storage)
        self._name = name
        self._pattern = _name_pattern(name)
        self._keep = keep
        self._trigger: Trigger | None = EveryNSteps(save_every) if isinstance(save_every, int) else save_every
        self._allow_pickle = allow_pickle
        self._ranks: Ranks | None = None
        if group is not False and (group is not None or (dist.is_available() and dist.is_initialized())):
            if "{rank}" in name:
                raise ValueError(f"name {name!r}: in a group each step is a directory; drop {{rank}}")
            self._ranks = Ranks(
                group,
                storage=self._storage,
                directory=directory,
                replicated=replicated,
                timeout=timeout,
                allow_pickle=allow_pickle,
            )
            rank = self._ranks.rank
        elif replicated:
            raise ValueError("replicated= needs a process group")
        self.rank = rank
        #: The number of ranks that checkpoint together; None outside a group.
        self.world_size: int | None = self._ranks.size if self._ranks is not None else None
        self._catalog: Catalog | None = None
        if self._ranks is None or rank == 0:
            dirs = StepDirs(self._storage, directory, self._pattern) if self._ranks else None
            self._catalog = Catalog(
                self._storage,
                directory,
                self._pattern,
                keep,
                scan=dirs.scan if dirs else self._scan_files,
                remove=dirs.remove if dirs else self._remove_file,
            )
            if self._ranks is not None:
                self._ranks.catalog, self._ranks.dirs = self._catalog, dirs
        self._last: Moment | None = None
        self._pending: set[SaveHandle] = set()
        self._failures = Failures()
        self._tg: anyio.abc.TaskGroup | None = None
        self._lock: Lease | None = None
        self._signals: list[int] = []
        self._state = "new"
        #: Set once a signal given to ``save_on_signal`` has arrived and its save is done.
        self.preempted = anyio.Event()

    # -- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        if self._state != "new":
            raise WriterClosedError("a CheckpointManager can be opened only once")
        self._state = "opening"
        try:
            if self._ranks is not None:
                config = {"name": self._name, "replicated": self._ranks.replicated, "size": self._ranks.size}
                await self._ranks.open(config, self._prepare)
            else:
                await self._prepare()
            await self._writer.__aenter__()
        except BaseException:
            await self._release()
            raise
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._state = "open"
        return self

    async def _prepare(self) -> None:
        """Lock the directory, sweep what crashed saves left, load the index."""
        assert self._catalog is not None
        self._lock = await _offload.run_io(self._storage.lease, self.directory, LEASE_TTL)
        swept = await _offload.run_io(self._storage.sweep_incomplete, self.directory)
        if swept:
            logger.info("removed %d temp file(s) of crashed saves in %s", len(swept), self.directory)
        await self._catalog.load()

    async def _release(self) -> None:
        self._state = "closed"
        if self._catalog is not None:
            self._catalog.close()
        if self._ranks is not None:
            await self._ranks.close()
        if self._lock is not None:
            self._lock.release()

    async def aclose(self) -> None:
        """Wait for pending commits and the rotation they trigger; release the directory."""
        if self._state != "open":
            return
        self._state = "closing"
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.remove_signal_handler(sig)
        writer_error: Exception | None = None
        try:
            try:
                await self._writer.aclose()  # raises (so reports) the writer's failures
            except Exception as exc:
                writer_error = exc
            finally:
                await self._wait_pending()
                assert self._tg is not None
                await self._tg.__aexit__(None, None, None)
        finally:
            await self._release()
        if writer_error is not None:
            for failure in self._failures.take():
                writer_error.add_note(f"aiosnap: the save of {failure.path} failed too: {failure.error!r}")
            raise writer_error
        self._raise_pending()

    async def flush(self) -> None:
        """Wait until every accepted save is committed, indexed and rotated; raise the
        first failure not reported yet (noting any others)."""
        await self._writer.flush()
        await self._wait_pending()
        self._raise_pending()

    def take_failures(self) -> list[SaveFailure]:
        """The failed saves (of the writer, the index, the group) not reported yet, oldest
        first; from now on they count as reported: no later call raises them."""
        return self._writer.take_failures() + self._failures.take()

    async def _wait_pending(self) -> None:
        for handle in list(self._pending):
            await handle._done.wait()

    def _raise_pending(self, *, accepted: str | None = None) -> None:
        raise_first(self.take_failures(), accepted=accepted)

    async def _accept(self, filename: str, directory: str, state: object) -> SaveHandle:
        """Hand a save to the writer; earlier failures are this manager's to report."""
        accept = getattr(self._writer, "_accept", None)
        if accept is not None:
            handle: SaveHandle = await accept(filename, directory, state)
            return handle
        return await self._writer(filename, directory, state)

    # -- saving --------------------------------------------------------------------------
    def should_save(self, step: int, *, epoch: int | None = None) -> bool:
        """Whether the triggers call for a save now (always, with no trigger). In a
        group, this is this rank's view; ``save`` follows rank 0's for clock triggers."""
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
        filename = self.filename(step, epoch)
        record = CheckpointRecord(
            step, filename, epoch, metrics=dict(metrics or {}), metadata=dict(metadata or {})
        )
        if not force and not await self._due(step, epoch):
            self._raise_pending()
            handle = SaveHandle(self._storage.join(self.directory, filename))
            handle._skip()
            return handle
        if self._ranks is not None:
            outer = await self._save_in_group(record, state)
        else:
            inner = await self._accept(filename, self.directory, state)
            self._last = Moment(step, epoch, time.monotonic())
            outer = SaveHandle(inner.path)
            self._pending.add(outer)
            assert self._tg is not None
            self._tg.start_soon(self._after_commit, inner, outer, record)
        # Earlier failures are raised only now: this call's own save is accepted, and goes on.
        self._raise_pending(accepted=outer.path)
        return outer

    async def _due(self, step: int, epoch: int | None) -> bool:
        due = self.should_save(step, epoch=epoch)
        if self._ranks is not None and self._trigger is not None and not deterministic(self._trigger):
            due = await self._ranks.agree_on_trigger(due)
        return due

    async def _save_in_group(self, record: CheckpointRecord, state: object) -> SaveHandle:
        ranks, tg = self._ranks, self._tg
        assert ranks is not None
        assert tg is not None
        # The turn is taken now, in program order, as every rank does for this call; the
        # vote that fills it runs in the background.
        turn = ranks.votes.turn(f"save step {record.step}")
        step_dir = self._storage.join(self.directory, record.file)
        target = state if ranks.rank == 0 or not ranks.replicated else ExternalLeaves(state, ranks.matches)
        outer = SaveHandle(self._storage.join(step_dir, rank_file(ranks.rank)))
        self._pending.add(outer)
        try:
            inner: SaveHandle | BaseException = await self._accept(rank_file(ranks.rank), step_dir, target)
        except BaseException as exc:
            failure = (
                exc if isinstance(exc, Exception) else WriterClosedError("this rank's save was cancelled")
            )
            tg.start_soon(self._vote, turn, failure, record, outer)
            raise
        self._last = Moment(record.step, record.epoch, time.monotonic())
        tg.start_soon(self._vote, turn, inner, record, outer)
        return outer

    async def _vote(
        self, turn: Turn, inner: SaveHandle | BaseException, record: CheckpointRecord, outer: SaveHandle
    ) -> None:
        assert self._ranks is not None
        path = outer.path
        try:
            await self._ranks.vote(turn, inner, record, outer, lambda exc: self._failures.add(path, exc))
        finally:
            self._pending.discard(outer)

    def filename(self, step: int, epoch: int | None = None) -> str:
        if epoch is None and "{epoch}" in self._name:
            raise ValueError(f"name {self._name!r} uses {{epoch}}: pass epoch=")
        return self._name.format(step=step, epoch=epoch, rank=self.rank)

    async def _after_commit(self, inner: SaveHandle, outer: SaveHandle, record: CheckpointRecord) -> None:
        try:
            stats = await inner._outcome()
            if isinstance(stats, SaveFailure):
                outer._fail(stats)  # one failure, shared: reported once, by either
                return
            if stats.skipped:
                outer._finish(stats)
                return
            try:
                assert self._catalog is not None
                await self._catalog.add(record, stats)
            except Exception as exc:
                logger.error("indexing or rotation after step %d failed: %r", record.step, exc)
                outer._fail(self._failures.add(outer.path, exc))
            else:
                outer._finish(stats)
        finally:
            self._pending.discard(outer)
            if not outer.done():
                outer._fail(WriterClosedError("the manager closed before the save finished"))

    # -- the single-process layout: a file per step ---------------------------------------
    async def _scan_files(self) -> dict[int, str]:
        entries = await _offload.run_io(self._storage.list, self.directory)
        on_disk: dict[int, str] = {}
        for name in (e.name for e in entries if not e.is_dir):
            m = self._pattern.fullmatch(name)
            if m is None or int(m.groupdict().get("rank") or self.rank) != self.rank:
                continue
            on_disk[int(m.group("step"))] = name
        return on_disk

    async def _remove_file(self, name: str) -> None:
        await _offload.run_io(self._storage.delete, self._storage.join(self.directory, name))

    # -- reading -------------------------------------------------------------------------
    async def steps(self) -> list[int]:
        """Steps of the committed checkpoints that have not failed verification, oldest
        first. A save still being written, or one that failed, is not listed: a step
        appears once its checkpoint is durable and indexed (its handle has resolved)."""
        if self._ranks is not None:
            return list(await self._ranks.ask("steps", lambda: self._steps()))
        return self._steps()

    def _steps(self) -> list[int]:
        assert self._catalog is not None
        return self._catalog.steps()

    async def latest_step(self) -> int | None:
        steps = await self.steps()
        return steps[-1] if steps else None

    async def history(self) -> list[CheckpointRecord]:
        """Every commit this directory has seen (up to HISTORY_LIMIT), oldest first."""
        if self._ranks is not None:
            raw = await self._ranks.ask("history", lambda: [r.to_json() for r in self._history()])
            return [CheckpointRecord.from_json(r) for r in raw]
        return self._history()

    def _history(self) -> list[CheckpointRecord]:
        assert self._catalog is not None
        return list(self._catalog.history)

    async def restore(
        self, step: int | None = None, *, target: Any = None, keys: Sequence[str] | None = None
    ) -> Restored:
        """Load the latest (or the given) step, verifying it as it is read.

        If the latest checkpoint fails verification it is logged, marked, and the
        newest valid older one is tried; CheckpointNotFoundError only when none is valid.
        With ``target``, the state is loaded into it in place (only once it verified).
        In a group, every rank gets the same step, and its own part of it.
        """
        if target is not None and keys is not None:
            raise ValueError("restore takes target or keys, not both")
        if self._ranks is not None:
            found, path, state = await self._ranks.restore(step, target, keys)
            return Restored(found.step, found.epoch, path, state)
        assert self._catalog is not None
        candidates = [step] if step is not None else sorted(self._catalog.steps(), reverse=True)
        for candidate in candidates:
            record = self._catalog.records.get(candidate)
            if record is None:  # only an explicit step can be unknown
                raise CheckpointNotFoundError(self._storage.join(self.directory, f"<step {candidate}>"))
            path = self._storage.join(self.directory, record.file)
            try:
                state = await self._load(path, target, keys)
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                logger.warning(
                    "checkpoint %s failed verification (%s); falling back to an older one", path, exc
                )
                await self._catalog.mark_corrupt(candidate, str(exc))
                if step is not None:
                    raise
                continue
            return Restored(candidate, record.epoch, path, state)
        raise CheckpointNotFoundError(self.directory, f"no valid checkpoint in {self.directory!r}")

    async def _load(self, path: str, target: Any, keys: Sequence[str] | None) -> Any:
        if target is not None:
            return await load_into(path, target, allow_pickle=self._allow_pickle, storage=self._storage)
        return await load(path, keys=keys, allow_pickle=self._allow_pickle, storage=self._storage)

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
            self._failures.add(f"<save on {signal.Signals(sig).name}>", exc)
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
