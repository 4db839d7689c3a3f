"""Multi-rank save: aiosnap's CheckpointManager against DCP, 2 ranks on gloo, one run.

    python benchmarks/bench_ranks.py [--size 1GiB] [--reps 3] [--ranks 2] [--dir DIR]

Each rank holds ``size / ranks`` bytes: half of it a "model" that is the same on every
rank (aiosnap: ``replicated=["model.*"]``; DCP deduplicates equal keys itself), half
its own "optim" state. So the bytes that must reach the disk are
``size/(2*ranks) + size/2``. A repetition starts every method from a barrier; a
method's time is the slowest rank's. Aggregate GB/s = unique bytes / call->durable.
The limit row is every rank writing its share (the unique bytes split evenly) with
O_DIRECT-free buffered write + fsync, concurrently. Results go to
``benchmarks/results/ranks.{md,json}``; ``--publish`` appends them to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import aiosnap

sys.path.insert(0, str(Path(__file__).parent))
from _harness import drop_cache, file_store, fsync_path, publish
from _peers import cpu_stager, timed_async_save

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent
PIECE = 16 * MiB


def rank_state(rank: int, per_rank: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    half = per_rank // 2
    model = {f"w{i}": torch.randn(PIECE // 4, generator=gen) for i in range(max(1, half // PIECE))}
    gen.manual_seed(1 + rank)
    optim = {f"r{rank}.m{i}": torch.randn(PIECE // 4, generator=gen) for i in range(max(1, half // PIECE))}
    return {"model": model, "optim": optim}


def unique_bytes(state: dict[str, Any], ranks: int) -> int:
    model = sum(t.numel() * t.itemsize for t in state["model"].values())
    optim = sum(t.numel() * t.itemsize for t in state["optim"].values())
    return model + ranks * optim


def _flat(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    # DCP wants one flat dict; equal "model.*" keys on every rank are written once.
    return {f"{group}.{key}": t for group, part in state.items() for key, t in part.items()}


async def aiosnap_group(state: dict[str, Any], directory: Path, step: int) -> tuple[float, float]:
    async with aiosnap.CheckpointManager(
        str(directory / "aiosnap"),
        ranks=aiosnap.Ranks(replicated=["model.*"], timeout=120),
        keep=aiosnap.retention.KeepLast(1),
    ) as mgr:
        await (await mgr.save(0, state)).wait()  # warm: arenas, threads, channels
        dist.barrier()
        t0 = time.perf_counter()
        handle = await mgr.save(step, state)
        stall = time.perf_counter() - t0
        await handle.wait()  # committed: every rank's file and rank 0's manifest durable
        return stall, time.perf_counter() - t0


def dcp_save(state: dict[str, Any], directory: Path, step: int) -> tuple[float, float]:
    import torch.distributed.checkpoint as dcp

    flat = _flat(state)
    dcp.save(flat, checkpoint_id=str(directory / "dcp-warm"))
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(flat, checkpoint_id=str(directory / f"dcp-{step}"))
    total = time.perf_counter() - t0
    return total, total


def dcp_async_save(state: dict[str, Any], directory: Path, step: int) -> tuple[float, float]:
    import torch.distributed.checkpoint as dcp

    flat = _flat(state)
    stager = cpu_stager()
    try:

        def save(name: str) -> tuple[float, float]:
            checkpoint_id = str(directory / name)
            return timed_async_save(
                lambda: dcp.async_save(flat, checkpoint_id=checkpoint_id, async_stager=stager)
            )

        save("dcpa-warm")
        dist.barrier()
        return save(f"dcpa-{step}")
    finally:
        stager.close()


def raw_write(state: dict[str, Any], directory: Path, step: int, share: int) -> tuple[float, float]:
    parts = [*state["model"].values(), *state["optim"].values()]
    data = torch.cat([t.reshape(-1) for t in parts]).numpy().view("u1")
    data = data[: min(share, data.nbytes)]
    dist.barrier()
    t0 = time.perf_counter()
    path = directory / f"raw-{dist.get_rank()}-{step}"
    with open(path, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
    fsync_path(directory)
    total = time.perf_counter() - t0
    return total, total


def _rank_main(rank: int, ranks: int, store: str, args: argparse.Namespace) -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=ranks, timeout=timedelta(seconds=600)
    )
    directory = Path(args.scratch)
    state = rank_state(rank, args.per_rank)
    share = unique_bytes(state, ranks) // ranks
    methods: dict[str, Callable[[int], tuple[float, float]]] = {
        "limit: buffered write + fsync, all ranks": lambda s: raw_write(state, directory, s, share),
        "aiosnap CheckpointManager (replicated model)": lambda s: asyncio.run(
            aiosnap_group(state, directory, s)
        ),
        "peer: dcp.save": lambda s: dcp_save(state, directory, s),
        "peer: dcp.async_save + reused DefaultStager": lambda s: dcp_async_save(state, directory, s),
    }
    names = list(methods)
    rows: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for rep in range(args.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            local = methods[name](rep + 1)
            gathered: list[Any] = [None] * ranks
            dist.all_gather_object(gathered, local)
            rows[name].append((max(g[0] for g in gathered), max(g[1] for g in gathered)))
            if rank == 0:
                for p in directory.iterdir():
                    drop_cache(p) if p.is_file() else None
            dist.barrier()
    if rank == 0:
        unique = unique_bytes(state, ranks)
        summary = {
            name: {
                "stall": statistics.median(r[0] for r in rows[name]),
                "total": statistics.median(r[1] for r in rows[name]),
            }
            for name in names
        }
        for row in summary.values():
            row["gbps"] = unique / row["total"] / 1e9
        Path(args.result).write_text(json.dumps({"ranks": ranks, "unique_bytes": unique, "summary": summary}))
    dist.destroy_process_group()


def render(data: dict[str, Any]) -> str:
    summary, unique, ranks = data["summary"], data["unique_bytes"], data["ranks"]
    limit = next(v for k, v in summary.items() if k.startswith("limit"))
    dcp = summary["peer: dcp.save"]
    lines = [
        f"### {ranks} ranks on gloo, {unique / MiB:.0f} MiB to disk (replicated model written once)",
        "",
        "| method | stall s | call->durable s | aggregate GB/s | x limit time | x dcp.save time |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in summary.items():
        lines.append(
            f"| {name} | {row['stall']:.3f} | {row['total']:.3f} | {row['gbps']:.2f} | "
            f"{row['total'] / limit['total']:.2f} | {row['total'] / dcp['total']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="1GiB", help="total of all ranks' states (e.g. 64MiB, 1GiB)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dir", help="scratch directory on the disk to measure")
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument("--publish", action="store_true", help="put it in docs/benchmarks.md")
    args = parser.parse_args()
    number, unit = args.size[:-3], args.size[-3:]
    args.per_rank = int(float(number) * {"MiB": MiB, "GiB": 1024 * MiB}[unit]) // args.ranks
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="aiosnap-ranks-", dir=ROOT)).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.scratch, args.result = str(scratch), str(out / "ranks.json")
    store = file_store(scratch / "ranks.store")
    mp.start_processes(_rank_main, args=(args.ranks, store, args), nprocs=args.ranks, start_method="spawn")
    data = json.loads(Path(args.result).read_text())
    table = render(data)
    (out / "ranks.md").write_text(table)
    print(table)
    if args.publish:
        publish("ranks", table)
    if not args.dir:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
