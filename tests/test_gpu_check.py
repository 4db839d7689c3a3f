"""benchmarks/gpu_check.py, the prepared run of the CUDA path, on the CPU: a dry run end to
end, and its checks with a fake device in place of CUDA (a real GPU runs it whole)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from .fake_device import FakeDevice

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def test_a_dry_run_measures_every_part_on_the_cpu(tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--dry-size-mib", "4"]
    command += [
        "--reps",
        "1",
        "--cycles",
        "1",
        "--steps",
        "2",
        "--dir",
        str(tmp_path / "s"),
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (tmp_path / "gpu.md").read_text()
    for row in ("aiosnap eager", "aiosnap lazy", "DCP async_save", "no checkpoint", "limit: O_DIRECT"):
        assert f"| {row}" in table
    assert "the CPU (--dry-run)" in table and list((tmp_path / "s").iterdir()) == []


def test_without_a_gpu_and_without_dry_run_it_says_so() -> None:
    if torch.cuda.is_available():
        pytest.skip("there is a GPU here")
    assert gpu_check.main(["--out", "/nonexistent"]) == 2


def _fake_setup() -> gpu_check.Setup:
    setup = gpu_check.make_setup(2 << 20, torch.device("cpu"))
    fake = FakeDevice([])
    fake.ptrs = {p.data_ptr() for p in setup.model.parameters()}  # the weights are on the "device"
    setup.copier = fake
    return setup


async def test_pinning_is_checked_through_a_device_copier(tmp_path: Path) -> None:
    setup = _fake_setup()
    assert (await gpu_check.check_pinning(setup, tmp_path)).startswith("passed (1 arena")
    peers = gpu_check.dcp_peers(setup, tmp_path)
    try:
        times = await gpu_check.save_times(setup, peers, tmp_path, reps=1)  # the device path, lazy too
    finally:
        for dcp in peers.values():
            dcp.close()
    assert not any(dcp.failed for dcp in peers.values())
    assert all(len(runs) == 1 for runs in times.values()) and len(times) == 5


async def test_the_pinning_check_catches_an_arena_left_pinned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiosnap._save.arena import ArenaPool

    monkeypatch.setattr(ArenaPool, "_free_arena", lambda self, arena: arena.close())  # no unpin
    assert "still pinned after close" in await gpu_check.check_pinning(_fake_setup(), tmp_path)


async def test_a_stager_that_fails_its_reuse_gets_a_fresh_one_per_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.11's DefaultStager empties itself after each stage and fails the next."""
    from torch.distributed.checkpoint.staging import DefaultStager

    stage, used = DefaultStager.stage, set()

    def once(self: Any, state: Any, **kwargs: Any) -> Any:
        if id(self) in used:
            raise KeyError(type)
        used.add(id(self))
        return stage(self, state, **kwargs)

    monkeypatch.setattr(DefaultStager, "stage", once)
    setup = gpu_check.make_setup(2 << 20, torch.device("cpu"))
    dcp = gpu_check.Dcp(setup, tmp_path, pinned=True)
    try:
        assert all(dcp.timed(f"s{i}") is not None for i in range(3))
    finally:
        dcp.close()
    assert dcp.failed is None and dcp.fresh and "failed its second save (KeyError" in str(dcp.note)
    assert len(used) == 3  # a new stager for each save after the failed reuse


@pytest.mark.slow  # CI's budget: the dry run above runs every part of the script
async def test_a_failing_dcp_leaves_aiosnaps_rows_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.checkpoint as dcp

    calls = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["checkpoint_id"])
        raise OSError("no space left")

    monkeypatch.setattr(dcp, "async_save", broken)
    setup = gpu_check.make_setup(2 << 20, torch.device("cpu"))
    peers = gpu_check.dcp_peers(setup, tmp_path)
    try:
        times = await gpu_check.save_times(setup, peers, tmp_path, reps=2)
        loop = await gpu_check.loop_times(setup, peers, tmp_path, steps=1, cycles=1)
    finally:
        for runner in peers.values():
            runner.close()
    assert len(calls) == 2  # each way tried once, then skipped
    assert all(runner.failed == "OSError: no space left" for runner in peers.values())
    assert all(times[name] == [] and name not in loop for name in peers)
    assert len(times["aiosnap lazy"]) == 2 and "aiosnap lazy" in loop
    info = {"saves": times, "loop": loop, "raw_write": 0.01, "bytes": setup.nbytes}
    info["dcp"] = {name: {"failed": r.failed, "note": r.note} for name, r in peers.items()}
    info |= {k: "x" for k in ("gpu", "torch", "date", "reps", "tests", "sync", "pinning", "steps", "cycles")}
    table = gpu_check.render(info)
    assert "DCP async_save, default: FAILED, OSError: no space left." in table and "| aiosnap lazy |" in table
