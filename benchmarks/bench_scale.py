"""How a group's save commit scales with its ranks (issue 42).

The simulation: N ranks as asyncio tasks of one process (``scale_group.SimGroup``),
voting through the real ``Member.vote`` over an in-process channel, rank 0 writing the
manifest with the real ``StepDirectories``; the reports are those of a llama-7B FSDP2
state sharded over all ranks (``Layout(n, n)``) or HSDP over groups of 64
(``Layout(n, 64)``). Per commit (the first, then a steady-state one with the same
layout): rank 0's CPU seconds (from having every report to its verdict sent), the
event loop's worst block (a 1 ms heartbeat's worst lateness) while rank 0 works (the
other simulated ranks only wait meanwhile) and over the whole commit (which counts the
other ranks' work too: in a real group, that is on other machines), bytes each rank
sent to rank 0, and messages each rank sent or received.

The anchor: a real save through a CheckpointManager at 2, 4 (and 8) gloo processes on
this machine, seconds per save; ``--before SRC`` runs the same with another checkout's
``src`` in the same run (alternating), for a ratio.

Results go to ``--out``/scale.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from scale_group import Heartbeat, SimGroup  # noqa: E402
from scale_layouts import Layout  # noqa: E402

from aiosnap._base import offload  # noqa: E402
from aiosnap._format.manifest import Manifest  # noqa: E402


async def simulate(size: int, shard: int, directory: Path) -> list[dict[str, Any]]:
    """Two commits of ``Layout(size, shard)``: the first, then a steady-state one."""
    layout = Layout(size, shard)
    group = SimGroup(size, directory, layout.report)
    beat = Heartbeat()
    rows = []
    await offload.warm()
    async with anyio.create_task_group() as tg:
        tg.start_soon(beat.run)
        for step, name in ((1, "first"), (2, "steady")):
            traffic = group.votes.traffic
            sent, messages, cpu = sum(traffic.sent[1:]), sum(traffic.messages[1:]), traffic.rank0_cpu
            windows = len(traffic.windows)
            beat.reset()
            start = time.perf_counter()
            outcomes = await group.save(step)
            wall = time.perf_counter() - start
            bad = [o for o in outcomes if isinstance(o, BaseException)]
            if bad:
                raise RuntimeError(f"{size} ranks, step {step}: {bad[0]!r}")
            peers = max(1, size - 1)
            manifest = directory / f"step_{step:08d}" / "aiosnap-manifest.json"
            rows.append(
                {
                    "ranks": size,
                    "layout": "7B-FSDP" if shard == size else f"HSDP-{shard}",
                    "commit": name,
                    "rank0_cpu_s": traffic.rank0_cpu - cpu,
                    "worst_block_ms": beat.worst * 1000,
                    "rank0_block_ms": beat.worst_within(traffic.windows[windows:]) * 1000,
                    "bytes_to_rank0_per_rank": (sum(traffic.sent[1:]) - sent) / peers,
                    "messages_per_rank": (sum(traffic.messages[1:]) - messages) / peers,
                    "manifest_bytes": manifest.stat().st_size,
                    "wall_s": wall,
                }
            )
        beat.stop()
    for row, step in zip(rows, (1, 2), strict=True):
        # Measured once the heartbeat stopped: this runs on the loop.
        row["to_bytes_s"] = _serialising(directory / f"step_{step:08d}" / "aiosnap-manifest.json")
        print(_row(row), flush=True)
    return rows


def _serialising(path: Path) -> float:
    """CPU seconds of ``Manifest.to_bytes`` for the manifest at ``path``: the part of rank
    0's work that is the manifest's format (the rest is the vote's)."""
    manifest = Manifest.parse(str(path), path.read_bytes())
    start = time.process_time()
    manifest.to_bytes()
    return time.process_time() - start


def render(rows: list[dict[str, Any]], anchor: list[dict[str, Any]]) -> str:
    lines = [
        "### A group's commit, simulated: N ranks as tasks of one process (llama-7B state)",
        "",
        "| ranks | layout | commit | rank 0 CPU s | loop's worst block ms (rank 0's work / all) "
        "| bytes to rank 0 per rank | messages per rank | manifest bytes (to_bytes s) | wall s |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_row(r) for r in rows]
    if anchor:
        lines += [
            "",
            "### Anchor: a real save through CheckpointManager over gloo (processes on this machine)",
            "",
            "| processes | code | s per save (median) |",
            "|---:|---|---:|",
        ]
        lines += [f"| {a['ranks']} | {a['code']} | {a['s']:.3f} |" for a in anchor]
    return "\n".join(lines) + "\n"


def _row(r: dict[str, Any]) -> str:
    return (
        f"| {r['ranks']} | {r['layout']} | {r['commit']} | {r['rank0_cpu_s']:.3f} | "
        f"{r.get('rank0_block_ms', float('nan')):.0f} / {r['worst_block_ms']:.0f} | "
        f"{r['bytes_to_rank0_per_rank']:.0f} | "
        f"{r['messages_per_rank']:.1f} | {r['manifest_bytes']} ({r.get('to_bytes_s', float('nan')):.2f}) | "
        f"{r['wall_s']:.2f} |"
    )


def anchor(ranks: int, src: str, scratch: Path, saves: int) -> float:
    """Median seconds per save of ``ranks`` gloo processes running ``src``'s aiosnap."""
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        store = f"file://{tmp}/store"
        env = {**os.environ, "PYTHONPATH": src}
        out = Path(tmp) / "times.json"
        procs = [
            subprocess.Popen(
                [sys.executable, str(ROOT / "scale_anchor.py"), str(r), str(ranks), store, tmp, str(saves)],
                env=env,
            )
            for r in range(ranks)
        ]
        codes = [p.wait(timeout=600) for p in procs]
        if any(codes):
            raise RuntimeError(f"the anchor at {ranks} processes exited {codes}")
        return float(statistics.median(json.loads(out.read_text())))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="8,64,256,1024", help="ranks of the simulation")
    parser.add_argument("--anchor", default="2,4", help="gloo processes of the anchor ('' for none)")
    parser.add_argument("--saves", type=int, default=5, help="saves per anchor run")
    parser.add_argument("--before", help="another checkout's src directory, for the anchor's ratio")
    parser.add_argument("--quick", action="store_true", help="8 and 16 ranks, a 2-process anchor")
    parser.add_argument("--dir", help="scratch directory")
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument(
        "--gc-off",
        action="store_true",
        help="the collector off: every simulated rank's objects live in this one process (a million "
        "at 1,024 ranks), and their full collections block the loop as a real rank 0's would not",
    )
    args = parser.parse_args()
    if args.gc_off:
        gc.disable()
    sizes = [8, 16] if args.quick else [int(s) for s in args.sizes.split(",") if s]
    anchors = [2] if args.quick else [int(s) for s in args.anchor.split(",") if s]
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench-scale-"))
    scratch.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for size in sizes:
        for shard in sorted({size, min(size, 64)}, reverse=True):
            with tempfile.TemporaryDirectory(dir=scratch) as tmp:
                rows += anyio.run(simulate, size, shard, Path(tmp))
    here = str(ROOT.parent / "src")
    codes = {"this": here, **({"before": args.before} if args.before else {})}
    timed: list[dict[str, Any]] = []
    for ranks in anchors:
        runs: dict[str, list[float]] = {code: [] for code in codes}
        for _ in range(1 if args.quick else 2):  # alternating, so that both see the same machine
            for code, src in codes.items():
                runs[code].append(anchor(ranks, src, scratch, 2 if args.quick else args.saves))
        timed += [{"ranks": ranks, "code": c, "s": statistics.median(t)} for c, t in runs.items()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps({"simulated": rows, "anchor": timed}, indent=1))
    table = render(rows, timed)
    (out / "scale.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
