"""The manager's one port to its writer: what a managed writer offers, found out once.

A CheckpointManager saves through a writer. aiosnap's writers offer all it can use
(``ManagedWriter``: a save accepted before its capture, lazily if asked; whether a call
returns durable; incremental saves and where their blobs go); a writer of one's own may
offer only the ``Writer`` protocol, or only a call. ``WriterPort`` looks at the writer
once, when the manager is made, and from then on the manager asks the port, never the
writer what it is. A read-only manager's port never opens its writer.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .._base.tasks import SaveFailure
from .._save.engine import SaveFun
from .._save.handle import SaveHandle
from .._save.options import CaptureMode, Incremental, QueueOptions, check_capture
from .._save.writers import QueueWriter, Writer
from .._storage.protocol import Storage
from .options import check_writer_given


@runtime_checkable
class ManagedWriter(Writer, Protocol):
    """What a writer offers a CheckpointManager beyond ``Writer``: aiosnap's writers all
    do. ``capture`` is the writer's default capture; ``returns_durable``, whether its call
    returns once the save is durable (the manager's ``save`` then does too); an
    ``incremental`` writer keeps a rank's blobs in a folder of its own when the manager
    saves into step directories (``keep_blobs_by_rank``)."""

    capture: CaptureMode
    returns_durable: bool

    @property
    def incremental(self) -> bool: ...

    def keep_blobs_by_rank(self, rank_dir: str) -> None: ...

    async def accept(
        self,
        filename: str,
        out_dir: str,
        target: object,
        *,
        savefun: SaveFun | None = None,
        capture: CaptureMode | None = None,
    ) -> SaveHandle: ...


class WriterPort:
    """A manager's writer, as the manager uses it (see the module's docstring).

    ``writer``: the writer given (unopened), or None for a QueueWriter of the manager's
    ``storage`` and ``incremental`` options (which a writer given carries itself).
    ``capture``: the manager's own (None: the writer's default, else eager)."""

    def __init__(
        self,
        writer: Writer | None,
        *,
        storage: Storage,
        incremental: Incremental | None,
        capture: CaptureMode | None,
        read_only: bool,
    ) -> None:
        check_writer_given(writer, incremental)
        options = QueueOptions(storage=storage, incremental=incremental)
        self.writer: Writer = QueueWriter(**options) if writer is None else writer
        # What the writer offers: looked at here, once (a probe at call time is what this
        # port replaces). One of one's own without ``accept`` is called, and waits for the
        # capture itself.
        managed = self.writer if isinstance(self.writer, ManagedWriter) else None
        self._managed: ManagedWriter | None = managed
        self._accept = getattr(self.writer, "accept", None) if managed is None else None
        #: The capture a save gets unless its call names one.
        self.capture: CaptureMode = check_capture(capture or (managed.capture if managed else "eager"))
        #: Whether a save returns only once durable (the writer's call does).
        self.returns_durable = managed is not None and managed.returns_durable
        self.incremental = managed is not None and managed.incremental
        self._active = not read_only

    def blobs_by_rank(self, rank_dir: str) -> None:
        """Saves into step directories: each rank's blobs in a folder of its own."""
        if self._managed is None:
            raise ValueError("incremental saves into step directories need one of aiosnap's writers")
        self._managed.keep_blobs_by_rank(rank_dir)

    async def accept(self, filename: str, directory: str, state: object, capture: CaptureMode) -> SaveHandle:
        """Hand a save to the writer, before its capture where it can (the caller awaits
        the capture; earlier failures are the manager's to report), lazily if asked."""
        if self._managed is not None:
            return await self._managed.accept(filename, directory, state, capture=capture)
        if self._accept is not None:
            handle: SaveHandle = await self._accept(filename, directory, state)
            return handle
        return await self.writer(filename, directory, state)

    async def open(self) -> bool:
        """Open the writer (a read-only manager's never is); whether it was."""
        if self._active:
            await self.writer.__aenter__()
        return self._active

    async def exit(self) -> None:
        """Exit the writer's task group (after ``aclose``, or an open that failed)."""
        if self._active:
            await self.writer.__aexit__(None, None, None)

    async def aclose(self) -> None:
        if self._active:
            await self.writer.aclose()

    async def flush(self) -> None:
        if self._active:
            await self.writer.flush()

    def take_failures(self) -> list[SaveFailure]:
        return self.writer.take_failures() if self._active else []
