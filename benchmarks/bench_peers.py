"""A checkpoint file moved between two ranks (``_dist/peers``) against a copy in one process.

    python benchmarks/bench_peers.py [--mib 256] [--reps 3] [--piece-mib 64] [--dir DIR]

Rank 0 sends a file of random bytes to rank 1 over a PeerLink (gloo on 127.0.0.1); a
repetition's time is from both ranks leaving a barrier to the later one returning (the
receiver's copy committed: written, fsynced, renamed). The baseline copies the same file
in one process through the same durable commit (``copy_object`` between two
LocalStorages). Both read a source in the page cache and write to the same disk. The last
row is gloo alone: the same bytes sent memory to memory, piece by piece, over the link.
Prints one table: median seconds, MB/s, and each time over the copy's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from aiosnap._dist.peers import open_peer_link, recv_file, send_file
from aiosnap._save.transfer import copy_object
from aiosnap.storage import LocalStorage

MiB = 1 << 20


async def _transfers(
    rank: int, src: str, out_dir: str, reps: int, piece: int, size: int
) -> tuple[list[float], list[float]]:
    link = await open_peer_link(None, 120.0, partners=[1 - rank])
    storage, times = LocalStorage(), []
    try:
        for i in range(reps):
            await asyncio.to_thread(dist.barrier)
            t0 = time.perf_counter()
            if rank == 0:
                await send_file(link, 1, i, storage, src, piece=piece)
            else:
                await recv_file(link, 0, i, storage, f"{out_dir}/peer_{i}", expected_size=size)
            times.append(time.perf_counter() - t0)
        return times, [_wire(link, rank, piece, size) for _ in range(reps)]
    finally:
        link.close()


def _wire(link: Any, rank: int, piece: int, size: int) -> float:
    """The same bytes from memory to memory: gloo's sends alone, one piece at a time."""
    buf = torch.zeros(piece, dtype=torch.uint8)
    dist.barrier()
    t0 = time.perf_counter()
    for offset in range(0, size, piece):
        part = buf[: min(piece, size - offset)]
        (link.group.send([part], 1, 7) if rank == 0 else link.group.recv([part], 0, 7)).wait()
    return time.perf_counter() - t0


def _rank(rank: int, port: int, args: tuple[Any, ...], out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    out.put((rank, asyncio.run(_transfers(rank, *args))))
    dist.destroy_process_group()


def peer_times(src: str, out_dir: str, reps: int, piece: int, size: int) -> tuple[list[float], list[float]]:
    """Each repetition's time, the slower rank's: files, and the wire alone."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, port, (src, out_dir, reps, piece, size), out)) for r in range(2)
    ]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    files, wire = ([max(a, b) for a, b in zip(got[0][k], got[1][k], strict=True)] for k in range(2))
    return files, wire


def copy_times(src: str, out_dir: str, reps: int) -> list[float]:
    storage, times = LocalStorage(), []
    for i in range(reps):
        t0 = time.perf_counter()
        copy_object(storage, src, storage, f"{out_dir}/copy_{i}")
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--piece-mib", type=int, default=64)
    parser.add_argument("--dir", default=None)
    a = parser.parse_args()
    size = a.mib * MiB
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        src = f"{tmp}/src"
        Path(src).write_bytes(os.urandom(size))
        copies = statistics.median(copy_times(src, tmp, a.reps))
        files, wire = peer_times(src, tmp, a.reps, a.piece_mib * MiB, size)
        peer = statistics.median(files)
        for i in range(a.reps):
            assert Path(f"{tmp}/peer_{i}").read_bytes() == Path(src).read_bytes()
    print(f"{a.mib} MiB, pieces of {a.piece_mib} MiB, median of {a.reps}")
    print(f"{'method':<34}{'s':>8}{'MB/s':>9}{'ratio':>7}")
    rows = [
        ("copy in one process (copy_object)", copies),
        ("PeerLink, 2 processes (gloo)", peer),
        ("gloo alone, memory to memory", statistics.median(wire)),
    ]
    for name, t in rows:
        print(f"{name:<34}{t:>8.3f}{size / t / 1e6:>9.0f}{t / copies:>7.2f}")


if __name__ == "__main__":
    main()
