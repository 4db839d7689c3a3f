"""Copies of a save's leaves into its arena: host tensors, arrays and pickles by memcpy,
device tensors through a ``DeviceCopier``. Everything here blocks: it runs in the staging
thread (or, for a lazy capture's copy-on-write, on the thread about to write a tensor)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .._base import offload as _offload
from .._format import dtypes as _dtypes
from .._format.codec import TensorInfo
from .._format.dtypes import as_copyable
from .._format.header import ALIGN
from .._format.plans import Plan
from .._format.tree import Leaf
from .arena import Arena
from .device import DeviceCopier, host_view

#: Leaves under this size are "small": copied by one memmove each (and, in a lazy
#: capture, before its call returns).
SMALL = 256 << 10
#: A copy of at least this many bytes is split in two, its second half copied by a
#: helper thread (``split_copy``).
SPLIT_MIN = 4 << 20
_memmove = ctypes.memmove


class SmallCopy:
    """Small contiguous host tensors, each copied into the arena by one ``memmove``
    from its data pointer: per tensor, a NumPy view costs ~1.5 us more, and a torch
    ``copy_`` into an arena slice ~20. Each call releases the GIL."""

    def __init__(self, arena: Arena, data_start: int) -> None:
        self.base = arena.array.ctypes.data + data_start

    def add(self, leaf: Leaf, info: TensorInfo) -> bool:
        """Copy ``leaf`` if it is a small tensor whose bytes lie contiguous in host
        memory, as they go to the file; False if it needs the general copy."""
        t, n = leaf.value, info.end - info.start
        if leaf.kind != "tensor" or not 0 < n < SMALL:
            return False
        # is_cpu, not device.type: 0.04 us against 0.25, per tensor.
        if not t.is_cpu or not t.is_contiguous() or t.is_conj() or t.is_neg():
            return False
        if t.nbytes != n:  # resized since the plan: the general copy fails
            return False
        _memmove(self.base + info.start, t.data_ptr(), n)
        return True


def split_copy(
    dst: np.ndarray[Any, np.dtype[np.uint8]], src: np.ndarray[Any, np.dtype[np.uint8]], side: _offload.Side
) -> None:
    """``np.copyto(dst, src)`` of flat bytes, the second half on the helper thread.

    On some machines one memcpy is bound by its core, not by memory: on the 2-core Xeon
    of the benchmarks, 16 MiB pieces copy at 6.4 GB/s on one thread and 11 on two, which
    DCP's stager (torch's copy_ on the intra-op threads) gets too. Where memory is the
    bound, the split costs one thread hop per copy of MiBs. Returns once both halves are
    copied, whatever failed."""
    if dst.nbytes < SPLIT_MIN:
        np.copyto(dst, src)
        return
    half = dst.nbytes // 2 // ALIGN * ALIGN
    side.submit(np.copyto, dst[half:], src[half:])
    try:
        np.copyto(dst[:half], src[:half])
    finally:
        side.wait()


def copy_leaf(leaf: Leaf, arena: Arena, start: int, nbytes: int, side: _offload.Side) -> None:
    if nbytes == 0:
        return
    value = leaf.value
    dst = arena.array[start : start + nbytes]
    if leaf.kind == "pickle":
        dst[:] = np.frombuffer(value, dtype=np.uint8)
    elif leaf.kind == "tensor":
        _copy_tensor(value, dst, arena, start, side)
    else:
        file_dtype = _dtypes.numpy_file_dtype(value.dtype)
        assert file_dtype is not None
        np.copyto(dst.view(file_dtype).reshape(value.shape), value)


def _copy_tensor(
    t: torch.Tensor, dst: np.ndarray[Any, np.dtype[np.uint8]], arena: Arena, start: int, side: _offload.Side
) -> None:
    src = t.detach() if t.requires_grad else t
    if src.device.type != "cpu":
        src = src.to("cpu")
    if src.is_conj() or src.is_neg():
        src = src.resolve_conj().resolve_neg()
    if src.is_contiguous():
        flat = src.reshape(-1).view(torch.uint8)
        if dst.size < SMALL:
            # Small tensors: fewest Python-level steps (per-tensor overhead dominates).
            arena.tensor[start : start + dst.size].copy_(flat)
        else:
            # Large tensors: NumPy's memcpy beats Tensor.copy_ by ~2x here (see BRIEF).
            split_copy(dst, flat.numpy(), side)
    else:
        # Copy as same-width integers: copy_ has no kernel for dtypes such as int1 or uint3.
        out, src = host_view(torch.from_numpy(dst), src)
        out.copy_(src)


def memmove_small(leaf: Leaf, buffer: Arena, at: int, nbytes: int) -> bool:
    """Copy a small contiguous host tensor into ``buffer`` by one ``memmove`` (see
    ``SmallCopy``); False if it needs the general copy."""
    t = leaf.value
    if leaf.kind != "tensor" or not 0 < nbytes < SMALL or t.nbytes != nbytes:
        return False
    if not t.is_cpu or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return False
    _memmove(buffer.array.ctypes.data + at, t.data_ptr(), nbytes)
    return True


def flat_view(leaf: Leaf) -> np.ndarray[Any, np.dtype[np.uint8]] | None:
    """A CPU tensor's bytes as a flat array, if that needs no copy; else None."""
    t = leaf.value
    if leaf.kind != "tensor" or t.device.type != "cpu" or t.is_conj() or t.is_neg() or not t.is_contiguous():
        return None
    flat: np.ndarray[Any, np.dtype[np.uint8]] = t.detach().reshape(-1).view(torch.uint8).numpy()
    return flat


def flat_bytes(leaf: Leaf) -> np.ndarray[Any, np.dtype[np.uint8]]:
    value = leaf.value
    if leaf.kind == "pickle":
        return np.frombuffer(value, dtype=np.uint8)
    if leaf.kind == "tensor":
        t = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
        raw: np.ndarray[Any, np.dtype[np.uint8]] = as_copyable(t).reshape(-1).view(torch.uint8).numpy()
        return raw
    file_dtype = _dtypes.numpy_file_dtype(value.dtype)
    flat: np.ndarray[Any, np.dtype[np.uint8]] = np.ascontiguousarray(value, dtype=file_dtype).reshape(-1)
    return flat.view(np.uint8)


def start_device_copies(
    layout: Plan,
    todo: Sequence[int],
    arena: Arena,
    copier: DeviceCopier | None,
    producers: Any,
) -> dict[int, object]:
    """Start the copy of every device leaf of ``todo``; the token of each, by leaf index."""
    if copier is None:
        return {}
    started: dict[int, object] = {}
    leaves, infos, data_start = layout.leaves, layout.tensors, layout.data_start
    for i in todo:
        leaf, info = leaves[i], infos[i]
        if leaf.kind == "tensor" and info.nbytes and copier.is_device(leaf.value):
            at = data_start + info.start
            started[i] = start_copy(copier, arena, leaf, at, info.nbytes, producers, not started)
    return started


def start_copy(
    copier: DeviceCopier, arena: Arena, leaf: Leaf, start: int, nbytes: int, producers: Any, first: bool
) -> object:
    """Start the copy of a device leaf to ``arena[start:start + nbytes]``; the ``first``
    of a save pins the arena (a copier pins an arena only once)."""
    if first:
        copier.pin(arena.array)
    dst, src = host_view(arena.tensor[start : start + nbytes], leaf.value.detach())
    return copier.start(src, dst, producers)
