"""What a lazily captured save still copies after its call returned, and who copies it.

Before the call returns, the staging thread copies the small leaves, the arrays and the
pickles, starts every device copy, and builds a ``LazyCopies`` over the host tensors left:
its ``window`` goes onto the caller's thread (``window.py``), and each of those tensors is
then copied once, by the staging thread in file order or, copy-on-write, by a thread about
to write it. Either way its version counter is compared with the walk's before the copy is
released: a change no window saw (another thread, NumPy, ``.data`` on another thread) fails
the save with ``CaptureError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._base import offload as _offload
from .._base.errors import CaptureError
from .._format.plans import Plan
from .arena import Arena
from .copies import copy_leaf
from .device import DeviceCopier
from .window import Claims, Window, extent


class LazyCopies:
    """The copies of one lazy capture after its call (thread-safe where it says so).

    ``todo``: the indices of its tensor leaves still to copy (host and device)."""

    def __init__(self, layout: Plan, arena: Arena, todo: Sequence[int], copier: DeviceCopier | None) -> None:
        self._layout, self._arena = layout, arena
        self._claims = Claims(len(layout.leaves))
        self._versions = {i: _version(layout.leaves[i].value) for i in todo}
        #: Changes found by a thread that copied a tensor before writing it.
        self._late: list[CaptureError] = []
        host: dict[int, list[tuple[int, int, int]]] = {}
        device: dict[int, list[int]] = {}
        for i in todo:
            t = layout.leaves[i].value
            if copier is not None and copier.is_device(t):
                device.setdefault(t.untyped_storage().data_ptr(), []).append(i)
            else:
                lo, hi = extent(t)
                host.setdefault(t.untyped_storage().data_ptr(), []).append((lo, hi, i))
        self._claims.expect(i for spans in host.values() for _, _, i in spans)
        self.window = Window(self._claims, host, self._copy_first, device, copier)

    def device_queued(self, fence: object) -> None:
        """Staging thread: every device copy is queued, ``fence`` after them; a write to a
        device tensor waits for them on the device from now on."""
        self.window.device_queued(fence)

    def take(self, i: int) -> bool:
        """Staging thread: claim host tensor ``i`` (False: a writer copied it already)."""
        return self._claims.take(i)

    def release(self, i: int) -> None:
        """Staging thread, after its copy of ``i`` (done or failed): a writer waiting to
        change it goes on. Checks first that it did not change meanwhile."""
        try:
            error = self.changed(i)
        finally:
            self._claims.done(i)
        if error is not None:
            raise error

    def changed(self, i: int) -> CaptureError | None:
        """The error for tensor ``i`` if its version moved since the walk, else None."""
        was, now = self._versions[i], _version(self._layout.leaves[i].value)
        if was == now:
            return None
        detail = (
            f"its version counter went from {was} to {now}, by an in-place operation on another "
            "thread than the save call's"
        )
        return CaptureError(self._layout.leaves[i].name, detail)

    def check_device(self, indices: Sequence[int]) -> None:
        """Staging thread, once the device copies ended: a device tensor whose version
        moved without its write being ordered after the copies (on another thread)."""
        for i in indices:
            error = None if i in self.window.ordered else self.changed(i)
            if error is not None:
                raise error

    def raise_late(self) -> None:
        """Staging thread, at the end: a change that a copying writer found."""
        if self._late:
            raise self._late[0]

    def close(self) -> None:
        """Staging thread, however the capture ends, before the arena can be reused: no
        writer copies into it any more (those copying now finish first)."""
        self.window.finish()
        self.window.device_queued(None)  # a writer waiting for the copies to be queued goes on
        self._claims.close()

    def _copy_first(self, i: int) -> None:
        """On a thread about to write tensor ``i`` (claimed): copy it into the image now."""
        leaf, info = self._layout.leaves[i], self._layout.tensors[i]
        with _offload.side_thread() as side:
            copy_leaf(leaf, self._arena, self._layout.data_start + info.start, info.nbytes, side)
        error = self.changed(i)
        if error is not None:
            self._late.append(error)


def _version(t: Any) -> int | None:
    """A tensor's version counter (None for those that keep none: inference tensors)."""
    try:
        return int(t._version) if isinstance(t, torch.Tensor) else None
    except RuntimeError:
        return None
