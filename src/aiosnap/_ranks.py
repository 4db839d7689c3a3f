"""What a CheckpointManager does differently as one rank of a process group.

Every decision is rank 0's and every rank learns it through the coordination channel
(``_coord``): which step is latest, whether a save commits, which checkpoint a
restore takes. A save is a two-phase commit: each rank writes its file, then all
report (file durable, its checksum) and rank 0 writes the manifest only if every rank
succeeded; any failure, death or silence makes every rank raise RankFailedError and
leaves the step uncommitted, to be swept later.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, final

import torch.distributed as dist

from . import _offload
from ._catalog import Catalog
from ._coord import Channel, Refused, Turn, new_group
from ._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, RankFailedError
from ._group import (
    MANIFEST_NAME,
    Manifest,
    StepDirs,
    file_summary,
    leaf_paths,
    only_replicated,
    rank_file,
    read_manifest,
    replicated_matcher,
)
from ._handle import SaveFailure, SaveHandle, SaveStats
from ._load import _load_blocking
from ._records import CheckpointRecord
from ._storage import Storage, put

logger = logging.getLogger(__name__)


@final
class Ranks:
    """This process's part in a group's checkpoints: the channels, and the protocols."""

    def __init__(
        self,
        parent: dist.ProcessGroup | None,
        *,
        storage: Storage,
        directory: str,
        replicated: Sequence[str],
        timeout: float,
        allow_pickle: bool,
    ) -> None:
        self.parent = parent
        self.rank = dist.get_rank(parent) if parent is not None else dist.get_rank()
        self.size = dist.get_world_size(parent) if parent is not None else dist.get_world_size()
        self.storage, self.directory = storage, directory
        self.replicated = list(replicated)
        self.matches = replicated_matcher(self.replicated)
        self.timeout, self.allow_pickle = timeout, allow_pickle
        self.catalog: Catalog | None = None  # rank 0's
        self.dirs: StepDirs | None = None
        #: Step directories that saves in progress write to: never swept.
        self.busy: set[str] = set()
        self._votes: Channel | None = None
        self._control: Channel | None = None

    @property
    def votes(self) -> Channel:
        assert self._votes is not None
        return self._votes

    # -- lifecycle -----------------------------------------------------------------------
    async def open(self, config: dict[str, Any], prepare: Callable[[], Awaitable[None]]) -> None:
        """Create the channels, run ``prepare`` on rank 0 (lock, sweep, index) and check
        that every rank is configured alike."""
        self._votes = await self._channel()
        self._control = await self._channel()

        async def work() -> dict[str, Any]:
            if self.rank == 0:
                await prepare()
            return config

        async def decide(configs: list[Any]) -> None:
            differ = {r: f"is configured with {c}, rank 0 with {configs[0]}" for r, c in enumerate(configs)}
            refused = {r: why for r, why in differ.items() if configs[r] != configs[0]}
            if refused:
                raise Refused(refused)

        async with self.votes.turn("open") as turn:
            await turn.agree(work, decide)

    async def _channel(self) -> Channel:
        group = await _offload.run_coord(new_group, self.parent, self.timeout)
        return Channel(group, timeout=self.timeout, destroy=self.parent is None)

    async def close(self) -> None:
        for channel in (self._votes, self._control):
            if channel is not None:
                await _offload.run_coord(channel.close)

    # -- asking rank 0 -------------------------------------------------------------------
    async def ask(self, op: str, answer: Callable[[], Any]) -> Any:
        """Rank 0's ``answer()``, on every rank."""

        async def decide(_: list[Any]) -> Any:
            return answer()

        async with self.votes.turn(op) as turn:
            return await turn.exchange(None, decide)

    async def agree_on_trigger(self, due: bool) -> bool:
        """Rank 0's verdict: clocks differ between ranks, the decision must not."""
        assert self._control is not None

        async def decide(verdicts: list[Any]) -> Any:
            return verdicts[0]

        async with self._control.turn("trigger") as turn:
            return bool(await turn.exchange(due, decide))

    # -- saving --------------------------------------------------------------------------
    async def vote(
        self,
        turn: Turn,
        inner: SaveHandle | BaseException,
        record: CheckpointRecord,
        outer: SaveHandle,
        report: Callable[[BaseException], SaveFailure],
    ) -> None:
        """The second phase of a save: wait for this rank's file, report it, and let
        rank 0 commit the step (or not); resolve ``outer`` with the outcome. ``turn`` was
        taken when the save was called, so that ranks take turns in program order."""
        step_dir = self.storage.join(self.directory, record.file)
        stats: list[SaveStats] = []
        own: list[SaveFailure] = []  # this rank's own write, failed

        async def work() -> dict[str, Any]:
            if isinstance(inner, BaseException):
                raise inner
            outcome = await inner._outcome()
            if isinstance(outcome, SaveFailure):
                own.append(outcome)
                raise outcome.error
            stats.append(outcome)
            if stats[0].skipped:
                return {"skipped": True}
            return await _offload.run_io(
                file_summary, self.storage, stats[0].path, self.replicated, self.rank
            )

        async def decide(results: list[Any]) -> dict[str, Any]:
            if any(r.get("skipped") for r in results):
                return {"committed": False}
            ref = results[0]["replicated"]
            differ = {r: x["replicated"] for r, x in enumerate(results) if x["replicated"] != ref}
            if differ:
                raise Refused(
                    {
                        r: f"holds replicated entries {d} (count, digest) unlike rank 0's {ref}"
                        for r, d in differ.items()
                    }
                )
            manifest = Manifest(
                record.step,
                record.epoch,
                self.size,
                [rank_file(r) for r in range(self.size)],
                [x["checksum"] for x in results],
                [x["bytes"] for x in results],
                self.replicated,
                rank_file(0),
            )
            path = self.storage.join(step_dir, MANIFEST_NAME)
            await _offload.run_io(put, self.storage, path, manifest.to_bytes())
            return {"committed": True, "bytes": sum(manifest.sizes)}

        self.busy.add(record.file)
        try:
            async with turn:
                verdict = await turn.agree(work, decide)
            if not verdict["committed"]:
                outer._skip()
                return
            if self.catalog is not None:
                await self._index(record, stats[0], verdict["bytes"])
        except RankFailedError as exc:
            if own:
                # This rank's write failed: one failure (the group's, chained from the
                # write's), reported once, through the handle or the writer.
                own[0].error = exc
                outer._fail(own[0])
            elif self.rank in exc.failed:
                outer._fail(exc)  # the save call itself raised: reported already
            else:
                outer._fail(report(exc))
            return
        except Exception as exc:
            outer._fail(report(exc))
            return
        finally:
            self.busy.discard(record.file)
        outer._finish(stats[0])

    async def _index(self, record: CheckpointRecord, stats: SaveStats, total: int) -> None:
        assert self.catalog is not None
        assert self.dirs is not None
        await self.catalog.add(record, stats, total)
        await self.dirs.sweep(record.step, self.busy)

    # -- restoring -----------------------------------------------------------------------
    async def restore(
        self, step: int | None, target: Any, keys: Sequence[str] | None
    ) -> tuple[CheckpointRecord, str, Any]:
        """Rank 0 picks the candidates; all ranks load their part of one; if any rank
        finds its part corrupt, rank 0 marks the step and all go on to an older one."""

        async def candidates(_: list[Any]) -> list[Any]:
            assert self.catalog is not None
            steps = [step] if step is not None else sorted(self.catalog.steps(), reverse=True)
            return [self.catalog.records[s].to_json() for s in steps if s in self.catalog.records]

        async with self.votes.turn("restore") as turn:
            found = await turn.exchange(None, candidates)
            for raw in found:
                record = CheckpointRecord.from_json(raw)
                loaded: list[Any] = []

                async def work(record: CheckpointRecord = record, loaded: list[Any] = loaded) -> Any:
                    try:
                        loaded.append(await self._load_part(record, target, keys))
                    except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                        return {"corrupt": str(exc)}
                    return {}

                async def judge(results: list[Any], step: int = record.step) -> str | None:
                    return await self._judge(step, results)

                verdict = await turn.agree(work, judge)
                if verdict is None:
                    return record, *loaded[0]
                logger.warning("step %d failed verification (%s); trying an older one", record.step, verdict)
                if step is not None:
                    raise CorruptCheckpointError(self.storage.join(self.directory, record.file), verdict)
        where = self.directory if step is None else self.storage.join(self.directory, f"<step {step}>")
        raise CheckpointNotFoundError(
            where, f"no valid checkpoint in {self.directory!r}" if step is None else None
        )

    async def _judge(self, step: int, results: list[Any]) -> str | None:
        bad = {r: x["corrupt"] for r, x in enumerate(results) if "corrupt" in x}
        if not bad:
            return None
        reason = "; ".join(f"rank {r}: {why}" for r, why in sorted(bad.items()))
        assert self.catalog is not None
        await self.catalog.mark_corrupt(step, reason)
        return reason

    async def _load_part(
        self, record: CheckpointRecord, target: Any, keys: Sequence[str] | None
    ) -> tuple[str, Any]:
        step_dir = self.storage.join(self.directory, record.file)
        manifest = await _offload.run_io(read_manifest, self.storage, step_dir)
        replicas = self.storage.join(step_dir, manifest.replicas)
        # Each file read must be the one the manifest committed.
        checksums = {
            self.storage.join(step_dir, f): c for f, c in zip(manifest.files, manifest.checksums, strict=True)
        }
        if self.rank >= manifest.world_size:
            # Only replicated entries: they are all in the file that holds them.
            paths = await _offload.run_io(leaf_paths, self.storage, replicas)
            only_replicated(keys, manifest, paths, f"step {record.step}")
            if target is not None:
                raise CheckpointError(
                    f"step {record.step}: restore replicated entries with keys=, not target="
                )
            own, replicas_of_own = replicas, None
        else:
            own, replicas_of_own = self.storage.join(step_dir, manifest.files[self.rank]), replicas
        state = await _offload.run_io(
            _load_blocking,
            self.storage,
            own,
            keys,
            None,
            self.allow_pickle,
            target,
            True,
            replicas_of_own,
            checksums,
        )
        return own, state
