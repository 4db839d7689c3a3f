"""Entries under 64 KiB are loaded as views of one buffer per run of neighbours.

Each must still behave as a tensor or array of its own: its values and dtype, a
storage of exactly its bytes, its elements aligned, its writes its own; and the buffer
must outlive the container it was returned in for as long as one of its views lives.
"""

from __future__ import annotations

import gc
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aiosnap
from aiosnap._format.codec import TensorInfo
from aiosnap._load.readers import _in_buffer

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def _state() -> dict[str, Any]:
    """Small entries of every kind, many at offsets that are not multiples of 64 (the
    three bools put every entry after them off any alignment), and one large one."""
    g = torch.Generator().manual_seed(0)
    return {
        "flags": torch.tensor([True, False, True]),
        "odd_f32": torch.randn(5, generator=g),  # at offset 3: must be copied, not viewed
        "pad": torch.zeros(1, dtype=torch.uint8),
        "f32": torch.randn(3, 7, generator=g),
        "bf16": torch.randn(6, generator=g).to(torch.bfloat16),
        "f8": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
        "c128": torch.randn(2, 2, dtype=torch.complex128, generator=g),
        "c32": torch.randn(4, generator=g).to(torch.complex32),
        "scalar": torch.tensor(7, dtype=torch.int16),
        "u16": torch.arange(5).to(torch.uint16),
        "empty": torch.empty(0, 3),
        "big_endian": np.arange(6, dtype=">f4").reshape(2, 3),
        "np_bool": np.array([True, False]),
        "np_scalar": np.float64(2.5),
        "pickled": {"a", "set"},
        "tail": [torch.full((1024,), float(i)) for i in range(40)],
        "large": torch.randn(64, 1024, generator=g),  # 256 KiB: its own allocation
    }


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""


def _leaves(tree: Any, path: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{path}.{key}").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in _leaves(sub, f"{path}.{i}").items()}
    return {path: tree}


async def test_small_entries_load_as_views_that_behave_as_their_own(tmp_path: Path) -> None:
    state = _state()
    async with aiosnap.QueueWriter(allow_pickle=True) as writer:
        await (await writer("ckpt", str(tmp_path), state)).wait()
    loaded = await aiosnap.load(str(tmp_path / "ckpt"), allow_pickle=True)

    want, got = _leaves(state), _leaves(loaded)
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            t = got[key]
            assert type(t) is torch.Tensor and t.dtype == value.dtype and t.shape == value.shape, key
            assert _bytes(t) == _bytes(value), key
            assert t.untyped_storage().nbytes() == t.nbytes, key  # a storage of its own bytes
            assert t.data_ptr() % t.element_size() == 0, key
            assert t.is_contiguous(), key
        elif isinstance(value, np.ndarray):
            a = got[key]
            assert a.dtype == value.dtype and np.array_equal(a, value) and a.flags.aligned, key
            assert a.flags.writeable, key
        else:
            assert got[key] == value, key

    # Neighbours share a buffer, but no bytes: a write to one is the only change.
    tail = loaded["tail"]
    assert tail[1].data_ptr() - tail[0].data_ptr() == 4096
    tail[3].add_(100)
    for i, t in enumerate(tail):
        assert torch.equal(t, torch.full((1024,), float(i) + (100 if i == 3 else 0)))

    # torch.save of a view writes its bytes, not its buffer's.
    out = io.BytesIO()
    torch.save(tail[5], out)
    assert len(out.getvalue()) < 4096 + 2048

    # The buffer lives while a view does.
    keep, keep_arr = loaded["tail"][7], loaded["big_endian"]
    del loaded, tail, got
    gc.collect()
    junk = [torch.full((1024,), -1.0) for _ in range(200)]  # reuse whatever was freed
    assert torch.equal(keep, torch.full((1024,), 7.0))
    assert np.array_equal(keep_arr, state["big_endian"])
    del junk


async def test_load_into_fills_targets_and_views_the_entries_it_has_no_place_for(tmp_path: Path) -> None:
    state = _state()
    async with aiosnap.QueueWriter(allow_pickle=True) as writer:
        await (await writer("ckpt", str(tmp_path), state)).wait()
    target = {"f32": torch.zeros(3, 7), "tail": [torch.zeros(1024) for _ in range(40)]}
    before = [t.data_ptr() for t in target["tail"]]
    await aiosnap.load_into(str(tmp_path / "ckpt"), target, strict=False, allow_pickle=True)
    assert [t.data_ptr() for t in target["tail"]] == before  # in place
    assert torch.equal(target["f32"], state["f32"])
    assert all(torch.equal(t, torch.full((1024,), float(i))) for i, t in enumerate(target["tail"]))


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.bfloat16, torch.complex32, torch.uint8])
def test_an_entry_off_its_alignment_is_copied_into_memory_of_its_own(dtype: torch.dtype) -> None:
    raw = np.arange(256, dtype=np.uint8)
    shape = (3,)
    nbytes = 3 * dtype.itemsize
    name = str(dtype).removeprefix("torch.")
    for at in range(0, 32):
        info = TensorInfo("x", "tensor", name, shape, 1000 + at, 1000 + at + nbytes, None)
        made, dest = _in_buffer(info, raw, at)
        assert dest is None
        assert made.dtype == dtype and tuple(made.shape) == shape
        assert bytes(made.view(torch.uint8).numpy()) == bytes(raw[at : at + nbytes])
        assert made.data_ptr() % dtype.itemsize == 0
        viewed = made.data_ptr() == raw.ctypes.data + at
        assert viewed == (at % dtype.itemsize == 0), at
