"""A CPU stand-in for a CUDA device, for the tests of device staging and lazy capture."""

from __future__ import annotations

import threading
from typing import Any

import torch


class FakeDevice:
    """A CPU stand-in for a GPU: 'device' tensors are registered CPU tensors, and a copy
    lands in host memory only at its event (``wait``) or at ``finish``, as an
    asynchronous copy would."""

    def __init__(self, device_tensors: list[torch.Tensor]) -> None:
        self.ids = {id(t) for t in device_tensors}
        #: Data pointers of 'device' memory: a module's ``state_dict()`` makes new tensor
        #: objects over its parameters' memory at every call.
        self.ptrs: set[int] = set()
        self.calls: list[tuple[Any, ...]] = []
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.started = 0
        self.pinned: set[int] = set()
        self.unpinned: list[tuple[int, bool]] = []

    def is_device(self, t: torch.Tensor) -> bool:
        return id(t) in self.ids or t.data_ptr() in self.ptrs

    def producer_streams(self) -> Any:
        self.calls.append(("producer_streams", threading.current_thread() is threading.main_thread()))
        return {"producer": "the training stream's mark at the call"}

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
            ("wait_event", producers["producer"]),
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

    def fence(self) -> object:
        self.calls.append(("fence",))
        return ("fence", self.started)

    def hold_producers(self, producers: Any, fence: object) -> None:
        # The caller's stream waits for the small copies: in this fake, they took their
        # values when started, before the call returned.
        self.calls.append(("hold_producers", producers["producer"], fence))

    def order_after(self, fence: object) -> None:
        # The caller's later device work queues after the copies: in this fake, a copy took
        # its value when it was started, so nothing lands early or late.
        self.calls.append(("order_after", fence, threading.current_thread() is threading.main_thread()))
