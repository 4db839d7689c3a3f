"""The compact manifest (format /3): a DTensor's boxes as a grid rule, derived by rank 0
from the boxes the ranks reported, checked at parse in O(dims), and asked directly for
the boxes a restore needs.

White-box: ``decisions.commit`` and ``Manifest.parse`` are pure functions; the boxes
come from ``shards.local_box``, the function a real save derives them with, for every
coordinate of a mesh (its ranks row-major, as ``init_device_mesh`` numbers them).
"""

from __future__ import annotations

import itertools
import json
import math
import random
from typing import Any

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import aiosnap
from aiosnap._base.checksums import crc32c
from aiosnap._dist.decisions import Refused, commit
from aiosnap._dist.messages import FileReport, ShardBox
from aiosnap._format.grids import Grid
from aiosnap._format.manifest import Manifest, SavedTensor
from aiosnap._format.shards import Box, is_writer, local_box

#: (shape, mesh, placements): the layouts a group saves.
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[int, ...], list[Any]]] = {
    "fsdp": ((10, 6), (4,), [Shard(0)]),  # uneven: 3, 3, 3, 1 rows
    "fsdp-empty": ((5, 3), (8,), [Shard(0)]),  # 5 rows over 8 ranks: 3 store nothing
    "shard1": ((6, 7), (3,), [Shard(1)]),  # columns: 3, 3, 1
    "hsdp": ((9, 4), (3, 4), [Replicate(), Shard(0)]),  # only replica group 0 stores
    "hsdp-rows-first": ((9, 4), (4, 3), [Shard(0), Replicate()]),  # files 0, 3, 6, 9
    "2d": ((7, 10), (2, 3), [Shard(0), Shard(1)]),
    "2d-swapped": ((7, 10), (2, 3), [Shard(1), Shard(0)]),  # dim 0 by the inner mesh dimension
    "3d": ((4, 5, 6), (2, 2, 2), [Shard(2), Replicate(), Shard(0)]),
    "replicated": ((3, 3), (4,), [Replicate()]),
    "scalar": ((), (2,), [Replicate()]),
    "nested": ((10,), (2, 2), [Shard(0), Shard(0)]),  # chunks of chunks: 3, 2, 3, 2 (no grid)
    "strided": ((8, 6), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
}
#: Layouts no grid describes: their boxes are listed.
LISTED = {"nested", "strided"}


def reports_of(layouts: dict[str, tuple[tuple[int, ...], tuple[int, ...], list[Any]]]) -> list[FileReport]:
    """What each rank reports of its file: the non-empty boxes it stores."""
    world = max(math.prod(mesh) for _, mesh, _ in layouts.values())
    shards: list[list[ShardBox]] = [[] for _ in range(world)]
    for path, (shape, mesh, placements) in layouts.items():
        for rank, coord in enumerate(itertools.product(*(range(k) for k in mesh))):
            box = local_box(shape, mesh, coord, placements, path)
            if is_writer(coord, placements) and box.numel:
                shards[rank].append(
                    ShardBox(path, path, "float32", list(shape), list(box.offsets), list(box.lengths))
                )
    return [FileReport(False, f"{r:08x}", 100, ["0", "00000000"], s, {}) for r, s in enumerate(shards)]


def reported(reports: list[FileReport], path: str) -> set[tuple[int, str, tuple[int, ...], tuple[int, ...]]]:
    return {
        (r, b.name, tuple(b.offsets), tuple(b.lengths))
        for r, report in enumerate(reports)
        for b in report.shards
        if b.path == path
    }


def as_set(saved: SavedTensor) -> set[tuple[int, str, tuple[int, ...], tuple[int, ...]]]:
    return {(b.file, b.name, tuple(b.offsets), tuple(b.lengths)) for b in saved.every_box()}


def test_grids_regenerate_exactly_the_reported_boxes_and_round_trip() -> None:
    reports = reports_of(LAYOUTS)
    manifest = commit(3, None, reports, [])
    assert manifest is not None
    parsed = Manifest.parse("m", manifest.to_bytes())
    assert parsed == manifest
    for path in LAYOUTS:
        saved = parsed.shards[path]
        assert (saved.grid is None) == (path in LISTED), path
        assert as_set(saved) == reported(reports, path), path
        assert saved.count() == len(reported(reports, path)), path
    assert parsed.shards["hsdp-rows-first"].grid == Grid([3, 4], 0, [3, 0], "hsdp-rows-first")
    assert parsed.shards["2d-swapped"].grid == Grid([3, 5], 0, [1, 3], "2d-swapped")


def test_entry_names_that_differ_between_files_keep_the_boxes_listed() -> None:
    reports = reports_of({"w": LAYOUTS["fsdp"]})
    renamed = reports[2].shards[0]
    reports[2] = FileReport(False, "2", 100, ["0", "00000000"], [ShardBox("w", "w#2", *_spec(renamed))], {})
    manifest = commit(3, None, reports, [])
    assert manifest is not None
    saved = manifest.shards["w"]
    assert saved.grid is None and as_set(saved) == reported(reports, "w")


def test_hand_made_boxes_that_fit_no_grid_are_listed_and_still_checked() -> None:
    boxes = [([0, 0], [2, 6]), ([2, 0], [3, 6]), ([5, 0], [5, 6])]  # uneven by hand
    reports = [
        FileReport(False, f"{r}", 100, [], [ShardBox("w", "w", "float32", [10, 6], o, n)], {})
        for r, (o, n) in enumerate(boxes)
    ]
    manifest = commit(3, None, reports, [])
    assert manifest is not None and manifest.shards["w"].grid is None
    assert as_set(Manifest.parse("m", manifest.to_bytes()).shards["w"]) == reported(reports, "w")
    overlapping = [*reports[:2], reports[1]]  # rows 2-4 twice, 5-9 never
    with pytest.raises(Refused, match="do not cover"):
        commit(3, None, overlapping, [])


def _spec(b: ShardBox) -> tuple[str, list[int], list[int], list[int]]:
    return b.dtype, b.shape, b.offsets, b.lengths


# -- hostile manifests --------------------------------------------------------------------
def _sealed(outer: dict[str, Any]) -> bytes:
    body = json.dumps(outer["body"], sort_keys=True, separators=(",", ":"))
    outer["crc32c"] = f"{crc32c(body.encode()):08x}"
    return json.dumps(outer).encode()


def _valid() -> dict[str, Any]:
    manifest = commit(3, None, reports_of({"w": LAYOUTS["2d"]}), [])  # 6 files, a 2x3 grid
    assert manifest is not None and manifest.shards["w"].grid is not None
    outer: dict[str, Any] = json.loads(manifest.to_bytes())
    return outer


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"pieces": [4]}, "another number of dimensions"),
        ({"strides": [3, 1, 0]}, "another number of dimensions"),
        ({"pieces": [0, 4]}, "longer than its dimension, or empty"),
        ({"pieces": [8, 4]}, "longer than its dimension, or empty"),
        ({"pieces": [1, 1]}, "more cells than the step has files"),  # 70 cells, 6 files
        ({"first": 1}, "not in the step"),
        ({"first": -1}, "not in the step"),
        ({"strides": [3, -1]}, "not in the step"),
        ({"strides": [1, 1]}, "two cells in one file"),
        ({"strides": [0, 1]}, "two cells in one file"),
        ({"pieces": "4"}, "grid.pieces: not a list of ints"),
        ({"first": 1.0}, "grid.first: 1.0 is not an int"),
        ({"first": True}, "grid.first: True is not an int"),
        ({"extra": 1}, "unknown fields"),
    ],
)
def test_a_hostile_grid_is_refused_with_its_reason(change: dict[str, Any], reason: str) -> None:
    outer = _valid()
    outer["body"]["shards"]["w"]["grid"].update(change)
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match=reason) as info:
        Manifest.parse("step/aiosnap-manifest.json", _sealed(outer))
    assert "step/aiosnap-manifest.json" in str(info.value)


def test_a_grid_of_a_trillion_cells_is_refused_without_counting_them() -> None:
    outer = _valid()
    outer["body"]["shards"]["w"] = {
        "dtype": "int8",
        "shape": [10**6, 10**6],
        "boxes": [],
        "grid": {"pieces": [1, 1], "first": 0, "strides": [10**6, 1], "name": "w"},
    }
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="more cells than the step has files"):
        Manifest.parse("m", _sealed(outer))


def test_grids_and_boxes_together_or_in_an_old_format_are_refused() -> None:
    outer = _valid()
    outer["body"]["shards"]["w"]["boxes"] = [{"file": 0, "name": "w", "offsets": [0, 0], "lengths": [7, 10]}]
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="both a grid and boxes"):
        Manifest.parse("m", _sealed(outer))
    outer = _valid()
    outer["format"] = "aiosnap-manifest/2"
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="a grid in a manifest of format"):
        Manifest.parse("m", _sealed(outer))


# -- plans from a grid, as from every box ---------------------------------------------------
def _brute_overlapping(saved: SavedTensor, box: Box) -> list[tuple[int, tuple[int, ...]]]:
    found = []
    for b in saved.every_box():
        overlap = b.box.intersect(box)
        if overlap is not None and overlap.numel:
            found.append((b.file, tuple(b.offsets)))
    return sorted(found)


@pytest.mark.parametrize(("saved_ranks", "shape"), [(1000, (4096, 8)), (96, (11008, 5)), (7, (3, 3, 5))])
def test_a_grid_finds_the_boxes_a_target_meets_as_a_search_of_every_box_does(
    saved_ranks: int, shape: tuple[int, ...]
) -> None:
    layouts = {
        "rows": (shape, (saved_ranks,), [Shard(0)]),
        "cols": (shape, (saved_ranks,), [Shard(1)]),
    }
    manifest = commit(3, None, reports_of(layouts), [])
    assert manifest is not None
    rng = random.Random(saved_ranks)
    for path, saved in manifest.shards.items():
        assert saved.grid is not None, path
        for world in (saved_ranks * 4 // 5, 3, 1):
            for rank in sorted({0, world - 1, rng.randrange(world)}):
                mesh = (world,)
                for placements in ([Shard(0)], [Shard(1)]):
                    box = local_box(shape, mesh, (rank,), placements, path)
                    got = sorted((b.file, tuple(b.offsets)) for b in saved.overlapping(box))
                    assert got == _brute_overlapping(saved, box), (path, world, rank, placements)
        for _ in range(20):  # any box, even one reaching past the tensor
            lo = [rng.randrange(n) for n in shape]
            box = Box(tuple(lo), tuple(rng.randrange(1, n + 2) for n in shape))
            got = sorted((b.file, tuple(b.offsets)) for b in saved.overlapping(box))
            assert got == _brute_overlapping(saved, box), (path, box)


def test_the_manifest_grows_by_a_rank_s_file_checksum_and_size_not_by_its_boxes() -> None:
    """O(DTensors + ranks): 40 row-sharded DTensors at 1,024 ranks add, per rank, its
    file name, checksum and size (about 35 bytes), not a box per DTensor (~85 each)."""

    def size(world: int) -> int:
        layouts = {f"layer{i}.w": ((4096 + i, 8), (world,), [Shard(0)]) for i in range(40)}
        manifest = commit(3, None, reports_of(layouts), [])
        assert manifest is not None
        assert all(s.grid is not None for s in manifest.shards.values())
        return len(manifest.to_bytes())

    small, large = size(64), size(1024)
    assert large - small < 40 * (1024 - 64)
