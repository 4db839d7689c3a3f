"""benchmarks/gpu_check.py, the prepared run of the CUDA path, on the CPU: a dry run end to
end, and its checks with a fake device in place of CUDA (a real GPU runs it whole)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    times = await gpu_check.save_times(setup, tmp_path, reps=1)  # the device path, lazy too
    assert all(len(runs) == 1 for runs in times.values())


async def test_the_pinning_check_catches_an_arena_left_pinned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiosnap._save.arena import ArenaPool

    monkeypatch.setattr(ArenaPool, "_free_arena", lambda self, arena: arena.close())  # no unpin
    assert "still pinned after close" in await gpu_check.check_pinning(_fake_setup(), tmp_path)
