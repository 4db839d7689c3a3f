"""aiosnap: asyncio-native checkpointing for PyTorch and NumPy training.

A save is ``await writer(filename, out_dir, state)``. The call returns as soon as the
state is *captured* -- its tensors copied into a reusable staging arena laid out as
the file image -- and training goes on while the image is committed in the
background: written to a temp file in the target directory, fsynced, renamed over the
target and the directory fsynced, in a worker thread or a worker process that reads
the arena from shared memory.

Data flows one way, one module a step: ``_tree`` captures the state tree, ``_stage``
copies it into the arena, ``_format`` encodes the safetensors-compatible header with
checksums, ``_engine`` runs the commit through a ``_storage`` backend. Loading runs
it backwards in ``_load``, verifying every checksum. The writers in ``_writers`` only
choose *when* each step runs; all blocking work passes through ``_offload``.

``CheckpointManager`` (``_manager``) names, indexes (``_catalog``), rotates and
restores checkpoints. A process is a group of one (``_member``): in a
torch.distributed group every rank writes its own file of a step directory
(``_layouts``, ``_group``), and rank 0 (``_decisions``) writes the manifest that
commits the step only once all reported success over a gloo channel of aiosnap's
own (``_coord``). Storage backends (``_local``, ``_objstore``, ``_fsspec``)
implement ``_storage``; a second tier uploads committed checkpoints (``_upload``).
"""

from __future__ import annotations

import logging as _logging

from . import retention as retention
from . import storage as storage
from . import triggers as triggers
from ._api import load_into_sync as load_into_sync
from ._api import load_sync as load_sync
from ._api import save as save
from ._api import save_sync as save_sync
from ._api import verify_sync as verify_sync
from ._errors import CheckpointError as CheckpointError
from ._errors import CheckpointKeyError as CheckpointKeyError
from ._errors import CheckpointNotFoundError as CheckpointNotFoundError
from ._errors import ConflictError as ConflictError
from ._errors import CorruptCheckpointError as CorruptCheckpointError
from ._errors import DirectoryLockedError as DirectoryLockedError
from ._errors import ForeignFileError as ForeignFileError
from ._errors import IndexWriteError as IndexWriteError
from ._errors import LeaseLostError as LeaseLostError
from ._errors import LoaderClosedError as LoaderClosedError
from ._errors import NotACheckpointError as NotACheckpointError
from ._errors import PickleNotAllowedError as PickleNotAllowedError
from ._errors import RankFailedError as RankFailedError
from ._errors import RemoteStorageError as RemoteStorageError
from ._errors import StateMismatchError as StateMismatchError
from ._errors import StepExistsError as StepExistsError
from ._errors import UnsupportedTypeError as UnsupportedTypeError
from ._errors import WorkerCrashedError as WorkerCrashedError
from ._errors import WriterClosedError as WriterClosedError
from ._handle import SaveFailure as SaveFailure
from ._handle import SaveHandle as SaveHandle
from ._handle import SaveStats as SaveStats
from ._job import Group as Group
from ._job import Job as Job
from ._job import JobRunner as JobRunner
from ._job import RunContext as RunContext
from ._job import epoch_limiter as epoch_limiter
from ._load import VerifyReport as VerifyReport
from ._load import load as load
from ._load import load_into as load_into
from ._load import verify as verify
from ._loader import AsyncLoader as AsyncLoader
from ._local import LocalStorage as LocalStorage
from ._manager import CheckpointManager as CheckpointManager
from ._manager import Restored as Restored
from ._records import CheckpointRecord as CheckpointRecord
from ._retention import AnyOf as AnyOf
from ._retention import KeepBest as KeepBest
from ._retention import KeepEvery as KeepEvery
from ._retention import KeepLast as KeepLast
from ._retention import KeepWithin as KeepWithin
from ._retention import RetentionPolicy as RetentionPolicy
from ._rng import RNGState as RNGState
from ._storage import TEMP_PREFIX as TEMP_PREFIX
from ._storage import CommitTimes as CommitTimes
from ._storage import Storage as Storage
from ._triggers import AnyTrigger as AnyTrigger
from ._triggers import AtSteps as AtSteps
from ._triggers import EveryNEpochs as EveryNEpochs
from ._triggers import EveryNSeconds as EveryNSeconds
from ._triggers import EveryNSteps as EveryNSteps
from ._triggers import Moment as Moment
from ._triggers import Trigger as Trigger
from ._upload import UploadWriter as UploadWriter
from ._writers import ProcessQueueWriter as ProcessQueueWriter
from ._writers import ProcessWriter as ProcessWriter
from ._writers import QueueWriter as QueueWriter
from ._writers import SimpleWriter as SimpleWriter
from ._writers import StandardWriter as StandardWriter
from ._writers import ThreadQueueWriter as ThreadQueueWriter
from ._writers import ThreadWriter as ThreadWriter
from ._writers import Writer as Writer
from ._writers import WriterOptions as WriterOptions

__version__ = "0.1.0"

__all__ = [
    "AnyOf",
    "AnyTrigger",
    "AsyncLoader",
    "AtSteps",
    "CheckpointError",
    "CheckpointKeyError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointRecord",
    "CommitTimes",
    "ConflictError",
    "CorruptCheckpointError",
    "DirectoryLockedError",
    "EveryNEpochs",
    "EveryNSeconds",
    "EveryNSteps",
    "ForeignFileError",
    "Group",
    "IndexWriteError",
    "Job",
    "JobRunner",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "KeepWithin",
    "LeaseLostError",
    "LoaderClosedError",
    "LocalStorage",
    "Moment",
    "NotACheckpointError",
    "PickleNotAllowedError",
    "ProcessQueueWriter",
    "ProcessWriter",
    "QueueWriter",
    "RNGState",
    "RankFailedError",
    "RemoteStorageError",
    "Restored",
    "RetentionPolicy",
    "RunContext",
    "SaveFailure",
    "SaveHandle",
    "SaveStats",
    "SimpleWriter",
    "StandardWriter",
    "StateMismatchError",
    "StepExistsError",
    "Storage",
    "TEMP_PREFIX",
    "ThreadQueueWriter",
    "ThreadWriter",
    "Trigger",
    "UnsupportedTypeError",
    "UploadWriter",
    "VerifyReport",
    "WorkerCrashedError",
    "Writer",
    "WriterClosedError",
    "WriterOptions",
    "epoch_limiter",
    "load",
    "load_into",
    "load_into_sync",
    "load_sync",
    "retention",
    "save",
    "save_sync",
    "storage",
    "triggers",
    "verify",
    "verify_sync",
]

_logging.getLogger(__name__).addHandler(_logging.NullHandler())


def __dir__() -> list[str]:
    """``dir(aiosnap)``: the public names and the module's own dunders, not the names
    its source needs (``annotations``, the submodules it imports)."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
