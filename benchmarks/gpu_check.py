"""The CUDA path on a real GPU, in one prepared run of a few minutes (``nox -s gpu``).

    python benchmarks/gpu_check.py [--size-gib 6] [--reps 3] [--publish] [--dry-run]

1. The tests marked ``cuda`` (skipped where there is no GPU), through pytest.
2. Checks: no host synchronisation in the hot path (``torch.cuda.set_sync_debug_mode
   ("error")`` around save calls and training steps, lazy and eager), and pinned staging
   memory registered once per arena and released when the writer closes.
3. A model with AdamW of ``--size-gib`` GiB of saved state: the stall and call->durable of
   eager and lazy saves, against DCP ``async_save`` with a pinned, reused DefaultStager,
   and the raw O_DIRECT write of the same bytes.
4. A training loop: the time of a checkpoint call and the ``--steps`` steps after it,
   against the same steps without one, for eager, lazy and DCP (each save is made
   durable before the next, untimed: the disk's speed is row 3's).

It prints a markdown table headed with the GPU's name (``--out`` keeps it, ``--publish``
puts it into docs/benchmarks.md). ``--dry-run`` runs all of it on the CPU with a small
model, in seconds (the CUDA-only checks are reported as skipped); tests/test_gpu_check.py
runs it so, and with a fake device in place of CUDA.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import aiosnap
from aiosnap._save.device import CudaCopier, DeviceCopier

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from _harness import empty_dir, o_direct_supported, publish  # noqa: E402
from _peers import cpu_stager, timed_async_save  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20


@dataclass
class Setup:
    """What a run works on: the device, the model and its optimizer, a batch."""

    device: torch.device
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    copier: DeviceCopier | None = None
    state: dict[str, Any] = field(default_factory=dict)

    def step(self) -> None:
        """One training step, with nothing that waits for the device (no ``.item()``)."""
        self.opt.zero_grad(set_to_none=True)
        self.model(self.x).square().mean().backward()
        self.opt.step()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def writer(self, **options: Any) -> Any:
        return aiosnap.QueueWriter(max_pending=1, device_copier=self.copier, **options)

    @property
    def nbytes(self) -> int:
        tensors = [*self.model.state_dict().values()]
        tensors += [t for s in self.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def make_setup(size: int, device: torch.device, copier: DeviceCopier | None = None) -> Setup:
    """An MLP whose parameters and AdamW moments come to about ``size`` bytes, one step in."""
    torch.manual_seed(0)
    width = 8192 if size >= GiB else 256
    layers = max(1, size // 12 // (width * width))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(1024 if device.type == "cuda" else 32, width, device=device)
    setup = Setup(device, model, opt, x, copier)
    setup.step()
    setup.state.update(model=model, optimizer=opt, step=1)
    setup.sync()
    return setup


def dcp_state(setup: Setup) -> dict[str, torch.Tensor]:
    """The same tensors as a flat dict DCP takes without a process group."""
    flat = {f"model.{k}": v for k, v in setup.model.state_dict().items()}
    for i, s in enumerate(setup.opt.state.values()):
        flat.update({f"optim.{i}.{k}": t for k, t in s.items() if isinstance(t, torch.Tensor)})
    return flat


def dcp_stager(setup: Setup) -> Any:
    """DCP's DefaultStager, pinned and reused, as DCP's users get their fastest stall."""
    if setup.device.type != "cuda":
        return cpu_stager()  # a CPU-only torch has no pinned memory
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=True,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=True,
        )
    )


# -- checks ---------------------------------------------------------------------------------------


@contextmanager
def sync_errors(setup: Setup) -> Iterator[None]:
    """Any host synchronisation with the device inside the block raises (CUDA only)."""
    if setup.device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


async def check_no_host_sync(setup: Setup, directory: Path) -> str:
    """Save calls and the steps after them make no host synchronisation: the copies wait
    on events in the staging thread, and the guard orders the step on the device."""
    if setup.device.type != "cuda":
        return "skipped (no CUDA)"
    async with setup.writer() as writer:
        await (await writer("warm", str(directory), setup.state)).wait()  # pinned, warmed
        for capture in ("lazy", "eager"):
            with sync_errors(setup):
                handle = await writer("ckpt", str(directory), setup.state, capture=capture)
                for _ in range(3):
                    setup.step()
            await handle.wait()
    return "passed"


class PinCounter:
    """Counts the arenas a copier pins (distinct addresses) and unpins; on CUDA, also
    the driver's own cudaHostRegister/cudaHostUnregister calls."""

    def __init__(self, copier: Any) -> None:
        self.pinned: set[int] = set()
        self.unpinned: set[int] = set()
        self.registered = self.unregistered = 0
        pin, unpin = copier.pin, copier.unpin
        copier.pin = lambda array: (self.pinned.add(int(array.ctypes.data)), pin(array))[1]
        copier.unpin = lambda array: (self._unpinned(array), unpin(array))[1]

    def _unpinned(self, array: Any) -> None:
        if int(array.ctypes.data) in self.pinned:
            self.unpinned.add(int(array.ctypes.data))

    @contextmanager
    def driver(self) -> Iterator[None]:
        if not torch.cuda.is_available():
            yield
            return
        real = torch.cuda.cudart
        counter = self

        class Counting:
            def __getattr__(self, name: str) -> Any:
                return getattr(real(), name)

            def cudaHostRegister(self, *args: Any) -> Any:
                counter.registered += 1
                return real().cudaHostRegister(*args)

            def cudaHostUnregister(self, *args: Any) -> Any:
                counter.unregistered += 1
                return real().cudaHostUnregister(*args)

        torch.cuda.cudart = lambda: Counting()  # type: ignore[assignment,return-value]
        try:
            yield
        finally:
            torch.cuda.cudart = real


async def check_pinning(setup: Setup, directory: Path, saves: int = 4) -> str:
    """Each arena is pinned once however many saves reuse it, and every one is released
    when the writer closes."""
    if setup.copier is None and setup.device.type != "cuda":
        return "skipped (no device copier)"
    copier = setup.copier if setup.copier is not None else CudaCopier()
    counter = PinCounter(copier)
    async with aiosnap.QueueWriter(max_pending=1, device_copier=copier) as writer:
        with counter.driver():
            for i in range(saves):
                await (await writer(f"p{i}", str(directory), setup.state)).wait()
            await writer.aclose()
    arenas = len(counter.pinned)
    if not 1 <= arenas <= 2:  # max_pending=1: at most two arenas
        return f"FAILED: {arenas} arenas pinned over {saves} saves"
    if counter.unpinned != counter.pinned:
        return f"FAILED: {len(counter.pinned - counter.unpinned)} arena(s) still pinned after close"
    if torch.cuda.is_available() and counter.registered != counter.unregistered:
        return f"FAILED: {counter.registered} cudaHostRegister, {counter.unregistered} cudaHostUnregister"
    return f"passed ({arenas} arena(s) pinned once each over {saves} saves, all released)"


# -- stall and call->durable ------------------------------------------------------------------


def raw_write(nbytes: int, directory: Path) -> float:
    """O_DIRECT write + fsync of ``nbytes`` from a filled host buffer, after a write of
    the same bytes (as a writer's timed save follows its warm one)."""
    length = -(-nbytes // 4096) * 4096
    buffer = np.frombuffer(mmap.mmap(-1, length), np.uint8)
    buffer[:] = 1
    view = memoryview(buffer)  # type: ignore[arg-type]
    direct = os.O_DIRECT if o_direct_supported(directory) else 0
    took = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        fd = os.open(directory / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
        try:
            for start in range(0, length, 16 * MiB):
                os.write(fd, view[start : start + 16 * MiB])
            os.fsync(fd)
        finally:
            os.close(fd)
        took = time.perf_counter() - t0
    (directory / "raw.bin").unlink()
    return took


async def save_times(setup: Setup, directory: Path, reps: int) -> dict[str, list[tuple[float, float]]]:
    """(stall, call->durable) of eager and lazy saves and of DCP async_save, alternating."""
    import torch.distributed.checkpoint as dcp

    warnings.simplefilter("ignore")  # every DCP call without a process group warns
    times: dict[str, list[tuple[float, float]]] = {
        "aiosnap eager": [],
        "aiosnap lazy": [],
        "DCP async_save": [],
    }
    stager = dcp_stager(setup)
    flat = dcp_state(setup)

    def dcp_save(name: str) -> tuple[float, float]:
        checkpoint_id = str(directory / name)
        return timed_async_save(
            lambda: dcp.async_save(flat, checkpoint_id=checkpoint_id, async_stager=stager, no_dist=True)
        )

    try:
        async with setup.writer() as writer:
            await (await writer("warm", str(directory), setup.state)).wait()
            await asyncio.to_thread(dcp_save, "dcp-warm")
            for rep in range(reps):
                names = list(times)
                for name in names[rep % 3 :] + names[: rep % 3]:
                    setup.sync()
                    if name == "DCP async_save":
                        times[name].append(await asyncio.to_thread(dcp_save, f"dcp{rep}"))
                        continue
                    t0 = time.perf_counter()
                    handle = await writer("ckpt", str(directory), setup.state, capture=name.split()[1])
                    stall = time.perf_counter() - t0
                    await handle.wait()
                    times[name].append((stall, time.perf_counter() - t0))
    finally:
        stager.close()
    return times


# -- a training loop ----------------------------------------------------------------------------


async def loop_times(setup: Setup, directory: Path, steps: int, cycles: int) -> dict[str, list[float]]:
    """Per cycle: a checkpoint call and ``steps`` steps, timed to the device's end; then
    (untimed) the save made durable. Rotated over no checkpoint, eager, lazy and DCP."""
    import torch.distributed.checkpoint as dcp

    warnings.simplefilter("ignore")
    times: dict[str, list[float]] = {"no checkpoint": [], "aiosnap eager": [], "aiosnap lazy": [], "DCP": []}
    stager = dcp_stager(setup)
    flat = dcp_state(setup)
    try:
        async with setup.writer() as writer:
            await (await writer("warm", str(directory), setup.state)).wait()
            dcp.async_save(flat, checkpoint_id=str(directory / "dcp-warm"), async_stager=stager, no_dist=True)
            for cycle in range(cycles):
                names = list(times)
                for name in names[cycle % 4 :] + names[: cycle % 4]:
                    done: Callable[[], Awaitable[object]] | None = None
                    setup.sync()
                    t0 = time.perf_counter()
                    if name.startswith("aiosnap"):
                        handle = await writer("ckpt", str(directory), setup.state, capture=name.split()[1])
                        done = handle.wait
                    elif name == "DCP":
                        response = dcp.async_save(
                            flat,
                            checkpoint_id=str(directory / f"dcp{cycle}"),
                            async_stager=stager,
                            no_dist=True,
                        )
                        if hasattr(response, "staging_completion"):
                            response.staging_completion.result()  # the state may change after this
                        done = _future_waiter(response)
                    for _ in range(steps):
                        setup.step()
                        await asyncio.sleep(0)  # an async loop yields once a step
                    setup.sync()
                    times[name].append(time.perf_counter() - t0)
                    if done is not None:
                        await done()
    finally:
        stager.close()
    return times


def _future_waiter(response: Any) -> Callable[[], Awaitable[object]]:
    future = getattr(response, "upload_completion", response)
    return lambda: asyncio.to_thread(future.result)


# -- the report ----------------------------------------------------------------------------------


def run_tests(dry_run: bool) -> str:
    """The tests marked cuda, in a pytest of their own."""
    if dry_run:
        return "skipped (--dry-run)"
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider"]
    command += [
        str(p) for p in sorted((ROOT.parent / "tests").glob("test_*.py")) if "mark.cuda" in p.read_text()
    ]
    done = subprocess.run(command, cwd=ROOT.parent, capture_output=True, text=True)
    last = (done.stdout.strip().splitlines() or ["no output"])[-1]
    return ("passed: " if done.returncode == 0 else "FAILED: ") + last


def render(info: dict[str, Any]) -> str:
    saves, loop, raw = info["saves"], info["loop"], info["raw_write"]
    nbytes = info["bytes"]
    dcp_stall = statistics.median(s for s, _ in saves["DCP async_save"])
    lines = [
        f"### The CUDA path on {info['gpu']}",
        "",
        f"{nbytes / GiB:.2f} GiB of model + AdamW state on the device; torch {info['torch']}, "
        f"{info['date']}; medians of {info['reps']} rotated runs. CUDA tests: {info['tests']}. "
        f"No host sync in save calls and steps: {info['sync']}. Pinned memory: {info['pinning']}.",
        "",
        "| method | stall s (min-max) | call->durable s | x raw write | stall x DCP's |",
        "|---|---|---|---|---|",
        f"| limit: O_DIRECT write + fsync of the same bytes | | {raw:.3f} | 1.00 | |",
    ]
    for name, runs in saves.items():
        stalls, totals = [s for s, _ in runs], [t for _, t in runs]
        stall, total = statistics.median(stalls), statistics.median(totals)
        lines.append(
            f"| {name} | {stall:.4f} ({min(stalls):.4f}-{max(stalls):.4f}) | {total:.3f} | "
            f"{total / raw:.2f} | {stall / dcp_stall:.3f} |"
        )
    base = statistics.median(loop["no checkpoint"])
    lines += [
        "",
        f"Training loop: a checkpoint call and the {info['steps']} steps after it, to the device's end "
        f"(each save made durable after, untimed), {info['cycles']} rotated cycles.",
        "",
        "| checkpoint | call + steps s (min-max) | overhead per checkpoint s | x DCP async_save's stall |",
        "|---|---|---|---|",
    ]
    for name, seconds in loop.items():
        median = statistics.median(seconds)
        lines.append(
            f"| {name} | {median:.3f} ({min(seconds):.3f}-{max(seconds):.3f}) | {median - base:.4f} | "
            f"{(median - base) / dcp_stall:.3f} |"
        )
    return "\n".join(lines) + "\n"


async def run(args: argparse.Namespace, copier: DeviceCopier | None = None) -> dict[str, Any]:
    """Everything but the report; ``copier`` stands in for CUDA (a test's fake device)."""
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    size = int(args.size_gib * GiB) if cuda else int(args.dry_size_mib * MiB)
    directory = Path(args.dir or tempfile.mkdtemp(prefix="aiosnap-gpu-", dir=ROOT)).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device) if cuda else "the CPU (--dry-run)",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "reps": args.reps,
        "steps": args.steps,
        "cycles": args.cycles,
        "tests": run_tests(not cuda),
    }
    print(f"CUDA tests: {info['tests']}", flush=True)
    setup = make_setup(size, device, copier)
    info["bytes"] = setup.nbytes
    try:
        info["sync"] = await check_no_host_sync(setup, directory)
        info["pinning"] = await check_pinning(setup, directory)
        print(f"host sync: {info['sync']}; pinning: {info['pinning']}", flush=True)
        info["raw_write"] = await asyncio.to_thread(raw_write, setup.nbytes, directory)
        empty_dir(directory)
        info["saves"] = await save_times(setup, directory, args.reps)
        empty_dir(directory)
        info["loop"] = await loop_times(setup, directory, args.steps, args.cycles)
    finally:
        empty_dir(directory)
        if not args.dir:
            directory.rmdir()
    return info


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--size-gib", type=float, default=6.0, help="saved state on the GPU (4-8 GiB fits 8 minutes)"
    )
    p.add_argument("--reps", type=int, default=3, help="saves of each method")
    p.add_argument("--steps", type=int, default=10, help="training steps after each checkpoint call")
    p.add_argument("--cycles", type=int, default=3, help="checkpoints of each kind in the training loop")
    p.add_argument("--dir", help="scratch directory on the disk to write to (default: under benchmarks/)")
    p.add_argument("--out", default=str(ROOT / "results"), help="where gpu.md and gpu.json go")
    p.add_argument("--publish", action="store_true", help="put the table into docs/benchmarks.md")
    p.add_argument("--dry-run", action="store_true", help="on the CPU, small: a smoke run of every part")
    p.add_argument("--dry-size-mib", type=float, default=16.0, help="the state of a --dry-run")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available() and not args.dry_run:
        print("no CUDA device here: run on a machine with a GPU, or pass --dry-run", file=sys.stderr)
        return 2
    info = asyncio.run(run(args))
    table = render(info)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.md").write_text(table)
    (out / "gpu.json").write_text(json.dumps(info, indent=1))
    print(table)
    if args.publish and not args.dry_run:
        publish("gpu", table)
    failed = any(str(info[k]).startswith("FAILED") for k in ("tests", "sync", "pinning"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
