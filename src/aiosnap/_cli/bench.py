"""``aiosnap bench``: a quick measurement on the user's own disk.

The full suite (benchmarks/bench.py, with the peers and the physical limits) is not
installed with the package; this is its quick run cut down to what a user deciding
where to put checkpoints wants to know: how fast that disk writes and reads (a plain
write + fsync, a cold read), and how aiosnap saves and loads a state of that size there
next to torch.save and torch.load. Every figure is the median of ``reps`` runs, in an
order that rotates from one run to the next; reads are cold (the file is dropped from
the page cache first, where the OS allows), and each runs in a new Python process, as
a resume does: its imports are not timed, but what a fresh process pays for its first
load (fresh memory, the first worker thread) is.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import torch

from .._api import load_into_sync, load_sync, save_sync
from .._save.writers import QueueWriter

MiB = 1 << 20
_PIECE = 16 * MiB


@dataclass(frozen=True, slots=True)
class Measurement:
    """One method: the median seconds its caller waited, and until it was done (the
    bytes durable, for a save; loaded, for a load)."""

    name: str
    phase: Literal["save", "load"]
    stall: float
    total: float


def parse_size(text: str) -> int:
    """``256MiB``, ``1GiB``, ``64M``, ``4096`` (bytes)."""
    low = text.strip().lower().removesuffix("b").removesuffix("i")
    factor = {"k": 1 << 10, "m": MiB, "g": 1 << 30}.get(low[-1:], 1)
    try:
        value = float(low[:-1] if factor > 1 else low)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (say 256MiB, 1GiB or a number of bytes)") from None
    if value <= 0:
        raise ValueError(f"the size must be positive, not {text!r}")
    return int(value * factor)


def make_state(nbytes: int) -> dict[str, Any]:
    """fp32 tensors of up to 16 MiB filling ``nbytes``, and an optimizer-like part of
    small tensors."""
    state: dict[str, Any] = {}
    left, i = nbytes, 0
    while left >= 4:
        n = min(left, _PIECE) // 4
        state[f"layer{i}.weight"] = torch.randn(n)
        left, i = left - 4 * n, i + 1
    state["optimizer"] = {"step": 10, "state": {k: {"exp_avg": torch.randn(256)} for k in range(32)}}
    return state


class Bench:
    """Runs the methods in ``directory`` (a scratch directory is made inside it and removed)."""

    def __init__(self, directory: str, nbytes: int, reps: int) -> None:
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"{directory}: no such directory (bench measures a local disk)")
        self.directory, self.reps = directory, reps
        self.state = make_state(nbytes)
        self.raw = [t.reshape(-1).view(torch.uint8).numpy() for t in _tensors(self.state)]
        self.nbytes = sum(r.nbytes for r in self.raw)
        self.scratch = ""

    def methods(self) -> dict[str, tuple[Literal["save", "load"], Callable[[], tuple[float, float]]]]:
        return {
            "disk: write + fsync": ("save", self.write),
            "torch.save + fsync": ("save", self.torch_save),
            "aiosnap.save (one call)": ("save", self.aiosnap_save),
            "aiosnap QueueWriter (open)": ("save", self.queue_writer),
            "disk: read (cold)": ("load", self.read),
            "torch.load (cold)": ("load", self.torch_load),
            "aiosnap.load (cold)": ("load", self.aiosnap_load),
        }

    def run(self, tick: Callable[[str], None] = lambda name: None) -> list[Measurement]:
        methods = self.methods()
        names = list(methods)
        times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        self.scratch = tempfile.mkdtemp(prefix=".aiosnap-bench-", dir=self.directory)
        try:
            self._warm(methods)
            for rep in range(self.reps):
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    times[name].append(methods[name][1]())
                    tick(name)
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)
        return [
            Measurement(
                n,
                methods[n][0],
                statistics.median(s for s, _ in times[n]),
                statistics.median(t for _, t in times[n]),
            )
            for n in names
        ]

    def _warm(self, methods: Mapping[str, tuple[str, Callable[[], object]]]) -> None:
        """Run every save once on a small state, unmeasured: what this process pays once
        (imports, the first worker thread, the first event loop) is no method's cost. The
        loads run in new processes: a resume pays those costs, and they are timed."""
        state, raw = self.state, self.raw
        self.state = make_state(min(_PIECE, self.nbytes))
        self.raw = [t.reshape(-1).view(torch.uint8).numpy() for t in _tensors(self.state)]
        try:
            for phase, method in methods.values():
                if phase == "save":
                    method()
            for name in os.listdir(self.scratch):
                os.unlink(self._path(name))
        finally:
            self.state, self.raw = state, raw

    def _path(self, name: str) -> str:
        return os.path.join(self.scratch, name)

    # -- saves -----------------------------------------------------------------------------------
    def write(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        fd = os.open(self._path("raw.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for r in self.raw:
                view = memoryview(r)  # type: ignore[arg-type]
                for start in range(0, len(view), _PIECE):
                    os.write(fd, view[start : start + _PIECE])
            os.fsync(fd)
        finally:
            os.close(fd)
        return _both(time.perf_counter() - t0)

    def torch_save(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        with open(self._path("state.pt"), "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())
        return _both(time.perf_counter() - t0)

    def aiosnap_save(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        save_sync(self._path("state.snap"), self.state)
        return _both(time.perf_counter() - t0)

    def queue_writer(self) -> tuple[float, float]:
        """The stall a training loop sees: the call returns once the state is staged."""

        async def measure() -> tuple[float, float]:
            async with QueueWriter() as writer:
                await (await writer("warm.snap", self.scratch, self.state)).wait()
                t0 = time.perf_counter()
                handle = await writer("queued.snap", self.scratch, self.state)
                stall = time.perf_counter() - t0
                await handle.wait()
                return stall, time.perf_counter() - t0

        return anyio.run(measure)

    # -- loads, each in a new process ----------------------------------------------------------
    def read(self) -> tuple[float, float]:
        return _both(cold_load("read", self._ready("raw.bin", self.write)))

    def torch_load(self) -> tuple[float, float]:
        return _both(cold_load("torch.load", self._ready("state.pt", self.torch_save)))

    def aiosnap_load(self) -> tuple[float, float]:
        return _both(cold_load("aiosnap.load", self._ready("state.snap", self.aiosnap_save)))

    def _ready(self, name: str, write: Callable[[], object]) -> str:
        """The file ``write`` makes, out of the page cache."""
        path = self._path(name)
        if not os.path.exists(path):
            write()
        _drop_cache(path)
        return path


#: What a new process runs for ``cold_load``: ``python -c COLD_CHILD METHOD PATH``.
COLD_CHILD = "from aiosnap._cli.bench import cold_child; cold_child()"
#: The loads ``cold_load`` times (``read``: the disk's own speed, into one reused buffer;
#: ``read-fresh``: into fresh memory of the file's size, as a load must; ``read-fresh-huge``:
#: the same memory advised for transparent huge pages, whatever this kernel makes of it).
COLD_METHODS = ("read", "read-fresh", "read-fresh-huge", "torch.load", "aiosnap.load", "aiosnap.load_into")


def cold_load(method: str, path: str) -> float:
    """Seconds one load of ``path`` takes in a new Python process (which imports torch and
    aiosnap before it starts the clock): the first load of a resume. Drop ``path`` from the
    page cache first for a cold one."""
    if method not in COLD_METHODS:
        raise ValueError(f"not a load: {method!r} (one of {', '.join(COLD_METHODS)})")
    done = subprocess.run(
        [sys.executable, "-c", COLD_CHILD, method, path], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {method} of {path} failed in its process:\n{done.stderr[-2000:]}")
    return float(done.stdout.split()[-1])


def cold_child() -> None:
    """The new process of ``cold_load``: one load, timed; prints its seconds."""
    method, path = sys.argv[1], sys.argv[2]
    target = _target_for(path) if method == "aiosnap.load_into" else None
    t0 = time.perf_counter()
    if method == "torch.load":
        torch.load(path, weights_only=True)
    elif method == "aiosnap.load":
        load_sync(path)
    elif method == "aiosnap.load_into":
        load_into_sync(path, target)
    else:
        _read(path, fresh=method != "read", huge=method == "read-fresh-huge")
    print(repr(time.perf_counter() - t0))


def _read(path: str, *, fresh: bool, huge: bool = False) -> None:
    """Read a file in 16 MiB pieces: into one reused buffer, or into fresh memory of its
    size (allocated as torch allocates a tensor's: no huge-page advice, unless ``huge``)."""
    size = os.stat(path).st_size
    buffer = torch.empty(size if fresh else min(size, _PIECE), dtype=torch.uint8).numpy()
    if huge:
        from .._storage.posix import advise_huge

        advise_huge(buffer.ctypes.data, size)
    view = memoryview(buffer)  # type: ignore[arg-type]
    fd = os.open(path, os.O_RDONLY)
    try:
        for start in range(0, size, _PIECE):
            piece = view[start : start + _PIECE] if fresh else view[: min(_PIECE, size - start)]
            os.preadv(fd, [piece], start)
    finally:
        os.close(fd)


def _target_for(path: str) -> Any:
    """The state a resume loads into, made from the file's header and written to (zeros)
    before the load, as a model's parameters are initialised before they are restored."""
    from .._format.codec import read_header, tree_of
    from .._format.dtypes import TORCH_DTYPES
    from .._format.tree import rebuild
    from .._storage.local import LocalStorage

    f = LocalStorage().open_read(path)
    try:
        header = read_header(f)
    finally:
        f.close()
    _drop_cache(path)

    def zeros(kind: str, name: str, where: tuple[object, ...]) -> Any:
        info = header.tensors[name]
        if kind != "tensor":
            raise ValueError(f"{path}: {'.'.join(map(str, where))} is not a tensor")
        return torch.zeros(info.shape, dtype=TORCH_DTYPES[info.dtype])

    return rebuild(tree_of(header), zeros)


def _both(seconds: float) -> tuple[float, float]:
    return seconds, seconds


def _drop_cache(path: str) -> None:
    if not hasattr(os, "posix_fadvise"):
        return  # not on this OS: reads are warm
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    return []
