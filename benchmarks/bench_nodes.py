"""Node-local directories (issue 43): what nodes and partner replicas cost a save, and what
a restore from the nodes gains over one from the remote tier. 4 ranks on gloo, one run.

    python benchmarks/bench_nodes.py [--size 256MiB] [--reps 3] [--ram /dev/shm] [--disk DIR]

Ranks 0-1 and 2-3 stand in for two nodes: their directories are ``node-0`` and ``node-1``
under ``--ram`` (tmpfs: the in-memory tier), with a remote tier on ``--disk`` (a directory
on this machine's disk standing in for an object store, its page cache dropped before each
read). Each rank holds ``size / 4`` bytes of its own state. Saves: 4, ``--interval`` seconds
of training apart (a GPU-bound step leaves the CPU free: an idle wait stands in for it),
each committed before the next call: the median stall of a call, and the time until all
are done (copies to partners included), the slowest rank's, for one shared directory, two
node directories, and two with ``Ranks(replicas=1)``. Restores
(open + ``restore()``, the slowest rank): from the nodes; from the nodes with one node's
file of the newest step deleted (taken from its partner's replica); from the remote tier
alone (node directories empty, no replicas). Results: ``benchmarks/results/nodes.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
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

import anyio
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import aiosnap

sys.path.insert(0, str(Path(__file__).parent))
from _harness import drop_cache, file_store

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent
RANKS = 4
SAVES = 4


def state_of(rank: int, per_rank: int, step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    return {
        "mine": {
            f"t{i}": torch.randn(4 * MiB // 4, generator=gen) for i in range(max(1, per_rank // (4 * MiB)))
        }
    }


def manager(directory: str, remote: str | None, replicas: int) -> aiosnap.CheckpointManager:
    ranks = aiosnap.Ranks(timeout=300, replicas=replicas)
    return aiosnap.CheckpointManager(
        directory, remote=remote, ranks=ranks, keep=aiosnap.retention.KeepLast(2)
    )


async def save(
    directory: str, state: dict[str, Any], step: int, replicas: int, remote: str | None, interval: float
) -> tuple[float, float]:
    """SAVES saves, ``interval`` seconds of a training step apart (a GPU-bound step, which
    leaves the CPU to the background work: here an idle wait), each committed before the
    next is called; with replicas, the copy of one runs during the next step: the median
    stall of a call, and the time from the first call until everything (copies included)
    is done."""
    async with manager(directory, remote, replicas) as mgr:
        await (await mgr.save(step - 1, state)).wait()  # warm: arenas, threads, links
        await mgr.flush()
        dist.barrier()
        stalls = []
        t0 = time.perf_counter()
        for i in range(SAVES):
            t = time.perf_counter()
            handle = await mgr.save(step + i, state)
            stalls.append(time.perf_counter() - t)
            await handle.wait()
            if i + 1 < SAVES:
                await anyio.sleep(interval)  # the training step between two saves
        await mgr.flush()
        total = time.perf_counter() - t0
    return statistics.median(stalls), total


async def restore(directory: str, remote: str | None, replicas: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    async with manager(directory, remote, replicas) as mgr:
        restored = await mgr.restore()
    assert restored.state["mine"], restored.path
    return time.perf_counter() - t0


def _rank_main(rank: int, store: str, args: argparse.Namespace) -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=RANKS, timeout=timedelta(seconds=600)
    )
    ram, disk = Path(args.ram_dir), Path(args.disk_dir)
    node = str(ram / f"node-{rank // 2}")
    remote = str(disk / "remote")
    results: dict[str, list[float]] = {}

    def note(name: str, value: float) -> None:
        gathered: list[Any] = [None] * RANKS
        dist.all_gather_object(gathered, value)
        results.setdefault(name, []).append(max(gathered))

    for rep in range(args.reps):
        state, step = state_of(rank, args.per_rank, rep), 10 * (rep + 1)
        newest = step + SAVES - 1
        for label, directory, replicas in (
            ("save: one shared directory", str(ram / "shared"), 0),
            ("save: 2 node directories", node, 0),
            ("save: 2 node directories, replicas=1", node + "-r", 1),
        ):
            stall, total = asyncio.run(save(directory, state, step, replicas, None, args.interval))
            note(f"{label}: stall", stall)
            note(f"{label}: {SAVES} saves, first call to all done", total)
        # Restores of the replicated run's newest step: from the nodes, then with node 1's
        # file of rank 2 lost (its replica on node 0), then from the remote tier alone.
        note("restore: the nodes (tmpfs)", asyncio.run(restore(node + "-r", None, 1)))
        if rank == 0:
            os.remove(os.path.join(str(ram / "node-1-r"), f"snapshot_iter_{newest}", "rank_00002"))
        note("restore: the nodes, one file from its partner", asyncio.run(restore(node + "-r", None, 1)))
        asyncio.run(save(node + "-t", state, step, 0, remote, args.interval))  # a tiered run, uploaded
        dist.barrier()  # every rank's manager closed before a node's directory goes
        if rank % 2 == 0:
            shutil.rmtree(node + "-t")  # new machines: empty node directories
        if rank == 0:
            for p in (disk / "remote").rglob("*"):
                drop_cache(p) if p.is_file() else None
        note("restore: the remote tier (disk)", asyncio.run(restore(node + "-t", remote, 0)))
        dist.barrier()
        if rank % 2 == 0:
            for suffix in ("", "-r", "-t"):
                shutil.rmtree(node + suffix, ignore_errors=True)
        if rank == 0:
            shutil.rmtree(ram / "shared", ignore_errors=True)
            shutil.rmtree(disk / "remote", ignore_errors=True)
        dist.barrier()
    if rank == 0:
        summary = {name: statistics.median(values) for name, values in results.items()}
        Path(args.result).write_text(
            json.dumps({"bytes": args.per_rank * RANKS, "summary": summary}, indent=1)
        )
    dist.destroy_process_group()


def render(data: dict[str, Any]) -> str:
    s = data["summary"]
    base = s["save: 2 node directories: stall"]
    remote = s["restore: the remote tier (disk)"]
    lines = [
        f"### 4 ranks as 2 nodes on gloo, {data['bytes'] / MiB:.0f} MiB in all (node directories on tmpfs)",
        "",
        "| what | seconds | ratio |",
        "|---|---:|---|",
    ]
    for name, value in s.items():
        if name.endswith(": stall"):
            ratio = f"{value / base:.2f}x the stall of node directories without replicas"
        elif name.startswith("restore"):
            ratio = f"{value / remote:.2f}x the restore from the remote tier"
        else:
            ratio = ""
        lines.append(f"| {name} | {value:.3f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="256MiB", help="all ranks' states together (e.g. 64MiB, 1GiB)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds of training between saves")
    parser.add_argument("--ram", default="/dev/shm", help="where the node directories go (tmpfs)")
    parser.add_argument("--disk", default=None, help="where the remote tier goes (a disk)")
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args()
    number, unit = args.size[:-3], args.size[-3:]
    args.per_rank = int(float(number) * {"MiB": MiB, "GiB": 1024 * MiB}[unit]) // RANKS
    ram = Path(tempfile.mkdtemp(prefix="aiosnap-nodes-", dir=args.ram))
    disk = Path(args.disk or tempfile.mkdtemp(prefix="aiosnap-nodes-", dir=ROOT)).resolve()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.ram_dir, args.disk_dir, args.result = str(ram), str(disk), str(out / "nodes.json")
    try:
        store = file_store(disk / "nodes.store")
        mp.start_processes(_rank_main, args=(store, args), nprocs=RANKS, start_method="spawn")
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        if not args.disk:
            shutil.rmtree(disk, ignore_errors=True)
    table = render(json.loads(Path(args.result).read_text()))
    (out / "nodes.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
