"""File and directory operations the integrations share: recognising aiosnap's own
checkpoints, removing only those, and publishing a checkpoint directory atomically.

Every function here blocks; the bridge runs them in worker threads of its loop.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import struct

import crc32c

from aiosnap.storage import TEMP_PREFIX, LocalStorage, Posix

logger = logging.getLogger(__name__)

#: The header's own checksum, as docs/format.md describes it: the crc32c of the length
#: prefix and the header with these 8 hex digits read as ``00000000``.
_CRC_FIELD = re.compile(rb'"aiosnap_crc32c":"([0-9a-f]{8})"')
_MAX_HEADER = 1 << 30
_local = LocalStorage()
_posix = Posix()


def is_aiosnap_file(path: str) -> bool:
    """Whether ``path`` is a file whose header is an intact aiosnap header (its checksum
    is checked; the data is not read: ``aiosnap.verify`` does that)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                return False
            (n,) = struct.unpack("<Q", prefix)
            if n < 2 or n > size - 8 or n > _MAX_HEADER:
                return False
            header = prefix + f.read(n)
    except OSError:
        return False
    found = list(_CRC_FIELD.finditer(header))
    if len(found) != 1:
        return False
    start, end = found[0].span(1)
    zeroed = header[:start] + b"00000000" + header[end:]
    return int(found[0].group(1), 16) == crc32c.crc32c(zeroed)


def is_aiosnap_dir(path: str, marker: str) -> bool:
    """Whether ``path`` is a checkpoint directory an integration wrote: it holds the
    aiosnap file ``marker``."""
    return os.path.isdir(path) and is_aiosnap_file(os.path.join(path, marker))


def remove_file(path: str) -> bool:
    """Delete ``path`` if it is an aiosnap checkpoint; else leave it, with a warning."""
    if not os.path.lexists(path):
        return False
    if os.path.islink(path) or not is_aiosnap_file(path):
        logger.warning(
            "not removing %s: it is not an aiosnap checkpoint (aiosnap deletes only its own)", path
        )
        return False
    _local.delete(path)
    return True


def remove_dir(path: str, marker: str, *, storage: LocalStorage = _local) -> bool:
    """Delete the checkpoint directory ``path`` if an integration wrote it (it holds the
    aiosnap file ``marker``); else leave it, with a warning. ``storage``: the local disk
    to do it through (tests give one whose system calls fail or stop midway)."""
    if not os.path.lexists(path):
        return False
    if os.path.islink(path) or not is_aiosnap_dir(path, marker):
        logger.warning("not removing %s: aiosnap did not write it (no aiosnap file %s in it)", path, marker)
        return False
    # Renamed to a temp name first, in one step: a process killed while the files go
    # leaves a temp directory, which the next start sweeps, never a checkpoint's name
    # without its marker (which nothing would recognise as aiosnap's any more).
    parent, name = os.path.split(path)
    doomed = os.path.join(parent, f"{TEMP_PREFIX}removed-{name}.{secrets.token_hex(6)}")
    storage.posix.rename(path, doomed)
    storage.posix.fsync_dir(parent or ".")
    storage.delete_tree(doomed)
    return True


def sweep_temps(directory: str) -> list[str]:
    """Remove what interrupted commits left directly in ``directory``: temp files and temp
    directories, whose names start with ``aiosnap.TEMP_PREFIX``; return their paths."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(TEMP_PREFIX)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    swept = [os.path.join(directory, n) for n in names]
    for path in swept:
        if os.path.isdir(path) and not os.path.islink(path):
            _local.delete_tree(path)
        else:
            _local.delete(path)
    if swept:
        logger.info("removed %d temp file(s) of interrupted commits in %s", len(swept), directory)
    return swept


def temp_dir(parent: str, name: str) -> str:
    """Create and return a fresh temp directory for checkpoint ``name`` inside ``parent``."""
    os.makedirs(parent, exist_ok=True)
    path = os.path.join(parent, f"{TEMP_PREFIX}{name}.{secrets.token_hex(6)}")
    os.mkdir(path)
    return path


def discard(path: str) -> None:
    """Remove the temp directory ``path`` of a checkpoint that will not be published."""
    _local.delete_tree(path)


def write_durably(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably (temp file, fsync, rename, fsync
    of the directory)."""
    upload = _local.create(path, len(data))
    try:
        upload.write_at(0, memoryview(data))
        upload.commit()
    except BaseException:
        upload.abort()
        raise


def publish_dir(tmp: str, final: str, marker: str) -> None:
    """Make the complete directory ``tmp`` visible as ``final``: every file in it made
    durable (a framework's hook may have added files aiosnap did not write), then one
    rename, then the parent directory fsynced.

    A ``final`` that already exists is replaced only if it is empty or an integration
    wrote it; it is moved aside first (a crash between the two renames leaves neither
    name half-written: only a temp directory, swept at the next start).
    """
    _sync_tree(tmp)
    parent = os.path.dirname(final)
    aside = None
    if os.path.lexists(final):
        if not (_is_empty_dir(final) or is_aiosnap_dir(final, marker)):
            raise FileExistsError(
                f"{final} exists and aiosnap did not write it: not replaced (the new checkpoint was "
                "discarded; move that directory away or save under another name)"
            )
        aside = os.path.join(
            parent, f"{TEMP_PREFIX}replaced-{os.path.basename(final)}.{secrets.token_hex(6)}"
        )
        _posix.rename(final, aside)
    try:
        _posix.rename(tmp, final)
    except BaseException:
        if aside is not None:
            _posix.rename(aside, final)  # the previous checkpoint stays where it was
        raise
    _posix.fsync_dir(parent or ".")
    if aside is not None:
        _local.delete_tree(aside)


def _sync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _posix.fsync_dir(root)


def _is_empty_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)
