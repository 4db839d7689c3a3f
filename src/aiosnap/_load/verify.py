"""``verify``: recompute every checksum of a checkpoint, without keeping its data."""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, final

import numpy as np

from .._base.checksums import crc32c, crc32c_combine
from .._base.errors import CheckpointNotFoundError, CorruptCheckpointError, NotACheckpointError
from .._format.codec import Header, TensorInfo, how_to_read, read_header, sniff, tree_of
from .._format.header import BLOCK
from .._format.manifest import MANIFEST_NAME, Manifest, SavedTensor, holds_box, indexed, read_manifest
from .._format.tree import format_path, walk_leaves
from .._storage.protocol import Reader, ReaderFile, Storage, exists
from .refs import follow

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
    #: What the file is: "aiosnap", "safetensors" (no checksums), or "torch.save" (a pickle in
    #: a zip, whose members' CRC-32s were checked: loading it runs code from the file); a
    #: step directory is "aiosnap".
    format: str = "aiosnap"
    #: A node's directory of a group of several nodes: which of the step's files it holds
    #: (the others are on other nodes), in words; "" otherwise.
    node: str = ""


def verify_blocking(storage: Storage, path: str, progress: Progress | None = None) -> VerifyReport:
    """Verify a file, or a step directory with every rank's file against its manifest.
    Every entry is checked: the error names all those that failed, and every bad file.
    A node's directory of a group of several nodes holds only some of the step's files:
    those it should hold (``Manifest.holdings``) must be there, and those it holds are
    verified."""
    if not exists(storage, storage.join(path, MANIFEST_NAME)):
        return _verify_file(storage, path, None, _Tally(progress))[0]
    manifest = read_manifest(storage, path)
    chosen, node = list(range(manifest.world_size)), ""
    if manifest.nodes or manifest.node_replicas:
        chosen, node = on_this_node(storage, path, manifest)
    tally = _Tally(progress, sum(manifest.sizes[r] for r in chosen))
    tensors = total = 0
    headers: dict[str, Header] = {}
    failures: list[str] = []
    for r in chosen:
        name, checksum = manifest.files[r], manifest.checksums[r]
        try:
            report, header = _verify_file(storage, storage.join(path, name), checksum, tally)
        except CorruptCheckpointError as exc:
            failures.append(str(exc))
            continue
        tensors, total = tensors + report.tensors, total + report.bytes
        assert header is not None  # a file with a checksum to match is parsed, never sniffed
        headers[name] = header
    if failures:
        raise CorruptCheckpointError(path, "; ".join(failures))
    _verify_step(storage, path, manifest, headers)
    return VerifyReport(path, tensors, total, True, node=node)


def on_this_node(storage: Storage, path: str, manifest: Manifest) -> tuple[list[int], str]:
    """Of a step directory on one node of a group of several: the ranks whose files it
    holds, and which node's it is, in words. With the nodes recorded (``nodes``), the
    directory is the node's whose files it holds most of, and every file that node
    should hold must be there; a manifest without them (written before they were) names
    no node, and the files found are taken. A directory holding every file (the remote
    tier's; a node's with copies of every other's) is taken whole. Blocking."""
    present = {e.name for e in storage.list(path) if e.is_file}
    found = {r for r, name in enumerate(manifest.files) if name in present}
    n = manifest.world_size
    if len(found) == n:  # the remote tier's copy; or copies on two nodes: no telling which
        return sorted(found), "a node's directory holding every file of the step" if manifest.nodes else ""
    if not manifest.nodes:
        if not found:
            raise CheckpointNotFoundError(storage.join(path, manifest.files[0]), "no file of the step here")
        return sorted(found), f"{len(found)} of the step's {n} files, the others on other nodes"
    of, holds = manifest.node_of(), manifest.holdings()
    node = max(sorted(holds), key=lambda lead: sum(r in found for r in holds[lead]))
    ranks = _spans([r for r, lead in enumerate(of) if lead == node])
    missing = [manifest.files[r] for r in holds[node] if r not in found]
    if missing:
        raise CheckpointNotFoundError(
            storage.join(path, missing[0]),
            f"{path} is the directory of the node of ranks {ranks}, which should hold "
            f"{', '.join(missing)} as well: not there",
        )
    chosen = sorted(set(holds[node]) | found)
    return (
        chosen,
        f"the node of ranks {ranks}: {len(chosen)} of the step's {n} files, the others on other nodes",
    )


def _spans(ranks: list[int]) -> str:
    """Ranks in words, runs joined: "0-3, 8"."""
    out: list[str] = []
    for r in ranks:
        if out and r == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def _verify_step(storage: Storage, path: str, manifest: Manifest, headers: dict[str, Header]) -> None:
    """What a restore of the step relies on beyond each file: every box the manifest
    indexes is the entry it names, every DTensor of every rank's tree is indexed (or
    empty) and read the same at each of its paths, and every replicated entry a rank's
    file describes is in the file of them. A step verify accepts, a restore reads. Of a
    node's directory, the files it holds (``headers``): their boxes, and the replicated
    entries in the node's file of them (rank 0's, or its leader's: ``node_replicas``)."""
    for where, saved in manifest.shards.items():
        for box in saved.every_box():
            name = manifest.files[box.file]
            if name in headers and not holds_box(headers[name].tensors.get(box.name), saved, box):
                raise CorruptCheckpointError(
                    storage.join(path, name), f"does not hold the box of {where} its manifest says"
                )
    holder = next((f for f in (manifest.replicas, *manifest.node_replicas) if f in headers), None)
    for name, header in headers.items():
        _verify_dtensors(storage, path, manifest, name, header)
        if holder is None:
            if any(info.shard is None for info in header.external.values()):
                raise CheckpointNotFoundError(
                    storage.join(path, manifest.replicas),
                    f"no file of the replicated entries of {name} is here",
                )
            continue
        _verify_replicated(storage.join(path, holder), headers[holder], name, header)


def _verify_dtensors(storage: Storage, path: str, manifest: Manifest, name: str, header: Header) -> None:
    first: dict[str, tuple[str, SavedTensor]] = {}
    for parts, kind, entry in walk_leaves(tree_of(header)):
        if kind != "dtensor":
            continue
        where = format_path(parts)
        found = indexed(manifest.shards, where, header.tensors.get(entry) or header.external.get(entry))
        if found is None:
            raise CorruptCheckpointError(
                storage.join(path, MANIFEST_NAME), f"no boxes of the DTensor at {where}"
            )
        other, saved = first.setdefault(entry, (where, found))
        if saved != found:
            raise CorruptCheckpointError(
                storage.join(path, name),
                f"bad tree: {where} and {other} are one DTensor {entry!r}, indexed as two",
            )


def _verify_replicated(replicas_path: str, replicas: Header, name: str, header: Header) -> None:
    for entry, info in header.external.items():
        have = replicas.tensors.get(entry)
        if info.shard is None and (have is None or _spec(have) != _spec(info)):
            raise CorruptCheckpointError(
                replicas_path, f"does not hold the replicated entry {entry!r} of {name}"
            )


def _spec(info: TensorInfo) -> tuple[str, str, tuple[int, ...]]:
    return info.kind, info.dtype, info.shape


class _Tally:
    """Counts the bytes verified for a ``progress`` callback; ``total``: the bytes of the
    files to read (None: the one file's, known once it is open)."""

    def __init__(self, progress: Progress | None, total: int | None = None) -> None:
        self.progress, self.total, self.done = progress, total, 0

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is not None and self.total is not None:
            self.progress(min(self.done, self.total), self.total)


def _verify_file(
    storage: Storage, path: str, checksum: str | None, tally: _Tally
) -> tuple[VerifyReport, Header | None]:
    """A file's report, and its header (None for a torch.save file). A file with the
    ``checksum`` of a manifest is a step's: it must be an aiosnap file, never sniffed."""
    f = storage.open_read(path)
    start = tally.done
    alone = tally.total is None
    if alone:
        tally.total = f.size
    try:
        foreign = sniff(f) if checksum is None else None
        if foreign == "torch.save":
            return _verify_zip(f), None
        if foreign is not None:
            raise NotACheckpointError(path, how_to_read(path, foreign).removeprefix(f"{path}: "))
        header = read_header(f)
        if checksum is not None and header.checksum != checksum:
            raise CorruptCheckpointError(
                path, f"header checksum {header.checksum} is not the committed {checksum}"
            )
        f, header = follow(storage, f, header)  # every referred blob is verified as an entry
        if alone:
            tally.total = f.size
        tally.add(header.data_start)
        buf = np.empty(
            min(_VERIFY_PIECE, max(t.nbytes for t in header.tensors.values()) if header.tensors else 0),
            dtype=np.uint8,
        )
        checked = [(info.name, _verify_one(f, header, info, buf, tally)) for info in header.tensors.values()]
        for what in ("checksum", "block checksum"):
            bad = [name for name, failed in checked if failed == what]
            if bad:
                names = ", ".join(map(repr, bad))
                raise CorruptCheckpointError(path, f"{what} mismatch in tensor{'s' * (len(bad) > 1)} {names}")
        _check_tree(path, header)
        total = sum(t.nbytes for t in header.tensors.values())
        kind = "aiosnap" if header.tree is not None else "safetensors"
        return VerifyReport(path, len(header.tensors), total, header.tree is not None, kind), header
    finally:
        tally.add(f.size - (tally.done - start))
        f.close()


def _check_tree(path: str, header: Header) -> None:
    """Every leaf of the tree refers to an entry of its kind."""
    try:
        seen: dict[str, str] = {}
        # A file without a tree is read as a dict of its entries: a shard or an array
        # among them is refused by a load, so here too.
        for where, kind, name in walk_leaves(tree_of(header)):
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
    return VerifyReport(f.path, len(data), f.size, True, "torch.save")


def _verify_one(
    f: Reader, header: Header, info: TensorInfo, buf: np.ndarray[Any, Any], tally: _Tally
) -> str | None:
    """What of the entry's bytes fails: its ``"checksum"``, or one of its ``"block
    checksum"``s (a restore that reads part of a shard verifies only its blocks; pieces
    start at block boundaries: _VERIFY_PIECE is a multiple of BLOCK); None if nothing."""
    crc, pos, blocks = 0, info.start, []
    while pos < info.end:
        piece = memoryview(buf[: min(len(buf), info.end - pos)])  # type: ignore[arg-type]
        f.readinto(header.data_start + pos, piece)
        if info.blocks is None:
            crc = crc32c(piece, crc)
        else:
            for i in range(0, len(piece), BLOCK):
                part = piece[i : i + BLOCK]
                blocks.append(crc32c(part))
                crc = crc32c_combine(crc, blocks[-1], len(part))
        pos += len(piece)
        tally.add(len(piece))
    if info.crc is not None and crc != info.crc:
        return "checksum"
    if info.blocks is not None and tuple(blocks) != info.blocks:
        return "block checksum"
    return None
