"""DTensor checkpoints: saved by 4 ranks as their shards, restored at any world size and
placement; read from one process, read-only, and counted byte by byte. Real gloo groups
on 127.0.0.1 and CPU device meshes."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import aiosnap
from aiosnap.storage import INDEX_NAME, Posix

from .hostile import headers_both_ways
from .test_distributed import ok, run_ranks

ROOT = Path(__file__).resolve().parent.parent
#: The bytes each block checksum covers (docs/format.md: "each 1 MiB block").
BLOCK = 1 << 20

#: name -> (global shape, dtype, placements at 4 ranks on a 1-D mesh, or on the 2x2 mesh).
LAYOUTS: dict[str, tuple[tuple[int, ...], torch.dtype, str]] = {
    "row": ((10, 6), torch.float32, "S0"),  # uneven: 3, 3, 3, 1 rows
    "col": ((8, 6), torch.float32, "S1"),  # 2, 2, 2, 0 columns: an empty shard
    "tiny": ((3,), torch.int64, "S0"),  # 1, 1, 1, 0
    "rep": ((5, 5), torch.float64, "R"),
    "bf16": ((64, 8), torch.bfloat16, "S0"),
    "big": ((4096, 512), torch.float32, "S0"),  # 8 MiB: shards of 2 MiB carry block checksums
    "wide": ((512, 4096), torch.float32, "S1"),  # 8 MiB of columns, restored as rows
    "grid": ((8, 6), torch.float32, "S0,S1"),  # the 2x2 mesh
    "hsdp": ((8, 6), torch.float32, "R,S0"),
    "half": ((8, 6), torch.float32, "S0,R"),
}
#: At restore: other placements, on a mesh of the restoring group's size.
TARGET = {"S0": "S1", "S1": "S0", "R": "S0", "S0,S1": "S1,S0", "R,S0": "S0,R", "S0,R": "R,S1"}


def whole(name: str) -> torch.Tensor:
    shape, dtype, _ = LAYOUTS[name]
    values = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) * 0.5 + len(name)
    return values.to(dtype)


def _placements(spec: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1])) for p in spec.split(",")]


def dtensors(specs: dict[str, str], world: int, fill: bool) -> dict[str, Any]:
    """Each name's tensor (or zeros) as a DTensor on a mesh of this group: 2-D specs on
    a 2x2 mesh when there are 4 ranks, else on the 1-D mesh with their first placement."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    flat = init_device_mesh("cpu", (world,))
    grid = init_device_mesh("cpu", (2, 2)) if world == 4 else None
    out = {}
    for name, spec in specs.items():
        mesh = grid if "," in spec and grid is not None else flat
        placements = _placements(spec if mesh is grid else spec.split(",")[0])
        value = whole(name) if fill else torch.zeros_like(whole(name))
        out[name] = distribute_tensor(value, mesh, placements, src_data_rank=None)
    return out


class CountingPosix(Posix):
    """The real calls, counting the bytes read."""

    def __init__(self) -> None:
        self.read = 0
        self._lock = threading.Lock()

    def preadv(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        n = super().preadv(fd, bufs, offset)
        with self._lock:
            self.read += n
        return n


async def _save(rank: int, world: int, directory: str) -> Any:
    state = {
        "dt": dtensors({n: spec for n, (_, _, spec) in LAYOUTS.items()}, world, fill=True),
        "step": 7,
        "rank": rank,  # differs between ranks: per-rank state
    }
    async with aiosnap.CheckpointManager(directory, ranks=aiosnap.Ranks(timeout=60)) as mgr:
        await (await mgr.save(7, state)).wait()
    return {}


def target_spec(name: str) -> str:
    shape, _, spec = LAYOUTS[name]
    if name == "big":
        return "S0"  # rows to rows, as FSDP reshards: the bytes each rank reads are counted
    return TARGET[spec] if len(shape) > 1 else "R"


async def _restore(rank: int, world: int, directory: str) -> Any:
    specs = {n: target_spec(n) for n in LAYOUTS}
    target = {"dt": dtensors(specs, world, fill=False), "step": 0}
    posix = CountingPosix()
    storage = aiosnap.storage.LocalStorage(posix=posix)
    async with aiosnap.CheckpointManager(directory, storage=storage, ranks=aiosnap.Ranks(timeout=60)) as mgr:
        before = posix.read
        await mgr.restore(target={"dt": {"big": target["dt"]["big"]}}, keys=["dt.big"])
        big_read = posix.read - before
        try:  # a target of another shape: every rank raises StateMismatchError (none RankFailedError)
            wrong_shape = {"dt": {"grid": dtensors({"row": "S0"}, world, fill=False)["row"]}}
            await mgr.restore(target=wrong_shape, keys=["dt.grid"])
            mismatch = "restored"
        except aiosnap.errors.StateMismatchError as exc:
            mismatch = str(exc)
        restored = await mgr.restore(target=target, strict=False)  # "rank" stays out: per-rank
        try:
            await mgr.restore(target={"rank": 0}, strict=False)
            per_rank = "restored"
        except aiosnap.errors.StateMismatchError as exc:
            per_rank = str(exc)
    wrong = []
    mine = 0
    for name, t in target["dt"].items():  # the same order on every rank: full_tensor gathers
        if not torch.equal(t.full_tensor(), whole(name)):
            wrong.append(name)
        if name == "big":
            mine += t.to_local().numel() * t.to_local().element_size()
    return {
        "step": restored.step,
        "wrong": wrong,
        "per_rank": per_rank,
        "mismatch": mismatch,
        "big_read": big_read,
        "big": mine,
    }


@pytest.fixture(scope="module")
def saved_by_four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("four")
    ok(run_ranks(4, _save, str(directory)), 4)
    return directory


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_dtensors_saved_by_4_ranks_restore_at_any_world_size_and_placement(
    saved_by_four: Path, world: int
) -> None:
    results = run_ranks(world, _restore, str(saved_by_four), limit=300)
    ok(results, world)
    for rank, r in results.items():
        assert r["step"] == 7 and r["wrong"] == [], (rank, r)
        assert (
            "dt.grid: checkpoint has torch.float32 (8, 6), target torch.float32 (10, 6)" in r["mismatch"]
        ), r
        if world != 4:
            assert "rank held state of each rank" in r["per_rank"], r
        else:
            assert r["per_rank"] == "restored"
        # A rank reads its part of "big" and little more: at most a block at each end of
        # each saved shard it overlaps (2 at most, here), and the headers. ("wide",
        # restored as rows, needs every saved box whole: they are verified by blocks.)
        # Twice: a load into a target checks every block before it writes any (the
        # second read comes from the page cache).
        assert r["big_read"] <= 2 * (r["big"] + 2 * 2 * BLOCK) + (256 << 10), (rank, r)


def test_one_process_reads_a_group_checkpoint_whole_and_leaves_the_index_alone(saved_by_four: Path) -> None:
    index = (saved_by_four / INDEX_NAME).read_bytes()
    step = saved_by_four / "snapshot_iter_7"

    async def main() -> dict[str, Any]:
        with pytest.raises(aiosnap.errors.StateMismatchError, match="rank held state of each rank.*rank=N"):
            await aiosnap.load(str(step))
        loaded = await aiosnap.load(str(step), keys=["dt", "step"])
        as_rank_2 = await aiosnap.load(str(step), rank=2)
        report = await aiosnap.verify(str(step))
        async with aiosnap.CheckpointManager(str(saved_by_four)) as mgr:
            assert await mgr.steps() == [7]
            with pytest.raises(aiosnap.errors.StateMismatchError):
                await mgr.restore()  # not corrupt: no mark, and no fall back
            restored = await mgr.restore(keys=["dt"])
            target = {"dt": {n: torch.zeros_like(whole(n)) for n in LAYOUTS}}
            await mgr.restore(target=target, keys=["dt"])
        return {
            "loaded": loaded,
            "rank2": as_rank_2,
            "report": report,
            "restored": restored,
            "target": target,
        }

    got = asyncio.run(main())
    for name in LAYOUTS:
        for tree in (got["loaded"], got["rank2"], got["restored"].state, got["target"]):
            assert torch.equal(tree["dt"][name], whole(name)), name
    assert got["rank2"]["rank"] == 2 and got["loaded"]["step"] == 7
    assert got["report"].checksummed and got["report"].tensors > len(LAYOUTS)
    assert (saved_by_four / INDEX_NAME).read_bytes() == index  # byte for byte: no corrupt marks


@pytest.mark.parametrize("name", ["big", "row"])  # a box with block checksums; one without
def test_a_damaged_box_leaves_the_whole_target_as_it_was(
    saved_by_four: Path, tmp_path: Path, name: str
) -> None:
    """load_into is all or nothing for DTensors too: every block a box is read from is
    checked before the first box is written into the target."""
    import shutil

    from .hostile import parse

    step = tmp_path / "snapshot_iter_7"
    shutil.copytree(saved_by_four / "snapshot_iter_7", step)
    rank_file = step / "rank_00003"
    raw = bytearray(rank_file.read_bytes())
    parts = parse(bytes(raw))
    entry = next(e for e in parts.header if e.startswith(f"dt.{name}") and parts.header[e]["data_offsets"][1])
    raw[len(raw) - len(parts.data) + parts.header[entry]["data_offsets"][1] - 1] ^= 0x01
    rank_file.write_bytes(bytes(raw))
    target = {"dt": {n: torch.full(whole(n).shape, 7, dtype=whole(n).dtype) for n in LAYOUTS}}
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="checksum mismatch"):
        aiosnap.load_into_sync(str(step), target, keys=["dt"])
    assert all(bool((t == 7).all()) for t in target["dt"].values())


def test_rank_files_are_read_without_parsing_their_entries(saved_by_four: Path) -> None:
    """Shards with block checksums and replicated (external) entries take the reader's
    shortcut for files as aiosnap writes them, to the same header as the general parse."""
    files = sorted((saved_by_four / "snapshot_iter_7").glob("rank_*"))
    assert len(files) == 4
    for path in files:
        fast, general, took = headers_both_ways(path)
        assert took and fast == general, path
    assert any(h.external for h in (headers_both_ways(p)[0] for p in files))
    assert any(i.blocks for p in files for i in headers_both_ways(p)[0].tensors.values())


async def test_a_read_only_manager_works_while_a_writer_holds_the_directory(tmp_path: Path) -> None:
    async with aiosnap.CheckpointManager(str(tmp_path), keep=aiosnap.retention.KeepLast(5)) as writer:
        for step in (1, 2):
            await (await writer.save(step, {"w": torch.full((4,), float(step))})).wait()
        before = sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.iterdir())
        async with aiosnap.CheckpointManager(str(tmp_path), read_only=True) as reader:
            assert await reader.steps() == [1, 2]
            assert [h.step for h in await reader.history()] == [1, 2]
            assert float((await reader.restore()).state["w"][0]) == 2.0
            with pytest.raises(aiosnap.errors.CheckpointError, match="read-only"):
                await reader.save(3, {"w": torch.ones(4)})
        (tmp_path / "snapshot_iter_2").write_bytes(b"damaged")  # the reader falls back, marks nothing
        async with aiosnap.CheckpointManager(str(tmp_path), read_only=True) as reader:
            assert (await reader.restore()).step == 1
        await (await writer.save(3, {"w": torch.full((4,), 3.0)})).wait()  # the writer never noticed
    after = sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.iterdir())
    assert [n for n, _ in after] == [n for n, _ in before] + ["snapshot_iter_3"]


# -- FSDP2 ----------------------------------------------------------------------------------
def _model(seed: int, world: int) -> torch.nn.Module:
    """A small MLP under FSDP2: uneven dims, so some shards are short and one is empty."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 10),
        torch.nn.ReLU(),
        torch.nn.Linear(10, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 3),
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(
    model: torch.nn.Module, opt: torch.optim.Optimizer, start: int, rank: int, world: int
) -> list[float]:
    """Every rank trains on its slice of the same global batch: the loss does not depend
    on the world size, up to the order of float sums."""
    losses = []
    for step in range(start, start + 3):
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(48, 8, generator=g), torch.randn(48, 3, generator=g)
        per = 48 // world
        loss = ((model(x[rank * per : (rank + 1) * per]) - y[rank * per : (rank + 1) * per]) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


async def _fsdp_save(rank: int, world: int, directory: str, dcp_dir: str) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model(0, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = _train(model, opt, 0, rank, world)
    async with aiosnap.CheckpointManager(directory, ranks=aiosnap.Ranks(timeout=60)) as mgr:
        await (await mgr.save(3, {"model": model, "optim": opt})).wait()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
    return {"losses": losses}


async def _fsdp_restore(rank: int, world: int, directory: str, dcp_dir: str) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    # Other seeds and hyper-parameters: everything must come from the checkpoints.
    ours = _model(123, world)
    ours_opt = torch.optim.AdamW(ours.parameters(), lr=999.0, weight_decay=0.0)
    async with aiosnap.CheckpointManager(directory, ranks=aiosnap.Ranks(timeout=60)) as mgr:
        restored = await mgr.restore(target={"model": ours, "optim": ours_opt})
    theirs = _model(456, world)
    theirs_opt = torch.optim.AdamW(theirs.parameters(), lr=999.0, weight_decay=0.0)
    msd, osd = get_state_dict(theirs, theirs_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
    set_state_dict(theirs, theirs_opt, model_state_dict=msd, optim_state_dict=osd)
    return {
        "step": restored.step,
        "lr": ours_opt.param_groups[0]["lr"],
        "ours": _train(ours, ours_opt, 3, rank, world),
        "dcp": _train(theirs, theirs_opt, 3, rank, world),
    }


def test_an_fsdp2_model_and_its_adamw_state_saved_at_4_ranks_train_on_at_2_as_with_dcp(
    tmp_path: Path,
) -> None:
    directory, dcp_dir = str(tmp_path / "ckpt"), str(tmp_path / "dcp")
    saved = run_ranks(4, _fsdp_save, directory, dcp_dir, limit=300)
    ok(saved, 4)
    resumed = run_ranks(2, _fsdp_restore, directory, dcp_dir, limit=300)
    ok(resumed, 2)
    for r in resumed.values():
        assert r["step"] == 3 and r["lr"] == 1e-2
        assert r["ours"] == r["dcp"], r  # bit for bit: the same state, the same training
    assert resumed[0]["ours"][0] != saved[0]["losses"][-1]  # it trained on: new batches, new losses


def _torchrun(ranks: int, *args: str) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    done = subprocess.run(
        [*command, str(ROOT / "examples" / "fsdp2.py"), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow  # CI's budget: the default run reshards 4 -> 2 ranks in-process above
def test_the_torchrun_example_of_the_docs_resumes_at_another_world_size(tmp_path: Path) -> None:
    resumed = tmp_path / "resumed"
    _torchrun(4, "--dir", str(resumed), "--steps", "2")
    out = _torchrun(2, "--dir", str(resumed), "--steps", "4")
    assert "resumed at step 2 on 2 ranks" in out
    reference = _torchrun(4, "--dir", str(tmp_path / "reference"), "--steps", "4")
    later = [line for line in out.splitlines() if line.startswith(("step 3:", "step 4:"))]
    assert len(later) == 2 and all(line in reference for line in later)
