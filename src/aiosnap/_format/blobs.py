"""Where an incremental checkpoint's blobs lie: the blob layout, shared by writing and reading.

A checkpoint file that refers to blobs (``Header.refs``) finds them in the blob folder
(``aiosnap-blobs/``) beside it; a rank's file of a step directory, in that rank's folder
of the blob folder beside the step directory (``Header.blob_dir``), which all the rank's
steps share. A blob's file is named by its content hash, with a suffix for how it is
stored (docs/format.md, "References and blobs").
"""

from __future__ import annotations

from .._base.names import BLOB_DIR
from .._storage.protocol import Storage

#: The file name of a blob of each kind (raw bytes, or a zstd frame of them).
SUFFIXES = {None: "", "zstd": ".zst"}


def blob_file(blob: str, compression: str | None) -> str:
    """The file name of blob ``blob`` stored with ``compression``."""
    return blob + SUFFIXES[compression]


def blob_dir(storage: Storage, path: str, rank_dir: str | None = None) -> str:
    """The blob folder of the checkpoint file at ``path``: beside it; or for a rank's file
    of a step directory (``rank_dir``: the rank's folder name), that rank's folder beside
    the step directory, which all the rank's steps share."""
    directory = storage.split(path)[0]
    if rank_dir is None:
        return storage.join(directory, BLOB_DIR)
    return storage.join(storage.split(directory)[0], BLOB_DIR, rank_dir)
