"""Per-entry compression of blobs: zstd, through the ``zstandard`` package (an extra).

A compressed blob is one zstd frame holding the entry's bytes; the referring header
records ``"compression": "zstd"`` and the frame's size (``stored``). The crc32c is the
entry's own (its bytes as loaded), so a load checks what it decompressed.
"""

from __future__ import annotations

from typing import Any

from .._base.errors import CorruptCheckpointError

#: zstd's levels: 1 (fastest) to 22.
LEVELS = range(1, 23)
#: The most bytes a zstd frame can hold per byte of it: a run-length block of 128 KiB is 4
#: bytes (32768:1). A frame claiming more is refused before any memory is allocated.
MAX_RATIO = 1 << 15
#: Bytes of a frame that hold its header (and so its content size).
FRAME_HEAD = 18


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError as exc:
        raise ImportError(
            'compression="zstd" needs the zstandard package: pip install "aiosnap[zstd]"'
        ) from exc
    return zstandard


def check(compression: str | None, level: int) -> None:
    """Refuse a compression aiosnap cannot write, before any save."""
    if compression is None:
        return
    if compression != "zstd":
        raise ValueError(f'compression must be None or "zstd", not {compression!r}')
    if level not in LEVELS:
        raise ValueError(f"level must be 1..22 for zstd, not {level!r}")
    _zstd()


def compress(data: memoryview, compression: str, level: int) -> bytes:
    """``data`` as one frame (its size recorded in it). Releases the GIL."""
    assert compression == "zstd"
    packed: bytes = _zstd().ZstdCompressor(level=level, write_content_size=True).compress(data)
    return packed


def check_frame(head: bytes, stored: int, nbytes: int, owner: str, path: str) -> None:
    """Refuse a blob whose frame header (its first FRAME_HEAD bytes, ``stored`` bytes in
    all) does not say it holds ``nbytes`` bytes, or that could not hold that many."""
    _checked(head, nbytes, "zstd", owner, path)
    if nbytes > stored * MAX_RATIO + (1 << 17):
        raise CorruptCheckpointError(owner, f"the blob {path} does not hold {nbytes} bytes")


def _checked(head: bytes | bytearray, nbytes: int, compression: str, owner: str, path: str) -> Any:
    """zstd, once the frame that starts with ``head`` says it holds ``nbytes`` bytes;
    CorruptCheckpointError (naming the checkpoint ``owner`` and the blob) if not."""
    if compression != "zstd":
        raise CorruptCheckpointError(owner, f"the blob {path}: unknown compression {compression!r}")
    zstd = _zstd()
    try:
        size = zstd.get_frame_parameters(head).content_size
    except zstd.ZstdError as exc:
        raise CorruptCheckpointError(owner, f"the blob {path} is not a valid zstd frame ({exc})") from None
    if size != nbytes:
        raise CorruptCheckpointError(owner, f"the blob {path} does not hold {nbytes} bytes")
    return zstd


def decompress(packed: bytearray, nbytes: int, compression: str, owner: str, path: str) -> memoryview:
    """The ``nbytes`` bytes of a blob's frame; CorruptCheckpointError (naming the
    checkpoint ``owner`` and the blob) if the frame is not one of exactly that many."""
    zstd = _checked(packed, nbytes, compression, owner, path)
    try:
        plain = zstd.ZstdDecompressor().decompress(packed, max_output_size=nbytes)
    except zstd.ZstdError as exc:
        raise CorruptCheckpointError(owner, f"the blob {path} is not a valid zstd frame ({exc})") from None
    if len(plain) != nbytes:
        raise CorruptCheckpointError(owner, f"the blob {path} does not hold {nbytes} bytes")
    return memoryview(plain)


class Stream:
    """A blob's frame decompressed front to back straight into the caller's buffers (a
    load's destination), checked to hold exactly ``nbytes`` bytes."""

    def __init__(self, packed: bytearray, nbytes: int, compression: str, owner: str, path: str) -> None:
        self._zstd, self.owner, self.path = _checked(packed, nbytes, compression, owner, path), owner, path
        self._reader = self._zstd.ZstdDecompressor().stream_reader(packed)

    def readinto(self, buf: memoryview) -> None:
        done = 0
        try:
            while done < len(buf):
                n = self._reader.readinto(buf[done:])
                if not n:
                    raise CorruptCheckpointError(self.owner, f"the blob {self.path} ends early")
                done += n
        except self._zstd.ZstdError as exc:
            raise CorruptCheckpointError(self.owner, f"the blob {self.path}: {exc}") from None


class Unpacker:
    """A blob's frame fed piece by piece (as read), its bytes handed to ``sink`` as they
    come out (memory bounded by zstd's window, whatever the entry's size). ``feed``
    raises CorruptCheckpointError for a frame header that does not say ``nbytes`` (its
    first piece must hold the header) and for bytes that are no valid frame, or that run
    past its end."""

    def __init__(self, nbytes: int, compression: str, sink: Any, owner: str, path: str) -> None:
        self.nbytes, self.compression = nbytes, compression
        self.sink, self.owner, self.path = sink, owner, path
        self._writer: Any = None
        self._error: type[Exception] = Exception  # zstd's, once it is imported

    def feed(self, piece: memoryview) -> None:
        if self._writer is None:
            zstd = _checked(bytes(piece[:FRAME_HEAD]), self.nbytes, self.compression, self.owner, self.path)
            self._error = zstd.ZstdError
            self._writer = zstd.ZstdDecompressor().stream_writer(
                self.sink, write_return_read=True, closefd=False
            )
        try:
            self._writer.write(piece)
            self._writer.flush()
        except self._error as exc:
            raise CorruptCheckpointError(
                self.owner, f"the blob {self.path} is not a valid zstd frame ({exc})"
            ) from None
