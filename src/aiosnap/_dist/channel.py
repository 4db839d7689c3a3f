"""How the members of a group take turns and agree, whatever the group.

A ``Channel`` orders exchanges into turns, taken in program order (``turn`` is a
synchronous call, so every member takes its turns in the same order). In a turn,
``exchange`` sends each member's message to rank 0, which decides, and every member
gets the decision; ``agree`` first runs some work on every member. A process on its
own is a group of one: ``LocalChannel`` decides at once, with no messages, and a
failure of its own work is raised as itself. ``_coord.GlooChannel`` is the same over
torch.distributed (gloo), for a real group.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Protocol, Self, final

import anyio

from .._base.errors import CheckpointError
from .decisions import Refused

Decide = Callable[[list[Any]], Awaitable[Any]]


class Turn(Protocol):
    """One member's place in the order of exchanges; ``async with`` waits for it."""

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    async def exchange(self, body: Any, decide: Decide) -> Any:
        """Send ``body``; rank 0 calls ``decide(bodies)`` with every member's, and every
        member returns its result. A failure anywhere raises everywhere."""

    async def agree(self, work: Callable[[], Awaitable[Any]], decide: Decide) -> Any:
        """Run ``work`` on every member; rank 0 then decides over their results."""


class Channel(Protocol):
    rank: int
    size: int

    def turn(self, op: str) -> Turn:
        """Take the next turn (a synchronous call: turns follow program order)."""

    def close(self) -> None:
        """Release what the channel holds. Blocking."""


class Ordered:
    """Turns that wait for the turn before them."""

    def __init__(self, prev: anyio.Event | None, done: anyio.Event) -> None:
        self._prev, self._done = prev, done

    async def __aenter__(self) -> Self:
        if self._prev is not None:
            await self._prev.wait()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._done.set()


@final
class LocalChannel:
    """The channel of a group of one. Its turns do not wait for each other: there are no
    messages to pair up, and saves commit in their writer's order anyway; so asking for
    the steps never waits for a save in flight."""

    rank = 0
    size = 1

    def turn(self, op: str) -> LocalTurn:
        return LocalTurn(None, anyio.Event())

    def close(self) -> None:
        pass


@final
class LocalTurn(Ordered):
    async def exchange(self, body: Any, decide: Decide) -> Any:
        try:
            return await decide([body])
        except Refused as exc:  # no other rank to name: the reason is the error
            raise CheckpointError(exc.failed[0]) from None

    async def agree(self, work: Callable[[], Awaitable[Any]], decide: Decide) -> Any:
        return await self.exchange(await work(), decide)
