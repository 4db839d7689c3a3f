"""Power loss at every system call of each flow, on a simulated disk that keeps only what
was made durable (``tests/simfs.py``): every state the disk may then hold restores to a
whole checkpoint, the old one or the new; and once a flow has returned, to the new one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import aiosnap

from .simfs import SimFS, crash_states
from .test_faults import FLOWS, assert_state, state


async def _restore(root: str, directory: Path, crashed: object, *, committed: bool) -> None:
    fs = SimFS(root, crashed)  # type: ignore[arg-type]
    storage = aiosnap.storage.LocalStorage(posix=fs)
    async with aiosnap.CheckpointManager(str(directory), storage=storage) as mgr:
        names = [n for n, _ in fs.scandir(str(directory))]
        assert not [n for n in names if n.startswith(aiosnap.storage.TEMP_PREFIX)]
        for step in await mgr.steps():  # each whole: no reference to a blob the disk lost
            await aiosnap.verify(str(directory / mgr.filename(step)), storage=storage)
        restored = await mgr.restore()
        assert restored.step in ((2,) if committed else (1, 2)), restored.step
        assert_state(restored.state, restored.step)


@pytest.mark.parametrize("name", sorted(FLOWS))
async def test_power_loss_at_every_call_leaves_a_whole_checkpoint(tmp_path: Path, name: str) -> None:
    root = str(tmp_path / "disk")  # a path on the simulated disk only
    sim = SimFS(root)
    storage = aiosnap.storage.LocalStorage(posix=sim)
    directory = Path(root) / "run"
    async with aiosnap.CheckpointManager(str(directory), storage=storage) as mgr:
        await (await mgr.save(1, state(1))).wait()
    sim.recording = True
    await FLOWS[name](directory, storage)
    sim.recording = False
    points = [(op, path, snap, False) for op, path, snap in sim.snapshots]
    points.append(("returned", "", sim.state, True))  # a flow that returned is durable
    states = 0
    for op, path, snap, committed in points:
        for crashed in crash_states(snap):
            states += 1
            try:
                await _restore(root, directory, crashed, committed=committed)
            except AssertionError as exc:
                exc.add_note(f"{name}: power lost before {op} {path}")
                raise
    assert len(points) > 5 and states >= len(points)
