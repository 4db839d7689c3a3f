"""Values that must not change silently, files aiosnap did not write, and error
messages that name what the user knows."""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aiosnap
from aiosnap.cli import main as cli_main

from .conftest import WRITERS, assert_tree_equal, temp_files
from .faults import HookedPosix, failing_writes


# -- values that came back changed ---------------------------------------------------------
def test_big_endian_arrays_come_back_exactly_and_load_into_the_same_structure(tmp_path: Path) -> None:
    state = {"a": np.arange(6, dtype=">f4").reshape(2, 3), "i": np.array([1, -2], dtype=">i8")}
    path = str(tmp_path / "c")
    aiosnap.save_sync(path, state)
    loaded = aiosnap.load_sync(path)
    assert_tree_equal(state, loaded)  # same dtype (byte order included), same bytes
    target = {"a": np.zeros((2, 3), dtype=">f4"), "i": np.zeros(2, dtype=">i8")}
    aiosnap.load_into_sync(path, target)
    assert_tree_equal(state, target)


@pytest.mark.parametrize(
    "value",
    [
        np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False]),
        np.array([[1, 2], [3, 4]]).view(np.matrix),  # np.matrix() itself warns of deprecation
    ],
    ids=["MaskedArray", "matrix"],
)
def test_array_subclasses_are_refused_or_pickled_whole(tmp_path: Path, value: Any) -> None:
    with pytest.raises(
        aiosnap.errors.UnsupportedTypeError, match=f"{type(value).__qualname__} would load as"
    ):
        aiosnap.save_sync(str(tmp_path / "c"), {"v": value})
    aiosnap.save_sync(str(tmp_path / "c"), {"v": value}, allow_pickle=True)
    back = aiosnap.load_sync(str(tmp_path / "c"), allow_pickle=True)["v"]
    assert type(back) is type(value) and back.tobytes() == value.tobytes()
    if isinstance(value, np.ma.MaskedArray):
        assert (back.mask == value.mask).all()


# -- savefun=torch.save files ---------------------------------------------------------------
@pytest.mark.parametrize("make", [w for _, w in WRITERS], ids=[n for n, _ in WRITERS])
async def test_a_torch_save_file_reports_its_size_and_loads_with_the_opt_in(
    make: Any, tmp_path: Path
) -> None:
    state = {"w": torch.arange(6.0), "opt": {"lr": 0.5, "m": [torch.ones(2)]}}
    async with make() as writer:
        stats = await (await writer("m.pt", str(tmp_path), state, savefun=torch.save)).wait()
    path = tmp_path / "m.pt"
    assert stats.bytes == path.stat().st_size
    with pytest.raises(
        aiosnap.errors.PickleNotAllowedError, match=r"torch.save file.*allow_pickle=True.*torch.load"
    ):
        await aiosnap.load(str(path))
    assert_tree_equal(state, await aiosnap.load(str(path), allow_pickle=True))
    assert_tree_equal({"w": state["w"]}, await aiosnap.load(str(path), allow_pickle=True, keys=["w"]))
    with pytest.raises(aiosnap.errors.CheckpointKeyError):
        await aiosnap.load(str(path), allow_pickle=True, keys=["nope"])
    target = {"w": torch.zeros(6), "opt": {"lr": 0.0, "m": [torch.zeros(2)]}}
    await aiosnap.load_into(str(path), target, allow_pickle=True)
    assert_tree_equal(state, target)
    report = await aiosnap.verify(str(path))
    assert report.checksummed and report.bytes == stats.bytes and report.tensors == 2


def test_a_damaged_torch_save_file_fails_verification(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save({"w": torch.arange(1000.0)}, path)
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename)
    data = bytearray(path.read_bytes())
    data[info.header_offset + 30 + len(info.filename) + len(info.extra) + 10] ^= 0xFF  # inside the member
    path.write_bytes(data)
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="checksum mismatch"):
        aiosnap.verify_sync(str(path))


# -- files that are not checkpoints -----------------------------------------------------------
def _write_foreign(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / kind
    if kind == "npy":
        np.save(path, np.ones(3))
        return path.with_suffix(".npy")
    if kind == "npz":
        np.savez(path, a=np.ones(3))
        return path.with_suffix(".npz")
    if kind == "pickle":
        path.write_bytes(pickle.dumps({"a": 1}))
    elif kind == "legacy":
        torch.save({"a": torch.ones(1)}, path, _use_new_zipfile_serialization=False)
    elif kind == "text":
        path.write_text("model: resnet50\nepochs: 90\n")
    return path


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("npy", "NumPy .npy file: read it with numpy.load"),
        ("npz", "NumPy .npz file: read it with numpy.load"),
        ("pickle", "a pickle: read it with pickle.load"),
        ("text", "not an aiosnap or safetensors checkpoint"),
    ],
)
def test_a_file_that_is_not_a_checkpoint_says_what_it_is(tmp_path: Path, kind: str, match: str) -> None:
    path = _write_foreign(tmp_path, kind)
    for call in (aiosnap.load_sync, aiosnap.verify_sync):
        with pytest.raises(aiosnap.errors.NotACheckpointError, match=match) as info:
            call(str(path))
        assert info.value.path == str(path)


def test_a_legacy_torch_save_file_is_recognised(tmp_path: Path) -> None:
    path = _write_foreign(tmp_path, "legacy")
    with pytest.raises(aiosnap.errors.PickleNotAllowedError, match="torch.save file"):
        aiosnap.load_sync(str(path))
    assert torch.equal(aiosnap.load_sync(str(path), allow_pickle=True)["a"], torch.ones(1))


# -- error messages -----------------------------------------------------------------------------
@pytest.mark.parametrize(("code", "name"), [(errno.EACCES, "PermissionError"), (errno.EROFS, "OSError")])
async def test_errors_name_the_users_path_not_the_temp_file(tmp_path: Path, code: int, name: str) -> None:
    def refuse_creation(op: str, path: str) -> None:
        if op == "open" and path.endswith("ckpt"):
            raise OSError(code, "injected", path)

    storage = aiosnap.storage.LocalStorage(posix=HookedPosix(refuse_creation))
    with pytest.raises(OSError) as info:
        await aiosnap.save(str(tmp_path / "ckpt"), {"x": torch.ones(3)}, storage=storage)
    assert type(info.value).__name__ == name and info.value.errno == code
    assert info.value.filename == str(tmp_path / "ckpt") and str(tmp_path / "ckpt") in str(info.value)
    assert aiosnap.storage.TEMP_PREFIX not in str(info.value)
    assert temp_files(tmp_path) == []


async def test_a_full_disk_says_how_much_space_was_needed(tmp_path: Path) -> None:
    storage = failing_writes({"ckpt"})
    with pytest.raises(OSError, match=r"writing .*ckpt needs 4\.0 MiB, .* free") as info:
        await aiosnap.save(str(tmp_path / "ckpt"), {"x": torch.ones(1 << 20)}, storage=storage)
    assert info.value.errno == errno.ENOSPC and aiosnap.storage.TEMP_PREFIX not in str(info.value)


def test_a_url_is_never_taken_for_a_local_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="unknown storage scheme 'nosuch'"):
        aiosnap.save_sync("nosuch://bucket/run/ckpt", {"x": torch.ones(1)})
    with pytest.raises(ValueError, match="is a URL, not a local path"):
        aiosnap.save_sync(
            "s3://bucket/run/ckpt", {"x": torch.ones(1)}, storage=aiosnap.storage.LocalStorage()
        )
    assert list(tmp_path.iterdir()) == []  # no directory named "s3:" or "nosuch:"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real full disk: a 1 MiB tmpfs (mounting one needs root; CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a 1 MiB tmpfs for a real full disk needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


async def test_a_savefun_on_a_full_disk_says_the_disk_is_full(small_disk: Path) -> None:
    async with aiosnap.SimpleWriter() as writer:
        with pytest.raises(OSError, match=r"No space left on device: writing .*ckpt\.pt failed") as info:
            await writer("ckpt.pt", str(small_disk), {"w": torch.zeros(1 << 19)}, savefun=torch.save)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(small_disk / "ckpt.pt")
    assert "unexpected pos" in str(info.value)  # what torch.save said, kept as the detail
    assert os.listdir(small_disk) == []  # the temp file went


def test_an_int_too_long_for_text_is_our_error_naming_its_key(tmp_path: Path) -> None:
    with pytest.raises(
        aiosnap.errors.UnsupportedTypeError, match=r"at opt\.big: an int of more than 4300 digits"
    ):
        aiosnap.save_sync(str(tmp_path / "c"), {"opt": {"big": 10**5000}})
    aiosnap.save_sync(str(tmp_path / "c"), {"opt": {"big": 10**5000}}, allow_pickle=True)
    assert aiosnap.load_sync(str(tmp_path / "c"), allow_pickle=True)["opt"]["big"] == 10**5000


def test_verify_and_ls_say_a_torch_save_file_is_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    aiosnap.save_sync(str(tmp_path / "snapshot_iter_1"), {"w": torch.ones(3)})
    torch.save({"w": torch.ones(3)}, tmp_path / "snapshot_iter_2")  # a savefun's, say
    assert cli_main(["verify", str(tmp_path / "snapshot_iter_2")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("pickle ") and "a torch.save file, not an aiosnap checkpoint" in out
    # In a directory of checkpoints, a file aiosnap cannot tell it wrote is no checkpoint of
    # it: not listed, never restored (nor unpickled) by a manager, and named on stderr.
    assert cli_main(["ls", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "1 checkpoint(s)" in out and "snapshot_iter_2 (not a checkpoint aiosnap wrote)" in err
