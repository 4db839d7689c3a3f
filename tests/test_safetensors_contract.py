"""What safetensors' own tests expect of a safetensors file, held for aiosnap's files.

An aiosnap file is a safetensors file: every dtype safetensors 0.8 knows is written under
its code and read from it (both ways: aiosnap -> ``load_file``, ``save_file`` -> aiosnap),
files that today's code wrote keep loading (goldens of constructed values), the header
says ``"format": "pt"``, and ``aiosnap convert`` keeps a file's own ``__metadata__``.
safetensors' tests (bindings/python/tests/test_pt_comparison.py, test_simple.py) are run
here with aiosnap writing or reading; what differs by design is in docs/format.md.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

import aiosnap

from .conftest import assert_tree_equal, raw_bytes
from .hostile import headers_both_ways
from .test_cli import cli

GOLDEN = Path(__file__).resolve().parent / "golden"
#: Every code safetensors 0.8 knows, and its bits per element (``Dtype::bitsize`` in
#: safetensors/src/tensor.rs).
SAFETENSORS_BITS = {
    **{"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8},
    **{"F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16},
    **{"I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64},
}
#: The torch dtype each code loads as in safetensors' torch loader (``get_pydtype`` in
#: bindings/python/src/lib.rs); the F6 codes have none.
SAFETENSORS_TORCH = {
    **{"BOOL": "bool", "F4": "float4_e2m1fn_x2", "U8": "uint8", "I8": "int8", "F8_E5M2": "float8_e5m2"},
    **{"F8_E4M3": "float8_e4m3fn", "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz"},
    **{"F8_E5M2FNUZ": "float8_e5m2fnuz", "I16": "int16", "U16": "uint16", "F16": "float16"},
    **{"BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "C64": "complex64"},
    **{"F64": "float64", "I64": "int64", "U64": "uint64"},
}
CODED = [getattr(torch, name) for name in sorted(SAFETENSORS_TORCH.values())]


def _entries(path: Path) -> dict[str, Any]:
    """The safetensors entries of a file's header (``__metadata__`` included)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return dict(json.loads(raw[8 : 8 + n]))


def _values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Constructed bytes of ``dtype`` (bools 0 or 1), any bit pattern of the others."""
    n = int(np.prod(shape)) * dtype.itemsize
    if not n:
        return torch.empty(shape, dtype=dtype)
    raw = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))
    if dtype == torch.bool:
        raw %= 2
    return raw.view(dtype).reshape(shape)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        got.dtype == want.dtype and got.shape == want.shape and torch.equal(raw_bytes(got), raw_bytes(want))
    )


# -- dtypes ----------------------------------------------------------------------------------------


def test_the_dtypes_safetensors_knows_are_those_aiosnap_knows() -> None:
    from safetensors import TensorSpec

    from aiosnap._format import dtypes

    # The installed safetensors lists the torch dtypes it writes in the error for one it
    # does not: the lists above are its own.
    with pytest.raises(SafetensorError) as caught:
        TensorSpec(dtype="nonsense", shape=[1], data_ptr=0, data_len=0)
    listed = re.search(r"Supported dtypes: (.*)", str(caught.value))
    assert listed is not None and set(listed.group(1).split(", ")) == set(SAFETENSORS_TORCH.values())
    assert dtypes.ST_BITS == SAFETENSORS_BITS
    assert {code: dtypes.torch_name(dt) for code, dt in dtypes.ST_TORCH.items()} == SAFETENSORS_TORCH


@pytest.mark.parametrize("code", sorted(SAFETENSORS_BITS))
def test_aiosnap_reads_every_code_safetensors_reads(tmp_path: Path, code: str) -> None:
    # Was, for F8_E8M0, F4 and F6: "unknown dtype", the file refused as corrupt.
    path = tmp_path / "one.safetensors"
    nbytes = SAFETENSORS_BITS[code]  # eight elements
    header = json.dumps({"x": {"dtype": code, "shape": [2, 4], "data_offsets": [0, nbytes]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(range(nbytes)))
    with safe_open(str(path), "pt") as f:
        assert f.get_slice("x").get_dtype() == code
    if code in SAFETENSORS_TORCH:
        want = getattr(torch, SAFETENSORS_TORCH[code])
        loaded = aiosnap.load_sync(str(path))["x"]
        assert loaded.dtype == want and torch.equal(
            raw_bytes(loaded), torch.arange(nbytes, dtype=torch.uint8)
        )
    else:  # F6: safetensors' torch loader has no dtype for it either
        with pytest.raises(aiosnap.errors.CheckpointError, match="torch has no dtype") as refused:
            aiosnap.load_sync(str(path))
        assert not isinstance(refused.value, aiosnap.errors.CorruptCheckpointError)


@pytest.mark.parametrize("dtype", CODED, ids=str)
def test_every_dtype_round_trips_through_safetensors_both_ways(tmp_path: Path, dtype: torch.dtype) -> None:
    # Was, for float8_e8m0fnu and float4_e2m1fn_x2: written as raw U8 bytes, and
    # safetensors' own files of them refused as corrupt ("unknown dtype").
    shapes = [(2, 4), (3,), (0, 2), ()] if dtype != torch.float4_e2m1fn_x2 else [(2, 4), (3,), (0, 2)]
    state = {f"t{i}": _values(dtype, shape, i) for i, shape in enumerate(shapes)}
    ours, theirs = tmp_path / "ours", tmp_path / "theirs.safetensors"
    aiosnap.save_sync(str(ours), state)
    save_file(state, str(theirs))
    # Under safetensors' own codes and shapes, as its writer writes them:
    mine, its = _entries(ours), _entries(theirs)
    for name in state:
        assert (mine[name]["dtype"], mine[name]["shape"]) == (its[name]["dtype"], its[name]["shape"])
    for loaded in (load_file(str(ours)), aiosnap.load_sync(str(theirs)), aiosnap.load_sync(str(ours))):
        for name, want in state.items():
            assert _same(loaded[name], want), name


def test_a_0d_float4_is_kept_as_raw_bytes(tmp_path: Path) -> None:
    # F4 counts values in the last dimension: a 0-d tensor of pairs has no F4 form
    # (safetensors' own writer refuses it), so it is stored as its byte.
    value = torch.tensor(0x2A, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    aiosnap.save_sync(str(tmp_path / "c"), {"x": value})
    assert _entries(tmp_path / "c")["x"]["dtype"] == "U8"
    assert _same(aiosnap.load_sync(str(tmp_path / "c"))["x"], value)
    assert torch.equal(load_file(str(tmp_path / "c"))["x"], torch.tensor([0x2A], dtype=torch.uint8))


@pytest.mark.parametrize(
    ("shape", "match"),
    [([2, 3], "in pairs"), ([3], "do not match"), ([], "do not match")],
)
def test_f4_entries_torch_cannot_hold_are_refused(tmp_path: Path, shape: list[int], match: str) -> None:
    nbytes = int(np.prod(shape)) // 2
    header = json.dumps({"x": {"dtype": "F4", "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    (tmp_path / "f").write_bytes(struct.pack("<Q", len(header)) + header + bytes(nbytes))
    with pytest.raises(aiosnap.errors.CheckpointError, match=match):
        aiosnap.load_sync(str(tmp_path / "f"))


# -- files written by earlier code -----------------------------------------------------------------


def legacy_state() -> dict[str, Any]:
    """What tests/golden/legacy-raw-dtypes.aiosnap holds: written by aiosnap at c4f3873
    (before this change), which stored float8_e8m0fnu and float4_e2m1fn_x2 as raw U8."""
    u8 = torch.arange(1, 13, dtype=torch.uint8)
    return {
        "e8m0": u8[:4].add(124).view(torch.float8_e8m0fnu),
        "e8m0_0d": torch.tensor(127, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        "fp4": u8[:6].mul(17).view(torch.float4_e2m1fn_x2).reshape(2, 3),
        "fp4_0d": torch.tensor(0x2A, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        "f32": torch.arange(4, dtype=torch.float32),
        "step": 3,
    }


def format_v1_state() -> dict[str, Any]:
    """What tests/golden/format-v1.aiosnap holds, written by aiosnap at c4f3873."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "model": {
            "w": w,
            "tied": w,
            "b": torch.arange(3, dtype=torch.bfloat16),
            "mask": torch.tensor([True, False]),
        },
        "ints": torch.arange(-2, 3, dtype=torch.int64),
        "c64": torch.complex(torch.arange(2.0), -torch.arange(2.0)),
        "c128": torch.complex(torch.arange(2.0, dtype=torch.float64), torch.ones(2, dtype=torch.float64)),
        "fp8": torch.arange(4, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "empty": torch.zeros(2, 0),
        "zero_d": torch.tensor(7, dtype=torch.int16),
        "np": np.arange(6, dtype=">i4").reshape(2, 3),
        "npscalar": np.float32(1.5),
        "plain": [1, 2.5, float("nan"), "s", None, (True, b"\x00\x01")],
        "keys": {0: "a", 2.5: "b"},
    }


def test_a_file_that_stored_new_codes_as_raw_bytes_still_loads() -> None:
    path = GOLDEN / "legacy-raw-dtypes.aiosnap"
    assert _entries(path)["e8m0"]["dtype"] == "U8"  # as it was written
    assert_tree_equal(legacy_state(), aiosnap.load_sync(str(path)))
    assert aiosnap.verify_sync(str(path)).checksummed
    quick, general, _ = headers_both_ways(path)
    assert quick == general
    raw = load_file(str(path))  # other readers: its bytes, as before
    assert torch.equal(raw["fp4"], raw_bytes(legacy_state()["fp4"]))


def test_a_file_written_before_this_format_change_loads_as_it_did() -> None:
    path = GOLDEN / "format-v1.aiosnap"
    assert "format" not in _entries(path)["__metadata__"]
    loaded = aiosnap.load_sync(str(path))
    assert_tree_equal(format_v1_state(), loaded)
    assert loaded["model"]["w"] is loaded["model"]["tied"]
    quick, general, shortcut = headers_both_ways(path)
    assert quick == general and shortcut  # still read without parsing its entries


# -- __metadata__ ----------------------------------------------------------------------------------


def test_files_say_they_hold_torch_tensors(tmp_path: Path) -> None:
    from accelerate.utils import load_state_dict

    # accelerate's load_state_dict (as transformers' from_pretrained did) refuses a
    # safetensors file whose metadata has no "format" of a framework. Was: OSError.
    path = tmp_path / "model.safetensors"
    aiosnap.save_sync(str(path), {"w": torch.arange(4.0)})
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["format"] == "pt"
    assert torch.equal(load_state_dict(str(path))["w"], torch.arange(4.0))
    quick, general, shortcut = headers_both_ways(path)
    assert quick == general and shortcut and quick.metadata == {"format": "pt"}


def test_convert_keeps_a_files_own_metadata(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Was: dropped (only "format" and aiosnap's tree were written).
    src = tmp_path / "src.safetensors"
    save_file({"w": torch.ones(2)}, str(src), metadata={"format": "pt", "Something": "more", "é": '"q"'})
    snap, back, pt = tmp_path / "x.snap", tmp_path / "back.safetensors", tmp_path / "x.pt"
    assert cli(capsys, "convert", str(src), str(snap))[0] == 0
    with safe_open(str(snap), "pt") as f:
        assert {k: v for k, v in f.metadata().items() if not k.startswith("aiosnap")} == {
            "format": "pt",
            "Something": "more",
            "é": '"q"',
        }
    assert cli(capsys, "convert", str(snap), str(back))[0] == 0
    with safe_open(str(back), "pt") as f:
        assert f.metadata()["Something"] == "more" and f.metadata()["é"] == '"q"'
    assert cli(capsys, "convert", str(src), str(tmp_path / "again.safetensors"))[0] == 0
    with safe_open(str(tmp_path / "again.safetensors"), "pt") as f:
        assert f.metadata()["Something"] == "more" and "aiosnap_tree" in f.metadata()
    code, _, err = cli(capsys, "convert", str(snap), str(pt))
    assert code == 0 and "Something, é" in err and "has none" in err
    assert torch.equal(aiosnap.load_sync(str(snap))["w"], torch.ones(2))


# -- safetensors' own tests, with aiosnap writing or reading -----------------------------------------


def _both_ways(tmp_path: Path, data: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """``data`` as safetensors reads aiosnap's file of it, and as aiosnap reads
    safetensors' file of it (safetensors' tests' ``save_file``/``load_file`` pairs)."""
    aiosnap.save_sync(str(tmp_path / "a"), data)
    save_file(dict(data), str(tmp_path / "s.safetensors"))
    return [load_file(str(tmp_path / "a")), aiosnap.load_sync(str(tmp_path / "s.safetensors"))]


def test_pt_comparison_odd_dtypes(tmp_path: Path) -> None:
    data = {
        "test": torch.randn((2, 2), dtype=torch.bfloat16),
        "test2": torch.randn((2, 2), dtype=torch.float16),
        "test3": torch.zeros((2, 2), dtype=torch.bool),
        "test4": torch.zeros((2, 2), dtype=torch.complex64),
    }
    data["test3"][0, 0] = True
    for reloaded in _both_ways(tmp_path, data):
        assert all(torch.equal(data[k], reloaded[k]) for k in data)


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        ("float8_e4m3fn", -0.5),
        ("float8_e5m2", -0.5),
        ("float8_e8m0fnu", 0.5),
        ("float8_e4m3fnuz", 0.5),
        ("float8_e5m2fnuz", 0.5),
    ],
)
def test_pt_comparison_odd_dtype_fp8(tmp_path: Path, dtype: str, value: float) -> None:
    data = {"test": torch.tensor([value], dtype=getattr(torch, dtype))}
    for reloaded in _both_ways(tmp_path, data):
        assert reloaded["test"].dtype == getattr(torch, dtype) and reloaded["test"].item() == value


def test_pt_comparison_odd_dtype_fp4(tmp_path: Path) -> None:
    test1 = torch.tensor([0.0], dtype=torch.float8_e8m0fnu)
    test2 = torch.empty(2, 2, dtype=torch.float4_e2m1fn_x2)
    for reloaded in _both_ways(tmp_path, {"test1": test1, "test2": test2}):
        assert reloaded["test1"].dtype == torch.float8_e8m0fnu and reloaded["test1"] == test1
        assert reloaded["test2"].dtype == torch.float4_e2m1fn_x2 and _same(reloaded["test2"], test2)


def test_pt_comparison_zero_sized_and_disjoint_views(tmp_path: Path) -> None:
    for reloaded in _both_ways(tmp_path, {"test": torch.zeros((2, 0)), "test2": torch.zeros((2, 0))}):
        assert torch.equal(reloaded["test"], torch.zeros((2, 0))) and torch.equal(
            reloaded["test2"], torch.zeros(2, 0)
        )
    a = torch.zeros((10, 10))
    aiosnap.save_sync(
        str(tmp_path / "d"), {"test": a[1:], "test2": a[:1]}
    )  # test_disjoint_tensors_shared_storage
    assert set(load_file(str(tmp_path / "d"))) == {"test", "test2"}


def test_pt_comparison_slices_and_metadata_of_an_aiosnap_file(tmp_path: Path) -> None:
    tensor = torch.arange(6, dtype=torch.float32).reshape((1, 2, 3))
    aiosnap.save_sync(str(tmp_path / "a"), {"test": tensor, "big": torch.zeros((1024, 1024))})
    with safe_open(str(tmp_path / "a"), framework="pt") as f:
        piece = f.get_slice("test")
        assert (piece.get_shape(), piece.get_dtype()) == ([1, 2, 3], "F32")
        assert torch.equal(piece[:, :, 1:2], torch.Tensor([[[1.0], [4.0]]]))
        assert f.metadata()["format"] == "pt"  # safetensors' own file of no metadata says None
    assert torch.equal(load_file(str(tmp_path / "a"))["big"], torch.zeros((1024, 1024)))


def test_simple_numpy_reads_aiosnap_arrays(tmp_path: Path) -> None:
    from safetensors.numpy import load_file as load_numpy

    tensors = {"a": np.zeros((2, 2)), "b": np.zeros((2, 3), dtype=np.uint8), "flag": np.asarray(False)}
    aiosnap.save_sync(str(tmp_path / "a"), tensors)
    loaded = load_numpy(str(tmp_path / "a"))
    assert all(np.array_equal(tensors[k], loaded[k]) and tensors[k].dtype == loaded[k].dtype for k in tensors)


def test_simple_overlapping_storage_is_two_entries(tmp_path: Path) -> None:
    # test_pt_sf_save_model_overlapping_storage: one data pointer, two storages of two sizes
    m = torch.randn(10)
    n = torch.empty([], dtype=m.dtype)
    n.set_(source=m.untyped_storage()[:16])  # n: the first 4 of m's elements
    aiosnap.save_sync(str(tmp_path / "a"), {"m": m, "n": n})
    loaded = load_file(str(tmp_path / "a"))
    assert torch.equal(loaded["m"], m) and torch.equal(loaded["n"], m[:4])
