"""Arenas: the reusable, page-aligned buffers a save's file image is staged into.

An arena is an anonymous mapping (page-aligned, so the image can be written with
O_DIRECT), or shared memory the worker process maps; the pool keeps them from save to
save within an optional byte budget.
"""

from __future__ import annotations

import functools
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, final

import numpy as np
import torch

from .._base.errors import WriterClosedError

#: Arena sizes are rounded up to this, so a slightly larger next state reuses them.
_GRAIN = 1 << 20


class Arena:
    """One reusable buffer; ``shm_name`` is set when it lives in shared memory."""

    def __init__(self, capacity: int, *, shared: bool) -> None:
        self.capacity = capacity
        self._shm: shared_memory.SharedMemory | None = None
        self._map: mmap.mmap | None = None
        self.array: np.ndarray[Any, np.dtype[np.uint8]]
        if shared:
            self._shm = shared_memory.SharedMemory(create=True, size=capacity)
            buf = self._shm.buf
            assert buf is not None
            self.array = np.frombuffer(buf, dtype=np.uint8, count=capacity)
        else:
            # Anonymous mmap: page-aligned, so the image can be written with O_DIRECT.
            self._map = mmap.mmap(-1, capacity)
            self.array = np.frombuffer(self._map, dtype=np.uint8, count=capacity)

    @functools.cached_property
    def tensor(self) -> torch.Tensor:
        """The arena as a torch uint8 tensor, sharing its memory."""
        return torch.from_numpy(self.array)

    @property
    def shm_name(self) -> str | None:
        return self._shm.name if self._shm is not None else None

    def view(self, start: int, end: int) -> memoryview:
        return memoryview(self.array[start:end])  # type: ignore[arg-type]

    def close(self) -> None:
        # Drop our own views first: an exported buffer cannot be unmapped.
        self.__dict__.pop("tensor", None)
        self.array = np.empty(0, dtype=np.uint8)
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes with it
            self._map = None
        if self._shm is not None:
            shm, self._shm = self._shm, None
            shm.unlink()
            try:
                shm.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes with it


class ArenaPool:
    """Arenas kept for reuse, within an optional byte budget.

    Thread-safe, because staging threads take from it. With a ``budget``, an arena
    that does not fit beside the ones in use waits (in the staging thread, never on
    the event loop) until a commit gives one back: saves waiting in a queue count
    against the budget.
    """

    def __init__(
        self,
        *,
        shared: bool,
        keep: int,
        budget: int | None = None,
        on_free: Callable[[np.ndarray[Any, np.dtype[np.uint8]]], None] | None = None,
    ) -> None:
        self.shared = shared
        self.budget = budget
        #: Called with an arena's buffer before it is freed (undoes device pinning).
        self._on_free = on_free
        self._keep = keep
        self._free: list[Arena] = []
        #: Arenas beyond ``keep``, freed by the next ``acquire`` or by ``close``: both run
        #: in worker threads, while ``release`` may run on the event loop.
        self._doomed: list[Arena] = []
        self._in_use = 0
        self._cond = threading.Condition()
        self._closed = False
        #: Staging threads waiting for memory to be released (what a test can wait for).
        self.waiting = 0

    def acquire(self, nbytes: int) -> Arena:
        capacity = max(_GRAIN, -(-nbytes // _GRAIN) * _GRAIN)
        if self.budget is not None:
            capacity = max(nbytes, min(capacity, self.budget))
        with self._cond:
            drop, self._doomed = self._doomed, []
        for old in drop:
            self._free_arena(old)
        drop = []
        with self._cond:
            while True:
                if self._closed:
                    raise WriterClosedError("the writer closed while a save waited for staging memory")
                fits = [a for a in self._free if a.capacity >= nbytes]
                if fits:
                    arena = min(fits, key=lambda a: a.capacity)
                    self._free.remove(arena)
                    self._in_use += arena.capacity
                    return arena
                if self.budget is None or self._in_use + capacity <= self.budget:
                    while (
                        self.budget is not None
                        and self._free
                        and (self._in_use + capacity + sum(a.capacity for a in self._free) > self.budget)
                    ):
                        drop.append(self._free.pop(0))  # largest first
                    self._in_use += capacity
                    break
                self.waiting += 1
                try:
                    self._cond.wait()
                finally:
                    self.waiting -= 1
        for old in drop:
            self._free_arena(old)
        return Arena(capacity, shared=self.shared)

    def usage(self) -> tuple[int, int, int, int]:
        """Bytes of arenas in use, arenas kept and their bytes, staging threads waiting."""
        with self._cond:
            return self._in_use, len(self._free), sum(a.capacity for a in self._free), self.waiting

    def _free_arena(self, arena: Arena) -> None:
        if self._on_free is not None and arena.capacity:
            self._on_free(arena.array)
        arena.close()

    def release(self, arena: Arena) -> None:
        """Hand an arena back. Frees no memory (the caller may be the event loop), except
        after ``close``, where nothing else would."""
        with self._cond:
            self._in_use -= arena.capacity
            drop = []
            if not self._closed:
                self._free.append(arena)
                self._free.sort(key=lambda a: a.capacity, reverse=True)
                self._doomed += self._free[self._keep :]
                self._free = self._free[: self._keep]
            else:
                drop = [arena]
            self._cond.notify_all()
        for a in drop:
            self._free_arena(a)

    def close(self) -> None:
        """Free the kept arenas (blocking: unmapping takes ~0.4 ms per MiB, so it runs in a
        worker thread); arenas still in use are freed when they come back."""
        with self._cond:
            self._closed = True
            drop, self._free, self._doomed = self._free + self._doomed, [], []
            self._cond.notify_all()
        for a in drop:
            self._free_arena(a)


@final
@dataclass(frozen=True, slots=True)
class StagingMemory:
    """A writer's staging memory at one moment (``staging_memory()``): bytes of arenas
    held by saves in flight, arenas kept for the next saves and their bytes, and
    captures waiting for memory (``max_host_bytes``)."""

    in_use: int
    kept: int
    kept_bytes: int
    waiting: int
