"""What ranks tell each other: small frozen dataclasses, sent as JSON.

Messages cross between processes, so they are decoded with every field checked
against its annotation (``_base.typed``); nothing here is pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, slots=True)
class OpenReport:
    """A rank's configuration at open: every rank must agree with rank 0's."""

    name: str
    replicated: list[str]
    size: int


@dataclass(frozen=True, slots=True)
class ShardBox:
    """One box of a DTensor entry a rank stored: the tree path, the entry's name in the
    rank's file, the dtype, the whole's shape and the box."""

    path: str
    name: str
    dtype: str
    shape: list[int]
    offsets: list[int]
    lengths: list[int]


@dataclass(frozen=True, slots=True)
class FileReport:
    """A rank's part of a save, once its file is durable (or why there is none)."""

    skipped: bool = False
    checksum: str = ""  # the crc32c of the file's header: a summary of every byte
    bytes: int = 0
    #: Count and digest of the replicated entries it describes (they must agree).
    replicated: list[str] = field(default_factory=list)
    shards: list[ShardBox] = field(default_factory=list)
    #: Tree path -> digest of every leaf that is not a shard: rank 0 learns which of
    #: them differ between ranks (per-rank state), and which are the same everywhere.
    leaves: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """How a rank's part of a restore went."""

    #: "unreadable": the file is gone, or is not one aiosnap can read (something else
    #: replaced it); like "corrupt", every rank goes on to an older step.
    outcome: Literal["ok", "corrupt", "unreadable", "mismatch"]
    reason: str = ""


@dataclass(frozen=True, slots=True)
class CommitVerdict:
    """Rank 0's outcome of a save: whether the step committed, and its bytes (every
    rank's file) if it did."""

    committed: bool
    bytes: int = 0
