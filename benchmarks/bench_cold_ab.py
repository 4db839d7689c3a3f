"""Cold loads of two source trees, A against B, as bench.py's cold section times them.

    python benchmarks/bench_cold_ab.py --a /tmp/base/src --b src [--sizes 256MiB,1GiB]
                                       [--reps 7] [--methods aiosnap.load_into,aiosnap.load]

Each load runs in a new process (``aiosnap._cli.bench.cold_child``, with PYTHONPATH set
to the tree), from ``cold_start`` (the file dropped from the page cache, fresh memory
faulted in and freed), on bench.py's state; A and B alternate, the one to go first
changing from one repetition to the next, so that the machine's drift falls on both.
Prints per size and method the median (min-max) seconds of each and the ratio of the
medians B / A. The file is written once per size, by the aiosnap this script imports
(the format is the same for both). Compare within one run only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import aiosnap
from aiosnap._cli.bench import COLD_CHILD

sys.path.insert(0, str(Path(__file__).parent))
from _harness import cold_start
from bench import make_state, parse_size, state_bytes

MiB = 1 << 20


def one(tree: str, method: str, path: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    done = subprocess.run(
        [sys.executable, "-c", COLD_CHILD, method, path], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{method} with {tree} failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.split()[-1])


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--a", required=True, help="the first source tree (the directory holding aiosnap/)")
    parser.add_argument("--b", required=True, help="the second")
    parser.add_argument("--sizes", default="256MiB,1GiB")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--methods", default="aiosnap.load_into")
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    args = parser.parse_args()
    trees = {"A": args.a, "B": args.b}
    with tempfile.TemporaryDirectory(prefix="cold-ab-", dir=args.dir) as scratch:
        path = os.path.join(scratch, "cold.snap")
        for size in map(parse_size, args.sizes.split(",")):
            state = make_state(size)
            nbytes = state_bytes(state)
            aiosnap.save_sync(path, state, storage=aiosnap.storage.LocalStorage(direct=False))
            del state
            for method in args.methods.split(","):
                times: dict[str, list[float]] = {"A": [], "B": []}
                for rep in range(args.reps):
                    for name in ("A", "B") if rep % 2 == 0 else ("B", "A"):
                        cold_start(path)
                        times[name].append(one(trees[name], method, path))
                a, b = (statistics.median(times[n]) for n in ("A", "B"))
                spread = {n: f"{min(t):.3f}-{max(t):.3f}" for n, t in times.items()}
                print(
                    f"{nbytes / MiB:6.0f} MiB {method:18} A {a:.3f} s ({spread['A']})  "
                    f"B {b:.3f} s ({spread['B']})  B/A {b / a:.3f}",
                    flush=True,
                )
            os.unlink(path)


if __name__ == "__main__":
    main()
