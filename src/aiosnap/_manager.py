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
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self, final

import anyio
import anyio.abc

from . import _offload
from ._backends import resolve
from ._catalog import Catalog
from ._channel import Channel, LocalChannel
from ._errors import CheckpointError, DirectoryLockedError, LeaseLostError, WriterClosedError
from ._group import has_step_dirs
from ._handle import Failures, SaveFailure, SaveHandle, raise_first
from ._layouts import Files, Layout, StepDirectories
from ._member import Member
from ._messages import OpenReport
from ._records import CheckpointRecord
from ._retention import RetentionPolicy
from ._storage import Lease, Storage
from ._tree import ExternalLeaves
from ._triggers import EveryNSteps, Moment, Trigger, deterministic
from ._writers import QueueWriter, Writer

logger = logging.getLogger(__name__)

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


def _in_a_group(group: object) -> bool:
    """Whether this process checkpoints with a group (torch.distributed is only looked at
    if its user imported it)."""
    if group is False:
        return False
    if group is not None:
        return True
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


@final
class CheckpointManager(anyio.abc.AsyncResource):
    """Owns a checkpoint directory: saves through a writer, keeps an index, rotates, restores.

    ``directory`` is a local path or a URL (``s3://bucket/run``). ``name`` is a format
    string with ``{step}`` and optionally ``{epoch}`` and ``{rank}``.
    ``save_every=N`` saves when ``step % N == 0`` (step 0 included), at most once per
    step; or pass a Trigger (``aiosnap.triggers``); None saves at every call. ``keep``
    is a RetentionPolicy (``aiosnap.retention``); None keeps everything. The writer, a
    QueueWriter by default, must be passed unopened: the manager opens and closes it.
    One manager per directory: a second one gets DirectoryLockedError, through a lock
    the OS drops when its holder dies. ``read_only=True`` takes no lock and writes
    nothing -- no save, no index, no sweeping, no corrupt marks -- so evaluation and
    tooling can list, inspect and restore while training holds the directory.

    **Process groups.** When torch.distributed is initialised (or ``group=`` is given;
    ``group=False`` opts out), every rank of the group opens a manager on the same
    directory (a shared filesystem or an object store) and calls the same methods in
    the same order. Each step is then a directory (``name``, which must not use
    ``{rank}``) with one file per rank, written in parallel, and a manifest that rank 0
    writes last, once every rank's file is durable. Rank 0 decides everything that must
    agree (which step is latest, what a restore takes, retention, the index) and tells
    the others over a gloo group the manager creates; every wait has a deadline of
    ``timeout`` seconds of silence, so a failed, dead or hung rank makes every live rank
    raise RankFailedError naming it, instead of hanging. DTensors (FSDP2, tensor
    parallelism) are saved as each rank's shard, one copy of each, and restore into any
    mesh and placements at any world size. Tree paths matching a ``replicated`` glob
    (``["model.*"]``) must hold the same values on every rank: rank 0 alone stores them.
    A process on its own that opens a directory of step directories reads and writes
    them as a group of one.
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
        group: Any = None,
        replicated: Sequence[str] = (),
        timeout: float = 300.0,
        read_only: bool = False,
        lease_ttl: float = 60.0,
    ) -> None:
        self._storage, self.directory = resolve(directory, storage)
        self.read_only = read_only
        self._lease_ttl = lease_ttl
        self._writer: Writer = writer if writer is not None else QueueWriter(storage=self._storage)
        self._name = name
        self._pattern = _name_pattern(name)
        self._keep = keep
        self._trigger: Trigger | None = EveryNSteps(save_every) if isinstance(save_every, int) else save_every
        self._allow_pickle = allow_pickle
        self._group: Any = None
        self._timeout = timeout
        self._replicated = list(replicated)
        if _in_a_group(group):
            if "{rank}" in name:
                raise ValueError(f"name {name!r}: in a group each step is a directory; drop {{rank}}")
            from . import _coord

            self._group = None if group is None else group
            rank, size = _coord.rank_and_size(self._group)
        elif replicated:
            raise ValueError("replicated= needs a process group")
        else:
            size = 1
        self.rank = rank
        #: The number of ranks that checkpoint together; None outside a group.
        self.world_size: int | None = size if _in_a_group(group) else None
        self._size = size
        self._member: Member | None = None
        self._catalog: Catalog | None = None
        self._last: Moment | None = None
        self._pending: set[SaveHandle] = set()
        self._failures = Failures()
        self._tg: anyio.abc.TaskGroup | None = None
        self._lock: Lease | None = None
        self._renewal = anyio.CancelScope()
        self._lease_lost: LeaseLostError | None = None
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
            layout = await self._layout()
            if self.rank == 0:
                self._catalog = Catalog(
                    self._storage,
                    self.directory,
                    self._pattern,
                    self._keep,
                    scan=layout.scan,
                    remove=layout.remove,
                    writable=not self.read_only,
                )
            self._member = Member(
                self._channels,
                rank=self.rank,
                size=self._size,
                layout=layout,
                catalog=self._catalog,
                replicated=self._replicated,
                where=self.directory,
            )
            config = OpenReport(self._name, self._replicated, self._size)
            await self._member.open(config, self._prepare)
            if not self.read_only:
                await self._writer.__aenter__()
        except BaseException:
            await self._release()
            raise
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        if self._lock is not None:
            self._tg.start_soon(self._renew, self._lock)
        self._state = "open"
        return self

    async def _renew(self, lease: Lease) -> None:
        """Keep the lease of the directory (an object store's expires unless renewed)."""
        with self._renewal:
            while True:
                await anyio.sleep(self._lease_ttl / 3)
                try:
                    await _offload.run_io(lease.renew)
                except LeaseLostError as exc:
                    logger.error("%s", exc)
                    self._lease_lost = exc
                    return
                except Exception as exc:  # a transient failure: the next renewal may pass
                    logger.warning("renewing the lease of %s failed (%r)", self.directory, exc)

    async def _layout(self) -> Layout:
        """A directory per step in a group, or where a group left its checkpoints; else a
        file per step."""
        steps_are_dirs = self._group is not None or self.world_size is not None
        if not steps_are_dirs:
            steps_are_dirs = await _offload.run_io(
                has_step_dirs, self._storage, self.directory, self._pattern
            )
        if steps_are_dirs:
            if "{rank}" in self._name:
                raise ValueError(
                    f"name {self._name!r}: {self.directory} holds a directory per step; drop {{rank}}"
                )
            return StepDirectories(
                self._storage, self.directory, self._pattern, self._allow_pickle, writable=not self.read_only
            )
        return Files(self._storage, self.directory, self._pattern, self.rank, self._allow_pickle)

    async def _channels(self) -> tuple[Channel, Channel]:
        if self.world_size is None:
            return LocalChannel(), LocalChannel()
        from . import _coord

        return await _coord.channels(self._group, self._timeout)

    async def _prepare(self) -> None:
        """Lock the directory, sweep what crashed saves left, load the index (rank 0); a
        reader only loads the index."""
        assert self._catalog is not None
        if not self.read_only:
            self._lock = await self._take_lease()
            swept = await _offload.run_io(self._storage.sweep_incomplete, self.directory)
            if swept:
                logger.info("removed %d temp file(s) of crashed saves in %s", len(swept), self.directory)
        await self._catalog.load()

    async def _take_lease(self) -> Lease:
        """The directory's lease. A holder that stopped renewing its lease (it died on
        another host) holds it until it goes stale: opening waits for that, up to
        ``lease_ttl``, and gives up at once if it sees the lease renewed (a live holder)."""
        patience = time.monotonic() + self._lease_ttl + 1.0  # clocks differ a little
        stale_at: float | None = None
        while True:
            try:
                return await _offload.run_io(self._storage.lease, self.directory, self._lease_ttl)
            except DirectoryLockedError as exc:
                if exc.retry_after is None:
                    raise
                now = time.monotonic()
                renewed = stale_at is not None and now + exc.retry_after > stale_at + 0.2
                if renewed or now >= patience:
                    raise
                if stale_at is None:
                    logger.warning(
                        "%s is leased by a manager that may have died; waiting up to %.0f s for its "
                        "lease to go stale",
                        self.directory,
                        exc.retry_after,
                    )
                stale_at = now + exc.retry_after
                await anyio.sleep(min(max(exc.retry_after, 0.05), patience - now, 1.0))

    async def _release(self) -> None:
        self._state = "closed"
        if self._catalog is not None:
            self._catalog.close()
        if self._member is not None:
            await _offload.run_coord(self._member.close)
        if self._lock is not None:
            lock, self._lock = self._lock, None
            with anyio.CancelScope(shield=True):  # a network round trip on an object store
                await _offload.run_io(lock.release)

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
                if not self.read_only:
                    await self._writer.aclose()  # raises (so reports) the writer's failures
            except Exception as exc:
                writer_error = exc
            finally:
                await self._wait_pending()
                self._renewal.cancel()
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
        try:
            if not self.read_only:
                await self._writer.flush()
        finally:
            await self._wait_pending()  # a raising flush has still waited for every save
        self._raise_pending()

    def take_failures(self) -> list[SaveFailure]:
        """The failed saves (of the writer, the index, the group) not reported yet, oldest
        first; from now on they count as reported: no later call raises them."""
        writer = [] if self.read_only else self._writer.take_failures()
        return writer + self._failures.take()

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
        did not call for resolves at once, skipped. An earlier save's failure not yet
        reported is raised here, after this save was accepted.
        """
        if self._state != "open":
            raise WriterClosedError("the manager is not open: use `async with manager:`")
        if self.read_only:
            raise CheckpointError(f"{self.directory}: this manager is read-only (read_only=True)")
        if self._lease_lost is not None:
            raise self._lease_lost
        filename = self.filename(step, epoch)
        record = CheckpointRecord(
            step, filename, epoch, metrics=dict(metrics or {}), metadata=dict(metadata or {})
        )
        if not force and not await self._due(step, epoch):
            self._raise_pending()
            handle = SaveHandle(self._storage.join(self.directory, filename))
            handle._skip()
            return handle
        member, tg = self._member, self._tg
        assert member is not None
        assert tg is not None
        # The turn is taken now, in program order, as every member does for this call;
        # the vote that fills it runs in the background.
        turn = member.votes.turn(f"save step {step}")
        out_dir, file = member.layout.place(record, self.rank)
        target = state if self.rank == 0 or not self._replicated else ExternalLeaves(state, member.matches)
        outer = SaveHandle(self._storage.join(out_dir, file))
        self._pending.add(outer)
        try:
            inner: SaveHandle | BaseException = await self._accept(file, out_dir, target)
        except BaseException as exc:
            # The other members vote on this step all the same: this one votes that it failed.
            failure = (
                exc if isinstance(exc, Exception) else WriterClosedError("this rank's save was cancelled")
            )
            tg.start_soon(self._vote, turn, failure, record, outer)
            raise
        self._last = Moment(step, epoch, time.monotonic())
        tg.start_soon(self._vote, turn, inner, record, outer)
        # Earlier failures are raised only now: this call's own save is accepted, and goes on.
        self._raise_pending(accepted=outer.path)
        return outer

    async def _due(self, step: int, epoch: int | None) -> bool:
        due = self.should_save(step, epoch=epoch)
        if self._size > 1 and self._trigger is not None and not deterministic(self._trigger):
            assert self._member is not None
            due = await self._member.agree_on_trigger(due)
        return due

    async def _vote(
        self, turn: Any, inner: SaveHandle | BaseException, record: CheckpointRecord, outer: SaveHandle
    ) -> None:
        assert self._member is not None
        path = outer.path
        try:
            await self._member.vote(turn, inner, record, outer, lambda exc: self._failures.add(path, exc))
        finally:
            self._pending.discard(outer)
            if not outer.done():
                outer._fail(WriterClosedError("the manager closed before the save finished"))

    def filename(self, step: int, epoch: int | None = None) -> str:
        if epoch is None and "{epoch}" in self._name:
            raise ValueError(f"name {self._name!r} uses {{epoch}}: pass epoch=")
        return self._name.format(step=step, epoch=epoch, rank=self.rank)

    # -- reading -------------------------------------------------------------------------
    async def steps(self) -> list[int]:
        """Steps of the committed checkpoints that have not failed verification, oldest
        first. A save still being written, or one that failed, is not listed: a step
        appears once its checkpoint is durable and indexed (its handle has resolved)."""
        assert self._member is not None
        return list(await self._member.ask("steps", lambda: self._rank0().steps()))

    def _rank0(self) -> Catalog:
        assert self._catalog is not None
        return self._catalog

    async def latest_step(self) -> int | None:
        steps = await self.steps()
        return steps[-1] if steps else None

    async def history(self) -> list[CheckpointRecord]:
        """Every commit this directory has seen (up to HISTORY_LIMIT), oldest first."""
        assert self._member is not None
        raw = await self._member.ask("history", lambda: [r.to_json() for r in self._rank0().history])
        return [CheckpointRecord.from_json(r) for r in raw]

    async def restore(
        self,
        step: int | None = None,
        *,
        target: Any = None,
        keys: Sequence[str] | None = None,
        strict: bool = True,
    ) -> Restored:
        """Load the latest (or the given) step, verifying it as it is read.

        If the latest checkpoint fails verification it is logged, marked (by a manager
        that writes), and the newest valid older one is tried; CheckpointNotFoundError
        only when none is valid. With ``target``, the state is loaded into it in place;
        ``keys`` restricts what is loaded (with or without a target); with
        ``strict=False`` the target's entries are loaded and the checkpoint's others
        ignored. In a group, every rank gets the same step, and its own part of it: the
        DTensors of its target filled from the shards of any world size; state that
        differed between the ranks that saved it only at the same world size
        (StateMismatchError, on every rank, names it otherwise).
        """
        assert self._member is not None
        found, path, state = await self._member.restore(step, target, keys, strict)
        return Restored(found.step, found.epoch, path, state)

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
