"""The lease of a checkpoint directory, as a Site holds it: taken, renewed, given up.

One manager writes a directory at a time. Its lease (``Storage.lease``: a lock the OS
drops with its holder on a local filesystem, an object with an expiry on a store) is
taken at open, renewed in the background while an object store's would expire, and given
up at close, within a bound on a store that does not answer. A holder that died on
another host holds it until it goes stale: taking it waits for that, and gives up at once
if it sees the lease renewed (a live holder).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import final

import anyio
import anyio.abc

from .._base import offload as _offload
from .._base.errors import DirectoryLockedError, LeaseLostError
from .._storage.protocol import Lease, Storage

logger = logging.getLogger(__name__)

#: Seconds a lease's release may take on a store that does not answer.
RELEASE_BOUND = 5.0


@final
class LeaseHolder:
    """The lease of ``directory`` on ``storage`` (see the module's docstring)."""

    def __init__(self, storage: Storage, directory: str, ttl: float) -> None:
        self.storage, self.directory, self.ttl = storage, directory, ttl
        #: Set once another manager took the directory's lease.
        self.lost: LeaseLostError | None = None
        self._lease: Lease | None = None
        self._renewal = anyio.CancelScope()

    async def take(self) -> None:
        """Take the lease. A holder that stopped renewing it (it died on another host)
        holds it until it goes stale: this waits for that, up to ``ttl``, and gives up at
        once if it sees the lease renewed (a live holder)."""
        patience = time.monotonic() + self.ttl + 1.0  # clocks differ a little
        stale_at: float | None = None  # when the holder's lease goes stale, as last seen
        while True:
            try:
                self._lease = await self._take_once()
                return
            except DirectoryLockedError as exc:
                if exc.retry_after is None:
                    raise
                now = time.monotonic()
                # The expiry the lease holds, where its backend says it: unchanged unless
                # renewed. Else guessed from retry_after, which a slow thread hop skews.
                mark, slack = (exc.expires, 0.0) if exc.expires is not None else (now + exc.retry_after, 1.0)
                renewed = stale_at is not None and mark > stale_at + slack
                if renewed or now >= patience:
                    raise
                if stale_at is None:
                    logger.warning(
                        "%s is leased by a manager that may have died; waiting up to %.0f s for its "
                        "lease to go stale",
                        self.directory,
                        exc.retry_after,
                    )
                stale_at = mark
                await anyio.sleep(min(max(exc.retry_after, 0.05), patience - now, 1.0))

    async def _take_once(self) -> Lease:
        """One try at the lease. A caller cancelled meanwhile may abandon the thread (a
        remote store that does not answer): a lease it takes after that is let go, never
        left held by nobody for the life of the process."""
        claim = _Claim()
        try:
            return await _offload.run_io(claim.take, self.storage, self.directory, self.ttl)
        except BaseException:
            leftover = claim.abandon()
            if leftover is not None:
                with anyio.CancelScope(shield=True):
                    await _offload.run_io(leftover.release)
            raise

    def keep(self, tg: anyio.abc.TaskGroup) -> None:
        """Renew the lease in ``tg`` until ``release`` (if one was taken)."""
        if self._lease is not None:
            tg.start_soon(self._renew, self._lease)

    async def _renew(self, lease: Lease) -> None:
        """Keep the lease of the directory (an object store's expires unless renewed)."""
        with self._renewal:
            while True:
                await anyio.sleep(self.ttl / 3)
                try:
                    await _offload.run_io(lease.renew)
                except LeaseLostError as exc:
                    logger.error("%s", exc)
                    self.lost = exc
                    return
                except Exception as exc:  # a transient failure: the next renewal may pass
                    logger.warning("renewing the lease of %s failed (%r)", self.directory, exc)

    def stop_renewing(self) -> None:
        self._renewal.cancel()

    async def release(self) -> None:
        """Give the lease up. On a store that does not answer, not for longer than
        ``RELEASE_BOUND`` seconds: a lease left behind goes stale after ``ttl``."""
        if self._lease is not None:
            lease, self._lease = self._lease, None
            with anyio.move_on_after(RELEASE_BOUND, shield=True) as scope:  # a round trip on an object store
                await _offload.run_io(lease.release)
            if scope.cancelled_caught:
                logger.warning(
                    "%s: the lease could not be given up within %g s; it goes stale in %g s",
                    self.directory,
                    RELEASE_BOUND,
                    self.ttl,
                )


@final
class _Claim:
    """A lease being taken in a worker thread that its caller may abandon."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lease: Lease | None = None
        self._abandoned = False

    def take(self, storage: Storage, directory: str, ttl: float) -> Lease:
        lease = storage.lease(directory, ttl)
        with self._lock:
            if not self._abandoned:
                self._lease = lease
                return lease
        lease.release()  # nobody waits for it any more
        raise DirectoryLockedError(f"{directory}: the lease was taken after its caller gave up")

    def abandon(self) -> Lease | None:
        """Give up; the lease if it was taken already (the caller must let it go)."""
        with self._lock:
            self._abandoned = True
            lease, self._lease = self._lease, None
            return lease
