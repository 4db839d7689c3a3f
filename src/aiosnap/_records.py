"""What the manager remembers of each checkpoint (the index's history entries)."""

from __future__ import annotations

import dataclasses
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
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> CheckpointRecord:
        """Parse an index entry; raise ValueError if it is malformed."""
        if not isinstance(data, dict) or not isinstance(data.get("step"), int):
            raise ValueError(f"bad index entry {data!r:.80}")
        names = {f.name for f in dataclasses.fields(cls)}
        record = cls(**{k: v for k, v in data.items() if k in names})
        if not isinstance(record.file, str) or not isinstance(record.metrics, dict):
            raise ValueError(f"bad index entry {data!r:.80}")
        return record

    def replace(self, **changes: Any) -> CheckpointRecord:
        return dataclasses.replace(self, **changes)
