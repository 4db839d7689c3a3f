"""The file format: every dtype round-trips, safetensors reads it, bad files are refused.

White-box: the header codec is tested on its own too (its two ways of reading a header,
its limits, files edited behind their checksums), through aiosnap's private modules.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import aiosnap
from aiosnap._base.checksums import crc32c
from aiosnap._format.dtypes import TORCH_DTYPES

from . import hostile
from .conftest import assert_tree_equal, raw_bytes
from .hostile import headers_both_ways


def _creatable(dtype: torch.dtype) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32 is "experimental"
            torch.zeros(1, dtype=dtype)
    except Exception:
        return False
    return True


ALL_DTYPES = sorted((d for d in TORCH_DTYPES.values() if _creatable(d)), key=str)
NUMPY_DTYPES = ["?", "i1", "u1", "<i2", ">i2", "<u4", "<f2", "<f4", ">f8", "<c8", "<c16", "<i8", "<u8"]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    n = int(np.prod(shape)) * dtype.itemsize
    data = np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)
    return torch.from_numpy(data).view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    shape=shapes,
    seed=st.integers(0, 2**16),
    transpose=st.booleans(),
    np_dtype=st.sampled_from(NUMPY_DTYPES),
)
def test_every_dtype_and_shape_round_trips(
    tmp_path: Path, dtype: torch.dtype, shape: tuple[int, ...], seed: int, transpose: bool, np_dtype: str
) -> None:
    tensor = random_tensor(dtype, shape, seed)
    if transpose and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)  # non-contiguous
    array = np.random.default_rng(seed).integers(0, 100, size=shape).astype(np_dtype)
    base = torch.arange(24.0)
    state = {"t": tensor, "a": array, "view1": base[2:10], "view2": base[5:20:3], "scalar": np.int16(-3)}
    path = str(tmp_path / "c.snap")
    aiosnap.save_sync(path, state)
    loaded = aiosnap.load_sync(path)
    assert_tree_equal(state, loaded)  # big-endian arrays included: same dtype, same bytes
    aiosnap.verify_sync(path)


def test_safetensors_reads_every_tensor(tmp_path: Path) -> None:
    state = {f"t_{str(d)[6:]}": random_tensor(d, (3, 2), i) for i, d in enumerate(ALL_DTYPES)}
    state["nested"] = {"np": np.arange(6, dtype=np.float32).reshape(2, 3)}
    path = tmp_path / "c.snap"
    aiosnap.save_sync(str(path), state)
    with safe_open(str(path), "pt") as f:
        names = set(f.keys())
        assert names == {*(k for k in state if k != "nested"), "nested.np"}
        for name in names:
            got = f.get_tensor(name)
            want = state["nested"]["np"] if name == "nested.np" else state[name]
            if isinstance(want, np.ndarray):
                want = torch.from_numpy(want)
            if got.dtype == want.dtype:
                assert torch.equal(raw_bytes(got), raw_bytes(want))
            else:  # dtypes safetensors has no code for arrive as their raw bytes
                assert got.dtype == torch.uint8 and torch.equal(got, raw_bytes(want))


def test_plain_safetensors_file_loads_as_flat_dict(tmp_path: Path) -> None:
    tensors = {"layer.weight": torch.randn(4, 3), "layer.bias": torch.randn(4), "x": torch.ones(2).half()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = aiosnap.load_sync(str(tmp_path / "model.safetensors"))
    assert set(loaded) == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(loaded[k], v)
    assert not aiosnap.verify_sync(str(tmp_path / "model.safetensors")).checksummed
    model = {"layer.weight": torch.zeros(4, 3), "layer.bias": torch.zeros(4), "x": torch.zeros(2).half()}
    aiosnap.load_into_sync(str(tmp_path / "model.safetensors"), model)
    assert torch.equal(model["layer.weight"], tensors["layer.weight"])


def test_values_of_every_kind_round_trip(tmp_path: Path) -> None:
    state: dict[Any, Any] = {
        "none": None,
        "bools": [True, False],
        "ints": [0, -1, 2**70],
        "floats": [1.0, -0.0, 1e-300],
        "special": [float("inf"), float("-inf"), float("nan")],
        "str": 'ünï"côdé',
        "bytes": b"\x00\xff",
        "tuple": (1, (2, 3)),
        "int keys": {0: "a", 1: "b"},
        "mixed keys": {None: 1, 2.5: 2, True: 3},
        "empty": {"d": {}, "l": [], "t": ()},
        "zero-d": torch.tensor(3.5),
        "empty tensor": torch.zeros(0, 4),
        "npbool": np.bool_(True),
        "npf": np.float64(2.5),
        "size": torch.Size([2, 3]),
        # The skeleton and the names are JSON written by hand, escaped in slices:
        # quotes, backslashes, controls, line separators, astral characters, a string
        # longer than one slice, and tensor names that need escaping.
        "escapes": ['"\\\n\t\x00\x1f\u2028\U0001f600', "é" * 70_000 + '"' + "\\" * 3],
        'na"me\\ü\U0001f600': torch.arange(3),
        "nested": {"a\nb": [{"c": torch.ones(1)}, ()]},
    }
    path = str(tmp_path / "c")
    aiosnap.save_sync(path, state)
    loaded = aiosnap.load_sync(path)
    state["size"] = (2, 3)
    assert_tree_equal(state, loaded)
    assert aiosnap.verify_sync(path).checksummed


def test_runs_of_small_tensors_of_every_sort_round_trip(tmp_path: Path) -> None:
    # Small host tensors are copied from their data pointers; conjugate and negative bits
    # and strides take the general copy, and a view's bytes start at its storage offset.
    z = torch.complex(torch.randn(5), torch.randn(5))
    param = torch.nn.Parameter(torch.randn(7))
    state = {
        "many": [torch.full((3,), float(i)) for i in range(2500)],  # longer than one run
        "wide": [torch.randn(300_000 // 4) for _ in range(20)],  # runs bounded by bytes
        "param": param,
        "bf16": torch.randn(9).bfloat16(),
        "conj": z.conj(),
        "neg": torch._neg_view(torch.randn(4)),
        "strided": torch.randn(6, 4).t(),
        "scalar": torch.tensor(2.5),
        "bool": torch.tensor([True, False, True]),
        "big": torch.randn(1 << 17),
        "after": torch.arange(10, dtype=torch.int16),
        "offset": torch.arange(40.0)[17:23],
        "int8_view": torch.arange(250, 256, dtype=torch.uint8).view(torch.int8),
    }
    path = str(tmp_path / "c")
    aiosnap.save_sync(path, state)
    loaded = aiosnap.load_sync(path)
    assert all(torch.equal(a, b) for a, b in zip(loaded["many"], state["many"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(loaded["wide"], state["wide"], strict=True))
    assert torch.equal(loaded["param"], param.detach())
    assert torch.equal(loaded["conj"], z.conj().resolve_conj())
    assert torch.equal(loaded["neg"], state["neg"].resolve_neg())
    for key in ("bf16", "strided", "scalar", "bool", "big", "after", "offset", "int8_view"):
        assert torch.equal(loaded[key], state[key]), key


def test_tied_tensors_are_stored_once_and_load_tied(tmp_path: Path) -> None:
    shared = torch.randn(100, 100)
    path = str(tmp_path / "c")
    aiosnap.save_sync(path, {"embed": shared, "head": shared})
    loaded = aiosnap.load_sync(path)
    assert loaded["embed"] is loaded["head"]
    assert (tmp_path / "c").stat().st_size < 2 * shared.numel() * 4


def test_keys_prune_the_tree(tmp_path: Path) -> None:
    model = {"layer1.weight": torch.ones(2), "layer1.bias": torch.zeros(2), "layer2.w": torch.ones(1)}
    state = {"model": model, "optimizer": {"state": {0: {"m": torch.ones(1)}}}, "lst": [1, torch.ones(1), 3]}
    path = str(tmp_path / "c")
    aiosnap.save_sync(path, state)
    got = aiosnap.load_sync(path, keys=["model.layer1", "optimizer.state.0", "lst.1"])
    assert set(got) == {"model", "optimizer", "lst"}
    assert set(got["model"]) == {"layer1.weight", "layer1.bias"}
    assert torch.equal(got["optimizer"]["state"][0]["m"], torch.ones(1))
    assert got["lst"][0] is None and torch.equal(got["lst"][1], torch.ones(1))
    with pytest.raises(aiosnap.errors.CheckpointKeyError, match="nope"):
        aiosnap.load_sync(path, keys=["nope"])


def test_map_location(tmp_path: Path) -> None:
    aiosnap.save_sync(str(tmp_path / "c"), {"t": torch.ones(2)})
    assert aiosnap.load_sync(str(tmp_path / "c"), map_location="cpu")["t"].device.type == "cpu"
    meta = aiosnap.load_sync(str(tmp_path / "c"), map_location="meta")
    assert meta["t"].device.type == "meta"


# -- bad input -------------------------------------------------------------------------------------


@pytest.fixture
def good_file(tmp_path: Path) -> Path:
    path = tmp_path / "good"
    aiosnap.save_sync(str(path), {"a": torch.arange(100.0), "b": {"c": np.arange(10)}, "n": 3})
    return path


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n])


def _rewrite_header(path: Path, edit: Any) -> None:
    data = path.read_bytes()
    n, header = _header(path)
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    text += b" " * (n - len(text))
    path.write_bytes(data[:8] + text + data[8 + n :])


def _corrupt(path: Path, match: str) -> None:
    for call in (aiosnap.load_sync, aiosnap.verify_sync):
        with pytest.raises(aiosnap.errors.CorruptCheckpointError, match=match) as info:
            call(str(path))
        assert info.value.path == str(path)


def test_every_flipped_bit_is_detected(good_file: Path) -> None:
    data = bytearray(good_file.read_bytes())
    rng = np.random.default_rng(0)
    positions = sorted({*range(0, 16), *rng.integers(0, len(data), 300).tolist(), len(data) - 1})
    for pos in positions:
        flipped = bytearray(data)
        flipped[pos] ^= 1 << int(rng.integers(0, 8))
        good_file.write_bytes(flipped)
        with pytest.raises(aiosnap.errors.CorruptCheckpointError):
            aiosnap.verify_sync(str(good_file))
        with pytest.raises(aiosnap.errors.CorruptCheckpointError):
            aiosnap.load_sync(str(good_file))


@pytest.mark.parametrize("cut", [0, 3, 8, 100, -1, -400])
def test_truncated_file(good_file: Path, cut: int) -> None:
    data = good_file.read_bytes()
    good_file.write_bytes(data[:cut])
    _corrupt(good_file, "truncated|does not fit|not valid JSON")


def test_trailing_bytes(good_file: Path) -> None:
    good_file.write_bytes(good_file.read_bytes() + b"x")
    _corrupt(good_file, "unexpected bytes")


def test_header_length_that_lies(good_file: Path) -> None:
    data = bytearray(good_file.read_bytes())
    data[:8] = struct.pack("<Q", 2**62)
    good_file.write_bytes(data)
    _corrupt(good_file, "header length")


def test_sizes_larger_than_the_file(tmp_path: Path) -> None:
    path = tmp_path / "big.safetensors"
    header = json.dumps({"x": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    _corrupt(path, "truncated")


def test_overlapping_offsets(tmp_path: Path) -> None:
    save_file({"a": torch.ones(4), "b": torch.ones(4)}, str(tmp_path / "f"))
    _rewrite_header(tmp_path / "f", lambda h: h["b"].update(data_offsets=[8, 24]))
    _corrupt(tmp_path / "f", "overlaps|gap|do not match")
    save_file({"a": torch.ones(4), "b": torch.ones(4)}, str(tmp_path / "g"))
    _rewrite_header(
        tmp_path / "g", lambda h: (h["a"].update(data_offsets=[0, 16]), h["b"].update(data_offsets=[0, 16]))
    )
    _corrupt(tmp_path / "g", "overlaps|unexpected bytes")


def test_unknown_dtype(tmp_path: Path) -> None:
    save_file({"a": torch.ones(4)}, str(tmp_path / "f"))
    _rewrite_header(tmp_path / "f", lambda h: h["a"].update(dtype="F128"))
    _corrupt(tmp_path / "f", "unknown dtype")


def test_hostile_aiosnap_metadata_is_caught_by_the_header_checksum(good_file: Path) -> None:
    def edit(h: dict[str, Any]) -> None:
        meta = json.loads(h["__metadata__"]["aiosnap"])
        meta["tensors"]["a"]["dtype"] = "object"
        h["__metadata__"]["aiosnap"] = json.dumps(meta)

    _rewrite_header(good_file, edit)
    _corrupt(good_file, "header checksum")


def test_not_json_and_deep_nesting(tmp_path: Path) -> None:
    for name, body in [
        ("nonutf8", b"\xff\xfe{}"),
        ("nested", b"[" * 100000 + b"]" * 100000),
        ("list", b"[]"),
    ]:
        path = tmp_path / name
        path.write_bytes(struct.pack("<Q", len(body)) + body)
        _corrupt(path, "JSON")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(aiosnap.errors.CheckpointNotFoundError):
        aiosnap.load_sync(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError):
        aiosnap.load_sync(str(tmp_path / "nope"))
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="directory"):
        aiosnap.load_sync(str(tmp_path))


def test_pickle_in_a_file_never_runs_without_opt_in(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self) -> Any:
            return (Path(tmp_path / "pwned").write_text, ("x",))

    path = str(tmp_path / "c")
    aiosnap.save_sync(path, {"evil": Evil()}, allow_pickle=True)
    with pytest.raises(aiosnap.errors.PickleNotAllowedError):
        aiosnap.load_sync(path)
    aiosnap.verify_sync(path)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no tmpfs at /dev/shm")
def test_o_direct_falls_back_to_buffered_writes_on_tmpfs() -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:  # tmpfs refuses O_DIRECT
        path = os.path.join(directory, "c")
        state = {"w": torch.randn(1000, 3), "n": 1}
        aiosnap.save_sync(path, state)
        assert torch.equal(aiosnap.load_sync(path)["w"], state["w"])
        assert os.path.getsize(path) == aiosnap.verify_sync(path).bytes + 4096


def _rewrite_sealed(path: Path, edit_meta: Any, *, grow: bool = False) -> int:
    """Edit the aiosnap metadata and seal the header again with a valid checksum: what a
    hostile writer can do, so only the reader's own checks stand in its way. With
    ``grow``, the header may get longer (the data section's offsets are relative to it).
    The header's new length."""
    data = path.read_bytes()
    n, header = _header(path)
    meta = json.loads(header["__metadata__"]["aiosnap"])
    edit_meta(meta)
    header["__metadata__"]["aiosnap"] = json.dumps(meta)
    header["__metadata__"]["aiosnap_crc32c"] = "00000000"
    text = json.dumps(header, separators=(",", ":")).encode()
    size = len(text) if grow else n
    assert len(text) <= size
    raw = struct.pack("<Q", size) + text + b" " * (size - len(text))
    sealed = raw.replace(b'"00000000"', f'"{crc32c(raw):08x}"'.encode())
    path.write_bytes(sealed + data[8 + n :])
    return size


@pytest.mark.parametrize(
    ("external", "match"),
    [
        ([], "external entries are malformed"),
        ({"a": {"kind": "tensor", "dtype": "float32", "shape": [100]}}, "both stored and external"),
        ({"x": {"kind": "pickle", "dtype": "|u1", "shape": [3]}}, "malformed description"),
        ({"x": {"kind": "tensor", "dtype": "float99", "shape": [3]}}, "bad dtype or shape"),
        ({"x": {"kind": "tensor", "dtype": "float32", "shape": [-1]}}, "bad dtype or shape"),
        ({"x": "tensor"}, "malformed description"),
    ],
)
def test_hostile_external_entries(good_file: Path, external: Any, match: str) -> None:
    _rewrite_sealed(good_file, lambda meta: meta.update(external=external))
    _corrupt(good_file, match)


def test_a_sealed_header_passes_unchanged(good_file: Path) -> None:
    _rewrite_sealed(good_file, lambda meta: None)  # the helper itself is sound
    assert aiosnap.verify_sync(str(good_file)).tensors == 2


def _reseal(path: Path, edit_text: Any, seal: bytes = b'"aiosnap_crc32c":"', occurrence: int = 0) -> None:
    """Edit the header's text as bytes, then write a checksum computed as the format
    computes it, at the given occurrence of ``seal``."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    text = edit_text(data[8 : 8 + n].rstrip(b" "))
    assert len(text) <= n
    raw = bytearray(data[:8] + text + b" " * (n - len(text)))
    at = -1
    for _ in range(occurrence + 1):
        at = raw.find(seal, at + 1)
    assert at >= 0
    at += len(seal)
    raw[at : at + 8] = b"00000000"
    raw[at : at + 8] = f"{crc32c(raw):08x}".encode()
    path.write_bytes(bytes(raw) + data[8 + n :])


def test_the_header_checksum_is_read_where_the_format_puts_it(good_file: Path) -> None:
    key = b'"aiosnap_crc32c":'
    _reseal(good_file, lambda t: t)  # the writer's own seal, done again
    assert aiosnap.verify_sync(str(good_file)).tensors == 2
    # Valid JSON holding the right checksum, but not in the compact form the writer
    # writes, or not once: refused before any of the document is trusted.
    _reseal(good_file, lambda t: t.replace(key, key + b" "), seal=key + b' "')
    _corrupt(good_file, "not where the format puts it")
    _reseal(good_file, lambda t: t.replace(key + b' "', key + b'"'))  # back to the compact form
    assert aiosnap.verify_sync(str(good_file)).tensors == 2
    _reseal(good_file, lambda t: t.replace(key, key + b'"00000000",' + key), occurrence=1)
    _corrupt(good_file, "not where the format puts it")  # JSON keeps the second: it passed before


def test_an_altered_or_unsealed_header_is_refused(good_file: Path) -> None:
    original = good_file.read_bytes()
    data = bytearray(original)
    at = data.find(b'"a":{')
    data[at + 1 : at + 2] = b"z"  # an entry renamed: still valid JSON
    good_file.write_bytes(data)
    _corrupt(good_file, "header checksum mismatch")
    good_file.write_bytes(original.replace(b'"aiosnap_crc32c":"', b'"aiosnap_crc32d":"'))
    _corrupt(good_file, "header checksum is missing")


def _padded(path: Path, chars: int) -> int:
    """Put a long string, escaped twice over in the header, into the aiosnap document,
    with a format version the reader refuses once it has parsed it all; the header size."""

    def edit(meta: dict[str, Any]) -> None:
        meta["padding"] = 'a"b\\' * (chars // 4)
        meta["version"] = 99

    return _rewrite_sealed(path, edit, grow=True)


def test_a_large_header_is_parsed_holding_few_copies_of_it(good_file: Path) -> None:
    """The raw bytes, their text, the aiosnap document and the strings in it are never
    all alive at once: a hostile 1 GiB header must not take 4-5 GiB to be refused."""
    import tracemalloc

    size = _padded(good_file, 4 << 20)
    assert size > 8 << 20  # the 4M characters, escaped twice
    tracemalloc.start()
    try:
        _corrupt(good_file, "format version 99")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 2.2x here: the text, then the document's string with its decoded pieces. The raw
    # bytes kept beside them and every string joined from pieces made it 5.2x.
    assert peak < 3 * size, (peak / size, size)


async def test_a_failed_load_keeps_nothing_of_its_file_alive(good_file: Path) -> None:
    """An idle worker thread holds its last job's exception; the frames of that
    exception's traceback must not hold the parsed header (tens of MB per thread)."""
    import gc
    import tracemalloc

    size = _padded(good_file, 4 << 20)
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for call in (aiosnap.load, aiosnap.verify):
            with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="format version 99") as info:
                await call(str(good_file))
            del info
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < size // 4, (after - before, size)


def test_files_as_aiosnap_writes_them_are_read_without_parsing_their_entries(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        odd = {
            "c32": torch.zeros(2, dtype=torch.complex32),
            "u16": torch.tensor([1, 2, 65535], dtype=torch.uint16),
        }
    states: dict[str, Any] = {
        "empty": {},
        "tensors": {f"t{i}": torch.randn(i % 5, 2) for i in range(50)},
        "every kind": {
            'na"me\\ü\U0001f600': torch.arange(3),
            "x" * 70_000: torch.ones(1),
            "np": np.arange(6, dtype=">i4").reshape(2, 3),
            "npscalar": np.float32(1.5),
            "u8": torch.arange(4, dtype=torch.uint8),
            "bits": torch.zeros(2, dtype=torch.uint8).view(torch.bits8),
            "pickled": {1, 2},
            "zero-d": torch.tensor(2.0),
            **odd,
        },
    }
    for label, state in states.items():
        path = tmp_path / label.replace(" ", "_")
        aiosnap.save_sync(str(path), state, allow_pickle=True)
        fast, general, took = headers_both_ways(path)
        assert took, label
        assert fast == general, label


@pytest.mark.parametrize("spelled", [[2.0], [True, 2], ["2"], [[2]], [-2]])
def test_a_shape_seen_before_vouches_only_for_the_same_spelling(tmp_path: Path, spelled: list[Any]) -> None:
    # The shortcut checks each (dtype, shape) once and finds it again by the shape's
    # repr: a later description whose shape is no list of ints (its safetensors entry
    # left as written) must not pass for the checked one.
    path = tmp_path / "f"
    aiosnap.save_sync(str(path), {"a": torch.ones(2), "b": torch.ones(2), "c": torch.ones(2)})
    parts = hostile.parse(path.read_bytes())
    parts.meta["tensors"]["b"]["shape"] = spelled
    path.write_bytes(hostile.render(parts))
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="'b'"):
        aiosnap.load_sync(str(path))


_T = '"kind":"tensor","dtype":"float32","shape":[2,3],"crc32c":"0123abcd"'
_OPEN = '{"version":1,"checksum":"crc32c","tensors":{'
_UNCOMMON = '"u":{"kind":"x","a":{"b":"c"},"d":1}'


@pytest.mark.parametrize(
    "text",
    [
        _OPEN + '},"tree":null}',
        _OPEN + '"a":{' + _T + '},"b":{' + _T + '}},"tree":{"$":"dict","items":[]}}',
        _OPEN + '"a\\u00e9":{' + _T + '},"n":{"kind":"ndarray","dtype":"<f4","shape":[1],'
        '"crc32c":"00000000"}},"tree":[1,2],"external":{"x":{"kind":"tensor","dtype":"float32","shape":[]}}}',
        _OPEN + '"a":{' + _T.replace("[2,3]", "[]") + '},"b":{' + _T.replace("2,3", "0,1") + '}},"tree":1}',
        _OPEN + '"a":{' + _T.replace("[2,3]", "[01]") + '}},"tree":1}',  # not JSON
        _OPEN + '"a":{' + _T.replace("[2,3]", "[2, 3]") + '}},"tree":1}',
        _OPEN + '"a":{' + _T.replace("[2,3]", "[" + "9" * 30 + "]") + '}},"tree":1}',
        _OPEN + '"a":{' + _T.replace("0123abcd", "0123ABCD") + '}},"tree":1}',
        _OPEN + '"a":{' + _T + ',"shard":{}}},"tree":1}',
        _OPEN + '"a":{' + _T + '},"a":{' + _T.replace("[2,3]", "[1]") + '}},"tree":1}',  # a name twice
        _OPEN + '"a":{' + _T + '},},"tree":1}',  # a trailing comma
        _OPEN + '"a":{' + _T + '} },"tree":1}',
        _OPEN + '"a":{' + _T + '}},"tree":1,"tree":2}',
        _OPEN + '"a":{' + _T + '}},"tree":1} ',
        _OPEN + '"a":{' + _T + '}},"tree":1,"external":{},"x":1}',
        _OPEN + "1:{" + _T + '}},"tree":1}',
        '{"version":1, "checksum":"crc32c","tensors":{},"tree":1}',
        # A ,"tree": inside a description, and one not common between common ones:
        _OPEN + '"a":{' + _T + '},"n":{"kind":"x","tree":{"b":{' + _T + '}}},"c":{' + _T + '}},"tree":1}',
        _OPEN + '"a":{' + _T + '},"n":{"kind":"x"},"c":{' + _T + '}},"tree":1}',
        _OPEN + '"a":{' + _T + '}, "c":{' + _T + '}},"tree":1}',  # a space between common ones
        _OPEN + '"a":{' + _T + '},"c":{' + _T + '},"tree":1}',  # the tensors never closed
        # Longer than a window of _all_common's, all common; then with an uncommon one
        # (holding what a window's cut looks for) in the second window.
        _OPEN + ",".join(f'"t{i}":{{{_T}}}' for i in range(2000)) + '},"tree":1}',
        _OPEN + ",".join(f'"t{i}":{{{_T}}}' if i != 1500 else _UNCOMMON for i in range(2000)) + '},"tree":1}',
    ],
)
def test_the_document_shortcut_reads_what_json_reads_or_nothing(text: str) -> None:
    from aiosnap._format.codec import _document, _ints_of

    try:
        want = json.loads(text)
    except ValueError:
        want = None
    try:
        got = _document(text)
    except ValueError:
        got = None
        assert want is None
    if got is None:
        return
    for name, d in got["tensors"].items():
        if type(d) is tuple:
            got["tensors"][name] = {"kind": "tensor", "dtype": d[1], "shape": _ints_of(d[2]), "crc32c": d[3]}
    assert got == want
    assert list(got["tensors"]) == list(want["tensors"])


def test_a_document_of_common_descriptions_is_matched_in_windows() -> None:
    from aiosnap._format.codec import _WINDOW, _all_common

    names = [f"t{i}" for i in range(3 * _WINDOW // len(_T))]
    text = _OPEN + ",".join(f'"{n}":{{{_T}}}' for n in names) + '},"tree":1}'
    found = _all_common(text, len(_OPEN))
    assert found is not None and list(found[0]) == names and text[found[1] :] == ',"tree":1}'
    twice = text.replace('"t7":', '"t6":')
    assert _all_common(twice, len(_OPEN)) is None


def test_a_header_written_otherwise_is_read_by_the_general_parse(good_file: Path) -> None:
    want = aiosnap.load_sync(str(good_file))
    data = good_file.read_bytes()
    n, header = _header(good_file)
    header = {k: header[k] for k in sorted(header, reverse=True)}  # entries first, reordered
    header["__metadata__"]["aiosnap_crc32c"] = "00000000"
    text = json.dumps(header, indent=1, separators=(",", ":")).encode()
    assert len(text) <= n
    raw = data[:8] + text + b" " * (n - len(text))
    good_file.write_bytes(raw.replace(b'"00000000"', f'"{crc32c(raw):08x}"'.encode()) + data[8 + n :])
    fast, general, took = headers_both_ways(good_file)
    assert not took and fast == general
    assert_tree_equal(aiosnap.load_sync(str(good_file)), want)


def test_a_load_whose_read_buffer_is_still_viewed_elsewhere_goes_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A view of the header's buffer that outlives the read (a stack sampler holding the
    reader's frame: ``benchmarks/loop_stalls.py``'s watchdog did) made the header's
    decode fail with BufferError, when it freed the raw bytes: the load must not care."""
    from aiosnap._storage.local import _LocalReader

    path = str(tmp_path / "ckpt")
    aiosnap.save_sync(path, {"w": torch.arange(8.0)})
    kept: list[memoryview] = []
    reading = _LocalReader.readinto

    def holding(self: _LocalReader, offset: int, buf: memoryview) -> None:
        reading(self, offset, buf)
        kept.append(buf[:1])  # what a held frame keeps: a view of the buffer read into

    monkeypatch.setattr(_LocalReader, "readinto", holding)
    assert torch.equal(aiosnap.load_sync(path)["w"], torch.arange(8.0))
    assert kept
