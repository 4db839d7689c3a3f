"""The helper threads beside worker threads: started once per process, never per call."""

from __future__ import annotations

import multiprocessing
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap
from aiosnap._base import offload as _offload

GUARD = 120.0  # seconds: a deadlock bound, never a point to synchronise on


def _state() -> dict[str, Any]:
    # A leaf large enough that its staging copy is split, and small ones read in groups.
    big = torch.arange(3 << 20, dtype=torch.float32)
    return {"big": big, "small": [torch.full((8,), i) for i in range(50)]}


def _digest(state: dict[str, Any]) -> int:
    """The state's bytes, through NumPy: a torch op with its intra-op threads hangs in a
    forked child (OpenMP), whatever aiosnap does."""
    return zlib.crc32(b"".join(t.numpy().tobytes() for t in [state["big"], *state["small"]]))


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return _digest(a) == _digest(b)


async def test_saves_and_loads_start_no_thread_once_the_helpers_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A thread started per call cost ~100 us, and under RLIMIT_AS one that failed to
    # allocate as it started left Thread.start() waiting forever (a load hung so).
    state, path = _state(), str(tmp_path / "ckpt")
    await aiosnap.save(path, state)
    await aiosnap.load(path)  # the helpers start here at the latest
    started: list[str] = []
    start = threading.Thread.start

    def counted(self: threading.Thread) -> None:
        started.append(self.name)
        start(self)

    warm = sum(t.name.startswith("aiosnap-side") for t in threading.enumerate())
    monkeypatch.setattr(threading.Thread, "start", counted)
    for _ in range(3):
        await aiosnap.save(path, state)
        assert _equal(await aiosnap.load(path), state)
    monkeypatch.undo()
    # The pool starts its threads as they are first needed, up to SIDE_THREADS: one the
    # warm-up did not need may start (a job that finds the other finishing), no more.
    side = [name for name in started if name.startswith("aiosnap-side")]
    assert warm >= 1 and len(side) <= _offload.SIDE_THREADS - warm, (warm, side)


def _load_in_child(path: str, digest: int, out: Any) -> None:
    out.put(_digest(aiosnap.load_sync(path)) == digest)


def test_a_forked_child_gets_helpers_of_its_own(tmp_path: Path) -> None:
    # The child has none of its parent's threads: a job handed to them would never run.
    path, state = str(tmp_path / "ckpt"), _state()
    aiosnap.save_sync(path, state)
    assert _equal(aiosnap.load_sync(path), state)  # the parent's helpers exist now
    fork = multiprocessing.get_context("fork")
    out = fork.SimpleQueue()
    child = fork.Process(target=_load_in_child, args=(path, _digest(state), out))
    child.start()
    child.join(GUARD)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0, child.exitcode
    assert out.get() is True


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 10_000])
def test_zip_dict_is_dict_of_zip(n: int) -> None:
    from aiosnap._base.heap import zip_dict

    keys, values = [f"k{i % (n - 7)}" if n > 7 else f"k{i}" for i in range(n)], list(range(n))
    assert list(zip_dict(keys, values).items()) == list(dict(zip(keys, values, strict=True)).items())
    with pytest.raises(ValueError):
        zip_dict(keys, [*values, 0])
