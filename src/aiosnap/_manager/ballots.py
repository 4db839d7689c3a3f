"""The saves a Site hands to its writer, and the group's vote on each.

Each save takes its turn in program order (every member of the group takes the same
turns), is handed to the writer, and is voted on in the background: rank 0 commits the
step once every member's file is durable, and each member's handle follows the vote's
outcome. A member whose own save was refused or cancelled still votes, that it failed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, final

import anyio.abc

from .._base.errors import SaveCancelledError, WriterClosedError
from .._format.tree import ExternalLeaves
from .._save.handle import Resolver, SaveHandle
from .._storage.protocol import Storage
from .member import Member
from .records import CheckpointRecord

#: A writer's side of a save: (file name, directory, state) -> the writer's handle.
Accept = Callable[[str, str, object], Awaitable[SaveHandle]]
Report = Callable[[str, BaseException], Any]


@final
class Ballots:
    """The saves of one Site being voted on (see the module's docstring)."""

    def __init__(self, storage: Storage, rank: int, replicated: Sequence[str]) -> None:
        self._storage, self._rank, self._replicated = storage, rank, bool(replicated)
        #: The saves being voted on: each one's handle -> the writer's own (None: the
        #: writer refused it), whose end says the file is durable.
        self._pending: dict[SaveHandle, SaveHandle | None] = {}
        #: The saves of ``_pending`` whose group agreed: what is left is this rank's own.
        self._agreed: set[SaveHandle] = set()
        #: Called each time a vote ends (whoever waits for the votes to settle).
        self.on_settled: Callable[[], object] | None = None
        #: Set as each vote's task ends: after its handle, what follows a commit (a copy
        #: on a partner node) may still run, which ``wait_pending`` waits for too.
        self._tails: set[anyio.Event] = set()

    async def submit(
        self,
        tg: anyio.abc.TaskGroup,
        member: Member,
        record: CheckpointRecord,
        state: object,
        accept: Accept,
        *,
        overwrite: bool,
        check: bool,
        committed: bool,
        outer: Resolver | None,
        report: Report,
        on_control: bool,
    ) -> SaveHandle:
        """Take this save's turn, hand it to the writer (``accept``), and vote on it in the
        background (in ``tg``); the returned handle follows the writer's, its capture
        included (``outer``: resolve this one instead of a new one). ``check``: look
        first at what stands at the step's name (``committed``: the catalog holds the
        step). ``report(path, error)`` records a failure only the Site's owner can report."""
        # The turn is taken now, in program order, as every member does for this call;
        # the vote that fills it runs in the background.
        turn = member.channel(on_control).turn(f"save step {record.step}")
        out_dir, file = member.place(record, self._rank)
        stores = member.stores_replicas or not self._replicated
        target = state if stores else ExternalLeaves(state, member.matches)
        path = self._storage.join(out_dir, file)
        try:
            if check:
                await member.layout.check_vacant(record, committed, overwrite)
            inner = await accept(file, out_dir, target)
        except BaseException as exc:
            # The other members vote on this step all the same: this one votes that it failed.
            failure = (
                exc if isinstance(exc, Exception) else SaveCancelledError("this rank's save was cancelled")
            )
            refused = outer if outer is not None else Resolver(path)
            self._pending[refused.handle] = None
            tg.start_soon(self._vote, member, turn, failure, record, refused, report)
            raise
        if outer is None:
            outer = Resolver(path, following=inner)  # its caller waits for the writer's capture
        self._pending[outer.handle] = inner
        tg.start_soon(self._vote, member, turn, inner, record, outer, report)
        return outer.handle

    async def _vote(
        self,
        member: Member,
        turn: Any,
        inner: SaveHandle | BaseException,
        record: CheckpointRecord,
        outer: Resolver,
        report: Report,
    ) -> None:
        path = outer.handle.path
        tail = anyio.Event()
        self._tails.add(tail)
        try:
            await member.vote(
                turn,
                inner,
                record,
                outer,
                lambda exc: report(path, exc),
                lambda: self._agreed.add(outer.handle),
            )
        finally:
            self._tails.discard(tail)
            tail.set()
            self._agreed.discard(outer.handle)
            self._pending.pop(outer.handle, None)
            if not outer.handle.done():
                outer.fail(WriterClosedError("the manager closed before the save finished"))
            if self.on_settled is not None:
                self.on_settled()

    async def settle_committed(self, size: int) -> None:
        """Wait for what follows each save whose file is durable already (its vote, the
        index, retention, the sweep and blob collection), but for no save still being
        written. A training loop that yields only in its save calls gives those follow-ups
        no other time to run: without this, retention fell behind by hundreds of files."""
        for handle, inner in list(self._pending.items()):
            if size > 1 and handle not in self._agreed:
                # Its vote waits for the other ranks, whose event loops may be blocked
                # where this rank's is not: in a collective of the training step (a
                # synchronous all_reduce) that waits for this rank in turn. Waiting here
                # for their votes hung torchrun runs.
                continue
            if inner is None or inner.done():
                await handle.outcome()

    async def wait_pending(self) -> None:
        """Wait until every save handed over so far has been voted on, and what follows
        its commit has run."""
        for handle in list(self._pending):
            await handle.outcome()
        for tail in list(self._tails):
            await tail.wait()

    def pending(self) -> int:
        return len(self._pending)
