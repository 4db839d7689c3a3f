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


def _cuda_training_state() -> tuple[dict[str, Any], torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 512)
    )
    model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(64, 512, device="cuda")
    state = {"model": model, "optimizer": opt, "step": 0}
    _cuda_step(state, x)
    return state, x


def _cuda_step(state: dict[str, Any], x: torch.Tensor) -> None:
    state["optimizer"].zero_grad(set_to_none=True)
    state["model"](x).square().mean().backward()
    state["optimizer"].step()


def _cpu_copy(state: dict[str, Any]) -> dict[str, Any]:
    # A copy even of what is on the CPU already (AdamW's `step`), where .cpu() is the tensor
    # itself and the next step would change the expected value with the live one.
    model = {k: v.to("cpu", copy=True) for k, v in state["model"].state_dict().items()}
    opt = state["optimizer"].state_dict()
    moments = {i: {k: v.to("cpu", copy=True) for k, v in s.items()} for i, s in opt["state"].items()}
    return {"model": model, "moments": moments}


@pytest.mark.cuda
@pytest.mark.parametrize(("capture", "device_staging"), [("lazy", False), ("eager", False), ("lazy", True)])
async def test_a_gpu_state_is_saved_as_it_was_at_the_call(
    capture: str, device_staging: bool, tmp_path: Path
) -> None:
    state, x = _cuda_training_state()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # the training stream is not the default one
        options = {"capture": capture, "device_staging": device_staging}
        async with aiosnap.QueueWriter(**options) as writer:  # type: ignore[arg-type]
            for i in range(3):
                want = _cpu_copy(state)
                handle = await writer(f"c{i}", str(tmp_path), state)
                for _ in range(2):  # forward changes the BatchNorm statistics, step the rest
                    _cuda_step(state, x)
                await handle.wait()
                loaded = await aiosnap.load(str(tmp_path / f"c{i}"))
                for k, v in want["model"].items():
                    assert torch.equal(loaded["model"][k], v), k
                for p, moments in want["moments"].items():
                    for k, v in moments.items():
                        assert torch.equal(loaded["optimizer"]["state"][p][k], v), (p, k)
    assert len(state["optimizer"]._optimizer_step_pre_hooks) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("device_staging", [False, True])
async def test_save_calls_and_the_steps_after_them_never_wait_for_the_gpu(
    device_staging: bool, tmp_path: Path
) -> None:
    state, x = _cuda_training_state()
    async with aiosnap.QueueWriter(device_staging=device_staging) as writer:
        await (await writer("warm", str(tmp_path), state)).wait()  # the arena exists, pinned
        for capture in ("lazy", "eager"):
            torch.cuda.set_sync_debug_mode("error")  # a host synchronisation raises
            try:
                handle = await writer("c", str(tmp_path), state, capture=capture)  # type: ignore[arg-type]
                for _ in range(3):
                    _cuda_step(state, x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            await handle.wait()


@pytest.mark.cuda
async def test_a_pinned_arena_is_registered_once_and_released_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = torch.cuda.cudart

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(real(), name)

        def cudaHostRegister(self, *args: Any) -> Any:
            calls.append("register")
            return real().cudaHostRegister(*args)

        def cudaHostUnregister(self, *args: Any) -> Any:
            calls.append("unregister")
            return real().cudaHostUnregister(*args)

    monkeypatch.setattr(torch.cuda, "cudart", Counting)
    state, _ = _cuda_training_state()
    async with aiosnap.StandardWriter() as writer:
        for i in range(4):
            await (await writer(f"c{i}", str(tmp_path), state)).wait()
        assert calls == ["register"]  # one arena, registered once, reused
    assert calls == ["register", "unregister"]


@pytest.mark.cuda
async def test_gpu_tensors_through_the_worker_process(tmp_path: Path) -> None:
    state, x = _cuda_training_state()
    want = _cpu_copy(state)
    async with aiosnap.ProcessQueueWriter(capture="lazy") as writer:
        handle = await writer("c", str(tmp_path), state)
        _cuda_step(state, x)
        await handle.wait()
    loaded = await aiosnap.load(str(tmp_path / "c"), map_location="cuda")
    for k, v in want["model"].items():
        assert loaded["model"][k].is_cuda and torch.equal(loaded["model"][k].cpu(), v), k


def test_device_staging_is_an_option_of_the_default_copier(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="device_staging= applies to the default CUDA copier"):
        aiosnap.QueueWriter(device_staging=True, device_copier=FakeDevice([]))  # type: ignore[arg-type]
    writer = aiosnap.QueueWriter(device_staging=True)  # on a machine without CUDA: nothing to stage
    assert (writer._copier is None) == (not torch.cuda.is_available())


@pytest.mark.cuda
async def test_device_staging_saves_the_call_s_values_when_the_step_runs_at_once(tmp_path: Path) -> None:
    """The guard's fence marks the device-to-device copies alone, so the step's kernels may
    run while the transfer to the host goes on: it must read the spare, never the weights."""
    torch.manual_seed(0)
    weights = torch.nn.Parameter(torch.randn(64 << 20, device="cuda"))  # 256 MiB
    opt = torch.optim.SGD([weights], lr=1.0)
    weights.grad = torch.ones_like(weights)
    want = weights.detach().to("cpu", copy=True)
    async with aiosnap.QueueWriter(capture="lazy", device_staging=True) as writer:
        handle = await writer("c", str(tmp_path), {"w": weights, "opt": opt})
        for _ in range(3):
            opt.step()  # the first is held until the copies are queued
        await handle.wait()
    loaded = await aiosnap.load(str(tmp_path / "c"))
    assert torch.equal(loaded["w"], want)
    stepped = want.clone()
    for _ in range(3):
        stepped.sub_(1.0)  # the same IEEE operations as SGD's on the GPU: the same bits
    assert torch.equal(weights.detach().cpu(), stepped)
