"""The offload worker process: commits staged images that it reads from shared memory.

It is started once per writer (``offload="process"``) with a bootstrap that does not
run ``aiosnap/__init__``, so it imports only the standard library until a ``savefun``
needs torch. Requests and replies are length-prefixed pickles of small tuples over
its stdin and stdout; tensor bytes never cross the pipe: the request names the
shared-memory arena and the size of the image in it.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import struct
import traceback
from typing import Any

from .._format.header import ALIGN, seal
from .._storage.protocol import CommitTimes, Storage, write_image, write_with

#: Run with ``python -c BOOTSTRAP <package dir>``: a bare package, no ``__init__``.
BOOTSTRAP = (
    "import sys,types;p=types.ModuleType('aiosnap');p.__path__=[sys.argv[1]];"
    "sys.modules['aiosnap']=p;from aiosnap._save.worker import main;main()"
)
_LEN = struct.Struct("<Q")


def encode_frame(obj: object) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def commit_from_shm(
    storage: Storage, path: str, shm_name: str, size: int, savefun: Any, layout: Any
) -> CommitTimes:
    """Commit bytes [0, size) of a shared-memory arena to ``path``."""
    fd = os.open(f"/dev/shm/{shm_name}", os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, -(-max(size, 1) // ALIGN) * ALIGN)
    finally:
        os.close(fd)
    try:
        image = memoryview(mapping)
        try:
            if savefun is None:
                seal(image[:size], *layout)
                return write_image(storage, path, image, size)
            from .stage import rebuild_image

            obj = rebuild_image(image[:size], *layout)
            return write_with(storage, path, lambda local: savefun(obj, local))
        finally:
            image.release()
    finally:
        try:
            mapping.close()
        except BufferError:
            pass  # a savefun kept a view; the mapping is freed with it


def main() -> None:
    # A file-size limit must fail the write with EFBIG, not kill the worker.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # Whatever user code prints must not corrupt the protocol on stdout.
    out = os.dup(1)
    os.dup2(2, 1)
    _write_all(out, encode_frame(("ready", os.getpid())))
    while True:
        head = _read_exact(0, _LEN.size)
        if head is None:
            return
        body = _read_exact(0, _LEN.unpack(head)[0])
        if body is None:
            return
        request = pickle.loads(body)
        if request[0] == "exit":
            return
        _write_all(out, _handle(request))


def _handle(request: tuple[Any, ...]) -> bytes:
    try:
        return encode_frame(("ok", commit_from_shm(*request[1:])))
    except BaseException as exc:  # every failure goes back to the writer
        text = traceback.format_exc()
        try:
            return encode_frame(("err", exc, text))
        except Exception:  # the exception itself does not pickle
            return encode_frame(("err", RuntimeError(f"{type(exc).__name__}: {exc}"), text))


if __name__ == "__main__":  # pragma: no cover - started through BOOTSTRAP
    main()
