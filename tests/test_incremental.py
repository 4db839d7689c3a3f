"""Incremental saves: large entries stored once, as content-addressed blobs.

Each test uses real files and the real readers: a save writes only the blobs it lacks,
every reader follows references and verifies their bytes, retention and prune delete a
blob only once no checkpoint refers to it, hostile references are refused naming the
file, and a standalone copy is a plain aiosnap (safetensors) file again.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import aiosnap
from aiosnap._format.codec import read_header
from aiosnap._load.refs import follow
from aiosnap._manager.blobs import collect
from aiosnap._manager.catalog import INDEX_NAME
from aiosnap._save.incremental import MIN_BLOB, PINS
from aiosnap.storage import LocalStorage

from . import hostile
from .test_cli import cli

BLOBS = "aiosnap-blobs"
ROWS = MIN_BLOB // 4 // 64  # a [ROWS, 64] float32 tensor is exactly one blob's minimum


def lora_state(step: int, base: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A frozen base (large, the same every step), an adapter and a small value that change."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "base": base,
        "adapter": torch.randn(2 * ROWS, 64, generator=g),
        "small": torch.full((8,), float(step)),
        "step": step,
    }


def make_base() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}": torch.randn(4 * ROWS, 64, generator=g) for i in range(3)}


def blobs(directory: Path) -> set[str]:
    folder = directory / BLOBS
    return set(os.listdir(folder)) if folder.exists() else set()


def assert_equal(loaded: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert set(loaded) == set(want)
        for k in want:
            assert_equal(loaded[k], want[k])
    elif isinstance(want, torch.Tensor):
        assert torch.equal(loaded, want)
    else:
        assert loaded == want


async def test_a_second_save_writes_only_what_changed_and_every_reader_follows(tmp_path: Path) -> None:
    base = make_base()
    async with aiosnap.ThreadWriter(incremental=True) as writer:
        first = await (await writer("a", str(tmp_path), lora_state(1, base))).wait()
        after_first = blobs(tmp_path)
        second = await (await writer("b", str(tmp_path), lora_state(2, base))).wait()
    assert len(after_first) == 4  # three base layers and the adapter
    assert len(blobs(tmp_path) - after_first) == 1  # only the new adapter
    adapter = 2 * ROWS * 64 * 4
    file_b = (tmp_path / "b").stat().st_size
    assert second.bytes == file_b + adapter < first.bytes  # the file and the one new blob
    for name, step in (("a", 1), ("b", 2)):
        want = lora_state(step, base)
        assert_equal(await aiosnap.load(str(tmp_path / name)), want)
        target = {
            "base": {k: torch.zeros_like(v) for k, v in base.items()},
            "adapter": torch.zeros(2 * ROWS, 64),
            "small": torch.zeros(8),
            "step": 0,
        }
        await aiosnap.load_into(str(tmp_path / name), target)
        assert_equal(target, want)
        part = await aiosnap.load(str(tmp_path / name), keys=["base.layer1"])
        assert torch.equal(part["base"]["layer1"], base["layer1"])
        report = await aiosnap.verify(str(tmp_path / name))
        assert report.tensors == 5
        assert report.bytes == sum(v.nbytes for v in base.values()) + adapter + 32


async def test_safetensors_reads_a_referring_file_as_its_own_entries_only(tmp_path: Path) -> None:
    base = make_base()
    async with aiosnap.ThreadWriter(incremental=True) as writer:
        await (await writer("a", str(tmp_path), lora_state(1, base))).wait()
    with safe_open(str(tmp_path / "a"), "pt") as f:
        assert list(f.keys()) == ["small"]
        assert torch.equal(f.get_tensor("small"), torch.full((8,), 1.0))
        document = json.loads(f.metadata()["aiosnap"])
    assert sorted(document["refs"]) == ["adapter", "base.layer0", "base.layer1", "base.layer2"]
    header = read_header(LocalStorage().open_read(str(tmp_path / "a")), shortcut=False)
    fast = read_header(LocalStorage().open_read(str(tmp_path / "a")))
    assert header.refs == fast.refs and set(header.refs) == set(document["refs"])


async def save_incremental(directory: Path, name: str, state: Any) -> aiosnap.SaveStats:
    async with aiosnap.ThreadWriter(incremental=True) as writer:
        return await (await writer(name, str(directory), state)).wait()


def test_standalone_copies_are_plain_files_that_load_bit_equal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = make_base()
    asyncio.run(save_incremental(tmp_path / "run", "a", lora_state(1, base)))
    src = str(tmp_path / "run" / "a")
    written = aiosnap.standalone_sync(src, str(tmp_path / "copy"))
    assert written == (tmp_path / "copy").stat().st_size
    assert read_header(LocalStorage().open_read(str(tmp_path / "copy"))).refs == {}
    with safe_open(str(tmp_path / "copy"), "pt") as f:
        assert sorted(f.keys()) == ["adapter", "base.layer0", "base.layer1", "base.layer2", "small"]
    assert_equal(aiosnap.load_sync(str(tmp_path / "copy")), lora_state(1, base))
    code, out, err = cli(capsys, "inspect", "--json", src)
    assert code == 0, err
    shown = {e["path"]: e.get("blob") for e in json.loads(out)["entries"]}
    refs = hostile.parse(Path(src).read_bytes()).meta["refs"]
    assert shown == {"small": None, "step": None} | {name: d["blob"] for name, d in refs.items()}
    assert json.loads(out)["stored"]["bytes"] == aiosnap.verify_sync(src).bytes
    code, _, err = cli(capsys, "convert", "--standalone", src, str(tmp_path / "cli"))
    assert code == 0, err
    assert (tmp_path / "cli").read_bytes() == (tmp_path / "copy").read_bytes()
    # A damaged blob is never copied into a file that would vouch for it.
    blob = next((tmp_path / "run" / BLOBS).iterdir())
    raw = bytearray(blob.read_bytes())
    raw[100] ^= 1
    blob.write_bytes(raw)
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="checksum mismatch"):
        asyncio.run(aiosnap.standalone(src, str(tmp_path / "bad")))
    assert not (tmp_path / "bad").exists()


async def test_frozen_entries_are_trusted_only_while_their_checksum_holds(tmp_path: Path) -> None:
    base = make_base()
    async with aiosnap.ThreadWriter(incremental=aiosnap.Incremental(frozen=["base.*"])) as writer:
        await (await writer("a", str(tmp_path), lora_state(1, base))).wait()
        before = blobs(tmp_path)
        base["layer0"][0, 0] += 1  # declared frozen, changed all the same
        await (await writer("b", str(tmp_path), lora_state(2, base))).wait()
    assert len(blobs(tmp_path) - before) == 2  # the adapter, and the changed layer
    assert_equal(await aiosnap.load(str(tmp_path / "b")), lora_state(2, base))


async def test_hostile_references_are_refused_naming_the_file(tmp_path: Path) -> None:
    base = make_base()
    async with aiosnap.ThreadWriter(incremental=True) as writer:
        await (await writer("a", str(tmp_path), lora_state(1, base))).wait()
    path = tmp_path / "a"
    parts = hostile.parse(path.read_bytes())
    adapter = parts.meta["refs"]["adapter"]
    blob = tmp_path / BLOBS / adapter["blob"]

    # A header claiming a huge entry: refused from the blob's size, before any allocation.
    adapter["shape"] = [1 << 40, 64]
    (tmp_path / "huge").write_bytes(hostile.render(parts))
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="huge.*adapter.*bytes"):
        await aiosnap.load(str(tmp_path / "huge"))
    # A blob that holds other bytes: its crc32c fails, in load and verify.
    raw = bytearray(blob.read_bytes())
    raw[-1] ^= 0x40
    blob.write_bytes(raw)
    for read in (aiosnap.load, aiosnap.verify):
        with pytest.raises(
            aiosnap.errors.CorruptCheckpointError, match=f"{path}.*checksum mismatch.*adapter"
        ):
            await read(str(path))
    # A reference to a blob that is not there.
    blob.unlink()
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match=f"{path}.*adapter.*missing blob"):
        await aiosnap.load(str(path))
    # A blob folder that is not a rank's folder name (a path out of aiosnap's) is refused.
    parts.meta["blob_dir"] = "../../etc"
    (tmp_path / "away").write_bytes(hostile.render(parts))
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="away.*bad blob_dir"):
        await aiosnap.load(str(tmp_path / "away"))
    del parts.meta["blob_dir"]
    # A blob name that is not a content hash (a path out of the folder) is malformed.
    parts.meta["refs"]["adapter"]["blob"] = "../../etc/passwd"
    (tmp_path / "escape").write_bytes(hostile.render(parts))
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="escape.*adapter.*malformed"):
        await aiosnap.load(str(tmp_path / "escape"))


async def test_retention_keeps_every_blob_a_checkpoint_refers_to(tmp_path: Path) -> None:
    base = make_base()
    kept = aiosnap.retention.KeepLast(2)
    async with aiosnap.CheckpointManager(str(tmp_path), keep=kept, incremental=True) as mgr:
        for step in range(5):
            await (await mgr.save(step, lora_state(step, base))).wait()
            # the base's three blobs, and the adapters of the checkpoints kept
            assert len(blobs(tmp_path)) == 3 + min(step + 1, 2)
        for step in await mgr.steps():
            restored = await mgr.restore(step)
            assert_equal(restored.state, lora_state(step, base))
    # The index is a cache: without it, the references are read from the checkpoints.
    (tmp_path / INDEX_NAME).unlink()
    orphan = tmp_path / BLOBS / ("0" * 32)
    orphan.write_bytes(b"left by a save that crashed before its checkpoint")
    foreign = tmp_path / BLOBS / "notes.txt"
    foreign.write_text("not aiosnap's")
    async with aiosnap.CheckpointManager(str(tmp_path), keep=kept, incremental=True) as mgr:
        assert await mgr.prune() == []
        assert not orphan.exists() and foreign.exists()  # only what aiosnap names as blobs
        assert len(blobs(tmp_path)) == 3 + 2 + 1
        for step in await mgr.steps():
            await aiosnap.verify(str(tmp_path / mgr.filename(step)))


def test_the_collector_never_deletes_a_blob_pinned_while_it_ran(tmp_path: Path) -> None:
    folder = tmp_path / BLOBS
    folder.mkdir()
    names = ["1" * 32, "2" * 32]
    for name in names:
        (folder / name).write_bytes(b"x")
    # Pinned and unpinned during the collection (its checkpoint committed meanwhile,
    # after the collector's scan): still kept.
    started, go = threading.Event(), threading.Event()
    storage = LocalStorage()
    real_list = storage.list

    def slow_list(path: str) -> list[Any]:
        if path == str(tmp_path):
            started.set()
            go.wait()
        return real_list(path)

    storage.list = slow_list  # type: ignore[method-assign]
    gone: list[str] = []
    collector = threading.Thread(target=lambda: gone.extend(collect(storage, str(tmp_path))))
    collector.start()
    started.wait()
    PINS.pin(names[0])
    PINS.unpin([names[0]])
    go.set()
    collector.join()
    assert gone == [str(folder / names[1])]
    assert os.listdir(folder) == [names[0]]


async def test_zstd_blobs_are_recorded_compressed_and_checked(tmp_path: Path) -> None:
    pytest.importorskip("zstandard")
    periodic = (torch.arange(4 * ROWS * 64) % 7).float().reshape(4 * ROWS, 64)
    state = {"periodic": periodic, "step": 3}
    async with aiosnap.ThreadWriter(incremental=aiosnap.Incremental(compression="zstd", level=3)) as writer:
        stats = await (await writer("a", str(tmp_path), state)).wait()
    (blob,) = (tmp_path / BLOBS).iterdir()
    assert blob.name.endswith(".zst") and blob.stat().st_size < periodic.nbytes // 20
    assert stats.bytes == (tmp_path / "a").stat().st_size + blob.stat().st_size
    document = hostile.parse((tmp_path / "a").read_bytes()).meta["refs"]["periodic"]
    assert document["compression"] == "zstd" and document["stored"] == blob.stat().st_size
    assert_equal(await aiosnap.load(str(tmp_path / "a")), state)
    await aiosnap.verify(str(tmp_path / "a"))
    # A header claiming more than the frame holds is refused before anything is allocated.
    parts = hostile.parse((tmp_path / "a").read_bytes())
    parts.meta["refs"]["periodic"]["shape"] = [1 << 40, 64]
    (tmp_path / "huge").write_bytes(hostile.render(parts))
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="huge.*does not hold"):
        await aiosnap.load(str(tmp_path / "huge"))
    # A ranged read of a compressed entry (not front to back) slices its decompressed bytes.
    storage = LocalStorage()
    f = storage.open_read(str(tmp_path / "a"))
    reader, header = follow(storage, f, read_header(f))
    try:
        info = header.tensors["periodic"]
        part = bytearray(1000)
        reader.readinto(header.data_start + info.start + 4100, memoryview(part))
        assert part == periodic.numpy().tobytes()[4100:5100]
    finally:
        reader.close()
    blob.write_bytes(blob.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match=str(tmp_path / "a")):
        await aiosnap.load(str(tmp_path / "a"))


async def test_incremental_options_that_are_none_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="compression"):
        aiosnap.ThreadWriter(incremental=aiosnap.Incremental(compression="lz4"))
    with pytest.raises(ValueError, match="goes to the writer"):
        aiosnap.CheckpointManager(str(tmp_path), writer=aiosnap.ThreadWriter(), incremental=True)
    with pytest.raises(ValueError, match="reserved|aiosnap's own"):
        async with aiosnap.ThreadWriter() as writer:
            await writer(BLOBS, str(tmp_path), {"x": 1})
    with pytest.raises(ValueError, match="rank_dir"):  # one folder inside aiosnap-blobs
        aiosnap.ThreadWriter(incremental=True).keep_blobs_by_rank("../rank_00000")


@pytest.mark.parametrize(
    "make",
    [
        lambda: aiosnap.ProcessWriter(incremental=True),
        lambda: aiosnap.ThreadQueueWriter(incremental=True, capture="lazy"),
    ],
    ids=["process", "lazy"],
)
async def test_incremental_saves_from_a_worker_process_or_a_lazy_capture(tmp_path: Path, make: Any) -> None:
    base = make_base()
    async with make() as writer:
        for step in (1, 2):
            await (await writer(f"s{step}", str(tmp_path), lora_state(step, base))).wait()
    assert len(blobs(tmp_path)) == 3 + 2
    for step in (1, 2):
        assert_equal(await aiosnap.load(str(tmp_path / f"s{step}")), lora_state(step, base))


async def test_the_remote_tier_is_sent_only_the_blobs_it_lacks(tmp_path: Path) -> None:
    base = make_base()
    local, remote = tmp_path / "local", tmp_path / "remote"
    sent = []
    async with aiosnap.CheckpointManager(
        str(local), remote=aiosnap.Remote(str(remote), keep=aiosnap.retention.KeepLast(2)), incremental=True
    ) as mgr:
        for step in range(4):
            handle = await mgr.save(step, lora_state(step, base))
            await handle.wait()
            assert handle.upload is not None
            sent.append((await handle.upload.wait()).bytes)
        assert await mgr.remote_steps() == [2, 3]
    adapter = 2 * ROWS * 64 * 4
    file_sizes = [(remote / f"snapshot_iter_{s}").stat().st_size for s in (2, 3)]
    assert sent[0] > 3 * adapter * 2  # the base and the first adapter
    assert sent[2:] == [adapter + file_sizes[0], adapter + file_sizes[1]]  # then one new blob each
    assert len(blobs(remote)) == 3 + 2  # the remote's retention collected the others
    # The remote tier alone restores each checkpoint it holds.
    for step in (2, 3):
        assert_equal(await aiosnap.load(str(remote / f"snapshot_iter_{step}")), lora_state(step, base))


async def test_incremental_checkpoints_on_an_object_store_and_as_its_remote_tier(
    s3: Any, tmp_path: Path
) -> None:
    from aiosnap.storage import from_url

    base = make_base()
    url = f"s3://{s3.bucket()}/run"
    storage = from_url(url, **s3.options)
    async with aiosnap.ThreadWriter(incremental=True, storage=storage) as writer:
        for step in (1, 2):
            await (await writer(f"s{step}", url, lora_state(step, base))).wait()
    assert len(storage.list(f"{url}/{BLOBS}")) == 3 + 2
    for step in (1, 2):
        loaded = await aiosnap.load(f"{url}/s{step}", storage=storage)
        assert_equal(loaded, lora_state(step, base))
    remote = f"s3://{s3.bucket()}/tier"
    async with aiosnap.CheckpointManager(
        str(tmp_path),
        remote=aiosnap.Remote(
            remote, storage=from_url(remote, **s3.options), keep=aiosnap.retention.KeepLast(1)
        ),
        incremental=True,
    ) as mgr:
        for step in range(3):
            handle = await mgr.save(step, lora_state(step, base))
            assert handle.upload is not None
            await handle.upload.wait()
    far = from_url(remote, **s3.options)
    assert len(far.list(f"{remote}/{BLOBS}")) == 3 + 1  # the remote's retention collected
    assert_equal(await aiosnap.load(f"{remote}/snapshot_iter_2", storage=far), lora_state(2, base))


async def _three_steps(directory: Path, base: dict[str, torch.Tensor]) -> None:
    async with aiosnap.CheckpointManager(str(directory), incremental=True) as mgr:
        for step in range(3):
            await (await mgr.save(step, lora_state(step, base))).wait()


def test_aiosnap_prune_collects_the_blobs_of_what_it_removed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = make_base()
    asyncio.run(_three_steps(tmp_path, base))
    assert len(blobs(tmp_path)) == 3 + 3
    code, _, err = cli(capsys, "prune", str(tmp_path), "--keep-last", "1")
    assert code == 0, err
    assert len(blobs(tmp_path)) == 3 + 1
    assert_equal(aiosnap.load_sync(str(tmp_path / "snapshot_iter_2")), lora_state(2, base))


async def test_equal_entries_of_one_save_share_one_blob_written_once(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    same = torch.randn(4 * ROWS, 64, generator=g)
    state = {"a": same.clone(), "b": same.clone(), "c": torch.randn(4 * ROWS, 64, generator=g)}
    async with aiosnap.ThreadWriter(incremental=True) as writer:
        stats = await (await writer("x", str(tmp_path), state)).wait()
    assert len(blobs(tmp_path)) == 2
    assert stats.bytes == (tmp_path / "x").stat().st_size + 2 * same.nbytes
    refs = hostile.parse((tmp_path / "x").read_bytes()).meta["refs"]
    assert refs["a"]["blob"] == refs["b"]["blob"] != refs["c"]["blob"]
    assert_equal(await aiosnap.load(str(tmp_path / "x")), state)


# -- a group: each rank's blobs in a folder of its own ----------------------------------------
def group_state(rank: int, step: int, frozen: Any) -> dict[str, Any]:
    return {
        "frozen": frozen,  # a DTensor, Shard(0): each rank's box a blob, the same every step
        "model": {"w": torch.full((2 * ROWS, 64), float(step))},  # replicated: rank 0 stores it
        "own": torch.full((2 * ROWS, 64), rank * 100 + step + 0.5),
        "step": step,
    }


async def _group_incremental(rank: int, world: int, directory: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    whole = torch.randn(8 * ROWS, 64, generator=torch.Generator().manual_seed(0))
    frozen = distribute_tensor(whole, mesh, [Shard(0)])
    async with aiosnap.CheckpointManager(
        directory,
        incremental=True,
        ranks=aiosnap.Ranks(replicated=["model.*"], timeout=60),
        keep=aiosnap.retention.KeepLast(2),
    ) as mgr:
        for step in range(3):
            await (await mgr.save(step, group_state(rank, step, frozen))).wait()
        target = group_state(rank, 0, distribute_tensor(torch.zeros_like(whole), mesh, [Shard(0)]))
        restored = await mgr.restore(target=target)
    assert restored.step == 2
    assert torch.equal(target["frozen"].full_tensor(), whole)
    assert torch.equal(target["own"], torch.full((2 * ROWS, 64), rank * 100 + 2.5))
    assert torch.equal(target["model"]["w"], torch.full((2 * ROWS, 64), 2.0))
    return {"ok": True}


def test_a_group_keeps_each_ranks_blobs_apart_and_restores_them(tmp_path: Path) -> None:
    from .test_distributed import ok, run_ranks

    results = run_ranks(2, _group_incremental, str(tmp_path))
    ok(results, 2)
    folders = sorted(os.listdir(tmp_path / BLOBS))
    assert folders == ["rank_00000", "rank_00001"]
    for rank_dir in folders:  # what a rank's last collection could not see gone yet
        collect(LocalStorage(), str(tmp_path), rank_dir)
    # rank 0: its box of frozen, the replicated w and its own tensor of the two steps kept;
    # rank 1: its box, its own tensors
    assert len(os.listdir(tmp_path / BLOBS / "rank_00000")) == 1 + 2 + 2
    assert len(os.listdir(tmp_path / BLOBS / "rank_00001")) == 1 + 2
    step = str(tmp_path / "snapshot_iter_2")
    aiosnap.verify_sync(step)
    whole = aiosnap.load_sync(step, keys=["frozen", "model"])
    assert torch.equal(whole["frozen"], torch.randn(8 * ROWS, 64, generator=torch.Generator().manual_seed(0)))
    # A rank's file refers to its own folder; the replicated entries are in rank 0's.
    assert hostile.parse((tmp_path / "snapshot_iter_2" / "rank_00001").read_bytes()).meta["blob_dir"] == (
        "rank_00001"
    )


async def _tiered_group(rank: int, world: int, local: str, remote: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    whole = torch.randn(8 * ROWS, 64, generator=torch.Generator().manual_seed(0))
    frozen = distribute_tensor(whole, mesh, [Shard(0)])
    sent = []
    async with aiosnap.CheckpointManager(
        local,
        remote=aiosnap.Remote(remote, keep=aiosnap.retention.KeepLast(1)),
        incremental=True,
        ranks=aiosnap.Ranks(replicated=["model.*"], timeout=60),
    ) as mgr:
        for step in range(3):
            handle = await mgr.save(step, group_state(rank, step, frozen))
            assert handle.upload is not None
            sent.append((await handle.upload.wait()).bytes)
    return {"sent": sent}


def test_a_tiered_group_uploads_each_ranks_new_blobs_into_its_folder(tmp_path: Path) -> None:
    from .test_distributed import ok, run_ranks

    local, remote = tmp_path / "local", tmp_path / "remote"
    results = run_ranks(2, _tiered_group, str(local), str(remote))
    ok(results, 2)
    box = 4 * ROWS * 64 * 4
    for rank, result in results.items():
        first, *later = result["sent"]
        assert all(first - n >= box for n in later), (rank, result)  # the box went once
    # The remote's retention (KeepLast(1)) and each rank's collection there keep what step 2 needs.
    for rank_dir in ("rank_00000", "rank_00001"):
        collect(LocalStorage(), str(remote), rank_dir)
    assert len(os.listdir(remote / BLOBS / "rank_00000")) == 1 + 1 + 1  # box, w, own
    assert len(os.listdir(remote / BLOBS / "rank_00001")) == 1 + 1  # box, own
    whole = aiosnap.load_sync(str(remote / "snapshot_iter_2"), keys=["frozen"])["frozen"]
    assert torch.equal(whole, torch.randn(8 * ROWS, 64, generator=torch.Generator().manual_seed(0)))


# -- shared ground: the blob folder ---------------------------------------------------------------
@pytest.mark.parametrize("stray", ["symlink", "file"])
async def test_a_blob_folder_that_is_not_a_directory_is_refused_and_left_alone(
    tmp_path: Path, stray: str
) -> None:
    # A link in the blob folder's place would take the blobs outside the directory, into
    # the user's; a file there is the user's too.
    directory, user = tmp_path / "ckpt", tmp_path / "user"
    directory.mkdir()
    user.mkdir()
    mine = user / ("0" * 32)  # named as aiosnap names a blob
    mine.write_bytes(b"the user's")
    if stray == "symlink":
        (directory / "aiosnap-blobs").symlink_to(user, target_is_directory=True)
    else:
        (directory / "aiosnap-blobs").write_bytes(b"the user's")
    async with aiosnap.CheckpointManager(str(directory), incremental=True) as mgr:
        handle = await mgr.save(1, lora_state(1, make_base()))
        with pytest.raises(aiosnap.errors.ForeignFileError, match="aiosnap-blobs"):
            await handle.wait()
        assert await mgr.prune() == []
    assert sorted(os.listdir(user)) == [mine.name] and mine.read_bytes() == b"the user's"
    assert not (directory / "snapshot_iter_1").exists()
    if stray == "file":
        assert (directory / "aiosnap-blobs").read_bytes() == b"the user's"


async def test_a_link_in_the_remote_blob_folder_place_fails_the_upload_and_is_left_alone(
    tmp_path: Path,
) -> None:
    # The remote tier's copy refuses it as the local save does, and at once: a user's link
    # is no outage to wait out, so the upload fails (raised at flush) rather than retrying.
    local, remote, user = tmp_path / "local", tmp_path / "remote", tmp_path / "user"
    remote.mkdir()
    user.mkdir()
    (user / "notes").write_bytes(b"the user's")
    (remote / BLOBS).symlink_to(user, target_is_directory=True)
    mgr = aiosnap.CheckpointManager(str(local), remote=str(remote), incremental=True)
    async with mgr:
        handle = await mgr.save(1, lora_state(1, make_base()))
        await handle.wait()  # the local save is whole
        assert handle.upload is not None
        with pytest.raises(aiosnap.errors.ForeignFileError, match=BLOBS):
            await mgr.flush()
        with pytest.raises(aiosnap.errors.ForeignFileError, match=BLOBS):
            await handle.upload.wait()
    assert os.listdir(user) == ["notes"] and (user / "notes").read_bytes() == b"the user's"
    assert not (remote / "snapshot_iter_1").exists()
    assert_equal(await aiosnap.load(str(local / "snapshot_iter_1")), lora_state(1, make_base()))


def test_prune_follows_no_link_put_in_the_blob_folder_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = make_base()
    asyncio.run(_three_steps(tmp_path / "ckpt", base))
    user = tmp_path / "user"
    (tmp_path / "ckpt" / "aiosnap-blobs").rename(user)  # the user moved them, and left a link
    (tmp_path / "ckpt" / "aiosnap-blobs").symlink_to(user, target_is_directory=True)
    before = sorted(os.listdir(user))
    code, _, err = cli(capsys, "prune", str(tmp_path / "ckpt"), "--keep-last", "1")
    assert code == 0, err
    assert sorted(os.listdir(user)) == before  # nothing deleted through the link


async def test_a_referring_file_copied_alone_says_how_to_make_one_that_stands_alone(tmp_path: Path) -> None:
    base = make_base()
    async with aiosnap.ThreadWriter(incremental=True) as writer:
        await (await writer("a", str(tmp_path / "run"), lora_state(1, base))).wait()
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "a").write_bytes((tmp_path / "run" / "a").read_bytes())  # without its blobs
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="refers to the missing blob") as caught:
        await aiosnap.load(str(tmp_path / "copy" / "a"))
    assert "aiosnap convert --standalone" in str(caught.value) and BLOBS in str(caught.value)
