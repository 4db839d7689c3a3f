"""A writer reuses the layout of its last save while the state keeps its structure.

The layout is the file's header with the checksums left out: whatever a writer kept from
an earlier save, each file must be what a fresh writer writes for the same state, byte
for byte, through every kind of change a state can go through between two saves.

White-box, in part: ``plan`` and ``PlanCache`` (``aiosnap._format.plans``) are internal
pure functions of a captured state, tested directly beside the writers that use them.
"""

from __future__ import annotations

import copy
import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aiosnap
from aiosnap._format.plans import PlanCache, plan
from aiosnap._format.tree import capture


def _state() -> dict[str, Any]:
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(4, 3),
        "b": torch.ones(3, dtype=torch.float16),
        "opt": {"lr": 0.1, "step": torch.tensor(1), "tag": {1, 2}},
        "arr": np.arange(5, dtype=np.int32),
    }


def _states() -> list[dict[str, Any]]:
    """A state, then each change a training run's state may go through between saves."""
    states = [_state()]

    def then(change: Any) -> None:
        state = copy.deepcopy(states[-1])
        change(state)
        states.append(state)

    then(lambda s: s["w"].add_(1))  # new values only
    then(lambda s: s["opt"].update(lr=0.05))  # a plain value of the skeleton
    then(lambda s: s["b"].mul_(2))  # new values of that skeleton
    then(lambda s: s.update(w=s["w"].reshape(3, 4).clone()))  # a shape, same bytes
    then(lambda s: s.update(b=s["b"].to(torch.bfloat16)))  # a dtype, same bytes
    then(lambda s: s.update(v=s.pop("w")))  # a name, same place in the file
    then(lambda s: s["opt"].update(tag={1, 2, 3, 4, 5}))  # a pickle's length
    then(lambda s: s.update(extra=torch.zeros(2)))  # one more tensor
    then(lambda s: s.update(arr=s["arr"].astype(np.float32)))  # an array's dtype
    states.append(_state())  # back to the first structure
    return states


async def test_each_save_is_what_a_fresh_writer_writes(tmp_path: Path) -> None:
    states = _states()
    async with aiosnap.QueueWriter(allow_pickle=True) as writer:
        for i, state in enumerate(states):
            await (await writer(f"kept{i}", str(tmp_path), state)).wait()
    for i, state in enumerate(states):
        await aiosnap.save(str(tmp_path / f"fresh{i}"), state, allow_pickle=True)
        kept, fresh = (tmp_path / f"kept{i}").read_bytes(), (tmp_path / f"fresh{i}").read_bytes()
        assert kept == fresh, f"save {i}"
        loaded = await aiosnap.load(str(tmp_path / f"kept{i}"), allow_pickle=True)
        assert loaded.keys() == state.keys()


async def test_a_save_that_fails_in_its_plan_leaves_the_next_ones_right(tmp_path: Path) -> None:
    state, unpicklable = _state(), _state()
    unpicklable["opt"]["tag"] = lambda: None  # pickling it fails while the save is planned
    async with aiosnap.QueueWriter(allow_pickle=True) as writer:
        await (await writer("a", str(tmp_path), state)).wait()
        with pytest.raises(AttributeError, match="pickle"):
            await (await writer("bad", str(tmp_path), unpicklable)).wait()
        state["w"].add_(1)
        await (await writer("b", str(tmp_path), state)).wait()
    await aiosnap.save(str(tmp_path / "fresh"), state, allow_pickle=True)
    assert (tmp_path / "b").read_bytes() == (tmp_path / "fresh").read_bytes()
    assert not (tmp_path / "bad").exists()


def test_an_unchanged_structure_gets_the_last_layout() -> None:
    cache, state = PlanCache(), _state()
    first = plan(capture(state, allow_pickle=True), cache)
    state["w"].add_(1)
    again = plan(capture(state, allow_pickle=True), cache)
    assert again.template is first.template
    assert all(a is b for a, b in zip(again.tensors, first.tensors, strict=True))
    assert again.tensors is not first.tensors  # each plan's own list: a stage empties it
    first.tensors.clear()
    state["opt"]["lr"] = 0.5  # the skeleton changes, the entries do not
    moved = plan(capture(state, allow_pickle=True), cache)
    assert moved.template is not first.template
    assert all(a is b for a, b in zip(moved.tensors, again.tensors, strict=True))
    assert moved.template.size == plan(capture(state, allow_pickle=True)).template.size
    cache.clear()
    assert plan(capture(state, allow_pickle=True), cache).template is not moved.template


async def test_a_kept_layout_is_not_left_to_the_young_collections(tmp_path: Path) -> None:
    """Left young, the entries a writer keeps are traversed by the next young collections
    (40-50 ms each for 100,000 tensors, in whichever thread sets them off: the event
    loop's too); they join the oldest generation instead."""
    assert gc.isenabled() and gc.get_freeze_count() == 0
    state = {f"t{i}": torch.zeros(2) for i in range(2000)}
    async with aiosnap.QueueWriter() as writer:
        await (await writer("warm", str(tmp_path), {"x": torch.zeros(1)})).wait()
        gc.collect()  # all that is young from here on, the save made
        await (await writer("a", str(tmp_path), state)).wait()
        young = sum(len(gc.get_objects(generation=generation)) for generation in (0, 1))
        # Kept young, the layout is ~3 objects a tensor (measured: 6,057 young objects, 2,000
        # of them entries); promoted, a few dozen objects of the save's own stay (25-29).
        assert young < len(state) // 4, young
