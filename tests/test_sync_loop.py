"""A training loop whose step is synchronous yields to the event loop only in its save
calls: what follows each commit (the index, retention, the sweep, blob collection) must
keep up all the same, so the directory never holds more than the policy keeps plus the
saves in flight -- for every writer, and with a remote tier (whose uploads hold local
retention back while they run)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap

KEEP = 3
NAME = re.compile(r"snapshot_iter_\d+")


def spy_on_commits(writer: Any) -> list[Any]:
    """The writer's own handles, as the manager hands it its saves: each one's end says
    its file is durable (the manager's handle ends later, once indexed and rotated)."""
    handles: list[Any] = []
    accept = writer.accept

    async def accepting(*args: Any, **kwargs: Any) -> Any:
        handle = await accept(*args, **kwargs)
        handles.append(handle)
        return handle

    writer.accept = accepting
    return handles


def train_step(state: dict[str, Any]) -> None:
    """Synchronous work, as a CPU training step is: nothing here yields to the loop."""
    w = state["w"]
    w.mul_(0.5).add_(torch.ones_like(w))
    state["step"] += 1


def files(directory: Path) -> int:
    return sum(1 for p in directory.iterdir() if NAME.fullmatch(p.name))


async def run(directory: Path, writer: Any, saves: int, **options: Any) -> list[tuple[int, int, int]]:
    """``saves`` saves of a loop that yields only in them; at each: (files on disk, saves
    still being written or uploaded when it was called, what retention keeps)."""
    commits = spy_on_commits(writer)
    uploads: list[Any] = []
    state = {"w": torch.zeros(16 << 10), "step": 0}
    seen = []
    keep = aiosnap.retention.KeepLast(KEEP)
    async with aiosnap.CheckpointManager(str(directory), writer=writer, keep=keep, **options) as manager:
        for _ in range(saves):
            train_step(state)
            in_flight = sum(not h.done() for h in commits) + sum(not u.done() for u in uploads)
            handle = await manager.save(state["step"], state)
            if handle.upload is not None:
                uploads.append(handle.upload)
            seen.append((files(directory), in_flight, KEEP))
    assert files(directory) == KEEP
    return seen


def check(seen: list[tuple[int, int, int]]) -> None:
    # The save just made may be durable already, its retention still to come (at the
    # next call): one more.
    over = [
        (i, on_disk, in_flight)
        for i, (on_disk, in_flight, keep) in enumerate(seen)
        if on_disk > keep + in_flight + 1
    ]
    assert not over, (
        f"retention fell behind at {len(over)} of {len(seen)} saves, e.g. (save, files, in flight) {over[:5]}"
    )


@pytest.mark.parametrize("saves", [120, pytest.param(400, marks=pytest.mark.slow)])
async def test_retention_keeps_up_with_a_loop_that_yields_only_in_save(
    tmp_path: Path, make_writer: Callable[[], Any], saves: int
) -> None:
    check(await run(tmp_path / "run", make_writer(), saves))


@pytest.mark.parametrize("saves", [120, pytest.param(400, marks=pytest.mark.slow)])
async def test_retention_keeps_up_with_a_remote_tier_too(tmp_path: Path, saves: int) -> None:
    remote = tmp_path / "remote"
    seen = await run(tmp_path / "run", aiosnap.QueueWriter(), saves, remote=str(remote))
    check(seen)
