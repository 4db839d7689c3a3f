"""aiosnap as DCP's storage backend, through DCP's own API in one process: dcp.save,
dcp.async_save with its default stager, dcp.load into a template; DCP's own reader and
dcp_to_torch_save reading what aiosnap wrote; a flipped byte named by item and file;
overwrite (DCP's test_overwrite contract), foreign checkpoints left alone; a failed write
leaves the previous checkpoint; a save SIGKILLed before each of its system calls leaves
the previous checkpoint or the new one, whole; object stores (fsspec memory://, S3 on
moto); the metadata's restricted unpickler. The ranks' side is tests/test_dcp_ranks.py."""

from __future__ import annotations

import errno
import os
import pickle
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.planner_helpers import _create_write_item_for_tensor
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.stateful import Stateful

import aiosnap
from aiosnap._base.checksums import crc32c
from aiosnap.integrations.dcp import AiosnapStorageReader, AiosnapStorageWriter
from aiosnap.storage import from_url

from .faults import HookedPosix
from .integration_runs import Child, Op, pause_at_file_ops, temp_entries

# DCP warns that it saves in one process when no process group is up: that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Blob(Stateful):
    """A Stateful whose values are not tensors: DCP writes them as serialized bytes."""

    def __init__(self, value: dict[str, Any]) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = dict(state_dict)


def state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 16)).sum().backward()
    optim.step()
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "extra": {
            "bf16": torch.arange(24, dtype=torch.bfloat16).reshape(4, 6) + seed,
            "view": torch.randn(12, 10)[2:8].t(),  # a non-contiguous view of a larger storage
            "ids": torch.arange(7, dtype=torch.int64) * (seed + 1),
            "empty": torch.zeros(0, 3),
        },
        "blob": Blob({"epoch": seed, "name": f"run-{seed}", "seen": [1, 2, seed]}),
    }


def template() -> dict[str, Any]:
    """``state()``'s shapes, zeroed: what a resuming job loads into."""
    out = state(99)
    for part in ("model", "extra"):
        for value in out[part].values():
            value.zero_()
    out["blob"] = Blob({"epoch": -1, "name": "", "seen": []})  # DCP loads the keys a template has
    return out


def assert_same(loaded: Any, saved: Any, path: str = "") -> None:
    if isinstance(saved, Stateful):
        assert loaded.state_dict() == saved.state_dict(), path
    elif isinstance(saved, dict):
        assert set(loaded) == set(saved), path
        for key in saved:
            assert_same(loaded[key], saved[key], f"{path}.{key}")
    elif isinstance(saved, torch.Tensor):
        assert loaded.dtype == saved.dtype and torch.equal(loaded, saved), path
    else:
        assert loaded == saved, path


def records(directory: Path) -> dict[str, Any]:
    """The metadata's record of each item (its FQN -> _StorageInfo), read as DCP reads it."""
    with open(directory / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    return {index.fqn: info for index, info in metadata.storage_data.items()}


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def failure(exc: CheckpointException) -> BaseException:
    """The one rank's error a CheckpointException carries (DCP wraps every rank's)."""
    (error, _trace), *others = exc.failures.values()
    assert not others, exc.failures
    return error


def test_save_and_load_into_a_template_and_dcp_reads_it_unchanged(tmp_path: Path) -> None:
    saved = state(1)
    dcp.save(saved, checkpoint_id=tmp_path / "ckpt", storage_writer=AiosnapStorageWriter())
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names[0] == ".metadata" and len(names) == 2 and names[1].startswith("__0_0."), names

    loaded = template()
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt", storage_reader=AiosnapStorageReader())
    assert_same(loaded, saved)
    # Every item carries the crc32c of its bytes, as they are in the file.
    data = (tmp_path / "ckpt" / names[1]).read_bytes()
    for fqn, info in records(tmp_path / "ckpt").items():
        assert info.crc32c == crc32c(data[info.offset : info.offset + info.length]), fqn

    # DCP's own reader (picked from the checkpoint_id) and its converter read it as theirs.
    plain = template()
    dcp.load(plain, checkpoint_id=str(tmp_path / "ckpt"))
    assert_same(plain, saved)
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert torch.equal(whole["extra"]["view"], saved["extra"]["view"])
    assert whole["blob"] == saved["blob"].state_dict()


def test_write_data_records_each_items_extent_and_checksum(tmp_path: Path) -> None:
    # As DCP's test_hf_storage drives a writer: write_data alone, on a plan of its own.
    tensors = {"tensor_0": torch.rand(4), "tensor_1": torch.rand(10)}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict=tensors)
    plan = SavePlan([_create_write_item_for_tensor(name, t) for name, t in tensors.items()])
    writer = AiosnapStorageWriter(tmp_path)
    future = writer.write_data(plan, planner)
    future.wait()
    results = sorted(future.value(), key=lambda r: r.storage_data.offset)
    assert sorted(r.index.fqn for r in results) == ["tensor_0", "tensor_1"]
    data = (tmp_path / results[0].storage_data.relative_path).read_bytes()
    end = 0
    for result in results:
        info = result.storage_data
        assert (info.offset, result.size_in_bytes) == (end, info.length)
        assert info.crc32c == crc32c(data[info.offset : info.offset + info.length])
        end += info.length
    assert end == len(data)


def test_async_save_with_its_default_stager(tmp_path: Path) -> None:
    writer = AiosnapStorageWriter()
    assert not isinstance(writer, AsyncStager)  # so async_save stages with its DefaultStager
    saved = state(2)
    expected = {key: value.clone() for key, value in saved["extra"].items()}
    future = dcp.async_save(saved, checkpoint_id=tmp_path / "ckpt", storage_writer=writer)
    for value in saved["extra"].values():  # changed once the call returned: staged before
        value.add_(1)
    future.result()
    loaded = template()
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt", storage_reader=AiosnapStorageReader())
    assert_same(loaded["extra"], expected)
    assert_same(loaded["model"], saved["model"])


def test_a_flipped_byte_is_named_by_item_and_file(tmp_path: Path) -> None:
    saved = state(3)
    dcp.save(saved, checkpoint_id=tmp_path, storage_writer=AiosnapStorageWriter())
    info = records(tmp_path)["model.0.weight"]
    flip(tmp_path / info.relative_path, info.offset + info.length // 2)  # in the tensor's data

    with pytest.raises(CheckpointException) as caught:
        dcp.load(template(), checkpoint_id=tmp_path, storage_reader=AiosnapStorageReader())
    error = failure(caught.value)
    assert isinstance(error, aiosnap.errors.CorruptCheckpointError)
    assert error.path == str(tmp_path / info.relative_path)
    assert "'model.0.weight'" in str(error) and "checksum mismatch" in str(error)
    # DCP's own reader has no checksum to check: it loads the altered value.
    plain = template()
    dcp.load(plain, checkpoint_id=str(tmp_path))
    assert not torch.equal(plain["model"]["0.weight"], saved["model"]["0.weight"])

    # A flipped byte in the metadata: DCP reports it in its message about the metadata.
    dcp.save(saved, checkpoint_id=tmp_path / "again", storage_writer=AiosnapStorageWriter())
    flip(tmp_path / "again" / ".metadata", 40)
    with pytest.raises(CheckpointException, match="metadata checksum mismatch"):
        dcp.load(template(), checkpoint_id=tmp_path / "again", storage_reader=AiosnapStorageReader())


def test_overwrite_replaces_whole_and_deletes_only_its_own(tmp_path: Path) -> None:
    # DCP's test_overwrite (test_fsspec.py), with aiosnap's writer.
    t1, t2 = torch.randn(10), torch.randn(10)
    dcp.save({"random": t1}, storage_writer=AiosnapStorageWriter(tmp_path, overwrite=False))
    first = sorted(os.listdir(tmp_path))
    dcp.save({"random": t2}, storage_writer=AiosnapStorageWriter(tmp_path, overwrite=True))
    sd = {"random": torch.zeros(10)}
    dcp.load(sd, checkpoint_id=str(tmp_path))
    torch.testing.assert_close(sd["random"], t2)
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save({"random": t2}, storage_writer=AiosnapStorageWriter(tmp_path, overwrite=False))
    # The replaced checkpoint's data file is gone; the new one has a name of its own.
    second = sorted(os.listdir(tmp_path))
    assert len(second) == 2 and first[1] not in second

    # A writer reused without a checkpoint_id writes new files at every save too.
    writer = AiosnapStorageWriter(tmp_path / "reused")
    dcp.save({"random": t1}, storage_writer=writer)
    before = set(os.listdir(tmp_path / "reused"))
    dcp.save({"random": t2}, storage_writer=writer)
    assert not before & set(os.listdir(tmp_path / "reused")) - {".metadata"}

    # A checkpoint DCP's own writer made is not aiosnap's to replace: refused, left whole.
    dcp.save({"random": t1}, storage_writer=FileSystemWriter(tmp_path / "theirs"))
    theirs = {p.name: p.read_bytes() for p in (tmp_path / "theirs").iterdir()}
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"random": t2}, storage_writer=AiosnapStorageWriter(tmp_path / "theirs"))
    assert isinstance(failure(caught.value), aiosnap.errors.ForeignFileError)
    assert {p.name: p.read_bytes() for p in (tmp_path / "theirs").iterdir()} == theirs
    # Nor is a metadata that is a symbolic link: it is neither read through nor replaced.
    (tmp_path / "linked").mkdir()
    os.symlink(tmp_path / "reused" / ".metadata", tmp_path / "linked" / ".metadata")
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"random": t2}, storage_writer=AiosnapStorageWriter(tmp_path / "linked"))
    assert isinstance(failure(caught.value), aiosnap.errors.ForeignFileError)
    assert os.path.islink(tmp_path / "linked" / ".metadata")
    # ... and aiosnap's reader reads it (there are no checksums to check).
    sd = {"random": torch.zeros(10)}
    dcp.load(sd, checkpoint_id=tmp_path / "theirs", storage_reader=AiosnapStorageReader())
    torch.testing.assert_close(sd["random"], t1)


def test_without_collectives_each_rank_commits_its_own_metadata(tmp_path: Path) -> None:
    # DCP's experimental use_collectives=False: __{rank}.metadata, read back by DCP's fallback.
    for value in (1.0, 2.0):
        dcp.save(
            {"a": torch.full((5,), value)},
            checkpoint_id=tmp_path,
            storage_writer=AiosnapStorageWriter(),
            use_collectives=False,
        )
    names = sorted(os.listdir(tmp_path))
    assert names[0] == "__0.metadata" and len(names) == 2, names  # the first save's file is gone
    for reader in (AiosnapStorageReader(), None):
        sd = {"a": torch.zeros(5)}
        dcp.load(sd, checkpoint_id=str(tmp_path), storage_reader=reader)
        assert torch.equal(sd["a"], torch.full((5,), 2.0))


@pytest.mark.cuda
def test_cuda_tensors_are_saved_from_and_loaded_into_the_device(tmp_path: Path) -> None:
    saved = {"w": torch.randn(1024, 256, device="cuda"), "h": torch.arange(9, device="cuda").half()}
    dcp.save(saved, checkpoint_id=tmp_path, storage_writer=AiosnapStorageWriter())
    loaded = {"w": torch.zeros(1024, 256, device="cuda"), "h": torch.zeros(9, device="cuda").half()}
    dcp.load(loaded, checkpoint_id=tmp_path, storage_reader=AiosnapStorageReader())
    assert all(loaded[k].is_cuda and torch.equal(loaded[k], saved[k]) for k in saved)


# A write (made by the writer's own thread, piece by piece) or the commit's fsync.
@pytest.mark.parametrize(("op", "code"), [("write", errno.ENOSPC), ("fsync", errno.EIO)])
def test_a_failed_write_fails_the_save_and_leaves_the_previous_checkpoint(
    tmp_path: Path, op: str, code: int
) -> None:
    dcp.save({"w": torch.ones(64)}, checkpoint_id=tmp_path, storage_writer=AiosnapStorageWriter())
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def hook(kind: str, path: str) -> None:
        if kind == op and path.endswith(".distcp"):
            raise OSError(code, f"{os.strerror(code)} (injected)", path)

    failing = AiosnapStorageWriter(storage=aiosnap.storage.LocalStorage(posix=HookedPosix(hook)))
    # 40 MiB: pieces go to the thread while the next fills
    big = {"w": torch.full((64,), 2.0), "big": torch.zeros(10 << 20)}
    with pytest.raises(CheckpointException) as caught:
        dcp.save(big, checkpoint_id=tmp_path, storage_writer=failing)
    error = failure(caught.value)
    assert isinstance(error, OSError) and error.errno == code and ".distcp" in str(error)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp file either
    sd = {"w": torch.zeros(64)}
    dcp.load(sd, checkpoint_id=tmp_path, storage_reader=AiosnapStorageReader())
    assert torch.equal(sd["w"], torch.ones(64))


def test_thread_count_writes_that_many_files_per_rank(tmp_path: Path) -> None:
    saved = state(5)
    dcp.save(saved, checkpoint_id=tmp_path, storage_writer=AiosnapStorageWriter(thread_count=2))
    assert len({info.relative_path for info in records(tmp_path).values()}) == 2
    loaded = template()
    dcp.load(loaded, checkpoint_id=tmp_path, storage_reader=AiosnapStorageReader())
    assert_same(loaded, saved)
    assert AiosnapStorageWriter.validate_checkpoint_id(tmp_path)
    assert AiosnapStorageReader.validate_checkpoint_id("s3://bucket/run/step-1")
    assert not AiosnapStorageReader.validate_checkpoint_id("nosuchscheme://x")


def resave_child(directory: str) -> None:
    """Saves ``directory`` again (every value 2) over the checkpoint the parent saved
    there (every value 1), each system call paused for the parent."""
    torch.set_num_threads(1)
    pause_at_file_ops(directory)
    dcp.save(_valued(2.0), checkpoint_id=directory, storage_writer=AiosnapStorageWriter())


def _valued(value: float) -> dict[str, Any]:
    return {"a": torch.full((256, 64), value), "b": {"c": torch.full((1000,), value)}, "n": int(value)}


def _killed_resave(case: Path, kill: Any) -> tuple[list[Op], Op | None]:
    dcp.save(_valued(1.0), checkpoint_id=case, storage_writer=AiosnapStorageWriter())
    run = Child("tests.test_dcp.resave_child", case, log=case.with_suffix(".log")).finish(kill_before=kill)
    return (run.ops[:-1], run.ops[-1]) if run.killed else (run.ops, None)


def _check_after_kill(case: Path, made: list[Op]) -> None:
    """The checkpoint at ``case`` is the old one or the new one, whole: the new one
    exactly when its metadata was renamed into place before the kill."""
    expected = 2.0 if ("rename", str(case / ".metadata")) in [op[:2] for op in made] else 1.0
    for reader in (AiosnapStorageReader(), None):  # aiosnap's (checked) and DCP's own
        sd = {"a": torch.zeros(256, 64), "b": {"c": torch.zeros(1000)}, "n": 0}
        dcp.load(sd, checkpoint_id=str(case), storage_reader=reader)
        assert_same(sd, _valued(expected))
    # The next save sweeps what the killed one left (a temp file, a data file no metadata
    # names), and replaces it: the directory holds the metadata and the files it names.
    dcp.save(_valued(3.0), checkpoint_id=case, storage_writer=AiosnapStorageWriter())
    assert temp_entries(case) == []
    named = {info.relative_path for info in records(case).values()}
    assert sorted(os.listdir(case)) == [".metadata", *sorted(named)]


def test_a_save_killed_before_its_metadata_is_renamed_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    case = tmp_path / "ckpt"
    made, at = _killed_resave(case, lambda ops: ops[-1][:2] == ("rename", str(case / ".metadata")))
    assert at is not None and ("rename", str(case / ".metadata")) == at[:2], made
    assert any(kind == "rename" and path.endswith(".distcp") for kind, path, _ in made)  # data committed
    _check_after_kill(case, made)


@pytest.mark.slow
def test_a_save_killed_before_any_of_its_system_calls_leaves_one_whole_checkpoint(tmp_path: Path) -> None:
    whole, _ = _killed_resave(tmp_path / "whole", None)
    kinds = [kind for kind, _, _ in whole]
    assert {"fsync", "rename", "dirsync", "unlink"} <= set(kinds), whole
    for n in range(1, len(whole) + 1):
        case = tmp_path / f"kill{n}"
        made, at = _killed_resave(case, lambda ops, n=n: len(ops) == n)
        try:
            _check_after_kill(case, made)
        except AssertionError as exc:
            exc.add_note(f"killed before {at} (calls made: {made})")
            raise


@pytest.mark.parametrize("where", ["memory", "s3"])
def test_an_object_store_url(tmp_path: Path, where: str, request: pytest.FixtureRequest) -> None:
    if where == "memory":
        storage, url = from_url("memory://"), f"memory://aiosnap-{uuid.uuid4().hex}/dcp/step-1"
    else:
        s3 = request.getfixturevalue("s3")
        bucket = s3.bucket()
        storage, url = from_url(f"s3://{bucket}", **s3.options), f"s3://{bucket}/dcp/step-1"
    saved = state(4)
    dcp.save(saved, checkpoint_id=url, storage_writer=AiosnapStorageWriter(storage=storage))
    loaded = template()
    dcp.load(loaded, checkpoint_id=url, storage_reader=AiosnapStorageReader(storage=storage))
    assert_same(loaded, saved)
    assert sorted(e.name for e in storage.list(url))[0] == ".metadata"


class _Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(Path(os.environ["DCP_PAYLOAD_DIR"]) / "ran"),))


def test_the_metadata_rebuilds_only_dcps_classes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "ckpt", storage_writer=AiosnapStorageWriter())
    metadata = pickle.loads((tmp_path / "ckpt" / ".metadata").read_bytes())
    (records_name,) = {info.relative_path for info in metadata.storage_data.values()}
    monkeypatch.setenv("DCP_PAYLOAD_DIR", str(tmp_path))
    metadata.planner_data = _Payload()
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointException, match="would rebuild posix.mkdir"):
        dcp.load(
            {"w": torch.zeros(3)}, checkpoint_id=tmp_path / "ckpt", storage_reader=AiosnapStorageReader()
        )
    assert not (tmp_path / "ran").exists()

    # A data file the metadata names outside the checkpoint's directory is refused.
    metadata.planner_data = None
    for info in metadata.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointException) as caught:
        dcp.load(
            {"w": torch.zeros(3)}, checkpoint_id=tmp_path / "ckpt", storage_reader=AiosnapStorageReader()
        )
    error = failure(caught.value)
    assert isinstance(error, aiosnap.errors.CorruptCheckpointError) and "'../elsewhere.distcp'" in str(error)

    # An extent that is not one: refused before any read.
    for info in metadata.storage_data.values():
        info.relative_path, info.length = records_name, -1
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointException) as caught:
        dcp.load(
            {"w": torch.zeros(3)}, checkpoint_id=tmp_path / "ckpt", storage_reader=AiosnapStorageReader()
        )
    assert "records 'w' at the extent" in str(failure(caught.value))
