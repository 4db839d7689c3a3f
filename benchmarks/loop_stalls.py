"""Where the event loop stalls while a state of many small tensors is saved and loaded.

A 2 ms ticker on the loop re-arms a watchdog at every tick: when the loop misses its
deadline, the watchdog writes the stack of every thread (``sys._current_frames``,
which holds the GIL: ``faulthandler.dump_traceback_later`` reads frames without it and
crashed the process now and then), so each dump shows what the threads were doing
during a stall. Collections of the cyclic garbage collector are timed through
``gc.callbacks``.

    python benchmarks/loop_stalls.py --tensors 20000 --reps 2

prints, per save, load, load_into and save+close (a new writer closed with its save in
flight), the largest gap between ticks, the collections longer than
10 ms, and the source lines the dumps caught most often (``--out``: the raw dumps).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import re
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO

import torch

import aiosnap

_FRAME = re.compile(r'File "(.+?)", line (\d+) in (\S+)')


class Probe:
    def __init__(self, dumps: TextIO, deadline: float) -> None:
        self.dumps, self.deadline = dumps, deadline
        self.collections: list[tuple[float, int]] = []
        self._started: dict[int, float] = {}
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        me = threading.get_ident()
        if phase == "start":
            self._started[me] = time.perf_counter()
        elif me in self._started:
            took = time.perf_counter() - self._started.pop(me)
            if took > 0.010:
                self.collections.append((took, info["generation"]))

    def _watch(self, armed: threading.Event, done: threading.Event) -> None:
        """Dump every thread's stack whenever ``armed`` is not set again within the deadline."""
        while not done.is_set():
            if armed.wait(self.deadline):
                armed.clear()
                continue
            if done.is_set():
                return
            me = threading.get_ident()
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                self.dumps.write(f"Thread 0x{ident:x}:\n")
                for at in reversed(traceback.extract_stack(frame)):  # innermost first
                    self.dumps.write(f'  File "{at.filename}", line {at.lineno} in {at.name}\n')
            self.dumps.write("\n")
            armed.wait()  # one dump per stall
            armed.clear()

    async def measure(self, work: Callable[[], Awaitable[object]]) -> dict[str, Any]:
        gaps: list[float] = []
        done, armed, stop = asyncio.Event(), threading.Event(), threading.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                armed.set()
                await asyncio.sleep(0.002)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
            stop.set()
            armed.set()

        self.collections.clear()
        watchdog = asyncio.create_task(asyncio.to_thread(self._watch, armed, stop))
        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        await work()
        seconds = time.perf_counter() - t0
        done.set()
        await tick
        await watchdog
        gaps.sort()
        return {
            "seconds": seconds,
            "max_gap_ms": gaps[-1] * 1e3,
            "p99_gap_ms": gaps[int(len(gaps) * 0.99)] * 1e3,
            "gc_over_10ms": [(round(t * 1e3, 1), gen) for t, gen in self.collections],
        }


def stalled_lines(dump_text: str, top: int) -> list[tuple[int, str]]:
    """The innermost aiosnap or library frame of each non-idle thread, most frequent first."""
    counts: collections.Counter[str] = collections.Counter()
    for block in dump_text.split("Thread 0x")[1:]:
        frames = _FRAME.findall(block)
        if not frames or frames[0][2] in ("wait", "select", "get", "_worker"):
            continue  # an idle thread
        path, line, name = frames[0]
        counts[f"{Path(path).name}:{line} in {name}"] += 1
    return [(n, where) for where, n in counts.most_common(top)]


async def main_async(args: argparse.Namespace) -> None:
    moments = {i: {"exp_avg": torch.randn(64), "step": i} for i in range(args.tensors)}
    state = {"optimizer": {"state": moments}}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory, open(args.out, "w") as dumps:
        probe = Probe(dumps, args.deadline_ms / 1e3)
        async with aiosnap.QueueWriter() as writer:

            async def save() -> None:
                await (await writer("ckpt", directory, state)).wait()

            kept: list[Any] = []

            async def load() -> None:
                # Kept, and dropped between measurements: freeing 100,000 tensors is ~50
                # ms in whichever thread drops them, the caller's, not the load's.
                kept.append(await aiosnap.load(str(Path(directory) / "ckpt")))

            async def load_into() -> None:
                await aiosnap.load_into(str(Path(directory) / "ckpt"), state)

            async def save_close() -> None:
                async with aiosnap.QueueWriter() as closing:
                    await closing("other", directory, state)  # in flight when the close begins

            await save()  # warm: first-use costs are not what this looks for
            for rep in range(args.reps):
                works = [("save", save), ("load", load), ("load_into", load_into), ("save+close", save_close)]
                for name, work in works:
                    r = await probe.measure(work)
                    kept.clear()
                    print(
                        f"{name} #{rep}: {r['seconds']:.2f} s, largest gap {r['max_gap_ms']:.1f} ms, "
                        f"p99 {r['p99_gap_ms']:.1f} ms, "
                        f"collections > 10 ms (ms, generation) {r['gc_over_10ms']}",
                        flush=True,
                    )
    print(f"\nwhere the loop was stalled (> {args.deadline_ms} ms), from {args.out}:")
    for n, where in stalled_lines(Path(args.out).read_text(), args.top):
        print(f"  {n:4d}  {where}")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--tensors", type=int, default=20_000)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--deadline-ms", type=float, default=25.0, help="a longer gap dumps the threads")
    parser.add_argument("--dir", default=None, help="scratch directory (default: the system's temp)")
    parser.add_argument("--out", default="loop_stalls.txt", help="where the raw dumps go")
    parser.add_argument("--top", type=int, default=10)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
