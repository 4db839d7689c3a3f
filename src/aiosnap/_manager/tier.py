"""The remote tier of a CheckpointManager: uploads in the background, never in the way.

The local directory is the safety net, so nothing local ever waits on the remote one:

- **Opening** joins the group's channels and decides the layout (the local one's), then
  returns; the remote directory's lease, sweep and catalog are taken in the background,
  tried again after each failure (backoff up to ``max_backoff``), with one warning the
  user sees (``_base.notice``). Its attempts agree over the site's control channel, so
  they never take a turn among the uploads'.
- **Uploads**: each committed local checkpoint is handed over at its save call, where
  it takes its turn in program order (so the members of a group pair their turns up);
  the copy waits until the remote directory is open, and is tried again while the
  remote is unavailable (``UploadWriter``). Until its upload ends, local retention
  keeps the checkpoint.
- **Reading** the remote tier (its steps, a restore) waits for it to open. A process
  on its own stops waiting once an attempt has failed, or ``read_timeout`` seconds
  passed without an answer, and is told the remote is unavailable and what to do
  (``available()``); so does a group, as rank 0 found it (its members must agree:
  ``agree_with``).
- **Draining** (``flush``, ``aclose``) waits for the uploads for as long as they make
  progress; after ``upload_timeout`` seconds without any, it stops waiting, and at a
  close ends them (one failure reported for all): the next open uploads the newest
  local checkpoint the remote tier lacks (``catch_up``).

Every call to the remote storage runs under ``offload.remote_io``: on threads of its
own, abandoned when its caller is cancelled, so Ctrl-C is never held by a store that
does not answer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar, final

import anyio
import anyio.abc

from .._base import offload as _offload
from .._base.errors import RemoteStorageError
from .._base.notice import notice
from .._base.tasks import SaveFailure
from .._save.handle import SaveHandle, skipped
from .._save.transfer import copy_checkpoint
from .._storage.protocol import Storage
from .records import CheckpointRecord
from .site import Site
from .upload import LocalCopy, UploadWriter

logger = logging.getLogger(__name__)

T = TypeVar("T")


@final
class Tier:
    """The remote tier of a CheckpointManager (see the module docstring). ``site`` is the
    remote directory; ``local`` the storage uploads read from."""

    def __init__(
        self,
        site: Site,
        uploader: UploadWriter,
        *,
        local: Storage,
        max_backoff: float = 60.0,
        read_timeout: float | None = 30.0,
    ) -> None:
        self.site, self.uploader, self.local = site, uploader, local
        self.max_backoff, self.read_timeout = max_backoff, read_timeout
        #: Why the remote directory is not open, after an attempt failed (None once open).
        self.error: BaseException | None = None
        #: Set once the first attempt to open it has ended, either way.
        self.tried = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None
        self._opener = anyio.CancelScope()
        #: Catch-ups not handed to the uploader yet (waiting for the remote to open).
        self._catching_up = 0
        site.on_settled(uploader.nudge)
        self._opened = site.opened  # set once the remote directory is open
        self._alone = site.group.world_size is None  # a process on its own
        #: A group's members take rank 0's view of whether the remote is open (``agree_with``).
        self._agree: Callable[[bool], Awaitable[bool]] | None = None

    @property
    def directory(self) -> str:
        return self.site.directory

    # -- lifecycle -----------------------------------------------------------------------
    async def connect(self, *, steps_are_dirs: bool) -> None:
        """Join the group's channels for the remote directory (every member at once, in
        program order), its layout the local one's: no call to the remote storage."""
        await self.site.connect(steps_are_dirs=steps_are_dirs)

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Open the uploader (paused until the remote directory is open) and start opening
        the remote directory in ``tg``; return at once."""
        self._tg = tg
        self.uploader.pause()
        await self.uploader.__aenter__()
        tg.start_soon(self._open_in_background)

    async def _open_in_background(self) -> None:
        assert self._tg is not None
        attempt = 0
        with self._opener, _offload.remote_io(f"opening the remote tier {self.directory}"):
            while True:
                try:
                    await self.site.open(self._tg, on_control=True)
                    break
                except Exception as exc:
                    attempt += 1
                    if self.error is None:
                        notice(
                            logger,
                            f"the remote tier {self.directory} cannot be opened ({exc}); local saves go "
                            f"on, uploads wait, and it is tried again, at most {self.max_backoff:g} s apart",
                        )
                    self.error = exc
                    self.tried.set()
                    # The same delays on every member: their attempts agree turn by turn.
                    await anyio.sleep(min(2.0 ** min(attempt, 16), self.max_backoff))
        if self.error is not None:
            logger.warning("the remote tier %s is open now", self.directory)
        self.error = None
        self.tried.set()
        self.uploader.resume()

    async def drain(self, idle: float | None) -> list[str]:
        """Wait until every upload handed over so far has ended, or ``idle`` seconds
        passed without progress (a piece copied, an upload ended); the paths of those
        still pending then."""
        while True:
            pending = self.uploader.pending() + self.site.pending() + self._catching_up
            if not pending:
                return []
            if idle is None:
                await self._some_progress()
                continue
            with anyio.move_on_after(idle) as scope:
                await self._some_progress()
            if scope.cancelled_caught:
                return self.uploader.pending_paths() or [f"{self.site.pending()} upload vote(s)"]

    async def _some_progress(self) -> None:
        """Return at the next progress: a piece copied, an upload, a vote or a catch-up
        ended (each nudges the uploader's progress)."""
        await self.uploader.progressed()

    async def close(self, *, abandon: bool) -> None:
        """Stop opening; with ``abandon``, end what uploads are still pending (reported as
        one failure); close the uploader and leave the remote directory."""
        self._opener.cancel()
        if abandon:
            why = (
                f"the remote tier {self.directory} made no progress before the close gave up"
                if self._opened.is_set()
                else f"the remote tier {self.directory} did not open before the close gave up"
            )
            self.uploader.abandon(why, self.error)
        try:
            await self.uploader.aclose()
        finally:
            try:
                await self.uploader.__aexit__(None, None, None)
            finally:
                with _offload.remote_io(f"closing the remote tier {self.directory}"):
                    await self.site.close()

    async def leave(self) -> None:
        """Leave the remote directory after an open that failed (closing does, else)."""
        with anyio.CancelScope(shield=True):
            await self.site.close()

    def share_blob_dir(self, local: Site) -> None:
        """This rank's blob folder is the local directory's: collected by this rank; and
        the files that hold the replicated entries are the local ones'."""
        self.site.blob_dir = local.blob_dir
        self.site.hold_replicas_as(local)
        self.agree_with(local)

    def take_failures(self) -> list[SaveFailure]:
        """The failed uploads not reported yet (see ``UploadWriter.take_failures``)."""
        return self.uploader.take_failures()

    def unavailable_since(self) -> BaseException | None:
        """What made the uploads find the remote tier unavailable (None: it is not)."""
        return self.uploader.unavailable

    # -- uploading -----------------------------------------------------------------------
    async def upload(self, record: CheckpointRecord, local: SaveHandle) -> SaveHandle:
        """Hand over the checkpoint ``local`` commits, its turn taken now, in program order
        (every member hands over every save); the upload's handle."""
        assert self._tg is not None
        if self.site.lease_lost is not None:
            # Another manager took the remote directory: upload nothing more to it; the
            # turn is still taken, and voted down, as on every member.
            local = skipped(local.path)
        with _offload.remote_io(f"uploading step {record.step} to the remote tier {self.directory}"):
            return await self._send(record, local, on_control=False)

    async def _send(self, record: CheckpointRecord, local: SaveHandle, *, on_control: bool) -> SaveHandle:
        """Submit the upload of ``local``'s file to the remote site. An upload replaces the
        remote copy of its step, as the local save did: both are aiosnap's own."""
        assert self._tg is not None
        return await self.site.submit(
            self._tg,
            record,
            LocalCopy(self.local, local),
            self.uploader.accept,
            overwrite=True,
            check=False,
            report=self.uploader.report,
            on_control=on_control,
        )

    def catch_up(self, record: CheckpointRecord, local: SaveHandle) -> None:
        """Once the remote directory is open, upload ``record``'s committed checkpoint if
        the remote tier lacks it: what a crash cut short, or a run without a remote tier.
        In the background, agreed over the control channel (never among the saves)."""
        assert self._tg is not None
        self._catching_up += 1
        self._tg.start_soon(self._catch_up, record, local)

    async def _catch_up(self, record: CheckpointRecord, local: SaveHandle) -> None:
        assert self._tg is not None
        try:
            with _offload.remote_io(f"uploading step {record.step} to the remote tier {self.directory}"):
                await self._catch_up_once_open(record, local)
        finally:
            self._catching_up -= 1
            self.uploader.nudge()

    async def _catch_up_once_open(self, record: CheckpointRecord, local: SaveHandle) -> None:
        await self._opened.wait()
        steps = await self.site.steps(on_control=True)
        if record.step in steps:
            return
        logger.info("uploading step %d, which %s lacks", record.step, self.directory)
        await self._send(record, local, on_control=True)

    # -- reading -------------------------------------------------------------------------
    def agree_with(self, local: Site) -> None:
        """In a group, whether the remote is open is rank 0's answer, asked over the local
        directory's channel (reads of the remote are in program order on every member)."""
        if not self._alone:
            self._agree = lambda mine: local.member.ask("remote open", lambda: mine)

    async def available(self) -> bool:
        """Whether the remote tier can be read now: it is open. Each member waits for the
        first attempt to open it, at most ``read_timeout`` seconds, and is answered False
        if it failed or has not ended; in a group, as rank 0 found it (its members must
        agree), or, without ``agree_with``, once it is open."""
        if self._alone or self._agree is not None:
            with anyio.move_on_after(self.read_timeout):
                await self.tried.wait()
            mine = self._opened.is_set()
            return mine if self._agree is None else bool(await self._agree(mine))
        await self._opened.wait()
        return True

    async def read(self, fn: Callable[[Site], Awaitable[T]]) -> T:
        """``fn(site)`` once the remote directory is open (see ``available``); a process
        on its own gets RemoteStorageError, saying what to do, if it is not."""
        if not await self.available():
            raise RemoteStorageError(f"{self.directory}: {self.unavailable()}")
        with _offload.remote_io(f"reading the remote tier {self.directory}"):
            return await fn(self.site)

    async def fetch(self, record: CheckpointRecord, rank: int, storage: Storage, path: str) -> None:
        """Copy ``rank``'s file of ``record``'s step from the remote directory to ``path``
        (``restores.Backup``): the remote's copy is the local file's bytes (an upload copies
        it as it is), with the blobs it refers to that ``storage`` lacks."""
        folder, name = self.site.member.place(record, rank)
        src = self.site.storage
        with _offload.remote_io(
            f"reading {name} of step {record.step} from the remote tier {self.directory}"
        ):
            await _offload.run_io(copy_checkpoint, src, src.join(folder, name), storage, path)

    def unavailable(self) -> str:
        """Why the remote tier cannot be read, and what to do about it."""
        if (self.tried.is_set() and self.error is not None) or self.read_timeout is None:
            why = f"the remote tier is unavailable: it cannot be opened ({self.error})"
        else:
            why = (
                f"the remote tier is unavailable: it has not answered within {self.read_timeout:g} s "
                "(Remote(..., timeout=...) sets how long a read waits)"
            )
        return (
            f"{why}. Check its URL, endpoint, network and credentials and start again; or, to go on "
            "from the local tier alone, open the manager without remote= (a later open with it "
            "uploads the newest local step the remote tier lacks). It is tried again in the background"
        )
