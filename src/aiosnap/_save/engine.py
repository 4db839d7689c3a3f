"""Where a commit runs: a worker thread, or a persistent worker process.

Both engines take a staged image and return the commit's timings; the writers do
not know which one they hold. The process engine's worker is started when the
writer opens and lives until it closes; it reads the image from shared memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from .._base import offload as _offload
from .._base.errors import WorkerCrashedError
from .._format.header import seal
from .._storage.protocol import CommitTimes, Storage, write_image, write_with
from . import worker as _worker
from .stage import StagedImage, rebuild_image

SaveFun = Callable[[Any, str], object]
#: The package the worker starts from (bare: its ``__init__`` is not run).
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Engine(Protocol):
    shared: bool

    @property
    def pid(self) -> int | None: ...

    async def start(self) -> None: ...

    async def commit(
        self, storage: Storage, path: str, staged: StagedImage, savefun: SaveFun | None
    ) -> CommitTimes: ...

    async def aclose(self) -> None: ...


def _commit_here(storage: Storage, path: str, staged: StagedImage, savefun: SaveFun | None) -> CommitTimes:
    if savefun is None:
        seal(staged.image(), staged.template, staged.spans)
        return write_image(storage, path, staged.aligned_image(), staged.size)
    assert staged.tensors is not None
    assert staged.tree is not None
    obj = rebuild_image(staged.image(), staged.data_start, staged.tensors, staged.tree)
    return write_with(storage, path, lambda local: savefun(obj, local))


class ThreadEngine:
    """Commits in a worker thread of this process."""

    shared = False
    pid = None

    async def start(self) -> None:
        await _offload.warm()

    async def commit(
        self, storage: Storage, path: str, staged: StagedImage, savefun: SaveFun | None
    ) -> CommitTimes:
        return await _offload.run_io(_commit_here, storage, path, staged, savefun)

    async def aclose(self) -> None:
        pass


class _RemoteTraceback(Exception):
    """The traceback of a failure inside the worker process."""

    def __str__(self) -> str:
        return f'\n"""\n{self.args[0]}"""'


class ProcessEngine:
    """Commits in one worker process that reads staged images from shared memory."""

    shared = True

    def __init__(self) -> None:
        self._process: anyio.abc.Process | None = None
        self._reader: BufferedByteReceiveStream | None = None
        self._lock = anyio.Lock()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    async def start(self) -> None:
        await _offload.warm()
        await self._spawn()

    async def _spawn(self) -> None:
        self._process = await anyio.open_process(
            [sys.executable, "-c", _worker.BOOTSTRAP, _PKG_DIR],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
        )
        assert self._process.stdout is not None
        self._reader = BufferedByteReceiveStream(self._process.stdout)
        await self._receive()  # "ready"

    async def _receive(self) -> Any:
        import pickle

        assert self._reader is not None
        try:
            head = await self._reader.receive_exactly(8)
            body = await self._reader.receive_exactly(int.from_bytes(head, "little"))
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError) as exc:
            await self._reap()
            raise WorkerCrashedError("the offload worker process died during a commit") from exc
        return pickle.loads(body)

    async def commit(
        self, storage: Storage, path: str, staged: StagedImage, savefun: SaveFun | None
    ) -> CommitTimes:
        # The tree (and with it torch) is only needed where a savefun rebuilds it.
        if savefun is None:
            layout: Any = (staged.template, staged.spans)
        else:
            layout = (staged.data_start, staged.tensors, staged.tree)
        request = ("commit", storage, path, staged.arena.shm_name, staged.size, savefun, layout)
        frame = _worker.encode_frame(request)
        async with self._lock:
            if self._process is None:
                await self._spawn()
            assert self._process is not None
            assert self._process.stdin is not None
            try:
                await self._process.stdin.send(frame)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
                await self._reap()
                raise WorkerCrashedError("the offload worker process is gone") from exc
            reply = await self._receive()
        if reply[0] == "ok":
            return CommitTimes(*reply[1])
        error: BaseException = reply[1]
        error.__cause__ = _RemoteTraceback(reply[2])
        raise error

    async def _reap(self) -> None:
        process, self._process, self._reader = self._process, None, None
        if process is not None:
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.kill()
                await process.wait()
                await process.aclose()

    async def aclose(self) -> None:
        async with self._lock:
            process = self._process
            if process is None:
                return
            assert process.stdin is not None
            try:
                await process.stdin.send(_worker.encode_frame(("exit",)))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            with anyio.move_on_after(10, shield=True):
                await process.wait()
            await self._reap()
