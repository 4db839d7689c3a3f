"""A CheckpointManager's grouped options, and every rule that ties them together: one place.

What belongs together is one object, as httpx groups its ``Timeout`` and ``Limits``:
``Remote`` (the remote tier: its directory, storage, retention, uploads), ``Ranks`` (how
this process checkpoints with others) and, from the writers' floor, ``Incremental``.
The common cases have shorthands: ``remote="s3://bucket/run"`` is ``Remote(...)`` of
that URL, ``incremental=True`` is ``Incremental()``. Each check raises ValueError naming
the option, before anything is opened.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal, final

from .._save.options import Incremental
from .._storage.protocol import Storage
from .retention import RetentionPolicy
from .site import Group
from .upload import UploadWriter


@final
@dataclass(frozen=True, slots=True)
class Remote:
    """A remote tier: each committed checkpoint is uploaded in the background to ``url``
    (any URL or path), committed there as a save is (see ``CheckpointManager``).

    Args:
        url: the remote tier's directory.
        keep: its retention policy (None keeps everything).
        storage: its storage (by default, what ``url`` names).
        upload: ``"every"`` committed save is uploaded, or ``"manual"`` (``upload()``).
        uploader: the UploadWriter of the tier (retries, waiting uploads).
        timeout: seconds a manager waits for the remote tier's first answer where it
            must read it (``latest_step``, ``restore``, ``resume``) before it goes on
            from the local tier, or, with nothing there, RemoteStorageError says the
            remote is unavailable and what to do (None: no bound). A group goes by what
            rank 0 found.
    """

    url: str
    _: KW_ONLY
    keep: RetentionPolicy | None = None
    storage: Storage | None = None
    upload: Literal["every", "manual"] = "every"
    uploader: UploadWriter | None = None
    timeout: float | None = 30.0

    def __post_init__(self) -> None:
        if self.upload not in ("every", "manual"):
            raise ValueError(f"upload must be 'every' or 'manual', not {self.upload!r}")
        theirs = None if self.uploader is None else self.uploader.storage
        if theirs is not None and theirs is not self.storage:
            raise ValueError("the uploader's storage= is not the Remote's storage=")


@final
@dataclass(frozen=True, slots=True)
class Ranks:
    """How this process checkpoints with others (see ``CheckpointManager``, "Process
    groups").

    Args:
        group: the torch.distributed group to checkpoint with (None: the default group
            when torch.distributed is initialised; False: none).
        rank: this process's rank among processes that share a directory without a
            group (a ``{rank}`` in the manager's ``name`` keeps their files apart).
        replicated: globs of tree paths every rank holds the same (rank 0 stores them).
        timeout: seconds of silence after which a rank of the group counts as failed.
        replicas: 1 keeps a copy of each rank's committed file on a partner node, when
            the ranks save to node-local directories (docs/nodes.md); 0 (the default) none.
    """

    group: Any = None
    _: KW_ONLY
    rank: int = 0
    replicated: Sequence[str] = ()
    timeout: float = 300.0
    replicas: int = 0

    def __post_init__(self) -> None:
        if self.replicas not in (0, 1):
            raise ValueError(f"replicas={self.replicas!r}: 0 or 1 (a copy on one partner node)")


def remote_of(value: str | Remote | None) -> Remote | None:
    """``remote=`` as given: a Remote, or a URL or path (``Remote(url)``), or None."""
    return Remote(value) if isinstance(value, str) else value


def group_of(name: str, ranks: Ranks | None) -> Group:
    """How this process checkpoints (``ranks``: on its own unless a group is found)."""
    ranks = ranks if ranks is not None else Ranks()
    if not _in_a_group(ranks.group):
        if ranks.replicated or ranks.replicas:
            raise ValueError(f"{'replicated=' if ranks.replicated else 'replicas='} needs a process group")
        return Group(None, ranks.rank, 1, None, (), ranks.timeout)
    if "{rank}" in name:
        raise ValueError(f"name {name!r}: in a group each step is a directory; drop {{rank}}")
    from .._dist import coord

    parent = None if ranks.group is None else ranks.group
    rank, size = coord.rank_and_size(parent)
    return Group(parent, rank, size, size, tuple(ranks.replicated), ranks.timeout, ranks.replicas)


def _in_a_group(group: object) -> bool:
    """Whether this process checkpoints with a group (torch.distributed is only looked at
    if its user imported it)."""
    if group is False:
        return False
    if group is not None:
        return True
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def check_writer_given(writer: object, incremental: Incremental | None) -> None:
    """A writer given carries its own incremental options."""
    if writer is not None and incremental is not None:
        raise ValueError("incremental= goes to the writer when one is given")
