"""Which checkpoints to keep: a small Protocol and composable policies.

A policy sees the committed, valid checkpoints (oldest first) and names the steps it
wants kept (``AnyPolicy``: what any of several keeps). The manager keeps the union of
that and the newest checkpoint, and only ever deletes checkpoints older than the newest
one, after the newest has committed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, final

from .records import CheckpointRecord


class RetentionPolicy(Protocol):
    """Decides which checkpoints stay."""

    def keep(self, checkpoints: Sequence[CheckpointRecord], now: float) -> set[int]:
        """The steps to keep, out of ``checkpoints`` (sorted by step, oldest first)."""
        ...


@final
@dataclass(frozen=True, slots=True)
class KeepLast:
    """The newest ``n`` checkpoints.

    Args:
        n: How many to keep; at least 1.
    """

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("KeepLast needs n >= 1")

    def keep(self, checkpoints: Sequence[CheckpointRecord], now: float) -> set[int]:
        return {c.step for c in checkpoints[-self.n :]}


@final
@dataclass(frozen=True, slots=True)
class KeepEvery:
    """Checkpoints whose step is a multiple of ``steps`` (permanent milestones).

    Args:
        steps: The interval between kept steps; at least 1.
    """

    steps: int

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError("KeepEvery needs steps >= 1")

    def keep(self, checkpoints: Sequence[CheckpointRecord], now: float) -> set[int]:
        return {c.step for c in checkpoints if c.step % self.steps == 0}


@final
@dataclass(frozen=True, slots=True)
class KeepBest:
    """The ``n`` checkpoints with the best value of ``metric``; those without it (or with
    NaN, a diverged run's loss, or a bool) are not kept.

    Args:
        metric: The name of a metric saved with each checkpoint
            (``manager.save(step, state, metrics={"loss": ...})``).
        mode: ``"min"`` (a loss) or ``"max"`` (an accuracy): which values are best.
        n: How many to keep; at least 1. Ties go to the newer checkpoint.
    """

    metric: str
    mode: Literal["min", "max"] = "min"
    n: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max") or self.n < 1:
            raise ValueError("KeepBest needs mode 'min' or 'max' and n >= 1")

    def keep(self, checkpoints: Sequence[CheckpointRecord], now: float) -> set[int]:
        scored = [c for c in checkpoints if _number(c.metrics.get(self.metric))]
        sign = 1.0 if self.mode == "min" else -1.0
        # Ties go to the newer checkpoint.
        scored.sort(key=lambda c: (sign * float(c.metrics[self.metric]), -c.step))
        return {c.step for c in scored[: self.n]}


def _number(value: object) -> bool:
    # NaN compares false with everything: sorted among numbers it lands anywhere, and
    # was kept as the best loss of a run that diverged.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


@final
@dataclass(frozen=True, slots=True)
class KeepWithin:
    """Checkpoints committed in the last ``seconds``.

    Args:
        seconds: How far back, by the wall clock, from the time the policy is applied.
    """

    seconds: float

    def keep(self, checkpoints: Sequence[CheckpointRecord], now: float) -> set[int]:
        return {c.step for c in checkpoints if now - c.wall_time <= self.seconds}


@final
class AnyPolicy:
    """Keeps what any of its policies keeps (as ``AnyTrigger`` is due when any of its
    triggers is). Formerly ``AnyOf``: that name still works, with a DeprecationWarning.

    Args:
        *policies: The policies combined; at least one.
    """

    def __init__(self, *policies: RetentionPolicy) -> None:
        if not policies:
            raise ValueError("AnyPolicy needs at least one policy")
        self.policies = policies

    def __repr__(self) -> str:
        return f"AnyPolicy{self.policies!r}"

    def keep(self, checkpoints: Sequence[CheckpointRecord], now: float) -> set[int]:
        kept: set[int] = set()
        for policy in self.policies:
            kept |= policy.keep(checkpoints, now)
        return kept


#: Former names of public policies, kept working: the public modules' ``__getattr__``.
FORMER_NAMES: dict[str, type] = {"AnyOf": AnyPolicy}


def former_name(module: str, name: str) -> type:
    """``module.name`` for a former name: its class, with a DeprecationWarning pointing at
    the caller; AttributeError for any other name (a module's ``__getattr__``)."""
    cls = FORMER_NAMES.get(name)
    if cls is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    message = f"{module}.{name} is deprecated: it is {module}.{cls.__name__} (the same class)"
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    return cls


def victims(policy: RetentionPolicy | None, checkpoints: Sequence[CheckpointRecord], now: float) -> list[int]:
    """Steps to delete: not kept by the policy, and older than the newest checkpoint."""
    if policy is None or not checkpoints:
        return []
    ordered = sorted(checkpoints, key=lambda c: c.step)
    kept = policy.keep(ordered, now) | {ordered[-1].step}
    return [c.step for c in ordered if c.step not in kept]
