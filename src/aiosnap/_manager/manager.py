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
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self, final

import anyio
import anyio.abc

from .._base import offload as _offload
from .._base.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DirectoryLockedError,
    LeaseLostError,
    WriterClosedError,
)
from .._base.names import check_step, render, template
from .._dist.channel import Channel, LocalChannel
from .._dist.messages import OpenReport
from .._format.tree import ExternalLeaves
from .._save.handle import Failures, Resolver, SaveFailure, SaveHandle, SaveStats, raise_first, skipped
from .._save.writers import QueueWriter, Writer
from .._storage.backends import resolve
from .._storage.protocol import Lease, Storage
from .catalog import Catalog
from .layouts import Files, Layout, StepDirectories
from .member import Member
from .records import CheckpointRecord
from .retention import RetentionPolicy
from .step_dirs import has_step_dirs
from .triggers import EveryNSteps, Moment, Trigger, deterministic
from .upload import LocalCopy, UploadWriter

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


def _check_capture(capture: str) -> Literal["eager", "lazy"]:
    if capture not in ("eager", "lazy"):
        raise ValueError(f"capture must be 'eager' or 'lazy', not {capture!r}")
    return capture  # type: ignore[return-value]


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

    **Two tiers.** With ``remote="s3://bucket/run"`` (any URL or path), saves commit to
    ``directory`` as ever, and each committed checkpoint is then uploaded in the
    background to ``remote``, committed there as a save is (``keep_remote`` rotates
    it). ``handle.upload`` is the upload's own handle; ``flush()`` and ``aclose()``
    wait for uploads too, and a failed upload is reported as a failed save is. A local
    checkpoint is not rotated away while its upload is pending. ``uploader`` (an
    UploadWriter) sets the retries and how many uploads may wait (the oldest waiting
    one is dropped when more come; the newest never is). ``upload="manual"`` uploads
    only what ``upload()`` is asked to. ``restore()`` takes the newest valid
    checkpoint of either tier, the local one when both hold that step.

    ``capture="lazy"`` makes ``save`` return once the state's tree is walked, its
    tensors copied in the background while the optimizers' steps wait for them (see
    the writers' ``capture``); ``save(capture=...)`` overrides it per call. A writer
    without a ``capture`` option saves eagerly.
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
        remote: str | None = None,
        remote_storage: Storage | None = None,
        keep_remote: RetentionPolicy | None = None,
        upload: Literal["every", "manual"] = "every",
        uploader: UploadWriter | None = None,
        capture: Literal["eager", "lazy"] = "eager",
    ) -> None:
        self._storage, self.directory = resolve(directory, storage)
        self._capture = _check_capture(capture)
        if upload not in ("every", "manual"):
            raise ValueError(f"upload must be 'every' or 'manual', not {upload!r}")
        if remote is None and (remote_storage is not None or keep_remote is not None or uploader is not None):
            raise ValueError("remote_storage=, keep_remote= and uploader= need remote=")
        self._upload_mode = upload
        #: The remote tier: a manager of its own whose saves are uploads.
        self._remote: CheckpointManager | None = None
        self._uploader: UploadWriter | None = None
        if remote is not None:
            self._uploader = uploader if uploader is not None else UploadWriter(storage=remote_storage)
            self._remote = CheckpointManager(
                remote,
                writer=self._uploader,
                name=name,
                keep=keep_remote,
                storage=remote_storage,
                rank=rank,
                allow_pickle=allow_pickle,
                group=group,
                replicated=replicated,
                timeout=timeout,
                read_only=read_only,
                lease_ttl=lease_ttl,
            )
            self._uploader._use(self._remote._storage)
        #: Whether steps are directories, when another tier decided it.
        self._steps_are_dirs: bool | None = None
        self.read_only = read_only
        self._lease_ttl = lease_ttl
        self._writer: Writer = writer if writer is not None else QueueWriter(storage=self._storage)
        self._name = name
        self._pattern = template(name)
        self._keep = keep
        self._trigger: Trigger | None = EveryNSteps(save_every) if isinstance(save_every, int) else save_every
        self._allow_pickle = allow_pickle
        self._group: Any = None
        self._timeout = timeout
        self._replicated = list(replicated)
        if _in_a_group(group):
            if "{rank}" in name:
                raise ValueError(f"name {name!r}: in a group each step is a directory; drop {{rank}}")
            from .._dist import coord as _coord

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
        #: Set once local retention has let go of an uploaded step (see _release_after).
        self._releases: set[anyio.Event] = set()
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
        writer_open = False
        try:
            layout = await self._layout()
            if self.rank == 0:
                self._catalog = Catalog(
                    self._storage,
                    self.directory,
                    self._pattern,
                    self._keep,
                    steps=layout,
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
                writer_open = True
            if self._remote is not None:
                self._remote._steps_are_dirs = layout.manifests
                await self._remote.__aenter__()
        except BaseException:
            try:
                if writer_open:  # nothing was saved through it yet
                    # Not inside a shielding scope: a task group is exited in the scope
                    # it was entered in.
                    await self._writer.__aexit__(None, None, None)
            finally:
                with anyio.CancelScope(shield=True):
                    await self._release()
            raise
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        if self._lock is not None:
            self._tg.start_soon(self._renew, self._lock)
        self._state = "open"
        if self._uploads_every_save() and not self.read_only:
            try:
                await self._catch_up()
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.aclose()
                raise
        return self

    async def _catch_up(self) -> None:
        """Upload the newest local checkpoint if the remote tier lacks it: the upload of
        a run that crashed (or ran without a remote tier) is not lost."""
        assert self._remote is not None
        local = await self.steps()
        if local and local[-1] not in await self._remote.steps():
            logger.info("uploading step %d, which %s lacks", local[-1], self._remote.directory)
            await self.upload(local[-1])

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
        if self._steps_are_dirs is not None:
            steps_are_dirs = self._steps_are_dirs
        if not steps_are_dirs:
            steps_are_dirs = await _offload.run_io(
                has_step_dirs, self._storage, self.directory, self._pattern
            )
        if not steps_are_dirs and self._remote is not None:  # a group's run, resumed from its remote tier
            far = self._remote
            steps_are_dirs = await _offload.run_io(has_step_dirs, far._storage, far.directory, self._pattern)
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
        from .._dist import coord as _coord

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
        if self._remote is not None and self._remote._state != "closed":
            await self._remote._release()
        if self._catalog is not None:
            self._catalog.close()
        if self._member is not None:
            await _offload.run_coord(self._member.close)
        if self._lock is not None:
            lock, self._lock = self._lock, None
            with anyio.CancelScope(shield=True):  # a network round trip on an object store
                await _offload.run_io(lock.release)

    async def aclose(self) -> None:
        """Wait for pending commits (and uploads) and the rotation they trigger; release
        the directory."""
        if self._state != "open":
            return
        self._state = "closing"
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.remove_signal_handler(sig)
        errors: list[Exception] = []
        try:
            try:
                await self._drain(errors)
            finally:
                await self._exit_task_groups()
        finally:
            await self._release()
        if errors:
            first = errors[0]
            for other in errors[1:]:
                first.add_note(f"aiosnap: closing failed in another way too: {other!r}")
            for failure in self.take_failures():
                first.add_note(f"aiosnap: the save of {failure.path} failed too: {failure.error!r}")
            raise first
        self._raise_pending()

    async def _drain(self, errors: list[Exception]) -> None:
        """Let every accepted save (and upload) end; the writers' failures go to ``errors``."""
        try:
            if not self.read_only:
                await self._writer.aclose()  # raises (so reports) the writer's failures
        except Exception as exc:
            errors.append(exc)
        finally:
            await self._wait_pending()
            if self._remote is not None and self._remote._state == "open":
                self._remote._state = "closing"
                await self._remote._drain(errors)

    async def _exit_task_groups(self) -> None:
        """Exit the task groups this manager entered, the last entered first: its own,
        the remote tier's, its writer's."""
        self._renewal.cancel()
        assert self._tg is not None
        await self._tg.__aexit__(None, None, None)
        if self._remote is not None and self._remote._tg is not None:
            await self._remote._exit_task_groups()
        if not self.read_only:
            await self._writer.__aexit__(None, None, None)  # closed already: exits its task group

    async def flush(self) -> None:
        """Wait until every accepted save is committed, indexed and rotated; raise the
        first failure not reported yet (noting any others)."""
        try:
            if not self.read_only:
                await self._writer.flush()
        finally:
            await self._wait_pending()  # a raising flush has still waited for every save
            await self._wait_uploads()
        self._raise_pending()

    async def _wait_uploads(self) -> None:
        """Wait until every upload handed to the remote tier so far has ended."""
        if self._remote is not None and self._uploader is not None:
            await self._uploader._wait()
            await self._remote._wait_pending()
        for released in list(self._releases):  # and the local retention the uploads held back
            await released.wait()

    def take_failures(self) -> list[SaveFailure]:
        """The failed saves (of the writer, the index, the group) not reported yet, oldest
        first; from now on they count as reported: no later call raises them."""
        writer = [] if self.read_only else self._writer.take_failures()
        remote = [] if self._remote is None else self._remote.take_failures()
        return writer + self._failures.take() + remote

    async def _wait_pending(self) -> None:
        for handle in list(self._pending):
            await handle.outcome()

    def _raise_pending(self, *, accepted: str | None = None) -> None:
        raise_first(self.take_failures(), accepted=accepted)

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
        did not call for resolves at once, skipped. An earlier save's failure not yet
        reported is raised here, after this save was accepted. ``capture`` overrides the
        manager's (a lazy save returns once its tree is walked: ``handle.wait_captured()``
        says when its tensors are copied).
        """
        mode = self._capture if capture is None else _check_capture(capture)
        if self._state != "open":
            raise WriterClosedError("the manager is not open: use `async with manager:`")
        if self.read_only:
            raise CheckpointError(f"{self.directory}: this manager is read-only (read_only=True)")
        if self._lease_lost is not None:
            raise self._lease_lost
        filename = self.filename(step, epoch)
        step, epoch = check_step(step), None if epoch is None else check_step(epoch, "epoch")
        record = CheckpointRecord(
            step, filename, epoch, metrics=dict(metrics or {}), metadata=dict(metadata or {})
        )
        if not force and not await self._due(step, epoch):
            self._raise_pending()
            return skipped(self._storage.join(self.directory, filename))
        try:
            outer = await self._submit(record, state, overwrite=overwrite, capture=mode)
        except BaseException:
            if self._uploads_every_save():
                # Every member hands every save to the remote tier, in the same order: one
                # whose own save was refused hands it over as failed (not uploaded).
                refused = skipped(self._storage.join(self.directory, filename))
                with anyio.CancelScope(shield=True):
                    await self._upload_after(record, refused)
            raise
        if self._uploads_every_save():
            # Handed over whatever becomes of the capture below: the upload follows the
            # local save's own outcome, as the index does.
            with anyio.CancelScope(shield=True):
                outer.upload = await self._upload_after(record, outer)
        # Cancelled before the capture ended, the save is dropped whole (its handle
        # fails, nothing is written); after, it commits and is indexed and rotated.
        await outer.wait_walked()
        if getattr(self._writer, "returns_durable", False):
            await outer.wait()
        self._last = Moment(step, epoch, time.monotonic())
        # Earlier failures are raised only now: this call's own save is accepted, and goes on.
        self._raise_pending(accepted=outer.path)
        return outer

    async def _submit(
        self,
        record: CheckpointRecord,
        state: object,
        *,
        overwrite: bool,
        check: bool = True,
        capture: str = "eager",
    ) -> SaveHandle:
        """Take this save's turn, hand it to the writer, and vote on it in the background;
        the returned handle follows the writer's, its capture included. ``check``: look
        first at what stands at the step's name (``Layout.check_vacant``)."""
        member, tg = self._member, self._tg
        assert member is not None
        assert tg is not None
        # The turn is taken now, in program order, as every member does for this call;
        # the vote that fills it runs in the background.
        turn = member.votes.turn(f"save step {record.step}")
        out_dir, file = member.layout.place(record, self.rank)
        target = state if self.rank == 0 or not self._replicated else ExternalLeaves(state, member.matches)
        path = self._storage.join(out_dir, file)
        try:
            if check:
                committed = self._catalog is not None and record.step in self._catalog.records
                await member.layout.check_vacant(record, committed, overwrite)
            inner = await self._accept(file, out_dir, target, capture)
        except BaseException as exc:
            # The other members vote on this step all the same: this one votes that it failed.
            failure = (
                exc if isinstance(exc, Exception) else WriterClosedError("this rank's save was cancelled")
            )
            refused = Resolver(path)
            self._pending.add(refused.handle)
            tg.start_soon(self._vote, turn, failure, record, refused)
            raise
        outer = Resolver(path, following=inner)  # its caller waits for the writer's capture
        self._pending.add(outer.handle)
        tg.start_soon(self._vote, turn, inner, record, outer)
        return outer.handle

    def _uploads_every_save(self) -> bool:
        return self._remote is not None and self._upload_mode == "every"

    async def _upload_after(self, record: CheckpointRecord, local: SaveHandle) -> SaveHandle:
        """Hand the checkpoint ``local`` commits to the remote tier; it is uploaded once
        committed. Until its upload ends, local retention keeps it."""
        assert self._remote is not None
        assert self._tg is not None
        if self._remote._lease_lost is not None:
            # Another manager took the remote directory: upload nothing more to it (its
            # turn is still taken, and voted down).
            self._failures.add(self._remote.directory, self._remote._lease_lost)
            local = skipped(local.path)
        # An upload replaces the remote copy of its step, as the local save did: both are
        # aiosnap's own (what is not, it still refuses).
        upload = await self._remote._submit(
            record, LocalCopy(self._storage, local), overwrite=True, check=False
        )
        if self._catalog is not None:
            self._catalog.hold(record.step)
            released = anyio.Event()
            self._releases.add(released)
            self._tg.start_soon(self._release_after, record.step, upload, released)
        return upload

    async def _release_after(self, step: int, upload: SaveHandle, released: anyio.Event) -> None:
        try:
            await upload.outcome()
            assert self._catalog is not None
            await self._catalog.release(step)
        except Exception as exc:  # the index or a removal failed: reported as a failed save is
            self._failures.add(self._storage.join(self.directory, f"<retention after step {step}>"), exc)
        finally:
            self._releases.discard(released)
            released.set()

    async def _due(self, step: int, epoch: int | None) -> bool:
        due = self.should_save(step, epoch=epoch)
        if self._size > 1 and self._trigger is not None and not deterministic(self._trigger):
            assert self._member is not None
            due = await self._member.agree_on_trigger(due)
        return due

    async def _vote(
        self, turn: Any, inner: SaveHandle | BaseException, record: CheckpointRecord, outer: Resolver
    ) -> None:
        assert self._member is not None
        path = outer.handle.path
        try:
            await self._member.vote(turn, inner, record, outer, lambda exc: self._failures.add(path, exc))
        finally:
            self._pending.discard(outer.handle)
            if not outer.handle.done():
                outer.fail(WriterClosedError("the manager closed before the save finished"))

    def filename(self, step: int, epoch: int | None = None) -> str:
        """The name ``step`` is saved under (ValueError for a step that is not a
        non-negative int, or a name that would not read back as this step)."""
        step = check_step(step)
        epoch = None if epoch is None else check_step(epoch, "epoch")
        return render(self._name, self._pattern, step, epoch, self.rank)

    # -- reading -------------------------------------------------------------------------
    async def steps(self) -> list[int]:
        """Steps of the committed checkpoints that have not failed verification, oldest
        first. A save still being written, or one that failed, is not listed: a step
        appears once its checkpoint is durable and indexed (its handle has resolved)."""
        assert self._member is not None
        await self._refresh()
        return list(await self._member.ask("steps", lambda: self._rank0().steps()))

    async def _refresh(self) -> None:
        """A reader's view is never older than its last call: training beside it commits
        and rotates, so a read-only manager reads the directory again at each call."""
        if self.read_only and self._catalog is not None:
            await self._catalog.load()

    def _rank0(self) -> Catalog:
        assert self._catalog is not None
        return self._catalog

    async def latest_step(self) -> int | None:
        steps = await self.steps()
        return steps[-1] if steps else None

    async def history(self) -> list[CheckpointRecord]:
        """Every commit this directory has seen (up to HISTORY_LIMIT), oldest first."""
        assert self._member is not None
        await self._refresh()
        raw = await self._member.ask("history", lambda: [r.to_json() for r in self._rank0().history])
        return [CheckpointRecord.from_json(r) for r in raw]

    async def records(self) -> list[CheckpointRecord]:
        """The record of every committed checkpoint, oldest first: its epoch, time, size
        and metrics, and for one that failed verification (which ``steps()`` leaves out)
        the reason, in ``corrupt``."""
        assert self._member is not None
        await self._refresh()
        raw = await self._member.ask(
            "records", lambda: [r.to_json() for _, r in sorted(self._rank0().records.items())]
        )
        return [CheckpointRecord.from_json(r) for r in raw]

    async def prune(self, *, dry_run: bool = False) -> list[CheckpointRecord]:
        """Apply the retention policy (``keep``) now, as a commit does, and return the
        records of the checkpoints it removed; with ``dry_run``, of those it would remove
        (a read-only manager can tell that too). As after a commit, the newest checkpoint
        and those with an upload pending stay. Only a process on its own prunes."""
        if self._state != "open":
            raise WriterClosedError("the manager is not open: use `async with manager:`")
        if self.read_only and not dry_run:
            raise CheckpointError(f"{self.directory}: this manager is read-only (read_only=True)")
        if self.world_size is not None:
            raise CheckpointError(f"{self.directory}: prune() runs in a process on its own, not in a group")
        return await self._rank0().apply_retention(dry_run=dry_run)

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
        step = None if step is None else check_step(step)
        if self._remote is not None:
            return await self._restore_from_tiers(step, target, keys, strict)
        await self._refresh()
        found, path, state = await self._member.restore(step, target, keys, strict)
        return Restored(found.step, found.epoch, path, state)

    async def _restore_from_tiers(
        self, step: int | None, target: Any, keys: Sequence[str] | None, strict: bool
    ) -> Restored:
        """The newest valid step of either tier, the local copy first: a step corrupt
        in one tier is tried in the other, then older steps are."""
        assert self._member is not None
        assert self._remote is not None
        assert self._remote._member is not None
        local, remote = set(await self.steps()), set(await self._remote.steps())
        wanted = [step] if step is not None else sorted(local | remote, reverse=True)
        failures: list[str] = []
        for candidate in wanted:
            for member, holds in ((self._member, local), (self._remote._member, remote)):
                if candidate not in holds:
                    continue
                try:
                    found, path, state = await member.restore(candidate, target, keys, strict)
                except CorruptCheckpointError as exc:  # logged and marked by the tier's member
                    failures.append(str(exc))
                    continue
                return Restored(found.step, found.epoch, path, state)
        where = f"{self.directory!r} or {self._remote.directory!r}"
        if step is not None and step not in local | remote:
            missing = f"{self.directory}/<step {step}>"
            raise CheckpointNotFoundError(missing, f"step {step} is in neither {where}")
        reason = f"no valid checkpoint in {where}" + (f" ({'; '.join(failures)})" if failures else "")
        raise CheckpointNotFoundError(self.directory, reason)

    async def remote_steps(self) -> list[int]:
        """The steps of the remote tier, as ``steps()`` gives the local ones ([] without one)."""
        return [] if self._remote is None else await self._remote.steps()

    async def upload(self, step: int | None = None) -> SaveHandle:
        """Upload a committed local step (the latest by default) to the remote tier, as
        ``upload="every"`` does after each save; returns the upload's handle, which
        resolves skipped, with nothing copied, if the remote tier holds that step already. Every member of a
        group calls it, as it calls ``save``."""
        if self._remote is None:
            raise CheckpointError(f"{self.directory}: no remote tier (CheckpointManager(remote=...))")
        if self.read_only:
            raise CheckpointError(f"{self.directory}: this manager is read-only (read_only=True)")
        assert self._member is not None
        steps = await self.steps()
        chosen = step if step is not None else (steps[-1] if steps else None)
        if chosen is None or chosen not in steps:
            raise CheckpointNotFoundError(self.directory, f"no committed local step {chosen} to upload")
        raw = await self._member.ask("record", lambda: self._rank0().records[chosen].to_json())
        record = CheckpointRecord.from_json(raw)
        out_dir, file = self._member.layout.place(record, self.rank)
        local = Resolver(self._storage.join(out_dir, file))
        if chosen in await self._remote.steps():
            local.skip()  # handed over all the same: every member takes the same turns
        else:
            local.finish(SaveStats(local.handle.path, record.bytes or 0, 0.0, 0.0, 0.0, 0.0, 0.0))
        return await self._upload_after(record, local.handle)

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
