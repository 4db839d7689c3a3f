"""Rank 0's decisions, as pure functions of what the ranks reported.

No I/O and no communication here: each function takes the messages of every rank
(``_messages``) and returns what the group does, or raises ``Refused`` naming the
ranks whose part cannot be taken. A single process is a group of one and goes
through the same functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from .._base.typed import decode
from .._format.grids import derive
from .._format.manifest import Manifest, SavedBox, SavedTensor, rank_file
from .._format.shards import tiles
from .messages import FileReport, LoadReport, OpenReport, ShardBox


class Refused(Exception):
    """The ranks in ``failed`` cannot take part as they are: an orderly outcome."""

    def __init__(self, failed: dict[int, str]) -> None:
        super().__init__(failed)
        self.failed = failed


M = TypeVar("M")


def decoded(cls: type[M], bodies: Sequence[Any]) -> list[M]:
    """Every rank's message as a ``cls``; Refused naming the ranks whose did not fit."""
    out, bad = [], {}
    for r, body in enumerate(bodies):
        try:
            out.append(decode(cls, body))
        except ValueError as exc:
            bad[r] = f"sent a malformed {cls.__name__}: {exc}"
    if bad:
        raise Refused(bad)
    return out


def agree_on_config(configs: Sequence[OpenReport]) -> None:
    """Every rank must open the directory as rank 0 did."""
    differ = {r: c for r, c in enumerate(configs) if c != configs[0]}
    if differ:
        raise Refused({r: f"is configured with {c}, rank 0 with {configs[0]}" for r, c in differ.items()})


def commit(
    step: int, epoch: int | None, reports: Sequence[FileReport], replicated: Sequence[str]
) -> Manifest | None:
    """The manifest that commits a step once every rank's file is durable, or None if
    some rank skipped the save; Refused if the ranks' parts do not fit together."""
    if any(r.skipped for r in reports):
        return None
    reference = reports[0].replicated
    differ = {r: x.replicated for r, x in enumerate(reports) if x.replicated != reference}
    if differ:
        raise Refused(
            {
                r: f"holds replicated entries {d} (count, digest) unlike rank 0's {reference}"
                for r, d in differ.items()
            }
        )
    n = len(reports)
    return Manifest(
        step,
        epoch,
        n,
        [rank_file(r) for r in range(n)],
        [x.checksum for x in reports],
        [x.bytes for x in reports],
        list(replicated),
        rank_file(0),
        shard_index(reports),
        per_rank_paths(reports),
    )


def shard_index(reports: Sequence[FileReport]) -> dict[str, SavedTensor]:
    """Where every box of every DTensor lies: a grid rule where one regenerates exactly
    the reported boxes, else the boxes themselves; Refused if the ranks disagree on a
    DTensor's dtype or shape, or if its boxes do not cover it exactly once."""
    found: dict[str, tuple[str, list[int], list[int], list[ShardBox]]] = {}
    for r, report in enumerate(reports):
        for b in report.shards:
            entry = found.get(b.path)
            if entry is None:
                entry = found[b.path] = (b.dtype, b.shape, [], [])
            elif entry[0] != b.dtype or entry[1] != b.shape:
                raise Refused(
                    {r: f"holds {b.path} as {b.dtype} {b.shape}, another rank as {entry[0]} {entry[1]}"}
                )
            entry[2].append(r)
            entry[3].append(b)
    index: dict[str, SavedTensor] = {}
    for path, (dtype, shape, files, boxes) in found.items():
        grid = derive(shape, files, boxes)
        if grid is not None:  # it regenerates every reported box: they tile the shape
            index[path] = SavedTensor(dtype, shape, [], grid)
            continue
        saved = SavedTensor(
            dtype,
            shape,
            [SavedBox(f, b.name, b.offsets, b.lengths) for f, b in zip(files, boxes, strict=True)],
        )
        if not tiles(shape, [b.box for b in saved.boxes]):
            raise Refused(
                {
                    r: f"the shards of {path} do not cover its shape {shape} exactly once"
                    for r in sorted(set(files))
                }
            )
        index[path] = saved
    return index


def per_rank_paths(reports: Sequence[FileReport]) -> list[str]:
    """The leaves that are not the same on every rank (or not on every rank at all)."""
    if len(reports) == 1:
        return []
    first = reports[0].leaves
    differ = {p for r in reports[1:] for p, d in r.leaves.items() if first.get(p) != d}
    differ |= {p for r in reports[1:] for p in first if p not in r.leaves}
    return sorted(differ)


def judge_restore(reports: Sequence[LoadReport]) -> LoadReport:
    """The group's outcome of loading a step: a mismatch with what the caller asked for
    wins (no older step would fit better); then corruption, then a file that is gone or
    not aiosnap's, each of which sends every rank to an older step."""
    for outcome in ("mismatch", "corrupt", "unreadable"):
        found = [(r, x.reason) for r, x in enumerate(reports) if x.outcome == outcome]
        if found:
            reason = found[0][1] if len(reports) == 1 else "; ".join(f"rank {r}: {why}" for r, why in found)
            return LoadReport(outcome, reason)
    return LoadReport("ok")
