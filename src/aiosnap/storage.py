"""Where checkpoints live: the storage interface, an extension point, and its backends.

Every path aiosnap takes may be a local path or a URL; ``from_url`` builds the storage
for a URL explicitly, with options (``storage=aiosnap.storage.from_url(url, ...)``).

A backend implements ``Storage``: ``create`` an ``Upload`` that is invisible until its
``commit`` makes it visible whole, ``open_read`` a ``Reader`` by byte ranges,
``list``/``stat``/``delete``/``delete_tree``, ``read_versioned``/``replace_if`` for the
small objects several writers race on (a replace happens only if the object is still at
the version read), a ``lease`` per checkpoint directory, and ``sweep_incomplete`` for
what killed commits left. Every method is blocking: aiosnap calls them from worker
threads. The documentation's "Write your own storage backend" (docs/storage-backend.md)
states the whole contract, with a complete in-memory backend that aiosnap's own contract
tests run against.

``Posix`` is the seam of ``LocalStorage``: every system call it makes goes through one,
so a subclass can fail, count or stop them (``LocalStorage(posix=...)``).
"""

from __future__ import annotations

from ._format.manifest import MANIFEST_NAME as MANIFEST_NAME
from ._manager import catalog as _catalog
from ._storage.backends import from_url as from_url
from ._storage.backends import resolve as resolve
from ._storage.fsspec import FsspecStorage as FsspecStorage
from ._storage.local import LocalStorage as LocalStorage
from ._storage.objstore import ObjectStorage as ObjectStorage
from ._storage.posix import FileStat as FileStat
from ._storage.posix import Posix as Posix
from ._storage.protocol import LEASE_NAME as LEASE_NAME
from ._storage.protocol import TEMP_PREFIX as TEMP_PREFIX
from ._storage.protocol import CommitTimes as CommitTimes
from ._storage.protocol import Entry as Entry
from ._storage.protocol import Lease as Lease
from ._storage.protocol import Reader as Reader
from ._storage.protocol import Storage as Storage
from ._storage.protocol import Upload as Upload
from ._storage.protocol import Version as Version

INDEX_NAME: str = _catalog.INDEX_NAME
"""The index a CheckpointManager keeps in its directory (``aiosnap-index.json``): the
committed checkpoints, their metrics and the history of commits. Written by replacing it
whole (``Storage.replace_if``); rebuilt from the files when it is lost."""

__all__ = [
    "CommitTimes",
    "Entry",
    "FileStat",
    "FsspecStorage",
    "INDEX_NAME",
    "LEASE_NAME",
    "Lease",
    "LocalStorage",
    "MANIFEST_NAME",
    "ObjectStorage",
    "Posix",
    "Reader",
    "Storage",
    "TEMP_PREFIX",
    "Upload",
    "Version",
    "from_url",
    "resolve",
]
