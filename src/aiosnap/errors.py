"""aiosnap's errors: one hierarchy, every one a ``CheckpointError`` (and the warning a user
must see, ``AiosnapWarning``). Each names the path and the reason.

    try:
        restored = await manager.restore()
    except aiosnap.errors.CheckpointNotFoundError:
        ...
"""

from __future__ import annotations

from ._base.errors import CaptureError as CaptureError
from ._base.errors import CheckpointError as CheckpointError
from ._base.errors import CheckpointKeyError as CheckpointKeyError
from ._base.errors import CheckpointNotFoundError as CheckpointNotFoundError
from ._base.errors import ConflictError as ConflictError
from ._base.errors import CorruptCheckpointError as CorruptCheckpointError
from ._base.errors import DirectoryLockedError as DirectoryLockedError
from ._base.errors import ForeignFileError as ForeignFileError
from ._base.errors import IndexWriteError as IndexWriteError
from ._base.errors import LeaseLostError as LeaseLostError
from ._base.errors import LoaderClosedError as LoaderClosedError
from ._base.errors import NotACheckpointError as NotACheckpointError
from ._base.errors import PeerTransferError as PeerTransferError
from ._base.errors import PickleNotAllowedError as PickleNotAllowedError
from ._base.errors import RankFailedError as RankFailedError
from ._base.errors import RemoteStorageError as RemoteStorageError
from ._base.errors import SaveCancelledError as SaveCancelledError
from ._base.errors import StateMismatchError as StateMismatchError
from ._base.errors import StepExistsError as StepExistsError
from ._base.errors import UnsupportedTypeError as UnsupportedTypeError
from ._base.errors import WorkerCrashedError as WorkerCrashedError
from ._base.errors import WriterClosedError as WriterClosedError
from ._base.notice import AiosnapWarning as AiosnapWarning

__all__ = [
    "AiosnapWarning",
    "CaptureError",
    "CheckpointError",
    "CheckpointKeyError",
    "CheckpointNotFoundError",
    "ConflictError",
    "CorruptCheckpointError",
    "DirectoryLockedError",
    "ForeignFileError",
    "IndexWriteError",
    "LeaseLostError",
    "LoaderClosedError",
    "NotACheckpointError",
    "PeerTransferError",
    "PickleNotAllowedError",
    "RankFailedError",
    "RemoteStorageError",
    "SaveCancelledError",
    "StateMismatchError",
    "StepExistsError",
    "UnsupportedTypeError",
    "WorkerCrashedError",
    "WriterClosedError",
]


def _public_names() -> None:
    """Tracebacks name the errors as users import them: ``aiosnap.errors.CorruptCheckpointError``,
    not the private module that defines it. (Here, not in that module: the offload worker
    process imports the bare package, and pickles its errors under their own module.)"""
    for name in __all__:
        globals()[name].__module__ = __name__


_public_names()
