"""What lazy capture's copy-on-write window costs (src/aiosnap/_save/window.py).

    python benchmarks/bench_window.py [--ops 20000] [--lazy-size 512MiB] [--reps 3] [--publish]

1. Per operator, on the thread the window sits on: a small non-writing op (``x + 1``) and
   a small in-place op (``y.add_(1)``, which the window must look at), with no window, with
   a window watching (copies pending), with a finished one not yet taken off (passing
   through), and after it is taken off (it is gone: the same as none).
2. Eager and lazy saves of one state (the stall), and a CPU training loop with eager and
   lazy saves every 10 steps (bench.py's tables), in the same run.

``--publish`` puts the tables into docs/benchmarks.md (section ``window``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from aiosnap._save.window import Claims, Window, take_off_finished, warm

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
import bench  # noqa: E402
from _harness import empty_dir, publish  # noqa: E402


def per_op(ops: int, reps: int) -> dict[str, dict[str, float]]:
    """Microseconds per op, median of ``reps``, in each of the window's states."""
    x, y = torch.ones(16), torch.ones(16)

    def timed(fn: Any) -> float:
        runs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(ops):
                fn()
            runs.append((time.perf_counter() - t0) / ops * 1e6)
        return statistics.median(runs)

    def both() -> dict[str, float]:
        return {"x + 1": timed(lambda: x + 1), "y.add_(1)": timed(lambda: y.add_(1))}

    warm()  # what the first operator under any dispatch mode imports (writers do this at open)
    out = {"no window": both()}
    window = Window(Claims(1), {}, lambda i: None)  # watching, no tensor of its own pending
    window.put_on()
    try:
        out["window watching (copies pending)"] = both()
        window.finish()
        out["window finished, not yet taken off"] = both()
    finally:
        take_off_finished()
    assert _get_current_dispatch_mode() is None
    out["window taken off"] = both()
    return out


def render(ops: dict[str, dict[str, float]]) -> str:
    base = ops["no window"]
    lines = [
        "| on the caller's thread | `x + 1` us | `y.add_(1)` us | extra per op us |",
        "|---|---|---|---|",
    ]
    for name, row in ops.items():
        extra = max(row[k] - base[k] for k in row)
        lines.append(f"| {name} | {row['x + 1']:.2f} | {row['y.add_(1)']:.2f} | {extra:.2f} |")
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> str:
    ops = per_op(args.ops, args.reps)
    parts = [
        "Machine: " + ", ".join(f"{k} {v}" for k, v in bench.machine().items()),
        "",
        f"### The copy-on-write window's cost per operator ({args.ops} ops, median of {args.reps})",
        "",
        render(ops),
    ]
    directory = Path(tempfile.mkdtemp(prefix="aiosnap-window-", dir=ROOT))
    try:
        lazy = await bench.lazy_stalls(directory, bench.parse_size(args.lazy_size), args.reps)
        loop = await bench.training_loop(directory, args.reps, width=2048, depth=4, steps=60, every=10)
        parts.append(bench.render_lazy(lazy, loop, args.reps))
    finally:
        empty_dir(directory)
        directory.rmdir()
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, default=20000)
    p.add_argument("--lazy-size", default="512MiB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--publish", action="store_true")
    args = p.parse_args(argv)
    text = asyncio.run(main_async(args))
    print(text)
    if args.publish:
        publish("window", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
