"""Stage: copy a captured snapshot into an arena laid out as the file image.

The arena holds the header and the data section exactly as they go to disk, so the
commit is a single write of one buffer. Arenas come from a pool owned by the writer
and are reused across saves; with process offload they live in shared memory, so
the worker process reads the bytes without any pipe or pickle.

Everything here blocks: it runs in a worker thread through ``_offload``.
"""

from __future__ import annotations

import array
import ctypes
import itertools
import json
import operator
import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._base import offload as _offload
from .._base.errors import SaveCancelledError
from .._format import dtypes as _dtypes
from .._format.codec import TensorInfo
from .._format.header import ALIGN, EntryCrc, HeaderTemplate, seal
from .._format.plans import Plan, PlanCache, plan
from .._format.tree import Leaf, capture
from .._storage.protocol import Upload
from .arena import Arena, ArenaPool
from .device import DeviceCopier, as_copyable, host_view
from .guard import Guard
from .pipeline import PIECE, Pipe

_SMALL = 256 << 10
#: A huge leaf is copied in chunks of this size when its commit is pipelined (glibc's
#: memcpy slows down on pieces much below 64 MiB, see the BRIEF).
_CHUNK = 64 << 20
#: A copy of at least this many bytes is split in two, its second half copied by a
#: helper thread (``_split_copy``).
_SPLIT_MIN = 4 << 20
#: Why a capture stopped: its caller stopped waiting for it (``request.stop()``).
GAVE_UP = "the save was cancelled: its caller gave it up during its capture"


@dataclass(slots=True)
class StagedImage:
    """A file image in an arena: bytes [0, size) of the arena are the whole file."""

    arena: Arena
    size: int
    template: HeaderTemplate
    #: Where each entry lies in the data section, flat (start, end, start, end, ...):
    #: one object instead of thousands for the garbage collector to walk.
    spans: array.array[int]
    stage_s: float = 0.0
    #: The header is in the arena already (a lazy capture's pipelined commit).
    sealed: bool = False
    #: The entries and the skeleton's JSON, kept only where a ``savefun`` rebuilds the
    #: state from them.
    tensors: list[TensorInfo] | None = None
    tree: str | None = None

    @property
    def data_start(self) -> int:
        return self.template.size

    def image(self) -> memoryview:
        return self.arena.view(0, self.size)

    def aligned_image(self) -> memoryview:
        """The image extended to a multiple of ALIGN (arenas are always large enough)."""
        return self.arena.view(0, -(-self.size // ALIGN) * ALIGN)


@dataclass(frozen=True, slots=True)
class Lazy:
    """A lazy capture's hand-offs, for the staging thread. ``walked(optimizers)`` is
    called on the event loop (which is free then: the caller waits for it) once the tree
    is walked, the small leaves copied and the arena taken; the caller then returns, and
    the rest is copied with no help from the loop. ``guard`` holds the optimizers' steps
    until the copies are done."""

    walked: Callable[[list[Any]], None]
    guard: Guard


def _never() -> bool:
    return False


@dataclass(frozen=True, slots=True)
class StageRequest:
    """How one save is captured and staged (``stage_or_plan``).

    ``allow_pickle``: store values that are not state types pickled. ``pool``: where the
    arena comes from. ``copier`` and ``producers``: device copies, after the work queued
    before the call (see ``_device``). ``keep_tree``: keep the entries and the skeleton
    for a ``savefun`` to rebuild the state from. ``begin``: offered the arena before the
    first copy, to start a pipelined commit (see ``stage``). ``plans``: the writer's last
    layout, reused while the state keeps its structure. ``stop``: asked between large
    copies; true once the caller gave the save up. ``lazy``: capture lazily (``Lazy``).
    """

    allow_pickle: bool
    pool: ArenaPool
    copier: DeviceCopier | None = None
    producers: Any = None
    keep_tree: bool = False
    begin: Callable[[Pipe], bool] | None = None
    plans: PlanCache | None = None
    stop: Callable[[], bool] = _never
    lazy: Lazy | None = None


def stage(layout: Plan, request: StageRequest, optimizers: Sequence[Any] = ()) -> StagedImage:
    """Copy the planned leaves into an arena: the capture, all an eager caller waits for.

    Device tensors (with a ``copier``) are copied first and asynchronously; host
    tensors are staged while those copies run; the capture ends at
    ``copier.finish()``. Checksums and the header come later (``_header.seal``), off
    the caller's path. With ``begin``, the arena is offered to a commit before the
    first copy (``_pipeline``); if ``begin`` takes it, the copies raise the pipe's
    watermark as they go, and the arena belongs to that commit, even if staging fails.

    A lazy request copies the small host leaves first (a BatchNorm's running
    statistics, which the next forward changes in place), hands the caller back through
    ``lazy.walked(optimizers)``, then copies the rest; and seals a pipelined commit
    itself. Its guard is released however this ends.
    """
    t0 = time.perf_counter()
    lazy = request.lazy
    pipe: Pipe | None = None
    try:
        arena = request.pool.acquire(layout.size)
        try:
            if request.begin is not None:
                offer = Pipe(arena, layout.size, layout.data_start)
                pipe = offer if request.begin(offer) else None
            todo: Sequence[int] = range(len(layout.leaves))
            started: dict[int, object] = {}
            if lazy is not None:
                todo, started = _copy_small(layout, arena, request.copier, request.producers)
                if pipe is not None:
                    pipe.wait_started()  # started by the loop, which the caller may hold next
                lazy.walked(list(optimizers))
            _fill(layout, arena, request, pipe, todo, started)
        except BaseException:
            if pipe is None:
                request.pool.release(arena)
            elif lazy is not None:
                pipe.fail()  # the commit aborts now, not once the loop is back
            raise
    finally:
        if lazy is not None:
            lazy.guard.release()
    infos = layout.tensors
    spans = array.array("q")
    for i in range(0, len(infos), _SPANS):  # one C call over 100,000 held the GIL 14 ms
        spans.extend(itertools.chain.from_iterable(map(_START_END, infos[i : i + _SPANS])))
    staged = StagedImage(arena, layout.size, layout.template, spans, time.perf_counter() - t0)
    if request.keep_tree:
        staged.tensors, staged.tree = infos, layout.tree
    if lazy is not None and pipe is not None:
        _seal_pipe(staged, pipe)
    return staged


def _seal_pipe(staged: StagedImage, pipe: Pipe) -> None:
    """Checksum a lazy capture's entries and put its header into the arena, from the
    staging thread: the event loop may be running a training step until the next save,
    and the commit must not wait for it."""
    try:
        seal(staged.image(), staged.template, staged.spans)
    except BaseException:
        pipe.fail()
        raise
    staged.sealed = True
    pipe.seal()


def _copy_small(
    layout: Plan, arena: Arena, copier: DeviceCopier | None, producers: Any
) -> tuple[list[int], dict[int, object]]:
    """A lazy capture's first part, before its call returns: the leaves under _SMALL
    bytes (a BatchNorm's running statistics, which the next forward changes in place).
    Device ones are copied asynchronously, and the caller's streams wait for those copies
    on the device, so its next forward runs after them. Returns the indices of the leaves
    left to copy, and the device copies started (their tokens, by leaf index)."""
    data_start = layout.data_start
    small, rest = _SmallCopy(arena, data_start), []
    started: dict[int, object] = {}
    with _offload.side_thread() as side:
        for i, (leaf, info) in enumerate(zip(layout.leaves, layout.tensors, strict=True)):
            on_device = copier is not None and leaf.kind == "tensor" and copier.is_device(leaf.value)
            if info.nbytes >= _SMALL:
                rest.append(i)
            elif on_device:
                assert copier is not None
                at = data_start + info.start
                started[i] = _start_copy(copier, arena, leaf, at, info.nbytes, producers, not started)
            elif not small.add(leaf, info):
                _copy(leaf, arena, data_start + info.start, info.nbytes, side)
    if started:
        assert copier is not None
        copier.hold_producers(producers, copier.fence())
    return rest, started


def _fill(
    layout: Plan,
    arena: Arena,
    request: StageRequest,
    pipe: Pipe | None,
    todo: Sequence[int],
    started: dict[int, object],
) -> None:
    """Copy the leaves ``todo`` lists to their places, front to back, raising ``pipe``'s
    watermark a piece at a time. Device copies start first and run meanwhile (with those
    ``started`` already): the watermark waits below the first device leaf until the host
    leaves are staged, then follows the device copies as each one lands.
    ``request.stop()`` is asked before each large host copy."""
    leaves, infos, data_start = layout.leaves, layout.tensors, layout.data_start
    copier, stop = request.copier, request.stop
    on_device = {**started, **_start_device_copies(layout, todo, arena, copier, request.producers)}
    hold = data_start + min(infos[i].start for i in on_device) if on_device else layout.size
    mark = _Mark(pipe, hold)
    small = _SmallCopy(arena, data_start)
    with _offload.side_thread() as side:
        for i in todo:
            leaf, info = leaves[i], infos[i]
            if i in on_device or small.add(leaf, info):
                continue
            if info.nbytes >= _SMALL and stop():
                raise SaveCancelledError(GAVE_UP)
            mark.reach(data_start + info.start)
            flat = _flat_view(leaf) if pipe is not None and info.nbytes > _CHUNK else None
            if flat is None:
                _copy(leaf, arena, data_start + info.start, info.nbytes, side)
                continue
            for lo in range(0, info.nbytes, _CHUNK):  # a watermark step per chunk of a huge leaf
                at, n = data_start + info.start + lo, min(_CHUNK, info.nbytes - lo)
                _split_copy(arena.array[at : at + n], flat[lo : lo + n], side)
                mark.reach(at + n)
    if request.lazy is not None:
        # The host copies are done and the device copies queued: a step may go on (its
        # device work after those copies).
        request.lazy.guard.ready(copier.fence() if on_device and copier is not None else None)
    if on_device:
        assert copier is not None
        if pipe is not None:
            # Every host leaf is staged: the watermark follows the device copies as they land.
            for i, token in sorted(on_device.items()):
                pipe.advance(data_start + infos[i].start)
                copier.wait(token)
        copier.finish()  # not a byte copied from a device is read before this
    if stop():  # before the pipe is sealed: a commit of it could not be stopped any more
        raise SaveCancelledError(GAVE_UP)
    if pipe is not None:
        pipe.advance(layout.size)


class _Mark:
    """Raises a pipe's watermark, at most once per piece (a lock per tensor would cost
    more than copying a small one), and never past ``hold``."""

    def __init__(self, pipe: Pipe | None, hold: int) -> None:
        self.pipe, self.hold, self.last = pipe, hold, 0

    def reach(self, pos: int) -> None:
        pos = min(pos, self.hold)
        if self.pipe is not None and pos - self.last >= PIECE:
            self.pipe.advance(pos)
            self.last = pos


def _flat_view(leaf: Leaf) -> np.ndarray[Any, np.dtype[np.uint8]] | None:
    """A CPU tensor's bytes as a flat array, if that needs no copy; else None."""
    t = leaf.value
    if leaf.kind != "tensor" or t.device.type != "cpu" or t.is_conj() or t.is_neg() or not t.is_contiguous():
        return None
    flat: np.ndarray[Any, np.dtype[np.uint8]] = t.detach().reshape(-1).view(torch.uint8).numpy()
    return flat


def stage_or_plan(target: object, request: StageRequest) -> StagedImage | Plan:
    """Capture and stage ``target``; or, if its image is larger than the pool's budget,
    only plan it. Runs in a worker thread: a state of 100,000 tensors takes a second to
    walk, which the event loop must not wait for. The collector is held off meanwhile,
    and what capture built is freed (by reference counting) before it resumes; what
    ``plans`` keeps of a new layout joins the oldest generation (``gc_paused(keep=True)``):
    left young, 100,000 entries cost the next young collections 40-50 ms each, in
    whichever thread set them off. A lazy capture's copies run after the pause: they run
    beside the training step, whose garbage must not wait for them."""
    with _offload.gc_paused(keep=request.plans is not None):
        snapshot = capture(target, allow_pickle=request.allow_pickle)
        optimizers, snapshot.optimizers = snapshot.optimizers, []
        layout = plan(snapshot, request.plans)
        del snapshot
        if request.pool.budget is not None and layout.size > request.pool.budget:
            if request.lazy is not None:
                request.lazy.guard.release()  # written in pieces while the caller waits
            return layout
        if request.lazy is None:
            return _stage_once(layout, request, ())
    return _stage_once(layout, request, optimizers)


def _stage_once(layout: Plan, request: StageRequest, optimizers: Sequence[Any]) -> StagedImage:
    staged = stage(layout, request, optimizers)
    # Not at once: a plan of 100,000 leaves freed in one cascade held the GIL 15-25 ms.
    _offload.release(layout.leaves, *([] if request.keep_tree else [layout.tensors]))
    return staged


def write_in_pieces(layout: Plan, upload: Upload, budget: int, stop: Callable[[], bool]) -> None:
    """Stage and write an image larger than the memory budget through two buffers of half
    ``budget`` bytes: a helper thread writes one while the next is filled, and every
    piece but the last is a whole buffer, aligned for O_DIRECT. Where pieces may come in
    any order, the data goes first and the header, with the checksums, last; an upload
    written front to back (an object store) first checksums every leaf where it lies,
    then gets the header and the data in order. ``stop()`` is asked before each piece."""
    size = max(ALIGN, budget // 2 // ALIGN * ALIGN)
    buffers = (Arena(size, shared=False), Arena(size, shared=False))
    try:
        if upload.random_access:
            crcs = _stream(layout, buffers, stop, upload.write_at)
            upload.write_at(0, memoryview(layout.template.render(crcs)))
        else:
            upload.write_at(0, memoryview(layout.template.render(_checksums(layout, stop))))
            _stream(layout, buffers, stop, upload.write_at)
    finally:
        for buffer in buffers:
            buffer.close()


def _stream(
    layout: Plan,
    buffers: tuple[Arena, Arena],
    stop: Callable[[], bool],
    write: Callable[[int, memoryview], None],
) -> list[int]:
    """Copy every leaf, front to back, into the buffers in turn, each written at its place
    in the data section once full (by the helper thread, while the other fills); the
    checksums of the entries, in header order."""
    crcs: list[int] = []
    size, blocks = buffers[0].capacity, layout.template.blocks
    turn, filled, pos = 0, 0, layout.data_start
    with _offload.side_thread() as side:
        for i, (leaf, info) in enumerate(zip(layout.leaves, layout.tensors, strict=True)):
            buffer, crc = buffers[turn], EntryCrc(blocks[i])
            if info.nbytes <= size - filled and _memmove_small(leaf, buffer, filled, info.nbytes):
                crc.update(buffer.view(filled, filled + info.nbytes))
                filled += info.nbytes
                crcs += crc.values()
                continue
            flat, lo = _flat_bytes(leaf), 0
            while lo < info.nbytes:
                n = min(info.nbytes - lo, size - filled)
                buffer.array[filled : filled + n] = flat[lo : lo + n]
                crc.update(buffer.view(filled, filled + n))
                filled, lo = filled + n, lo + n
                if filled == size:
                    if stop():
                        raise SaveCancelledError("the caller gave the save up during a save in pieces")
                    side.wait()  # the other buffer is written: it is free
                    side.submit(write, pos, buffer.view(0, size))
                    pos, filled, turn = pos + size, 0, 1 - turn
                    buffer = buffers[turn]
            crcs += crc.values()
        side.wait()
        if filled:
            write(pos, buffers[turn].view(0, filled))
    return crcs


def _memmove_small(leaf: Leaf, buffer: Arena, at: int, nbytes: int) -> bool:
    """Copy a small contiguous host tensor into ``buffer`` by one ``memmove`` (see
    ``_SmallCopy``); False if it needs the general copy."""
    t = leaf.value
    if leaf.kind != "tensor" or not 0 < nbytes < _SMALL or t.nbytes != nbytes:
        return False
    if not t.is_cpu or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return False
    _memmove(buffer.array.ctypes.data + at, t.data_ptr(), nbytes)
    return True


def _checksums(layout: Plan, stop: Callable[[], bool]) -> list[int]:
    """The checksums of every entry, read where the leaves lie (no copy)."""
    crcs: list[int] = []
    for i, (leaf, info) in enumerate(zip(layout.leaves, layout.tensors, strict=True)):
        if stop():
            raise SaveCancelledError("the caller gave the save up during a save in pieces")
        crc, flat = EntryCrc(layout.template.blocks[i]), _flat_bytes(leaf)
        for lo in range(0, info.nbytes, _CHUNK):
            crc.update(flat[lo : lo + _CHUNK].data)
        crcs += crc.values()
    return crcs


def _flat_bytes(leaf: Leaf) -> np.ndarray[Any, np.dtype[np.uint8]]:
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


def _start_device_copies(
    layout: Plan, todo: Sequence[int], arena: Arena, copier: DeviceCopier | None, producers: Any
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
            started[i] = _start_copy(copier, arena, leaf, at, info.nbytes, producers, not started)
    return started


def _start_copy(
    copier: DeviceCopier, arena: Arena, leaf: Leaf, start: int, nbytes: int, producers: Any, first: bool
) -> object:
    """Start the copy of a device leaf to ``arena[start:start + nbytes]``; the ``first``
    of a save pins the arena (a copier pins an arena only once)."""
    if first:
        copier.pin(arena.array)
    dst, src = host_view(arena.tensor[start : start + nbytes], leaf.value.detach())
    return copier.start(src, dst, producers)


_memmove = ctypes.memmove
_SPANS = 8192
_START_END = operator.attrgetter("start", "end")


class _SmallCopy:
    """Small contiguous host tensors, each copied into the arena by one ``memmove``
    from its data pointer: per tensor, a NumPy view costs ~1.5 us more, and a torch
    ``copy_`` into an arena slice ~20. Each call releases the GIL."""

    def __init__(self, arena: Arena, data_start: int) -> None:
        self.base = arena.array.ctypes.data + data_start

    def add(self, leaf: Leaf, info: TensorInfo) -> bool:
        """Copy ``leaf`` if it is a small tensor whose bytes lie contiguous in host
        memory, as they go to the file; False if it needs the general copy."""
        t, n = leaf.value, info.end - info.start
        if leaf.kind != "tensor" or not 0 < n < _SMALL:
            return False
        # is_cpu, not device.type: 0.04 us against 0.25, per tensor.
        if not t.is_cpu or not t.is_contiguous() or t.is_conj() or t.is_neg():
            return False
        if t.nbytes != n:  # resized since the plan: the general copy fails
            return False
        _memmove(self.base + info.start, t.data_ptr(), n)
        return True


def _split_copy(
    dst: np.ndarray[Any, np.dtype[np.uint8]], src: np.ndarray[Any, np.dtype[np.uint8]], side: _offload.Side
) -> None:
    """``np.copyto(dst, src)`` of flat bytes, the second half on the helper thread.

    On some machines one memcpy is bound by its core, not by memory: on the 2-core Xeon
    of the benchmarks, 16 MiB pieces copy at 6.4 GB/s on one thread and 11 on two, which
    DCP's stager (torch's copy_ on the intra-op threads) gets too. Where memory is the
    bound, the split costs one thread hop per copy of MiBs. Returns once both halves are
    copied, whatever failed."""
    if dst.nbytes < _SPLIT_MIN:
        np.copyto(dst, src)
        return
    half = dst.nbytes // 2 // ALIGN * ALIGN
    side.submit(np.copyto, dst[half:], src[half:])
    try:
        np.copyto(dst[:half], src[:half])
    finally:
        side.wait()


def _copy(leaf: Leaf, arena: Arena, start: int, nbytes: int, side: _offload.Side) -> None:
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
        if dst.size < _SMALL:
            # Small tensors: fewest Python-level steps (per-tensor overhead dominates).
            arena.tensor[start : start + dst.size].copy_(flat)
        else:
            # Large tensors: NumPy's memcpy beats Tensor.copy_ by ~2x here (see BRIEF).
            _split_copy(dst, flat.numpy(), side)
    else:
        # Copy as same-width integers: copy_ has no kernel for dtypes such as int1 or uint3.
        out, src = host_view(torch.from_numpy(dst), src)
        out.copy_(src)


def tensor_view(image: memoryview, data_start: int, info: TensorInfo) -> object:
    """A zero-copy object over an entry of a staged image (used by ``savefun``)."""
    raw = np.frombuffer(image, dtype=np.uint8, count=info.nbytes, offset=data_start + info.start)
    if info.kind == "pickle":
        return pickle.loads(raw.tobytes())
    if info.kind == "tensor":
        return torch.from_numpy(raw).view(_dtypes.TORCH_DTYPES[info.dtype]).view(info.shape)
    array = raw.view(np.dtype(info.dtype)).reshape(info.shape)
    return array[()] if info.kind == "npscalar" else array


def rebuild_image(image: memoryview, data_start: int, tensors: list[TensorInfo], tree: str) -> object:
    """The state tree over a staged image, sharing its memory (for ``savefun``); ``tree``
    is the skeleton's JSON text."""
    from .._format.tree import rebuild

    by_name = {t.name: t for t in tensors}
    made: dict[str, object] = {}

    def resolve(kind: str, name: str, path: tuple[object, ...]) -> object:
        if name not in made:
            made[name] = tensor_view(image, data_start, by_name[name])
        return made[name]

    return rebuild(json.loads(tree), resolve)
