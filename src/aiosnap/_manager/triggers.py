"""When to save: triggers the manager consults in ``should_save``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, Protocol, final


@final
@dataclass(frozen=True, slots=True)
class Moment:
    """A point in training, as a trigger sees it.

    Attributes:
        step: The training step.
        epoch: The epoch, if the caller gave one; else None.
        time: ``time.monotonic()`` when the manager was asked.
    """

    step: int
    epoch: int | None
    time: float


class Trigger(Protocol):
    """Says whether ``now`` is due for a save, given the last save (None before any).

    A trigger whose answer depends only on steps and epochs may say so with a class
    attribute ``deterministic = True``: the ranks of a group then decide alone,
    instead of following rank 0's answer (clocks differ between ranks)."""

    def __call__(self, now: Moment, last: Moment | None) -> bool: ...


def deterministic(trigger: Trigger) -> bool:
    """Whether every rank reaches the same answer from the same steps and epochs."""
    if isinstance(trigger, AnyTrigger):
        return all(deterministic(t) for t in trigger.triggers)
    return getattr(trigger, "deterministic", False) is True


@final
@dataclass(frozen=True, slots=True)
class EveryNSteps:
    """Due when ``step % n == 0`` (step 0 included), at most once per step.

    Args:
        n: The interval in steps.
    """

    deterministic: ClassVar[bool] = True
    n: int

    def __call__(self, now: Moment, last: Moment | None) -> bool:
        return now.step % self.n == 0 and (last is None or last.step != now.step)


@final
@dataclass(frozen=True, slots=True)
class EveryNEpochs:
    """Due when the epoch is given and ``epoch % n == 0``, at most once per epoch.

    Args:
        n: The interval in epochs.
    """

    deterministic: ClassVar[bool] = True
    n: int

    def __call__(self, now: Moment, last: Moment | None) -> bool:
        if now.epoch is None or now.epoch % self.n:
            return False
        return last is None or last.epoch != now.epoch


@final
@dataclass(frozen=True, slots=True)
class EveryNSeconds:
    """Due at the first call, then once ``seconds`` (monotonic) have passed since the last
    save. Clocks differ between ranks: in a group, every rank follows rank 0's answer.

    Args:
        seconds: The least time between two saves.
    """

    seconds: float

    def __call__(self, now: Moment, last: Moment | None) -> bool:
        return last is None or now.time - last.time >= self.seconds


@final
class AtSteps:
    """Due at each of the given steps, at most once per step.

    Args:
        steps: The steps to save at.
    """

    deterministic: ClassVar[bool] = True

    def __init__(self, steps: Iterable[int]) -> None:
        self.steps = frozenset(steps)

    def __repr__(self) -> str:
        return f"AtSteps({sorted(self.steps)})"

    def __call__(self, now: Moment, last: Moment | None) -> bool:
        return now.step in self.steps and (last is None or last.step != now.step)


@final
class AnyTrigger:
    """Due when any of its triggers is; deterministic when all of them are (as
    ``AnyPolicy`` keeps what any of its retention policies keeps).

    Args:
        *triggers: The triggers combined.
    """

    def __init__(self, *triggers: Trigger) -> None:
        self.triggers = triggers

    def __repr__(self) -> str:
        return f"AnyTrigger{self.triggers!r}"

    def __call__(self, now: Moment, last: Moment | None) -> bool:
        return any(t(now, last) for t in self.triggers)
