"""The entries of a checkpoint, for ``aiosnap inspect``: read off its header, so nothing
but the header is read (a torch.save file, which has none, is loaded once the caller
opted in to pickle)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._base.errors import CheckpointError, CorruptCheckpointError, NotACheckpointError, PickleNotAllowedError
from .._format.blobs import blob_file
from .._format.codec import Header, how_to_read, itemsize, read_header, sniff
from .._format.manifest import Manifest, read_manifest
from .._format.tree import (
    LEAF_TAGS,
    decode_key,
    dict_items,
    format_path,
    rebuild,
    sequence_values,
    walk_leaves,
)
from .._load.load import load_blocking
from .._load.verify import on_this_node
from .._storage.protocol import Storage
from .dirs import Located
from .safetensors import TREE_KEY, saved_tree

Path = tuple[object, ...]


@dataclass(frozen=True, slots=True)
class Entry:
    """A leaf of the tree: a stored value (tensor, array, pickle) or a plain one."""

    path: Path
    kind: str  # tensor, dtensor, ndarray, npscalar, pickle; else the plain value's type
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    nbytes: int | None = None
    crc32c: str | None = None
    value: Any = None
    note: str = ""
    #: The blob that holds its bytes (an incremental save's), as its file name.
    blob: str | None = None

    @property
    def stored(self) -> bool:
        return self.kind in LEAF_TAGS

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": format_path(self.path), "kind": self.kind}
        if self.stored:
            out |= {"dtype": self.dtype, "shape": list(self.shape or ()), "bytes": self.nbytes}
            out |= {"crc32c": self.crc32c} if self.crc32c else {}
            out |= {"blob": self.blob} if self.blob else {}
        else:
            out["value"] = jsonable(self.value)
        return out | ({"note": self.note} if self.note else {})


@dataclass(slots=True)
class Described:
    """A checkpoint as ``inspect`` shows it."""

    path: str
    format: str
    size: int
    checksum: str | None = None  # the header's crc32c, which sums up the whole file
    entries: list[Entry] = field(default_factory=list)
    #: A step directory's files: (name, bytes, header crc32c).
    files: list[tuple[str, int, str]] = field(default_factory=list)
    step: int | None = None
    #: The entries of the data section(s) and their bytes: what ``verify`` checks and
    #: counts (a tensor reached twice is stored once; a DTensor once per box). None for
    #: a torch.save file.
    stored: int | None = None
    data: int | None = None

    @property
    def tensors(self) -> int:
        """The leaves that are tensors, arrays (or pickles): stored, not plain values."""
        return sum(e.stored for e in self.entries)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "format": self.format, "bytes": self.size}
        out["crc32c"] = self.checksum
        if self.files:
            out["step"] = self.step
            out["files"] = [{"name": n, "bytes": b, "crc32c": c} for n, b, c in self.files]
        out["tensors"] = self.tensors
        out["stored"] = {"tensors": self.stored, "bytes": self.data} if self.stored is not None else None
        out["entries"] = [e.to_json() for e in self.entries]
        return out


def describe(place: Located, allow_pickle: bool) -> Described:
    """What the checkpoint at ``place`` (a file or a step directory) holds."""
    if place.kind == "step":
        return _describe_step(place)
    if place.kind == "dcp":
        raise CheckpointError(
            f"{place.path} is a torch.distributed.checkpoint directory: `aiosnap convert` reads it"
        )
    if place.kind != "file":
        raise CheckpointError(f"{place.path} is a directory: inspect one of its checkpoints (aiosnap ls)")
    f = place.storage.open_read(place.path)
    try:
        foreign = sniff(f)
        header = None if foreign is not None else read_header(f)
    finally:
        f.close()
    if header is None:
        return _describe_foreign(place, str(foreign), allow_pickle)
    fmt, tree = "aiosnap", header.tree
    if tree is None:
        fmt, tree = "safetensors", saved_tree(place.storage, place.path)
        fmt += "" if tree is None else " with its tree (kept by aiosnap convert)"
        missing = [n for _, _, n in walk_leaves(tree) if n not in header.tensors] if tree is not None else []
        if missing:
            raise CorruptCheckpointError(place.path, f"bad {TREE_KEY}: no tensor {missing[0]!r} in the file")
    described = Described(place.path, fmt, place.size, header.checksum, header_entries(header, tree=tree))
    described.stored, described.data = _data_section([header])
    return described


def _describe_step(place: Located) -> Described:
    """A step directory: every rank's file, or on one node of a group of several, the
    files that node holds (``on_this_node``), its tree from its file of the replicated
    entries."""
    manifest = read_manifest(place.storage, place.path)
    chosen, node = list(range(manifest.world_size)), ""
    if manifest.nodes or manifest.node_replicas:
        chosen, node = on_this_node(place.storage, place.path, manifest)
    headers = {
        manifest.files[r]: _header(place.storage, place.storage.join(place.path, manifest.files[r]))
        for r in chosen
    }
    files = [(manifest.files[r], manifest.sizes[r], manifest.checksums[r]) for r in chosen]
    fmt = f"aiosnap step ({manifest.world_size} rank{'s' * (manifest.world_size > 1)})"
    fmt += f"; {node}" if node else ""
    holder = next((f for f in (manifest.replicas, *manifest.node_replicas) if f in headers), files[0][0])
    entries = header_entries(headers[holder], manifest)
    stored, data = _data_section(list(headers.values()))
    size = sum(f[1] for f in files)
    return Described(place.path, fmt, size, None, entries, files, manifest.step, stored, data)


def _header(storage: Storage, path: str) -> Header:
    f = storage.open_read(path)
    try:
        return read_header(f)
    finally:
        f.close()


def _data_section(headers: list[Header]) -> tuple[int, int]:
    """(entries, bytes) of the files' data sections and the blobs they refer to, as
    verify counts them."""
    entries = sum(len(h.tensors) + len(h.refs) for h in headers)
    nbytes = sum(t.nbytes for h in headers for t in h.tensors.values())
    return entries, nbytes + sum(r.info.nbytes for h in headers for r in h.refs.values())


def _describe_foreign(place: Located, kind: str, allow_pickle: bool) -> Described:
    if not kind.startswith("torch.save"):
        raise NotACheckpointError(place.path, how_to_read(place.path, kind).removeprefix(f"{place.path}: "))
    if not allow_pickle:
        raise PickleNotAllowedError(pickle_hint(place.path))
    obj = load_blocking(place.storage, place.path, None, None, True)
    return Described(place.path, kind, place.size, None, object_entries(obj))


def pickle_hint(path: str) -> str:
    return (
        f"{path} is a torch.save file: reading it runs pickled code from the file; "
        "pass --allow-pickle if you trust it"
    )


def header_entries(header: Header, manifest: Manifest | None = None, *, tree: Any = None) -> list[Entry]:
    """The leaves of a file's tree, or of ``tree`` (a plain safetensors file without one:
    its tensors, in file order)."""
    tree = tree if tree is not None else header.tree
    if tree is None:
        items = sorted(header.tensors.values(), key=lambda t: t.start)
        tree = {"$": "dict", "items": [[t.name, {"$": "tensor", "n": t.name}] for t in items]}
    out: list[Entry] = []
    for path, node in _walk_tree(tree, ()):
        tag = node.get("$") if isinstance(node, dict) else None
        if tag in LEAF_TAGS:
            out.append(_stored(header, path, tag, node["n"], manifest))
        else:
            value = rebuild(node, _no_leaf)
            out.append(Entry(path, _type_name(value), value=value))
    return out


def _stored(header: Header, path: Path, kind: str, name: str, manifest: Manifest | None) -> Entry:
    info = header.tensors.get(name)
    note, blob = "", None
    ref = header.refs.get(name)
    if ref is not None:
        info, blob = ref.info, blob_file(ref.blob, ref.compression)
        note = f"in blob {blob}" + (f", {ref.stored} bytes compressed" if ref.compression else "")
    elif info is None:
        info = header.external[name]
        note = "stored in another rank's file"
    crc = None if info.crc is None else f"{info.crc:08x}"
    shape = info.shape
    saved = None if manifest is None else manifest.shards.get(format_path(path))
    if kind == "dtensor" and saved is not None:
        shape, note = tuple(saved.shape), f"sharded in {saved.count()} boxes"
        crc = None  # each box has its own
    elif kind == "dtensor" and info.shard is not None:
        note = f"shard at {list(info.shard[1])} of {list(info.shard[0])}"
    nbytes = (itemsize(info.kind, info.dtype) or 0) * math.prod(shape)
    return Entry(path, kind, info.dtype, shape, nbytes, crc, note=note, blob=blob)


def _walk_tree(node: Any, path: Path) -> Iterator[tuple[Path, Any]]:
    """(path, node) of every leaf of a checked tree; an empty container is a leaf too."""
    tag = node.get("$") if isinstance(node, dict) else None
    if isinstance(node, list) or tag == "tuple":
        values = sequence_values(node, path)
        if not values:
            yield path, node
        for i, v in enumerate(values):
            yield from _walk_tree(v, (*path, i))
    elif tag == "dict":
        items = list(dict_items(node, path))
        if not items:
            yield path, node
        for key_node, value in items:
            yield from _walk_tree(value, (*path, decode_key(key_node, path)))
    else:
        yield path, node


def _no_leaf(kind: str, name: str, path: Path) -> object:
    raise AssertionError("a leaf is not a plain value")


def walk_object(obj: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """(path, value) of every leaf of a loaded tree; an empty container is a leaf too."""
    if isinstance(obj, dict) and obj:
        for key, value in obj.items():
            yield from walk_object(value, (*path, key))
    elif isinstance(obj, (list, tuple)) and obj and not isinstance(obj, torch.Size):
        for i, value in enumerate(obj):
            yield from walk_object(value, (*path, i))
    else:
        yield path, obj


def object_entries(obj: Any) -> list[Entry]:
    """The leaves of a loaded tree (a torch.load result), described as a header would."""
    out = []
    for path, value in walk_object(obj):
        if isinstance(value, torch.Tensor):
            nbytes = value.numel() * value.element_size()
            out.append(
                Entry(path, "tensor", str(value.dtype).removeprefix("torch."), tuple(value.shape), nbytes)
            )
        elif isinstance(value, (np.ndarray, np.generic)):
            kind = "ndarray" if isinstance(value, np.ndarray) else "npscalar"
            out.append(Entry(path, kind, value.dtype.str, tuple(value.shape), value.nbytes))
        else:
            out.append(Entry(path, _type_name(value), value=value))
    return out


def _type_name(value: object) -> str:
    return "None" if value is None else type(value).__name__


def jsonable(value: Any) -> Any:
    """A plain value as JSON can hold it (what it cannot, as its repr)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return repr(value)
