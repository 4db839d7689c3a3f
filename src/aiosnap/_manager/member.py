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
from dataclasses import dataclass, replace
from typing import Any, final

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
from .._format.manifest import replicated_matcher
from .._save.handle import Resolver, SaveHandle, SaveStats
from .blobs import collect
from .catalog import Catalog
from .layouts import Layout
from .records import CheckpointRecord
from .reports import Collected, Keeper, Sender

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
@dataclass(frozen=True, slots=True)
class Attempt:
    """How loading one step went, the same on every member: ``outcome`` is the group's
    verdict; ``path`` and ``state`` this member's part, when it is "ok"."""

    record: CheckpointRecord
    outcome: str
    reason: str
    where: str
    path: str = ""
    state: Any = None
    #: This member's own error of a "mismatch", raised as itself.
    error: Exception | None = None


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
            mine = await self.layout.report(outcome, self.rank, self.replicated, self.size > 1)
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
            finally:
                agreed()
            if not verdict.committed:
                outer.skip()
                return
            self._sender.committed(sent[0][1], verdict.per_rank)
            await self._after_commit(record, stats[0], verdict.bytes)
        except Exception as exc:
            outer.fail(self._failure(exc, inner, own, report))
            return
        finally:
            self.busy.discard(record.file)
        outer.finish(stats[0])

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
        if self.layout.manifests:
            await self.layout.commit(record, manifest)
        if small:
            keeper.adopt(settled.held)
        else:  # it frees what the last commit held: a large group's is thousands of objects
            await _offload.run_cpu(keeper.adopt, settled.held)
        return encode(
            CommitVerdict(committed=True, bytes=sum(manifest.sizes), per_rank=list(manifest.per_rank))
        )

    async def _after_commit(self, record: CheckpointRecord, stats: SaveStats, size: int) -> None:
        """Index the committed step and sweep (rank 0); collect this rank's blobs."""
        if self.catalog is not None:
            await self.catalog.add(record, stats, size)
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
        """Rank 0's records to restore, newest first (only ``step``'s, if given), and the
        mark of the directory they were listed from."""

        def answer() -> dict[str, Any]:
            assert self.catalog is not None
            steps = [step] if step is not None else sorted(self.catalog.steps(), reverse=True)
            records = [self.catalog.records[s].to_json() for s in steps if s in self.catalog.records]
            return {"records": records, "mark": self.catalog.mark()}

        listed = await self.ask("restore", answer)
        return Listing([(self, CheckpointRecord.from_json(raw)) for raw in listed["records"]], listed["mark"])

    async def attempt(
        self, record: CheckpointRecord, target: Any, keys: Sequence[str] | None, strict: bool
    ) -> Attempt:
        """Every member loads its part of ``record``'s step; rank 0 judges the whole (and
        marks a corrupt or unreadable step in its catalog); every member gets the verdict."""
        loaded: list[tuple[str, Any]] = []
        mine: list[Exception] = []

        async def work() -> Any:
            try:
                loaded.append(await self.layout.load(record, self.rank, self.size, target, keys, strict))
            except _MISMATCH as exc:
                mine.append(exc)
                return encode(LoadReport("mismatch", str(exc)))
            except (NotACheckpointError, CheckpointNotFoundError) as exc:
                return encode(LoadReport("unreadable", str(exc)))
            except CorruptCheckpointError as exc:
                return encode(LoadReport("corrupt", str(exc)))
            return encode(LoadReport("ok"))

        async def decide(bodies: list[Any]) -> Any:
            verdict = judge_restore(decoded(LoadReport, bodies))
            if verdict.outcome == "corrupt" and self.catalog is not None:
                await self.catalog.mark_corrupt(record.step, verdict.reason)
            elif verdict.outcome == "unreadable" and self.catalog is not None:
                await self.catalog.mark_unreadable(record.step, verdict.reason)
            return encode(verdict)

        async with self.votes.turn("load") as turn:
            verdict = decode(LoadReport, await turn.agree(work, decide))
        where = self.layout.path(record)
        if verdict.outcome == "ok":
            path, state = loaded[0]
            return Attempt(record, "ok", "", where, path, state)
        return Attempt(record, verdict.outcome, verdict.reason, where, error=mine[0] if mine else None)


#: Times a reader lists its directory again within one restore. It does only when the
#: directory moved on since the listing before (a writer beside it committed or rotated),
#: so this bounds a reader that a writer's retention outruns every time.
RELISTS = 16


@final
@dataclass(frozen=True, slots=True)
class Listing:
    """What a restore may try, newest first (a member and a step's record each), and the
    mark of the directories they were listed from (``Catalog.mark``), the same on every
    member: a reader that lists again compares marks to tell that anything moved."""

    tries: list[tuple[Member, CheckpointRecord]]
    mark: object = None

    def holds(self, member: Member, record: CheckpointRecord) -> bool:
        return any(m is member and (r.step, r.file) == (record.step, record.file) for m, r in self.tries)


@final
@dataclass(frozen=True, slots=True)
class Failed:
    """A restore that loaded nothing: its failed attempts, oldest first, the last listing,
    and how many times it listed the directory again."""

    attempts: list[Attempt]
    listing: Listing
    relists: int = 0

    def why(self) -> str:
        """What was tried, in words, for an error ("" if nothing was)."""
        tried = [f"{a.where}: {a.reason or a.outcome}" for a in self.attempts[-8:]]
        if len(self.attempts) > len(tried):
            tried.insert(0, f"{len(self.attempts) - len(tried)} earlier attempts")
        moved = f"; listed again {self.relists} times as the directory moved on" if self.relists else ""
        return f"tried {'; '.join(tried)}{moved}" if tried else moved.lstrip("; ")

    def error(self, directory: str, step: int | None) -> CheckpointError:
        """The error of a restore of ``directory`` (of ``step``, if given) that loaded
        nothing: a step asked for that is there and failed is corrupt; else none is found."""
        why = f" ({self.why()})" if self.attempts or self.relists else ""
        if step is None:
            return CheckpointNotFoundError(directory, f"no valid checkpoint in {directory!r}{why}")
        if self.listing.tries and self.attempts:
            return CorruptCheckpointError(self.attempts[-1].where, self.attempts[-1].reason)
        gone = f"step {step} is not (any more) in {directory!r}{why}" if self.attempts else None
        return CheckpointNotFoundError(f"{directory}/<step {step}>", gone)


async def restore_first(
    listing: Listing,
    target: Any,
    keys: Sequence[str] | None,
    strict: bool,
    *,
    relist: Callable[[], Awaitable[Listing]] | None = None,
) -> Attempt | Failed:
    """Load the first of ``listing``'s tries (newest first) that loads whole: its Attempt.
    One that is corrupt or unreadable is logged and the next is tried; one that does not
    fit what was asked raises (no older step would fit better). Every member passes the
    same tries.

    A reader beside a writer passes ``relist``: what it chose may go away as it reads it
    (retention), and newer steps come. After a failure, and once every try failed, it
    lists again; if the directory moved on, it starts over with the new listing (newest
    first), at most RELISTS times. A step that went away is no failure of its own: it is
    not warned about."""
    failed: list[Attempt] = []
    warned: set[tuple[int, int, str]] = set()
    relists, i = 0, 0
    while True:
        tried: tuple[Member, Attempt] | None = None
        if i < len(listing.tries):
            member, record = listing.tries[i]
            attempt = await member.attempt(record, target, keys, strict)
            if attempt.outcome == "ok":
                return attempt
            if attempt.outcome == "mismatch":
                raise attempt.error if attempt.error is not None else StateMismatchError(attempt.reason)
            failed.append(attempt)
            tried = (member, attempt)
        fresh = await relist() if relist is not None and relists < RELISTS else None
        if fresh is not None and fresh.mark != listing.mark:
            relists += 1
            if tried is not None and fresh.holds(tried[0], tried[1].record):
                _warn_once(warned, *tried, "listing the directory again")
            elif tried is not None:
                where, why = tried[1].where, tried[1].reason
                logger.info("checkpoint %s went away as it was read (%s); listing again", where, why)
            listing, i = fresh, 0
            continue
        if tried is None:  # every try failed (or there were none), and the directory holds still
            return Failed(failed, listing, relists)
        _warn_once(warned, *tried, "falling back to an older one")
        i += 1


def _warn_once(warned: set[tuple[int, int, str]], member: Member, tried: Attempt, then: str) -> None:
    key = (id(member), tried.record.step, tried.record.file)
    if key in warned:
        return
    warned.add(key)
    # Shown whether or not logging is configured: a fallback trains the steps since the
    # older checkpoint again, and a damaged disk deserves the user's attention.
    what = "failed verification" if tried.outcome == "corrupt" else "cannot be read"
    notice(logger, f"checkpoint {tried.where} {what} ({tried.reason}); {then}")


def _entries(body: Any) -> int:
    """How many boxes and leaves a report (undecoded) holds: how much work it is."""
    if not isinstance(body, dict):
        return 0
    return sum(len(body.get(k) or ()) for k in ("shards", "leaves"))
