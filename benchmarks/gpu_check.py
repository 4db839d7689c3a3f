"""The CUDA path on a real GPU, in one prepared run of a few minutes (``nox -s gpu``).

    python benchmarks/gpu_check.py [--size-gib 6] [--reps 3] [--publish] [--dry-run]

1. The tests marked ``cuda`` (skipped where there is no GPU), through pytest.
2. Checks: no host synchronisation in the hot path (``torch.cuda.set_sync_debug_mode
   ("error")`` around save calls and training steps, lazy and eager), and pinned staging
   memory registered once per arena and released when the writer closes.
3. A model with AdamW of ``--size-gib`` GiB of saved state: the stall and call->durable of
   eager and lazy saves (lazy also with ``device_staging``), against DCP ``async_save``
   (default, and with a pinned, reused DefaultStager) and the raw O_DIRECT write of the
   same bytes.
4. A training loop: the time of a checkpoint call and the ``--steps`` steps after it,
   against the same steps without one, for each of those (each save is made durable
   before the next, untimed: the disk's speed is row 3's).

It prints a markdown table headed with the GPU's name (``--out`` keeps it, ``--publish``
puts it into docs/benchmarks.md). ``--dry-run`` runs all of it on the CPU with a small
model, in seconds (the CUDA-only checks are reported as skipped); tests/test_gpu_check.py
runs it so, and with a fake device in place of CUDA.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
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
from _peers import reused_stager  # noqa: E402

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

    def settle(self, steps: int = 5) -> None:
        """Between two timed parts: garbage collected, then a few untimed steps, to the
        device's end. Whatever the last part left behind (a peer's staging memory going
        back to the system, its threads winding down) lands here: on the H200, the part
        right after a DCP save ran 0.11-0.14 s slower without this."""
        gc.collect()
        for _ in range(steps):
            self.step()
        self.sync()

    def writer(self, *, device_staging: bool = False) -> Any:
        """A writer of one pending save; ``device_staging`` where CUDA's copier is used
        (a fake device stages nothing)."""
        if self.copier is not None:
            return aiosnap.QueueWriter(max_pending=1, device_copier=self.copier)
        return aiosnap.QueueWriter(max_pending=1, device_staging=device_staging)

    @property
    def nbytes(self) -> int:
        tensors = [*self.model.state_dict().values()]
        tensors += [t for s in self.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


METHODS = {
    "aiosnap eager": ("eager", False),
    "aiosnap lazy": ("lazy", False),
    "aiosnap lazy, device staging": ("lazy", True),
}
"""aiosnap's rows: (capture, device_staging)."""


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
    return reused_stager(pinned=setup.device.type == "cuda")  # a CPU-only torch cannot pin


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
    for name, (capture, device_staging) in METHODS.items():
        async with setup.writer(device_staging=device_staging) as writer:
            await (await writer("warm", str(directory), setup.state)).wait()  # pinned, warmed
            with sync_errors(setup):
                handle = await writer("ckpt", str(directory), setup.state, capture=capture)
                for _ in range(3):
                    setup.step()
            try:
                await handle.wait()
            except Exception as exc:
                return f"FAILED ({name}): {type(exc).__name__}: {exc}"
    return f"passed ({', '.join(METHODS)})"


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


class Dcp:
    """DCP ``async_save`` of the setup's state, as its users call it: ``pinned``, with a
    pinned DefaultStager reused across saves (its best stall); else with DCP's default
    staging. On the H200 machine's torch 2.11 a reused DefaultStager failed its second
    save (``KeyError: <class 'type'>``): a stager that fails its reuse is replaced by a new
    one for each later save, and ``note`` says so. Any other failure is kept (``failed``)
    and later calls are skipped, so that aiosnap's rows still come."""

    def __init__(self, setup: Setup, directory: Path, *, pinned: bool) -> None:
        import torch.distributed.checkpoint as dcp

        warnings.simplefilter("ignore")  # every DCP call without a process group warns
        self.dcp, self.directory, self.flat = dcp, directory, dcp_state(setup)
        self._make: Callable[[], Any] = (lambda: dcp_stager(setup)) if pinned else (lambda: None)
        self.stager = self._make()
        self.saved, self.fresh = 0, False
        self.note: str | None = None
        self.failed: str | None = None

    def stage(self, name: str) -> Any:
        """``async_save`` called and its staging waited for (the state may change only
        after it): its response, or None once DCP has failed."""
        while self.failed is None:
            if self.fresh:
                self.close()
                self.stager = self._make()
            try:
                response = self.dcp.async_save(
                    self.flat,
                    checkpoint_id=str(self.directory / name),
                    async_stager=self.stager,
                    no_dist=True,
                )
                staging = getattr(response, "staging_completion", None)
                if staging is not None:
                    staging.result()
                return response
            except Exception as exc:
                if self.stager is None or self.fresh or not self.saved:
                    self.failed = f"{type(exc).__name__}: {exc}"
                else:  # reuse failed: as torch 2.11's stager does
                    self.fresh = True
                    self.note = f"a reused stager failed its second save ({type(exc).__name__}: {exc})"
        return None

    def finish(self, response: Any) -> None:
        """Wait (blocking) for a started save to be durable; a failure is kept."""
        try:
            getattr(response, "upload_completion", response).result()
            self.saved += 1
        except Exception as exc:
            self.failed = self.failed or f"{type(exc).__name__}: {exc}"

    def timed(self, name: str) -> tuple[float, float] | None:
        """(stall, call->durable) of one save, in the calling thread (DCP's calls block)."""
        t0 = time.perf_counter()
        response = self.stage(name)
        stall = time.perf_counter() - t0
        if response is not None:
            self.finish(response)
        return None if self.failed else (stall, time.perf_counter() - t0)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


Peers = dict[str, Dcp]
"""DCP's ways of saving, by row name."""


def dcp_peers(setup: Setup, directory: Path) -> Peers:
    """DCP ``async_save`` with its default staging and with a reused pinned stager (on the
    CPU, a reused stager without pinning)."""
    return {  # pinned first: on torch 2.11 its first staging in a process is the one that works
        "DCP async_save, pinned stager": Dcp(setup, directory, pinned=True),
        "DCP async_save, default": Dcp(setup, directory, pinned=False),
    }


async def save_times(
    setup: Setup, peers: Peers, directory: Path, reps: int
) -> dict[str, list[tuple[float, float]]]:
    """(stall, call->durable) of aiosnap's ways and DCP's, rotated (a DCP way's list stays
    empty once it has failed: its ``failed`` says why)."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in [*METHODS, *peers]}
    async with contextlib.AsyncExitStack() as stack:
        writers = {
            name: await stack.enter_async_context(setup.writer(device_staging=staging))
            for name, (_, staging) in METHODS.items()
        }
        for writer in writers.values():
            await (await writer("warm", str(directory), setup.state)).wait()
        for name, dcp in peers.items():
            await asyncio.to_thread(dcp.timed, f"warm-{name[-7:]}")
        for rep in range(reps):
            names = list(times)
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                setup.sync()
                if name in peers:
                    timed = await asyncio.to_thread(peers[name].timed, f"dcp{rep}-{name[-7:]}")
                    times[name] += [timed] if timed is not None else []
                else:
                    t0 = time.perf_counter()
                    handle = await writers[name](
                        "ckpt", str(directory), setup.state, capture=METHODS[name][0]
                    )
                    stall = time.perf_counter() - t0
                    await handle.wait()
                    times[name].append((stall, time.perf_counter() - t0))
                setup.settle()
    return times


# -- a training loop ----------------------------------------------------------------------------


async def loop_times(
    setup: Setup, peers: Peers, directory: Path, steps: int, cycles: int
) -> dict[str, list[float]]:
    """Per cycle: a checkpoint call and ``steps`` steps, timed to the device's end; then
    (untimed) the save made durable. Rotated over no checkpoint, aiosnap's ways and DCP's."""
    times: dict[str, list[float]] = {name: [] for name in ["no checkpoint", *METHODS, *peers]}
    async with contextlib.AsyncExitStack() as stack:
        writers = {
            name: await stack.enter_async_context(setup.writer(device_staging=staging))
            for name, (_, staging) in METHODS.items()
        }
        for writer in writers.values():
            await (await writer("warm", str(directory), setup.state)).wait()
        for cycle in range(cycles):
            names = list(times)
            for name in names[cycle % len(names) :] + names[: cycle % len(names)]:
                done: Callable[[], Awaitable[object]] | None = None
                setup.sync()
                t0 = time.perf_counter()
                if name in writers:
                    handle = await writers[name](
                        "ckpt", str(directory), setup.state, capture=METHODS[name][0]
                    )
                    done = handle.wait
                elif name in peers:
                    response = peers[name].stage(f"loop{cycle}-{name[-7:]}")  # blocks, as in a DCP loop
                    if response is None:
                        continue
                    done = functools.partial(asyncio.to_thread, peers[name].finish, response)
                for _ in range(steps):
                    setup.step()
                    await asyncio.sleep(0)  # an async loop yields once a step
                setup.sync()
                times[name].append(time.perf_counter() - t0)
                if done is not None:
                    await done()
                setup.settle()
    return {name: seconds for name, seconds in times.items() if seconds}


# -- the report ----------------------------------------------------------------------------------


def run_tests(dry_run: bool, out: Path) -> str:
    """The tests marked cuda, in a pytest of their own; its whole output is kept in
    ``out/gpu-tests.log`` (a device's time is too scarce to run a failing test twice)."""
    if dry_run:
        return "skipped (--dry-run)"
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-v", "-rfE", "-p", "no:cacheprovider"]
    command += [
        str(p) for p in sorted((ROOT.parent / "tests").glob("test_*.py")) if "mark.cuda" in p.read_text()
    ]
    command += ["-o", "faulthandler_timeout=100"]  # a hung test shows where it waits
    out.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(command, cwd=ROOT.parent, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as hung:
        (out / "gpu-tests.log").write_text(_text(hung.stdout) + _text(hung.stderr))
        return "FAILED: the CUDA tests did not end within 240 s"
    (out / "gpu-tests.log").write_text(done.stdout + done.stderr)
    last = (done.stdout.strip().splitlines() or ["no output"])[-1]
    return ("passed: " if done.returncode == 0 else "FAILED: ") + last.strip("= ")


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _best_dcp_stall(saves: dict[str, list[tuple[float, float]]]) -> float | None:
    """The lowest median stall of DCP's ways (the best peer), or None if none ran."""
    stalls = [
        statistics.median(s for s, _ in runs)
        for name, runs in saves.items()
        if name.startswith("DCP") and runs
    ]
    return min(stalls) if stalls else None


def render(info: dict[str, Any]) -> str:
    saves, loop, raw = info["saves"], info["loop"], info["raw_write"]
    dcp_stall = _best_dcp_stall(saves)

    def per_dcp(seconds: float) -> str:
        return f"{seconds / dcp_stall:.3f}" if dcp_stall else "-"

    notes = [
        f"{name}: {'FAILED, ' + d['failed'] if d['failed'] else d['note']}."
        for name, d in info.get("dcp", {}).items()
        if d["failed"] or d["note"]
    ]
    lines = [
        f"### The CUDA path on {info['gpu']}",
        "",
        f"{info['bytes'] / GiB:.2f} GiB of model + AdamW state on the device; torch {info['torch']}, "
        f"{info['date']}; medians of {info['reps']} rotated runs. CUDA tests: {info['tests']}. "
        f"No host sync in save calls and steps: {info['sync']}. Pinned memory: {info['pinning']}.",
        *(["", *notes] if notes else []),
        "",
        "| method | stall s (min-max) | call->durable s | x raw write | stall x best DCP's |",
        "|---|---|---|---|---|",
        f"| limit: O_DIRECT write + fsync of the same bytes | | {raw:.3f} | 1.00 | |",
    ]
    for name, runs in saves.items():
        if not runs:
            continue
        stalls, totals = [s for s, _ in runs], [t for _, t in runs]
        stall, total = statistics.median(stalls), statistics.median(totals)
        lines.append(
            f"| {name} | {stall:.4f} ({min(stalls):.4f}-{max(stalls):.4f}) | {total:.3f} | "
            f"{total / raw:.2f} | {per_dcp(stall)} |"
        )
    base = statistics.median(loop["no checkpoint"])
    lines += [
        "",
        f"Training loop: a checkpoint call and the {info['steps']} steps after it, to the device's end "
        f"(each save made durable after, untimed), {info['cycles']} rotated cycles.",
        "",
        "| checkpoint | call + steps s (min-max) | overhead per checkpoint s | x best DCP stall |",
        "|---|---|---|---|",
    ]
    for name, seconds in loop.items():
        median = statistics.median(seconds)
        lines.append(
            f"| {name} | {median:.3f} ({min(seconds):.3f}-{max(seconds):.3f}) | {median - base:.4f} | "
            f"{per_dcp(median - base)} |"
        )
    return "\n".join([*lines, "", *targets(info)]) + "\n"


def targets(info: dict[str, Any]) -> list[str]:
    """The issue's targets, each with the figure it was judged on."""
    saves, loop, raw = info["saves"], info["loop"], info["raw_write"]
    stall = {name: statistics.median(s for s, _ in runs) for name, runs in saves.items() if runs}
    durable = {name: statistics.median(t for _, t in runs) for name, runs in saves.items() if runs}
    base = statistics.median(loop["no checkpoint"])
    dcp = _best_dcp_stall(saves)
    lines = ["Targets (against the best DCP stall):", ""]
    for name in METHODS:
        if dcp and name.startswith("aiosnap lazy") and name in loop:
            overhead = statistics.median(loop[name]) - base
            lines.append(_judged(f"{name}: overhead per checkpoint <= 0.1x DCP's stall", overhead / dcp, 0.1))
        if dcp and name == "aiosnap eager":
            lines.append(_judged("aiosnap eager: stall <= DCP's stall", stall[name] / dcp, 1.0))
        lines.append(_judged(f"{name}: call->durable <= 1.2x the raw write", durable[name] / raw, 1.2))
    return lines


def _judged(what: str, ratio: float, bound: float) -> str:
    return f"- {what}: {ratio:.3f}, {'met' if ratio <= bound else 'NOT met'}"


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
        "tests": run_tests(not cuda, Path(args.out)),
    }
    progress = Progress(info, Path(args.out))
    progress.note("tests", info["tests"])
    setup = make_setup(size, device, copier)
    info["bytes"] = setup.nbytes
    try:
        progress.note("sync", await check_no_host_sync(setup, directory))
        progress.note("pinning", await check_pinning(setup, directory))
        progress.note("raw_write", await asyncio.to_thread(raw_write, setup.nbytes, directory))
        empty_dir(directory)
        peers = dcp_peers(setup, directory)  # one pinned stager for both parts
        try:
            progress.note("saves", await save_times(setup, peers, directory, args.reps))
            empty_dir(directory)
            progress.note("loop", await loop_times(setup, peers, directory, args.steps, args.cycles))
        finally:
            for dcp in peers.values():
                dcp.close()
            info["dcp"] = {name: {"failed": dcp.failed, "note": dcp.note} for name, dcp in peers.items()}
    finally:
        empty_dir(directory)
        if not args.dir:
            directory.rmdir()
    return info


class Progress:
    """Each part's result as it comes: printed, and all so far kept in ``gpu-partial.json``,
    so a run stopped at its time limit still brings back what it measured."""

    def __init__(self, info: dict[str, Any], out: Path) -> None:
        self.info, self.out, self.t0 = info, out, time.perf_counter()

    def note(self, key: str, value: Any) -> None:
        self.info[key] = value
        print(f"[{time.perf_counter() - self.t0:6.1f} s] {key}: {value}", flush=True)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu-partial.json").write_text(json.dumps(self.info, indent=1))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--size-gib", type=float, default=4.0, help="saved state on the GPU (3 GiB took 200 s on an H200)"
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
