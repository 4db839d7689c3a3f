"""Device staging: CUDA ordering tested on the CPU with a fake device; real GPU tests run where CUDA is."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap


class FakeDevice:
    """A CPU stand-in for a GPU: 'device' tensors are registered CPU tensors, and a copy
    lands in host memory only at its event (``wait``) or at ``finish``, as an
    asynchronous copy would."""

    def __init__(self, device_tensors: list[torch.Tensor]) -> None:
        self.ids = {id(t) for t in device_tensors}
        self.calls: list[tuple[Any, ...]] = []
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.started = 0
        self.pinned: set[int] = set()
        self.unpinned: list[tuple[int, bool]] = []

    def is_device(self, t: torch.Tensor) -> bool:
        return id(t) in self.ids

    def producer_streams(self) -> Any:
        self.calls.append(("producer_streams", threading.current_thread() is threading.main_thread()))
        return {"producer": "the training stream"}

    def pin(self, array: Any) -> None:
        self.calls.append(("pin", int(array.ctypes.data)))
        self.pinned.add(int(array.ctypes.data))

    def unpin(self, array: Any) -> None:
        address = int(array.ctypes.data)
        if address in self.pinned:
            self.pinned.discard(address)
            self.unpinned.append((address, threading.current_thread() is threading.main_thread()))

    def start(self, src: torch.Tensor, dst: torch.Tensor, producers: Any) -> int:
        # The side stream waits for the producer, then the copy is enqueued: the value
        # copied is the one at enqueue time, but it reaches dst only at its event.
        self.calls += [
            ("wait_stream", producers["producer"]),
            ("copy",),
            ("record_stream",),
            ("record_event",),
        ]
        self.started += 1
        self.pending.append((self.started, src.clone(), dst))
        # Until the event, host memory holds garbage: a checksum taken early would not match.
        dst.reshape(-1).view(torch.uint8).fill_(0x5A)
        return self.started

    def wait(self, token: object) -> None:
        self.calls.append(("event_synchronize",))
        self._land(lambda t: t <= token)  # type: ignore[operator]  # one stream: in order

    def finish(self) -> None:
        self.calls.append(("synchronize", len(self.pending)))
        self._land(lambda t: True)

    def _land(self, landed: Any) -> None:
        for _, src, dst in [p for p in self.pending if landed(p[0])]:
            dst.copy_(src)
        self.pending = [p for p in self.pending if not landed(p[0])]


@pytest.mark.parametrize("offload", ["thread", "process"])
async def test_device_copies_follow_stream_order_and_are_read_after_the_event(
    offload: str, tmp_path: Path
) -> None:
    gpu = [torch.randn(1000), torch.randn(64, 64).t(), torch.arange(10, dtype=torch.int16)]
    state = {"gpu": gpu, "cpu": torch.ones(100), "step": 3}
    fake = FakeDevice(gpu)
    async with aiosnap.QueueWriter(offload=offload) as writer:  # type: ignore[arg-type]
        writer._copier = fake
        for i in range(2):
            handle = await writer(f"c{i}", str(tmp_path), state)
            expected = [t.clone() for t in gpu]
            for t in gpu:
                t.add_(1)  # the caller moves on: the checkpoint keeps the old values
            await handle.wait()
            loaded = await aiosnap.load(str(tmp_path / f"c{i}"))  # checksums prove the read came after
            for want, got in zip(expected, loaded["gpu"], strict=True):
                assert torch.equal(want, got)
            assert torch.equal(loaded["cpu"], torch.ones(100))
    assert fake.calls[0] == ("producer_streams", True)  # taken on the event-loop thread
    per_save = fake.calls[: len(fake.calls) // 2]
    assert per_save[1][0] == "pin"
    assert per_save[2:] == [
        ("wait_stream", "the training stream"),
        ("copy",),
        ("record_stream",),
        ("record_event",),
    ] * 3 + (  # a pipelined commit (thread offload) follows the copies one by one
        [("event_synchronize",)] * 3 + [("synchronize", 0)] if offload == "thread" else [("synchronize", 3)]
    )
    pins = {c[1] for c in fake.calls if c[0] == "pin"}
    assert len(pins) == 1  # one arena, pinned once and reused


@pytest.mark.parametrize("offload", ["thread", "process"])
async def test_arenas_are_unpinned_then_unmapped_off_the_event_loop(
    offload: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing a writer after large saves must not unmap its arenas on the event loop
    (~150 ms for 1 GiB), and arenas pinned for device copies are unregistered first."""
    unmapped: list[bool] = []  # per unmapped arena: was it on the event-loop thread?
    close = aiosnap._save.arena.Arena.close

    def recording_close(arena: Any) -> None:
        unmapped.append(threading.current_thread() is threading.main_thread())
        close(arena)

    monkeypatch.setattr(aiosnap._save.arena.Arena, "close", recording_close)
    gpu = [torch.randn(1 << 16)]
    fake = FakeDevice(gpu)
    async with aiosnap.QueueWriter(max_pending=1, offload=offload) as writer:  # type: ignore[arg-type]
        writer._copier = fake
        # Growing states: each save outgrows the arenas kept, which are dropped.
        for i, extra in enumerate((1, 4, 16)):
            state = {"gpu": gpu, "cpu": torch.ones(extra << 18)}
            await (await writer(f"c{i}", str(tmp_path), state)).wait()
    assert unmapped and not any(unmapped), unmapped
    assert fake.pinned == set()  # every pinned arena was unregistered before it was freed
    assert len(fake.unpinned) == 3 and not any(on_loop for _, on_loop in fake.unpinned)


@pytest.mark.cuda
async def test_real_cuda_tensors_on_a_side_stream(tmp_path: Path) -> None:
    device = torch.device("cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # the producer is not the default stream
        weights = torch.randn(1 << 20, device=device)
        expected = weights.cpu()
        async with aiosnap.QueueWriter() as writer:
            handle = await writer("c", str(tmp_path), {"w": weights, "b": torch.ones(3, device=device)})
            weights.add_(1)
            await handle.wait()
    loaded = await aiosnap.load(str(tmp_path / "c"))
    assert torch.equal(loaded["w"], expected)
    assert (await aiosnap.load(str(tmp_path / "c"), map_location="cuda"))["w"].is_cuda
