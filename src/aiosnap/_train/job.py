"""Job and JobRunner: the Caffe2 checkpoint job, asyncio-native.

A Job has four groups of async callables -- init, epoch, download, exit -- and stop
conditions. The JobRunner resumes from the newest valid checkpoint (or a given
epoch), runs the init group only when starting from scratch, checkpoints at epoch 0
and after every epoch through the manager's writer (so the next epoch runs while the
save persists), checks the stop conditions, then uploads and runs the download and
exit groups. The upload is Caffe2's upload group: with a manager that has a remote
tier, ``upload=True`` makes sure the final epoch's checkpoint is uploaded (and every
epoch's upload has ended) before the download group runs.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, final

import anyio

from .._manager.manager import CheckpointManager

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[["RunContext"], Coroutine[Any, Any, object]])
StopCondition = Callable[["RunContext"], "bool | Awaitable[bool]"]
Upload = Callable[[int, CheckpointManager], "object | Awaitable[object]"]


@final
@dataclass(slots=True)
class RunContext:
    """What every job callable receives: the epoch being run, the state, the manager."""

    epoch: int
    state: dict[str, Any]
    manager: CheckpointManager
    extra: dict[str, Any] = field(default_factory=dict)


@final
class Group:
    """Async callables that run concurrently; one failing cancels the others and propagates."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.callables: list[Callable[[RunContext], Coroutine[Any, Any, object]]] = []

    def __repr__(self) -> str:
        return f"<Group {self.name}: {len(self.callables)} callables>"

    def add(self, fn: F) -> F:
        """Add ``fn`` (usable as a decorator)."""
        if not inspect.iscoroutinefunction(fn) and not inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - async callable objects
        ):
            raise TypeError(f"{self.name}: {fn!r} is not an async callable")
        self.callables.append(fn)
        return fn

    async def run(self, ctx: RunContext) -> None:
        try:
            async with anyio.create_task_group() as tg:
                for fn in self.callables:
                    tg.start_soon(fn, ctx)
        except BaseExceptionGroup as group:
            # One failure is raised as itself; the rest were cancellations it caused.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise


@final
class Job:
    """The four groups of a training job, and when to stop."""

    def __init__(self) -> None:
        self.init_group = Group("init")
        self.epoch_group = Group("epoch")
        self.download_group = Group("download")
        self.exit_group = Group("exit")
        self.stop_conditions: list[StopCondition] = []

    def add_stop_condition(self, condition: StopCondition) -> StopCondition:
        """Stop after an epoch where ``condition(ctx)`` (sync or async) is true."""
        self.stop_conditions.append(condition)
        return condition

    async def should_stop(self, ctx: RunContext) -> bool:
        for condition in self.stop_conditions:
            result = condition(ctx)
            if await result if inspect.isawaitable(result) else result:
                return True
        return False


def epoch_limiter(job: Job, epochs: int) -> None:
    """Stop ``job`` once ``epochs`` epochs have run (counting those before a resume)."""
    job.add_stop_condition(lambda ctx: ctx.epoch >= epochs)


@final
class JobRunner:
    """Runs a Job with checkpoints (see the module docstring).

    ``state`` is a dict of Stateful objects (model, optimizer, scheduler, AsyncLoader,
    RNGState, ...); AsyncLoaders in it are opened for the run. A failed save logs a
    warning and training goes on, unless ``on_save_error="raise"``. ``upload``: True
    to upload the final checkpoint to the manager's remote tier (see the module
    docstring), or an ``upload(epoch, manager)`` callable of your own.
    """

    def __init__(
        self,
        job: Job,
        manager: CheckpointManager,
        *,
        state: dict[str, Any],
        resume_from_epoch: int | None = None,
        upload: Upload | bool | None = None,
        on_save_error: Literal["warn", "raise"] = "warn",
    ) -> None:
        if on_save_error not in ("warn", "raise"):
            raise ValueError("on_save_error must be 'warn' or 'raise'")
        if upload is True and manager.remote is None:
            raise ValueError("upload=True needs a manager with a remote tier (CheckpointManager(remote=...))")
        self.job, self.manager, self.state = job, manager, state
        self.resume_from_epoch = resume_from_epoch
        self.upload = upload
        self.on_save_error = on_save_error

    async def train(self) -> int:
        """Run the job; return the last epoch."""
        async with contextlib.AsyncExitStack() as stack:
            for value in self.state.values():
                if hasattr(value, "__aenter__") and hasattr(value, "__aiter__"):
                    await stack.enter_async_context(value)  # AsyncLoaders
            ctx = RunContext(await self._start_epoch(), self.state, self.manager)
            if ctx.epoch == 0:
                await self.job.init_group.run(ctx)
                await self._checkpoint(ctx)
            while not (ctx.epoch > 0 and await self.job.should_stop(ctx)):
                ctx.epoch += 1
                await self.job.epoch_group.run(ctx)
                await self._checkpoint(ctx)
            await self._finish_saves()
            if self.upload is True:
                await self._upload_final(ctx.epoch)
            elif callable(self.upload):
                result = self.upload(ctx.epoch, self.manager)
                if inspect.isawaitable(result):
                    await result
            await self.job.download_group.run(ctx)
            await self.job.exit_group.run(ctx)
            return ctx.epoch

    async def _start_epoch(self) -> int:
        if self.resume_from_epoch is not None:
            restored = await self.manager.restore(self.resume_from_epoch, target=self.state)
            logger.info("resumed from epoch %d", restored.step)
            return restored.step
        resumed = await self.manager.resume(target=self.state)
        if resumed is None:
            return 0
        logger.info("resumed from epoch %d (%s)", resumed.step, resumed.path)
        return resumed.step

    async def _checkpoint(self, ctx: RunContext) -> None:
        # A save call that raises the failure of an earlier background save has accepted
        # its own save all the same: this epoch is still saved.
        try:
            await self.manager.save(ctx.epoch, self.state, epoch=ctx.epoch, force=True)
        except Exception as exc:
            if self.on_save_error == "raise":
                raise
            logger.warning("checkpoint save failed (%r); training goes on", exc)

    async def _finish_saves(self) -> None:
        try:
            await self.manager.flush()
        except Exception as exc:
            if self.on_save_error == "raise":
                raise
            logger.warning("checkpoint save failed (%r); training goes on", exc)

    async def _upload_final(self, epoch: int) -> None:
        try:
            if epoch not in await self.manager.remote_steps():
                await (await self.manager.upload(epoch)).wait()
            await self.manager.flush()  # and every other upload
        except Exception as exc:
            if self.on_save_error == "raise":
                raise
            logger.warning("uploading the checkpoints failed (%r); the local ones remain", exc)

    async def load_blobs(self, keys: Sequence[str], epoch: int) -> Any:
        """Some entries of the checkpoint of ``epoch`` (dotted paths), the seed's
        ``load_blobs_from_checkpoints``."""
        return (await self.manager.restore(epoch, keys=keys)).state
