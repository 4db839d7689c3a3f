"""aiosnap benchmark suite: physical limits, aiosnap, and peers, in one run on one state.

    python benchmarks/bench.py [--size 1GiB] [--reps 5] [--dir DIR] [--sweeps] [--quick]
                               [--cold-sizes 256MiB,1GiB,4GiB]

Every figure is the median of ``--reps`` repetitions; the order of the methods rotates
from one repetition to the next so that machine noise spreads evenly. Writers and
stagers are opened, warmed with one save, measured, and closed within a repetition,
so each method's peak RSS is its own. The raw write the saves are held to is timed as
they are, right after an untimed write of the same bytes: on some virtual disks a write
that follows another runs a third slower than one on an idle disk (the idle disk's time
has a row of its own). Cold loads are also measured as a resume does them: one load per
new process (``aiosnap._cli.bench.cold_load``), beside torch.load and the raw read of the
same file, at each of ``--cold-sizes``. Results: ``benchmarks/results/latest.{md,json,png}``
(``--out`` elsewhere);
``--publish`` also puts them in docs/benchmarks.md (replacing only this script's section).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import aiosnap
from aiosnap._cli.bench import cold_load
from aiosnap._storage.posix import huge_pages_pay, thp_mode

sys.path.insert(0, str(Path(__file__).parent))
from _harness import RssSampler, cold_start, empty_dir, loop_lag, o_direct_supported, publish
from _peers import PEERS

MiB = 1 << 20
GiB = 1 << 30
ROOT = Path(__file__).resolve().parent
Result = dict[str, float]
#: The write the saves are held to (see the module's text).
RAW_WRITE = "limit: write + fsync, O_DIRECT"
IDLE_WRITE = "limit: write + fsync, O_DIRECT, idle disk"
COPY_WRITE = "limit: np.copyto beside write + fsync, O_DIRECT"
IDLE_COPY_WRITE = "limit: np.copyto beside write + fsync, O_DIRECT, idle disk"


def parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": MiB, "gib": GiB, "b": 1}
    low = text.lower()
    for unit, factor in units.items():
        if low.endswith(unit):
            return int(float(low[: -len(unit)]) * factor)
    return int(low)


def make_state(total: int) -> dict[str, Any]:
    """Big fp32 tensors of 16 MiB, small tensors, and an optimizer-like dict with int keys."""
    big = max(1, (total - 4 * MiB) // (16 * MiB))
    piece = min(16 * MiB, total) // 4
    state: dict[str, Any] = {f"layer{i}.weight": torch.randn(piece) for i in range(big)}
    state["small"] = {f"bias{i}": torch.randn(1024) for i in range(100)}
    state["optimizer"] = {
        "state": {i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(2048)} for i in range(200)},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(200))}],
    }
    return state


def state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in tensors(v)]
    return []


# -- physical limits ---------------------------------------------------------------------------


class Limits:
    def __init__(self, state: dict[str, Any], directory: Path) -> None:
        self.parts = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors(state)]
        self.nbytes = sum(p.nbytes for p in self.parts)
        self.buffer = np.frombuffer(_aligned(self.nbytes), dtype=np.uint8)
        self.buffer[:] = 1  # touched once, reused: what a warm staging arena costs
        self.path = directory / "raw.bin"

    def copyto(self) -> Result:
        t0 = time.perf_counter()
        pos = 0
        for p in self.parts:
            np.copyto(self.buffer[pos : pos + p.nbytes], p)
            pos += p.nbytes
        return {"stall": time.perf_counter() - t0, "total": time.perf_counter() - t0}

    def write(self, direct: bool, after_write: bool = False, pause: bool = False) -> Result:
        """Write the bytes in 16 MiB pieces and fsync; ``after_write``: right after an
        untimed write of the same bytes, as a writer's timed save follows its warm one;
        ``pause``: on an idle disk."""
        if after_write:
            self.write(direct)
        if pause:
            idle()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        length = -(-self.nbytes // 4096) * 4096
        view = memoryview(self.buffer)[:length] if direct else memoryview(self.buffer)[: self.nbytes]
        t0 = time.perf_counter()
        fd = os.open(self.path, flags, 0o644)
        try:
            for start in range(0, len(view), 16 * MiB):
                os.write(fd, view[start : start + 16 * MiB])
            os.fsync(fd)
        finally:
            os.close(fd)
        total = time.perf_counter() - t0
        return {"stall": total, "total": total}

    def copy_fresh(self) -> Result:
        """``copyto`` into fresh memory, as a writer's first save fills its new arena."""
        fresh = np.frombuffer(_aligned(self.nbytes), dtype=np.uint8)
        t0 = time.perf_counter()
        pos = 0
        for p in self.parts:
            np.copyto(fresh[pos : pos + p.nbytes], p)
            pos += p.nbytes
        total = time.perf_counter() - t0
        return {"stall": total, "total": total}

    def copy_beside_write(self, pause: bool = False) -> Result:
        """The least a save that copies the state can take: one thread copies the state
        into the buffer, the other writes each 16 MiB piece (O_DIRECT) once it is
        copied, then fsync; right after an untimed write, as ``write(after_write=True)``,
        or (``pause``) on an idle disk. Stall: until the copy is done."""
        self.write(direct=True)
        if pause:
            idle()
        length = -(-self.nbytes // 4096) * 4096
        view, copied, done = memoryview(self.buffer)[:length], [0], [0.0]
        cond, failed = threading.Condition(), list[BaseException]()

        def copy() -> None:
            pos = 0
            try:
                for p in self.parts:
                    np.copyto(self.buffer[pos : pos + p.nbytes], p)
                    pos += p.nbytes
                    with cond:
                        copied[0] = pos
                        cond.notify()
            except BaseException as exc:
                failed.append(exc)
            done[0] = time.perf_counter()
            with cond:  # the writer waits for no more, whatever happened
                copied[0] = length
                cond.notify()

        t0 = time.perf_counter()
        thread = threading.Thread(target=copy)
        thread.start()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            for start in range(0, length, 16 * MiB):
                end = min(start + 16 * MiB, length)
                with cond:
                    while copied[0] < end:
                        cond.wait()
                os.write(fd, view[start:end])
            os.fsync(fd)
        finally:
            os.close(fd)
            thread.join()
        if failed:
            raise failed[0]
        return {"stall": done[0] - t0, "total": time.perf_counter() - t0}

    def cold_setup(self) -> None:
        """Before a cold read (untimed, outside the RSS sampler: cold_start's memory is
        not the read's)."""
        self.write(direct=False)
        cold_start(self.path)

    def cold_read(self, fresh: bool = False) -> Result:
        """A cold read of the bytes (after ``cold_setup``) into the reused buffer, or
        (``fresh``) into memory allocated for it, as a load returns: its pages are
        faulted in as they are read."""
        t0 = time.perf_counter()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            # Fresh memory as torch allocates it, with no huge-page advice (NumPy's own
            # would compact memory at every fault where defrag=madvise: see posix.py).
            fresh_bytes = torch.empty(self.nbytes, dtype=torch.uint8).numpy() if fresh else None
            view = memoryview(self.buffer if fresh_bytes is None else fresh_bytes)
            for start in range(0, self.nbytes, 16 * MiB):
                os.preadv(fd, [view[start : min(start + 16 * MiB, self.nbytes)]], start)
        finally:
            os.close(fd)
        total = time.perf_counter() - t0
        return {"stall": total, "total": total}


def _aligned(n: int) -> Any:
    import mmap

    return mmap.mmap(-1, -(-n // 4096) * 4096)


# -- aiosnap -------------------------------------------------------------------------------------


#: Seconds the disk is left alone before an "idle disk" row: on some virtual disks a
#: write that follows another runs a third slower than one on an idle disk.
IDLE_S = 3.0


def idle() -> None:
    time.sleep(IDLE_S)


def aiosnap_save(
    make_writer: Callable[[], Any],
    lag: bool = False,
    *,
    warm: bool = True,
    pause: bool = False,
    capture: str = "eager",
) -> Callable[..., Awaitable[Result]]:
    """A writer's save: after a warm save of the same state (its arena reused), right
    after it or (``pause``) on an idle disk; or (``warm=False``) the first save of a new
    writer, into a fresh arena."""

    async def run(state: dict[str, Any], directory: Path, rss: RssSampler) -> Result:
        # RSS counts from before the writer opens: its staging arenas are part of its cost.
        with rss:
            async with make_writer() as writer:
                if warm:
                    await (await writer("warm", str(directory), state)).wait()
                if pause:
                    await asyncio.to_thread(idle)
                with loop_lag() as lags:
                    t0 = time.perf_counter()
                    handle = await writer("ckpt", str(directory), state, capture=capture)
                    stall = time.perf_counter() - t0
                    stats = await handle.wait()
                    total = time.perf_counter() - t0
        result = {"stall": stall, "total": total, "write": stats.write_s, "fsync": stats.fsync_s}
        if lag:
            result["lag_p99_ms"] = float(np.percentile(lags, 99)) * 1e3 if lags else 0.0
            result["lag_max_ms"] = max(lags, default=0.0) * 1e3
        return result

    return run


async def aiosnap_one_call(state: dict[str, Any], directory: Path, rss: RssSampler) -> Result:
    """``aiosnap.save``, on an idle disk: a script's durable save, as torch.save + fsync."""
    await asyncio.to_thread(idle)
    with rss:
        t0 = time.perf_counter()
        stats = await aiosnap.save(str(directory / "one"), state)
        total = time.perf_counter() - t0
    return {"stall": total, "total": total, "write": stats.write_s, "fsync": stats.fsync_s}


async def aiosnap_load(state: dict[str, Any], directory: Path, rss: RssSampler, into: bool = False) -> Result:
    path = directory / "load.snap"
    # Written as the other cold rows' files are (buffered), and started as they are
    # (see cold_start: the memory a load allocates must not be what the VM handed back).
    await aiosnap.save(str(path), state, storage=aiosnap.storage.LocalStorage(direct=False))
    target = {k: v for k, v in state.items()} if into else None
    cold_start(path)
    with rss:
        t0 = time.perf_counter()
        if into:
            await aiosnap.load_into(str(path), target)
        else:
            await aiosnap.load(str(path))
        total = time.perf_counter() - t0
    return {"stall": total, "total": total}


METHODS: dict[str, Callable[..., Awaitable[Result]]] = {
    "aiosnap SimpleWriter (thread)": aiosnap_save(lambda: aiosnap.SimpleWriter()),
    "aiosnap StandardWriter (thread)": aiosnap_save(lambda: aiosnap.StandardWriter()),
    "aiosnap StandardWriter (process)": aiosnap_save(lambda: aiosnap.StandardWriter(offload="process")),
    "aiosnap QueueWriter (thread)": aiosnap_save(lambda: aiosnap.QueueWriter(), lag=True),
    "aiosnap QueueWriter (thread), idle disk": aiosnap_save(lambda: aiosnap.QueueWriter(), pause=True),
    "aiosnap QueueWriter (thread), first save of a new writer, idle disk": aiosnap_save(
        lambda: aiosnap.QueueWriter(), warm=False, pause=True
    ),
    "aiosnap QueueWriter (thread), lazy": aiosnap_save(
        lambda: aiosnap.QueueWriter(), lag=True, capture="lazy"
    ),
    "aiosnap.save (one call), idle disk": aiosnap_one_call,
    "aiosnap QueueWriter (thread), commit after capture": aiosnap_save(
        lambda: aiosnap.QueueWriter(pipeline=False), lag=True
    ),
    "aiosnap QueueWriter (process)": aiosnap_save(lambda: aiosnap.QueueWriter(offload="process"), lag=True),
    "aiosnap load (cold)": aiosnap_load,
    "aiosnap load_into (cold)": lambda s, d, r: aiosnap_load(s, d, r, into=True),
}


async def measure_all(
    state: dict[str, Any], directory: Path, reps: int, direct: bool
) -> dict[str, list[Result]]:
    limits = Limits(state, directory)
    sync_methods: dict[str, Callable[[], Result]] = {
        "limit: np.copyto into a reused buffer": limits.copyto,
        "limit: write + fsync, buffered": lambda: limits.write(direct=False, after_write=True),
        "limit: cold read": limits.cold_read,
        "limit: cold read into fresh memory": lambda: limits.cold_read(fresh=True),
    }
    if direct:
        sync_methods[RAW_WRITE] = lambda: limits.write(direct=True, after_write=True)
        sync_methods[IDLE_WRITE] = lambda: limits.write(direct=True, pause=True)
        sync_methods["limit: np.copyto beside write + fsync, O_DIRECT"] = limits.copy_beside_write
        sync_methods[IDLE_COPY_WRITE] = lambda: limits.copy_beside_write(pause=True)
    sync_methods["limit: np.copyto into fresh memory"] = limits.copy_fresh
    setups = {"limit: cold read": limits.cold_setup, "limit: cold read into fresh memory": limits.cold_setup}
    names = [*sync_methods, *METHODS, *PEERS]
    results: dict[str, list[Result]] = {n: [] for n in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            rss = RssSampler()
            if name in sync_methods:
                if name in setups:
                    setups[name]()
                with rss:
                    result = sync_methods[name]()
            elif name in METHODS:
                result = await METHODS[name](state, directory, rss)
            else:
                result = await asyncio.to_thread(PEERS[name], state, directory, rss)
            result["rss_extra"], result["faulted"] = rss.peak_extra, rss.faulted
            results[name].append(result)
            empty_dir(directory)
        print(f"  repetition {rep + 1}/{reps} done", flush=True)
    return results


# -- the durable gap, lazy capture, a training loop -------------------------------------------

#: The rows that explain call->durable against the limits, each against the limit taken
#: in the same disk state (right after a write, or on an idle disk).
DURABLE_ROWS = [
    IDLE_WRITE,
    RAW_WRITE,
    IDLE_COPY_WRITE,
    COPY_WRITE,
    "limit: np.copyto into a reused buffer",
    "limit: np.copyto into fresh memory",
    "aiosnap QueueWriter (thread), idle disk",
    "aiosnap QueueWriter (thread)",
    "aiosnap QueueWriter (thread), lazy",
    "aiosnap QueueWriter (thread), first save of a new writer, idle disk",
    "aiosnap.save (one call), idle disk",
]


def render_durable(summary: dict[str, dict[str, float]]) -> str:
    if COPY_WRITE not in summary:
        return ""
    lines = [
        "### Call->durable against the limits, in the same run",
        "",
        "Each save is held to the limits taken in the same disk state: right after a write of the "
        "same bytes (as a writer's timed save follows its warm one), or on an idle disk "
        f"({IDLE_S:.0f} s after the last write).",
        "",
        "| row | call->durable s (min-max) | x raw write | x copy beside write |",
        "|---|---|---|---|",
    ]
    for name in DURABLE_ROWS:
        s = summary.get(name)
        if s is None:
            continue
        idle_row = "idle disk" in name
        write = summary[IDLE_WRITE if idle_row else RAW_WRITE]["total"]
        copy = summary[IDLE_COPY_WRITE if idle_row else COPY_WRITE]["total"]
        lines.append(
            f"| {name} | {s['total']:.3f} ({s['total_min']:.3f}-{s['total_max']:.3f}) | "
            f"{s['total'] / write:.2f} | {s['total'] / copy:.2f} |"
        )
    return "\n".join(lines) + "\n"


async def lazy_stalls(directory: Path, size: int, reps: int) -> dict[str, dict[str, float]]:
    """Eager and lazy saves of one state by one QueueWriter, alternating: the stall, and
    call->durable."""
    state = make_state(size)
    runs: dict[str, list[tuple[float, float]]] = {"eager": [], "lazy": []}
    async with aiosnap.QueueWriter() as writer:
        await (await writer("warm", str(directory), state)).wait()
        for rep in range(reps):
            for mode in ("eager", "lazy") if rep % 2 == 0 else ("lazy", "eager"):
                t0 = time.perf_counter()
                handle = await writer("ckpt", str(directory), state, capture=mode)  # type: ignore[arg-type]
                stall = time.perf_counter() - t0
                await handle.wait()
                runs[mode].append((stall, time.perf_counter() - t0))
    empty_dir(directory)
    out = {}
    for mode, pairs in runs.items():
        stalls = [s for s, _ in pairs]
        out[mode] = {
            "bytes": state_bytes(state),
            "stall": statistics.median(stalls),
            "stall_min": min(stalls),
            "stall_max": max(stalls),
            "total": statistics.median(t for _, t in pairs),
        }
    return out


def _mlp(width: int, depth: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    return model, torch.optim.AdamW(model.parameters()), torch.randn(64, width)


async def training_loop(
    directory: Path, reps: int, *, width: int, depth: int, steps: int, every: int
) -> dict[str, Any]:
    """A synchronous CPU training step on the event loop's thread, as an async loop runs it
    (it yields once a step, as to a data loader), with a QueueWriter save every ``every``
    steps, eager or lazy, or none: the loop's time, rotated over ``reps``."""
    times: dict[str, list[float]] = {"no saves": [], "eager saves": [], "lazy saves": []}
    names = list(times)
    for rep in range(reps):
        for name in names[rep % 3 :] + names[: rep % 3]:
            model, opt, x = _mlp(width, depth)
            state = {"model": model, "optimizer": opt, "step": 0}
            async with aiosnap.QueueWriter() as writer:
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()  # the optimizer's state exists: the saves are all of one size
                await (await writer("warm", str(directory), state)).wait()
                t0 = time.perf_counter()
                for step in range(steps):
                    opt.zero_grad()
                    model(x).square().mean().backward()
                    opt.step()
                    state["step"] = step
                    if name != "no saves" and step % every == every - 1:
                        mode = "lazy" if name == "lazy saves" else "eager"
                        await writer("ckpt", str(directory), state, capture=mode)  # type: ignore[arg-type]
                    await asyncio.sleep(0)
                times[name].append(time.perf_counter() - t0)
            empty_dir(directory)
    model, opt, _ = _mlp(width, depth)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    saves = steps // every
    base = statistics.median(times["no saves"])
    rows = {}
    for name, seconds in times.items():
        loop = statistics.median(seconds)
        rows[name] = {
            "loop": loop,
            "min": min(seconds),
            "max": max(seconds),
            "per_checkpoint": (loop - base) / saves if name != "no saves" else 0.0,
        }
    return {"steps": steps, "every": every, "state_bytes": 3 * params, "rows": rows}


def render_lazy(lazy: dict[str, dict[str, float]], loop: dict[str, Any], reps: int) -> str:
    eager = lazy["eager"]
    lines = [
        f"### Lazy capture: {eager['bytes'] / MiB:.0f} MiB, QueueWriter (thread), {reps} alternating saves",
        "",
        "| capture | stall s (min-max) | call->durable s | stall x eager |",
        "|---|---|---|---|",
    ]
    for mode, r in lazy.items():
        lines.append(
            f"| {mode} | {r['stall']:.4f} ({r['stall_min']:.4f}-{r['stall_max']:.4f}) | {r['total']:.3f} | "
            f"{r['stall'] / eager['stall']:.3f} |"
        )
    rows = loop["rows"]
    lines += [
        "",
        f"### A CPU training loop: {loop['steps']} steps, a save every {loop['every']} "
        f"({loop['state_bytes'] / MiB:.0f} MiB of model + AdamW state), rotated",
        "",
        "| saves | loop s (min-max) | per checkpoint s | loop x eager saves |",
        "|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['loop']:.3f} ({r['min']:.3f}-{r['max']:.3f}) | {r['per_checkpoint']:.3f} | "
            f"{r['loop'] / rows['eager saves']['loop']:.3f} |"
        )
    return "\n".join(lines) + "\n"


# -- sweeps -----------------------------------------------------------------------------------------


async def sweep_sizes(directory: Path, sizes: list[int], reps: int) -> list[dict[str, float]]:
    rows = []
    for size in sizes:
        state = make_state(size)
        nbytes = state_bytes(state)
        limits = Limits(state, directory)
        totals, stalls, raws = [], [], []
        for _ in range(reps):
            raws.append(limits.write(direct=o_direct_supported(directory), after_write=True)["total"])
            r = await aiosnap_save(lambda: aiosnap.QueueWriter())(state, directory, RssSampler())
            totals.append(r["total"])
            stalls.append(r["stall"])
            empty_dir(directory)
        rows.append(
            {
                "bytes": nbytes,
                "stall": statistics.median(stalls),
                "total": statistics.median(totals),
                "raw": statistics.median(raws),
            }
        )
        print(f"  size {nbytes / MiB:.0f} MiB done", flush=True)
        del state, limits
    return rows


async def sweep_counts(directory: Path, counts: list[int], reps: int) -> list[dict[str, float]]:
    rows = []
    for n in counts:
        state = {f"t{i}": torch.randn(1024) for i in range(n)}  # 4 KiB each
        totals, stalls = [], []
        async with aiosnap.QueueWriter() as writer:
            await (await writer("warm", str(directory), state)).wait()
            for _ in range(reps):
                t0 = time.perf_counter()
                handle = await writer("ckpt", str(directory), state)
                stalls.append(time.perf_counter() - t0)
                stats = await handle.wait()
                totals.append(time.perf_counter() - t0 - stats.fsync_s)
        loads, intos = [], []
        for _ in range(reps):  # the file is in the page cache: what is timed is per tensor
            t0 = time.perf_counter()
            await aiosnap.load(str(directory / "ckpt"))
            loads.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await aiosnap.load_into(str(directory / "ckpt"), state)
            intos.append(time.perf_counter() - t0)
        rows.append(
            {
                "tensors": n,
                "stall": statistics.median(stalls),
                "total_minus_fsync": statistics.median(totals),
                "load": statistics.median(loads),
                "load_min": min(loads),
                "load_max": max(loads),
                "load_into": statistics.median(intos),
                "load_into_min": min(intos),
                "load_into_max": max(intos),
            }
        )
        empty_dir(directory)
        print(f"  {n} tensors done", flush=True)
    return rows


async def tiny_saves(directory: Path, count: int) -> dict[str, float]:
    costs, fsyncs = [], []
    async with aiosnap.QueueWriter() as writer:
        for i in range(count):
            t0 = time.perf_counter()
            handle = await writer("tiny", str(directory), {"step": i, "x": torch.ones(4)})
            stats = await handle.wait()
            costs.append(time.perf_counter() - t0 - stats.fsync_s)
            fsyncs.append(stats.fsync_s)
    return {
        "saves": count,
        "median_ms_beyond_fsync": statistics.median(costs) * 1e3,
        "median_fsync_ms": statistics.median(fsyncs) * 1e3,
    }


#: The rows of the cold-load table: (method of cold_load, the file it reads).
COLD_ROWS: dict[str, tuple[str, str]] = {
    "limit: read, one reused 16 MiB buffer": ("read", "snap"),
    "limit: read into fresh memory": ("read-fresh", "snap"),
    "read into fresh memory advised MADV_HUGEPAGE": ("read-fresh-huge", "snap"),
    "torch.load": ("torch.load", "pt"),
    "aiosnap.load": ("aiosnap.load", "snap"),
    "aiosnap.load_into (target made first)": ("aiosnap.load_into", "snap"),
}


async def cold_loads(directory: Path, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """One load per new process, each from a cold start (see cold_start), the order of
    the rows rotating; per size and row, the median and spread of the seconds."""
    rows: list[dict[str, Any]] = []
    for size in sizes:
        state = make_state(size)
        nbytes = state_bytes(state)
        files = {"snap": directory / "cold.snap", "pt": directory / "cold.pt"}
        # Written as the other cold rows' files are: buffered, then dropped from the cache.
        await aiosnap.save(str(files["snap"]), state, storage=aiosnap.storage.LocalStorage(direct=False))
        torch.save(state, files["pt"])
        del state
        times: dict[str, list[float]] = {name: [] for name in COLD_ROWS}
        names = list(COLD_ROWS)
        for rep in range(reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                method, file = COLD_ROWS[name]
                cold_start(files[file])
                times[name].append(await asyncio.to_thread(cold_load, method, str(files[file])))
        for name, seconds in times.items():
            rows.append(
                {
                    "bytes": nbytes,
                    "method": name,
                    "s": statistics.median(seconds),
                    "min": min(seconds),
                    "max": max(seconds),
                }
            )
        empty_dir(directory)
        print(f"  cold loads of {nbytes / MiB:.0f} MiB done", flush=True)
    return rows


def render_cold(rows: list[dict[str, Any]], reps: int) -> str:
    """The cold-load table: time, bandwidth, and both against torch.load and the raw read."""
    thp = f"enabled={thp_mode('enabled')}, defrag={thp_mode('defrag')}"
    lines = [
        f"### Cold loads in a new process (medians of {reps} rotated runs, one load per process)",
        "",
        f"Transparent huge pages here: {thp}; aiosnap asks for them: {'yes' if huge_pages_pay() else 'no'}.",
        "",
        "| MiB | method | s (min-max) | GB/s | x torch.load time | bandwidth x raw read's |",
        "|---|---|---|---|---|---|",
    ]
    by = {(r["bytes"], r["method"]): r for r in rows}
    for r in rows:
        torch_s = by[(r["bytes"], "torch.load")]["s"]
        read_s = by[(r["bytes"], "limit: read, one reused 16 MiB buffer")]["s"]
        lines.append(
            f"| {r['bytes'] / MiB:.0f} | {r['method']} | {r['s']:.3f} ({r['min']:.3f}-{r['max']:.3f}) | "
            f"{r['bytes'] / r['s'] / 1e9:.2f} | {r['s'] / torch_s:.2f} | {read_s / r['s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def slope(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2:
        return float("nan")
    return float(np.polyfit(np.array(xs, dtype=float), np.array(ys, dtype=float), 1)[0])


# -- report -----------------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory": f"{mem:.0f} GiB",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def summarize(results: dict[str, list[Result]], nbytes: int) -> dict[str, dict[str, float]]:
    summary = {}
    for name, runs in results.items():
        keys = {k for r in runs for k in r}
        summary[name] = {k: statistics.median(r[k] for r in runs if k in r) for k in keys}
        # The spread too: one median hides a bimodal method (loads were 0.4 s, then 2.1 s).
        for k in ("stall", "total"):
            summary[name][f"{k}_min"] = min(r[k] for r in runs)
            summary[name][f"{k}_max"] = max(r[k] for r in runs)
        summary[name]["gbps"] = nbytes / summary[name]["total"] / 1e9
    return summary


def render(
    summary: dict[str, dict[str, float]], nbytes: int, info: dict[str, Any], extra: dict[str, Any]
) -> str:
    lim = {k.removeprefix("limit: "): v for k, v in summary.items() if k.startswith("limit: ")}
    copy = lim["np.copyto into a reused buffer"]["total"]
    write = lim.get(RAW_WRITE.removeprefix("limit: "), lim["write + fsync, buffered"])["total"]
    read = lim["cold read"]["total"]
    lines = [
        f"State: {nbytes / GiB:.2f} GiB ({extra['tensor_count']} tensors); medians (and min-max) of "
        f"{extra['reps']} rotated repetitions; directory on {extra['fs']}"
        f"{'' if extra['direct'] else ' (O_DIRECT unavailable: buffered)'}.",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()),
        "",
        "| method | stall s | call->durable s (min-max) | GB/s | stall / copyto | total / raw write | "
        "total / raw read | peak extra RSS / state | pages faulted / state | loop lag p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        is_load = _is_load(name)
        vs_write = "" if is_load else f"{s['total'] / write:.2f}"
        vs_read = f"{s['total'] / read:.2f}" if is_load else ""
        lag = f"{s['lag_p99_ms']:.1f}" if "lag_p99_ms" in s else ""
        lines.append(
            f"| {name} | {s['stall']:.3f} | {s['total']:.3f} ({s['total_min']:.3f}-{s['total_max']:.3f}) | "
            f"{s['gbps']:.2f} | {s['stall'] / copy:.2f} | "
            f"{vs_write} | {vs_read} | {s.get('rss_extra', 0) / nbytes:.2f} | "
            f"{s.get('faulted', 0) / nbytes:.2f} | {lag} |"
        )
    for title, rows in (
        ("Size sweep (QueueWriter, thread)", extra.get("sizes")),
        ("Tensor-count sweep (4 KiB tensors, QueueWriter)", extra.get("counts")),
    ):
        if rows:
            lines += ["", f"### {title}", "", "| " + " | ".join(rows[0]) + " |", "|---" * len(rows[0]) + "|"]
            lines += ["| " + " | ".join(f"{v:.4g}" for v in r.values()) + " |" for r in rows]
    for key in ("size_slope", "count_slope", "tiny"):
        if key in extra:
            lines += ["", f"- {key}: {extra[key]}"]
    return "\n".join(lines) + "\n"


def render_sections(
    summary: dict[str, dict[str, float]], info: dict[str, Any], extra: dict[str, Any]
) -> dict[str, str]:
    """The tables of issue 31, each a section of docs/benchmarks.md of its own (``bench:NAME``),
    headed with the machine and the date of the run."""
    head = "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()) + "\n\n"
    sections = {"durable": render_durable(summary)}
    if extra.get("cold"):
        sections["cold"] = render_cold(extra["cold"], extra["reps"])
    if extra.get("lazy"):
        sections["lazy"] = render_lazy(extra["lazy"], extra["loop"], extra["reps"])
    return {name: head + text for name, text in sections.items() if text}


def _is_load(name: str) -> bool:
    return "load" in name or "cold read" in name


def chart(summary: dict[str, dict[str, float]], sizes: list[dict[str, float]] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if sizes else 1, figsize=(15 if sizes else 10, 6), squeeze=False)
    names = [n for n in summary if not _is_load(n)]
    ys = np.arange(len(names))
    ax = axes[0][0]
    ax.barh(ys - 0.2, [summary[n]["stall"] for n in names], 0.4, label="stall")
    ax.barh(ys + 0.2, [summary[n]["total"] for n in names], 0.4, label="call -> durable")
    ax.set_yticks(ys, names, fontsize=7)
    ax.set_xlabel("seconds (median)")
    ax.legend()
    ax.set_title("save: stall and call->durable")
    if sizes:
        ax = axes[0][1]
        gib = [r["bytes"] / GiB for r in sizes]
        for key in ("stall", "total", "raw"):
            ax.plot(gib, [r[key] for r in sizes], marker="o", label=key)
        ax.set_xlabel("state GiB")
        ax.set_ylabel("seconds")
        ax.set_title("cost vs size")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


async def main_async(args: argparse.Namespace) -> None:
    warnings.simplefilter("ignore")
    directory = Path(args.dir or tempfile.mkdtemp(prefix="aiosnap-bench-", dir=ROOT)).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    direct = o_direct_supported(directory)
    if not direct:
        print(f"note: O_DIRECT is not supported on {directory}; raw and aiosnap writes fall back to buffered")
    size = parse_size(args.size)
    state = make_state(size)
    nbytes = state_bytes(state)
    print(f"benchmarking {nbytes / MiB:.0f} MiB in {directory}, {args.reps} repetitions", flush=True)
    results = await measure_all(state, directory, args.reps, direct)
    summary = summarize(results, nbytes)
    extra: dict[str, Any] = {
        "reps": args.reps,
        "direct": direct,
        "fs": _fs_type(directory),
        "tensor_count": len(tensors(state)),
    }
    del state
    if args.sweeps:
        sizes = [parse_size(s) for s in args.sweep_sizes.split(",")]
        extra["sizes"] = await sweep_sizes(directory, sizes, max(1, args.reps // 2))
        rows = extra["sizes"]
        extra["size_slope"] = (
            f"aiosnap {slope([r['bytes'] for r in rows], [r['total'] for r in rows]) * GiB:.3f} s/GiB, "
            f"raw write {slope([r['bytes'] for r in rows], [r['raw'] for r in rows]) * GiB:.3f} s/GiB"
        )
        counts = [int(c) for c in args.sweep_counts.split(",")]
        # All the repetitions (a 100,000-tensor load takes ~1 s): with 2, the median was
        # the mean of the process's first load into fresh memory and one after it.
        extra["counts"] = await sweep_counts(directory, counts, args.reps)
        rows = extra["counts"]
        per = slope([r["tensors"] for r in rows], [r["total_minus_fsync"] for r in rows])
        counted = [r["tensors"] for r in rows]
        load, into = slope(counted, [r["load"] for r in rows]), slope(counted, [r["load_into"] for r in rows])
        extra["count_slope"] = (
            f"{per * 1e6:.1f} us per tensor to save (call->durable minus fsync), "
            f"{load * 1e6:.1f} to load, {into * 1e6:.1f} to load_into (warm cache)"
        )
        extra["tiny"] = await tiny_saves(directory, args.tiny)
    if args.lazy_size:
        extra["lazy"] = await lazy_stalls(directory, parse_size(args.lazy_size), args.reps)
        extra["loop"] = await training_loop(
            directory, args.loop_reps, width=args.loop_width, depth=4, steps=args.loop_steps, every=10
        )
    if args.cold_sizes:
        extra["cold"] = await cold_loads(
            directory, [parse_size(s) for s in args.cold_sizes.split(",")], args.reps
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    table = render(summary, nbytes, info, extra)
    sections = render_sections(summary, info, extra)
    (out / "latest.md").write_text("\n".join([table, *sections.values()]))
    (out / "latest.json").write_text(
        json.dumps({"machine": info, "summary": summary, "extra": extra}, indent=1)
    )
    chart(summary, extra.get("sizes"), out / "latest.png")
    print("\n".join([table, *sections.values()]))
    if args.publish:
        docs = ROOT.parent / "docs"
        # The chart goes inside docs/, where the documentation site finds it.
        shutil.copyfile(out / "latest.png", docs / "assets" / "benchmarks-latest.png")
        publish("main", table + "\n![chart](assets/benchmarks-latest.png)\n")
        for name, text in sections.items():
            publish(name, text)
    empty_dir(directory)
    if not args.dir:
        directory.rmdir()


def _fs_type(directory: Path) -> str:
    best, fstype = "", "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if str(directory).startswith(parts[1]) and len(parts[1]) > len(best):
                best, fstype = parts[1], parts[2]
    except OSError:
        pass
    return fstype


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", help="state size, e.g. 64MiB or 1GiB (default 1GiB; 64MiB with --quick)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", help="scratch directory on the disk to measure (default: under benchmarks/)")
    parser.add_argument("--sweeps", action="store_true", help="also sweep size, tensor count, tiny saves")
    parser.add_argument("--sweep-sizes", default="64MiB,256MiB,1GiB,4GiB")
    parser.add_argument("--sweep-counts", default="10,1000,10000,100000")
    parser.add_argument("--tiny", type=int, default=1000, help="saves of a tiny state")
    parser.add_argument("--lazy-size", default="512MiB", help="state of the lazy capture table ('' for none)")
    parser.add_argument("--loop-steps", type=int, default=60, help="steps of the training-loop table")
    parser.add_argument("--loop-width", type=int, default=2048, help="width of its MLP (4 layers)")
    parser.add_argument("--loop-reps", type=int, default=3, help="runs of each training loop")
    parser.add_argument(
        "--cold-sizes",
        default="256MiB,1GiB,4GiB",
        help="sizes of the cold loads in new processes ('' for none)",
    )
    parser.add_argument("--publish", action="store_true", help="write docs/benchmarks.md")
    parser.add_argument("--out", default=str(ROOT / "results"), help="where the table, JSON and chart go")
    parser.add_argument("--quick", action="store_true", help="smoke test: 64MiB, 1 repetition, small sweeps")
    args = parser.parse_args()
    if args.quick:
        args.size, args.reps, args.sweeps = args.size or "64MiB", 1, True
        args.sweep_sizes, args.sweep_counts, args.tiny = "16MiB,64MiB", "10,100", 20
        args.cold_sizes, args.lazy_size = "16MiB", "16MiB"
        args.loop_steps, args.loop_width, args.loop_reps = 20, 256, 1
    args.size = args.size or "1GiB"
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
