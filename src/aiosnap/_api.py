"""One-shot saving, and the blocking twins of the async API for scripts and notebooks."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import anyio

from ._load.load import (
    LoadRequest,
    VerifyReport,
    load,
    load_into,
    load_into_now,
    load_now,
    verify,
    verify_now,
)
from ._load.readers import MapLocation
from ._load.standalone import standalone_now
from ._load.verify import Progress
from ._save.engine import SaveFun
from ._save.handle import SaveStats
from ._save.writers import SimpleWriter
from ._storage.backends import resolve
from ._storage.protocol import Storage

P = ParamSpec("P")
#: The staging memory of a one-call save: larger states are written in pieces through it.
_ONE_SHOT_BYTES = 32 << 20
T = TypeVar("T")


async def save(
    path: str,
    target: object,
    *,
    savefun: SaveFun | None = None,
    allow_pickle: bool = False,
    storage: Storage | None = None,
) -> SaveStats:
    """Durably save ``target`` to ``path`` and return when it is committed.

    A one-shot ``SimpleWriter`` save: the file is written to a temp name beside ``path``,
    made durable and renamed over it, so ``path`` holds the old checkpoint or the new one,
    never a part of either. For saves in a training loop, keep a writer open instead (its
    staging buffers are reused and its commits run in the background).

    Args:
        path: The checkpoint file to write: a local path or a URL (``s3://bucket/run/x``).
        target: The state: a tree of dicts, lists and tuples whose leaves are tensors,
            arrays, numbers, strings, bytes, and objects with ``state_dict()`` and
            ``load_state_dict()`` (a model, an optimizer: saved as their state dicts).
        savefun: A function ``savefun(obj, path)`` (``torch.save``) that writes the file
            itself instead of aiosnap's format; the commit stays durable and atomic.
        allow_pickle: Store values that are not state types by pickling them (loading
            them then needs ``allow_pickle=True`` too); without it they are refused.
        storage: The storage to write through; None picks it from ``path``.

    Returns:
        How the save went: bytes committed and seconds per phase.
    """
    storage, path = resolve(path, storage)
    directory, name = storage.split(path)
    # The caller waits until the file is durable, so the state is not staged whole: it is
    # written through two small buffers (fresh memory for a whole arena, faulted in and
    # unmapped again at every call, cost more than the disk's write here).
    budget = None if savefun is not None else _ONE_SHOT_BYTES
    async with SimpleWriter(storage=storage, allow_pickle=allow_pickle, max_host_bytes=budget) as writer:
        handle = await writer(name, directory, target, savefun=savefun)
        return await handle.wait()


def _blocking(fn: Callable[P, Awaitable[T]]) -> Callable[P, T]:
    @functools.wraps(fn)
    def twin(*args: P.args, **kwargs: P.kwargs) -> T:
        _no_loop(fn.__name__)
        # The result is not the main task's: Python 3.11's asyncio.Runner formats the repr
        # of its SIGINT handler when it ends, and with it the main task's result (a
        # state's repr scans every tensor: 25-100 ms per 256 MiB here).
        result: list[T] = []

        async def main() -> None:
            result.append(await fn(*args, **kwargs))

        anyio.run(main)
        return result[0]

    twin.__name__ = twin.__qualname__ = f"{fn.__name__}_sync"
    twin.__doc__ = f"Blocking twin of :func:`aiosnap.{fn.__name__}` (no event loop may be running)."
    return twin


def _in_caller(fn: Callable[P, Awaitable[T]], now: Callable[..., T]) -> Callable[P, T]:
    """The blocking twin of a load or a verify: ``now`` in the calling thread. With no
    event loop to keep serving, a worker thread would only add two thread hops (tens of
    ms on a loaded machine, where the loop waits to be woken by the worker)."""

    @functools.wraps(fn)
    def twin(*args: P.args, **kwargs: P.kwargs) -> T:
        _no_loop(fn.__name__)
        return now(*args, **kwargs)

    twin.__name__ = twin.__qualname__ = f"{fn.__name__}_sync"
    twin.__doc__ = f"Blocking twin of :func:`aiosnap.{fn.__name__}` (no event loop may be running)."
    return twin


def _no_loop(name: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        f"aiosnap.{name}_sync was called inside a running event loop; "
        f"use `await aiosnap.{name}(...)` there instead"
    )


def _load_sync(
    path: str,
    *,
    keys: Sequence[str] | None = None,
    map_location: MapLocation = None,
    allow_pickle: bool = False,
    storage: Storage | None = None,
    replicas: str | None = None,
    rank: int | None = None,
    progress: Progress | None = None,
) -> Any:
    request = LoadRequest(
        keys=keys, map_location=map_location, allow_pickle=allow_pickle, replicas=replicas, rank=rank
    )
    return load_now(path, request, storage, progress)


def _load_into_sync(
    path: str,
    target: Any,
    *,
    strict: bool = True,
    keys: Sequence[str] | None = None,
    allow_pickle: bool = False,
    storage: Storage | None = None,
    replicas: str | None = None,
    rank: int | None = None,
    progress: Progress | None = None,
) -> Any:
    request = LoadRequest(
        keys=keys, allow_pickle=allow_pickle, target=target, strict=strict, replicas=replicas, rank=rank
    )
    load_into_now(path, request, storage, progress)
    return target


def _verify_sync(
    path: str, *, storage: Storage | None = None, progress: Progress | None = None
) -> VerifyReport:
    return verify_now(path, storage, progress)


save_sync: Callable[..., SaveStats] = _blocking(save)
"""Blocking twin of `aiosnap.save`: same arguments; no event loop may be running."""
load_sync: Callable[..., Any] = _in_caller(load, _load_sync)
"""Blocking twin of `aiosnap.load`: same arguments; no event loop may be running."""
load_into_sync: Callable[..., Any] = _in_caller(load_into, _load_into_sync)
"""Blocking twin of `aiosnap.load_into`: same arguments; no event loop may be running."""
verify_sync: Callable[..., VerifyReport] = _in_caller(verify, _verify_sync)
"""Blocking twin of `aiosnap.verify`: same arguments; no event loop may be running."""


def standalone_sync(src: str, dst: str, *, storage: Storage | None = None) -> int:
    """Blocking twin of ``standalone``: a self-contained copy of ``src`` at ``dst``."""
    return standalone_now(src, dst, storage).bytes
