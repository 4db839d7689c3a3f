"""Shards and group decisions as pure functions: no process group, no gloo.

White-box: the shard arithmetic (``aiosnap._format.shards``), rank 0's decisions
(``aiosnap._dist.decisions``) and the typed messages between ranks are internal pure
functions, tested directly.
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Partial, _StridedShard

import aiosnap
from aiosnap._base.typed import decode, encode
from aiosnap._dist.decisions import Refused, commit, judge_restore, per_rank_paths
from aiosnap._dist.messages import FileReport, LoadReport, ShardBox
from aiosnap._format.manifest import Manifest, refused_per_rank
from aiosnap._format.shards import Box, is_writer, local_box, runs, tiles
from aiosnap._load.readers import split


def _brute(saved: Box, target: Box, shape: tuple[int, ...]) -> torch.Tensor:
    """The target box filled from the saved box, element by element."""
    whole = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    out = torch.full(target.lengths, -1, dtype=whole.dtype)
    overlap = saved.intersect(target)
    if overlap is not None:
        src = whole[tuple(slice(o, o + n) for o, n in zip(overlap.offsets, overlap.lengths, strict=True))]
        rel = tuple(
            slice(o - t, o - t + n)
            for o, t, n in zip(overlap.offsets, target.offsets, overlap.lengths, strict=True)
        )
        out[rel] = src
    return out


def _by_runs(saved: Box, target: Box, shape: tuple[int, ...], limit: int) -> torch.Tensor:
    whole = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    stored = whole[
        tuple(slice(o, o + n) for o, n in zip(saved.offsets, saved.lengths, strict=True))
    ].contiguous()
    raw = stored.reshape(-1).view(torch.uint8)
    out = torch.full(target.lengths, -1, dtype=whole.dtype)
    for run in runs(saved, target, whole.element_size()):
        for piece in split(run, limit, whole.element_size()):
            k = len(piece.dst) - len(piece.shape)
            index = (
                *piece.dst[:k],
                *(slice(d, d + n) for d, n in zip(piece.dst[k:], piece.shape, strict=True)),
            )
            view = out[index] if index else out
            view.copy_(raw[piece.src : piece.src + piece.nbytes].view(whole.dtype).view(piece.shape))
    return out


def _random_box(rng: random.Random, shape: tuple[int, ...]) -> Box:
    offsets, lengths = [], []
    for n in shape:
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        offsets.append(a)
        lengths.append(b - a)
    return Box(tuple(offsets), tuple(lengths))


def test_runs_read_exactly_the_overlap() -> None:
    rng = random.Random(0)
    for _ in range(1500):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(0, 4)))
        saved, target = _random_box(rng, shape), _random_box(rng, shape)
        limit = rng.choice([8, 24, 1 << 20])  # small limits cut runs into pieces
        assert torch.equal(_by_runs(saved, target, shape, limit), _brute(saved, target, shape)), (
            saved,
            target,
        )


def test_a_row_sharded_overlap_is_one_run() -> None:
    assert len(list(runs(Box((0, 0), (5, 6)), Box((3, 0), (7, 6)), 4))) == 1
    (run,) = runs(Box((0, 0), (5, 6)), Box((3, 0), (7, 6)), 4)
    assert (run.src, run.nbytes) == (72, 48)
    assert (
        len(list(runs(Box((0, 0), (10, 6)), Box((0, 2), (10, 2)), 4))) == 10
    )  # a column shard: a run per row


def test_tiles() -> None:
    rows = [Box((0, 0), (3, 6)), Box((3, 0), (3, 6)), Box((6, 0), (4, 6))]
    assert tiles((10, 6), rows)
    assert not tiles((10, 6), rows[:2])  # a hole
    assert not tiles((10, 6), [*rows[:2], Box((5, 0), (5, 6))])  # an overlap
    assert not tiles((10, 6), [*rows[:2], Box((6, 0), (5, 6))])  # outside
    assert tiles((), [Box((), ())])


def test_tiles_finds_an_overlap_of_boxes_far_apart_in_order() -> None:
    # Was: only the next 64 boxes in order of offsets were compared, so a tall box at
    # (0, 0) and the box at (1, 0), 70 apart, overlapped unseen; with a hole at (1, 69)
    # the volumes added up, and a restore returned the hole's memory as it found it.
    boxes = [Box((0, 0), (2, 1)), *(Box((0, j), (1, 1)) for j in range(1, 70))]
    boxes += [Box((1, j), (1, 1)) for j in range(69)]
    assert not tiles((2, 70), boxes)
    assert tiles((2, 70), [Box((0, 0), (2, 1)), *(Box((i, j), (1, 1)) for i in (0, 1) for j in range(1, 70))])


class CountedBox(Box):
    """A Box that counts the comparisons it takes part in (``calls``)."""

    calls = 0

    def intersect(self, other: Box) -> Box | None:
        CountedBox.calls += 1
        return super().intersect(other)


def _wall(rows: int, bricks: int) -> tuple[tuple[int, int, int], list[Box]]:
    """A brick wall: ``rows`` rows of ``bricks`` boxes each, every row's joints shifted
    (no grid of a few cells holds them), each box spanning dimension 0."""
    boxes: list[Box] = []
    for r in range(rows):
        edges = [0, *(r + j * rows for j in range(1, bricks)), bricks * rows]
        boxes += [CountedBox((0, r, a), (2, 1, b - a)) for a, b in itertools.pairwise(edges)]
    return (2, rows, bricks * rows), boxes


def test_tiles_of_irregular_boxes_is_bounded() -> None:
    # Was (in the unfinished fix of the above): every pair of 4,096 bricks that all
    # meet along dimension 0 compared, 49 s. Now a grid of up to GRID_CELLS cells is
    # checked cell by cell, at most MAX_IRREGULAR boxes off it pair by pair, more refused.
    CountedBox.calls = 0
    shape, boxes = _wall(64, 64)  # 4,096 bricks on a grid of 262,080 cells
    assert tiles(shape, boxes)
    assert not tiles(shape, [CountedBox((0, 0, 1), boxes[0].lengths), *boxes[1:]])
    assert not tiles(*_wall(512, 8))  # 4,096 bricks off any grid of 2^18 cells: refused
    assert CountedBox.calls == 0
    shape, boxes = _guillotine(256)  # off any grid of 2^18 cells: compared along the sweep
    assert tiles(shape, boxes) and 0 < CountedBox.calls <= 256 * 255 // 2
    assert not tiles(shape, [*boxes[:-1], Box(boxes[0].offsets, boxes[-1].lengths)])


def _guillotine(n: int) -> tuple[tuple[int, ...], list[Box]]:
    """``n`` boxes made by cutting a cube in two again and again at random places (each
    spanning dimension 0): a tiling whose cuts lie on no small grid."""
    rng, side = random.Random(0), 10**6
    boxes: list[Box] = [CountedBox((0, 0, 0, 0), (2, side, side, side))]
    while len(boxes) < n:
        b = boxes.pop(rng.randrange(len(boxes)))
        d = rng.choice([d for d in (1, 2, 3) if b.lengths[d] > 1])
        cut = rng.randrange(1, b.lengths[d])
        lengths = list(b.lengths)
        lengths[d] = cut
        offsets = list(b.offsets)
        offsets[d] += cut
        rest = list(b.lengths)
        rest[d] -= cut
        boxes += [CountedBox(b.offsets, tuple(lengths)), CountedBox(tuple(offsets), tuple(rest))]
    return (2, side, side, side), boxes


def test_local_box_of_a_huge_dimension_lists_no_indices() -> None:
    # Was: a list of every index of every dimension (list(range(2**62)): MemoryError;
    # 2**31 rows, ~77 GB of ints).
    assert local_box((2**62, 3), (4,), (1,), [Shard(0)], "w") == Box((2**60, 0), (2**60, 3))


@pytest.mark.parametrize(
    ("shape", "mesh", "placements", "boxes"),
    [
        ((10, 3), (4,), [Shard(0)], [((0, 0), (3, 3)), ((3, 0), (3, 3)), ((6, 0), (3, 3)), ((9, 0), (1, 3))]),
        ((5, 3), (4,), [Shard(0)], [((0, 0), (2, 3)), ((2, 0), (2, 3)), ((4, 0), (1, 3)), ((0, 0), (0, 3))]),
        ((8, 6), (4,), [Shard(1)], [((0, 0), (8, 2)), ((0, 2), (8, 2)), ((0, 4), (8, 2)), ((0, 0), (8, 0))]),
        ((8, 6), (2, 2), [Shard(0), Replicate()], [((0, 0), (4, 6))] * 2 + [((4, 0), (4, 6))] * 2),
        (
            (8, 6),
            (2, 2),
            [Shard(0), Shard(1)],
            [((0, 0), (4, 3)), ((0, 3), (4, 3)), ((4, 0), (4, 3)), ((4, 3), (4, 3))],
        ),
        (
            (8, 6),
            (2, 2),
            [_StridedShard(0, split_factor=2), Shard(0)],
            [((0, 0), (2, 6)), ((4, 0), (2, 6)), ((2, 0), (2, 6)), ((6, 0), (2, 6))],
        ),
    ],
)
def test_local_boxes(
    shape: tuple[int, ...], mesh: tuple[int, ...], placements: list[object], boxes: list[object]
) -> None:
    coords = (
        [(c,) for c in range(mesh[0])]
        if len(mesh) == 1
        else [(a, b) for a in range(mesh[0]) for b in range(mesh[1])]
    )
    got = [local_box(shape, mesh, c, placements, "t") for c in coords]
    assert [(b.offsets, b.lengths) for b in got] == boxes
    writers = [b for c, b in zip(coords, got, strict=True) if is_writer(c, placements) and b.numel]
    assert tiles(shape, writers)  # one copy of every element is stored


def test_partial_and_non_box_placements_are_refused() -> None:
    with pytest.raises(aiosnap.errors.UnsupportedTypeError, match="Partial"):
        local_box((4,), (2,), (0,), [Partial()], "model.w")
    with pytest.raises(aiosnap.errors.UnsupportedTypeError, match="not contiguous"):
        local_box((8, 6), (2, 2), (0, 1), [Shard(0), _StridedShard(0, split_factor=2)], "model.w")


def _report(rank: int, leaves: dict[str, str], boxes: list[ShardBox] | None = None) -> FileReport:
    return FileReport(False, f"{rank:08x}", 100, ["0", "00000000"], boxes or [], leaves)


def test_rank_0_commits_with_a_shard_index_and_the_per_rank_leaves() -> None:
    boxes = [ShardBox("m.w", "m.w", "float32", [4, 2], [2 * r, 0], [2, 2]) for r in range(2)]
    reports = [_report(r, {"step": "7", "rank": str(r)}, [boxes[r]]) for r in range(2)]
    manifest = commit(5, None, reports, [])
    assert manifest is not None and manifest.per_rank == ["rank"]
    assert [b.file for b in manifest.shards["m.w"].every_box()] == [0, 1]
    parsed = Manifest.parse("m", manifest.to_bytes())
    assert parsed == manifest
    assert refused_per_rank(parsed, 2, ["rank", "step"]) == []
    assert refused_per_rank(parsed, 3, ["rank", "step", "m.w"]) == ["rank"]
    assert commit(5, None, [_report(0, {}), FileReport(True)], []) is None  # a rank skipped it
    with pytest.raises(Refused) as info:  # two ranks both stored rows 0-1: a hole at 2-3
        commit(5, None, [_report(r, {}, [boxes[0]]) for r in range(2)], [])
    assert "do not cover" in str(info.value.failed)


def test_per_rank_paths_and_restore_verdicts() -> None:
    assert per_rank_paths([_report(0, {"a": "1", "b": "2"})]) == []
    assert per_rank_paths([_report(0, {"a": "1", "b": "2"}), _report(1, {"a": "1", "c": "3"})]) == ["b", "c"]
    ok, corrupt, mismatch = LoadReport("ok"), LoadReport("corrupt", "crc"), LoadReport("mismatch", "shape")
    assert judge_restore([ok, ok]).outcome == "ok"
    assert judge_restore([ok, corrupt]) == LoadReport("corrupt", "rank 1: crc")
    assert judge_restore([corrupt, mismatch]) == LoadReport("mismatch", "rank 1: shape")


def test_messages_are_checked_field_by_field() -> None:
    report = _report(0, {"a": "1"}, [ShardBox("p", "p", "float32", [2], [0], [2])])
    assert decode(FileReport, encode(report)) == report
    for bad in ({"bytes": "100"}, {"shards": [{"path": "p"}]}, {"leaves": {"a": 1}}, {"nope": 1}, []):
        with pytest.raises(ValueError):
            decode(FileReport, bad)
    with pytest.raises(ValueError):
        decode(LoadReport, {"outcome": "fine"})


def test_aiosnap_imports_no_torch_distributed_module_of_its_own() -> None:
    modules = "('aiosnap._dist.coord', 'torch.distributed.tensor')"
    code = f"import sys, aiosnap; print(sorted(m for m in {modules} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_a_rank_derives_its_box_without_the_other_ranks_pieces() -> None:
    """Each rank derives its box of every DTensor at every save: at 100,000 ranks it must
    cost what it costs at 2 (it computed every rank's piece to keep one: 873 DTensors at
    10,000 ranks were 8.7 million pieces per rank per save). A ratio in one run."""
    import time

    def cost(world: int) -> float:
        start = time.process_time()
        for i in range(50):
            box = local_box((10 * world, 4), (world,), (i * world // 50,), [Shard(0)], "w")
            assert box.lengths == (10, 4)
        return time.process_time() - start

    cost(2)  # warm: the first call imports the placement types
    small = min(cost(2) for _ in range(3))
    large = min(cost(100_000) for _ in range(3))
    assert large < 20 * small + 0.05, (small, large)
