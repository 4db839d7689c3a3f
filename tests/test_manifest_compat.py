"""Old group checkpoints still load: a step directory whose manifest is format
``aiosnap-manifest/2`` (every box listed), committed as files under
``tests/golden/step-manifest-v2``.

The golden was written by a real group of 2 gloo ranks running aiosnap at fbf3ac5 (the
last commit that wrote /2 manifests), through ``write_golden`` below; its values are
constructed (``expected``), so every machine reads the same."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap
from aiosnap._format.manifest import MANIFEST_NAME, read_manifest
from aiosnap.storage import LocalStorage

GOLDEN = Path(__file__).resolve().parent / "golden" / "step-manifest-v2"

#: name -> (global shape, dtype, placement on the 1-D mesh of 2 ranks).
LAYOUTS: dict[str, tuple[tuple[int, ...], torch.dtype, str]] = {
    "row": ((5, 3), torch.float32, "S0"),  # uneven: 3 and 2 rows
    "col": ((4, 3), torch.float32, "S1"),  # 2 and 1 columns
    "tiny": ((1,), torch.int64, "S0"),  # 1 and an empty shard
    "rep": ((2, 2), torch.float64, "R"),  # stored by rank 0 alone
}


def whole(name: str) -> torch.Tensor:
    shape, dtype, _ = LAYOUTS[name]
    return (torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) * 0.5 + len(name)).to(dtype)


def expected(rank: int) -> dict[str, Any]:
    """The state rank ``rank`` saved, as plain tensors."""
    return {"dt": {n: whole(n) for n in LAYOUTS}, "bias": torch.arange(4.0), "step": 7, "rank": rank}


async def write_golden(rank: int, world: int, directory: str) -> Any:
    """The scenario that wrote the golden (``run_ranks(2, write_golden, dir)`` at fbf3ac5)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = expected(rank)
    for name, (_, _, spec) in LAYOUTS.items():
        placement = Replicate() if spec == "R" else Shard(int(spec[1]))
        state["dt"][name] = distribute_tensor(state["dt"][name], mesh, [placement], src_data_rank=None)
    async with aiosnap.CheckpointManager(directory, ranks=aiosnap.Ranks(timeout=60)) as mgr:
        await (await mgr.save(7, state)).wait()
    return {}


def test_the_golden_is_a_format_2_manifest() -> None:
    outer = json.loads((GOLDEN / MANIFEST_NAME).read_bytes())
    assert outer["format"] == "aiosnap-manifest/2"
    assert all("grid" not in saved for saved in outer["body"]["shards"].values())


def test_a_step_with_a_format_2_manifest_loads_whole_per_rank_and_verifies(tmp_path: Path) -> None:
    step = tmp_path / "snapshot_iter_7"
    shutil.copytree(GOLDEN, step)

    async def main() -> dict[str, Any]:
        return {
            "whole": await aiosnap.load(str(step), keys=["dt", "bias", "step"]),
            "rank1": await aiosnap.load(str(step), rank=1),
            "report": await aiosnap.verify(str(step)),
        }

    got = asyncio.run(main())
    for name in LAYOUTS:
        assert torch.equal(got["whole"]["dt"][name], whole(name)), name
        assert torch.equal(got["rank1"]["dt"][name], whole(name)), name
    assert got["rank1"]["rank"] == 1 and got["whole"]["step"] == 7
    assert torch.equal(got["whole"]["bias"], torch.arange(4.0))
    assert got["report"].checksummed
    manifest = read_manifest(LocalStorage(), str(step))
    assert sorted(manifest.shards) == sorted(f"dt.{n}" for n in LAYOUTS)
    assert all(saved.grid is None for saved in manifest.shards.values())


@pytest.mark.parametrize("rank", [0, 1])
def test_a_format_2_step_restores_into_targets_of_another_layout(tmp_path: Path, rank: int) -> None:
    """Read as a rank of a group reads it: into targets (here whole tensors, so every box
    of every DTensor is planned from the /2 manifest's boxes)."""
    step = tmp_path / "snapshot_iter_7"
    shutil.copytree(GOLDEN, step)
    target = {"dt": {n: torch.zeros_like(whole(n)) for n in LAYOUTS}}
    aiosnap.load_into_sync(str(step), target, keys=["dt"], rank=rank)
    for name in LAYOUTS:
        assert torch.equal(target["dt"][name], whole(name)), name
