"""The group manifest at scale (issue 42): its size, rank 0's cost to build it, each
rank's cost to parse it and to plan its own reads from it.

For ``Layout(n, n)`` (llama-7B under FSDP2) and ``Layout(n, 64)`` (HSDP-64) from
``scale_layouts``, the reports every rank would send go through the real
``decisions.commit`` and ``Manifest.to_bytes`` (rank 0), then ``Manifest.parse`` and one
rank's restore plan at 0.8 n ranks, resharded (each rank of a restoring FSDP group,
``Shard(0)`` over 0.8 n ranks: the saved boxes each of its boxes overlaps, and the byte
runs to read of each). No files: the plan is what ``_load.boxes`` computes before it
opens any.

    PYTHONPATH=src python -m benchmarks.scale_manifest [sizes...]

``manifest_rows(sizes)`` gives the table as dicts (``bench_scale`` prints it too).
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from aiosnap._dist import decisions
from aiosnap._format.dtypes import TORCH_DTYPES
from aiosnap._format.manifest import Manifest, SavedBox, SavedTensor
from aiosnap._format.shards import Box, Run, runs

try:
    from benchmarks.scale_layouts import Layout, _chunk
except ImportError:  # run as a script from benchmarks/
    from scale_layouts import Layout, _chunk  # type: ignore[no-redef]

SIZES = (8, 64, 256, 1024, 4096, 10000)


def _reads(saved: SavedTensor, box: Box, itemsize: int) -> Iterator[tuple[SavedBox, list[Run]]]:
    """What the loader plans for ``box``: each saved box it overlaps and the runs of it."""
    if hasattr(saved, "overlapping"):  # a grid's: only the cells the box meets
        found: Iterator[SavedBox] = saved.overlapping(box)
    else:  # the code before issue 42 (fbf3ac5): every saved box is intersected
        found = (sb for sb in saved.boxes if (o := sb.box.intersect(box)) is not None and o.numel)
    for sb in found:
        yield sb, list(runs(sb.box, box, itemsize))


def restore_plan(manifest: Manifest, world: int, rank: int) -> int:
    """Plan ``rank``'s reads at ``world`` ranks, each DTensor ``Shard(0)`` over them (as
    FSDP2 reshards): the number of runs it would read."""
    count = 0
    for saved in manifest.shards.values():
        shape = tuple(saved.shape)
        offset, length = _chunk(shape[0], world, rank)
        if not length:
            continue
        box = Box((offset, *[0] * (len(shape) - 1)), (length, *shape[1:]))
        itemsize = TORCH_DTYPES[saved.dtype].itemsize
        count += sum(len(pieces) for _, pieces in _reads(saved, box, itemsize))
    return count


def manifest_row(size: int, shard: int) -> dict[str, Any]:
    """One line of the table: ``size`` ranks, DTensors sharded over ``shard`` of them."""
    reports = list(Layout(size, shard).reports())
    gc.collect()
    start = time.process_time()
    manifest = decisions.commit(1000, None, reports, [])
    assert manifest is not None
    raw = manifest.to_bytes()
    commit_s = time.process_time() - start
    del reports
    gc.collect()
    start = time.process_time()
    parsed = Manifest.parse("aiosnap-manifest.json", raw)
    parse_s = time.process_time() - start
    world = max(1, size * 4 // 5)
    start = time.process_time()
    n_runs = restore_plan(parsed, world, world // 2)
    plan_s = time.process_time() - start
    return {
        "ranks": size,
        "layout": "FSDP" if shard == size else f"HSDP-{shard}",
        "manifest_bytes": len(raw),
        "commit_s": round(commit_s, 3),
        "parse_s": round(parse_s, 4),
        "plan_s": round(plan_s, 4),
        "plan_runs": n_runs,
    }


def manifest_rows(sizes: Sequence[int] = SIZES) -> list[dict[str, Any]]:
    """The table: each size with the FSDP layout, then with HSDP-64 (where it divides)."""
    rows = []
    for size in sizes:
        rows.append(manifest_row(size, size))
        if size % 64 == 0 and size > 64:
            rows.append(manifest_row(size, 64))
    return rows


HEADER = (
    "| ranks | layout | manifest | commit + to_bytes | parse | one rank's plan (0.8 n) |\n"
    "|---:|---|---:|---:|---:|---:|"
)


def print_rows(rows: Sequence[dict[str, Any]]) -> None:
    for r in rows:
        print(
            f"| {r['ranks']:,} | {r['layout']} | {r['manifest_bytes'] / 1e6:.2f} MB | {r['commit_s']:.2f} s "
            f"| {r['parse_s']:.3f} s | {r['plan_s']:.3f} s |",
            flush=True,
        )


if __name__ == "__main__":
    print(HEADER)
    for n in [int(a) for a in sys.argv[1:]] or SIZES:
        print_rows(manifest_rows([n]))
