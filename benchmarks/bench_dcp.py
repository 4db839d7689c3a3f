"""dcp.save through aiosnap's storage writer against DCP's own FileSystemWriter, one run.

    python benchmarks/bench_dcp.py [--size 256MiB] [--reps 5] [--ranks 1,2] [--dir DIR] [--publish]

The same state, ``--size`` in all, is saved by ``dcp.save`` with
``FileSystemWriter(path, sync_files=True)`` (DCP's durable default) and with
``aiosnap.integrations.dcp.AiosnapStorageWriter()``, at each world size of ``--ranks``
(gloo groups on this machine). Each rank holds its ``size / ranks`` shard of every
tensor, as FSDP does: DTensors sharded on dim 0 of a CPU mesh, 16 MiB tensors. Both
writers have written and fsynced everything when ``dcp.save`` returns, so the timed
span is the call. A repetition runs both, in an order that alternates, each into a
fresh checkpoint directory after ``os.sync()`` and a barrier; a time is the slowest
rank's; the ratio is aiosnap's time over FileSystemWriter's in the same repetition
(median over repetitions). Results: ``benchmarks/results/dcp.{md,json}``; ``--publish``
puts the table into docs/benchmarks.md and docs/integration-dcp.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from _harness import file_store, publish
from bench import machine, parse_size

ROOT = Path(__file__).resolve().parent
DOCS = ROOT.parent / "docs"
MiB = 1 << 20
PIECE = 16 * MiB
FSW, AIOSNAP = "FileSystemWriter(sync_files=True)", "AiosnapStorageWriter"


def shard_state(size: int, rank: int, ranks: int) -> dict[str, Any]:
    """``size`` bytes of float32 tensors of ``PIECE`` bytes, this rank's shards of them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (ranks,))
    gen = torch.Generator().manual_seed(rank)
    rows = PIECE // 4 // 1024 // ranks
    return {
        f"layer{i}.weight": DTensor.from_local(
            torch.randn(rows, 1024, generator=gen), mesh, [Shard(0)], run_check=False
        )
        for i in range(max(1, size // PIECE))
    }


def writer(name: str, path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    from aiosnap.integrations.dcp import AiosnapStorageWriter

    return FileSystemWriter(path, sync_files=True) if name == FSW else AiosnapStorageWriter(path)


def timed_save(state: dict[str, Any], name: str, path: Path) -> float:
    import torch.distributed.checkpoint as dcp

    storage_writer = writer(name, path)
    os.sync()
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=storage_writer)
    return time.perf_counter() - t0


def _rank_main(rank: int, ranks: int, store: str, args: argparse.Namespace) -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=ranks, timeout=timedelta(seconds=600)
    )
    scratch = Path(args.scratch)
    state = shard_state(args.bytes, rank, ranks)
    names = [FSW, AIOSNAP]
    for name in names:  # warm: imports, first-touch of the code paths
        timed_save(state, name, scratch / f"warm-{names.index(name)}")
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            local = timed_save(state, name, scratch / f"{names.index(name)}-{rep}")
            gathered: list[Any] = [None] * ranks
            dist.all_gather_object(gathered, local)
            times[name].append(max(gathered))
            if rank == 0:
                shutil.rmtree(scratch / f"{names.index(name)}-{rep}")
            dist.barrier()
    if rank == 0:
        Path(args.result).write_text(json.dumps(times))
    dist.destroy_process_group()


def measure(ranks: int, args: argparse.Namespace, scratch: Path, out: Path) -> dict[str, Any]:
    args.scratch, args.result = str(scratch), str(out / f"dcp-{ranks}.tmp.json")
    store = file_store(scratch / "store")
    if ranks == 1:  # a group of one in this process: no interpreter to start
        _rank_main(0, 1, store, args)
    else:
        mp.start_processes(_rank_main, args=(ranks, store, args), nprocs=ranks, start_method="spawn")
    times = json.loads(Path(args.result).read_text())
    os.unlink(args.result)
    ratios = [a / f for a, f in zip(times[AIOSNAP], times[FSW], strict=True)]
    return {
        "ranks": ranks,
        "times": times,
        "median_s": {name: statistics.median(ts) for name, ts in times.items()},
        "ratio": statistics.median(ratios),
        "ratios": ratios,
    }


def render(rows: list[dict[str, Any]], size: int, reps: int) -> str:
    lines = [
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine().items()),
        "",
        f"### dcp.save of {size / MiB:.0f} MiB of DTensor shards: aiosnap's writer vs FileSystemWriter",
        "",
        f"Median of {reps} repetitions in one run; ratio: aiosnap's time / FileSystemWriter's in the same "
        "repetition (below 1: aiosnap is faster).",
        "",
        f"| ranks | {FSW} s | {AIOSNAP} s | GB/s ({AIOSNAP}) | ratio (median) | ratios |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        fsw, ours = row["median_s"][FSW], row["median_s"][AIOSNAP]
        spread = ", ".join(f"{r:.2f}" for r in row["ratios"])
        gbps = size / ours / 1e9
        cells = [str(row["ranks"]), f"{fsw:.3f}", f"{ours:.3f}", f"{gbps:.2f}", f"{row['ratio']:.2f}"]
        lines.append("| " + " | ".join([*cells, spread]) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="256MiB", help="the whole state, all ranks together (64MiB, 1GiB)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ranks", default="1,2", help="world sizes, comma-separated")
    parser.add_argument("--dir", help="scratch directory on the disk to measure")
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument("--publish", action="store_true", help="put the table into the docs")
    args = parser.parse_args()
    args.bytes = parse_size(args.size)
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="aiosnap-dcp-", dir=ROOT)).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        rows = [measure(int(n), args, scratch, out) for n in args.ranks.split(",")]
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    table = render(rows, args.bytes, args.reps)
    (out / "dcp.md").write_text(table)
    (out / "dcp.json").write_text(
        json.dumps({"machine": machine(), "bytes": args.bytes, "rows": rows}, indent=1)
    )
    print(table)
    if args.publish:
        publish("dcp", table)
        publish("dcp", table, DOCS / "integration-dcp.md")


if __name__ == "__main__":
    main()
