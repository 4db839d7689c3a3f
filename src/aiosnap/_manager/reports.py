"""Steady-state reports: what a rank tells rank 0 at a save, once rank 0 holds it.

In a steady run a rank's layout (the boxes of its DTensors) is the same from one save
to the next, and so is every leaf but the few that differ between ranks (RNG states).
Sent whole, that is ~160 KB per rank and commit for a 7B model over FSDP, 160 MB to
rank 0 at 1,024 ranks. So a rank whose layout is the one of its last committed report
sends a digest of it (``compact``), and its leaves as one digest of those every rank
shares plus the few that differed between ranks (``leaves_base``). Rank 0 keeps each
rank's last committed layout (``Keeper``) and expands the digests before
``decisions.commit``; what it cannot expand (it restarted, its last commit failed, a
digest is not the one it holds) it asks for again (``CommitVerdict.resend``), in the
same turn: at worst one more exchange, never a wrong manifest.

When every rank's layout is the one of the last commit, the DTensors' index is too:
rank 0 takes the fields of the manifest that the boxes decide from the last commit,
instead of indexing ~900,000 boxes again at 1,024 ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, final

from .._base import heap as _heap
from .._base.typed import decode, encode
from .._dist.decisions import Refused, commit, decoded
from .._dist.messages import FileReport, ShardBox
from .._format.manifest import Manifest


def digest(value: object) -> str:
    """A 128-bit digest of a JSON value: equal digests stand for equal values."""
    data = json.dumps(value, separators=(",", ":"), sort_keys=True).encode()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def layout_digest(shards: Sequence[ShardBox]) -> str:
    return digest([[b.path, b.name, b.dtype, b.shape, b.offsets, b.lengths] for b in shards])


def leaves_digest(leaves: dict[str, str], per_rank: Sequence[str]) -> str:
    """A digest of the leaves outside ``per_rank`` (and of ``per_rank`` itself)."""
    skip = set(per_rank)
    return digest([sorted(skip), sorted((p, d) for p, d in leaves.items() if p not in skip)])


@final
class Sender:
    """What one rank sent at the group's last commit, to send only a digest of it next."""

    def __init__(self) -> None:
        self.layout = ""
        #: The leaves that differed between ranks at the last commit (None: no commit).
        self.per_rank: list[str] | None = None

    def prepare(self, report: FileReport, whole: bool) -> tuple[Any, str]:
        """The body to send of ``report`` (encoded; ``whole``: not compacted, as rank 0's
        own, which it needs whole), and its layout's digest. Blocking (hashing)."""
        with _heap.gc_paused():
            return self._prepare(report, whole)

    def _prepare(self, report: FileReport, whole: bool) -> tuple[Any, str]:
        layout = layout_digest(report.shards)
        full = replace(report, layout=layout)
        if whole or report.skipped:
            return encode(full), layout
        if layout == self.layout:
            full = replace(full, shards=[], compact=True)
        if self.per_rank is not None and report.leaves:
            keep = set(self.per_rank)
            own = {p: d for p, d in report.leaves.items() if p in keep}
            full = replace(full, leaves=own, leaves_base=leaves_digest(report.leaves, self.per_rank))
        return encode(full), layout

    def committed(self, layout: str, per_rank: list[str]) -> None:
        self.layout, self.per_rank = layout, per_rank


@final
@dataclass(frozen=True, slots=True)
class Held:
    """What rank 0 holds after a commit: each rank's layout (digest, and its boxes as
    JSON text: one object, not a million for the collector to walk at 1,024 ranks), the
    manifest's fields the boxes decide, and the per-rank leaves."""

    layouts: dict[int, tuple[str, str]]
    derived: dict[str, Any]
    per_rank: list[str]


@final
@dataclass(frozen=True, slots=True)
class Settled:
    """Rank 0's outcome of a save's reports: the manifest (None: a rank skipped), or the
    ranks to send their whole report again; and what to hold once it is committed."""

    manifest: Manifest | None = None
    resend: list[int] = dataclasses.field(default_factory=list)
    held: Held | None = None


@final
class Collected:
    """The reports of one save's vote on rank 0, across its exchanges."""

    def __init__(self) -> None:
        self.reports: list[FileReport] = []
        #: The boxes sent whole in this vote, as JSON text (what ``Held`` keeps).
        self.texts: dict[int, str] = {}
        #: Ranks whose boxes are those rank 0 holds (their digest matched): decoded only
        #: if the index must be built again.
        self.held: set[int] = set()

    def take(self, r: int, report: FileReport, body: Any) -> None:
        if not report.compact:
            self.texts[r] = json.dumps(body["shards"], separators=(",", ":"))


@final
class Keeper:
    """Rank 0's side: each rank's last committed layout, and the last DTensor index."""

    def __init__(self) -> None:
        self.held: Held | None = None

    def adopt(self, held: Held | None) -> None:
        """The manifest built with ``held`` is durable: the next digests refer to it.

        What the last commit held is freed here a rank at a time (``release``); a large
        group's adopt runs in a worker thread. Its digests are the only objects left of
        the first commit's reports in the memory arenas those filled: dropped at once on
        the loop, at 1,024 ranks, they gave ~1 GiB of arenas back to the system in one
        stall of ~100 ms."""
        if held is None:
            return
        old, self.held = self.held, held
        if old is not None and old is not held:
            _heap.release(old.layouts, per=16)  # the new one's are other tuples

    def settle(
        self,
        step: int,
        epoch: int | None,
        bodies: list[Any],
        first: Collected,
        replicated: Sequence[str],
        large: bool = True,
    ) -> Settled:
        """The manifest of ``step`` from every rank's body; ``first`` keeps the reports of
        the first round when some ranks must send theirs again (the bodies of the second
        round are those ranks' whole reports, None elsewhere). Blocking.

        The collector is held off meanwhile: what this builds for 1,024 ranks (a million
        objects) would set off full collections, each a stall of every thread for a
        second; what is kept goes straight to the oldest generation (``large``: else the
        few objects of a small group's are left to it)."""
        if not large:
            return self._settle(step, epoch, bodies, first, replicated)
        with _heap.gc_paused(keep=True):
            settled = self._settle(step, epoch, bodies, first, replicated)
        if not settled.resend:
            # The vote's reports are done with: freed here, a rank at a time, not at the
            # vote's end on the loop (1,024 first reports: a million objects, ~0.3 s).
            _heap.release_each(first.reports)
        return settled

    def _settle(
        self,
        step: int,
        epoch: int | None,
        bodies: list[Any],
        first: Collected,
        replicated: Sequence[str],
    ) -> Settled:
        if not first.reports:
            reports = decoded(FileReport, bodies)
            for r, report in enumerate(reports):
                first.take(r, report, bodies[r])
            resend = self._expand(reports, first.held)
            first.reports = reports
            if resend:
                return Settled(resend=resend)
        else:
            redone = decoded(FileReport, [b if b is not None else encode(FileReport()) for b in bodies])
            for r, report in enumerate(redone):
                if first.reports[r].compact or first.reports[r].leaves_base:
                    if bodies[r] is None or report.compact or report.leaves_base:
                        raise Refused({r: "did not send its whole report when rank 0 asked for it"})
                    first.reports[r] = report
                    first.take(r, report, bodies[r])
                    first.held.discard(r)
        return self._build(step, epoch, first, replicated)

    def _expand(self, reports: list[FileReport], kept_boxes: set[int]) -> list[int]:
        """Replace each digest in ``reports`` by what it stands for (boxes: only noted in
        ``kept_boxes``, see ``_build``); the ranks whose digests rank 0 cannot expand."""
        held, own, resend = self.held, reports[0], []
        shared: dict[str, str] = {}
        base = ""
        if held is not None:
            skip = set(held.per_rank)
            shared = {p: d for p, d in own.leaves.items() if p not in skip}
            base = leaves_digest(own.leaves, held.per_rank)
        for r, x in enumerate(reports):
            if x.compact:
                kept = held.layouts.get(r) if held is not None else None
                if kept is None or kept[0] != x.layout:
                    resend.append(r)
                    continue
                x = replace(x, compact=False)
                kept_boxes.add(r)
            if x.leaves_base:
                if not base or x.leaves_base != base:
                    resend.append(r)
                    continue
                x = replace(x, leaves={**shared, **x.leaves}, leaves_base="")
            reports[r] = x
        return resend

    def _build(self, step: int, epoch: int | None, got: Collected, replicated: Sequence[str]) -> Settled:
        reports = got.reports
        bare = [replace(x, shards=[]) for x in reports]
        held = self.held
        if held is not None and _same_layouts(held, reports):
            # The same boxes as at the last commit: the same index, already checked.
            manifest = commit(step, epoch, bare, replicated)
            manifest = None if manifest is None else replace(manifest, **held.derived)
            derived = held.derived
        else:
            if got.held:  # some boxes are the ones held: all are needed for the index
                assert held is not None
                for r in got.held:
                    reports[r] = replace(reports[r], shards=_boxes(held.layouts[r][1]))
            manifest = commit(step, epoch, reports, replicated)
            if manifest is None:
                return Settled()
            without = commit(step, epoch, bare, replicated)
            assert without is not None
            derived = {
                f.name: getattr(manifest, f.name)
                for f in dataclasses.fields(manifest)
                if getattr(manifest, f.name) != getattr(without, f.name)
            }
        if manifest is None:
            return Settled()
        texts = (
            {r: got.texts[r] if r in got.texts else held.layouts[r][1] for r in range(len(reports))}
            if held
            else got.texts
        )
        layouts = {r: (x.layout, texts[r]) for r, x in enumerate(reports)}
        return Settled(manifest, held=Held(layouts, derived, list(manifest.per_rank)))


def _same_layouts(held: Held, reports: list[FileReport]) -> bool:
    """Whether every rank's boxes are those of the last commit (each digest is known)."""
    kept = held.layouts
    return len(kept) == len(reports) and all(
        x.layout and r in kept and kept[r][0] == x.layout for r, x in enumerate(reports)
    )


def _boxes(text: str) -> list[ShardBox]:
    return decode(FileReport, {"shards": json.loads(text)}).shards
