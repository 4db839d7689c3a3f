"""One process's part in a group's checkpoints; a process on its own is a group of one.

Every decision is rank 0's (``_dist.decisions``) and every member learns it through the
channel (``_dist.channel``): which step is latest, whether a save commits, which
checkpoint a restore takes. A save is a two-phase commit: each member writes its part
of the step, reports it once durable, and rank 0 commits the step (writes its
manifest, for a directory per step) only if every member succeeded; any failure,
death or silence makes every member raise RankFailedError and leaves the step
uncommitted, to be swept later. In a group of one the same code runs with a channel
that decides at once, and a failure is raised as itself.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, final

from .._base import heap as _heap
from .._base import offload as _offload
from .._base.errors import (
    CheckpointError,
    CheckpointKeyError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotACheckpointError,
    PickleNotAllowedError,
    RankFailedError,
    StateMismatchError,
)
from .._base.notice import notice
from .._base.tasks import SaveFailure
from .._base.typed import decode, encode
from .._dist.channel import Channel, Turn
from .._dist.decisions import agree_on_config, decoded, judge_restore
from .._dist.messages import CommitVerdict, FileReport, LoadReport, OpenReport
from .._format.manifest import Manifest, node_runs, rank_file, rank_of, replicated_matcher
from .._save.handle import Resolver, SaveHandle, SaveStats
from .blobs import collect
from .catalog import Catalog
from .layouts import Layout, replaceable
from .nodes import Nodes
from .records import CheckpointRecord
from .replicas import Replicator, covered
from .reports import Collected, Keeper, Sender
from .restores import Attempt, Backup, Listing

logger = logging.getLogger(__name__)

#: Errors of a restore that say the caller asked for what the step does not hold as
#: asked: every member raises, and no older step is tried (none would fit better).
_MISMATCH = (StateMismatchError, CheckpointKeyError, PickleNotAllowedError)
#: A report of fewer boxes and leaves than this is encoded and hashed on the loop.
_SMALL_REPORT = 256
#: Rank 0 settles the reports of up to 64 ranks with fewer boxes and leaves than this in
#: all on the loop (a few milliseconds: less than a hop to a busy worker thread).
_SMALL_GROUP = 4096


@final
class Member:
    """This process's part in a group's checkpoints (see the module docstring)."""

    def __init__(
        self,
        votes: Channel,
        control: Channel,
        *,
        layout: Layout,
        catalog: Catalog | None,
        replicated: Sequence[str],
    ) -> None:
        self.votes, self._control = votes, control
        self.rank, self.size = votes.rank, votes.size
        self.layout, self.catalog = layout, catalog  # the catalog is rank 0's
        self.replicated = list(replicated)
        self.matches = replicated_matcher(self.replicated)
        #: Steps that saves in progress write to: never swept.
        self.busy: set[str] = set()
        #: This rank's blob folder (incremental saves into step directories), which it
        #: collects itself after each of its saves: only its own saves write there, and
        #: only its process knows which of their blobs are in flight.
        self.blob_dir: str | None = None
        #: What this member last reported, and (rank 0) every member's: steady-state
        #: reports are digests of what rank 0 holds (``reports``).
        self._sender, self._keeper = Sender(), Keeper()
        #: Which ranks share a directory (``nodes``): each node's leader holds a catalog
        #: of its own, and writes rank 0's manifest of each commit in its directory.
        self.nodes = Nodes.one(self.size)
        #: The ranks whose files hold the replicated entries: rank 0, and in a group of
        #: several nodes each node's leader, so that a node restores alone. A remote
        #: tier's copies are the local files: its member takes the local one's.
        self.holders: tuple[int, ...] = (0,)
        #: Copies on partner nodes (``replicas``), if asked for and the group has nodes.
        self.replicator: Replicator | None = None
        #: Where a rank file that a node lacks, or holds damaged, is had last before the
        #: step is given up: the remote tier of a manager with one (``TwoTiers.restore``).
        self.backup: Backup | None = None

    @property
    def stores_replicas(self) -> bool:
        """Whether this rank's file holds the replicated entries (``holders``)."""
        return self.rank in self.holders

    @property
    def manifests(self) -> bool:
        """Whether steps are directories with a manifest (a group's layout)."""
        return self.layout.manifests

    def place(self, record: CheckpointRecord, rank: int) -> tuple[str, str]:
        """Where ``rank``'s file of ``record`` goes: (its directory, its name)."""
        return self.layout.place(record, rank)

    async def open(
        self, config: OpenReport, prepare: Callable[[], Awaitable[None]], *, on_control: bool = False
    ) -> None:
        """Run ``prepare`` on rank 0 (lock, sweep, index) and check that every member is
        configured alike. A failure of ``prepare`` raises on every member (orderly: the
        channel stays usable, so opening can be tried again). ``on_control``: over the
        control channel, whose turns never mix with the saves' (a background open)."""

        async def work() -> Any:
            if self.rank == 0:
                await prepare()
            return encode(config)

        async def decide(bodies: list[Any]) -> None:
            agree_on_config(decoded(OpenReport, bodies))

        async with self.channel(on_control).turn("open") as turn:
            await turn.agree(work, decide)

    # -- asking rank 0 -------------------------------------------------------------------
    async def ask(self, op: str, answer: Callable[[], Any], *, on_control: bool = False) -> Any:
        """Rank 0's ``answer()`` (a value, or an awaitable of one), on every member
        (``on_control``: over the control channel, for work in the background)."""

        async def decide(_: list[Any]) -> Any:
            result = answer()
            return await result if inspect.isawaitable(result) else result

        async with self.channel(on_control).turn(op) as turn:
            return await turn.exchange(None, decide)

    async def ask_nodes(
        self,
        op: str,
        local: Callable[[Catalog], Any],
        answer: Callable[[list[Any]], Any],
        *,
        on_control: bool = False,
    ) -> Any:
        """Rank 0's ``answer`` from every node's ``local(catalog)`` (rank 0's first), on
        every member: each node's leader tells what its directory holds."""
        mine = local(self.catalog) if self.catalog is not None else None
        mine = await mine if inspect.isawaitable(mine) else mine

        async def decide(bodies: list[Any]) -> Any:
            result = answer([b for r, b in enumerate(bodies) if self.nodes.leads(r)])
            return await result if inspect.isawaitable(result) else result

        async with self.channel(on_control).turn(op) as turn:
            return await turn.exchange(mine, decide)

    async def steps(self, *, on_control: bool = False) -> list[int]:
        """The steps the group can restore from its nodes: rank 0's valid ones that every
        node holds or, with replicas, whose every file some node holds."""

        def answer(held: list[Any]) -> list[int]:
            return sorted(set(self._records(held)) & self._restorable(held))

        return list(await self.ask_nodes("steps", self._held, answer, on_control=on_control))

    async def _held(self, catalog: Catalog) -> Any:
        """What this node holds: its committed steps, or with replicas, each one's files
        and (another node's leader) its records of them: rank 0 lists the steps its own
        node has no record of from them (its node replaced: its index is gone too)."""
        if self.replicator is None:
            return sorted(catalog.records)
        holds = await self.replicator.holds({s: r.file for s, r in catalog.records.items()})
        if self.rank == 0:
            return {"holds": holds}
        records = {str(s): r.to_json() for s, r in catalog.records.items() if r.corrupt is None}
        return {"holds": holds, "records": records}

    def _restorable(self, held: list[Any]) -> set[int]:
        """Rank 0: the steps the nodes' ``_held`` let the group restore."""
        if self.replicator is None:
            return set.intersection(*(set(h) for h in held))
        return covered([h["holds"] for h in held])

    def _records(self, held: list[Any], *, marked: bool = False) -> dict[int, CheckpointRecord]:
        """Rank 0: the records of its valid steps (``marked``: also of those that failed),
        and with replicas, other nodes' records of the steps it has none of."""
        assert self.catalog is not None
        out = {s: r for s, r in self.catalog.records.items() if marked or r.corrupt is None}
        for h in held[1:] if self.replicator is not None else ():
            for s, raw in h["records"].items():
                if int(s) not in self.catalog.records and int(s) not in out:
                    out[int(s)] = CheckpointRecord.from_json(raw)
        return out

    def channel(self, control: bool) -> Channel:
        """The votes channel (turns in program order), or the control channel."""
        return self._control if control else self.votes

    async def agree_on_trigger(self, due: bool) -> bool:
        """Rank 0's verdict: clocks differ between ranks, the decision must not."""

        async def decide(verdicts: list[Any]) -> Any:
            return verdicts[0]

        async with self._control.turn("trigger") as turn:
            return bool(await turn.exchange(due, decide))

    # -- saving --------------------------------------------------------------------------
    async def vote(
        self,
        turn: Turn,
        inner: SaveHandle | BaseException,
        record: CheckpointRecord,
        outer: Resolver,
        report: Callable[[BaseException], SaveFailure],
        agreed: Callable[[], None] = lambda: None,
    ) -> None:
        """The second phase of a save: wait for this member's part, report it, let rank 0
        commit the step (or not), resolve ``outer``. ``turn`` was taken at the save's call
        (program order); ``agreed()``: the group agreed (or failed to)."""
        stats: list[SaveStats] = []
        own: list[SaveFailure] = []  # this member's own part, failed
        sent: list[tuple[FileReport, str]] = []  # its report, and its layout's digest
        first = Collected()  # rank 0: the reports of this vote's exchanges

        async def work() -> Any:
            if isinstance(inner, BaseException):
                raise inner
            outcome = await inner.outcome()
            if isinstance(outcome, SaveFailure):
                own.append(outcome)
                raise outcome.error
            stats.append(outcome)
            compare = self.size > 1
            mine = await self.layout.report(
                outcome, self.rank, self.replicated, compare, stores=self.stores_replicas
            )
            # Digests instead of what rank 0 holds already (``reports``); rank 0 keeps its own whole.
            if len(mine.shards) + len(mine.leaves) < _SMALL_REPORT:  # less work than a thread hop
                body, layout = self._sender.prepare(mine, self.rank == 0)
            else:
                body, layout = await _offload.run_cpu(self._sender.prepare, mine, self.rank == 0)
            sent.append((mine, layout))
            return body

        async def decide(bodies: list[Any]) -> Any:
            return await self._settle(record, bodies, first)

        self.busy.add(record.file)
        ticket: int | None = None  # this commit's place among the copies to partner nodes
        try:
            try:
                async with turn:
                    verdict = decode(CommitVerdict, await turn.agree(work, decide))
                    if verdict.resend:  # rank 0 lacks what some digests stand for
                        whole = (
                            encode(replace(sent[0][0], layout=sent[0][1]))
                            if self.rank in verdict.resend
                            else None
                        )
                        verdict = decode(CommitVerdict, await turn.exchange(whole, decide))
                        if verdict.resend:  # whole reports always expand: never a silent skip
                            raise CheckpointError(f"rank 0 could not use ranks {verdict.resend}' reports")
                    if verdict.committed and verdict.manifest and self.replicator is not None:
                        # Taken in the turn, so in the same order on every rank: the copies
                        # pair up in that order, whenever each vote's task gets to them.
                        ticket = self.replicator.ticket()
                        if self.catalog is not None:  # kept on this node until it is copied
                            self.catalog.hold(record.step)
            finally:
                agreed()
            if not verdict.committed:
                outer.skip()
                return
            self._sender.committed(sent[0][1], verdict.per_rank)
            await self._after_commit(record, stats[0], verdict)
        except Exception as exc:
            outer.fail(self._failure(exc, inner, own, report))
        else:
            outer.finish(stats[0])
        finally:
            self.busy.discard(record.file)
        if ticket is not None:  # committed: copied after its handle is resolved, even if indexing failed
            assert self.replicator is not None
            try:
                await self.replicator.replicate(record, verdict.manifest, ticket)
            finally:
                if self.catalog is not None:
                    await self.catalog.release(record.step)

    async def _settle(self, record: CheckpointRecord, bodies: list[Any], first: Collected) -> Any:
        """Rank 0: the verdict on a save from every member's report, the step committed if
        it is to be. Decoding, expanding and indexing the reports is one worker-thread
        call: at 1,024 ranks it is seconds of work the event loop must not do."""
        step, epoch, keeper = record.step, record.epoch, self._keeper
        small = len(bodies) <= 64 and sum(_entries(body) for body in bodies) < _SMALL_GROUP  # less than a hop
        if small:
            settled = keeper.settle(step, epoch, bodies, first, self.replicated, large=False)
        else:
            settled = await _offload.run_cpu(keeper.settle, step, epoch, bodies, first, self.replicated)
        if settled.resend:
            return encode(CommitVerdict(committed=False, resend=settled.resend))
        manifest = settled.manifest
        if manifest is None:
            return encode(CommitVerdict(committed=False))
        copy, kept = "", []
        if self.replicated and len(self.holders) > 1:
            manifest = replace(manifest, node_replicas=[rank_file(r) for r in self.holders[1:]])
        if self.layout.manifests and self.nodes.many:  # the other nodes' leaders write it too
            # Where the step's files are kept: each rank's node, and its partner's with replicas.
            copies = 1 if self.replicator is not None else 0
            manifest = replace(manifest, nodes=node_runs(self.nodes.of), copies=copies)
            data = await _offload.run_cpu(_manifest_bytes, manifest)
            await self.layout.commit_copy(record, data)
            copy = data.decode()
            kept = self.catalog.kept_after(record) if self.catalog is not None else []
        elif self.layout.manifests:
            await self.layout.commit(record, manifest)
        if small:
            keeper.adopt(settled.held)
        else:  # it frees what the last commit held: a large group's is thousands of objects
            await _offload.run_cpu(keeper.adopt, settled.held)
        per_rank = list(manifest.per_rank)
        verdict = CommitVerdict(True, sum(manifest.sizes), per_rank, manifest=copy, kept=kept)
        return encode(verdict)

    async def _after_commit(self, record: CheckpointRecord, stats: SaveStats, verdict: CommitVerdict) -> None:
        """Write rank 0's manifest on another node (its leader), index the committed step
        and sweep (each node's leader); collect this rank's blobs. A leader that cannot
        write the manifest fails its save: its node does not hold the step."""
        if self.catalog is not None:
            follow = None
            if verdict.manifest and self.rank != 0:
                await self.layout.commit_copy(record, verdict.manifest.encode())
                follow = verdict.kept
            await self.catalog.add(record, stats, verdict.bytes, follow=follow)
            await self.layout.sweep(record.step, self.busy)
        if self.blob_dir is not None:
            await _offload.run_io(collect, self.layout.storage, self.layout.directory, self.blob_dir)

    def _failure(
        self,
        exc: Exception,
        inner: SaveHandle | BaseException,
        own: list[SaveFailure],
        report: Callable[[BaseException], SaveFailure],
    ) -> SaveFailure | BaseException:
        """What a vote that raised ``exc`` fails its save with, reported once."""
        if isinstance(exc, RankFailedError):
            if own:
                # This member's write failed: one failure (the group's, chained from the
                # write's), reported once, through the handle or the writer.
                own[0].error = exc
                return own[0]
            if self.rank in exc.failed:
                return exc  # the save call itself raised: reported already
            return report(exc)
        if own and exc is own[0].error:
            return own[0]  # a group of one: its own failure, as itself
        if exc is inner:
            return exc  # the save call itself raised it
        return report(exc)

    # -- restoring -----------------------------------------------------------------------
    async def listing(self, step: int | None) -> Listing:
        """Rank 0's records to restore, newest first (only ``step``'s, if given), of the
        steps every node holds, and the mark of the directory they were listed from."""

        def answer(held: list[Any]) -> dict[str, Any]:
            assert self.catalog is not None
            everywhere = self._restorable(held)
            known = self._records(held, marked=step is not None)
            steps = [step] if step is not None else sorted(known, reverse=True)
            records = [known[s].to_json() for s in steps if s in everywhere and s in known]
            return {"records": records, "mark": self.catalog.mark()}

        listed = await self.ask_nodes("restore", self._held, answer)
        return Listing([(self, CheckpointRecord.from_json(raw)) for raw in listed["records"]], listed["mark"])

    async def attempt(
        self, record: CheckpointRecord, target: Any, keys: Sequence[str] | None, strict: bool
    ) -> Attempt:
        """Every member loads its part of ``record``'s step; rank 0 judges the whole (and
        marks a corrupt or unreadable step in its catalog); every member gets the verdict.
        With replicas, what a node lacks is fetched from another first, and a file that
        fails its checksum is fetched again from another node's copy, then read once more
        (a load fills the target only once every checksum passed). A file still missing
        or damaged then is copied from the ``backup`` (the remote tier), only that file,
        and the step read once more: a step is not given up for one file the remote has."""
        loaded: list[tuple[str, Any]] = []
        mine: list[Exception] = []
        bad: list[int] = []  # the ranks whose files, on this node, are missing or damaged
        backup = self.backup if self.manifests else None
        if self.replicator is not None:  # a file its node lost, from a partner's replica
            await self.replicator.repair(self.votes, record, self.catalog)
        verdict = await self._load(record, target, keys, strict, loaded, mine, bad)
        if verdict.outcome == "corrupt" and self.replicator is not None:
            await self.replicator.repair(self.votes, record, self.catalog, bad=bad)
            verdict = await self._load(record, target, keys, strict, loaded, mine, bad)
        had: set[int] = set()  # the files this rank copied from the backup: once each
        while verdict.outcome in ("corrupt", "unreadable") and backup is not None:
            # A load stops at the first file it misses: as many rounds as files missing.
            if not await self._from_backup(backup, record, [f for f in bad if f not in had]):
                break
            had.update(bad)
            verdict = await self._load(record, target, keys, strict, loaded, mine, bad)
        await self._mark(record, verdict)  # failed for good (rank 0's catalog): after the last try
        where = self.layout.path(record)
        if verdict.outcome == "ok":
            path, state = loaded[0]
            return Attempt(record, "ok", "", where, path, state)
        return Attempt(record, verdict.outcome, verdict.reason, where, error=mine[0] if mine else None)

    async def _from_backup(self, backup: Backup, record: CheckpointRecord, bad: Sequence[int]) -> bool:
        """Every member at once: the rank files the last load found missing or damaged on
        its node (``bad``) are copied from ``backup``, each once per node (by the first of
        its ranks that found it), a damaged one replaced only once the copy is whole.
        Whether any member had one: then the step is read again."""
        if not await backup.available():
            return False
        step_dir = self.layout.path(record)

        async def plan(bodies: list[Any]) -> Any:
            taken: set[tuple[int, int]] = set()
            out: list[list[int]] = []
            for r, files in enumerate(bodies):
                out.append([f for f in files if (self.nodes.of[r], f) not in taken])
                taken.update((self.nodes.of[r], f) for f in files)
            return out

        async def total(bodies: list[Any]) -> Any:
            return sum(bodies)

        async with self.votes.turn("backup") as turn:
            got = 0
            for f in (await turn.exchange(sorted(set(bad)), plan))[self.rank]:
                path = self.layout.storage.join(step_dir, rank_file(f))
                try:
                    await backup.fetch(record, f, self.layout.storage, path)
                except (CheckpointError, OSError) as exc:
                    notice(
                        logger,
                        f"{path} is missing or damaged, and the remote tier's copy could not be had ({exc})",
                    )
                else:
                    got += 1
                    notice(
                        logger,
                        f"{path} was missing or damaged: copied from the remote tier {backup.directory}",
                    )
            return bool(await turn.exchange(got, total))

    async def _mark(self, record: CheckpointRecord, verdict: LoadReport) -> None:
        """Rank 0 marks a step whose load failed (corrupt or unreadable) in its catalog."""
        if self.rank != 0 or self.catalog is None:
            return
        if verdict.outcome == "corrupt":
            await self.catalog.mark_corrupt(record.step, verdict.reason)
        elif verdict.outcome == "unreadable":
            await self.catalog.mark_unreadable(record.step, verdict.reason)

    async def _load(
        self,
        record: CheckpointRecord,
        target: Any,
        keys: Sequence[str] | None,
        strict: bool,
        loaded: list[tuple[str, Any]],
        mine: list[Exception],
        bad: list[int],
    ) -> LoadReport:
        """One load of ``record``'s step by every member, and the group's verdict; ``bad``:
        this rank's files of the step it found missing or damaged."""
        step_dir = self.layout.path(record)

        async def work() -> Any:
            bad.clear()
            try:
                near = self.nodes.of[self.rank]
                loaded.append(
                    await self.layout.load(record, self.rank, self.size, target, keys, strict, near)
                )
            except _MISMATCH as exc:
                mine.append(exc)
                return encode(LoadReport("mismatch", str(exc)))
            except NotACheckpointError as exc:
                return encode(LoadReport("unreadable", str(exc)))
            except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
                storage = self.layout.storage
                folder, name = storage.split(exc.path)
                # A rank file missing or damaged (not the manifest), which a copy may replace.
                rank = rank_of(name) if folder == step_dir else None
                if rank is not None and await _offload.run_io(replaceable, storage, exc.path):
                    bad.append(rank)
                if isinstance(exc, CorruptCheckpointError):
                    return encode(LoadReport("corrupt", str(exc)))
                return encode(LoadReport("unreadable", str(exc)))
            return encode(LoadReport("ok"))

        async def decide(bodies: list[Any]) -> Any:
            return encode(judge_restore(decoded(LoadReport, bodies)))

        async with self.votes.turn("load") as turn:
            return decode(LoadReport, await turn.agree(work, decide))


def _manifest_bytes(manifest: Manifest) -> bytes:
    with _heap.gc_paused():  # its JSON is as many objects as the manifest's boxes
        return manifest.to_bytes()


def _entries(body: Any) -> int:
    """How many boxes and leaves a report (undecoded) holds: how much work it is."""
    if not isinstance(body, dict):
        return 0
    return sum(len(body.get(k) or ()) for k in ("shards", "leaves"))
