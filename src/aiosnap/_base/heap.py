"""The heap as a large group's or a large state's work meets it: the cyclic collector held
off while worker threads build many objects, and large containers built and freed in
slices, so that no thread (the event loop's least of all) waits on one long stretch of
allocation or deallocation. Split from ``offload`` (the door to the worker threads), which
these serve.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

K = TypeVar("K")
V = TypeVar("V")


_gc_lock = threading.Lock()
_gc_holders = 0
_gc_was_enabled = False
_gc_promote = False


@contextlib.contextmanager
def gc_paused(keep: bool = False) -> Iterator[None]:
    """Hold off the cyclic garbage collector while a worker thread builds many objects.

    A full collection stops every thread, the event loop's included, for as long as it
    takes to traverse the heap (~0.35 s with a 100,000-tensor state). What capture
    builds is freed by reference counting, so no collection is needed for it.

    ``keep``: what the block builds is kept by the caller (a loaded state). When the
    last holder leaves, the objects made meanwhile go straight to the oldest generation
    (``gc.freeze`` then ``gc.unfreeze``: two list splices) instead of being traversed by
    the young collections that would promote them one generation at a time, each a
    stall of 20-140 ms with 100,000 tensors. Promoted this way they do not count
    towards the next full collection either, which a load would otherwise set off at
    once (0.35 s). The young generations are collected first, so that what was garbage
    before is not promoted; garbage cycles other threads make during the block are (the
    next full collection frees them). A block that raises promotes nothing.
    """
    global _gc_holders, _gc_was_enabled, _gc_promote
    with _gc_lock:
        if _gc_holders == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
            if keep and _gc_was_enabled:
                # The young garbage of before (a few thousand objects at most: the
                # thresholds bound them) is collected now, not promoted with the load's.
                gc.collect(1)
        _gc_holders += 1
    try:
        yield
        # A block that failed kept nothing, and may have left garbage cycles (a
        # traceback's frames): those stay young, for the next collection.
        _gc_promote = _gc_promote or keep
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0:
                # Never while the process holds frozen objects of its own (gc.freeze
                # before forking workers): the unfreeze would hand those back too.
                if _gc_promote and _gc_was_enabled and gc.get_freeze_count() == 0:
                    gc.freeze()
                    gc.unfreeze()
                _gc_promote = False
                if _gc_was_enabled:
                    gc.enable()


#: ``hand_over`` gives the GIL away once per this many calls: 256 tensors walked or
#: copied are 2-4 ms of Python here.
HAND_OVER_EVERY = 256
#: How long it gives it away: long enough for a thread waiting on the GIL to wake and
#: take it (tens of microseconds); 20,000 leaves pay ~5 ms in all.
_HAND_OVER_S = 50e-6
_hand_over_steps = itertools.count()


def hand_over() -> None:
    """Call once per step of a long per-leaf loop in a worker thread that calls into
    torch: every ``HAND_OVER_EVERY`` calls, the GIL is given away for a moment.

    The interpreter's own switch (every 5 ms) never comes in such a loop. Most torch
    calls release the GIL and take it straight back; each release wakes a thread
    waiting for it (the event loop's), which finds it taken again and starts a fresh
    5 ms wait, so its wait never times out into the request that forces a switch
    (CPython's convoy effect). A walk of 20,000 tensors held the event loop off for
    40-240 ms at a time; a short sleep now and then lets the waiter in (measured: ~10
    ms, as long as plain bytecode in a worker thread gives). ``time.sleep(0)`` does
    not: it returns before the waiter wakes."""
    if next(_hand_over_steps) % HAND_OVER_EVERY == 0:
        time.sleep(_HAND_OVER_S)


#: Items ``release`` frees per slice: well under a millisecond's work.
_RELEASE_SLICE = 1024


def release(*containers: dict[Any, Any] | list[Any], per: int = _RELEASE_SLICE) -> None:
    """Empty large dicts and lists ``per`` items at a time, from a worker thread.

    Freeing a 100,000-entry header at once is one cascade of deallocations in C: 20-40
    ms in which the thread keeps the GIL, so the event loop stalls. Between slices the
    interpreter can hand the GIL over. Items that each hold many objects (a rank's
    report: thousands) go one at a time (``per=1``): freeing them can also give emptied
    memory arenas back to the system, ~0.1 ms of ``munmap`` per MiB."""
    for c in containers:
        if isinstance(c, dict):
            while c:
                for _ in range(min(len(c), per)):
                    c.popitem()
        else:
            while c:
                del c[-per:]


def release_each(*containers: dict[Any, Any] | list[Any]) -> None:
    """``release``, one item at a time: for items that each hold many objects."""
    release(*containers, per=1)


#: Items ``zip_dict`` inserts per C call: ~0.4 ms of work.
_BUILD_SLICE = 4096


def zip_dict(keys: Sequence[K], values: Sequence[V]) -> dict[K, V]:
    """``dict(zip(keys, values))``, a slice at a time: one C call over 100,000 items
    holds the GIL for ~9 ms, a stall of the event loop as long. Between slices the
    interpreter can hand the GIL over."""
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys for {len(values)} values")
    out: dict[K, V] = {}
    for i in range(0, len(keys), _BUILD_SLICE):
        out.update(zip(keys[i : i + _BUILD_SLICE], values[i : i + _BUILD_SLICE], strict=True))
    return out
