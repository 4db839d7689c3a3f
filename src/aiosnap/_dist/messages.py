"""What ranks tell each other: small frozen dataclasses, sent as JSON.

Messages cross between processes, so they are decoded with every field checked
against its annotation (``_base.typed``); nothing here is pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


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
    #: A digest of ``shards`` (``_manager.reports``). With ``compact``, ``shards`` is
    #: left out: it is the one this rank sent under this digest, which rank 0 keeps.
    layout: str = ""
    compact: bool = False
    #: If set, ``leaves`` holds only the paths that differed between ranks at the last
    #: commit; every other leaf is rank 0's, and this is a digest of them (and of those
    #: paths) as this rank holds them. Rank 0 asks for the whole map if its own differ.
    leaves_base: str = ""


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
    #: The leaves that differ between ranks (the manifest's), for the next reports.
    per_rank: list[str] = field(default_factory=list)
    #: Ranks whose compact report rank 0 cannot expand (it does not hold what the digest
    #: stands for): each sends its whole report again, in the same turn.
    resend: list[int] = field(default_factory=list)
    #: The manifest rank 0 committed, for the leaders of the other nodes to write in
    #: theirs (only in a group of several nodes, ``_manager.nodes``).
    manifest: str = ""
    #: The steps rank 0 keeps once this one is committed: the other nodes keep the same.
    kept: list[int] = field(default_factory=list)


# -- the channel's own envelopes (``_dist.coord``) --------------------------------------------
@dataclass(frozen=True, slots=True)
class Envelope:
    """One rank's message of one exchange: its place in the order of exchanges (``seq``,
    ``op``, which rank 0 checks) and the body."""

    seq: int
    op: str
    body: Any

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "op": self.op, "body": self.body}  # the body as it is: no copy


@dataclass(frozen=True, slots=True)
class Outcome:
    """Rank 0's answer to an exchange: its decision (``ok``), or the ranks that failed it
    and why; ``broken``: the exchange is torn, and the channel cannot be used again."""

    ok: Any = None
    failed: dict[str, str] | None = None
    broken: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "failed": self.failed, "broken": self.broken}


@dataclass(frozen=True, slots=True)
class WorkState:
    """How a rank's work in an ``agree`` goes: still busy, done (its result), or failed
    (why)."""

    state: Literal["busy", "done", "failed"]
    result: Any = None
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "result": self.result, "why": self.why}


@dataclass(frozen=True, slots=True)
class Round:
    """Rank 0's decision after a round of ``WorkState``: wait for another, or the value."""

    wait: bool
    value: Any = None

    def to_json(self) -> dict[str, Any]:
        return {"wait": self.wait, "value": self.value}
