"""aiosnap as DCP's storage backend in real gloo groups on 127.0.0.1: 2 ranks save
DTensor shards with dcp.save and dcp.async_save, and the checkpoint loads at another
world size (1 here; 4 in the slow run); a write that fails on one rank fails the save on
every rank, through DCP's own collectives, and leaves the previous checkpoint."""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import aiosnap
from aiosnap.integrations.dcp import AiosnapStorageReader, AiosnapStorageWriter

from .faults import HookedPosix
from .test_distributed import ok, run_ranks

#: name -> (global shape, dtype, placement when saved by 2 ranks, placement when loaded by 4).
LAYOUTS: dict[str, tuple[tuple[int, ...], torch.dtype, str, str]] = {
    "rows": ((11, 6), torch.float32, "S0", "S1"),  # uneven: 6 and 5 rows
    "cols": ((4, 9), torch.bfloat16, "S1", "S0"),
    "rep": ((5, 5), torch.float64, "R", "S0"),
    "ids": ((7,), torch.int64, "S0", "R"),
}


def whole(name: str, version: int = 1) -> torch.Tensor:
    shape, dtype, _, _ = LAYOUTS[name]
    values = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) + 100 * version
    return values.to(dtype)


def dtensors(world: int, which: int, version: int = 1) -> dict[str, Any]:
    """Every tensor of LAYOUTS as a DTensor on a 1-D mesh of the group, with its
    ``which``-th placement (2: saving, 3: loading), filled with ``version``'s values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, layout in LAYOUTS.items():
        spec = layout[which]
        placement = Replicate() if spec == "R" else Shard(int(spec[1]))
        out[name] = distribute_tensor(whole(name, version), mesh, [placement], src_data_rank=None)
    return out


def saved_state(world: int, version: int = 1) -> dict[str, Any]:
    return {"model": dtensors(world, 2, version), "step": 7 * version}


def _files(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


async def _save(rank: int, world: int, root: str) -> Any:
    dcp.save(saved_state(world), checkpoint_id=f"{root}/sync", storage_writer=AiosnapStorageWriter())
    future = dcp.async_save(
        saved_state(world), checkpoint_id=f"{root}/async", storage_writer=AiosnapStorageWriter()
    )
    future.result()
    dist.barrier()
    return {"sync": _files(f"{root}/sync"), "async": _files(f"{root}/async")}


def load_whole(directory: Path, reader: Any) -> dict[str, Any]:
    """The checkpoint loaded in this process, without a group, into whole tensors."""
    target = {"model": {n: torch.zeros_like(whole(n)) for n in LAYOUTS}, "step": 0}
    dcp.load(target, checkpoint_id=str(directory), storage_reader=reader)
    return target


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_two_ranks_save_and_one_process_loads_the_whole_tensors(tmp_path: Path) -> None:
    results = run_ranks(2, _save, str(tmp_path))
    ok(results, 2)
    for kind in ("sync", "async"):
        files = results[0][kind]
        # The metadata and one file per rank (the replicated tensor is written by one).
        assert files[0] == ".metadata" and [f[:4] for f in files[1:]] == ["__0_", "__1_"], files
        for reader in (AiosnapStorageReader(), None):  # aiosnap's, and DCP's own
            loaded = load_whole(tmp_path / kind, reader)
            assert loaded["step"] == 7
            for name in LAYOUTS:
                assert torch.equal(loaded["model"][name], whole(name)), (kind, name)


async def _load_at(rank: int, world: int, directory: str) -> Any:
    target = {"model": dtensors(world, 3, version=0), "step": 0}
    dcp.load(target, checkpoint_id=directory, storage_reader=AiosnapStorageReader())
    return {
        "step": target["step"],
        "equal": {n: bool(torch.equal(t.full_tensor(), whole(n))) for n, t in target["model"].items()},
    }


@pytest.mark.slow
def test_two_ranks_save_and_four_load_with_other_placements(tmp_path: Path) -> None:
    ok(run_ranks(2, _save, str(tmp_path)), 2)
    for kind in ("sync", "async"):
        loaded = run_ranks(4, _load_at, str(tmp_path / kind))
        ok(loaded, 4)
        assert all(r == {"step": 7, "equal": dict.fromkeys(LAYOUTS, True)} for r in loaded.values()), loaded


def _failing_on(victim: int, rank: int) -> AiosnapStorageWriter:
    """Rank ``victim``'s writer fails its data file's fsync, as a dying disk does."""
    if rank != victim:
        return AiosnapStorageWriter()

    def hook(op: str, path: str) -> None:
        if op == "fsync" and path.endswith(".distcp"):
            raise OSError(errno.EIO, "Input/output error (injected)", path)

    return AiosnapStorageWriter(storage=aiosnap.storage.LocalStorage(posix=HookedPosix(hook)))


async def _failing_save(rank: int, world: int, directory: str, victim: int) -> Any:
    dcp.save(saved_state(world, 1), checkpoint_id=directory, storage_writer=AiosnapStorageWriter())
    dist.barrier()
    before = _files(directory)
    try:
        dcp.save(saved_state(world, 2), checkpoint_id=directory, storage_writer=_failing_on(victim, rank))
        outcome: dict[str, Any] = {"saved": True}
    except CheckpointException as exc:
        error, _ = exc.failures[victim]
        outcome = {
            "failed": sorted(exc.failures),
            "type": type(error).__name__,
            "errno": getattr(error, "errno", None),
            "message": str(error),
        }
    dist.barrier()
    outcome["metadata_kept"] = ".metadata" in before and ".metadata" in _files(directory)
    # The previous checkpoint is what every rank loads, at once, in the same group.
    target = {"model": dtensors(world, 2, version=0), "step": 0}
    dcp.load(target, checkpoint_id=directory, storage_reader=AiosnapStorageReader())
    outcome["loaded"] = [
        target["step"],
        all(torch.equal(t.full_tensor(), whole(n, 1)) for n, t in target["model"].items()),
    ]
    return outcome


def test_a_write_failing_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(2, _failing_save, str(tmp_path), 1)
    ok(results, 2)
    for rank, r in results.items():
        assert r["failed"] == [1] and r["type"] == "OSError" and r["errno"] == errno.EIO, (rank, r)
        assert "__1_0." in r["message"] and ".distcp" in r["message"], r  # rank 1's file, by name
        assert r["metadata_kept"] and r["loaded"] == [7, True], (rank, r)
