"""What the manager remembers of each checkpoint (the index's history entries)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, final


@final
@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """One committed checkpoint: where, when, how it went, and what the user attached."""

    step: int
    file: str
    epoch: int | None = None
    wall_time: float = 0.0
    bytes: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    corrupt: str | None = None  # the reason restore refused it, once it has

    def to_json(self) -> dict[str, Any]:
        # Not dataclasses.asdict: its deep copy is most of the cost of writing an index
        # of 10,000 records. The dicts are copied one level deep; what they hold is JSON.
        return {
            "step": self.step,
            "file": self.file,
            "epoch": self.epoch,
            "wall_time": self.wall_time,
            "bytes": self.bytes,
            "metrics": dict(self.metrics),
            "metadata": dict(self.metadata),
            "timings": dict(self.timings),
            "corrupt": self.corrupt,
        }

    @classmethod
    def from_json(cls, data: Any) -> CheckpointRecord:
        """Parse an index entry; raise ValueError if it is malformed. Every field is
        checked: a wrong type would fail far from the index (retention subtracts wall
        times), or be taken for a verdict (any ``corrupt`` value hides a checkpoint)."""
        if not isinstance(data, dict) or not _is_int(data.get("step")) or "file" not in data:
            raise ValueError(f"bad index entry {data!r:.80}")
        names = {f.name for f in dataclasses.fields(cls)}
        record = cls(**{k: v for k, v in data.items() if k in names})
        if not record._well_typed():
            raise ValueError(f"bad index entry {data!r:.80}")
        return record

    def _well_typed(self) -> bool:
        return (
            isinstance(self.file, str)
            and (self.epoch is None or _is_int(self.epoch))
            and _is_real(self.wall_time)
            and _is_int(self.bytes)
            and self.bytes >= 0
            and isinstance(self.metrics, dict)
            and isinstance(self.metadata, dict)
            and isinstance(self.timings, dict)
            and all(isinstance(k, str) and _is_real(v) for k, v in self.timings.items())
            and (self.corrupt is None or isinstance(self.corrupt, str))
        )

    def replace(self, **changes: Any) -> CheckpointRecord:
        return dataclasses.replace(self, **changes)


def _is_int(value: object) -> bool:
    # Integral, not int: records also cross between ranks as objects, and a step or
    # epoch the caller gave may be a NumPy integer. Never a bool: True is no step.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A finite number (JSON reads 1e999 as inf, and an int can exceed any float)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    if isinstance(value, numbers.Integral):
        return abs(int(value)) < 1 << 63
    return math.isfinite(value)
