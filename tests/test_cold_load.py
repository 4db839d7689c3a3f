"""Loads into fresh memory: huge pages asked for only where the kernel gives them without
compacting memory inside the fault, and the cold load of a new process, measured as a
resume does it (``aiosnap bench``'s ``cold_load``)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aiosnap
from aiosnap._cli.bench import COLD_METHODS, cold_load
from aiosnap._load import readers
from aiosnap._storage import posix


@pytest.mark.parametrize(
    ("enabled", "defrag", "pays"),
    [
        ("madvise", "madvise", False),  # this project's machines: advised faults compact memory
        ("always", "always", False),
        ("madvise", "defer+madvise", False),
        ("always", "defer", True),  # huge pages where the kernel has them free, no stall
        ("madvise", "never", True),
        ("never", "never", False),
        (None, None, False),  # no transparent huge pages at all
    ],
)
def test_huge_pages_are_asked_for_only_where_no_fault_compacts_memory(
    enabled: str | None, defrag: str | None, pays: bool
) -> None:
    assert posix.advice_pays(enabled, defrag) is pays


_FLAGS = r"""
import json, sys
from pathlib import Path
import aiosnap


def vm_flags(address):
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise LookupError(hex(address))


loaded = aiosnap.load_sync(sys.argv[1])
assert bool((loaded["big"] == 1).all()) and bool((loaded["array"] == 1).all())
print(json.dumps({
    "tensor": vm_flags(loaded["big"].data_ptr() + (8 << 20)),
    "array": vm_flags(loaded["array"].ctypes.data + (8 << 20)),
}))
"""


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_large_entries_get_the_huge_page_advice_that_pays_here(tmp_path: Path) -> None:
    # In a new process, as a resume loads: in a long one, the allocator may hand out memory
    # that an earlier NumPy array of the process had advised already.
    path = str(tmp_path / "ckpt")
    aiosnap.save_sync(path, {"big": torch.ones(4 << 20), "array": np.ones(4 << 20, np.float32)})
    out = subprocess.run([sys.executable, "-c", _FLAGS, path], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    flags = json.loads(out.stdout)
    tensor, array = flags["tensor"], flags["array"]
    if posix.huge_pages_pay():
        assert "hg" in tensor and "hg" in array
    else:  # NumPy's own advice is taken back; torch's memory never had any
        assert "hg" not in tensor and "hg" not in array
        assert ("nh" in array) is readers._NUMPY_ADVISES


def test_a_cold_load_runs_in_a_new_process_and_reads_what_was_saved(tmp_path: Path) -> None:
    state = {"w": torch.randn(1 << 18), "opt": {"m": torch.zeros(300), "step": 3}}
    snap, pt = str(tmp_path / "s.snap"), str(tmp_path / "s.pt")
    aiosnap.save_sync(snap, state)
    torch.save(state, pt)
    for method in COLD_METHODS:
        assert cold_load(method, pt if method == "torch.load" else snap) > 0
    with pytest.raises(ValueError, match="not a load"):
        cold_load("mmap", snap)
    with pytest.raises(RuntimeError, match="failed in its process"):
        cold_load("aiosnap.load", pt)  # a torch.save file, without allow_pickle


def test_entries_read_in_pieces_are_whole_and_checked(tmp_path: Path) -> None:
    # Entries larger than a piece, and pieces that hold the end of one and the start of
    # the next: each is checked once its last byte is read.
    piece = readers.READ_PIECE
    state = {
        "a": torch.randn(piece // 4 + 999),
        "b": torch.randn(2 * piece // 4 + 5),
        "c": torch.ones(1 << 17),
    }
    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), state)
    loaded = aiosnap.load_sync(str(path))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    aiosnap.load_into_sync(str(path), target)
    assert all(torch.equal(target[k], v) for k, v in state.items())
    size = path.stat().st_size
    with open(path, "r+b") as f:  # one byte in the middle of "b", in a piece of its own
        f.seek(size - state["c"].nbytes - state["b"].nbytes // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="'b'"):
        aiosnap.load_sync(str(path))


def test_a_blocking_load_never_formats_what_it_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Python 3.11's asyncio.Runner formats the repr of its main task as it ends, and with
    # it the task's result: a load's state, every tensor of it scanned to be printed.
    path = str(tmp_path / "ckpt")
    aiosnap.save_sync(path, {"w": torch.ones(1 << 16), "m": {"x": torch.zeros(3)}})
    formatted: list[tuple[int, ...]] = []
    real = torch.Tensor.__repr__

    def recording(self: torch.Tensor, *args: Any, **kwargs: Any) -> str:
        formatted.append(tuple(self.shape))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "__repr__", recording)
    assert aiosnap.load_sync(path)["m"]["x"].shape == (3,)
    aiosnap.load_into_sync(path, {"w": torch.zeros(1 << 16), "m": {"x": torch.ones(3)}})
    assert formatted == []


def test_the_blocking_twins_read_in_the_callers_thread(tmp_path: Path) -> None:
    # No event loop to keep serving: a worker thread would only add two hops.
    path = str(tmp_path / "ckpt")
    aiosnap.save_sync(path, {"w": torch.ones(1 << 16)})
    threads: set[int] = set()

    def progress(done: int, total: int) -> None:
        threads.add(threading.get_ident())

    aiosnap.load_sync(path, progress=progress)
    aiosnap.load_into_sync(path, {"w": torch.zeros(1 << 16)}, progress=progress)
    aiosnap.verify_sync(path, progress=progress)
    assert threads == {threading.get_ident()}
