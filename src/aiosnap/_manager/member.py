"""One process's part in a group's checkpoints; a process on its own is a group of one.

Every decision is rank 0's (``_decisions``) and every member learns it through the
channel (``_channel``): which step is latest, whether a save commits, which
checkpoint a restore takes. A save is a two-phase commit: each member writes its part
of the step, reports it once durable, and rank 0 commits the step (writes its
manifest, for a directory per step) only if every member succeeded; any failure,
death or silence makes every member raise RankFailedError and leaves the step
uncommitted, to be swept later. In a group of one the same code runs with a channel
that decides at once, and a failure is raised as itself.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, final

from .._base.errors import (
    CheckpointKeyError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotACheckpointError,
    PickleNotAllowedError,
    RankFailedError,
    StateMismatchError,
)
from .._base.typed import decode, encode
from .._dist.channel import Channel, Turn
from .._dist.decisions import Refused, agree_on_config, commit, judge_restore
from .._dist.messages import FileReport, LoadReport, OpenReport
from .._format.manifest import replicated_matcher
from .._save.handle import Resolver, SaveFailure, SaveHandle, SaveStats
from .catalog import Catalog
from .layouts import Layout
from .records import CheckpointRecord

logger = logging.getLogger(__name__)

#: Errors of a restore that say the caller asked for what the step does not hold as
#: asked: every member raises, and no older step is tried (none would fit better).
_MISMATCH = (StateMismatchError, CheckpointKeyError, PickleNotAllowedError)


@final
class Member:
    """This process's part in a group's checkpoints (see the module docstring)."""

    def __init__(
        self,
        channels: Callable[[], Awaitable[tuple[Channel, Channel]]],
        *,
        rank: int,
        size: int,
        layout: Layout,
        catalog: Catalog | None,
        replicated: Sequence[str],
        where: str,
    ) -> None:
        self._make_channels = channels
        self.rank, self.size = rank, size
        self.layout, self.catalog = layout, catalog  # the catalog is rank 0's
        self.replicated = list(replicated)
        self.matches = replicated_matcher(self.replicated)
        self.where = where
        #: Steps that saves in progress write to: never swept.
        self.busy: set[str] = set()
        self._votes: Channel | None = None
        self._control: Channel | None = None

    @property
    def votes(self) -> Channel:
        assert self._votes is not None
        return self._votes

    # -- lifecycle -----------------------------------------------------------------------
    async def open(self, config: OpenReport, prepare: Callable[[], Awaitable[None]]) -> None:
        """Set up the channels, run ``prepare`` on rank 0 (lock, sweep, index) and check
        that every member is configured alike."""
        self._votes, self._control = await self._make_channels()

        async def work() -> Any:
            if self.rank == 0:
                await prepare()
            return encode(config)

        async def decide(bodies: list[Any]) -> None:
            agree_on_config(_decoded(OpenReport, bodies))

        async with self.votes.turn("open") as turn:
            await turn.agree(work, decide)

    def close(self) -> None:
        """Release the channels. Blocking."""
        for channel in (self._votes, self._control):
            if channel is not None:
                channel.close()

    # -- asking rank 0 -------------------------------------------------------------------
    async def ask(self, op: str, answer: Callable[[], Any]) -> Any:
        """Rank 0's ``answer()``, on every member."""

        async def decide(_: list[Any]) -> Any:
            return answer()

        async with self.votes.turn(op) as turn:
            return await turn.exchange(None, decide)

    async def agree_on_trigger(self, due: bool) -> bool:
        """Rank 0's verdict: clocks differ between ranks, the decision must not."""
        assert self._control is not None

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
    ) -> None:
        """The second phase of a save: wait for this member's part, report it, and let
        rank 0 commit the step (or not); resolve ``outer`` with the outcome. ``turn`` was
        taken when the save was called, so that members take turns in program order."""
        stats: list[SaveStats] = []
        own: list[SaveFailure] = []  # this member's own part, failed

        async def work() -> Any:
            if isinstance(inner, BaseException):
                raise inner
            outcome = await inner.outcome()
            if isinstance(outcome, SaveFailure):
                own.append(outcome)
                raise outcome.error
            stats.append(outcome)
            return encode(await self.layout.report(outcome, self.rank, self.replicated, self.size > 1))

        async def decide(bodies: list[Any]) -> Any:
            manifest = commit(record.step, record.epoch, _decoded(FileReport, bodies), self.replicated)
            if manifest is None:
                return {"committed": False}
            if self.layout.manifests:
                await self.layout.commit(record, manifest)
            return {"committed": True, "bytes": sum(manifest.sizes)}

        self.busy.add(record.file)
        try:
            async with turn:
                verdict = await turn.agree(work, decide)
            if not verdict["committed"]:
                outer.skip()
                return
            if self.catalog is not None:
                await self.catalog.add(record, stats[0], verdict["bytes"])
                await self.layout.sweep(record.step, self.busy)
        except RankFailedError as exc:
            if own:
                # This member's write failed: one failure (the group's, chained from the
                # write's), reported once, through the handle or the writer.
                own[0].error = exc
                outer.fail(own[0])
            elif self.rank in exc.failed:
                outer.fail(exc)  # the save call itself raised: reported already
            else:
                outer.fail(report(exc))
            return
        except Exception as exc:
            if own and exc is own[0].error:
                outer.fail(own[0])  # a group of one: its own failure, as itself
            elif exc is inner:
                outer.fail(exc)  # the save call itself raised it
            else:
                outer.fail(report(exc))
            return
        finally:
            self.busy.discard(record.file)
        outer.finish(stats[0])

    # -- restoring -----------------------------------------------------------------------
    async def restore(
        self, step: int | None, target: Any, keys: Sequence[str] | None, strict: bool
    ) -> tuple[CheckpointRecord, str, Any]:
        """Rank 0 picks the candidates; every member loads its part of one; if any finds
        its part corrupt, rank 0 marks the step and all go on to an older one; if any
        finds the step does not fit what was asked, all raise."""

        async def candidates(_: list[Any]) -> list[Any]:
            assert self.catalog is not None
            steps = [step] if step is not None else sorted(self.catalog.steps(), reverse=True)
            return [self.catalog.records[s].to_json() for s in steps if s in self.catalog.records]

        async with self.votes.turn("restore") as turn:
            for raw in await turn.exchange(None, candidates):
                record = CheckpointRecord.from_json(raw)
                loaded: list[tuple[str, Any]] = []
                mine: list[Exception] = []

                async def work(
                    record: CheckpointRecord = record, loaded: Any = loaded, mine: Any = mine
                ) -> Any:
                    try:
                        loaded.append(
                            await self.layout.load(record, self.rank, self.size, target, keys, strict)
                        )
                    except _MISMATCH as exc:
                        mine.append(exc)
                        return encode(LoadReport("mismatch", str(exc)))
                    except (NotACheckpointError, CheckpointNotFoundError) as exc:
                        return encode(LoadReport("unreadable", str(exc)))
                    except CorruptCheckpointError as exc:
                        return encode(LoadReport("corrupt", str(exc)))
                    return encode(LoadReport("ok"))

                async def decide(bodies: list[Any], step: int = record.step) -> Any:
                    verdict = judge_restore(_decoded(LoadReport, bodies))
                    if verdict.outcome == "corrupt" and self.catalog is not None:
                        await self.catalog.mark_corrupt(step, verdict.reason)
                    elif verdict.outcome == "unreadable" and self.catalog is not None:
                        await self.catalog.mark_unreadable(step, verdict.reason)
                    return encode(verdict)

                verdict = decode(LoadReport, await turn.agree(work, decide))
                if verdict.outcome == "ok":
                    path, state = loaded[0]
                    return record, path, state
                if verdict.outcome == "mismatch":
                    if mine:
                        raise mine[0]
                    raise StateMismatchError(verdict.reason)
                where = self.layout.path(record)
                logger.warning(
                    "checkpoint %s %s (%s); falling back to an older one",
                    where,
                    "failed verification" if verdict.outcome == "corrupt" else "cannot be read",
                    verdict.reason,
                )
                if step is not None:
                    raise CorruptCheckpointError(where, verdict.reason)
        where = self.where if step is None else f"{self.where}/<step {step}>"
        raise CheckpointNotFoundError(
            where, f"no valid checkpoint in {self.where!r}" if step is None else None
        )


def _decoded(cls: type[Any], bodies: list[Any]) -> list[Any]:
    """Every member's message as a ``cls``; Refused naming the members whose did not fit."""
    out, bad = [], {}
    for r, body in enumerate(bodies):
        try:
            out.append(decode(cls, body))
        except ValueError as exc:
            bad[r] = f"sent a malformed {cls.__name__}: {exc}"
    if bad:
        raise Refused(bad)
    return out
