"""An incremental commit: large entries go to content-addressed blobs, shared by saves.

Runs in the commit, off the caller's path, on the image the capture staged as for any
save (sealed: every entry's crc32c computed). Each entry of at least ``MIN_BLOB`` bytes
is hashed (xxh3-128) and stored as the blob of that name in the folder beside the file
(``aiosnap-blobs/``), unless the blob is there already (see below); every new blob is committed
(temp file, write, fsync, rename, fsync of the folder) before the checkpoint file that
refers to it is. The file then holds its tree, its small entries and, for each large
one, a reference: a blob name, the entry's description and its crc32c.

Entries under a ``frozen`` glob are not hashed again while their crc32c (computed for
every save anyway) is the one the blob they last went to had: that checksum, which a
load verifies as well, is the check that they did not change.

A blob that is there already is referred to only if this process checked it (read it
back whole) or wrote it, and it has not changed since (``_save/trust.py``); else it is
written again, replacing what stood at its name.

A blob this process is about to refer to is *pinned* until the file that refers to it
is committed; the collector (``_manager/blobs.py``) never deletes a pinned blob, nor
one pinned at any moment while it ran (its scan of the referring files may predate the
file that refers to it).
"""

from __future__ import annotations

import array
import dataclasses
import fnmatch
import functools
import json
import mmap
import operator
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .._base import offload as _offload
from .._base.checksums import content_hash
from .._base.errors import ForeignFileError
from .._format.blobs import blob_dir, blob_file
from .._format.codec import Header, Ref, TensorInfo, header_template, read_header
from .._format.compress import compress
from .._format.header import seal
from .._storage.protocol import CommitTimes, MemoryReader, Storage, describe, lstat, put, write_image
from .options import Incremental
from .stage import StagedImage
from .trust import verified, wrote

#: Entries smaller than this stay in the file: a blob costs a file and its fsync.
MIN_BLOB = 64 << 10


@dataclass(frozen=True, slots=True)
class Dedup:
    """A writer's incremental options as its commits use them (``Incremental``, checked
    there): ``frozen`` globs of entry names (the dotted paths of the tensors), how blobs
    are compressed, and the rank's blob folder."""

    frozen: tuple[str, ...] = ()
    compression: str | None = None
    level: int = 3
    #: Saves of a rank into step directories: the rank's blob folder (see ``blob_dir``).
    rank_dir: str | None = None

    @classmethod
    def of(cls, options: Incremental) -> Dedup:
        return cls(tuple(options.frozen), options.compression, options.level)

    def is_frozen(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, glob) for glob in self.frozen)


@dataclass(slots=True)
class Known:
    """What a writer's saves stored: per blob folder and entry name, the crc32c, size and
    blob of its last committed save (for ``frozen`` entries)."""

    last: dict[tuple[str, str], tuple[int, int, str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Pins:
    """The blobs saves of this process are about to refer to (see the module). Kept by
    content hash alone, whatever the folder: a pin keeps a blob of that hash anywhere."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()
        self._touched: set[str] = set()
        self._collecting = 0

    def pin(self, blob: str) -> None:
        with self._lock:
            self._held[blob] += 1
            if self._collecting:
                self._touched.add(blob)

    def unpin(self, blobs: Iterable[str]) -> None:
        with self._lock:
            for blob in blobs:
                self._held[blob] -= 1
                if self._held[blob] <= 0:
                    del self._held[blob]

    def begin(self) -> None:
        """A collection starts: from now on every pin is remembered until it ends."""
        with self._lock:
            self._touched |= set(self._held)
            self._collecting += 1

    def end(self) -> None:
        with self._lock:
            self._collecting -= 1
            if not self._collecting:
                self._touched = set()

    def delete_unless_pinned(self, blob: str, delete: Callable[[], object]) -> bool:
        """Call ``delete()`` unless ``blob`` was pinned since the collection began."""
        with self._lock:
            if blob in self._held or blob in self._touched:
                return False
            delete()
            return True


PINS = Pins()


@dataclass(slots=True)
class _Outcome:
    kept: list[TensorInfo] = field(default_factory=list)
    refs: list[Ref] = field(default_factory=list)
    pinned: list[str] = field(default_factory=list)
    blob_bytes: int = 0  # bytes of blobs written by this save


def commit_incremental(
    storage: Storage, path: str, staged: StagedImage, dedup: Dedup, known: Known
) -> CommitTimes:
    """Commit the staged save at ``path`` as a file that refers to blobs (see the module).
    Blocking. ``bytes`` of the result: the file's and the new blobs' together."""
    image = staged.image()
    if not staged.sealed:
        seal(image, staged.template, staged.spans)
    header = read_header(MemoryReader(path, image, "the staged image"))
    folder = blob_dir(storage, path, dedup.rank_dir)
    check_blob_folder(storage, folder, dedup.rank_dir)
    t0 = time.perf_counter()
    out = _Outcome()
    try:
        _store_blobs(storage, folder, header, image, dedup, known, out)
        blobs_s = time.perf_counter() - t0
        referring, size = _referring_image(header, out.kept, out.refs, image, dedup.rank_dir)
        times = write_image(storage, path, referring, size)
    finally:
        PINS.unpin(out.pinned)
    with known.lock:
        for ref in out.refs:
            known.last[folder, ref.info.name] = (ref.info.crc or 0, ref.info.nbytes, ref.blob)
    return CommitTimes(times.write_s + blobs_s, times.fsync_s, times.bytes + out.blob_bytes)


def _store_blobs(
    storage: Storage,
    folder: str,
    header: Header,
    image: memoryview,
    dedup: Dedup,
    known: Known,
    out: _Outcome,
) -> None:
    """Write the blobs of the image's large entries that ``folder`` lacks, pinned (in
    ``out.pinned``) until the save ends; ``out`` gets the entries kept in the file and
    the references to blobs, in the order of the data section, and the new blobs' bytes."""
    slots: list[Ref | TensorInfo] = []
    written: list[int] = []
    new: dict[str, int] = {}  # blob -> the slot of the entry that writes it
    again: list[tuple[int, int]] = []  # (slot, slot of the same bytes written by this save)
    with _offload.side_thread() as side:
        beside = False  # new blobs alternate between this thread and a helper
        for info in sorted(header.tensors.values(), key=_START):
            data = image[header.data_start + info.start : header.data_start + info.end]
            if info.nbytes < MIN_BLOB or info.kind == "pickle":
                slots.append(info)
                continue
            blob = _frozen_blob(folder, info, dedup, known) or content_hash(data)
            PINS.pin(blob)
            out.pinned.append(blob)
            if blob in new:  # the same bytes twice in one save: written once
                again.append((len(slots), new[blob]))
                slots.append(info)
                continue
            found = _found(storage, folder, blob, info, dedup.compression)
            slots.append(found)
            if found is not _MISSING:
                continue
            new[blob] = at = len(slots) - 1
            write = functools.partial(_write, storage, folder, blob, data, info, dedup, slots, at, written)
            if beside:
                side.wait()
                side.submit(write)
            else:
                write()
            beside = not beside
        side.wait()  # its error raised here (the block's end would swallow it)
    for at, first in again:
        done = slots[first]
        assert isinstance(done, Ref)
        slots[at] = dataclasses.replace(done, info=_whole(slots[at]))
    out.kept = [x for x in slots if isinstance(x, TensorInfo)]
    out.refs = [x for x in slots if isinstance(x, Ref)]
    out.blob_bytes = sum(written)


def check_blob_folder(storage: Storage, folder: str, rank_dir: str | None) -> None:
    """Refuse a blob folder (or, for a rank's, the folder above it) that is not a plain
    directory: a symbolic link or a file in its place is a user's, and blobs written
    through it would land outside the checkpoint directory (ForeignFileError)."""
    places = [folder] if rank_dir is None else [storage.split(folder)[0], folder]
    for place in places:
        entry = lstat(storage, place)
        if entry is not None and (entry.special or not entry.is_dir):
            raise ForeignFileError(place, describe(entry))


def _frozen_blob(folder: str, info: TensorInfo, dedup: Dedup, known: Known) -> str | None:
    """The blob a frozen entry went to last, if its checksum says it did not change."""
    if not dedup.frozen or not dedup.is_frozen(info.name):
        return None
    with known.lock:
        last = known.last.get((folder, info.name))
    if last is None or last[:2] != (info.crc or 0, info.nbytes):
        return None
    return last[2]


#: A blob not there yet (``_found``): it is written, then its slot holds its reference.
_MISSING = Ref(TensorInfo("", "tensor", "uint8", (0,), 0, 0, None), "", 0)


def _found(storage: Storage, folder: str, blob: str, info: TensorInfo, kind: str | None) -> Ref | TensorInfo:
    """The reference to the blob of ``info``'s bytes if it is there already and this
    process checked or wrote it (``trust``); ``info`` to keep the entry in the file where
    something not a file stands at the blob's name (a user's link or directory, never
    written through); else _MISSING: the blob is written (a damaged one replaced)."""
    path = storage.join(folder, blob_file(blob, kind))
    entry = lstat(storage, path)  # a link there is a user's: never read nor replaced
    if entry is None:
        return _MISSING
    if not entry.is_file:
        return info
    if not verified(storage, path, entry, blob, info.nbytes, kind):
        return _MISSING
    return Ref(_whole(info), blob, entry.size, kind)


def _whole(info: Ref | TensorInfo) -> TensorInfo:
    """An entry as a blob holds it: its bytes from offset 0."""
    assert isinstance(info, TensorInfo)
    return dataclasses.replace(info, start=0, end=info.nbytes)


def _write(
    storage: Storage,
    folder: str,
    blob: str,
    data: memoryview,
    info: TensorInfo,
    dedup: Dedup,
    slots: list[Ref | TensorInfo],
    at: int,
    written: list[int],
) -> None:
    """Commit the blob of ``data`` (compressed first, if asked), and put its reference in
    ``slots[at]``, and its size in ``written``. Runs in the commit thread or its helper."""
    kind = dedup.compression
    packed: memoryview | bytes = data if kind is None else compress(data, kind, dedup.level)
    path = storage.join(folder, blob_file(blob, kind))
    put(storage, path, packed)
    wrote(storage, path)
    slots[at] = Ref(_whole(info), blob, len(packed), kind)
    written.append(len(packed))


def _referring_image(
    header: Header, kept: list[TensorInfo], refs: list[Ref], image: memoryview, rank_dir: str | None
) -> tuple[memoryview, int]:
    """The file that holds ``kept`` entries (their bytes copied from ``image``) and
    refers to ``refs``, with the tree and external entries of ``header``."""
    placed, pos = [], 0
    for info in kept:
        placed.append(dataclasses.replace(info, start=pos, end=pos + info.nbytes))
        pos += info.nbytes
    tree = json.dumps(header.tree, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    external = list(header.external.values()) or None
    template = header_template(placed, tree, external, refs=refs, blob_dir=rank_dir)
    # Page-aligned, not malloc's: a file of whole pages is then written one way (O_DIRECT
    # where the file system takes it) every time, not by where the heap put a bytearray.
    out = mmap.mmap(-1, template.size + pos)
    view = memoryview(out)
    for old, new in zip(kept, placed, strict=True):
        src = header.data_start + old.start
        view[template.size + new.start : template.size + new.end] = image[src : src + old.nbytes]
    crcs = array.array("q")
    for info in placed:
        crcs.extend(info.blocks or ())
        crcs.append(info.crc or 0)
    template.render_into(view[: template.size], crcs)
    return view, len(out)


_START = operator.attrgetter("start")
