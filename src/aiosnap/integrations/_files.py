"""File and directory operations the integrations share: recognising aiosnap's own
checkpoints, removing only those, and publishing a checkpoint directory atomically (and
repairing a publish cut short, see ``publish_dir``).

Every function here blocks; the bridge runs them in worker threads of its loop.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import secrets
import struct

import crc32c

from aiosnap._storage import inflight
from aiosnap.storage import TEMP_PREFIX, LocalStorage

logger = logging.getLogger(__name__)

#: The header's own checksum, as docs/format.md describes it: the crc32c of the length
#: prefix and the header with these 8 hex digits read as ``00000000``.
_CRC_FIELD = re.compile(rb'"aiosnap_crc32c":"([0-9a-f]{8})"')
_MAX_HEADER = 1 << 30
#: The local disk every function here goes through (a child process in the tests swaps
#: its system calls for ones that stop before each call).
_local = LocalStorage()

#: The roles of the integrations' temp directories: a new checkpoint being filled (swept
#: if cut short), an old one moved aside by a publish that replaces it (put back if the
#: new one never arrived), one being deleted (swept).
NEW, OLD, REMOVED = "new", "old", "removed"
_DIR_TEMP = re.compile(
    rf"^{re.escape(TEMP_PREFIX)}(?P<role>{NEW}|{OLD}|{REMOVED})-[0-9a-f]{{12}}-(?P<name>.+)$", re.DOTALL
)


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


Marker = str | tuple[str, ...]
"""The name of the aiosnap file that marks an integration's checkpoint directory, or the
names of which any one does (a layout whose files vary)."""


def is_aiosnap_dir(path: str, marker: Marker) -> bool:
    """Whether ``path`` is a checkpoint directory an integration wrote: it holds the
    aiosnap file ``marker`` (one of them, for several)."""
    names = (marker,) if isinstance(marker, str) else marker
    return os.path.isdir(path) and any(is_aiosnap_file(os.path.join(path, name)) for name in names)


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


def remove_dir(path: str, marker: Marker, *, storage: LocalStorage | None = None) -> bool:
    """Delete the checkpoint directory ``path`` if an integration wrote it (it holds the
    aiosnap file ``marker``); else leave it, with a warning. ``storage``: the local disk
    to do it through (tests give one whose system calls fail or stop midway)."""
    storage = _local if storage is None else storage
    if not os.path.lexists(path):
        return False
    if os.path.islink(path) or not is_aiosnap_dir(path, marker):
        logger.warning("not removing %s: aiosnap did not write it (no aiosnap file %s in it)", path, marker)
        return False
    # Renamed to a temp name first, in one step: a process killed while the files go
    # leaves a temp directory, which the next start sweeps, never a checkpoint's name
    # without its marker (which nothing would recognise as aiosnap's any more).
    parent, name = os.path.split(path)
    doomed = os.path.join(parent, _temp_name(REMOVED, name))
    held = inflight.lock_aside(storage.posix, path, os.path.basename(doomed))
    try:
        storage.posix.rename(path, doomed)
        storage.posix.fsync_dir(parent or ".")
        storage.delete_tree(doomed)
    finally:
        inflight.release(storage.posix, os.path.basename(doomed), held)
    return True


def sweep_temps(directory: str, marker: Marker | None = None) -> list[str]:
    """Remove what interrupted commits left directly in ``directory`` (temp files and temp
    directories, whose names start with ``aiosnap.storage.TEMP_PREFIX``) and return their paths;
    first put back the checkpoint directories a publish cut short had moved aside
    (``repair_publishes``). An old directory whose name holds a checkpoint again goes only
    where that checkpoint is an integration's (it holds the aiosnap file ``marker``).

    A writer calls it without holding the directory (no lease): it removes only what no
    live commit holds, of any writer of this process or of another process (the commit
    locks its temp file until the rename, and the kernel drops the lock of a dead one;
    see ``aiosnap._storage.inflight``). A symbolic link is never removed, whatever its name."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(TEMP_PREFIX)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    restored = repair_publishes(directory) if names else []
    swept = []
    for name in names:
        path = os.path.join(directory, name)
        temp = _DIR_TEMP.match(name)
        if path in restored:
            continue
        if temp is not None and temp["role"] == OLD and not _superseded(directory, temp["name"], marker):
            continue  # an old checkpoint still needed, or one nobody can tell is: kept
        remove = _local.delete_tree if os.path.isdir(path) and not os.path.islink(path) else _local.delete
        if inflight.reclaim(_local.posix, path, remove):  # never one live work holds
            swept.append(path)
    if swept:
        logger.info("removed %d temp file(s) of interrupted commits in %s", len(swept), directory)
    return swept


def repair_publishes(directory: str, name: str | None = None) -> list[str]:
    """Put back every checkpoint directory in ``directory`` (or only ``name``) that a
    ``publish_dir`` cut short between its two renames left aside: its name is missing
    (or an empty directory) and exactly one old directory of that name stands beside it.
    Returns the temp paths it renamed. Deletes nothing; ``sweep_temps`` does."""
    try:
        entries = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    asides: dict[str, list[str]] = {}
    for entry in sorted(entries):
        match = _DIR_TEMP.match(entry)
        if match is not None and match["role"] == OLD and name in (None, match["name"]):
            asides.setdefault(match["name"], []).append(os.path.join(directory, entry))
    restored = []
    for final_name, paths in asides.items():
        final = os.path.join(directory, final_name)
        if os.path.lexists(final) and not _is_empty_dir(final):
            continue  # the new checkpoint is in place (or something else stands there)
        if len(paths) > 1:
            logger.warning(
                "not restoring %s: %d old directories of it (%s), which one is its last is unknown",
                final,
                len(paths),
                ", ".join(paths),
            )
            continue
        # Never one a live publish (of any writer or process) holds, between its renames.
        if not inflight.reclaim(_local.posix, paths[0], functools.partial(_put_back, final)):
            continue
        _local.posix.fsync_dir(directory or ".")  # durable before a sweep deletes the new one
        restored.append(paths[0])
    return restored


def _put_back(final: str, aside: str) -> None:
    logger.warning("restoring %s from %s: a save that was replacing it was cut short", final, aside)
    _local.posix.rename(aside, final)  # replaces an empty directory in one step


def _superseded(directory: str, name: str, marker: Marker | None) -> bool:
    """Whether an old directory of checkpoint ``name`` may go: the name holds one of the
    integrations' checkpoints again (a new one put in place, or the old one restored)."""
    final = os.path.join(directory, name)
    if marker is not None and not os.path.islink(final) and is_aiosnap_dir(final, marker):
        return True
    if os.path.lexists(final):
        logger.warning(
            "keeping the old directories of %s (%s*): aiosnap did not write what stands there now",
            final,
            os.path.join(directory, f"{TEMP_PREFIX}{OLD}-"),
        )
    return False


def temp_dir(parent: str, name: str) -> str:
    """Create and return a fresh temp directory for checkpoint ``name`` inside ``parent``,
    held (no sweep takes it) until ``publish_dir`` or ``discard`` ends it."""
    os.makedirs(parent, exist_ok=True)
    path, fd = inflight.create_dir(_local.posix, parent, lambda token: _temp_name(NEW, name, token))
    _filling[path] = fd
    return path


def discard(path: str) -> None:
    """Remove the temp directory ``path`` of a checkpoint that will not be published."""
    try:
        _local.delete_tree(path)
    finally:
        _let_go(path)


#: The temp directories being filled in this process, and the descriptors holding them.
_filling: dict[str, int] = {}


def _let_go(path: str) -> None:
    """``path``, a temp directory of ``temp_dir``, is published or deleted: no longer held."""
    inflight.release(_local.posix, os.path.basename(path), _filling.pop(path, None))


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


def publish_dir(tmp: str, final: str, marker: Marker) -> None:
    """Make the complete directory ``tmp`` visible as ``final``: every file in it made
    durable (a framework's hook may have added files aiosnap did not write), then one
    rename, then the parent directory fsynced.

    A ``final`` that already exists is replaced only if it is empty or an integration
    wrote it. It is renamed aside first, to an old directory of its name (``old-``), and
    deleted once the new one is in place and durable. A process killed between the two
    renames leaves the old checkpoint there and no ``final``: ``repair_publishes`` (run by
    the loaders, the sweep and the next publish of ``final``) renames it back. So at every
    instant ``final`` holds the old checkpoint or the new one, or is put back to the old.
    """
    parent, name = os.path.split(final)
    repair_publishes(parent, name)  # a publish of the same name cut short: its old one back
    _sync_tree(tmp)
    aside = None
    if os.path.lexists(final):
        if not (_is_empty_dir(final) or is_aiosnap_dir(final, marker)):
            raise FileExistsError(
                f"{final} exists and aiosnap did not write it: not replaced (the new checkpoint was "
                "discarded; move that directory away or save under another name)"
            )
        aside = os.path.join(parent, _temp_name(OLD, name))
    held = None if aside is None else inflight.lock_aside(_local.posix, final, os.path.basename(aside))
    try:
        if aside is not None:
            _local.posix.rename(final, aside)
        try:
            _local.posix.rename(tmp, final)
        except BaseException:
            if aside is not None:
                _local.posix.rename(aside, final)  # the previous checkpoint stays where it was
            raise
        _local.posix.fsync_dir(parent or ".")
        _let_go(tmp)
        if aside is not None:
            _local.delete_tree(aside)
    finally:
        if aside is not None:
            inflight.release(_local.posix, os.path.basename(aside), held)


def _sync_tree(path: str) -> None:
    posix = _local.posix
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = posix.open(os.path.join(root, name), os.O_RDONLY)
            try:
                posix.fsync(fd)
            finally:
                posix.close(fd)
        posix.fsync_dir(root)


def _temp_name(role: str, name: str, token: str | None = None) -> str:
    """The temp name of a directory of checkpoint ``name`` in ``role``: the role and a
    random token in fixed places, the checkpoint's name last, whole, so each is read back
    without doubt (``_DIR_TEMP``) whatever the checkpoint's name holds."""
    return f"{TEMP_PREFIX}{role}-{token or secrets.token_hex(6)}-{name}"


def _is_empty_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)
