"""Stage: copy a captured snapshot into an arena laid out as the file image.

The arena holds the header and the data section exactly as they go to disk, so the
commit is a single write of one buffer. Arenas come from a pool owned by the writer
and are reused across saves; with process offload they live in shared memory, so
the worker process reads the bytes without any pipe or pickle.

Everything here blocks: it runs in a worker thread through ``_offload``.
"""

from __future__ import annotations

import array
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

from .._base import heap as _heap
from .._base import offload as _offload
from .._base.errors import SaveCancelledError
from .._format import dtypes as _dtypes
from .._format.codec import TensorInfo
from .._format.header import ALIGN, EntryCrc, HeaderTemplate, seal
from .._format.plans import Plan, PlanCache, plan
from .._format.tree import capture
from .._storage.protocol import Upload
from .arena import Arena, ArenaPool
from .copies import (
    SMALL,
    SPLIT_MIN,
    SmallCopy,
    copy_leaf,
    flat_bytes,
    flat_view,
    memmove_small,
    split_copy,
    start_copy,
    start_device_copies,
)
from .device import DeviceCopier
from .guard import Guard
from .lazy import LazyCopies
from .pipeline import PIECE, Pipe
from .window import Window
from .window import warm as warm_window

#: A huge leaf is copied in chunks of this size when its commit is pipelined (glibc's
#: memcpy slows down on pieces much below 64 MiB, see the BRIEF).
_CHUNK = 64 << 20
_SPLIT_MIN = SPLIT_MIN  # the tests' name for it
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
    """A lazy capture's hand-offs, for the staging thread. ``walked(optimizers, window)``
    is called on the event loop (which is free then: the caller waits for it) once the
    tree is walked, the small leaves and the arrays copied, the device copies queued and
    the arena taken; it puts ``window`` on the loop's thread (``window.py``) and the caller
    returns; the rest is copied with no help from the loop. ``guard`` holds the optimizers'
    steps until the copies are done."""

    walked: Callable[[list[Any], Window], None]
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
    copies: LazyCopies | None = None
    try:
        arena = request.pool.acquire(layout.size)
        try:
            pipe = _offer(layout, arena, request.begin)
            todo: Sequence[int] = range(len(layout.leaves))
            started: dict[int, object] = {}
            if lazy is not None:
                todo, started = _before_return(layout, arena, request)
                copies = LazyCopies(layout, arena, todo, request.copier)
                warm_window()  # once per process, here rather than in the caller's next step
                if pipe is not None:
                    pipe.wait_started()  # started by the loop, which the caller may hold next
                lazy.walked(list(optimizers), copies.window)
            _fill(layout, arena, request, pipe, todo, started, copies)
        except BaseException:
            if copies is not None:
                copies.close()  # no writer copies into the arena once it may be reused
            if pipe is None:
                request.pool.release(arena)
            elif lazy is not None:
                pipe.fail()  # the commit aborts now, not once the loop is back
            raise
    finally:
        if copies is not None:
            copies.close()
        if lazy is not None:
            lazy.guard.release()
    staged = _staged(layout, arena, request.keep_tree, t0)
    if lazy is not None and pipe is not None:
        _seal_pipe(staged, pipe)
    return staged


def _offer(layout: Plan, arena: Arena, begin: Callable[[Pipe], bool] | None) -> Pipe | None:
    """The pipe a commit took to write ``arena`` while it fills (``begin``), if any."""
    if begin is None:
        return None
    offer = Pipe(arena, layout.size, layout.data_start)
    return offer if begin(offer) else None


def _staged(layout: Plan, arena: Arena, keep_tree: bool, t0: float) -> StagedImage:
    """The staged image of ``layout`` in ``arena``, its copies done."""
    infos = layout.tensors
    spans = array.array("q")
    for i in range(0, len(infos), _SPANS):  # one C call over 100,000 held the GIL 14 ms
        spans.extend(itertools.chain.from_iterable(map(_START_END, infos[i : i + _SPANS])))
    staged = StagedImage(arena, layout.size, layout.template, spans, time.perf_counter() - t0)
    if keep_tree:
        staged.tensors, staged.tree = infos, layout.tree
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


def _before_return(layout: Plan, arena: Arena, request: StageRequest) -> tuple[list[int], dict[int, object]]:
    """A lazy capture's first part, before its call returns: the leaves under SMALL
    bytes (a BatchNorm's running statistics, which the next forward changes in place),
    and every array and pickle (a write through NumPy is seen by no one) are copied.
    Small device leaves are copied asynchronously, and the caller's streams wait for those
    copies on the device, so its next forward runs after them (a write to a large one
    waits on the device for its copy: ``window.py``). Returns the indices of the tensor
    leaves left to copy and the device copies started (their tokens, by leaf index)."""
    copier, producers, data_start = request.copier, request.producers, layout.data_start
    small, rest = SmallCopy(arena, data_start), []
    started: dict[int, object] = {}
    with _offload.side_thread() as side:
        for i, (leaf, info) in enumerate(zip(layout.leaves, layout.tensors, strict=True)):
            on_device = copier is not None and leaf.kind == "tensor" and copier.is_device(leaf.value)
            if info.nbytes >= SMALL and leaf.kind == "tensor":
                rest.append(i)
            elif on_device:
                assert copier is not None
                at = data_start + info.start
                started[i] = start_copy(copier, arena, leaf, at, info.nbytes, producers, not started)
            elif not small.add(leaf, info):
                copy_leaf(leaf, arena, data_start + info.start, info.nbytes, side)
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
    copies: LazyCopies | None = None,
) -> None:
    """Copy the leaves ``todo`` lists to their places, front to back, raising ``pipe``'s
    watermark a piece at a time. Device copies start first and run meanwhile (with those
    ``started`` already): the watermark waits below the first device leaf until the host
    leaves are staged, then follows the device copies as each one lands.
    ``request.stop()`` is asked before each large host copy. A lazy capture's ``copies``
    say which host leaves a writer copied first (skipped here), and check each one copied
    here, and each device leaf, against its version at the walk."""
    leaves, infos, data_start = layout.leaves, layout.tensors, layout.data_start
    copier, stop = request.copier, request.stop
    on_device = {**started, **start_device_copies(layout, todo, arena, copier, request.producers)}
    if copies is not None:
        copies.device_queued(copier.fence() if on_device and copier is not None else None)
    hold = data_start + min(infos[i].start for i in on_device) if on_device else layout.size
    mark = _Mark(pipe, hold)
    small = SmallCopy(arena, data_start)
    with _offload.side_thread() as side:
        for i in todo:
            _heap.hand_over()
            if i in on_device or small.add(leaves[i], infos[i]):
                continue
            if copies is None:
                _copy_one(layout, arena, i, pipe, mark, stop, side)
            elif copies.take(i):
                try:
                    _copy_one(layout, arena, i, pipe, mark, stop, side)
                finally:
                    copies.release(i)
    if request.lazy is not None:
        # The host copies are done and the device copies queued: a step may go on (its
        # device work after those copies).
        request.lazy.guard.ready(copier.fence() if on_device and copier is not None else None)
    if on_device:
        assert copier is not None
        _land(layout, pipe, copier, on_device)
    if copies is not None:
        copies.check_device([i for i in todo if i in on_device])
        copies.raise_late()
    if stop():  # before the pipe is sealed: a commit of it could not be stopped any more
        raise SaveCancelledError(GAVE_UP)
    if pipe is not None:
        pipe.advance(layout.size)


def _land(layout: Plan, pipe: Pipe | None, copier: DeviceCopier, on_device: dict[int, object]) -> None:
    """Wait for the device copies; with a ``pipe``, every host leaf is staged already:
    its watermark follows the device copies as they land."""
    if pipe is not None:
        for i, token in sorted(on_device.items()):
            pipe.advance(layout.data_start + layout.tensors[i].start)
            copier.wait(token)
    copier.finish()  # not a byte copied from a device is read before this


def _copy_one(
    layout: Plan,
    arena: Arena,
    i: int,
    pipe: Pipe | None,
    mark: _Mark,
    stop: Callable[[], bool],
    side: _offload.Side,
) -> None:
    """Copy host leaf ``i`` to its place, raising the watermark as it goes."""
    leaf, info, data_start = layout.leaves[i], layout.tensors[i], layout.data_start
    if info.nbytes >= SMALL and stop():
        raise SaveCancelledError(GAVE_UP)
    mark.reach(data_start + info.start)
    flat = flat_view(leaf) if pipe is not None and info.nbytes > _CHUNK else None
    if flat is None:
        copy_leaf(leaf, arena, data_start + info.start, info.nbytes, side)
        return
    for lo in range(0, info.nbytes, _CHUNK):  # a watermark step per chunk of a huge leaf
        at, n = data_start + info.start + lo, min(_CHUNK, info.nbytes - lo)
        split_copy(arena.array[at : at + n], flat[lo : lo + n], side)
        mark.reach(at + n)


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


def stage_or_plan(target: object, request: StageRequest) -> StagedImage | Plan:
    """Capture and stage ``target``; or, if its image is larger than the pool's budget,
    only plan it. Runs in a worker thread: a state of 100,000 tensors takes a second to
    walk, which the event loop must not wait for. The collector is held off meanwhile,
    and what capture built is freed (by reference counting) before it resumes; what
    ``plans`` keeps of a new layout joins the oldest generation (``gc_paused(keep=True)``):
    left young, 100,000 entries cost the next young collections 40-50 ms each, in
    whichever thread set them off. A lazy capture's copies run after the pause: they run
    beside the training step, whose garbage must not wait for them."""
    with _heap.gc_paused(keep=request.plans is not None):
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
    _heap.release(layout.leaves, *([] if request.keep_tree else [layout.tensors]))
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
            if info.nbytes <= size - filled and memmove_small(leaf, buffer, filled, info.nbytes):
                crc.update(buffer.view(filled, filled + info.nbytes))
                filled += info.nbytes
                crcs += crc.values()
                continue
            flat, lo = flat_bytes(leaf), 0
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


def _checksums(layout: Plan, stop: Callable[[], bool]) -> list[int]:
    """The checksums of every entry, read where the leaves lie (no copy)."""
    crcs: list[int] = []
    for i, (leaf, info) in enumerate(zip(layout.leaves, layout.tensors, strict=True)):
        if stop():
            raise SaveCancelledError("the caller gave the save up during a save in pieces")
        crc, flat = EntryCrc(layout.template.blocks[i]), flat_bytes(leaf)
        for lo in range(0, info.nbytes, _CHUNK):
            crc.update(flat[lo : lo + _CHUNK].data)
        crcs += crc.values()
    return crcs


_SPANS = 8192
_START_END = operator.attrgetter("start", "end")


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
