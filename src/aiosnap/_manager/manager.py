"""CheckpointManager: steps, triggers, retention, verified resume, history; and a remote tier.

The files are the truth. A checkpoint exists once its file has been committed (the
writer's durable atomic rename) -- in a process group, once rank 0 wrote the step's
manifest (``step_dirs``); the index next to them (latest pointer, history; ``catalog``)
is a cache that is replaced atomically after each commit and rebuilt from the
directory whenever it is missing, stale or unreadable. Retention runs after a commit,
deletes only checkpoints older than the newest one, and never the newest one, so a
crash at any point leaves at least one valid checkpoint.

The manager is a facade: its directory is a ``Site`` (lease, layout, catalog, the
group's votes); where its checkpoints live, ``Tiers`` (the local directory alone, or with
a remote tier: uploads, catch-up, reads across both); its writer is reached through one
``WriterPort``; saves on a signal or an error are ``Preemption``'s. Each takes what it
needs when the manager is made.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal, Self, final

import anyio
import anyio.abc

from .._base.errors import CheckpointError, WriterClosedError
from .._base.names import check_step, render, template
from .._base.tasks import Failures, SaveFailure, TaskGroupOwner, raise_collected, raise_first
from .._save.handle import SaveHandle, skipped
from .._save.options import CaptureMode, Incremental, check_capture, incremental_of
from .._save.writers import Writer
from .._storage.protocol import Storage
from .ballots import Accept
from .options import Ranks, Remote, group_of, remote_of
from .parts import Parts
from .port import WriterPort
from .preempt import Preemption, StateFn
from .records import CheckpointRecord
from .retention import RetentionPolicy
from .schedule import Schedule
from .site import Naming, Site
from .tier import Tier
from .tiers import Restored, Tiers, TwoTiers
from .triggers import Trigger
from .upload import UploadWriter

#: Seconds ``flush`` and ``aclose`` wait for uploads that make no progress at all.
UPLOAD_TIMEOUT = 60.0


def _tiers_of(site: Site, remote: Remote | None) -> Tiers:
    """The local directory alone, or with the remote tier ``remote`` describes."""
    if remote is None:
        return Tiers(site)
    far = site.beside(remote.url, storage=remote.storage, keep=remote.keep)
    uploads = remote.uploader if remote.uploader is not None else UploadWriter(storage=remote.storage)
    uploads.bind(far.storage)
    tier = Tier(far, uploads, local=site.storage, read_timeout=remote.timeout)
    return TwoTiers(site, tier, every_save=remote.upload == "every")


@final
class CheckpointManager(TaskGroupOwner, anyio.abc.AsyncResource):
    """Owns a checkpoint directory: saves through a writer, keeps an index, rotates, restores.

    One manager per directory (a second gets DirectoryLockedError, through a lock the
    OS drops when its holder dies); ``read_only=True`` takes no lock and writes nothing,
    so evaluation and tooling list and restore while training holds the directory. In a
    process group (``ranks=``) every rank opens one on the same directory and calls the
    same methods in the same order: each step is a directory of one file per rank and a
    manifest rank 0 writes last; a failed, dead or hung rank makes every live rank raise
    RankFailedError (docs/sharded.md). With a remote tier (``remote=``), saves commit
    locally, then upload in the background; reads take the newest valid step of either
    tier (docs/remote.md). A save's capture: the call's ``capture=``, else the
    manager's, else the writer's default, else eager.

    Args:
        directory: the checkpoint directory: a local path, or a URL.
        writer: the writer saves go through (unopened); a QueueWriter by default.
        name: the name template of a step's checkpoint (``{step}``, ``{epoch}``, ``{rank}``).
        keep: the retention policy of the directory; None keeps everything.
        save_every: a save each N steps, or a Trigger; None saves at every call.
        storage: the storage of ``directory`` (by default, what the path or URL names).
        allow_pickle: store values that are not state types pickled, and read them back.
        ranks: how this process checkpoints with others (``aiosnap.Ranks``: the group,
            this process's rank without one, replicated globs, the deadline).
        read_only: list and restore only; take no lock, write nothing.
        lease_ttl: seconds a holder that stopped renewing keeps an object store's lease.
        remote: the remote tier: a URL or path, or an ``aiosnap.Remote`` with its options.
        capture: ``"eager"`` (a save returns once its state is copied) or ``"lazy"`` (once
            its tree is walked); None takes the writer's default.
        incremental: ``True`` or an ``aiosnap.Incremental``: entries of 64 KiB or more
            stored once, as blobs shared by the directory's checkpoints (docs/manager.md).
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
        allow_pickle: bool = False,
        ranks: Ranks | None = None,
        read_only: bool = False,
        lease_ttl: float = 60.0,
        remote: str | Remote | None = None,
        capture: Literal["eager", "lazy"] | None = None,
        incremental: bool | Incremental | None = None,
    ) -> None:
        manager_capture = None if capture is None else check_capture(capture)
        far = remote_of(remote)
        self._group = group_of(name, ranks)
        self._site = Site(
            directory,
            storage=storage,
            naming=Naming(name, template(name)),
            keep=keep,
            group=self._group,
            read_only=read_only,
            lease_ttl=lease_ttl,
            allow_pickle=allow_pickle,
        )
        self.directory = self._site.directory
        self.read_only = read_only
        self._tiers = _tiers_of(self._site, far)
        self._writer = WriterPort(
            writer,
            storage=self._site.storage,
            incremental=incremental_of(incremental),
            capture=manager_capture,
            read_only=read_only,
        )
        self._schedule = Schedule(save_every, self._site)
        #: This process's rank in the group (or as given, on its own).
        self.rank = self._group.rank
        #: The number of ranks that checkpoint together; None outside a group.
        self.world_size: int | None = self._group.world_size
        self._failures = Failures()
        self._preemption = Preemption(self._save_now, self._failures)
        self._parts = Parts(self._site, self._tiers, self._writer)
        #: Set once a signal given to ``save_on_signal`` has arrived and its save is done.
        self.preempted = self._preemption.preempted

    @property
    def remote(self) -> str | None:
        """The remote tier's directory, or None without one."""
        return self._tiers.remote

    # -- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        self._opening("a CheckpointManager can be opened only once")
        tg = await self._open_tasks()
        try:
            await self._parts.open(tg, self._failures)
        except BaseException:
            try:
                await self._close_tasks(cancel=True)
            finally:
                self._closed()
                await self._parts.leave(remote=True)
            raise
        self._opened()
        self._preemption.start(tg)
        try:
            await self._tiers.catch_up()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def aclose(self, *, upload_timeout: float | None = UPLOAD_TIMEOUT) -> None:
        """Wait for pending commits, uploads and the rotation they trigger (uploads: while
        they make progress, up to ``upload_timeout`` s without any; None: no bound); release
        the directories; raise the first failure not reported yet."""
        if not self._closing():
            return
        self._preemption.stop()
        errors: list[Exception] = []
        left: list[str] | None = None  # uploads still pending; None: not waited for (cancelled)
        try:
            left = await self._parts.drain(upload_timeout, errors)
        finally:
            try:
                await self._parts.close(left, errors)
            finally:
                try:
                    # What is left runs for ever (renewals, the remote tier's attempts).
                    await self._close_tasks(cancel=True)
                finally:
                    self._closed()
                    await self._parts.leave(remote=False)
        raise_collected(errors, self.take_failures())

    async def flush(self, *, upload_timeout: float | None = UPLOAD_TIMEOUT) -> None:
        """Wait until every accepted save is committed, indexed and rotated, and its upload
        ended or stalled ``upload_timeout`` s (RemoteStorageError then; they go on);
        raise the first failure not reported yet."""
        try:
            await self._writer.flush()
        finally:
            await self._site.wait_pending()  # a raising flush has still waited for every save
            stuck = await self._tiers.drain(upload_timeout)
        self._raise_pending()
        if stuck:
            raise self._tiers.stuck(stuck, upload_timeout)

    def take_failures(self) -> list[SaveFailure]:
        """The failed saves (of the writer, the index, the group, the uploads) not reported
        yet, oldest first; from now on they count as reported: no later call raises them."""
        return self._writer.take_failures() + self._failures.take() + self._tiers.take_failures()

    def _raise_pending(self, *, accepted: str | None = None) -> None:
        raise_first(self.take_failures(), accepted=accepted)

    def _accepting(self, capture: CaptureMode) -> Accept:
        """The writer's side of a save made with ``capture``."""

        async def accept(filename: str, directory: str, state: object) -> SaveHandle:
            return await self._writer.accept(filename, directory, state, capture)

        return accept

    def _report(self, path: str, error: BaseException) -> SaveFailure:
        return self._failures.add(path, error)

    # -- saving --------------------------------------------------------------------------
    def should_save(self, step: int, *, epoch: int | None = None) -> bool:
        """Whether the triggers call for a save now (always, with no trigger). In a
        group, this is this rank's view; ``save`` follows rank 0's for clock triggers."""
        return self._schedule.should_save(step, epoch)

    async def save(
        self,
        step: int,
        state: object,
        *,
        epoch: int | None = None,
        metrics: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        force: bool = False,
        overwrite: bool = False,
        capture: Literal["eager", "lazy"] | None = None,
    ) -> SaveHandle:
        """Save ``state`` as ``step`` if the triggers say so (or ``force``); return once it
        is captured (a lazy ``capture``: once its tree is walked). The handle resolves once
        the checkpoint is committed, indexed and rotated. A committed step is replaced only
        with ``overwrite=True`` (else StepExistsError); what aiosnap did not write, never
        (ForeignFileError). A cancelled call drops the save whole before its capture ended,
        else lets it commit. An earlier failure is raised here, this save accepted."""
        mode = check_capture(capture) if capture is not None else self._writer.capture
        self._check_writable()
        await self._settle_committed()
        filename = self.filename(step, epoch)
        step, epoch = check_step(step), None if epoch is None else check_step(epoch, "epoch")
        record = CheckpointRecord(
            step, filename, epoch, metrics=dict(metrics or {}), metadata=dict(metadata or {})
        )
        if not force and not await self._schedule.due(step, epoch):
            self._raise_pending()
            return skipped(self._site.path(filename))
        try:
            outer = await self._site.submit(
                self._tasks, record, state, self._accepting(mode), overwrite=overwrite, report=self._report
            )
        except BaseException:
            # Every member hands every save to the remote tier, in the same order: one
            # whose own save was refused hands it over as failed (not uploaded).
            await self._tiers.hand_over(record, skipped(self._site.path(filename)))
            raise
        # Handed over whatever becomes of the capture below: the upload follows the
        # local save's own outcome, as the index does.
        outer.upload = await self._tiers.hand_over(record, outer)
        # Cancelled before the capture ended, the save is dropped whole (its handle
        # fails, nothing is written); after, it commits and is indexed and rotated.
        await outer.wait_walked()
        if self._writer.returns_durable:
            await outer.wait()
        self._schedule.saved(step, epoch)
        # Earlier failures are raised only now: this call's own save is accepted, and goes on.
        self._raise_pending(accepted=outer.path)
        return outer

    def _check_writable(self) -> None:
        if not self._is_open:
            raise WriterClosedError("the manager is not open: use `async with manager:`")
        if self.read_only:
            raise CheckpointError(f"{self.directory}: this manager is read-only (read_only=True)")
        if self._site.lease_lost is not None:
            raise self._site.lease_lost

    async def _save_now(self, step: int, state: object) -> SaveHandle:
        # The state of the moment goes over a save of the same step: it is newer.
        return await self.save(step, state, force=True, overwrite=True)

    async def _settle_committed(self) -> None:
        """What earlier saves left to the event loop and can do now (see
        ``Site.settle_committed``): their index and retention, and the retention their
        finished uploads held back. Bounded by those follow-ups' own I/O."""
        await self._site.settle_committed()
        await self._tiers.settled()

    def filename(self, step: int, epoch: int | None = None) -> str:
        """The name ``step`` is saved under (ValueError for a step that is not a
        non-negative int, or a name that would not read back as this step)."""
        step = check_step(step)
        epoch = None if epoch is None else check_step(epoch, "epoch")
        naming = self._site.naming
        return render(naming.name, naming.pattern, step, epoch, self.rank)

    # -- reading -------------------------------------------------------------------------
    async def steps(self) -> list[int]:
        """The local directory's committed, valid steps, oldest first: a step is listed once
        its handle resolved (``remote_steps()``: the remote tier's)."""
        return await self._site.steps()

    async def latest_step(self) -> int | None:
        """The newest committed step of either tier, or None: what ``restore()`` tries first
        (a remote tier unavailable: the local newest with a warning, else RemoteStorageError)."""
        return await self._tiers.latest_step()

    async def history(self) -> list[CheckpointRecord]:
        """Every commit this directory has seen (up to HISTORY_LIMIT), oldest first."""
        return await self._site.history()

    async def records(self) -> list[CheckpointRecord]:
        """Every committed checkpoint's record, oldest first (``corrupt``: why one is not listed)."""
        return await self._site.records()

    async def prune(self, *, dry_run: bool = False) -> list[CheckpointRecord]:
        """Apply retention (``keep``) now, as a commit does; the records it removed (with
        ``dry_run``, would remove). The newest and those uploading stay; no group prunes."""
        if not self._is_open:
            raise WriterClosedError("the manager is not open: use `async with manager:`")
        return await self._site.prune(dry_run=dry_run)

    async def restore(
        self,
        step: int | None = None,
        *,
        target: Any = None,
        keys: Sequence[str] | None = None,
        strict: bool = True,
    ) -> Restored:
        """Load the latest (or the given) step, verified as it is read: a corrupt newest
        one is marked and the newest valid older one taken (CheckpointNotFoundError when
        none is). With a remote tier, the newest valid step of either tier, the local copy
        first. ``target``: load in place; ``keys``: only those; ``strict=False``: the
        target's entries only. In a group every rank gets the same step, its DTensors
        resharded from any world size (docs/sharded.md)."""
        step = None if step is None else check_step(step)
        return await self._tiers.restore(step, target, keys, strict)

    async def resume(
        self, *, target: Any = None, keys: Sequence[str] | None = None, strict: bool = True
    ) -> Restored | None:
        """``restore()`` of the newest valid step of either tier, or None on a fresh start
        (RemoteStorageError where a remote tier that may hold checkpoints cannot be read; a
        reader of a directory whose checkpoints are gone: CheckpointNotFoundError)."""
        if await self.latest_step() is None and not (self.read_only and await self._tiers.committed_before()):
            return None
        # Committed steps exist: if none is valid, that is no fresh start, and it raises.
        return await self.restore(target=target, keys=keys, strict=strict)

    async def remote_steps(self) -> list[int]:
        """The steps of the remote tier, as ``steps()`` gives the local ones ([] without
        one); RemoteStorageError while it is unavailable (a process on its own)."""
        return await self._tiers.remote_steps()

    async def upload(self, step: int | None = None) -> SaveHandle:
        """Upload a committed local step (the latest by default) to the remote tier; its
        handle (skipped where the remote holds it already). Every member of a group calls it."""
        return await self._tiers.upload(step)

    # -- saving when things go wrong -----------------------------------------------------
    def save_on_signal(
        self, state_fn: StateFn, *, signals: Sequence[int] = (signal.SIGTERM,), deadline: float = 60.0
    ) -> None:
        """On any of ``signals``, save ``state_fn()`` (a ``(step, state)`` pair) and flush it
        within ``deadline`` seconds, then set ``manager.preempted``. Training code should
        watch ``preempted`` and stop. Handlers are removed at ``aclose``."""
        self._preemption.on_signal(state_fn, signals, deadline)

    def save_on_error(self, state_fn: StateFn) -> AbstractAsyncContextManager[None]:
        """Save ``state_fn()`` (a ``(step, state)`` pair) when the body raises, then re-raise."""
        return self._preemption.on_error(state_fn)
