"""The writers' options, and every rule that ties them together: one place.

A writer takes its options as keywords (``WriterOptions``; a queue's three more,
``QueueOptions``, which the integrations pass on too). Incremental saves take theirs as
one object, ``Incremental``, which a CheckpointManager passes on to its writer; ``True``
is short for ``Incremental()``. Each check raises ValueError naming the option, before
anything is opened.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypedDict, final

from .._base.checksums import content_hash
from .._format.compress import check as check_compression
from .._storage.protocol import Storage
from .device import DeviceCopier

Offload = Literal["thread", "process"]
WhenFull = Literal["block", "skip", "replace"]
CaptureMode = Literal["eager", "lazy"]
#: Below this, a budget could not even hold one header page and one piece.
MIN_BUDGET = 1 << 20


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Incremental:
    """Incremental saves: each entry of 64 KiB or more is stored as a content-addressed
    blob in ``aiosnap-blobs/`` beside the file, written only if no earlier save stored the
    same bytes; the file refers to its blobs (see docs/format.md, "References and blobs").
    Hashing runs in the commit, never in the caller's wait.

    Args:
        frozen: globs of entry names (dotted tensor paths) that do not change: not hashed
            again while their crc32c is unchanged.
        compression: ``"zstd"`` stores blobs compressed (needs the ``zstd`` extra).
        level: the zstd level, 1-22.
    """

    frozen: Sequence[str] = ()
    compression: str | None = None
    level: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.frozen, str):
            raise ValueError("frozen must be a sequence of globs, not one string")
        object.__setattr__(self, "frozen", tuple(self.frozen))
        check_compression(self.compression, self.level)
        content_hash(b"")  # an ImportError naming the package now, not at the first commit


def incremental_of(value: bool | Incremental | None) -> Incremental | None:
    """``incremental=`` as given: an Incremental, True (its defaults) or False/None (none)."""
    if value is True:
        return Incremental()
    if value is False or value is None:
        return None
    if isinstance(value, Incremental):
        return value
    raise TypeError(f"incremental must be True, False or an aiosnap.Incremental, not {value!r}")


class WriterOptions(TypedDict, total=False):
    """Options every writer takes (keyword-only).

    ``storage``: where files go (by default, what each ``out_dir`` names: a local path,
    or a URL such as ``s3://bucket/run``). ``allow_pickle``: store
    values that are not state types pickled. ``max_host_bytes``: the most host memory
    staging may hold, queued saves included; a state larger than that is staged and
    written in pieces before the call returns. ``pipeline``: let a save with nothing
    ahead of it be written while it is still being copied (the default: durable about one
    disk write after the call); False commits only after the capture, which stalls the
    caller ~15-25 % less (the copy then has the memory bus and the cores to itself).
    ``capture``: when a save call returns. ``"eager"`` (the default) once every tensor is
    copied; ``"lazy"`` once the tree is walked and its plain values taken, the tensors
    copied in the background while ``optimizer.step()`` of every optimizer in the state
    waits for them (see docs/concepts.md, "Lazy capture"); a call's own ``capture=``
    overrides it. ``device_copier``: what copies device tensors to host memory (by
    default, CUDA's side streams where CUDA is available; tests pass a fake device).
    ``device_staging``: copy CUDA tensors into a spare buffer on their GPU first, then to
    the host from there: a lazy capture then holds ``optimizer.step()`` for a
    device-to-device copy rather than the transfer over PCIe, at the cost of as much GPU
    memory again as the state's CUDA tensors during the transfer (see docs/concepts.md).
    ``incremental``: an ``aiosnap.Incremental`` (``True``: its defaults): large entries
    stored once, as blobs shared by the saves.
    """

    storage: Storage | None
    allow_pickle: bool
    max_host_bytes: int | None
    pipeline: bool
    capture: CaptureMode
    device_copier: DeviceCopier | None
    device_staging: bool
    incremental: bool | Incremental | None


class QueueOptions(WriterOptions, total=False):
    """A QueueWriter's options: every writer's, and how its queue works (``max_pending``,
    ``when_full``) and where it commits (``offload``). The integrations pass these on."""

    offload: Offload
    max_pending: int
    when_full: WhenFull


def check_capture(capture: str) -> CaptureMode:
    if capture not in ("eager", "lazy"):
        raise ValueError(f"capture must be 'eager' or 'lazy', not {capture!r}")
    return capture  # type: ignore[return-value]


def check_writer(
    *,
    offload: str,
    capture: str,
    max_host_bytes: int | None,
    device_copier: DeviceCopier | None,
    device_staging: bool,
) -> None:
    """Every writer's options, before the writer is made."""
    if offload not in ("thread", "process"):
        raise ValueError(f"offload must be 'thread' or 'process', not {offload!r}")
    check_capture(capture)
    if max_host_bytes is not None and max_host_bytes < MIN_BUDGET:
        raise ValueError(f"max_host_bytes must be at least {MIN_BUDGET}")
    if device_copier is not None and device_staging:
        raise ValueError("device_staging= applies to the default CUDA copier, not to a device_copier")


def check_queue(max_pending: int, when_full: str) -> None:
    """A queue's options (``QueueWriter``; the uploader's ``max_pending`` too)."""
    if max_pending < 1:
        raise ValueError(f"max_pending must be at least 1, not {max_pending}")
    if when_full not in ("block", "skip", "replace"):
        raise ValueError(f"when_full must be 'block', 'skip' or 'replace', not {when_full!r}")
