"""AsyncLoader: async iteration over a data loader, with prefetching and exact resume.

``async with AsyncLoader(source) as loader:`` then ``async for batch in loader:`` once per
epoch. A producer task of the loader's task group pulls batches in a worker thread (or
awaits an async source) and keeps ``prefetch`` of them ready, so loading overlaps the
training step and checkpoint persistence.

The loader is Stateful. Its position is (epoch, batches consumed by the training
loop) -- not batches prefetched. Restoring it and iterating again continues at exactly
the next batch:

- a torch DataLoader (torchdata's StatefulDataLoader too) or any other iterable is
  replayed from the start of the epoch and the consumed batches are skipped (costs one
  pass over them; workers load them again). For the replay to see the same order, a
  shuffling DataLoader must draw from its own ``generator=``, whose state at the start
  of the epoch (a uint8 tensor) is part of the loader's state. StatefulDataLoader's own
  state is not used: with torchdata 0.11 it restores the interrupted epoch exactly but
  shuffles the following epochs differently from a run that never stopped;
- any other source with ``state_dict``/``load_state_dict`` is snapshotted after each
  batch in the producer thread, and that snapshot is restored.

``epoch`` and ``batches`` say where the loader is. Restore it (``load_state_dict``, or a
manager's ``restore`` with the loader in its target) before the ``async for`` that is to
continue; whether the loader is open yet does not matter, since nothing is loaded until
iteration begins.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any, Self, final

import anyio
import anyio.abc
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._base import offload as _offload
from .._base.errors import LoaderClosedError
from .._base.notice import notice
from .._base.tasks import TaskGroupOwner

logger = logging.getLogger(__name__)

_END = object()
_FAILED = object()


def _next_batch(it: Iterator[Any], source: Any) -> tuple[bool, Any, Any]:
    """(more, batch, source state after it) -- one thread hop per batch."""
    try:
        batch = next(it)
    except StopIteration:
        return False, None, source.state_dict() if source is not None else None
    return True, batch, source.state_dict() if source is not None else None


def _check_shuffling(source: Any) -> None:
    """Tell the user of a DataLoader that shuffles with torch's global generator: its order
    cannot be replayed on resume (the global generator has moved on since the epoch
    began), so a resumed run would not continue at the exact next batch."""
    if not isinstance(source, torch.utils.data.DataLoader):
        return
    samplers = [source.sampler, getattr(source.batch_sampler, "sampler", None)]
    for sampler in samplers:
        if isinstance(sampler, torch.utils.data.RandomSampler) and sampler.generator is None:
            notice(
                logger,
                "AsyncLoader: the DataLoader shuffles with torch's global random generator "
                "(a RandomSampler without its own generator): a resumed run cannot replay this "
                "epoch's order and would not continue at the exact next batch. Give the "
                "DataLoader its own: DataLoader(..., shuffle=True, generator=torch.Generator()) "
                "(its state is saved with the loader)",
            )
            return


def _skip(it: Iterator[Any], n: int) -> None:
    for _ in range(n):
        next(it)


@final
class AsyncLoader(TaskGroupOwner, anyio.abc.AsyncResource):
    """Async, prefetching, resumable iteration over ``source``: ``async with`` it, then
    ``async for batch in loader:`` once per epoch. Put it in the checkpointed state: a
    restored loader continues at the batch after the last one the training loop took.

    Args:
        source: What to iterate: a torch DataLoader (a shuffling one must draw from its
            own ``generator=``, whose state is saved), any iterable (pulled in a worker
            thread), or an async iterable. On resume, an iterable that is not a
            DataLoader but has ``state_dict``/``load_state_dict`` gets back its state
            after the last batch taken; any other source is replayed from the start of
            the epoch, the batches already taken skipped.
        prefetch: Batches kept ready ahead of the training loop; at least 1.
    """

    def __init__(self, source: Any, *, prefetch: int = 2) -> None:
        if prefetch < 1:
            raise ValueError("prefetch must be at least 1")
        _check_shuffling(source)
        self.source = source
        self.prefetch = prefetch
        self._epoch = 0
        self._batches = 0
        self._source_state: Any = None
        self._epoch_generator: torch.Tensor | None = None
        self._seek = False
        self._producer: anyio.CancelScope | None = None
        self._receive: MemoryObjectReceiveStream[tuple[Any, Any]] | None = None

    @property
    def _stateful(self) -> bool:
        # DataLoaders, torchdata's StatefulDataLoader included, are replayed from their
        # generator instead: StatefulDataLoader 0.11 restores the interrupted epoch
        # exactly but shuffles the epochs after it differently from an unbroken run.
        if isinstance(self.source, torch.utils.data.DataLoader):
            return False
        return callable(getattr(self.source, "state_dict", None)) and callable(
            getattr(self.source, "load_state_dict", None)
        )

    @property
    def epoch(self) -> int:
        """The epoch the next ``async for`` runs: 0 at first, one more after each loop
        that ran to the end of its source, and what a restored state says."""
        return self._epoch

    @property
    def batches(self) -> int:
        """The batches of the current epoch the training loop has taken (not those
        prefetched): the next ``async for`` starts after them. 0 when an epoch ends."""
        return self._batches

    # -- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        await self._open_tasks()
        await _offload.warm()
        return self

    async def aclose(self) -> None:
        """Stop prefetching and release the worker that was running."""
        if self._tasks_open:
            self._stop_producer()
            await self._close_tasks(cancel=False)

    def _stop_producer(self) -> None:
        if self._producer is not None:
            self._producer.cancel()
            self._producer = None
        if self._receive is not None:
            self._receive.close()
            self._receive = None

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position: epoch, batches taken, and what replays the epoch's order."""
        state: dict[str, Any] = {"epoch": self._epoch, "batches": self._batches}
        if self._stateful:
            known = self._source_state
            state["source"] = known if known is not None else self.source.state_dict()
        else:
            generator = self._generator()
            at_start = self._epoch_generator if self._batches else None
            if generator is not None:
                state["generator"] = at_start if at_start is not None else generator.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go back to a position ``state_dict`` gave; the next ``async for`` starts there."""
        self._epoch, self._batches = int(state["epoch"]), int(state["batches"])
        self._source_state = state.get("source")
        self._epoch_generator = state.get("generator")
        self._seek = True

    def _generator(self) -> torch.Generator | None:
        generator = getattr(self.source, "generator", None)
        return generator if isinstance(generator, torch.Generator) else None

    # -- iteration -----------------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[Any]:
        if not self._tasks_open:
            raise LoaderClosedError("the loader is not open: use `async with AsyncLoader(...) as loader:`")
        self._stop_producer()
        skip = self._position_source()
        send, self._receive = anyio.create_memory_object_stream[tuple[Any, Any]](self.prefetch)
        self._producer = anyio.CancelScope()
        self._tasks.start_soon(self._produce, send, skip, self._producer)
        return self

    def _position_source(self) -> int:
        """Put the source where this epoch's iteration starts; return batches to skip."""
        generator = self._generator()
        seek = self._seek or self._batches > 0  # restored, or an earlier loop broke off
        self._seek = False
        if self._stateful:
            if seek and self._source_state is not None:
                self.source.load_state_dict(self._source_state)
            return 0
        if generator is not None:
            if seek and self._epoch_generator is not None:
                generator.set_state(self._epoch_generator)
            self._epoch_generator = generator.get_state()
        return self._batches if seek else 0

    async def _produce(
        self, send: MemoryObjectSendStream[tuple[Any, Any]], skip: int, scope: anyio.CancelScope
    ) -> None:
        with scope:
            async with send:
                try:
                    if hasattr(self.source, "__aiter__"):
                        await self._produce_async(send, skip)
                    else:
                        await self._produce_sync(send, skip)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass  # the consumer went away
                except Exception as exc:  # the source failed: the consumer raises it
                    with anyio.move_on_after(60):
                        await send.send((_FAILED, exc))

    async def _produce_sync(self, send: MemoryObjectSendStream[tuple[Any, Any]], skip: int) -> None:
        source = self.source if self._stateful else None
        it = await _offload.run_io(iter, self.source)
        if skip:
            await _offload.run_io(_skip, it, skip)
        while True:
            more, batch, state = await _offload.run_io(_next_batch, it, source)
            await send.send((batch, state) if more else (_END, state))
            if not more:
                return

    async def _produce_async(self, send: MemoryObjectSendStream[tuple[Any, Any]], skip: int) -> None:
        it = self.source.__aiter__()
        for _ in range(skip):
            await it.__anext__()
        async for batch in it:
            await send.send((batch, None))
        await send.send((_END, None))

    async def __anext__(self) -> Any:
        if self._receive is None:
            raise StopAsyncIteration
        try:
            batch, state = await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise LoaderClosedError("the loader's producer stopped before the epoch ended") from None
        if batch is _FAILED:
            self._stop_producer()
            raise state
        if self._stateful:
            self._source_state = state
        if batch is _END:
            self._epoch, self._batches = self._epoch + 1, 0
            self._epoch_generator = None
            self._stop_producer()
            raise StopAsyncIteration
        self._batches += 1
        return batch
