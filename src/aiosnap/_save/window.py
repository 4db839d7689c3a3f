"""Lazy capture's window: no in-place write reaches a tensor before its copy is taken.

A lazily captured save returns before its large tensors are copied. Until each one is,
an in-place write to it would end up in the checkpoint: an EMA's ``lerp_``, weight
clipping through ``p.data``, ``load_state_dict``, a hand-written SGD step, an optimizer
that is not in the state, a large BatchNorm's statistics updated by the next forward.

So, from the moment the call returns, a ``Window`` (a ``TorchDispatchMode``) sits on the
dispatch stack of the caller's thread and looks at every operator that writes one of its
arguments. A write to a tensor whose copy is still pending copies that tensor first, on
the writing thread (copy-on-write; if the staging thread is copying it, the write waits
for that copy instead), then goes on. A write to a device tensor makes the current stream
wait for the save's device copies (no host synchronisation). Every tensor is copied once,
by whichever thread comes first (``Claims``).

The mode only sees its own thread. What it cannot see -- an in-place change on another
thread, through NumPy or a raw pointer -- is caught where version counters show it: the
staging thread compares each tensor's ``_version`` at the walk with the one after its copy
and fails the save (``CaptureError``) rather than write a mix. NumPy arrays are copied
before the call returns (NumPy writes bump no counter).

The mode costs every operator of its thread a Python call (~9 us here) while it is on the
stack; it is taken off at the first boundary after the copies end, on its own thread: the
event loop's next turn, or the next module ``forward`` or optimizer ``step`` (global hooks
that exist only while a window is open).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils import _python_dispatch as _dispatch
from torch.utils._python_dispatch import TorchDispatchMode

from .device import DeviceCopier

#: Arguments that some operators write although their schema does not say so: BatchNorm's
#: running statistics (``native_batch_norm`` updates them in place in training mode).
_UNDECLARED_WRITES = frozenset(("running_mean", "running_var"))
_PENDING, _COPYING, _DONE = 0, 1, 2


class Claims:
    """Which of a capture's host tensors are copied, and by whom: each is copied once, by
    the staging thread in file order or by a thread about to write it (thread-safe)."""

    def __init__(self, count: int) -> None:
        self._state = bytearray([_DONE]) * count
        self._cond = threading.Condition()

    def expect(self, indices: Iterable[int]) -> None:
        """Mark ``indices`` as still to copy (before anyone else can see the claims)."""
        for i in indices:
            self._state[i] = _PENDING

    def take(self, i: int) -> bool:
        """Claim tensor ``i`` to copy it: True if the caller must copy it now (then call
        ``done``); False once it is copied (waits while another thread copies it)."""
        with self._cond:
            while self._state[i] == _COPYING:
                self._cond.wait()
            if self._state[i] == _DONE:
                return False
            self._state[i] = _COPYING
            return True

    def done(self, i: int) -> None:
        with self._cond:
            self._state[i] = _DONE
            self._cond.notify_all()

    def close(self) -> None:
        """No tensor is taken any more; returns once the copies taken have ended."""
        with self._cond:
            for i, state in enumerate(self._state):
                if state == _PENDING:
                    self._state[i] = _DONE
            while _COPYING in self._state:
                self._cond.wait()


def extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` a strided tensor covers (torch's strides are never
    negative)."""
    lo = t.data_ptr()
    if t.numel() == 0:
        return lo, lo
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return lo, lo + span * t.element_size()


class Window(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """One lazy save's copy-on-write window on one thread (see the module's text).

    ``host``: pending host tensors by storage address, each ``(lo, hi, index)``;
    ``copy_now(i)``: copies tensor ``i`` into the save's image on the calling thread.
    ``device``: the save's device tensors by storage address (their indices): a write to
    one waits on the device for the copies (``fence``, once ``device_queued`` gave it)."""

    def __init__(
        self,
        claims: Claims,
        host: dict[int, list[tuple[int, int, int]]],
        copy_now: Callable[[int], None],
        device: dict[int, list[int]] | None = None,
        copier: DeviceCopier | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._claims, self._host, self._copy_now = claims, host, copy_now
        self._device, self._copier = device or {}, copier
        self._fence: object = None
        self._queued = threading.Event()
        #: False once every copy ended: the mode only passes operators through.
        self.watching = True
        self.finished = threading.Event()
        self.thread: int | None = None
        #: Writes that found their tensor's copy pending and copied it first.
        self.copied_first = 0
        #: Device tensors written on this thread, after their copies on the device: their
        #: version counters move, and that is no sign of a mix.
        self.ordered: set[int] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.watching:
            written = _WRITES.get(func)
            if written is None:
                written = _WRITES[func] = _written(func)
            if written:
                for t in _arguments(written, args, kwargs):
                    self._before_write(t)
        return func(*args, **kwargs)

    def _before_write(self, t: torch.Tensor) -> None:
        try:
            if t.device.type == "meta" or t.numel() == 0:
                return
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage: sparse, nested, functional
            return
        spans = self._host.get(key)
        if spans:
            lo, hi = extent(t)
            for start, end, i in spans:
                if start < hi and lo < end and self._claims.take(i):
                    self._copy_first(i)
        on_device = self._device.get(key)  # (the copier says what is a device's: not t.device)
        if on_device and self._copier is not None:
            self._queued.wait()  # the staging thread queues them just after the call returned
            if self._fence is not None:
                self._copier.order_after(self._fence)
            self.ordered.update(on_device)

    def _copy_first(self, i: int) -> None:
        try:
            self._copy_now(i)
            self.copied_first += 1
        finally:
            self._claims.done(i)

    # -- on and off the stack ------------------------------------------------------------
    def put_on(self) -> None:
        """On the caller's thread: from now on its writes are looked at."""
        self.thread = threading.get_ident()
        _dispatch._push_mode(self)
        _Hooks.opened()

    def device_queued(self, fence: object) -> None:
        """From the staging thread: the device copies are queued, ``fence`` after them
        (the first call counts)."""
        if not self._queued.is_set():
            self._fence = fence
            self._queued.set()

    def finish(self) -> None:
        """From any thread, once every copy ended (or the capture failed): the mode only
        passes operators through until it is taken off its thread's stack."""
        self.watching = False
        self.finished.set()


class _Passing(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return func(*args, **(kwargs or {}))


_warm_lock = threading.Lock()
_warmed = False


def warm() -> None:
    """Pay, on a worker thread, what the first operator under any dispatch mode of the
    process costs: torch imports ``torch._dynamo`` then (1.3 s here), which would
    otherwise stall the training step right after the first lazy save."""
    global _warmed
    with _warm_lock:
        if _warmed:
            return
        _dispatch._push_mode(_Passing())  # type: ignore[no-untyped-call]
        try:
            torch.zeros(1).add_(1)
        finally:
            _dispatch._pop_mode()
        _warmed = True


def take_off_finished() -> None:
    """On any thread: take the finished windows of this thread off the top of its
    dispatch stack. A mode of someone else's above them keeps them (passing through)
    until a later boundary."""
    me = threading.get_ident()
    while True:
        top = _dispatch._get_current_dispatch_mode()
        if not isinstance(top, Window) or top.watching or top.thread != me:
            return
        _dispatch._pop_mode()
        top.thread = None
        _Hooks.closed()


class _Hooks:
    """The global forward and step pre-hooks that take finished windows off their stack,
    registered while any window is on a stack (they cost every module call a Python call)."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _count: ClassVar[int] = 0
    _handles: ClassVar[list[Any]] = []

    @classmethod
    def opened(cls) -> None:
        with cls._lock:
            cls._count += 1
            if cls._count == 1:
                cls._handles = [
                    torch.nn.modules.module.register_module_forward_pre_hook(_boundary),
                    register_optimizer_step_pre_hook(_boundary),
                ]

    @classmethod
    def closed(cls) -> None:
        with cls._lock:
            cls._count -= 1
            if cls._count == 0:
                handles, cls._handles = cls._handles, []
                for handle in handles:
                    handle.remove()


def _boundary(*args: object) -> None:
    take_off_finished()


def _written(func: Any) -> tuple[tuple[int, str, bool], ...]:
    """The arguments ``func`` writes: (position, name, is a list), from its schema."""
    found = []
    for position, arg in enumerate(func._schema.arguments):
        alias = arg.alias_info
        if (alias is not None and alias.is_write) or arg.name in _UNDECLARED_WRITES:
            found.append((position, arg.name, isinstance(arg.type, torch.ListType)))
    return tuple(found)


_WRITES: dict[Any, tuple[tuple[int, str, bool], ...]] = {}


def _arguments(
    written: tuple[tuple[int, str, bool], ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[torch.Tensor]:
    for position, name, many in written:
        value = args[position] if position < len(args) else kwargs.get(name)
        if value is None:
            continue
        for t in value if many else (value,):
            if isinstance(t, torch.Tensor):
                yield t
