"""aiosnap: asyncio-native checkpointing for PyTorch and NumPy training.

A save is ``await writer(filename, out_dir, state)``. The call returns as soon as the
state is *captured* -- its tensors copied into a reusable staging arena laid out as
the file image -- and training goes on while the image is committed in the
background: written to a temp file in the target directory, fsynced, renamed over the
target and the directory fsynced, in a worker thread or a worker process that reads
the arena from shared memory.

Data flows one way, a folder a floor (ARCHITECTURE.md walks through it): ``_format``
captures the state tree and lays out the file image with its checksummed header,
``_save`` stages it into the arena and commits it through a ``_storage`` backend (the
writers only choose *when* each step runs); ``_load`` runs it backwards, verifying
every checksum. All blocking work passes through ``_base.offload``.

``CheckpointManager`` (``_manager``) names, indexes, rotates and restores checkpoints
of a directory (a ``Site``), and uploads them to a remote tier (a ``Tier``, a Site of
its own opened in the background). A process is a group of one: in a
torch.distributed group every rank writes its own file of a step directory, and rank 0
writes the manifest that commits the step only once all reported success, over a
gloo channel of aiosnap's own (``_dist``). ``_cli`` is the command line; ``_train``
the Job, AsyncLoader and RNGState; ``integrations`` the trainers' plug-ins.
"""

from __future__ import annotations

import logging as _logging

from . import errors as errors
from . import retention as retention
from . import storage as storage
from . import triggers as triggers
from ._api import load_into_sync as load_into_sync
from ._api import load_sync as load_sync
from ._api import save as save
from ._api import save_sync as save_sync
from ._api import standalone_sync as standalone_sync
from ._api import verify_sync as verify_sync
from ._base.tasks import SaveFailure as SaveFailure
from ._load.load import VerifyReport as VerifyReport
from ._load.load import load as load
from ._load.load import load_into as load_into
from ._load.load import verify as verify
from ._load.standalone import standalone as standalone
from ._manager.manager import CheckpointManager as CheckpointManager
from ._manager.options import Ranks as Ranks
from ._manager.options import Remote as Remote
from ._manager.port import ManagedWriter as ManagedWriter
from ._manager.records import CheckpointRecord as CheckpointRecord
from ._manager.tiers import Restored as Restored
from ._manager.upload import UploadWriter as UploadWriter
from ._save.handle import SaveHandle as SaveHandle
from ._save.handle import SaveStats as SaveStats
from ._save.options import Incremental as Incremental
from ._save.options import WriterOptions as WriterOptions
from ._save.writers import ProcessQueueWriter as ProcessQueueWriter
from ._save.writers import ProcessWriter as ProcessWriter
from ._save.writers import QueueWriter as QueueWriter
from ._save.writers import SimpleWriter as SimpleWriter
from ._save.writers import StandardWriter as StandardWriter
from ._save.writers import ThreadQueueWriter as ThreadQueueWriter
from ._save.writers import ThreadWriter as ThreadWriter
from ._save.writers import Writer as Writer
from ._train.job import Group as Group
from ._train.job import Job as Job
from ._train.job import JobRunner as JobRunner
from ._train.job import RunContext as RunContext
from ._train.job import epoch_limiter as epoch_limiter
from ._train.loader import AsyncLoader as AsyncLoader
from ._train.rng import RNGState as RNGState

__version__ = "0.1.0"

__all__ = [
    "AsyncLoader",
    "CheckpointManager",
    "CheckpointRecord",
    "Group",
    "Incremental",
    "Job",
    "JobRunner",
    "ManagedWriter",
    "ProcessQueueWriter",
    "ProcessWriter",
    "QueueWriter",
    "RNGState",
    "Ranks",
    "Remote",
    "Restored",
    "RunContext",
    "SaveFailure",
    "SaveHandle",
    "SaveStats",
    "SimpleWriter",
    "StandardWriter",
    "ThreadQueueWriter",
    "ThreadWriter",
    "UploadWriter",
    "VerifyReport",
    "Writer",
    "WriterOptions",
    "epoch_limiter",
    "errors",
    "load",
    "load_into",
    "load_into_sync",
    "load_sync",
    "retention",
    "save",
    "save_sync",
    "standalone",
    "standalone_sync",
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
