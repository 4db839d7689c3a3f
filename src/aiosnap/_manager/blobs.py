"""Collecting the blobs of a directory that no checkpoint refers to any more.

The references are read from the checkpoints themselves (every file aiosnap wrote in
the directory, and in its step directories), never from the index, so a lost or stale
index changes nothing. A blob is deleted only if it lies in aiosnap's own folder, is
named as aiosnap names blobs (a content hash, with the suffix of its compression), no
file refers to it, and no save of this process pinned it while the collection ran
(see ``_save/incremental``). Retention runs it after the checkpoints it removed are
gone: a crash between the two leaves blobs nobody refers to, never a reference to a
missing blob.

The temp files a killed save left in the blob folders are swept at open and by
``prune`` (``sweep``), never one of a blob this process is writing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from .._base.checksums import is_content_hash
from .._base.errors import CheckpointError
from .._base.names import BLOB_DIR, RESERVED_PREFIXES
from .._format.blobs import SUFFIXES, blob_file
from .._format.codec import read_header, written_by_aiosnap
from .._save.incremental import PINS
from .._save.trust import TRUSTED
from .._storage.protocol import TEMP_PREFIX, Storage, lstat

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


def sweep(storage: Storage, directory: str, *, idle: bool) -> list[str]:
    """Remove the temp files that killed saves left in the blob folders of ``directory``
    (``aiosnap-blobs/`` and each rank's folder in it), as the directory's own are swept:
    aiosnap's temp names only, regular files only, no link followed; and never the temp
    file of a blob that a save or upload of this process has pinned (it is being
    written). A backend that cannot name its temp files (no ``incomplete`` method) is
    swept by its ``sweep_incomplete``, and only where ``idle`` (at open, when no save of
    the directory can be in flight). The paths removed; a failure ends the sweep with a
    warning (the next one takes what is left). Blocking."""
    try:
        return _sweep(storage, directory, idle)
    except OSError as exc:
        logger.warning(
            "%s: temp files in %s were not all removed (%r); the next open does", directory, BLOB_DIR, exc
        )
        return []


def _sweep(storage: Storage, directory: str, idle: bool) -> list[str]:
    top = storage.join(directory, BLOB_DIR)
    entry = lstat(storage, top)
    if entry is None or entry.special or not entry.is_dir:
        return []  # none, or a user's link or file: never followed
    folders = [top] + [storage.join(top, e.name) for e in storage.list(top) if e.is_dir and not e.special]
    names: Callable[[str], list[str]] | None = getattr(storage, "incomplete", None)
    gone: list[str] = []
    for folder in folders:
        if names is None:
            gone += storage.sweep_incomplete(folder) if idle else []
            continue
        PINS.begin()  # before the listing: a blob pinned from now on keeps its temp file
        try:
            for name in names(folder):
                path = storage.join(folder, name)
                blob = blob_of(name[len(TEMP_PREFIX) :].rpartition(".")[0]) or ""
                if PINS.delete_unless_pinned(blob, functools.partial(storage.delete, path)):
                    gone.append(path)
        finally:
            PINS.end()
    if gone:
        logger.info("%s: removed %d temp file(s) of killed saves in %s", directory, len(gone), BLOB_DIR)
    return gone


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
                TRUSTED.forget(path)  # what this process checked of it goes with it
                gone.append(path)
    finally:
        PINS.end()
    if gone:
        logger.info("%s: removed %d blobs no checkpoint refers to", folder, len(gone))
    return gone
