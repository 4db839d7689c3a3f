"""One rank of bench_scale's anchor: real saves through a CheckpointManager over gloo.

``python scale_anchor.py RANK RANKS STORE DIR SAVES`` (aiosnap from PYTHONPATH, which
bench_scale sets to the checkout being measured). Rank 0 writes the seconds of each
save, call to committed on every rank, to DIR/times.json.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import aiosnap


async def saves(rank: int, directory: Path, count: int) -> list[float]:
    state = {"model": {f"w{i}": torch.full((256, 256), float(rank + i)) for i in range(32)}, "step": 0}
    times = []
    async with aiosnap.CheckpointManager(
        str(directory / "ckpt"), ranks=aiosnap.Ranks(timeout=120), keep=aiosnap.retention.KeepLast(2)
    ) as mgr:
        await (await mgr.save(0, state)).wait()  # warm: arenas, threads, channels
        for step in range(1, count + 1):
            dist.barrier()
            start = time.perf_counter()
            await (await mgr.save(step, state)).wait()  # committed: the manifest is durable
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    warnings.simplefilter("ignore")
    rank, ranks, store, directory, count = sys.argv[1:6]
    dist.init_process_group(
        "gloo", init_method=store, rank=int(rank), world_size=int(ranks), timeout=timedelta(seconds=300)
    )
    times = asyncio.run(saves(int(rank), Path(directory), int(count)))
    gathered: list[list[float] | None] = [None] * int(ranks)
    dist.all_gather_object(gathered, times)
    if int(rank) == 0:
        slowest = [max(t[i] for t in gathered if t is not None) for i in range(len(times))]
        (Path(directory) / "times.json").write_text(json.dumps(slowest))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
