"""``verify``: recompute every checksum of a checkpoint, without keeping its data."""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, final

import numpy as np

from ._errors import CorruptCheckpointError, NotACheckpointError
from ._format import Header, TensorInfo, how_to_read, read_header, sniff
from ._group import MANIFEST_NAME, read_manifest
from ._header import crc32c
from ._storage import Reader, ReaderFile, Storage, exists
from ._tree import format_path, walk_leaves

#: verify() reads in pieces of this size, so it needs no memory for the tensors.
_VERIFY_PIECE = 64 << 20

#: Told ``(bytes checked, bytes in all)`` as verification goes on, from the thread that
#: verifies: the bytes are those of the files read, so the two are equal at the end.
Progress = Callable[[int, int], None]


@final
@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What ``verify`` checked."""

    path: str
    tensors: int
    bytes: int
    checksummed: bool  # False for a plain safetensors file: structure only


def verify_blocking(storage: Storage, path: str, progress: Progress | None = None) -> VerifyReport:
    """Verify a file, or a step directory with every rank's file against its manifest.
    Every entry is checked: the error names all those that failed, and every bad file."""
    if not exists(storage, storage.join(path, MANIFEST_NAME)):
        return _verify_file(storage, path, None, _Tally(progress))
    manifest = read_manifest(storage, path)
    files = [storage.join(path, name) for name in manifest.files]
    tally = _Tally(progress, sum(manifest.sizes))
    tensors = total = 0
    failures: list[str] = []
    for file, checksum in zip(files, manifest.checksums, strict=True):
        try:
            report = _verify_file(storage, file, checksum, tally)
        except CorruptCheckpointError as exc:
            failures.append(str(exc))
            continue
        tensors, total = tensors + report.tensors, total + report.bytes
    if failures:
        raise CorruptCheckpointError(path, "; ".join(failures))
    return VerifyReport(path, tensors, total, True)


class _Tally:
    """Counts the bytes verified for a ``progress`` callback; ``total``: the bytes of the
    files to read (None: the one file's, known once it is open)."""

    def __init__(self, progress: Progress | None, total: int | None = None) -> None:
        self.progress, self.total, self.done = progress, total, 0

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is not None and self.total is not None:
            self.progress(min(self.done, self.total), self.total)


def _verify_file(storage: Storage, path: str, checksum: str | None, tally: _Tally) -> VerifyReport:
    f = storage.open_read(path)
    start = tally.done
    if tally.total is None:
        tally.total = f.size
    try:
        foreign = sniff(f)
        if foreign == "torch.save":
            return _verify_zip(f)
        if foreign is not None:
            raise NotACheckpointError(path, how_to_read(path, foreign).removeprefix(f"{path}: "))
        header = read_header(f)
        if checksum is not None and header.checksum != checksum:
            raise CorruptCheckpointError(
                path, f"header checksum {header.checksum} is not the committed {checksum}"
            )
        tally.add(header.data_start)
        buf = np.empty(
            min(_VERIFY_PIECE, max(t.nbytes for t in header.tensors.values()) if header.tensors else 0),
            dtype=np.uint8,
        )
        bad = [info.name for info in header.tensors.values() if not _verify_one(f, header, info, buf, tally)]
        if bad:
            names = ", ".join(map(repr, bad))
            raise CorruptCheckpointError(path, f"checksum mismatch in tensor{'s' * (len(bad) > 1)} {names}")
        if header.tree is not None:
            _check_tree(path, header)
        total = sum(t.nbytes for t in header.tensors.values())
        return VerifyReport(path, len(header.tensors), total, header.tree is not None)
    finally:
        tally.add(f.size - (tally.done - start))
        f.close()


def _check_tree(path: str, header: Header) -> None:
    """Every leaf of the tree refers to an entry of its kind."""
    try:
        seen: dict[str, str] = {}
        for where, kind, name in walk_leaves(header.tree):
            entry = header.tensors.get(name) or header.external.get(name)
            stored = "tensor" if kind == "dtensor" else kind  # a DTensor's shard is a tensor
            if entry is None:
                raise ValueError(f"the tree refers to a missing {kind} {name!r}")
            if seen.setdefault(name, kind) != kind:  # as load says it
                raise ValueError(f"{format_path(where)} is a {kind} but {name!r} is a {seen[name]}")
            if entry.kind != stored or (kind == "dtensor") != bool(entry.shard):
                raise ValueError(f"{format_path(where)} is a {kind} but {name!r} is not")
    except ValueError as exc:
        raise CorruptCheckpointError(path, f"bad tree: {exc}") from None


def _verify_zip(f: Reader) -> VerifyReport:
    """A torch.save file: its zip records a crc32 per member; check them all."""
    try:
        with zipfile.ZipFile(ReaderFile(f)) as archive:
            bad = archive.testzip()
            members = archive.namelist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise CorruptCheckpointError(f.path, f"damaged torch.save file: {exc}") from None
    if bad is not None:
        raise CorruptCheckpointError(f.path, f"checksum mismatch in member {bad!r} of the torch.save file")
    data = [m for m in members if "/data/" in m and not m.endswith("/")]
    return VerifyReport(f.path, len(data), f.size, True)


def _verify_one(
    f: Reader, header: Header, info: TensorInfo, buf: np.ndarray[Any, Any], tally: _Tally
) -> bool:
    """Whether the entry's bytes match its checksum."""
    crc, pos = 0, info.start
    while pos < info.end:
        piece = memoryview(buf[: min(len(buf), info.end - pos)])  # type: ignore[arg-type]
        f.readinto(header.data_start + pos, piece)
        crc = crc32c(piece, crc)
        pos += len(piece)
        tally.add(len(piece))
    return info.crc is None or crc == info.crc
