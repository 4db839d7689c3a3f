"""Where checkpoints live: the storage interface, an extension point, and its backends.

Every path aiosnap takes may be a local path or a URL; ``from_url`` builds the storage
for a URL explicitly, with options (``storage=aiosnap.storage.from_url(url, ...)``).
A backend implements ``Storage``: ``create`` an ``Upload`` that is invisible until its
``commit``, ``open_read`` a ``Reader`` by byte ranges, ``list``/``stat``/``delete``,
``read_versioned``/``replace_if`` for objects several writers race on, and a
``lease`` per checkpoint directory. Every method is blocking: aiosnap calls them from
worker threads. See the module docstring of ``aiosnap._storage.protocol`` for the contract.
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
