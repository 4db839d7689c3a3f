"""A Site: one checkpoint directory, as one member of a group (or a process on its own) uses it.

A CheckpointManager has one for its directory, and its remote tier another for the
remote one: the same code takes the directory's lease, decides its layout (a file per
step, or a directory per step), loads its catalog (rank 0), joins the group's
channels, hands saves to a writer and votes on them, lists, restores and prunes. What
makes a manager more than its site (a writer it owns, triggers, signals, the tier) is
the manager's business.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, final

import anyio
import anyio.abc

from .._base import offload as _offload
from .._base.errors import (
    CheckpointError,
    DirectoryLockedError,
    ForeignFileError,
    LeaseLostError,
    SaveCancelledError,
    WriterClosedError,
)
from .._base.tasks import Failures
from .._dist.channel import Channel, LocalChannel
from .._dist.messages import OpenReport
from .._format.tree import ExternalLeaves
from .._save.handle import Resolver, SaveHandle
from .._storage.backends import resolve
from .._storage.local import LocalStorage
from .._storage.protocol import Lease, Storage, describe
from .blobs import sweep as sweep_blobs
from .catalog import Catalog
from .layouts import Files, Layout, StepDirectories
from .member import Attempt, Listing, Member, restore_first
from .records import CheckpointRecord
from .retention import RetentionPolicy
from .step_dirs import has_step_dirs

logger = logging.getLogger(__name__)

#: Seconds a lease's release may take on a store that does not answer.
RELEASE_BOUND = 5.0

#: A writer's side of a save: (file name, directory, state) -> the writer's handle.
Accept = Callable[[str, str, object], Awaitable[SaveHandle]]


@final
@dataclass(frozen=True, slots=True)
class Naming:
    """How the checkpoints of a directory are named: the template and its pattern."""

    name: str
    pattern: re.Pattern[str]


@final
@dataclass(frozen=True, slots=True)
class Group:
    """How this process checkpoints with others: ``parent`` is the torch.distributed group
    (None for the default one); ``world_size`` is None for a process on its own."""

    parent: Any
    rank: int
    size: int
    world_size: int | None
    replicated: tuple[str, ...]
    timeout: float


@final
class Site:
    """One checkpoint directory, as this member uses it (see the module docstring).

    ``connect()`` joins the group's channels (a step every member takes at once, in
    program order) and decides the layout; from then on saves can take their turns.
    ``open()`` takes the lease, sweeps and loads the catalog (rank 0), and may be called
    again after it failed; ``opened`` is set once it went through. ``close()`` lets go.
    """

    def __init__(
        self,
        directory: str,
        *,
        storage: Storage | None,
        naming: Naming,
        keep: RetentionPolicy | None,
        group: Group,
        read_only: bool,
        lease_ttl: float,
        allow_pickle: bool,
    ) -> None:
        self.storage, self.directory = resolve(directory, storage)
        self.naming, self.keep, self.group = naming, keep, group
        self.read_only, self.lease_ttl, self.allow_pickle = read_only, lease_ttl, allow_pickle
        #: What the last open found failed (an object store down, a lease held).
        self.failures = Failures()
        #: Set once another manager took the directory's lease.
        self.lease_lost: LeaseLostError | None = None
        self._channels: tuple[Channel, Channel] | None = None
        self._member: Member | None = None
        self._catalog: Catalog | None = None
        self._lease: Lease | None = None
        self._renewal = anyio.CancelScope()
        #: The saves being voted on: each one's handle -> the writer's own (None: the
        #: writer refused it), whose end says the file is durable.
        self._pending: dict[SaveHandle, SaveHandle | None] = {}
        #: The saves of ``_pending`` whose group agreed: what is left is this rank's own.
        self._agreed: set[SaveHandle] = set()
        #: Set once ``open`` went through: the lease is held and the catalog loaded.
        self.opened = anyio.Event()
        #: Called each time a vote ends (whoever waits for the votes to settle).
        self.on_settled: Callable[[], object] | None = None

    def beside(self, directory: str, *, storage: Storage | None, keep: RetentionPolicy | None) -> Site:
        """A Site of another directory (a remote tier's), named, grouped and opened as this
        one is."""
        return Site(
            directory,
            storage=storage,
            naming=self.naming,
            keep=keep,
            group=self.group,
            read_only=self.read_only,
            lease_ttl=self.lease_ttl,
            allow_pickle=self.allow_pickle,
        )

    @property
    def is_local(self) -> bool:
        """Whether the directory is on a local filesystem (its calls are never abandoned)."""
        return isinstance(self.storage, LocalStorage)

    @property
    def member(self) -> Member:
        assert self._member is not None, "the site is not connected"
        return self._member

    @property
    def catalog(self) -> Catalog | None:
        """The catalog of the directory: rank 0's (None on the other members)."""
        return self._catalog

    # -- lifecycle -----------------------------------------------------------------------
    async def connect(self, *, steps_are_dirs: bool | None = None) -> None:
        """Join the group's channels (every member at once; a process on its own has its
        own, which need nobody) and decide the layout: ``steps_are_dirs`` as given, or by
        the group, or by what the directory holds (which asks the storage)."""
        if self.group.world_size is None:
            self._channels = (LocalChannel(), LocalChannel())
        else:
            from .._dist import coord

            self._channels = await coord.channels(self.group.parent, self.group.timeout)
        layout = await self._layout(steps_are_dirs)
        if self.group.rank == 0:
            self._catalog = Catalog(
                self.storage,
                self.directory,
                self.naming.pattern,
                self.keep,
                steps=layout,
                writable=not self.read_only,
                name=self.naming.name,
            )
        self._member = Member(
            *self._channels, layout=layout, catalog=self._catalog, replicated=self.group.replicated
        )

    @property
    def steps_are_dirs(self) -> bool:
        return self.member.layout.manifests

    async def open(self, tg: anyio.abc.TaskGroup, *, on_control: bool = False) -> None:
        """On rank 0, take the lease, sweep and load the catalog; every member checks that
        all are configured alike. A failure raises on every member and releases what was
        taken: ``open`` can be tried again. ``on_control``: agree over the control channel,
        so that a background open takes no turn among the saves'."""
        config = OpenReport(self.naming.name, list(self.group.replicated), self.group.size)
        try:
            await self.member.open(config, self._prepare, on_control=on_control)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._release_lease()
            raise
        if self._lease is not None:
            tg.start_soon(self._renew, self._lease)
        self.opened.set()

    async def _layout(self, steps_are_dirs: bool | None) -> Layout:
        """A directory per step in a group, or where a group committed its checkpoints;
        else a file per step."""
        if steps_are_dirs is None:
            steps_are_dirs = self.group.world_size is not None or await _offload.run_io(
                has_step_dirs, self.storage, self.directory, self.naming.pattern
            )
        if steps_are_dirs:
            if "{rank}" in self.naming.name:
                raise ValueError(
                    f"name {self.naming.name!r}: {self.directory} holds a directory per step; drop {{rank}}"
                )
            return StepDirectories(
                self.storage,
                self.directory,
                self.naming.pattern,
                self.allow_pickle,
                writable=not self.read_only,
            )
        return Files(self.storage, self.directory, self.naming.pattern, self.group.rank, self.allow_pickle)

    async def _prepare(self) -> None:
        """Lock the directory, sweep what crashed saves left, load the index (rank 0); a
        reader only loads the index."""
        assert self._catalog is not None
        found = await _offload.run_io(self.storage.stat, self.directory)  # a link to a directory is one
        if found is not None and not found.is_dir:
            raise ForeignFileError(self.directory, f"{describe(found)}, not a directory")
        if not self.read_only:
            self._lease = await self._take_lease()
            swept = await _offload.run_io(self.storage.sweep_incomplete, self.directory)
            if swept:
                logger.info("removed %d temp file(s) of crashed saves in %s", len(swept), self.directory)
            await _offload.run_io(functools.partial(sweep_blobs, idle=True), self.storage, self.directory)
        await self._catalog.load()

    async def _take_lease(self) -> Lease:
        """The directory's lease. A holder that stopped renewing its lease (it died on
        another host) holds it until it goes stale: opening waits for that, up to
        ``lease_ttl``, and gives up at once if it sees the lease renewed (a live holder)."""
        patience = time.monotonic() + self.lease_ttl + 1.0  # clocks differ a little
        stale_at: float | None = None  # when the holder's lease goes stale, as last seen
        while True:
            try:
                return await self._lease_once()
            except DirectoryLockedError as exc:
                if exc.retry_after is None:
                    raise
                now = time.monotonic()
                # The expiry the lease holds, where its backend says it: unchanged unless
                # renewed. Else guessed from retry_after, which a slow thread hop skews.
                mark, slack = (exc.expires, 0.0) if exc.expires is not None else (now + exc.retry_after, 1.0)
                renewed = stale_at is not None and mark > stale_at + slack
                if renewed or now >= patience:
                    raise
                if stale_at is None:
                    logger.warning(
                        "%s is leased by a manager that may have died; waiting up to %.0f s for its "
                        "lease to go stale",
                        self.directory,
                        exc.retry_after,
                    )
                stale_at = mark
                await anyio.sleep(min(max(exc.retry_after, 0.05), patience - now, 1.0))

    async def _lease_once(self) -> Lease:
        """One try at the lease. A caller cancelled meanwhile may abandon the thread (a
        remote store that does not answer): a lease it takes after that is let go, never
        left held by nobody for the life of the process."""
        claim = _Claim()
        try:
            return await _offload.run_io(claim.take, self.storage, self.directory, self.lease_ttl)
        except BaseException:
            leftover = claim.abandon()
            if leftover is not None:
                with anyio.CancelScope(shield=True):
                    await _offload.run_io(leftover.release)
            raise

    async def _renew(self, lease: Lease) -> None:
        """Keep the lease of the directory (an object store's expires unless renewed)."""
        with self._renewal:
            while True:
                await anyio.sleep(self.lease_ttl / 3)
                try:
                    await _offload.run_io(lease.renew)
                except LeaseLostError as exc:
                    logger.error("%s", exc)
                    self.lease_lost = exc
                    return
                except Exception as exc:  # a transient failure: the next renewal may pass
                    logger.warning("renewing the lease of %s failed (%r)", self.directory, exc)

    async def close(self) -> None:
        """Stop writing the index, leave the group's channels, release the lease: all of
        it, also when the caller is being cancelled (Ctrl-C at a close)."""
        self._renewal.cancel()
        if self._catalog is not None:
            self._catalog.close()
        with anyio.CancelScope(shield=True):
            if self._channels is not None:
                channels, self._channels = self._channels, None
                for channel in channels:
                    await _offload.run_coord(channel.close)
            await self._release_lease()

    async def _release_lease(self) -> None:
        """Give the lease up. On a store that does not answer, not for longer than
        ``RELEASE_BOUND`` seconds: a lease left behind goes stale after ``lease_ttl``."""
        if self._lease is not None:
            lease, self._lease = self._lease, None
            with anyio.move_on_after(RELEASE_BOUND, shield=True) as scope:  # a round trip on an object store
                await _offload.run_io(lease.release)
            if scope.cancelled_caught:
                logger.warning(
                    "%s: the lease could not be given up within %g s; it goes stale in %g s",
                    self.directory,
                    RELEASE_BOUND,
                    self.lease_ttl,
                )

    # -- saving --------------------------------------------------------------------------
    async def submit(
        self,
        tg: anyio.abc.TaskGroup,
        record: CheckpointRecord,
        state: object,
        accept: Accept,
        *,
        overwrite: bool,
        check: bool = True,
        outer: Resolver | None = None,
        report: Callable[[str, BaseException], Any],
        on_control: bool = False,
    ) -> SaveHandle:
        """Take this save's turn, hand it to the writer (``accept``), and vote on it in the
        background (in ``tg``); the returned handle follows the writer's, its capture
        included (``outer``: resolve this one instead of a new one). ``check``: look
        first at what stands at the step's name. ``report(path, error)`` records a
        failure only this site's owner can report."""
        member = self.member
        # The turn is taken now, in program order, as every member does for this call;
        # the vote that fills it runs in the background.
        turn = member.channel(on_control).turn(f"save step {record.step}")
        out_dir, file = member.layout.place(record, self.group.rank)
        target = (
            state
            if self.group.rank == 0 or not self.group.replicated
            else ExternalLeaves(state, member.matches)
        )
        path = self.storage.join(out_dir, file)
        try:
            if check:
                committed = self._catalog is not None and record.step in self._catalog.records
                await member.layout.check_vacant(record, committed, overwrite)
            inner = await accept(file, out_dir, target)
        except BaseException as exc:
            # The other members vote on this step all the same: this one votes that it failed.
            failure = (
                exc if isinstance(exc, Exception) else SaveCancelledError("this rank's save was cancelled")
            )
            refused = outer if outer is not None else Resolver(path)
            self._pending[refused.handle] = None
            tg.start_soon(self._vote, turn, failure, record, refused, report)
            raise
        if outer is None:
            outer = Resolver(path, following=inner)  # its caller waits for the writer's capture
        self._pending[outer.handle] = inner
        tg.start_soon(self._vote, turn, inner, record, outer, report)
        return outer.handle

    async def _vote(
        self,
        turn: Any,
        inner: SaveHandle | BaseException,
        record: CheckpointRecord,
        outer: Resolver,
        report: Callable[[str, BaseException], Any],
    ) -> None:
        path = outer.handle.path
        try:
            await self.member.vote(
                turn,
                inner,
                record,
                outer,
                lambda exc: report(path, exc),
                lambda: self._agreed.add(outer.handle),
            )
        finally:
            self._agreed.discard(outer.handle)
            self._pending.pop(outer.handle, None)
            if not outer.handle.done():
                outer.fail(WriterClosedError("the manager closed before the save finished"))
            if self.on_settled is not None:
                self.on_settled()

    async def settle_committed(self) -> None:
        """Wait for what follows each save whose file is durable already (its vote, the
        index, retention, the sweep and blob collection), but for no save still being
        written. A training loop that yields only in its save calls gives those follow-ups
        no other time to run: without this, retention fell behind by hundreds of files."""
        for handle, inner in list(self._pending.items()):
            if self.member.size > 1 and handle not in self._agreed:
                # Its vote waits for the other ranks, whose event loops may be blocked
                # where this rank's is not: in a collective of the training step (a
                # synchronous all_reduce) that waits for this rank in turn. Waiting here
                # for their votes hung torchrun runs.
                continue
            if inner is None or inner.done():
                await handle.outcome()

    async def wait_pending(self) -> None:
        """Wait until every save handed to this site so far has been voted on."""
        for handle in list(self._pending):
            await handle.outcome()

    def pending(self) -> int:
        return len(self._pending)

    # -- reading -------------------------------------------------------------------------
    async def refresh(self) -> None:
        """A reader's view is never older than its last call: training beside it commits
        and rotates, so a read-only site reads the directory again at each call."""
        if self.read_only and self._catalog is not None:
            await self._catalog.load()

    def _rank0(self) -> Catalog:
        assert self._catalog is not None
        return self._catalog

    def catalog_steps(self) -> list[int]:
        """Rank 0's committed, valid steps (what ``steps`` asks it for)."""
        return self._rank0().steps()

    async def steps(self) -> list[int]:
        """The committed steps that have not failed verification, oldest first."""
        await self.refresh()
        return list(await self.member.ask("steps", self.catalog_steps))

    async def history(self) -> list[CheckpointRecord]:
        await self.refresh()

        async def answer() -> list[Any]:
            return [r.to_json() for r in await self._rank0().past()]

        raw = await self.member.ask("history", answer)
        return [CheckpointRecord.from_json(r) for r in raw]

    async def records(self) -> list[CheckpointRecord]:
        await self.refresh()
        raw = await self.member.ask(
            "records", lambda: [r.to_json() for _, r in sorted(self._rank0().records.items())]
        )
        return [CheckpointRecord.from_json(r) for r in raw]

    async def record(self, step: int) -> CheckpointRecord | None:
        """The record of a committed step, or None."""
        raw = await self.member.ask(
            "record", lambda: r.to_json() if (r := self._rank0().records.get(step)) is not None else None
        )
        return None if raw is None else CheckpointRecord.from_json(raw)

    async def listing(self, step: int | None) -> Listing:
        """What a restore may try, newest first (only ``step``, if given), as the
        directory is now; with the directory's mark."""
        await self.refresh()
        return await self.member.listing(step)

    async def committed_before(self) -> bool:
        """Whether the directory ever held a committed checkpoint: it holds one, or its
        index says it did (retention since removed them all, or someone did)."""
        await self.refresh()
        return bool(await self.member.ask("committed before", lambda: self._rank0().committed_before))

    async def restore(
        self, step: int | None, target: Any, keys: Sequence[str] | None, strict: bool
    ) -> Attempt:
        """The newest step (or ``step``) that loads whole; a corrupt one is marked and an
        older one tried, unless ``step`` was asked for (CorruptCheckpointError). A reader
        lists the directory again when what it chose went away as it read it."""
        relist = (lambda: self.listing(step)) if self.read_only else None
        found = await restore_first(await self.listing(step), target, keys, strict, relist=relist)
        if isinstance(found, Attempt):
            return found
        raise found.error(self.directory, step)

    async def prune(self, *, dry_run: bool) -> list[CheckpointRecord]:
        if self.read_only and not dry_run:
            raise CheckpointError(f"{self.directory}: this manager is read-only (read_only=True)")
        if self.group.world_size is not None:
            raise CheckpointError(f"{self.directory}: prune() runs in a process on its own, not in a group")
        gone = await self._rank0().apply_retention(dry_run=dry_run)
        if not dry_run:  # saves may be in flight: their blobs' temp files are pinned
            await _offload.run_io(functools.partial(sweep_blobs, idle=False), self.storage, self.directory)
        return gone


@final
class _Claim:
    """A lease being taken in a worker thread that its caller may abandon."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lease: Lease | None = None
        self._abandoned = False

    def take(self, storage: Storage, directory: str, ttl: float) -> Lease:
        lease = storage.lease(directory, ttl)
        with self._lock:
            if not self._abandoned:
                self._lease = lease
                return lease
        lease.release()  # nobody waits for it any more
        raise DirectoryLockedError(f"{directory}: the lease was taken after its caller gave up")

    def abandon(self) -> Lease | None:
        """Give up; the lease if it was taken already (the caller must let it go)."""
        with self._lock:
            self._abandoned = True
            lease, self._lease = self._lease, None
            return lease
