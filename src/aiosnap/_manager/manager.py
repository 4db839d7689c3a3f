"""CheckpointManager: steps, triggers, retention, verified resume, history; and a remote tier.

The files are the truth. A checkpoint exists once its file has been committed (the
writer's durable atomic rename) -- in a process group, once rank 0 wrote the step's
manifest (``step_dirs``); the index next to them (latest pointer, history; ``catalog``)
is a cache that is replaced atomically after each commit and rebuilt from the
directory whenever it is missing, stale or unreadable. Retention runs after a commit,
deletes only checkpoints older than the newest one, and never the newest one, so a
crash at any point leaves at least one valid checkpoint.

The manager owns a writer, its triggers and signal handlers; its directory is a
``Site`` (lease, layout, catalog, the group's votes), and a remote tier (``Tier``) has
a Site of its own, opened and fed in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self, final

import anyio
import anyio.abc

from .._base.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    RemoteStorageError,
    WriterClosedError,
)
from .._base.names import check_step, render, template
from .._base.notice import notice
from .._base.tasks import Failures, SaveFailure, TaskGroupOwner, raise_collected, raise_first
from .._save.handle import Resolver, SaveHandle, SaveStats, skipped
from .._save.options import Incremental, check_capture, incremental_of
from .._save.writers import QueueWriter, Writer, _WriterBase
from .._storage.protocol import Storage
from .member import Attempt, Listing, restore_first
from .options import Ranks, Remote, check_writer_given, group_of, remote_of
from .records import CheckpointRecord
from .retention import RetentionPolicy
from .site import Accept, Naming, Site
from .tier import Tier
from .triggers import EveryNSteps, Moment, Trigger, deterministic
from .upload import UploadWriter

logger = logging.getLogger(__name__)

StateFn = Callable[[], "tuple[int, object] | Awaitable[tuple[int, object]]"]

#: Seconds ``flush`` and ``aclose`` wait for uploads that make no progress at all.
UPLOAD_TIMEOUT = 60.0


@final
@dataclass(frozen=True, slots=True)
class Restored:
    """What ``restore`` loaded: which step, from where, and the state."""

    step: int
    epoch: int | None
    path: str
    state: Any


def _writer_of(writer: Writer | None, storage: Storage, incremental: Incremental | None) -> Writer:
    """The manager's writer: the one given (which carries its own incremental options),
    or a QueueWriter with the manager's."""
    check_writer_given(writer, incremental)
    return QueueWriter(storage=storage, incremental=incremental) if writer is None else writer


@final
class CheckpointManager(TaskGroupOwner, anyio.abc.AsyncResource):
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

    **Process groups** (``ranks=aiosnap.Ranks(...)``). When torch.distributed is
    initialised (or a group is given; ``Ranks(False)`` opts out), every rank opens a
    manager on the same directory and calls the same methods in the same order. Each step
    is a directory (``name`` without ``{rank}``) with one file per rank and a manifest
    rank 0 writes last, once every rank's file is durable; rank 0 decides what must agree
    and tells the others over a gloo group of the manager's own. Every wait has a deadline
    (``Ranks(timeout=...)`` seconds of silence): a failed, dead or hung rank makes every
    live rank raise RankFailedError naming it. DTensors are saved as each rank's shard and
    restore at any world size; ``Ranks(replicated=["model.*"])`` entries, the same on
    every rank, are stored by rank 0 alone (docs/sharded.md).

    **Two tiers** (``remote="s3://bucket/run"`` or ``aiosnap.Remote(url, keep=...,
    upload=..., uploader=..., timeout=...)``). Saves commit to ``directory``, then each
    is uploaded in the background and committed there. The local tier never waits on the
    remote one; ``handle.upload`` is the upload's handle; ``flush()`` and ``aclose()``
    wait for uploads while they make progress; a failed upload is reported as a failed
    save is. ``latest_step()``, ``restore()`` and ``resume()`` take the newest valid
    checkpoint of either tier (docs/remote.md).

    **Capture.** Which capture a save gets: the call's ``save(capture=...)``, else the
    manager's ``capture=``, else the writer's own default (``QueueWriter(capture=
    "lazy")``), else eager.

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
        self._capture = None if capture is None else check_capture(capture)
        far = remote_of(remote)
        naming = Naming(name, template(name))
        self._group = group_of(name, ranks)
        self._site = Site(
            directory,
            storage=storage,
            naming=naming,
            keep=keep,
            group=self._group,
            read_only=read_only,
            lease_ttl=lease_ttl,
            allow_pickle=allow_pickle,
        )
        self.directory = self._site.directory
        self._tier: Tier | None = None
        if far is not None:
            site = self._site.beside(far.url, storage=far.storage, keep=far.keep)
            uploads = far.uploader if far.uploader is not None else UploadWriter(storage=far.storage)
            uploads.bind(site.storage)
            self._tier = Tier(site, uploads, local=self._site.storage, read_timeout=far.timeout)
        self._upload_mode = "every" if far is None else far.upload
        self.read_only = read_only
        self._writer: Writer = _writer_of(writer, self._site.storage, incremental_of(incremental))
        self._trigger: Trigger | None = EveryNSteps(save_every) if isinstance(save_every, int) else save_every
        #: This process's rank in the group (or as given, on its own).
        self.rank = self._group.rank
        #: The number of ranks that checkpoint together; None outside a group.
        self.world_size: int | None = self._group.world_size
        self._last: Moment | None = None
        #: Set once local retention has let go of an uploaded step (see _release_after).
        #: The local retention an upload holds back: released once it ended -> the upload.
        self._releases: dict[anyio.Event, SaveHandle] = {}
        self._failures = Failures()
        self._signals: list[int] = []
        #: Set once a signal given to ``save_on_signal`` has arrived and its save is done.
        self.preempted = anyio.Event()

    @property
    def remote(self) -> str | None:
        """The remote tier's directory, or None without one."""
        return None if self._tier is None else self._tier.directory

    # -- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        self._opening("a CheckpointManager can be opened only once")
        tg = await self._open_tasks()
        writer_open = False
        try:
            await self._site.connect()
            if getattr(self._writer, "incremental", False) and self._site.steps_are_dirs:
                self._blobs_as_rank()
            await self._site.open(tg)
            if self._tier is not None:
                await self._tier.connect(steps_are_dirs=self._site.steps_are_dirs)
                # The remote tier's copies of this rank's blobs: collected by this rank too.
                self._tier.site.member.blob_dir = self._site.member.blob_dir
            if not self.read_only:
                await self._writer.__aenter__()
                writer_open = True
            if self._tier is not None:
                await self._tier.start(tg)
        except BaseException:
            try:
                if writer_open:  # nothing was saved through it yet
                    # Not inside a shielding scope: a task group is exited in the scope
                    # it was entered in.
                    await self._writer.__aexit__(None, None, None)
            finally:
                try:
                    await self._close_tasks(cancel=True)
                finally:
                    await self._leave(remote=True)
            raise
        self._opened()
        if self._uploads_every_save() and not self.read_only:
            try:
                await self._catch_up()
            except BaseException:
                await self.aclose()
                raise
        return self

    def _blobs_as_rank(self) -> None:
        """Incremental saves into step directories: each rank keeps its blobs in a folder
        of its own, which it collects itself (see ``Member.blob_dir``)."""
        if not isinstance(self._writer, _WriterBase):
            raise ValueError("incremental saves into step directories need one of aiosnap's writers")
        rank_dir = f"rank_{self.rank:05d}"
        self._writer.keep_blobs_by_rank(rank_dir)
        self._site.member.blob_dir = rank_dir

    async def _catch_up(self) -> None:
        """Upload the newest local checkpoint if the remote tier lacks it, once it is open:
        the upload a crash cut short (or a run without a remote tier) is not lost."""
        assert self._tier is not None
        local = await self._site.steps()
        if local:  # the newest: retention never removes it meanwhile
            record = await self._site.record(local[-1])
            assert record is not None
            self._tier.catch_up(record, self._committed(record))

    def _committed(self, record: CheckpointRecord) -> SaveHandle:
        """A handle of the committed local checkpoint of ``record``, resolved."""
        out_dir, file = self._site.member.layout.place(record, self.rank)
        done = Resolver(self._site.storage.join(out_dir, file))
        done.finish(SaveStats(done.handle.path, record.bytes, 0.0, 0.0, 0.0, 0.0, 0.0))
        return done.handle

    async def _leave(self, *, remote: bool) -> None:
        """Leave the directories (``remote``: the remote tier's too, which closing it did
        not: after a failed open)."""
        self._closed()
        with anyio.CancelScope(shield=True):
            try:
                if remote and self._tier is not None:
                    await self._tier.site.close()
            finally:
                await self._site.close()

    async def aclose(self, *, upload_timeout: float | None = UPLOAD_TIMEOUT) -> None:
        """Wait for pending commits (and uploads) and the rotation they trigger; release
        the directories; raise the first failure not reported yet.

        Uploads are waited for as long as they make progress: after ``upload_timeout``
        seconds without any (None: no bound), those still pending are ended and
        reported (their checkpoints stay local, and the next open uploads the newest)."""
        if not self._closing():
            return
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.remove_signal_handler(sig)
        errors: list[Exception] = []
        left: list[str] | None = None  # uploads still pending; None: not waited for (cancelled)
        try:
            try:
                if not self.read_only:
                    await self._writer.aclose()  # raises (so reports) the writer's failures
            except Exception as exc:
                errors.append(exc)
            await self._site.wait_pending()
            if self._tier is not None:
                left = await self._tier.drain(upload_timeout)
        finally:
            # Task groups are exited the last entered first, each in the scope it was
            # entered in (never inside a shielding scope), also when this is cancelled.
            try:
                if self._tier is not None:
                    try:
                        await self._tier.close(abandon=left != [])
                    except Exception as exc:
                        errors.append(exc)
                    if left == []:
                        for released in list(self._releases):  # local retention the uploads held
                            await released.wait()
            finally:
                try:
                    if not self.read_only:
                        await self._writer.__aexit__(None, None, None)  # closed already: exits its group
                finally:
                    try:
                        # What is left runs for ever (renewals, the remote tier's attempts).
                        await self._close_tasks(cancel=True)
                    finally:
                        await self._leave(remote=False)
        raise_collected(errors, self.take_failures())

    async def flush(self, *, upload_timeout: float | None = UPLOAD_TIMEOUT) -> None:
        """Wait until every accepted save is committed, indexed and rotated, and its upload
        ended or made no progress for ``upload_timeout`` seconds (None: no bound); raise
        the first failure not reported yet (noting any others). Uploads still pending
        then go on in the background, and this raises RemoteStorageError saying so."""
        try:
            if not self.read_only:
                await self._writer.flush()
        finally:
            await self._site.wait_pending()  # a raising flush has still waited for every save
            stuck: list[str] = []
            if self._tier is not None:
                stuck = await self._tier.drain(upload_timeout)
                if not stuck:
                    for released in list(self._releases):  # the local retention the uploads held back
                        await released.wait()
        self._raise_pending()
        if stuck:
            assert self._tier is not None
            cause = self._tier.error or self._tier.uploader.unavailable
            raise RemoteStorageError(
                f"{len(stuck)} upload(s) to {self._tier.directory} made no progress for {upload_timeout:g} s "
                f"({', '.join(stuck)}); they go on in the background (the remote tier is "
                f"{'unavailable: ' + repr(cause) if cause is not None else 'slow'})"
            ) from cause

    def take_failures(self) -> list[SaveFailure]:
        """The failed saves (of the writer, the index, the group, the uploads) not reported
        yet, oldest first; from now on they count as reported: no later call raises them."""
        writer = [] if self.read_only else self._writer.take_failures()
        remote = [] if self._tier is None else self._tier.uploader.take_failures()
        return writer + self._failures.take() + remote

    def _raise_pending(self, *, accepted: str | None = None) -> None:
        raise_first(self.take_failures(), accepted=accepted)

    def _default_capture(self) -> str:
        """The manager's ``capture=``, else its writer's default, else eager."""
        if self._capture is not None:
            return self._capture
        writers = getattr(self._writer, "capture", "eager")
        return writers if writers in ("eager", "lazy") else "eager"

    def _accepting(self, capture: str) -> Accept:
        """The writer's side of a save made with ``capture``."""

        async def accept(filename: str, directory: str, state: object) -> SaveHandle:
            return await self._accept(filename, directory, state, capture)

        return accept

    async def _accept(self, filename: str, directory: str, state: object, capture: str) -> SaveHandle:
        """Hand a save to the writer through its ``accept`` (the caller awaits the capture;
        earlier failures are this manager's to report), lazily if asked and the writer
        can. A writer of the user's own may lack it: it is then called, and waits for the
        capture itself."""
        accept = getattr(self._writer, "accept", None)
        if accept is None:
            return await self._writer(filename, directory, state)
        lazy = {"capture": capture} if "capture" in inspect.signature(accept).parameters else {}
        handle: SaveHandle = await accept(filename, directory, state, **lazy)
        return handle

    def _report(self, path: str, error: BaseException) -> SaveFailure:
        return self._failures.add(path, error)

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
        overwrite: bool = False,
        capture: Literal["eager", "lazy"] | None = None,
    ) -> SaveHandle:
        """Save ``state`` as ``step`` if the triggers say so (or ``force``).

        ``step`` is a non-negative int. A step that is committed already is not replaced
        (StepExistsError, naming it) unless ``overwrite=True``; what stands at the step's
        name without being aiosnap's (a user's file, a link) never is (ForeignFileError).
        Returns once the state is captured. The handle resolves when the checkpoint is
        committed, indexed, and the retention it triggers is done; a save the triggers
        did not call for resolves at once, skipped. A cancelled call either drops the
        save whole (before its capture ended) or lets it commit, indexed and rotated as
        any other. An earlier save's failure not yet reported is raised here, after this
        save was accepted. ``capture`` overrides the manager's (a lazy save returns once
        its tree is walked: ``handle.wait_captured()`` says when its tensors are copied).
        """
        mode = check_capture(capture) if capture is not None else self._default_capture()
        if not self._is_open:
            raise WriterClosedError("the manager is not open: use `async with manager:`")
        if self.read_only:
            raise CheckpointError(f"{self.directory}: this manager is read-only (read_only=True)")
        if self._site.lease_lost is not None:
            raise self._site.lease_lost
        await self._settle_committed()
        filename = self.filename(step, epoch)
        step, epoch = check_step(step), None if epoch is None else check_step(epoch, "epoch")
        record = CheckpointRecord(
            step, filename, epoch, metrics=dict(metrics or {}), metadata=dict(metadata or {})
        )
        if not force and not await self._due(step, epoch):
            self._raise_pending()
            return skipped(self._site.storage.join(self.directory, filename))
        try:
            outer = await self._site.submit(
                self._tasks, record, state, self._accepting(mode), overwrite=overwrite, report=self._report
            )
        except BaseException:
            if self._uploads_every_save():
                # Every member hands every save to the remote tier, in the same order: one
                # whose own save was refused hands it over as failed (not uploaded).
                with anyio.CancelScope(shield=True):
                    await self._upload(record, skipped(self._site.storage.join(self.directory, filename)))
            raise
        if self._uploads_every_save():
            # Handed over whatever becomes of the capture below: the upload follows the
            # local save's own outcome, as the index does.
            with anyio.CancelScope(shield=True):
                outer.upload = await self._upload(record, outer)
        # Cancelled before the capture ended, the save is dropped whole (its handle
        # fails, nothing is written); after, it commits and is indexed and rotated.
        await outer.wait_walked()
        if getattr(self._writer, "returns_durable", False):
            await outer.wait()
        self._last = Moment(step, epoch, time.monotonic())
        # Earlier failures are raised only now: this call's own save is accepted, and goes on.
        self._raise_pending(accepted=outer.path)
        return outer

    async def _settle_committed(self) -> None:
        """What earlier saves left to the event loop and can do now (see
        ``Site.settle_committed``): their index and retention, and the retention their
        finished uploads held back. Bounded by those follow-ups' own I/O."""
        await self._site.settle_committed()
        for released, upload in list(self._releases.items()):
            if upload.done():
                await released.wait()

    def _uploads_every_save(self) -> bool:
        return self._tier is not None and self._upload_mode == "every"

    async def _upload(self, record: CheckpointRecord, local: SaveHandle) -> SaveHandle:
        """Hand the checkpoint ``local`` commits to the remote tier; until its upload ends,
        local retention keeps it."""
        assert self._tier is not None
        upload = await self._tier.upload(record, local)
        self._hold(record.step, upload)
        return upload

    def _hold(self, step: int, upload: SaveHandle) -> None:
        catalog = self._site.catalog
        if catalog is not None:
            catalog.hold(step)
            released = anyio.Event()
            self._releases[released] = upload
            self._tasks.start_soon(self._release_after, step, upload, released)

    async def _release_after(self, step: int, upload: SaveHandle, released: anyio.Event) -> None:
        try:
            await upload.outcome()
            catalog = self._site.catalog
            assert catalog is not None
            await catalog.release(step)
        except Exception as exc:  # the index or a removal failed: reported as a failed save is
            self._failures.add(self._site.storage.join(self.directory, f"<retention after step {step}>"), exc)
        finally:
            self._releases.pop(released, None)
            released.set()

    async def _due(self, step: int, epoch: int | None) -> bool:
        due = self.should_save(step, epoch=epoch)
        if self._group.size > 1 and self._trigger is not None and not deterministic(self._trigger):
            due = await self._site.member.agree_on_trigger(due)
        return due

    def filename(self, step: int, epoch: int | None = None) -> str:
        """The name ``step`` is saved under (ValueError for a step that is not a
        non-negative int, or a name that would not read back as this step)."""
        step = check_step(step)
        epoch = None if epoch is None else check_step(epoch, "epoch")
        return render(self._site.naming.name, self._site.naming.pattern, step, epoch, self.rank)

    # -- reading -------------------------------------------------------------------------
    async def steps(self) -> list[int]:
        """Steps of the committed checkpoints of the local directory that have not failed
        verification, oldest first. A save still being written, or one that failed, is
        not listed: a step appears once its checkpoint is durable and indexed (its handle
        has resolved). ``remote_steps()`` lists the remote tier's."""
        return await self._site.steps()

    async def latest_step(self) -> int | None:
        """The newest committed step of either tier (None if neither holds one): the step
        ``restore()`` tries first. With a remote tier it waits for the remote directory
        to open (a process on its own, for the first attempt: if that failed, the local
        newest is returned with a warning; with no local step, RemoteStorageError)."""
        steps = await self._site.steps()
        if self._tier is not None:
            steps = sorted(set(steps) | set(await self._remote_or_local(steps)))
        return steps[-1] if steps else None

    async def _remote_or_local(self, local: list[int]) -> list[int]:
        """The remote tier's steps; if it is unavailable, [] with a warning when ``local``
        has some to go on with, else RemoteStorageError (starting from scratch while the
        remote tier may hold checkpoints would lose them)."""
        assert self._tier is not None
        try:
            return await self._tier.read(lambda site: site.steps())
        except RemoteStorageError:
            if not local:
                raise
            notice(
                logger,
                f"the remote tier {self._tier.directory} is unavailable ({self._tier.error or 'no answer'}): "
                f"going on with the local steps (newest {local[-1]}); the remote tier may hold newer ones",
            )
            return []

    async def history(self) -> list[CheckpointRecord]:
        """Every commit this directory has seen (up to HISTORY_LIMIT), oldest first."""
        return await self._site.history()

    async def records(self) -> list[CheckpointRecord]:
        """The record of every committed checkpoint, oldest first: its epoch, time, size
        and metrics, and for one that failed verification (which ``steps()`` leaves out)
        the reason, in ``corrupt``."""
        return await self._site.records()

    async def prune(self, *, dry_run: bool = False) -> list[CheckpointRecord]:
        """Apply the retention policy (``keep``) now, as a commit does, and return the
        records of the checkpoints it removed; with ``dry_run``, of those it would remove
        (a read-only manager can tell that too). As after a commit, the newest checkpoint
        and those with an upload pending stay. Only a process on its own prunes."""
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
        """Load the latest (or the given) step, verifying it as it is read.

        If the latest checkpoint fails verification it is logged, marked (by a manager
        that writes), and the newest valid older one is tried; CheckpointNotFoundError
        only when none is valid. With a remote tier, the newest valid step of either tier
        is taken, the local copy first (see ``latest_step`` for a remote tier that is
        unavailable). With ``target``, the state is loaded into it in place; ``keys``
        restricts what is loaded (with or without a target); with ``strict=False`` the
        target's entries are loaded and the checkpoint's others ignored. In a group,
        every rank gets the same step, and its own part of it: the DTensors of its target
        filled from the shards of any world size; state that differed between the ranks
        that saved it only at the same world size (StateMismatchError, on every rank,
        names it otherwise).
        """
        step = None if step is None else check_step(step)
        if self._tier is None:
            found = await self._site.restore(step, target, keys, strict)
            return Restored(found.record.step, found.record.epoch, found.path, found.state)
        return await self._restore_from_tiers(step, target, keys, strict)

    async def resume(
        self, *, target: Any = None, keys: Sequence[str] | None = None, strict: bool = True
    ) -> Restored | None:
        """``restore()`` of the newest valid step of either tier, or None where there is
        none (a fresh start): the one call a training script needs to pick up where it
        stopped. A remote tier that may hold checkpoints but cannot be read raises
        RemoteStorageError rather than start afresh. A reader (``read_only``) returns
        None only where the directory never held a committed checkpoint: one whose index
        tells of commits but whose checkpoints are gone raises CheckpointNotFoundError."""
        if await self.latest_step() is None and not (self.read_only and await self._committed_before()):
            return None
        # Committed steps exist: if none is valid, that is no fresh start, and it raises.
        return await self.restore(target=target, keys=keys, strict=strict)

    async def _committed_before(self) -> bool:
        """Whether either tier's directory ever held a committed checkpoint (a remote tier
        that cannot be read is left to ``latest_step``, which raised already)."""
        if await self._site.committed_before():
            return True
        return self._tier is not None and await self._tier.read(lambda site: site.committed_before())

    async def _restore_from_tiers(
        self, step: int | None, target: Any, keys: Sequence[str] | None, strict: bool
    ) -> Restored:
        """The newest valid step of either tier, the local copy first: a step corrupt
        in one tier is tried in the other, then older steps are. A reader lists both
        again when what it chose went away as it read it (``restore_first``)."""
        assert self._tier is not None
        tier, near = self._tier, self._site.member
        held: set[int] = set()  # the steps either tier held, at the last listing

        async def listing() -> Listing:
            local = await self._site.listing(step)
            remote = Listing([])
            if await self._remote_or_local(sorted(r.step for _, r in local.tries)):
                remote = await tier.read(lambda site: site.listing(step))
            # Newest first; of a step both tiers hold, the local copy first.
            tries = sorted([*local.tries, *remote.tries], key=lambda t: (-t[1].step, t[0] is not near))
            held.clear()
            held.update(r.step for _, r in tries)
            return Listing(tries, [local.mark, remote.mark])

        relist = listing if self.read_only else None
        found = await restore_first(await listing(), target, keys, strict, relist=relist)
        if isinstance(found, Attempt):
            return Restored(found.record.step, found.record.epoch, found.path, found.state)
        where = f"{self.directory!r} or {tier.directory!r}"
        if step is not None and step not in held:
            missing = f"{self.directory}/<step {step}>"
            raise CheckpointNotFoundError(missing, f"step {step} is in neither {where}")
        why = found.why()
        reason = f"no valid checkpoint in {where}" + (f" ({why})" if why else "")
        raise CheckpointNotFoundError(self.directory, reason)

    async def remote_steps(self) -> list[int]:
        """The steps of the remote tier, as ``steps()`` gives the local ones ([] without
        one); RemoteStorageError while it is unavailable (a process on its own)."""
        if self._tier is None:
            return []
        return await self._tier.read(lambda site: site.steps())

    async def upload(self, step: int | None = None) -> SaveHandle:
        """Upload a committed local step (the latest by default) to the remote tier, as
        ``upload="every"`` does after each save; returns the upload's handle, which
        resolves skipped, with nothing copied, if the remote tier holds that step already.
        Every member of a group calls it, as it calls ``save``."""
        if self._tier is None:
            raise CheckpointError(f"{self.directory}: no remote tier (CheckpointManager(remote=...))")
        if self.read_only:
            raise CheckpointError(f"{self.directory}: this manager is read-only (read_only=True)")
        steps = await self._site.steps()
        chosen = step if step is not None else (steps[-1] if steps else None)
        record = None if chosen is None or chosen not in steps else await self._site.record(chosen)
        if record is None:
            raise CheckpointNotFoundError(self.directory, f"no committed local step {chosen} to upload")
        if chosen in await self.remote_steps():
            # Handed over all the same, as skipped: every member takes the same turns.
            return await self._upload(record, skipped(self._committed(record).path))
        return await self._upload(record, self._committed(record))

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
        if self._is_open:
            self._tasks.start_soon(self._save_for_signal, sig, state_fn, deadline)

    async def _save_for_signal(self, sig: int, state_fn: StateFn, deadline: float) -> None:
        name = signal.Signals(sig).name
        try:
            with anyio.fail_after(deadline) as scope:
                step, handle = await self._emergency_save(state_fn)
            logger.warning("saved step %d on signal %s", step, name)
            if handle.upload is not None:  # the node may not outlive the signal: upload it too
                with anyio.move_on_after(max(0.0, scope.deadline - anyio.current_time())):
                    await handle.upload.wait()
                    logger.warning("uploaded step %d on signal %s", step, name)
                if not handle.upload.done():
                    logger.error("step %d was not uploaded within the deadline of signal %s", step, name)
        except Exception as exc:
            logger.error("the save on signal %s failed: %r", name, exc)
            self._failures.add(f"<save on {name}>", exc)
        finally:
            self.preempted.set()

    async def _emergency_save(self, state_fn: StateFn) -> tuple[int, SaveHandle]:
        result = state_fn()
        step, state = await result if inspect.isawaitable(result) else result
        # The state of the moment goes over a save of the same step: it is newer.
        handle = await self.save(step, state, force=True, overwrite=True)
        await handle.wait()
        return step, handle

    @contextlib.asynccontextmanager
    async def save_on_error(self, state_fn: StateFn) -> AsyncIterator[None]:
        """Save ``state_fn()`` (a ``(step, state)`` pair) when the body raises, then re-raise."""
        try:
            yield
        except (Exception, KeyboardInterrupt) as exc:
            try:
                step, _ = await self._emergency_save(state_fn)
            except Exception as save_exc:
                exc.add_note(f"aiosnap: the save on error failed too: {save_exc!r}")
            else:
                exc.add_note(f"aiosnap: saved step {step} before re-raising")
            raise
