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
    """Durably save ``target`` to ``path`` and return when it is committed."""
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
