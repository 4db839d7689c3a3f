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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, final

import anyio
import anyio.abc

from .._base import offload as _offload
from .._base.errors import (
    CheckpointError,
    ForeignFileError,
    LeaseLostError,
)
from .._base.notice import notice
from .._base.tasks import Failures
from .._base.typed import encode
from .._dist.channel import Channel, LocalChannel
from .._dist.decisions import agree_on_config, decoded
from .._dist.messages import OpenReport
from .._save.handle import Resolver, SaveHandle, SaveStats
from .._storage.backends import resolve
from .._storage.local import LocalStorage
from .._storage.protocol import Storage, describe
from .ballots import Accept, Ballots
from .blobs import sweep as sweep_blobs
from .catalog import Catalog
from .holding import LeaseHolder
from .layouts import choose_layout
from .member import Member
from .nodes import Nodes, committed_here, find_nodes, manifests_of, refill, sweep_probes
from .records import CheckpointRecord
from .replicas import Replicator
from .restores import Attempt, Listing, restore_first
from .retention import RetentionPolicy

logger = logging.getLogger(__name__)


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
    #: Copies of each rank's file on a partner node (``replicas``): 0 or 1.
    replicas: int = 0


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
        probe_nodes: bool = True,
    ) -> None:
        self.storage, self.directory = resolve(directory, storage)
        #: Whether the ranks find out which of them share the directory (``nodes``): a
        #: remote tier's is shared by construction, a reader writes no probe.
        self.probe_nodes = probe_nodes and not read_only
        #: The group's nodes (ranks sharing a directory), once connected.
        self.nodes = Nodes.one(group.size)
        self.naming, self.keep, self.group = naming, keep, group
        self.read_only, self.lease_ttl, self.allow_pickle = read_only, lease_ttl, allow_pickle
        #: What the last open found failed (an object store down, a lease held).
        self.failures = Failures()
        self._channels: tuple[Channel, Channel] | None = None
        self._member: Member | None = None
        self._catalog: Catalog | None = None
        self._holder = LeaseHolder(self.storage, self.directory, lease_ttl)
        self._ballots = Ballots(self.storage, group.rank, group.replicated)
        #: Set once ``open`` went through: the lease is held and the catalog loaded.
        self.opened = anyio.Event()

    def beside(self, directory: str, *, storage: Storage | None, keep: RetentionPolicy | None) -> Site:
        """A Site of another directory (a remote tier's), named, grouped and opened as this
        one is."""
        return Site(
            directory,
            storage=storage,
            keep=keep,
            naming=self.naming,  # named, grouped and opened as this one is
            group=self.group,
            read_only=self.read_only,
            lease_ttl=self.lease_ttl,
            allow_pickle=self.allow_pickle,
            probe_nodes=False,  # one directory every rank reaches
        )

    def on_settled(self, call: Callable[[], object]) -> None:
        """Call ``call`` each time a vote ends (whoever waits for the votes to settle)."""
        self._ballots.on_settled = call

    @property
    def is_local(self) -> bool:
        """Whether the directory is on a local filesystem (its calls are never abandoned)."""
        return isinstance(self.storage, LocalStorage)

    @property
    def member(self) -> Member:
        assert self._member is not None, "the site is not connected"
        return self._member

    def path(self, name: str) -> str:
        """The path of ``name`` in the directory."""
        return self.storage.join(self.directory, name)

    @property
    def lease_lost(self) -> LeaseLostError | None:
        """Set once another manager took the directory's lease."""
        return self._holder.lost

    def hold_replicas_as(self, local: Site) -> None:
        """The ranks whose files hold the replicated entries are ``local``'s (this is its
        remote tier, whose copies are those files)."""
        self.member.holders = local.member.holders

    @property
    def blob_dir(self) -> str | None:
        """This rank's folder of blobs, which it collects itself (``Member.blob_dir``)."""
        return self.member.blob_dir

    @blob_dir.setter
    def blob_dir(self, rank_dir: str | None) -> None:
        self.member.blob_dir = rank_dir

    def committed(self, record: CheckpointRecord) -> SaveHandle:
        """A handle of this rank's committed checkpoint of ``record``, resolved."""
        out_dir, file = self.member.place(record, self.group.rank)
        done = Resolver(self.storage.join(out_dir, file))
        done.finish(SaveStats(done.handle.path, record.bytes, 0.0, 0.0, 0.0, 0.0, 0.0))
        return done.handle

    @property
    def catalog(self) -> Catalog | None:
        """The catalog of the directory: a node leader's (None on the other members);
        rank 0's decides for the group."""
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
        layout = await choose_layout(
            self.storage,
            self.directory,
            self.naming.name,
            self.naming.pattern,
            steps_are_dirs,
            group_rank=self.group.rank,
            in_group=self.group.world_size is not None,
            allow_pickle=self.allow_pickle,
            writable=not self.read_only,
        )
        self._member = Member(*self._channels, layout=layout, catalog=None, replicated=self.group.replicated)
        if self.probe_nodes and self.group.world_size is not None:
            replicas = self.group.replicas
            self.nodes = await find_nodes(self._channels[0], self.storage, self.directory, replicas)
            if replicas and self.nodes.many:
                self._member.replicator = await Replicator.open(
                    self.group.parent,
                    self.group.timeout,
                    self.storage,
                    self.directory,
                    self.nodes,
                    self.group.rank,
                )
            elif replicas and self.group.rank == 0:
                notice(
                    logger,
                    f"{self.directory}: replicas=1, but every rank shares this directory: no copy is kept",
                )
        self._member.nodes = self.nodes
        self._member.holders = tuple(self.nodes.leaders)
        if self.nodes.leads(self.group.rank):
            self._catalog = Catalog(
                self.storage,
                self.directory,
                self.naming.pattern,
                self.keep,
                steps=layout,
                writable=not self.read_only,
                name=self.naming.name,
            )
            self._member.catalog = self._catalog

    @property
    def steps_are_dirs(self) -> bool:
        return self.member.manifests

    async def open(self, tg: anyio.abc.TaskGroup, *, on_control: bool = False) -> None:
        """On each node's leader (rank 0 alone, for a shared directory), take the lease,
        sweep and load the catalog; every member checks that all are configured alike.
        A failure raises on every member and releases what was taken: ``open`` can be
        tried again. ``on_control``: agree over the control channel, so that a
        background open takes no turn among the saves'."""
        config = OpenReport(self.naming.name, list(self.group.replicated), self.group.size)
        try:
            if self.nodes.many:
                await self._open_nodes(config, on_control)
            else:
                await self.member.open(config, self._prepare, on_control=on_control)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._holder.release()
            raise
        self._holder.keep(tg)
        self.opened.set()

    async def _prepare(self) -> None:
        await self._lock()
        await self._tidy()

    async def _lock(self) -> None:
        """Lock the directory (not a reader)."""
        found = await _offload.run_io(self.storage.stat, self.directory)  # a link to a directory is one
        if found is not None and not found.is_dir:
            raise ForeignFileError(self.directory, f"{describe(found)}, not a directory")
        if not self.read_only:
            await self._holder.take()

    async def _tidy(self) -> None:
        """Sweep what crashed saves left, load the index; a reader only loads the index."""
        assert self._catalog is not None
        if not self.read_only:
            swept = await _offload.run_io(self.storage.sweep_incomplete, self.directory)
            if swept:
                logger.info("removed %d temp file(s) of crashed saves in %s", len(swept), self.directory)
            await _offload.run_io(functools.partial(sweep_blobs, idle=True), self.storage, self.directory)
            if self.probe_nodes:
                await _offload.run_io(sweep_probes, self.storage, self.directory)
        await self._catalog.load()

    async def _open_nodes(self, config: OpenReport, on_control: bool) -> None:
        """Open a group of several nodes (``nodes``): each leader locks its directory and
        tells which steps it holds committed; rank 0 answers with the steps committed on
        any node, which no node sweeps, and the manifests of its own that other nodes
        lack; then each leader refills those it has the files of, sweeps and loads."""
        lead = self.nodes.leads(self.group.rank)

        async def lock() -> Any:
            if not lead:
                return {"config": encode(config), "committed": None}
            await self._lock()
            names = await _offload.run_io(self._step_dir_names)
            here = await _offload.run_io(committed_here, self.storage, self.directory, names)
            return {"config": encode(config), "committed": here}

        async def plan(bodies: list[Any]) -> Any:
            agree_on_config(decoded(OpenReport, [b["config"] for b in bodies]))
            held = {r: set(b["committed"]) for r, b in enumerate(bodies) if b["committed"] is not None}
            lacking = sorted(n for n in held[0] if any(n not in names for names in held.values()))
            manifests = await _offload.run_io(manifests_of, self.storage, self.directory, lacking)
            return {"keep": sorted(set().union(*held.values())), "manifests": manifests}

        async def tidy() -> Any:
            if lead:
                if self.group.rank != 0:
                    ranks = self.nodes.members(self.group.rank)
                    done = await _offload.run_io(
                        refill, self.storage, self.directory, told["manifests"], ranks
                    )
                    if done:
                        logger.info(
                            "%s: the manifests of %s written again from rank 0's", self.directory, done
                        )
                self.member.layout.spare(set(told["keep"]))
                await self._tidy()
            return None

        async def nothing(_: list[Any]) -> Any:
            return None

        channel = self.member.channel(on_control)
        async with channel.turn("open") as turn:
            told = await turn.agree(lock, plan)
        async with channel.turn("open nodes") as turn:
            await turn.agree(tidy, nothing)

    def _step_dir_names(self) -> list[str]:
        """The step directories in the directory (committed or not). Blocking."""
        return [
            e.name
            for e in self.storage.list(self.directory)
            if e.is_dir and self.naming.pattern.fullmatch(e.name)
        ]

    async def close(self) -> None:
        """Stop writing the index, leave the group's channels, release the lease: all of
        it, also when the caller is being cancelled (Ctrl-C at a close)."""
        self._holder.stop_renewing()
        if self._catalog is not None:
            self._catalog.close()
        with anyio.CancelScope(shield=True):
            if self._channels is not None:
                channels, self._channels = self._channels, None
                for channel in channels:
                    await _offload.run_coord(channel.close)
            member = self._member
            if member is not None and member.replicator is not None:
                replicator, member.replicator = member.replicator, None
                await _offload.run_peer(replicator.close)
            await self._holder.release()

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
        background (``Ballots.submit``)."""
        committed = check and self._catalog is not None and record.step in self._catalog.records
        return await self._ballots.submit(
            tg,
            self.member,
            record,
            state,
            accept,
            overwrite=overwrite,
            check=check,
            committed=committed,
            outer=outer,
            report=report,
            on_control=on_control,
        )

    async def settle_committed(self) -> None:
        await self._ballots.settle_committed(self.member.size)

    async def agree_on_trigger(self, due: bool) -> bool:
        """Rank 0's answer to whether a clock trigger calls for a save (see ``Member``)."""
        return await self.member.agree_on_trigger(due)

    async def wait_pending(self) -> None:
        """Wait until every save handed to this site so far has been voted on."""
        await self._ballots.wait_pending()

    def pending(self) -> int:
        return self._ballots.pending()

    # -- reading -------------------------------------------------------------------------
    async def refresh(self) -> None:
        """A reader's view is never older than its last call: training beside it commits
        and rotates, so a read-only site reads the directory again at each call."""
        if self.read_only and self._catalog is not None:
            await self._catalog.load()

    def _rank0(self) -> Catalog:
        assert self._catalog is not None
        return self._catalog

    async def steps(self, *, on_control: bool = False) -> list[int]:
        """The committed steps that have not failed verification, oldest first
        (``on_control``: asked over the control channel, among no save's turns)."""
        await self.refresh()
        return await self.member.steps(on_control=on_control)

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
        return bool(await self.member.ask_nodes("committed before", lambda c: c.committed_before, any))

    async def restore(
        self, step: int | None, target: Any, keys: Sequence[str] | None, strict: bool
    ) -> Attempt:
        """The newest step (or ``step``) that loads whole; a corrupt one is marked and an
        older one tried, unless ``step`` was asked for (CorruptCheckpointError). A reader
        lists the directory again when what it chose went away as it read it."""
        relist = (lambda: self.listing(step)) if self.read_only else None
        found = await restore_first(await self.listing(step), target, keys, strict, relist=relist)
        if isinstance(found, Attempt):
            await self.refill(found.record)
            return found
        raise found.error(self.directory, step)

    async def refill(self, restored: CheckpointRecord) -> None:
        """With replicas, after a restore: the other steps the nodes keep get back what a
        node lacks (``Replicator.repair``), so a node whose disk came back empty holds
        them again before the first save. Every member at once."""
        replicator = self.member.replicator
        if replicator is None or self.read_only:
            return
        for _, record in (await self.listing(None)).tries:
            if record.step != restored.step:
                await replicator.repair(self.member.votes, record, self.catalog)

    async def prune(self, *, dry_run: bool) -> list[CheckpointRecord]:
        if self.read_only and not dry_run:
            raise CheckpointError(f"{self.directory}: this manager is read-only (read_only=True)")
        if self.group.world_size is not None:
            raise CheckpointError(f"{self.directory}: prune() runs in a process on its own, not in a group")
        gone = await self._rank0().apply_retention(dry_run=dry_run)
        if not dry_run:  # saves may be in flight: their blobs' temp files are pinned
            await _offload.run_io(functools.partial(sweep_blobs, idle=False), self.storage, self.directory)
        return gone
