"""Collecting the blobs of a directory that no checkpoint refers to any more.

The references are read from the checkpoints themselves (every file aiosnap wrote in
the directory, and in its step directories), never from the index, so a lost or stale
index changes nothing. A blob is deleted only if it lies in aiosnap's own folder, is
named as aiosnap names blobs (a content hash, with the suffix of its compression), no
file refers to it, and no save of this process pinned it while the collection ran
(see ``_save/incremental``). Retention runs it after the checkpoints it removed are
gone: a crash between the two leaves blobs nobody refers to, never a reference to a
missing blob.
"""

from __future__ import annotations

import functools
import logging

from .._base.checksums import is_content_hash
from .._base.errors import CheckpointError
from .._base.names import BLOB_DIR, RESERVED_PREFIXES
from .._format.codec import read_header, written_by_aiosnap
from .._save.incremental import PINS, SUFFIXES, blob_file
from .._storage.protocol import Storage

logger = logging.getLogger(__name__)


def blob_of(name: str) -> str | None:
    """The content hash a blob file is named by; None for a name aiosnap never gives one."""
    for suffix in sorted(SUFFIXES.values(), key=len, reverse=True):
        if suffix and not name.endswith(suffix):
            continue
        blob = name[: len(name) - len(suffix)] if suffix else name
        if is_content_hash(blob):
            return blob
    return None


def referenced(storage: Storage, directory: str, rank_dir: str | None = None) -> set[str]:
    """The blob files of one folder that the checkpoints in ``directory`` refer to: the
    shared folder (``rank_dir`` None), which only the files beside it can refer to; or a
    rank's folder, which only that rank's files in the step directories can (a rank's
    file bears its folder's name). A file whose header cannot be read refers to nothing:
    it cannot be restored either. Blocking."""
    found: set[tuple[str | None, str]] = set()
    for entry in storage.list(directory):
        if entry.name.startswith(RESERVED_PREFIXES):  # the index, the lock, temp files, blobs
            continue
        path = storage.join(directory, entry.name)
        if entry.is_dir and rank_dir is not None:
            if any(inner.is_file and inner.name == rank_dir for inner in storage.list(path)):
                found |= _refs_of(storage, storage.join(path, rank_dir))
        elif entry.is_file and rank_dir is None:
            found |= _refs_of(storage, path)
    return {name for where, name in found if where == rank_dir}


def _refs_of(storage: Storage, path: str) -> set[tuple[str | None, str]]:
    """The blobs the file at ``path`` refers to. A file gone meanwhile, not aiosnap's,
    or whose header fails its checks refers to none; a read that fails (OSError) fails
    the collection: that file's references are unknown."""
    try:
        f = storage.open_read(path)
    except CheckpointError:
        return set()
    try:
        if not written_by_aiosnap(f):
            return set()
        header = read_header(f)
    except CheckpointError:
        return set()
    finally:
        f.close()
    return {(header.blob_dir, blob_file(ref.blob, ref.compression)) for ref in header.refs.values()}


def collect(storage: Storage, directory: str, rank_dir: str | None = None) -> list[str]:
    """Delete the blobs of ``directory`` that nothing refers to; their paths. ``rank_dir``:
    those of one rank's folder (a group's; only that rank collects it, as only its own
    saves write there). A failed read or delete ends the collection early, with a
    warning: what is left is collected the next time. Blocking."""
    try:
        return _collect(storage, directory, rank_dir)
    except OSError as exc:
        logger.warning("%s: unreferenced blobs were not all removed (%r); the next prune is", directory, exc)
        return []


def _collect(storage: Storage, directory: str, rank_dir: str | None) -> list[str]:
    top = storage.join(directory, BLOB_DIR)
    folder = top if rank_dir is None else storage.join(top, rank_dir)
    PINS.begin()  # before anything is listed: a pin from now on keeps its blob
    try:
        parent, name = (directory, BLOB_DIR) if rank_dir is None else (top, rank_dir)
        if not any(e.is_dir and e.name == name for e in storage.list(parent)):
            return []  # no blobs (an object store lists a folder as a common prefix)
        blobs = [e.name for e in storage.list(folder) if e.is_file and blob_of(e.name) is not None]
        if not blobs:
            return []
        kept = referenced(storage, directory, rank_dir)
        gone = []
        for name in blobs:
            if name in kept:
                continue
            path = storage.join(folder, name)
            if PINS.delete_unless_pinned(str(blob_of(name)), functools.partial(storage.delete, path)):
                gone.append(path)
    finally:
        PINS.end()
    if gone:
        logger.info("%s: removed %d blobs no checkpoint refers to", folder, len(gone))
    return gone
