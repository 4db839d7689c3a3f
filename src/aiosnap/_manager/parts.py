"""How a manager's parts open and close together, in the one order that loses nothing.

Opening: the directory joins the group and decides its layout, an incremental writer's
blobs go to the rank's folder (step directories), the directory is opened (lease, sweep,
catalog), the remote tier joins, the writer opens, the remote tier starts opening in the
background. Closing: the writer drains (its failures kept to raise), every vote ends,
uploads drain while they make progress, the remote tier closes, the writer's task group
exits. Task groups are exited the last entered first, each in the scope it was entered in
(never inside a shielding scope), also when the caller is being cancelled.
"""

from __future__ import annotations

from typing import final

import anyio.abc

from .._base.tasks import Failures
from .port import WriterPort
from .site import Site
from .tiers import Tiers


@final
class Parts:
    """A manager's directory, tiers and writer, opened and closed together."""

    def __init__(self, site: Site, tiers: Tiers, writer: WriterPort) -> None:
        self.site, self.tiers, self.writer = site, tiers, writer

    async def open(self, tg: anyio.abc.TaskGroup, failures: Failures) -> None:
        """Open every part (background work in ``tg``); on a failure, the writer is
        closed again and the error raised (the caller closes ``tg`` and leaves)."""
        site, writer = self.site, self.writer
        writer_open = False
        try:
            await site.connect()
            if writer.incremental and site.steps_are_dirs:
                # Each rank keeps its blobs in a folder of its own, which it collects itself.
                rank_dir = f"rank_{site.group.rank:05d}"
                writer.blobs_by_rank(rank_dir)
                site.blob_dir = rank_dir
            await site.open(tg)
            await self.tiers.connect(tg, failures)
            writer_open = await writer.open()
            await self.tiers.start()
        except BaseException:
            if writer_open:  # nothing was saved through it yet
                await writer.exit()
            raise

    async def drain(self, upload_timeout: float | None, errors: list[Exception]) -> list[str]:
        """Close the writer (its failure into ``errors``), wait for every vote and for the
        uploads while they make progress; the uploads left pending."""
        try:
            await self.writer.aclose()  # raises (so reports) the writer's failures
        except Exception as exc:
            errors.append(exc)
        await self.site.wait_pending()
        return await self.tiers.drain(upload_timeout)

    async def close(self, left: list[str] | None, errors: list[Exception]) -> None:
        """Close the remote tier (ending the uploads ``left``; None: not waited for) and
        exit the writer's task group."""
        try:
            try:
                await self.tiers.close(left)
            except Exception as exc:
                errors.append(exc)
        finally:
            await self.writer.exit()  # closed already: exits its group

    async def leave(self, *, remote: bool) -> None:
        """Leave the directories (``remote``: the remote tier's too, which closing it did
        not: after a failed open), also when the caller is being cancelled."""
        with anyio.CancelScope(shield=True):
            try:
                if remote:
                    await self.tiers.leave()
            finally:
                await self.site.close()
