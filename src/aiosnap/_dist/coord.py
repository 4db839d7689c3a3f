"""The channel of a real group: torch.distributed (gloo), over a process group of its own.

This and ``_shards`` (for DTensors, which only a user of torch.distributed has) are
the only modules that touch torch.distributed; a single process never imports them.

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
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, final

import anyio
import torch
import torch.distributed as dist

from .._base import offload as _offload
from .._base.errors import RankFailedError
from .._base.typed import decode
from .channel import Decide, Ordered
from .decisions import Refused
from .messages import Envelope, Outcome, Round, WorkState

logger = logging.getLogger(__name__)

#: A message longer than this is refused before anything is allocated for it.
MAX_MESSAGE = 64 << 20
_TAG = 7
M = TypeVar("M")


def rank_and_size(parent: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``parent`` (the default group if None), and its size."""
    if parent is not None:
        return dist.get_rank(parent), dist.get_world_size(parent)
    return dist.get_rank(), dist.get_world_size()


async def channels(parent: dist.ProcessGroup | None, silence: float) -> tuple[GlooChannel, GlooChannel]:
    """Two channels over gloo groups of their own: one for the votes, one for the
    triggers' decisions (those never wait behind a vote)."""
    made = []
    for _ in range(2):
        group = await _offload.run_coord(new_group, parent, silence)
        made.append(GlooChannel(group, timeout=silence, destroy=parent is None))
    return made[0], made[1]


def new_group(parent: dist.ProcessGroup | None, timeout: float) -> dist.ProcessGroup:
    """A gloo group over the ranks of ``parent`` (the default group if None). Blocking.

    Over a subgroup only its members call this, so the group synchronizes locally; such
    a group is named after its ranks, and a name freed by destroying it would be reused
    with the rendezvous keys of the old group still in the store (the next creation
    hangs). So only groups over all ranks are destroyed at close (see ``Channel.close``)."""
    ranks = None if parent is None else dist.get_process_group_ranks(parent)
    group = dist.new_group(
        ranks=ranks,
        backend="gloo",
        timeout=datetime.timedelta(seconds=timeout),
        use_local_synchronization=parent is not None,
    )
    assert isinstance(group, dist.ProcessGroup)  # this rank is a member
    return group


def describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 500 else text[:497] + "..."


@final
class GlooChannel:
    """Exchanges of JSON messages among the ranks of ``group``, through rank 0."""

    def __init__(self, group: dist.ProcessGroup, *, timeout: float, destroy: bool) -> None:
        self.group = group
        self._destroy = destroy
        self.rank = group.rank()
        self.size = group.size()
        self.timeout = timeout
        #: How often ranks that wait for each other's work say they are still alive.
        self.poll = max(0.01, min(timeout / 4, 2.0))
        self._seq = 0
        self._tail: anyio.Event | None = None
        self._broken: RankFailedError | None = None
        #: Buffers of receives that missed their deadline: gloo may still write to them.
        self._stale: list[object] = []

    def turn(self, op: str) -> GlooTurn:
        """Take the next turn; enter it (``async with``) to wait for the earlier ones."""
        prev, done = self._tail, anyio.Event()
        self._tail = done
        return GlooTurn(self, op, prev, done)

    def close(self) -> None:
        """Release the group (destroyed, if it can be: see ``new_group``), and let go of it
        here, in the closing thread. Blocking.

        The offload thread that ran this channel's last exchange may still hold the
        channel (anyio's worker drops the function it ran only after reporting back). Had
        the channel kept the group, that thread could be the one to free it, and freeing a
        ProcessGroup releases the GIL: if the interpreter began to shut down meanwhile,
        the thread is stopped inside a C++ destructor and the process aborts ("terminate
        called without an active exception", 1 run in 5 of the ppe example at 2 ranks)."""
        group = self.group
        del self.group
        self._broken = self._broken or RankFailedError("the channel is closed", {})
        if not self._destroy:
            return
        try:
            dist.destroy_process_group(group)
        except Exception as exc:  # the group may be broken already; closing must not fail
            logger.debug("destroying the coordination group: %r", exc)

    def break_off(self, error: RankFailedError) -> None:
        """Refuse every later exchange with ``error`` (the first break is the one kept):
        once an exchange was abandoned halfway, the ranks' messages no longer pair up."""
        self._broken = self._broken or error

    # -- one exchange --------------------------------------------------------------------
    async def exchange(self, op: str, body: Any, decide: Decide) -> Any:
        if self._broken is not None:
            raise RankFailedError(str(self._broken), self._broken.failed) from self._broken
        self._seq += 1
        envelope = Envelope(self._seq, op, body)
        cause: BaseException | None = None
        if self.rank == 0:
            bodies, failed = await _offload.run_coord(self._gather, envelope)
            if failed:
                verdict = Outcome(failed=_named(failed), broken=True)
            else:
                try:
                    verdict = Outcome(ok=await decide(bodies))
                except Refused as exc:
                    verdict = Outcome(failed=_named(exc.failed))
                except Exception as exc:
                    verdict, cause = Outcome(failed={"0": describe(exc)}), exc
            await _offload.run_coord(self._scatter, verdict, set(failed))
        else:
            try:
                verdict = await _offload.run_coord(self._send_and_receive, envelope)
            except RuntimeError as exc:
                verdict = Outcome(failed={"0": _reason(exc, 2 * self.timeout)}, broken=True)
        if verdict.failed is None:
            return verdict.ok
        failed = {int(r): why for r, why in verdict.failed.items()}
        error = RankFailedError(
            f"{op}: " + "; ".join(f"rank {r} {why}" for r, why in sorted(failed.items())), failed
        )
        if verdict.broken:
            self._broken = error
        raise error from cause

    def _gather(self, envelope: Envelope) -> tuple[list[Any], dict[int, str]]:
        deadline = time.monotonic() + self.timeout
        peers = range(1, self.size)
        bodies: list[Any] = [envelope.body] + [None] * (self.size - 1)
        failed: dict[int, str] = {}
        lengths = {r: torch.zeros(1, dtype=torch.int64) for r in peers}
        waits = {r: self._post_recv(lengths[r], r, failed) for r in peers}
        buffers: dict[int, torch.Tensor] = {}
        for r in peers:
            if self._wait(waits[r], deadline, failed, r, lengths[r]):
                n = int(lengths[r])
                if 0 < n <= MAX_MESSAGE:
                    buffers[r] = torch.empty(n, dtype=torch.uint8)
                else:
                    failed[r] = f"sent a message of {n} bytes"
        waits = {r: self._post_recv(buf, r, failed) for r, buf in buffers.items()}
        for r, buf in buffers.items():
            if self._wait(waits[r], deadline, failed, r, buf):
                message = _message(Envelope, _decode(buf))
                if message is None or (message.seq, message.op) != (envelope.seq, envelope.op):
                    sent = "a malformed message" if message is None else f"{message.op!r} #{message.seq}"
                    failed[r] = (
                        f"is out of step: it sent {sent} while rank 0 is at {envelope.op!r} #{envelope.seq}"
                    )
                else:
                    bodies[r] = message.body
        return bodies, failed

    def _scatter(self, verdict: Outcome, skip: set[int]) -> None:
        deadline = time.monotonic() + self.timeout
        data = _encode(verdict.to_json())
        sends = []
        ignored: dict[int, str] = {}
        for r in range(1, self.size):
            try:
                if r not in skip:
                    sends.append((r, self.group.send([_length(data)], r, _TAG)))
                    sends.append((r, self.group.send([data], r, _TAG)))
            except RuntimeError as exc:  # the peer's connection is already closed
                ignored[r] = _reason(exc, self.timeout)
        for r, work in sends:
            self._wait(work, deadline, ignored, r, None)
        for r, why in ignored.items():
            logger.warning("rank %d did not receive the outcome: it %s", r, why)

    def _send_and_receive(self, envelope: Envelope) -> Outcome:
        # Rank 0 may enter the exchange up to one deadline after this rank does, and
        # then waits up to one deadline for the others: two deadlines in all.
        deadline = time.monotonic() + 2 * self.timeout
        data = _encode(envelope.to_json())
        for work in (self.group.send([_length(data)], 0, _TAG), self.group.send([data], 0, _TAG)):
            _wait_or_raise(work, deadline)
        length = torch.zeros(1, dtype=torch.int64)
        self._stale.append(length)
        _wait_or_raise(self.group.recv([length], 0, _TAG), deadline)
        n = int(length)
        if not 0 < n <= MAX_MESSAGE:
            raise RuntimeError(f"rank 0 sent an outcome of {n} bytes")
        buf = torch.empty(n, dtype=torch.uint8)
        self._stale.append(buf)
        _wait_or_raise(self.group.recv([buf], 0, _TAG), deadline)
        del self._stale[-2:]
        verdict = _message(Outcome, _decode(buf))
        if verdict is None:
            raise RuntimeError("rank 0 sent a malformed outcome")
        return verdict

    def _post_recv(self, buf: torch.Tensor, r: int, failed: dict[int, str]) -> Any:
        # Posting fails at once when the peer's connection is already closed.
        try:
            return self.group.recv([buf], r, _TAG)
        except RuntimeError as exc:
            failed[r] = _reason(exc, self.timeout)
            return None

    def _wait(self, work: Any, deadline: float, failed: dict[int, str], r: int, buf: object) -> bool:
        if r in failed:
            return False
        try:
            _wait_or_raise(work, deadline)
        except RuntimeError as exc:
            failed[r] = _reason(exc, self.timeout)
            if buf is not None:
                self._stale.append(buf)
            return False
        return True


@final
class GlooTurn(Ordered):
    """One rank's place in the order of exchanges; ``async with`` waits for it."""

    def __init__(self, channel: GlooChannel, op: str, prev: anyio.Event | None, done: anyio.Event) -> None:
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
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            try:
                while True:
                    with anyio.move_on_after(self.channel.poll):
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


async def _round(bodies: list[Any], decide: Decide) -> Any:
    states: dict[int, WorkState] = {}
    for r, body in enumerate(bodies):
        try:
            states[r] = decode(WorkState, body)
        except ValueError as exc:
            states[r] = WorkState("failed", why=f"sent a malformed work state: {exc}")
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


class DeadlineMissed(RuntimeError):
    """A peer did not answer before the exchange's deadline."""


def _wait_or_raise(work: Any, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineMissed
    try:
        done = work.wait(datetime.timedelta(seconds=left))
    except RuntimeError as exc:
        # gloo enforces the time given itself, and says so only in words ("Timed out
        # waiting 5000ms for recv operation to complete"): translated here, once.
        if "Timed out" in str(exc):
            raise DeadlineMissed(str(exc)) from exc
        raise
    if not done:
        raise DeadlineMissed


def _reason(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, DeadlineMissed):
        return f"did not answer within {timeout:g} s"
    text = str(exc)
    if "closed" in text.lower() or "reset" in text.lower() or "broken pipe" in text.lower():
        return "is gone: its connection closed (the process died or exited)"
    return f"could not be reached: {text.splitlines()[0][:300] if text else type(exc).__name__}"


def _encode(obj: object) -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _decode(buf: torch.Tensor) -> Any:
    try:
        return json.loads(buf.numpy().tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


def _length(data: torch.Tensor) -> torch.Tensor:
    return torch.tensor([data.numel()], dtype=torch.int64)
