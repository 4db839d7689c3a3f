"""Device staging: CUDA ordering tested on the CPU with a fake device; real GPU tests run where CUDA is."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap

from .fake_device import FakeDevice


@pytest.mark.parametrize("offload", ["thread", "process"])
async def test_device_copies_follow_stream_order_and_are_read_after_the_event(
    offload: str, tmp_path: Path
) -> None:
    gpu = [torch.randn(1000), torch.randn(64, 64).t(), torch.arange(10, dtype=torch.int16)]
    state = {"gpu": gpu, "cpu": torch.ones(100), "step": 3}
    fake = FakeDevice(gpu)
    async with aiosnap.QueueWriter(offload=offload, device_copier=fake) as writer:  # type: ignore[arg-type]
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
        ("wait_event", "the training stream's mark at the call"),
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
    async with aiosnap.QueueWriter(max_pending=1, offload=offload, device_copier=fake) as writer:  # type: ignore[arg-type]
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
