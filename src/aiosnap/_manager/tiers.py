"""Where a manager's checkpoints live: its local directory alone, or two tiers.

``Tiers`` is a manager's local directory on its own, and the null object of the remote
tier: there is nothing to upload, drain or close, and reading is reading the local
directory. ``TwoTiers`` adds a remote tier (``Tier``): every save handed over to the
upload (``Remote(upload="every")``), local retention held back until that upload ended,
the newest local step uploaded once the remote directory opens (catch-up), reads that
take the newest valid step of either tier. The manager asks its tiers and never which
kind they are.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, final

import anyio
import anyio.abc

from .._base.errors import CheckpointError, CheckpointNotFoundError, RemoteStorageError
from .._base.notice import notice
from .._base.tasks import Failures, SaveFailure
from .._save.handle import SaveHandle, skipped
from .records import CheckpointRecord
from .restores import Attempt, Listing, restore_first
from .site import Site
from .tier import Tier

logger = logging.getLogger(__name__)


@final
@dataclass(frozen=True, slots=True)
class Restored:
    """What ``restore`` loaded: which step, from where, and the state."""

    step: int
    epoch: int | None
    path: str
    state: Any


class Tiers:
    """A manager's local directory, with no remote tier (see the module's docstring)."""

    def __init__(self, site: Site) -> None:
        self.site = site

    @property
    def remote(self) -> str | None:
        """The remote tier's directory (None: there is none)."""
        return None

    async def connect(self, tg: anyio.abc.TaskGroup, failures: Failures) -> None:
        """Join the remote directory's channels, once the local directory is connected."""

    async def start(self) -> None:
        """Start the uploads and the remote directory's opening, in the background."""

    async def catch_up(self) -> None:
        """Upload the newest local step if the remote tier lacks it, once it is open."""

    async def hand_over(self, record: CheckpointRecord, local: SaveHandle) -> SaveHandle | None:
        """Hand the save ``local`` commits to the remote tier; its upload's handle (None:
        saves are not uploaded)."""
        return None

    async def settled(self) -> None:
        """Wait for the local retention that finished uploads held back."""

    async def drain(self, upload_timeout: float | None) -> list[str]:
        """Wait for the uploads while they make progress; those left then."""
        return []

    def stuck(self, stuck: list[str], upload_timeout: float | None) -> RemoteStorageError:
        raise AssertionError("no uploads to be stuck")  # drain() left none

    async def close(self, left: list[str] | None) -> None:
        """Close the remote tier (ending the uploads ``left`` pending, None: not waited for)."""

    async def leave(self) -> None:
        """Leave the remote directory after an open that failed."""

    def take_failures(self) -> list[SaveFailure]:
        return []

    async def latest_step(self) -> int | None:
        steps = await self.site.steps()
        return steps[-1] if steps else None

    async def restore(
        self, step: int | None, target: Any, keys: Sequence[str] | None, strict: bool
    ) -> Restored:
        found = await self.site.restore(step, target, keys, strict)
        return Restored(found.record.step, found.record.epoch, found.path, found.state)

    async def committed_before(self) -> bool:
        return await self.site.committed_before()

    async def remote_steps(self) -> list[int]:
        return []

    async def upload(self, step: int | None) -> SaveHandle:
        raise CheckpointError(f"{self.site.directory}: no remote tier (CheckpointManager(remote=...))")


@final
class TwoTiers(Tiers):
    """A manager's local directory and its remote tier (see the module's docstring)."""

    def __init__(self, site: Site, tier: Tier, *, every_save: bool) -> None:
        super().__init__(site)
        #: The remote tier, and whether every save is uploaded (else: ``upload()``'s).
        self.tier, self.every_save = tier, every_save
        #: The local retention an upload holds back: released once it ended -> the upload.
        self._releases: dict[anyio.Event, SaveHandle] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._failures = Failures()

    @property
    def remote(self) -> str | None:
        return self.tier.directory

    async def connect(self, tg: anyio.abc.TaskGroup, failures: Failures) -> None:
        self._tg, self._failures = tg, failures
        await self.tier.connect(steps_are_dirs=self.site.steps_are_dirs)
        # The remote tier's copies of this rank's blobs: collected by this rank too.
        self.tier.share_blob_dir(self.site)

    async def start(self) -> None:
        assert self._tg is not None
        await self.tier.start(self._tg)

    async def catch_up(self) -> None:
        if not self.every_save or self.site.read_only:
            return
        local = await self.site.steps()
        if local:  # the newest: retention never removes it meanwhile
            record = await self.site.record(local[-1])
            assert record is not None
            self.tier.catch_up(record, self.site.committed(record))

    async def hand_over(self, record: CheckpointRecord, local: SaveHandle) -> SaveHandle | None:
        if not self.every_save:
            return None
        with anyio.CancelScope(shield=True):
            upload = await self._upload(record, local)
        return upload

    async def _upload(self, record: CheckpointRecord, local: SaveHandle) -> SaveHandle:
        """Hand over the checkpoint ``local`` commits; until its upload ends, local
        retention keeps it."""
        upload = await self.tier.upload(record, local)
        catalog = self.site.catalog
        if catalog is not None:
            assert self._tg is not None
            catalog.hold(record.step)
            released = anyio.Event()
            self._releases[released] = upload
            self._tg.start_soon(self._release_after, record.step, upload, released)
        return upload

    async def _release_after(self, step: int, upload: SaveHandle, released: anyio.Event) -> None:
        try:
            await upload.outcome()
            catalog = self.site.catalog
            assert catalog is not None
            await catalog.release(step)
        except Exception as exc:  # the index or a removal failed: reported as a failed save is
            where = self.site.path(f"<retention after step {step}>")
            self._failures.add(where, exc)
        finally:
            self._releases.pop(released, None)
            released.set()

    async def settled(self) -> None:
        for released, upload in list(self._releases.items()):
            if upload.done():
                await released.wait()

    async def drain(self, upload_timeout: float | None) -> list[str]:
        left = await self.tier.drain(upload_timeout)
        if not left:
            for released in list(self._releases):  # the local retention the uploads held back
                await released.wait()
        return left

    def stuck(self, stuck: list[str], upload_timeout: float | None) -> RemoteStorageError:
        cause = self.tier.error or self.tier.unavailable_since()
        error = RemoteStorageError(
            f"{len(stuck)} upload(s) to {self.tier.directory} made no progress for {upload_timeout:g} s "
            f"({', '.join(stuck)}); they go on in the background (the remote tier is "
            f"{'unavailable: ' + repr(cause) if cause is not None else 'slow'})"
        )
        error.__cause__ = cause
        return error

    async def close(self, left: list[str] | None) -> None:
        await self.tier.close(abandon=left != [])
        if left == []:
            for released in list(self._releases):  # local retention the uploads held
                await released.wait()

    async def leave(self) -> None:
        await self.tier.leave()

    def take_failures(self) -> list[SaveFailure]:
        return self.tier.take_failures()

    async def latest_step(self) -> int | None:
        steps = await self.site.steps()
        steps = sorted(set(steps) | set(await self._remote_or_local(steps)))
        return steps[-1] if steps else None

    async def _remote_or_local(self, local: list[int]) -> list[int]:
        """The remote tier's steps; if it is unavailable, [] with a warning when ``local``
        has some to go on with, else RemoteStorageError (starting from scratch while the
        remote tier may hold checkpoints would lose them)."""
        try:
            return await self.tier.read(lambda site: site.steps())
        except RemoteStorageError:
            if not local:
                raise
            notice(
                logger,
                f"the remote tier {self.tier.directory} is unavailable ({self.tier.error or 'no answer'}): "
                f"going on with the local steps (newest {local[-1]}); the remote tier may hold newer ones",
            )
            return []

    async def restore(
        self, step: int | None, target: Any, keys: Sequence[str] | None, strict: bool
    ) -> Restored:
        """The newest valid step of either tier, the local copy first: a step corrupt
        in one tier is tried in the other, then older steps are. A local step with a rank
        file missing or damaged takes that file from the remote tier and is read again
        (``Member.attempt``), unless the manager is read-only (it writes nothing locally).
        A reader lists both again when what it chose went away as it read it
        (``restore_first``)."""
        tier, site = self.tier, self.site
        near = site.member
        near.backup = None if site.read_only else tier
        held: set[int] = set()  # the steps either tier held, at the last listing

        async def listing() -> Listing:
            local = await site.listing(step)
            remote = Listing([])
            if await self._remote_or_local(sorted(r.step for _, r in local.tries)):
                remote = await tier.read(lambda far: far.listing(step))
            # Newest first; of a step both tiers hold, the local copy first.
            tries = sorted([*local.tries, *remote.tries], key=lambda t: (-t[1].step, t[0] is not near))
            held.clear()
            held.update(r.step for _, r in tries)
            return Listing(tries, [local.mark, remote.mark])

        relist = listing if site.read_only else None
        found = await restore_first(await listing(), target, keys, strict, relist=relist)
        if isinstance(found, Attempt):
            await site.refill(found.record)
            return Restored(found.record.step, found.record.epoch, found.path, found.state)
        where = f"{site.directory!r} or {tier.directory!r}"
        if step is not None and step not in held:
            missing = f"{site.directory}/<step {step}>"
            raise CheckpointNotFoundError(missing, f"step {step} is in neither {where}")
        why = found.why()
        reason = f"no valid checkpoint in {where}" + (f" ({why})" if why else "")
        raise CheckpointNotFoundError(site.directory, reason)

    async def committed_before(self) -> bool:
        if await self.site.committed_before():
            return True
        return await self.tier.read(lambda site: site.committed_before())

    async def remote_steps(self) -> list[int]:
        return await self.tier.read(lambda site: site.steps())

    async def upload(self, step: int | None) -> SaveHandle:
        if self.site.read_only:
            raise CheckpointError(f"{self.site.directory}: this manager is read-only (read_only=True)")
        steps = await self.site.steps()
        chosen = step if step is not None else (steps[-1] if steps else None)
        record = None if chosen is None or chosen not in steps else await self.site.record(chosen)
        if record is None:
            raise CheckpointNotFoundError(self.site.directory, f"no committed local step {chosen} to upload")
        if chosen in await self.remote_steps():
            # Handed over all the same, as skipped: every member takes the same turns.
            return await self._upload(record, skipped(self.site.committed(record).path))
        return await self._upload(record, self.site.committed(record))
