"""Which blobs a save may refer to without reading them: those this process checked or wrote.

A blob is named by the hash of its bytes, but the name proves nothing about the file that
bears it: a bit flipped on the disk, a frame cut short, another program's object put
under that name. A save that referred to such a blob unread would report success, and
neither its checkpoint nor any later one referring to it would restore; retention would
then delete the older ones. So a save (and an upload to a remote tier) refers to a blob
that is there already only once this process has read it whole and found in it what its
name says (``check``: its bytes hash to the name and are the entry's size; for a zstd
blob, one frame that says so and holds exactly those bytes), or wrote it itself; and only
while it is the same object as then, by its ``Entry.identity`` (a file's device, inode,
size, mtime and ctime; an object's ETag and version, or generation). Any write or
replacement changes the identity, and the blob is checked again; one that fails is
written again (the commit replaces it atomically).

The cost: after a restart, each blob the first save refers to is read once (then it is
known for the life of the process); each blob written costs a ``stat`` more.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .._base.checksums import content_hasher
from .._base.errors import CheckpointError, CorruptCheckpointError
from .._base.notice import notice
from .._format.compress import Unpacker
from .._storage.protocol import Entry, Storage

logger = logging.getLogger(__name__)

#: Bytes read per call when a blob is checked.
PIECE = 16 << 20


class Trusted:
    """The blobs this process checked or wrote, by path: the identity and size each had
    then. Shared by every writer and uploader of the process (a blob is trusted whoever
    checked it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[str, tuple[str | None, int]] = {}

    def holds(self, path: str, entry: Entry | None) -> bool:
        """Whether ``entry`` (a fresh ``stat`` of ``path``) is the object checked or written."""
        if entry is None or not entry.is_file:
            return False
        with self._lock:
            return self._known.get(path) == (entry.identity, entry.size)

    def add(self, path: str, entry: Entry) -> None:
        with self._lock:
            self._known[path] = (entry.identity, entry.size)

    def forget(self, path: str) -> None:
        with self._lock:
            self._known.pop(path, None)


TRUSTED = Trusted()


class Check:
    """A blob's stored bytes, fed piece by piece (``feed``), against what its name says:
    ``nbytes`` bytes whose content hash is ``blob``, raw or as one zstd frame."""

    def __init__(self, blob: str, nbytes: int, compression: str | None, path: str) -> None:
        self.blob, self.nbytes, self.path = blob, nbytes, path
        self._hash = content_hasher()
        self._seen = 0  # the entry's bytes so far
        self._fault: str | None = None
        self._unpack = None if compression is None else Unpacker(nbytes, compression, self, path, path)

    def write(self, data: bytes | memoryview) -> int:
        """The entry's bytes (a raw piece, or what the frame decompressed to)."""
        self._seen += len(data)
        if self._seen <= self.nbytes:
            self._hash.update(data)
        return len(data)

    def feed(self, piece: memoryview) -> None:
        if self._fault is not None:
            return
        try:
            if self._unpack is None:
                self.write(piece)
            else:
                self._unpack.feed(piece)
        except CorruptCheckpointError as exc:
            self._fault = exc.reason

    def fault(self) -> str | None:
        """None once everything was fed if the blob is what its name says; else why not."""
        if self._fault is not None:
            return self._fault
        if self._seen != self.nbytes:
            return f"it holds {self._seen} bytes, not {self.nbytes}"
        if self._hash.hexdigest() != self.blob:
            return "its bytes are not the ones its name is the hash of"
        return None


def check(
    storage: Storage,
    path: str,
    entry: Entry,
    blob: str,
    nbytes: int,
    compression: str | None,
    on_piece: Callable[[int], object] | None = None,
) -> str | None:
    """Read the blob at ``path`` whole (``entry``: its ``stat``) and check it: None if it
    holds what its name says; else why not (a read that fails included: a blob that
    cannot be read is written again as one that is damaged). ``on_piece(n)`` after each
    piece of ``n`` bytes read. Blocking."""
    try:
        reader = storage.open_read(path)
    except (OSError, CheckpointError) as exc:
        return f"it cannot be read ({exc})"
    try:
        if reader.size != entry.size:
            return "it changed while it was checked"
        checker = Check(blob, nbytes, compression, path)
        buf = memoryview(bytearray(min(PIECE, max(reader.size, 1))))
        for offset in range(0, reader.size, len(buf)):
            piece = buf[: min(len(buf), reader.size - offset)]
            reader.readinto(offset, piece)
            checker.feed(piece)
            if on_piece is not None:
                on_piece(len(piece))
        return checker.fault()
    except (OSError, CheckpointError) as exc:
        return f"it cannot be read ({exc})"
    finally:
        reader.close()


def verified(
    storage: Storage,
    path: str,
    entry: Entry,
    blob: str,
    nbytes: int,
    compression: str | None,
    then: str = "written again",
    on_piece: Callable[[int], object] | None = None,
) -> bool:
    """Whether the blob at ``path`` (``entry``: its ``stat``) may be referred to: trusted
    already, or checked now (and trusted from now on; ``on_piece``: see ``check``). One
    that fails is forgotten, and the user told what happens to it (``then``). Blocking."""
    if TRUSTED.holds(path, entry):
        return True
    fault = check(storage, path, entry, blob, nbytes, compression, on_piece)
    if fault is None:
        TRUSTED.add(path, entry)
        return True
    TRUSTED.forget(path)
    notice(logger, f"the blob {path} cannot be trusted ({fault}): it is {then}")
    return False


def wrote(storage: Storage, path: str) -> None:
    """Trust the blob this process has just committed at ``path``, as it is now. Blocking."""
    entry = storage.stat(path)
    if entry is not None and entry.is_file:
        TRUSTED.add(path, entry)
