"""Restoring a step, whichever tier: what each try gave, and trying the newest first.

``Member.attempt`` loads one step on every member; ``restore_first`` tries a listing's
steps, newest first, until one loads whole, and falls back past a corrupt or unreadable
one with a warning the user sees.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, final

from .._base.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateMismatchError,
)
from .._base.notice import notice
from .records import CheckpointRecord

if TYPE_CHECKING:
    from .._storage.protocol import Storage
    from .member import Member

logger = logging.getLogger(__name__)


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


class Backup(Protocol):
    """Where a step directory's rank file that a node lacks or holds damaged is had from
    last, before the step is given up: the remote tier (``Tier``), one file at a time."""

    @property
    def directory(self) -> str: ...

    async def available(self) -> bool:
        """Whether it can be read now; every member at once, and the same on every one."""
        ...

    async def fetch(self, record: CheckpointRecord, rank: int, storage: Storage, path: str) -> None:
        """Copy ``rank``'s file of ``record``'s step to ``path`` in ``storage``, committed
        only once whole (the load that follows checks every byte)."""
        ...


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
