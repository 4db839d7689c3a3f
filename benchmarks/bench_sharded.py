"""Sharded state: 4 ranks save DTensors, 2 ranks restore them resharded; aiosnap against DCP.

    python benchmarks/bench_sharded.py [--size 1GiB] [--reps 3] [--save-ranks 4] [--load-ranks 2]

The state is 16 DTensors of ``size / 16`` bytes each, ``Shard(0)`` over the saving
ranks (FSDP2's layout). Saving: aiosnap's CheckpointManager (call to durable, the
manifest included), ``dcp.save`` and ``dcp.async_save`` with a reused stager. Loading:
the restoring ranks' DTensors, ``Shard(0)`` over their own mesh, filled by
``CheckpointManager.restore(target=...)`` and by ``dcp.load``, from a dropped page cache.
The limit rows are every rank writing its share with buffered write + fsync, and
reading it back cold. A method's time is the slowest rank's; each is the median of
``reps`` repetitions, methods in rotated order. Results: benchmarks/results/sharded.{md,json}.
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
TENSORS = 16


def _state(size: int, world: int, fill: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    rows = size // TENSORS // (4 * 1024)
    out = {}
    for i in range(TENSORS):
        value = torch.full((rows, 1024), float(i)) if fill else torch.zeros(rows, 1024)
        out[f"w{i}"] = distribute_tensor(value, mesh, [Shard(0)], src_data_rank=None)
    return {"model": out}


def _drop(directory: Path) -> None:
    for root, _, files in os.walk(directory):
        for name in files:
            drop_cache(Path(root) / name)


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    total = time.perf_counter() - t0
    return total, total


# -- saving ----------------------------------------------------------------------------------
async def _aiosnap_save(state: dict[str, Any], directory: Path, step: int) -> tuple[float, float]:
    async with aiosnap.CheckpointManager(
        str(directory / "aiosnap"), keep=aiosnap.retention.KeepLast(2), ranks=aiosnap.Ranks(timeout=300)
    ) as mgr:
        await (await mgr.save(0, state)).wait()  # warm: arenas, threads, channels
        dist.barrier()
        t0 = time.perf_counter()
        handle = await mgr.save(step, state)
        stall = time.perf_counter() - t0
        await handle.wait()
        return stall, time.perf_counter() - t0


def _dcp_save(state: dict[str, Any], directory: Path, step: int) -> tuple[float, float]:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(directory / "dcp-warm"))
    return _timed(lambda: dcp.save(state, checkpoint_id=str(directory / f"dcp-{step}")))


def _dcp_async_save(state: dict[str, Any], directory: Path, step: int) -> tuple[float, float]:
    import torch.distributed.checkpoint as dcp

    stager = cpu_stager()
    try:
        timed_async_save(
            lambda: dcp.async_save(state, checkpoint_id=str(directory / "dcpa-warm"), async_stager=stager)
        )
        dist.barrier()
        return timed_async_save(
            lambda: dcp.async_save(state, checkpoint_id=str(directory / f"dcpa-{step}"), async_stager=stager)
        )
    finally:
        stager.close()


def _raw_write(state: dict[str, Any], directory: Path, step: int) -> tuple[float, float]:
    data = torch.cat([t.to_local().reshape(-1) for t in state["model"].values()]).numpy().view("u1")

    def write() -> None:
        path = directory / f"raw-{dist.get_rank()}"
        with open(path, "wb") as f:
            f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
        fsync_path(directory)

    return _timed(write)


# -- loading ---------------------------------------------------------------------------------
async def _aiosnap_load(state: dict[str, Any], directory: Path) -> None:
    async with aiosnap.CheckpointManager(
        str(directory / "aiosnap"), read_only=True, ranks=aiosnap.Ranks(timeout=300)
    ) as mgr:
        await mgr.restore(target=state)


def _dcp_load(state: dict[str, Any], directory: Path) -> None:
    import torch.distributed.checkpoint as dcp

    step = max(int(p.name.split("-")[1]) for p in directory.glob("dcp-[0-9]*"))
    dcp.load(state, checkpoint_id=str(directory / f"dcp-{step}"))


def _raw_read(directory: Path, rank: int, saving: int, loading: int) -> None:
    share = range(rank * saving // loading, (rank + 1) * saving // loading)
    for r in share:
        with open(directory / f"raw-{r}", "rb", buffering=0) as f:
            while f.read(16 * MiB):
                pass


def _check(state: dict[str, Any]) -> None:
    for i, t in enumerate(state["model"].values()):
        assert bool((t.to_local() == float(i)).all()), "a restore gave wrong values"


# -- ranks -----------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, store: str, phase: str, args: argparse.Namespace) -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    directory = Path(args.scratch)
    methods: dict[str, Callable[[int], tuple[float, float]]]
    if phase == "save":
        state = _state(args.bytes, world, fill=True)
        methods = {
            "limit: buffered write + fsync, every rank its share": lambda s: _raw_write(state, directory, s),
            "aiosnap CheckpointManager": lambda s: asyncio.run(_aiosnap_save(state, directory, s)),
            "peer: dcp.save": lambda s: _dcp_save(state, directory, s),
            "peer: dcp.async_save + reused DefaultStager": lambda s: _dcp_async_save(state, directory, s),
        }
    else:
        state = _state(args.bytes, world, fill=False)

        def load(fn: Callable[[], object]) -> tuple[float, float]:
            if rank == 0:
                _drop(directory)
            result = _timed(fn)
            if not args.raw:
                _check(state)
            return result

        methods = {
            "limit: cold read, every rank its share": lambda s: load(
                lambda: _raw_read(directory, rank, args.save_ranks, world)
            ),
            "aiosnap CheckpointManager.restore(target=)": lambda s: load(
                lambda: asyncio.run(_aiosnap_load(state, directory))
            ),
            "peer: dcp.load": lambda s: load(lambda: _dcp_load(state, directory)),
        }
    names = list(methods)
    rows: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for rep in range(args.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            args.raw = name.startswith("limit")
            local = methods[name](rep + 1)
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, local)
            rows[name].append((max(g[0] for g in gathered), max(g[1] for g in gathered)))
            if rank == 0:
                _drop(directory)
            dist.barrier()
    if rank == 0:
        summary = {
            n: {
                "stall": statistics.median(r[0] for r in rows[n]),
                "total": statistics.median(r[1] for r in rows[n]),
                "min": min(r[1] for r in rows[n]),
                "max": max(r[1] for r in rows[n]),
            }
            for n in names
        }
        Path(args.result + f".{phase}").write_text(json.dumps(summary))
    dist.destroy_process_group()
    # Everything is measured and written: leave without the interpreter's finalization.
    # A rank aborted there once ("terminate called without an active exception", SIGABRT
    # in a clean-clone CI run of test_sharded_benchmark_runs_small, 2026-11-25), a known
    # torch hazard of gloo's C++ threads still holding work at exit (pytorch PR 179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(world: int, phase: str, args: argparse.Namespace) -> dict[str, Any]:
    store = file_store(Path(args.scratch) / f"{phase}.store")
    mp.start_processes(_rank_main, args=(world, store, phase, args), nprocs=world, start_method="spawn")
    result: dict[str, Any] = json.loads(Path(args.result + f".{phase}").read_text())
    return result


def render(data: dict[str, Any]) -> str:
    lines = [
        f"### Sharded: {data['save_ranks']} ranks save {data['bytes'] / MiB:.0f} MiB of Shard(0) DTensors, "
        f"{data['load_ranks']} ranks restore them resharded",
        "",
        "| method | stall s | call->durable s (min-max) | x limit | x DCP |",
        "|---|---|---|---|---|",
    ]
    for phase, peer in (("save", "peer: dcp.save"), ("load", "peer: dcp.load")):
        rows = data[phase]
        limit = next(v for k, v in rows.items() if k.startswith("limit"))
        for name, row in rows.items():
            lines.append(
                f"| {name} | {row['stall']:.3f} | {row['total']:.3f} ({row['min']:.3f}-{row['max']:.3f}) | "
                f"{row['total'] / limit['total']:.2f} | {row['total'] / rows[peer]['total']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="1GiB", help="the whole state (e.g. 64MiB, 1GiB)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--save-ranks", type=int, default=4)
    parser.add_argument("--load-ranks", type=int, default=2)
    parser.add_argument("--dir", help="scratch directory on the disk to measure")
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument("--publish", action="store_true", help="put it in docs/benchmarks.md")
    args = parser.parse_args()
    number, unit = args.size[:-3], args.size[-3:]
    args.bytes = int(float(number) * {"MiB": MiB, "GiB": 1024 * MiB}[unit])
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="aiosnap-sharded-", dir=ROOT)).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.scratch, args.result = str(scratch), str(out / "sharded.json")
    try:
        data = {
            "bytes": args.bytes,
            "save_ranks": args.save_ranks,
            "load_ranks": args.load_ranks,
            "save": _spawn(args.save_ranks, "save", args),
            "load": _spawn(args.load_ranks, "load", args),
        }
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    for phase in ("save", "load"):
        Path(args.result + f".{phase}").unlink(missing_ok=True)
    Path(args.result).write_text(json.dumps(data, indent=1))
    table = render(data)
    (out / "sharded.md").write_text(table)
    print(table)
    if args.publish:
        publish("sharded", table)


if __name__ == "__main__":
    main()
