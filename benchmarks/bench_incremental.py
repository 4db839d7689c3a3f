"""Incremental checkpoints and zstd: bytes written, space, stall, against full saves.

    python benchmarks/bench_incremental.py [--size 256MiB] [--saves 10] [--publish]

LoRA-shaped state of ``size`` bytes: a frozen base (90% of the bytes, float32 layers
of 1 MiB or more) and adapters with their AdamW state (exp_avg, exp_avg_sq: 10% of the
bytes together) that change at every step. A CheckpointManager saves it ``saves`` times
with ``incremental=True`` and, in the same run, without (each a fresh directory, the
two rotated per step). Rows: bytes written per save after the first (the file and the
new blobs), as a share of the state; the space ``saves`` checkpoints take against one
full checkpoint plus ``saves`` times the changing bytes (target: at most 1.3 x); the
caller's stall (median), against the full save's (target: at most 1.10 x); the bytes a
tiered manager (``remote=``, a local directory) uploads per save; every
checkpoint restored and compared bit for bit, also after ``KeepLast(3)`` retention
dropped the first ones. The first save after a restart: a fresh process opens the
directory and saves twice; the first reads back once each blob it refers to that it did
not write (the frozen base: a save refers to a blob only once its process has checked it),
the second none. Measured with the blobs evicted from the page cache (``posix_fadvise``:
as after a reboot) and cached (as after a process restart), against the second save.

Embedding table: 1M rows of 64 float32 (256 MiB, or ``size`` if smaller), 1% of the rows
(random) updated per step. The unit of deduplication is measured on it and on the LoRA
state before anything is written: the share of the bytes a save would write with whole
tensors, and with fixed chunks of 4 KiB, 64 KiB and 1 MiB (a chunk is written again if
any of its bytes changed).

zstd: ratio and throughput (one thread, levels 1 and 3, the median of ``reps`` runs) on
the state of a real model + AdamW after a few steps, and on random float32 data.

Results: benchmarks/results/incremental.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import aiosnap
from aiosnap.storage import Posix

sys.path.insert(0, str(Path(__file__).parent))
from _harness import publish
from bench import machine

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent


# -- the states ----------------------------------------------------------------------------------
def lora_base(nbytes: int) -> dict[str, torch.Tensor]:
    """The frozen 90%: layers of [n, 1024] float32, at least 1 MiB each."""
    frozen = int(nbytes * 0.9)
    rows = max(256, min(4096, frozen // 16 // 4096))  # ~16 layers
    layers = max(1, frozen // (rows * 4096))
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(rows, 1024, generator=g) for i in range(layers)}


def lora_live(base: dict[str, torch.Tensor], nbytes: int) -> dict[str, dict[str, torch.Tensor]]:
    """Adapters and their two AdamW moments: together 10% of the bytes."""
    each = max(4096, int(nbytes * 0.1) // 3 // len(base) // 4)  # float32 elements per tensor
    rank = max(1, each // 1024)
    return {
        kind: {name: torch.zeros(rank, 1024) for name in base}
        for kind in ("adapter", "exp_avg", "exp_avg_sq")
    }


def lora_step(live: dict[str, dict[str, torch.Tensor]], step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for group in live.values():
        for t in group.values():
            t.add_(torch.randn(t.shape, generator=g))


def lora_state(base: dict[str, torch.Tensor], live: dict[str, Any], step: int) -> dict[str, Any]:
    return {"base": base, **live, "step": step}


def nbytes_of(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.nbytes
    if isinstance(tree, dict):
        return sum(nbytes_of(v) for v in tree.values())
    return 0


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.name.startswith(".aiosnap"))


def equal(a: Any, b: Any) -> bool:
    if isinstance(b, dict):
        return set(a) == set(b) and all(equal(a[k], b[k]) for k in b)
    if isinstance(b, torch.Tensor):
        return bool(torch.equal(a, b))
    return bool(a == b)


# -- the unit of deduplication -------------------------------------------------------------------
def changed_share(before: np.ndarray[Any, Any], after: np.ndarray[Any, Any], chunk: int | None) -> float:
    """The share of the bytes written again: whole (``chunk`` None) or per chunk."""
    a, b = before.reshape(-1).view(np.uint8), after.reshape(-1).view(np.uint8)
    if chunk is None:
        return 1.0 if not np.array_equal(a, b) else 0.0
    n = -(-a.size // chunk)
    pad = n * chunk - a.size
    diff = np.pad(a != b, (0, pad)).reshape(n, chunk).any(axis=1)
    written = int(diff.sum()) * chunk - (pad if diff[-1] else 0)  # the last chunk is short
    return written / a.size


def unit_of_dedup(rows: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    table = rng.standard_normal((rows, 64), dtype=np.float32)
    updated = table.copy()
    picked = rng.choice(rows, size=rows // 100, replace=False)
    updated[picked] += 1.0
    out = []
    for label, chunk in (
        ("whole tensor", None),
        ("4 KiB chunks", 4096),
        ("64 KiB chunks", 65536),
        ("1 MiB chunks", MiB),
    ):
        out.append({"unit": label, "embedding": changed_share(table, updated, chunk)})
    return out


# -- incremental against full saves --------------------------------------------------------------
async def run_lora(scratch: Path, nbytes: int, saves: int) -> dict[str, Any]:
    base = lora_base(nbytes)
    live = lora_live(base, nbytes)
    total = nbytes_of(base) + nbytes_of(live)
    changing = nbytes_of(live)
    dirs = {"incremental": scratch / "incremental", "full": scratch / "full"}
    stalls: dict[str, list[float]] = {k: [] for k in dirs}
    written: dict[str, list[int]] = {k: [] for k in dirs}
    durable: dict[str, list[float]] = {k: [] for k in dirs}
    kept: dict[int, Any] = {}
    managers = {
        "incremental": aiosnap.CheckpointManager(str(dirs["incremental"]), incremental=True),
        "full": aiosnap.CheckpointManager(str(dirs["full"])),
    }
    async with managers["incremental"], managers["full"]:
        for step in range(saves):
            lora_step(live, step)
            state = lora_state(base, live, step)
            kept[step] = {k: {n: t.clone() for n, t in v.items()} for k, v in live.items()}
            order = list(dirs) if step % 2 else list(reversed(dirs))
            for kind in order:
                t0 = time.perf_counter()
                handle = await managers[kind].save(step, state)
                stalls[kind].append(time.perf_counter() - t0)
                stats = await handle.wait()
                written[kind].append(stats.bytes)
                durable[kind].append(stats.total_s)
        restored_all = True
        for step in range(saves):
            got = (await managers["incremental"].restore(step)).state
            restored_all &= equal(got, lora_state(base, kept[step], step))
    space = du(dirs["incremental"])
    full_one = written["full"][0]
    restart = restart_rows(dirs["incremental"], nbytes, saves)
    # Retention: a fresh directory, KeepLast(3), the same saves; every kept one restores.
    retained = scratch / "retained"
    async with aiosnap.CheckpointManager(
        str(retained), incremental=True, keep=aiosnap.retention.KeepLast(3)
    ) as mgr:
        for step in range(saves):
            live_step = kept[step]
            await (await mgr.save(step, lora_state(base, live_step, step))).wait()
        steps = await mgr.steps()
        after_retention = True
        for s in steps:
            after_retention &= equal((await mgr.restore(s)).state, lora_state(base, kept[s], s))
    # A remote tier (a local directory here): bytes each upload sent.
    uploaded = []
    async with aiosnap.CheckpointManager(
        str(scratch / "tiered"), remote=str(scratch / "remote"), incremental=True
    ) as mgr:
        for step in range(min(saves, 4)):
            handle = await mgr.save(step, lora_state(base, kept[step], step))
            await handle.wait()
            assert handle.upload is not None
            uploaded.append((await handle.upload.wait()).bytes)
    return {
        "restart": restart,
        "base_bytes": nbytes_of(base),
        "uploaded": uploaded,
        "state_bytes": total,
        "changing_bytes": changing,
        "saves": saves,
        "written": written,
        "stall": stalls,
        "durable": durable,
        "space_incremental": space,
        "space_full": du(dirs["full"]),
        "space_budget": full_one + saves * changing,
        "restored_bit_equal": restored_all,
        "retained_steps": steps,
        "restored_after_retention": after_retention,
    }


# -- the first save after a restart --------------------------------------------------------------
class CountingPosix(Posix):
    """The real calls, counting the bytes read from files of a blob folder."""

    def __init__(self) -> None:
        self.paths: dict[int, str] = {}
        self.blob_bytes = 0

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        self.paths[fd] = path
        return fd

    def preadv(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        n = super().preadv(fd, bufs, offset)
        if f"{os.sep}aiosnap-blobs{os.sep}" in self.paths.get(fd, ""):
            self.blob_bytes += n
        return n


def evict(folder: Path) -> None:
    """Drop the blobs' pages from the page cache (they are durable): a cold read follows."""
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


async def restarted(directory: Path, nbytes: int, first: int, cold: bool) -> dict[str, dict[str, float]]:
    """In a fresh process: ``without``, the first save of a manager whose blobs this
    process wrote itself (into a scratch directory, after a warm-up save there): a first
    save after a restart as it costs without the read-back; then ``first`` and ``next``,
    two saves into the parent's ``directory`` (steps ``first``, ``first + 1``), the first of
    which reads back the blobs it refers to. Each: call -> durable, blob bytes read. The
    adapters change before every save, so each writes its new blobs as a real one does."""
    base = lora_base(nbytes)
    live = lora_live(base, nbytes)
    posix = CountingPosix()
    storage = aiosnap.storage.LocalStorage(posix=posix)
    scratch = directory.with_name(f"{directory.name}-restart-{first}")
    changes = iter(range(1_000_000 + 10 * first, 1_000_010 + 10 * first))  # no two runs alike

    async def saves(where: Path, steps: list[int]) -> list[dict[str, float]]:
        rows = []
        async with aiosnap.CheckpointManager(str(where), incremental=True, storage=storage) as mgr:
            for step in steps:
                lora_step(live, next(changes))
                posix.blob_bytes = 0
                stats = await (await mgr.save(step, lora_state(base, live, step))).wait()
                rows.append({"total_s": stats.total_s, "blob_bytes_read": posix.blob_bytes})
        return rows

    try:
        await saves(scratch, [0])  # the process's own warm-up (threads, imports, the first arena)
        (without,) = await saves(scratch, [1])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if cold:
        evict(directory / "aiosnap-blobs")
    after, later = await saves(directory, [first, first + 1])
    return {"without": without, "first": after, "next": later}


def restart_rows(directory: Path, nbytes: int, saves: int) -> dict[str, Any]:
    """``restarted`` in two fresh processes: with the blobs evicted, then cached."""
    out: dict[str, Any] = {}
    for i, kind in enumerate(("cold", "cached")):
        args = [sys.executable, __file__, "--restarted", str(directory), "--size", f"{nbytes // MiB}MiB"]
        args += ["--first", str(saves + 2 * i)] + (["--cold"] if kind == "cold" else [])
        done = subprocess.run(args, check=True, capture_output=True, text=True)
        out[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


# -- zstd ----------------------------------------------------------------------------------------
def adamw_state(nbytes: int) -> dict[str, Any]:
    """A real model + AdamW state after a few steps (weights, exp_avg, exp_avg_sq, step)."""
    width = 1024
    layers = max(1, nbytes // 3 // (width * width * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, width)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def zstd_rows(nbytes: int, reps: int) -> list[dict[str, Any]]:
    import zstandard

    state = adamw_state(nbytes)
    real = b"".join(
        t.numpy().tobytes()
        for t in [
            *state["model"].values(),
            *(v for s in state["optimizer"]["state"].values() for v in s.values()),
        ]
        if t.dim() > 0
    )
    random = np.random.default_rng(0).standard_normal(len(real) // 4, dtype=np.float32).tobytes()
    rows = []
    for label, data in (("model + AdamW state", real), ("random float32", random)):
        for level in (1, 3):
            comp = zstandard.ZstdCompressor(level=level, write_content_size=True)
            c_times, d_times = [], []
            for _ in range(max(1, reps)):
                t0 = time.perf_counter()
                packed = comp.compress(data)
                c_times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                zstandard.ZstdDecompressor().decompress(packed)
                d_times.append(time.perf_counter() - t0)
            c_s, d_s = statistics.median(c_times), statistics.median(d_times)
            rows.append(
                {
                    "data": label,
                    "level": level,
                    "bytes": len(data),
                    "ratio": len(data) / len(packed),
                    "compress_MBps": len(data) / c_s / 1e6,
                    "decompress_MBps": len(data) / d_s / 1e6,
                }
            )
    return rows


async def zstd_saves(scratch: Path, nbytes: int) -> list[dict[str, Any]]:
    """One incremental save of the model + AdamW state into a fresh directory, with each
    compression: what it wrote, the caller's stall, call -> durable."""
    state = adamw_state(nbytes)
    rows = []
    for label, options in (
        ("raw blobs", {}),
        ("zstd level 1", {"compression": "zstd", "level": 1}),
    ):
        async with aiosnap.ThreadWriter(incremental=aiosnap.Incremental(**options)) as writer:
            t0 = time.perf_counter()
            handle = await writer("ckpt", str(scratch / label.replace(" ", "-")), state)
            stall = time.perf_counter() - t0
            stats = await handle.wait()
        rows.append({"save": label, "bytes": stats.bytes, "stall_s": stall, "total_s": stats.total_s})
    return rows


# -- the table -----------------------------------------------------------------------------------
def restart_lines(lora: dict[str, Any]) -> list[str]:
    """The first save after a restart against the next one (see the module)."""
    if "restart" not in lora:
        return []
    lines = []
    for kind, label in (("cold", "blobs not cached"), ("cached", "blobs cached")):
        run = lora["restart"][kind]
        first, without, later = run["first"], run["without"], run["next"]
        lines.append(
            f"| first save after a restart ({label}): call -> durable, blobs read back | "
            f"{first['total_s'] * 1e3:.0f} ms, {first['blob_bytes_read'] / MiB:.1f} MiB "
            f"({first['blob_bytes_read'] / lora['base_bytes']:.2f} x the frozen base) | "
            f"without the read-back {without['total_s'] * 1e3:.0f} ms; the next save "
            f"{later['total_s'] * 1e3:.0f} ms, {later['blob_bytes_read'] / MiB:.1f} MiB read | "
            f"+{(first['total_s'] - without['total_s']) * 1e3:.0f} ms "
            f"({first['total_s'] / without['total_s']:.2f} x) | one read of the blobs it refers to |"
        )
    return lines


def render(data: dict[str, Any]) -> str:
    lora = data["lora"]
    total, changing, saves = lora["state_bytes"], lora["changing_bytes"], lora["saves"]
    inc, full = lora["written"]["incremental"], lora["written"]["full"]
    later = statistics.median(inc[1:]) if len(inc) > 1 else inc[0]
    s_inc, s_full = statistics.median(lora["stall"]["incremental"]), statistics.median(lora["stall"]["full"])
    d_inc, d_full = (statistics.median(lora["durable"][k]) for k in ("incremental", "full"))
    lines = [
        f"### Incremental: a LoRA-shaped state of {total / MiB:.0f} MiB (90% frozen), {saves} saves",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in data.get("machine", {}).items()),
        "",
        "| what | incremental | full saves | ratio | target |",
        "|---|---|---|---|---|",
        f"| bytes written per save after the first (median) | {later / MiB:.1f} MiB | "
        f"{statistics.median(full[1:] or full) / MiB:.1f} MiB | {later / total:.3f} of the state | <= 0.15 |",
        f"| first save: bytes, call -> durable | {inc[0] / MiB:.1f} MiB, "
        f"{lora['durable']['incremental'][0] * 1e3:.0f} ms | {full[0] / MiB:.1f} MiB, "
        f"{lora['durable']['full'][0] * 1e3:.0f} ms | | |",
        f"| space of {saves} checkpoints | {lora['space_incremental'] / MiB:.1f} MiB | "
        f"{lora['space_full'] / MiB:.1f} MiB | {lora['space_incremental'] / lora['space_budget']:.3f} x "
        f"(one full + {saves} x {changing / MiB:.1f} MiB changing) | <= 1.3 |",
        f"| caller stall (median) | {s_inc * 1e3:.1f} ms | {s_full * 1e3:.1f} ms | "
        f"{s_inc / s_full:.2f} x | <= 1.10 |",
        f"| call -> durable (median) | {d_inc * 1e3:.0f} ms | {d_full * 1e3:.0f} ms | "
        f"{d_inc / d_full:.2f} x | |",
        f"| bytes uploaded to a remote tier per save after the first (median) | "
        f"{statistics.median(lora['uploaded'][1:] or lora['uploaded']) / MiB:.1f} MiB | "
        f"{lora['uploaded'][0] / MiB:.1f} MiB (the first) | "
        f"{statistics.median(lora['uploaded'][1:] or lora['uploaded']) / total:.3f} of the state | "
        "new blobs only |",
        *restart_lines(lora),
        f"| every checkpoint restores bit-equal | {lora['restored_bit_equal']} | | | True |",
        f"| after KeepLast(3) retention (steps {lora['retained_steps']}) | "
        f"{lora['restored_after_retention']} | | | True |",
        "",
        "Unit of deduplication, measured on the embedding table "
        f"({data['rows']:,} rows x 64 float32, 1% of the rows, random, updated): share of the table a save "
        "writes again.",
        "",
        "| unit | embedding table |",
        "|---|---|",
        *(f"| {r['unit']} | {r['embedding']:.3f} |" for r in data["units"]),
        "",
        "zstd (one thread, `zstandard`):",
        "",
        "| data | level | ratio | compress MB/s | decompress MB/s |",
        "|---|---|---|---|---|",
        *(
            f"| {r['data']} ({r['bytes'] / MiB:.0f} MiB) | {r['level']} | {r['ratio']:.3f} | "
            f"{r['compress_MBps']:.0f} | {r['decompress_MBps']:.0f} |"
            for r in data["zstd"]
        ),
        "",
        "An incremental save of that model + AdamW state, raw and compressed (in the commit):",
        "",
        "| blobs | bytes written | caller stall | call -> durable |",
        "|---|---|---|---|",
        *(
            f"| {r['save']} | {r['bytes'] / MiB:.1f} MiB | {r['stall_s'] * 1e3:.1f} ms | "
            f"{r['total_s'] * 1e3:.0f} ms |"
            for r in data["zstd_saves"]
        ),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="256MiB", help="the LoRA state (e.g. 64MiB, 1GiB)")
    parser.add_argument("--saves", type=int, default=10)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the embedding table")
    parser.add_argument("--reps", type=int, default=3, help="runs of each zstd timing (the median is shown)")
    parser.add_argument("--dir", help="scratch directory on the disk to measure")
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument("--publish", action="store_true", help="put it in docs/benchmarks.md")
    parser.add_argument("--restarted", help=argparse.SUPPRESS)  # the fresh process of restart_rows
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    number, unit = args.size[:-3], args.size[-3:]
    nbytes = int(float(number) * {"MiB": MiB, "GiB": 1024 * MiB}[unit])
    if args.restarted:
        print(json.dumps(asyncio.run(restarted(Path(args.restarted), nbytes, args.first, args.cold))))
        return
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="aiosnap-incremental-", dir=ROOT)).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        data = {
            "rows": args.rows,
            "units": unit_of_dedup(args.rows),
            "lora": asyncio.run(run_lora(scratch, nbytes, args.saves)),
            "zstd": zstd_rows(min(nbytes, 96 * MiB), args.reps),
            "zstd_saves": asyncio.run(zstd_saves(scratch, min(nbytes, 96 * MiB))),
            "cpus": os.cpu_count(),
            "machine": machine(),
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    (out / "incremental.json").write_text(json.dumps(data, indent=1))
    table = render(data)
    (out / "incremental.md").write_text(table)
    print(table)
    if args.publish:
        publish("incremental", table)


if __name__ == "__main__":
    main()
