"""AsyncLoader: async iteration, prefetch, and resume at exactly the next batch."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import aiosnap

from .conftest import WAIT_CAP, wait_until

DATA = TensorDataset(torch.arange(100).float().unsqueeze(1))


def plain(workers: int) -> DataLoader[Any]:
    return DataLoader(
        DATA, batch_size=8, shuffle=True, num_workers=workers, generator=torch.Generator().manual_seed(3)
    )


def stateful(workers: int) -> Any:
    return StatefulDataLoader(
        DATA, batch_size=8, shuffle=True, num_workers=workers, generator=torch.Generator().manual_seed(3)
    )


def ids(batch: Any) -> list[int]:
    return [int(v) for v in batch[0].flatten()]


async def epochs_of(loader: aiosnap.AsyncLoader, n: int) -> list[list[list[int]]]:
    return [[ids(b) async for b in loader] for _ in range(n)]


@pytest.mark.parametrize("make", [plain, stateful], ids=["DataLoader", "StatefulDataLoader"])
@pytest.mark.parametrize("workers", [0, 2])
async def test_resume_continues_at_exactly_the_next_batch(make: Any, workers: int, tmp_path: Path) -> None:
    async with aiosnap.AsyncLoader(make(workers)) as loader:
        reference = await epochs_of(loader, 3)
    assert len({len(e) for e in reference}) == 1 and reference[0] != reference[1]  # shuffled, same length

    for stop_at in (0, 5, 13):  # batches consumed (epoch 0 has 13) before the checkpoint
        async with aiosnap.AsyncLoader(make(workers)) as loader:
            seen: list[list[int]] = []
            if stop_at:
                async for batch in loader:
                    seen.append(ids(batch))
                    if len(seen) == stop_at:
                        break
            if stop_at == 13:
                assert [ids(b) async for b in loader] == []  # the epoch's end is still to come
            await aiosnap.save(str(tmp_path / "loader"), {"loader": loader})
        resumed = aiosnap.AsyncLoader(make(workers))
        await aiosnap.load_into(str(tmp_path / "loader"), {"loader": resumed})
        async with resumed:
            rest = await epochs_of(resumed, 3 if stop_at < 13 else 2)
        replay = [seen + rest[0], *rest[1:]] if stop_at < 13 else [seen, *rest]
        assert replay == reference, f"stopped after {stop_at}"


async def test_async_and_plain_iterables(tmp_path: Path) -> None:
    async def numbers() -> AsyncIterator[int]:
        for i in range(5):
            await asyncio.sleep(0)
            yield i

    class Numbers:
        def __aiter__(self) -> AsyncIterator[int]:
            return numbers()

    async with aiosnap.AsyncLoader(Numbers()) as loader, aiosnap.AsyncLoader([10, 11, 12]) as lst:
        assert [i async for i in loader] == [0, 1, 2, 3, 4]
        assert [i async for i in lst] == [10, 11, 12] and [i async for i in lst] == [10, 11, 12]
        async for i in loader:
            if i == 2:
                break
        state = loader.state_dict()
    assert state == {"epoch": 1, "batches": 3}
    again = aiosnap.AsyncLoader(Numbers())
    again.load_state_dict(state)
    async with again:
        assert [i async for i in again] == [3, 4]


class Counting(Dataset[int]):
    def __init__(self) -> None:
        self.fetched = 0
        self.thread: set[str] = set()
        self.three = threading.Event()

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        self.fetched += 1
        self.thread.add(threading.current_thread().name)
        if self.fetched == 3:
            self.three.set()
        return i


async def test_prefetch_runs_ahead_in_a_worker_thread() -> None:
    data = Counting()
    async with aiosnap.AsyncLoader(DataLoader(data, batch_size=1), prefetch=3) as loader:
        async for _ in loader:
            # A training step that never asks for the next batch: batches 2 and 3 come
            # all the same, fetched ahead in a worker thread.
            assert await asyncio.to_thread(data.three.wait, WAIT_CAP)
            break
    assert threading.main_thread().name not in data.thread


async def test_a_failing_source_raises_in_the_loop() -> None:
    class Broken(Dataset[int]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> int:
            if i == 2:
                raise KeyError("bad sample 2")
            return i

    async with aiosnap.AsyncLoader(DataLoader(Broken(), batch_size=1)) as loader:
        with pytest.raises(KeyError, match="bad sample 2"):
            async for _ in loader:
                pass


async def test_loader_must_be_open() -> None:
    with pytest.raises(aiosnap.errors.LoaderClosedError):
        async for _ in aiosnap.AsyncLoader([1]):
            pass


def test_rng_state_round_trips(tmp_path: Path) -> None:
    import random

    rng = aiosnap.RNGState()
    aiosnap.save_sync(str(tmp_path / "rng"), {"rng": rng})
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    aiosnap.load_into_sync(str(tmp_path / "rng"), {"rng": aiosnap.RNGState()})
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


class Resumable:
    """An iterable that checkpoints itself, as a stream reader would."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self) -> Any:
        while self.pos < 6:
            self.pos += 1
            yield self.pos - 1
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


async def test_a_stateful_source_is_restored_from_its_own_snapshot() -> None:
    source = Resumable()
    async with aiosnap.AsyncLoader(source, prefetch=3) as loader:
        async for i in loader:
            if i == 1:
                break
        await wait_until(lambda: source.pos > 2)  # the producer has run ahead: its position is not ours
        state = loader.state_dict()
    assert state["source"] == {"pos": 2}
    again = aiosnap.AsyncLoader(Resumable())
    again.load_state_dict(state)
    async with again:
        assert [i async for i in again] == [2, 3, 4, 5]
        assert [i async for i in again] == [0, 1, 2, 3, 4, 5]


async def test_epoch_and_batches_are_public_and_restore_works_before_or_after_open() -> None:
    async with aiosnap.AsyncLoader(plain(0)) as loader:
        assert (loader.epoch, loader.batches) == (0, 0)
        async for _ in loader:
            if loader.batches == 4:
                break
        assert (loader.epoch, loader.batches) == (0, 4)
        state = loader.state_dict()
        rest = [ids(b) async for b in loader]
        assert (loader.epoch, loader.batches, len(rest)) == (1, 0, 9)
        with pytest.raises(AttributeError):
            loader.epoch = 5  # type: ignore[misc]  # read-only: the position comes from iterating
    before, after = aiosnap.AsyncLoader(plain(0)), aiosnap.AsyncLoader(plain(0))
    before.load_state_dict(state)  # restored, then opened
    async with before, after:
        after.load_state_dict(state)  # opened, then restored
        assert (before.epoch, before.batches) == (after.epoch, after.batches) == (0, 4)
        assert [ids(b) async for b in before] == [ids(b) async for b in after] == rest


def test_a_dataloader_shuffling_with_the_global_generator_is_named(caplog: pytest.LogCaptureFixture) -> None:
    """Its order cannot be replayed on resume: the user is told, and how to fix it."""
    data = torch.utils.data.TensorDataset(torch.arange(16))
    with caplog.at_level(logging.WARNING, logger="aiosnap"):
        aiosnap.AsyncLoader(DataLoader(data, batch_size=4, shuffle=True))
    (record,) = [r for r in caplog.records if r.name == "aiosnap._train.loader"]
    assert "generator=torch.Generator()" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aiosnap"):
        aiosnap.AsyncLoader(DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator()))
        aiosnap.AsyncLoader(DataLoader(data, batch_size=4))  # no shuffling: nothing to replay
        sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(data), 4, False)
        aiosnap.AsyncLoader(DataLoader(data, batch_sampler=sampler))  # ... but this one shuffles
    assert [r.name for r in caplog.records] == ["aiosnap._train.loader"]
