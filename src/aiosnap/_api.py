"""One-shot saving, and the blocking twins of the async API for scripts and notebooks."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

import anyio

from ._load.load import VerifyReport, load, load_into, verify
from ._save.engine import SaveFun
from ._save.handle import SaveStats
from ._save.writers import SimpleWriter
from ._storage.backends import resolve
from ._storage.protocol import Storage

P = ParamSpec("P")
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
    async with SimpleWriter(storage=storage, allow_pickle=allow_pickle) as writer:
        handle = await writer(name, directory, target, savefun=savefun)
        return await handle.wait()


def _blocking(fn: Callable[P, Awaitable[T]]) -> Callable[P, T]:
    @functools.wraps(fn)
    def twin(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return anyio.run(functools.partial(fn, *args, **kwargs))
        raise RuntimeError(
            f"aiosnap.{fn.__name__}_sync was called inside a running event loop; "
            f"use `await aiosnap.{fn.__name__}(...)` there instead"
        )

    twin.__name__ = twin.__qualname__ = f"{fn.__name__}_sync"
    twin.__doc__ = f"Blocking twin of :func:`aiosnap.{fn.__name__}` (no event loop may be running)."
    return twin


save_sync: Callable[..., SaveStats] = _blocking(save)
"""Blocking twin of `aiosnap.save`: same arguments; no event loop may be running."""
load_sync: Callable[..., Any] = _blocking(load)
"""Blocking twin of `aiosnap.load`: same arguments; no event loop may be running."""
load_into_sync: Callable[..., Any] = _blocking(load_into)
"""Blocking twin of `aiosnap.load_into`: same arguments; no event loop may be running."""
verify_sync: Callable[..., VerifyReport] = _blocking(verify)
"""Blocking twin of `aiosnap.verify`: same arguments; no event loop may be running."""
