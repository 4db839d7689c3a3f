"""How a real group's ranks exchange and agree, whatever carries their messages.

Every exchange goes through rank 0: each rank sends it a message, rank 0 decides and
sends the decision back to all. Point-to-point messages rather than collectives let
rank 0 name the rank that failed, and every wait has a deadline, so a rank that died
or stopped answering is reported, never waited for forever. Messages are JSON, never
pickle: a peer cannot make another rank run code.

Exchanges run one at a time, in the order their turns were taken (``Channel.turn``,
a synchronous call). Ranks run the same program, so they take turns in the same
order and their exchanges pair up; each message carries its sequence number and
operation, and rank 0 checks that they agree.

A failed exchange (a rank gone, a deadline missed, ranks out of step) *breaks* the
channel: what was sent may be half received, so every later exchange raises at once.
A rank that reports a failure of its own work (a full disk) does not break it: that
is an orderly outcome, and the group can go on.

What carries the messages is a ``Transport``: gloo between processes (``coord``), or
memory between tasks of one event loop (``memory``: tests and benchmarks of large
groups). The logic here is the same for both.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol, TypeVar

import anyio

from .._base import heap as _heap
from .._base import offload as _offload
from .._base.errors import RankFailedError
from .._base.typed import decode
from .channel import Decide, Ordered
from .decisions import Refused
from .messages import Envelope, Outcome, Round, WorkState

#: A message longer than this is refused before anything is allocated for it.
MAX_MESSAGE = 64 << 20
#: Messages of this many bytes in all decode to enough objects to set off collections
#: of the whole heap (a large group's first reports): the collector is held off then.
_MANY_OBJECTS = 1 << 20
#: Up to this many ranks, their work states are decoded on the loop (microseconds).
_FEW = 64
M = TypeVar("M")


class Clock(Protocol):
    def move_on_after(self, seconds: float) -> AbstractContextManager[anyio.CancelScope]:
        """A scope cancelled once ``seconds`` passed (``cancelled_caught`` tells)."""


class RealClock:
    """The event loop's own time: what a real group waits by."""

    @contextmanager
    def move_on_after(self, seconds: float) -> Iterator[anyio.CancelScope]:
        with anyio.move_on_after(seconds) as scope:
            yield scope


class DeadlineMissed(RuntimeError):
    """A peer did not answer before the exchange's deadline."""


class Transport(Protocol):
    """What carries one rank's messages to rank 0 and back. A failure to reach a peer
    raises RuntimeError (DeadlineMissed for silence), which the channel names."""

    rank: int
    size: int
    clock: Clock

    async def gather(self, envelope: Envelope, silence: float) -> tuple[list[Any], dict[int, str]]:
        """Rank 0: every rank's body of ``envelope``'s exchange (``accept``), and the ranks
        that failed it, with why."""

    async def scatter(self, verdict: Outcome, skip: set[int], silence: float) -> None:
        """Rank 0: send ``verdict`` to every rank but ``skip`` (those failed)."""

    async def send_and_receive(self, envelope: Envelope, silence: float) -> Outcome:
        """Another rank: send its envelope, return rank 0's outcome."""

    def close(self) -> None:
        """Release what the transport holds. Blocking."""


def accept(envelope: Envelope, raw: dict[int, bytes]) -> tuple[dict[int, Any], dict[int, str]]:
    """Rank 0's check of what the other ranks sent for ``envelope``'s exchange: each
    one's body, or why it failed (malformed, or out of step). Blocking (JSON).

    ``raw`` is emptied, each message freed once decoded: 1,024 first reports of ~160 KB
    freed at once are one call that gives 160 MB back to the system, the GIL held."""
    if sum(len(data) for data in raw.values()) < _MANY_OBJECTS:
        return _accept(envelope, raw)
    with _heap.gc_paused(keep=True):  # the bodies are kept: rank 0 decides on them
        return _accept(envelope, raw)


def _accept(envelope: Envelope, raw: dict[int, bytes]) -> tuple[dict[int, Any], dict[int, str]]:
    bodies: dict[int, Any] = {}
    failed: dict[int, str] = {}
    for r in list(raw):
        message = _message(Envelope, decode_json(raw.pop(r)))
        if message is None or (message.seq, message.op) != (envelope.seq, envelope.op):
            sent = "a malformed message" if message is None else f"{message.op!r} #{message.seq}"
            failed[r] = f"is out of step: it sent {sent} while rank 0 is at {envelope.op!r} #{envelope.seq}"
        else:
            bodies[r] = message.body
    return bodies, failed


def encode_json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def decode_json(data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


def describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 500 else text[:497] + "..."


def reason(exc: BaseException, timeout: float) -> str:
    """Why a peer failed an exchange, in words, from the transport's error."""
    if isinstance(exc, DeadlineMissed):
        return f"did not answer within {timeout:g} s"
    text = str(exc)
    if "closed" in text.lower() or "reset" in text.lower() or "broken pipe" in text.lower():
        return "is gone: its connection closed (the process died or exited)"
    return f"could not be reached: {text.splitlines()[0][:300] if text else type(exc).__name__}"


class GroupChannel:
    """Exchanges of JSON messages among the ranks of a group, through rank 0."""

    def __init__(self, transport: Transport, *, timeout: float) -> None:
        self.transport = transport
        self.rank, self.size = transport.rank, transport.size
        self.timeout = timeout
        #: How often ranks that wait for each other's work say they are still alive: as
        #: rarely as the deadline allows (each round is a message per rank). A rank's
        #: round reaches rank 0 up to one ``poll`` after rank 0 starts waiting for it,
        #: within its deadline of ``timeout``, with three quarters of it to spare.
        self.poll = max(0.01, timeout / 4)
        self._seq = 0
        self._tail: anyio.Event | None = None
        self._broken: RankFailedError | None = None

    def turn(self, op: str) -> GroupTurn:
        """Take the next turn; enter it (``async with``) to wait for the earlier ones."""
        prev, done = self._tail, anyio.Event()
        self._tail = done
        return GroupTurn(self, op, prev, done)

    def close(self) -> None:
        """Release the transport; later exchanges raise. Blocking."""
        self._broken = self._broken or RankFailedError("the channel is closed", {})
        self.transport.close()

    def break_off(self, error: RankFailedError) -> None:
        """Refuse every later exchange with ``error`` (the first break is the one kept):
        once an exchange was abandoned halfway, the ranks' messages no longer pair up."""
        self._broken = self._broken or error

    async def exchange(self, op: str, body: Any, decide: Decide) -> Any:
        if self._broken is not None:
            raise RankFailedError(str(self._broken), self._broken.failed) from self._broken
        self._seq += 1
        envelope = Envelope(self._seq, op, body)
        cause: BaseException | None = None
        if self.rank == 0:
            bodies, failed = await self.transport.gather(envelope, self.timeout)
            if failed:
                verdict = Outcome(failed=_named(failed), broken=True)
            else:
                try:
                    verdict = Outcome(ok=await decide(bodies))
                except Refused as exc:
                    verdict = Outcome(failed=_named(exc.failed))
                except Exception as exc:
                    verdict, cause = Outcome(failed={"0": describe(exc)}), exc
            if len(bodies) > _FEW:
                # The last reference to every rank's decoded message: freed in a worker, a
                # rank at a time. On the loop, 1,024 ranks' first reports (a million
                # objects, and the memory arenas they filled given back) stalled it 0.3 s.
                # Before the verdict goes out: a cancellation here abandons the exchange.
                await _offload.run_cpu(_heap.release_each, bodies)
            await self.transport.scatter(verdict, set(failed), self.timeout)
        else:
            try:
                verdict = await self.transport.send_and_receive(envelope, self.timeout)
            except RuntimeError as exc:
                verdict = Outcome(failed={"0": reason(exc, 2 * self.timeout)}, broken=True)
        if verdict.failed is None:
            return verdict.ok
        failed = {int(r): why for r, why in verdict.failed.items()}
        error = RankFailedError(
            f"{op}: " + "; ".join(f"rank {r} {why}" for r, why in sorted(failed.items())), failed
        )
        if verdict.broken:
            self._broken = error
        raise error from cause


class GroupTurn(Ordered):
    """One rank's place in the order of exchanges; ``async with`` waits for it."""

    def __init__(self, channel: GroupChannel, op: str, prev: anyio.Event | None, done: anyio.Event) -> None:
        super().__init__(prev, done)
        self.channel, self.op = channel, op

    async def exchange(self, body: Any, decide: Decide) -> Any:
        """Send ``body``; rank 0 calls ``decide(bodies)`` with every rank's, and every
        rank returns its result. A failure anywhere raises RankFailedError everywhere."""
        try:
            return await self.channel.exchange(self.op, body, decide)
        except anyio.get_cancelled_exc_class():
            # Abandoned halfway: the other ranks' messages no longer pair up with ours.
            why = {self.channel.rank: "was cancelled"}
            self.channel.break_off(RankFailedError(f"{self.op}: this rank abandoned an exchange", why))
            raise

    async def agree(self, work: Callable[[], Awaitable[Any]], decide: Decide) -> Any:
        """Run ``work`` on every rank; once all have finished, rank 0 calls ``decide``
        with their results, and every rank returns its result.

        Until then the ranks exchange "still working" every ``poll`` seconds, so the
        deadline bounds how long a rank may stay silent, not how long the work takes.
        If the work of some rank raises, every rank raises RankFailedError naming it
        (chained, on that rank, from its own exception)."""
        outcome: list[Any] = []
        finished = anyio.Event()

        async def run() -> None:
            try:
                outcome.append(("done", await work()))
            except Exception as exc:
                outcome.append(("failed", exc))
            finally:
                finished.set()

        error: Exception | None = None
        clock = self.channel.transport.clock
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            try:
                while True:
                    with clock.move_on_after(self.channel.poll):
                        await finished.wait()
                    raw = await self.exchange(_status(outcome), lambda bodies: _round(bodies, decide))
                    verdict = decode(Round, raw)
                    if not verdict.wait:
                        return verdict.value
            except Exception as exc:  # raised outside the task group, which would wrap it
                error = exc
            finally:
                tg.cancel_scope.cancel()
        assert error is not None
        mine = outcome[0][1] if outcome and outcome[0][0] == "failed" else None
        if isinstance(error, RankFailedError) and mine is not None and self.channel.rank in error.failed:
            raise error from mine
        raise error


def _status(outcome: list[Any]) -> Any:
    if not outcome:
        return WorkState("busy").to_json()
    state, value = outcome[0]
    done = state == "done"
    return (WorkState("done", result=value) if done else WorkState("failed", why=describe(value))).to_json()


def _states(bodies: list[Any]) -> dict[int, WorkState]:
    states: dict[int, WorkState] = {}
    for r, body in enumerate(bodies):
        try:
            states[r] = decode(WorkState, body)
        except ValueError as exc:
            states[r] = WorkState("failed", why=f"sent a malformed work state: {exc}")
    return states


async def _round(bodies: list[Any], decide: Decide) -> Any:
    # One worker-thread call for every rank's state: a large group's are no work for
    # the event loop (the results themselves are ``decide``'s to decode); a small
    # group's cost less than the hop to a thread.
    states = _states(bodies) if len(bodies) <= _FEW else await _offload.run_cpu(_states, bodies)
    failed = {r: s.why for r, s in states.items() if s.state == "failed"}
    if failed:
        raise Refused(failed)
    if any(s.state != "done" for s in states.values()):
        return Round(wait=True).to_json()
    return Round(wait=False, value=await decide([s.result for s in states.values()])).to_json()


def _named(failed: dict[int, str]) -> dict[str, str]:
    """Failed ranks keyed as JSON keys them: strings."""
    return {str(r): why for r, why in failed.items()}


def _message(cls: type[M], data: Any) -> M | None:
    """``data`` decoded as a ``cls``, or None if it does not fit."""
    try:
        return decode(cls, data)
    except ValueError:
        return None
