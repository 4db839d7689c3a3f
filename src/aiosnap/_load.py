"""Loading: read, verify and rebuild a checkpoint; or copy it into live objects.

Each call does its blocking work as one worker-thread call. Every tensor is read
straight into the memory of the tensor or array that is returned, and its crc32c
is checked before the tree is handed back.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, final

import numpy as np
import torch

from . import _dtypes, _offload
from ._backends import resolve
from ._errors import (
    CheckpointError,
    CheckpointKeyError,
    CorruptCheckpointError,
    NotACheckpointError,
    PickleNotAllowedError,
    StateMismatchError,
)
from ._format import Header, TensorInfo, how_to_read, read_header, sniff
from ._header import crc32c
from ._storage import Reader, ReaderFile, Storage
from ._tree import decode_key, dict_items, format_path, is_stateful, rebuild, sequence_values, walk_leaves

#: verify() reads in pieces of this size, so it needs no memory for the tensors.
_VERIFY_PIECE = 64 << 20
#: Neighbouring entries are read together, up to this many bytes and buffers per read.
_READ_GROUP = 64 << 20
_READ_IOVECS = 512

MapLocation = str | torch.device | None


@final
@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What ``verify`` checked."""

    path: str
    tensors: int
    bytes: int
    checksummed: bool  # False for a plain safetensors file: structure only


async def load(
    path: str,
    *,
    keys: Sequence[str] | None = None,
    map_location: MapLocation = None,
    allow_pickle: bool = False,
    storage: Storage | None = None,
    replicas: str | None = None,
) -> Any:
    """Read a checkpoint back as the tree that was saved.

    ``keys`` are dotted paths (``["model.layer1", "optimizer"]``); the result is the
    same tree pruned to those subtrees. A plain safetensors file loads as a flat dict.
    ``replicas`` is the file holding the entries this one marks external: in a
    checkpoint of a process group, rank 0's file of the same step.
    """
    storage, path = resolve(path, storage)
    return await _offload.run_io(
        _load_blocking, storage, path, keys, map_location, allow_pickle, None, True, replicas
    )


async def verify(path: str, *, storage: Storage | None = None) -> VerifyReport:
    """Recompute every checksum; raise CorruptCheckpointError on any mismatch."""
    storage, path = resolve(path, storage)
    return await _offload.run_io(_verify_blocking, storage, path)


async def load_into(
    path: str,
    target: Any,
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    storage: Storage | None = None,
    replicas: str | None = None,
) -> Any:
    """Load a checkpoint into existing tensors, arrays, containers and Stateful objects.

    Tensors and arrays are updated in place; with ``strict`` a missing or unexpected
    key, or a shape or dtype mismatch, raises StateMismatchError. Returns ``target``.

    CPU tensors and arrays whose dtype, shape and layout match are read straight into
    their own memory, with no intermediate copy; if a checksum then fails, the error
    is raised and such a target holds partly new bytes (restore an older checkpoint
    into it, as CheckpointManager.restore does). Stateful objects get
    ``load_state_dict`` with freshly read tensors. ``replicas`` as in ``load``.
    """
    storage, path = resolve(path, storage)
    await _offload.run_io(_load_blocking, storage, path, None, None, allow_pickle, target, strict, replicas)
    return target


def _load_blocking(
    storage: Storage,
    path: str,
    keys: Sequence[str] | None,
    map_location: MapLocation,
    allow_pickle: bool,
    target: Any = None,
    strict: bool = True,
    replicas: str | None = None,
    checksums: Mapping[str, str] | None = None,
) -> Any:
    """``checksums`` (path -> header crc32c, as a manifest records them) refuses a file
    that is not the one committed."""
    files: list[Reader] = [storage.open_read(path)]
    try:
        foreign = sniff(files[0])
        if foreign is not None:
            loaded = _load_foreign(files[0], foreign, keys, map_location, allow_pickle)
            if target is not None:
                _assign(target, loaded, (), strict)
            return loaded
        header = _read_checked(files[0], checksums)
        tree = _plain_tree(header) if header.tree is None else header.tree
        try:
            if keys is not None:
                tree = _prune(tree, list(keys), path)
            reader = _Reader(files[0], header, map_location, allow_pickle)
            if header.external and _refers_to(tree, header.external):
                if replicas is None:
                    raise CheckpointError(
                        f"{path}: some entries are stored in the file of the rank that wrote the replicated "
                        "entries; pass replicas= (CheckpointManager.restore does)"
                    )
                files.append(storage.open_read(replicas))
                reader.add_replicas(files[1], _read_checked(files[1], checksums))
            if target is not None:
                _destinations(target, tree, reader.lookup, reader.direct)
            reader.prefetch(tree)
            with _offload.gc_paused():  # what rebuild makes is returned: nothing to collect
                loaded = rebuild(tree, reader.resolve)
        except CheckpointError:
            raise
        except ValueError as exc:
            raise CorruptCheckpointError(path, f"bad tree: {exc}") from None
    finally:
        for f in files:
            f.close()
    if target is not None:
        _assign(target, loaded, (), strict)
    return loaded


def _load_foreign(
    f: Reader, kind: str, keys: Sequence[str] | None, map_location: MapLocation, allow_pickle: bool
) -> Any:
    """A torch.save file (a savefun's), read with torch.load once the caller opted in to
    pickle; any other format is refused with how to read it."""
    if not kind.startswith("torch.save"):
        raise NotACheckpointError(f.path, how_to_read(f.path, kind).removeprefix(f"{f.path}: "))
    if not allow_pickle:
        raise PickleNotAllowedError(how_to_read(f.path, kind))
    try:
        source = io.BufferedReader(ReaderFile(f), buffer_size=1 << 20)
        obj = torch.load(source, map_location=map_location or "cpu", weights_only=False)
    except Exception as exc:  # the file is damaged: what torch.load raises varies
        raise CorruptCheckpointError(f.path, f"torch.load failed: {type(exc).__name__}: {exc}") from exc
    return obj if keys is None else _select(obj, list(keys), f.path)


def _select(obj: Any, keys: list[str], path: str) -> Any:
    """``obj`` (a torch.load result) cut down to the dotted ``keys``, as ``keys=`` cuts a tree."""
    out: dict[Any, Any] = {}
    for key in keys:
        node, src, dst = obj, key.split("."), out
        for i, part in enumerate(src):
            found = _child(node, part)
            if found is _NOTHING:
                raise CheckpointKeyError(f"{path}: no entry {key!r}")
            name, node = found
            if i == len(src) - 1:
                dst[name] = node
            else:
                dst = dst.setdefault(name, {})
    return out


def _child(node: Any, part: str) -> Any:
    if isinstance(node, dict):
        for name in (part, int(part) if part.lstrip("-").isdigit() else None):
            if name is not None and name in node:
                return name, node[name]
    elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
        return int(part), node[int(part)]
    return _NOTHING


def _read_checked(f: Reader, checksums: Mapping[str, str] | None) -> Header:
    header = read_header(f)
    want = None if checksums is None else checksums.get(f.path)
    if want is not None and header.checksum != want:
        raise CorruptCheckpointError(f.path, f"header checksum {header.checksum} is not the committed {want}")
    return header


def _refers_to(tree: Any, names: dict[str, TensorInfo]) -> bool:
    return any(name in names for _, _, name in walk_leaves(tree))


def _destinations(
    target: Any, node: Any, lookup: Callable[[str], TensorInfo | None], out: dict[str, tuple[Any, Any]]
) -> None:
    """Find the entries that can be read straight into the target's own memory."""
    tag = node.get("$") if isinstance(node, dict) else None
    if tag in ("tensor", "ndarray"):
        info = lookup(node.get("n"))
        if info is not None and info.kind == tag and info.name not in out:
            flat = _direct_view(target, info)
            if flat is not None:
                out[info.name] = (target, flat)
    elif tag == "dict" and isinstance(target, dict) and not is_stateful(target):
        for key_node, value in dict_items(node):
            key = decode_key(key_node)
            if key in target:
                _destinations(target[key], value, lookup, out)
    elif isinstance(target, (list, tuple)) and (isinstance(node, list) or tag == "tuple"):
        values = sequence_values(node)
        if len(values) == len(target):
            for sub_target, sub_node in zip(target, values, strict=True):
                _destinations(sub_target, sub_node, lookup, out)


def _direct_view(target: Any, info: TensorInfo) -> np.ndarray[Any, np.dtype[np.uint8]] | None:
    if isinstance(target, torch.Tensor):
        if (
            target.device.type != "cpu"
            or not target.is_contiguous()
            or target.is_conj()
            or target.is_neg()
            or _dtypes.torch_name(target.dtype) != info.dtype
            or tuple(target.shape) != info.shape
        ):
            return None
        flat: np.ndarray[Any, np.dtype[np.uint8]] = target.detach().reshape(-1).view(torch.uint8).numpy()
        return flat
    if isinstance(target, np.ndarray):
        if (
            not target.flags.c_contiguous
            or not target.flags.writeable
            or target.dtype.str != info.dtype
            or target.shape != info.shape
        ):
            return None
        return target.reshape(-1).view(np.uint8)
    return None


def _plain_tree(header: Header) -> Any:
    items = sorted(header.tensors.values(), key=lambda t: t.start)
    return {"$": "dict", "items": [[t.name, {"$": "tensor", "n": t.name}] for t in items]}


class _Reader:
    """Reads the leaves a tree refers to: from the file, and external ones from the
    file of replicated entries, checking that each is the entry the tree describes."""

    def __init__(self, f: Reader, header: Header, map_location: MapLocation, allow_pickle: bool) -> None:
        self.sources: list[tuple[Reader, Header]] = [(f, header)]
        self.map_location, self.allow_pickle = map_location, allow_pickle
        self.made: dict[str, object] = {}
        #: Entries to read into existing memory (load_into): name -> (object, its bytes).
        self.direct: dict[str, tuple[Any, Any]] = {}

    def add_replicas(self, f: Reader, header: Header) -> None:
        own = self.sources[0][1]
        for name, want in own.external.items():
            have = header.tensors.get(name)
            if have is not None and _spec(have) != _spec(want):
                raise CorruptCheckpointError(
                    f.path,
                    f"replicated entry {name!r} is {have.dtype} {have.shape}, not {want.dtype} {want.shape}",
                )
        self.sources.append((f, header))

    def source(self, name: str) -> int:
        if name in self.sources[0][1].tensors:
            return 0
        if len(self.sources) > 1 and name in self.sources[0][1].external:
            if name not in self.sources[1][1].tensors:
                raise CorruptCheckpointError(self.sources[1][0].path, f"no replicated entry {name!r}")
            return 1
        raise ValueError(f"the tree refers to a missing tensor {name!r}")

    def lookup(self, name: str) -> TensorInfo | None:
        try:
            return self.sources[self.source(name)][1].tensors[name]
        except (ValueError, CorruptCheckpointError):
            return None

    def resolve(self, kind: str, name: str, path: tuple[object, ...]) -> object:
        return self.made[name]  # prefetch() read every leaf the tree refers to

    def prefetch(self, tree: Any) -> None:
        """Check every leaf the tree refers to, then read them all in file order.

        Neighbouring entries are read with one scattered read each, straight into the
        memory of the tensors and arrays that will be returned; checksums follow.
        """
        wanted: dict[str, TensorInfo] = {}
        by_source: list[list[TensorInfo]] = [[] for _ in self.sources]
        for path, kind, name in walk_leaves(tree):
            known = wanted.get(name)
            # Every reference is checked, not only the first: a second one of another
            # kind would get the first's object (a tensor where the tree says ndarray).
            if known is not None and known.kind == kind:
                continue
            src = self.source(name)
            info = self.sources[src][1].tensors[name]
            if info.kind != kind:
                raise ValueError(f"{format_path(path)} is a {kind} but {name!r} is a {info.kind}")
            if kind == "pickle" and not self.allow_pickle:
                raise PickleNotAllowedError(
                    f"{self.sources[src][0].path}: {format_path(path)} is pickled; loading it runs code "
                    "from the file, so it needs allow_pickle=True"
                )
            wanted[name] = info
            by_source[src].append(info)
        with _offload.gc_paused():  # thousands of small tensors, all kept
            made = {name: self.direct.get(name) or _allocate(info) for name, info in wanted.items()}
        for (f, header), infos in zip(self.sources, by_source, strict=True):
            self.read_all(f, header, sorted(infos, key=lambda i: i.start), made)
        self.made = {name: self.finish(wanted[name], obj) for name, (obj, _) in made.items()}

    def read_all(
        self, f: Reader, header: Header, infos: list[TensorInfo], made: dict[str, tuple[Any, Any]]
    ) -> None:
        group: list[TensorInfo] = []
        for info in infos:
            if group and (
                info.start != group[-1].end
                or len(group) >= _READ_IOVECS
                or info.end - group[0].start > _READ_GROUP
            ):
                _read_group(f, header, group, made)
                group = []
            group.append(info)
        if group:
            _read_group(f, header, group, made)

    def finish(self, info: TensorInfo, obj: Any) -> object:
        if info.kind == "tensor":
            return obj if self.map_location is None else obj.to(self.map_location)
        if info.kind == "pickle":
            return pickle.loads(obj.tobytes())  # the caller opted in
        return obj[()] if info.kind == "npscalar" else obj


def _spec(info: TensorInfo) -> tuple[str, str, tuple[int, ...]]:
    return info.kind, info.dtype, info.shape


def _read_group(f: Reader, header: Header, group: list[TensorInfo], made: dict[str, tuple[Any, Any]]) -> None:
    views = [memoryview(made[info.name][1]) for info in group]
    f.read_batch([(header.data_start + group[0].start, views)])
    for info, view in zip(group, views, strict=True):
        if info.crc is not None and crc32c(view) != info.crc:
            raise CorruptCheckpointError(f.path, f"checksum mismatch in tensor {info.name!r}")


def _allocate(info: TensorInfo) -> tuple[Any, np.ndarray[Any, np.dtype[np.uint8]]]:
    """The object an entry becomes, and its bytes as a flat uint8 array to read into."""
    if info.kind == "tensor":
        tensor = torch.empty(info.shape, dtype=_dtypes.TORCH_DTYPES[info.dtype])
        return tensor, tensor.reshape(-1).view(torch.uint8).numpy()
    array = np.empty(info.shape, dtype=np.dtype(info.dtype))
    return array, array.reshape(-1).view(np.uint8)


def _prune(tree: Any, keys: list[str], path: str) -> Any:
    found: set[str] = set()
    pruned = _prune_node(tree, (), keys, found)
    if pruned is _NOTHING:
        pruned = None
    missing = [k for k in keys if k not in found]
    if missing:
        raise CheckpointKeyError(f"{path}: no entry {', '.join(map(repr, missing))}")
    return pruned


def _prune_node(node: Any, path: tuple[object, ...], keys: list[str], found: set[str]) -> Any:
    """The node cut down to the selected subtrees, or _NOTHING if none is inside.

    Dict entries outside the selection are dropped; list and tuple elements outside
    it become None, so the indices of the selected ones stay what they were.
    """
    here = format_path(path) if path else ""
    hits = [k for k in keys if here == k or here.startswith(k + ".")]
    if hits:
        found.update(hits)
        return node
    if path and not any(k.startswith(here + ".") for k in keys):
        return _NOTHING
    tag = node.get("$") if isinstance(node, dict) else None
    if tag == "dict":
        items = []
        for key_node, value in dict_items(node, path):
            kept = _prune_node(value, (*path, decode_key(key_node, path)), keys, found)
            if kept is not _NOTHING:
                items.append([key_node, kept])
        return {"$": "dict", "items": items}
    if isinstance(node, list) or tag == "tuple":
        values = sequence_values(node, path)
        kept_values = [_prune_node(v, (*path, i), keys, found) for i, v in enumerate(values)]
        kept_values = [None if v is _NOTHING else v for v in kept_values]
        return kept_values if isinstance(node, list) else {"$": "tuple", "v": kept_values}
    return _NOTHING


_NOTHING: Any = object()


def _verify_blocking(storage: Storage, path: str) -> VerifyReport:
    f = storage.open_read(path)
    try:
        foreign = sniff(f)
        if foreign == "torch.save":
            return _verify_zip(f)
        if foreign is not None:
            raise NotACheckpointError(path, how_to_read(path, foreign).removeprefix(f"{path}: "))
        header = read_header(f)
        buf = np.empty(
            min(_VERIFY_PIECE, max(t.nbytes for t in header.tensors.values()) if header.tensors else 0),
            dtype=np.uint8,
        )
        for info in header.tensors.values():
            _verify_one(f, header, info, buf)
        if header.tree is not None:
            try:
                for where, kind, name in walk_leaves(header.tree):
                    entry = header.tensors.get(name) or header.external.get(name)
                    if entry is None:
                        raise ValueError(f"the tree refers to a missing {kind} {name!r}")
                    if entry.kind != kind:  # as load says it
                        raise ValueError(f"{format_path(where)} is a {kind} but {name!r} is a {entry.kind}")
            except ValueError as exc:
                raise CorruptCheckpointError(path, f"bad tree: {exc}") from None
        total = sum(t.nbytes for t in header.tensors.values())
        return VerifyReport(path, len(header.tensors), total, header.tree is not None)
    finally:
        f.close()


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


def _verify_one(f: Reader, header: Header, info: TensorInfo, buf: np.ndarray[Any, Any]) -> None:
    crc, pos = 0, info.start
    while pos < info.end:
        piece = memoryview(buf[: min(len(buf), info.end - pos)])  # type: ignore[arg-type]
        f.readinto(header.data_start + pos, piece)
        crc = crc32c(piece, crc)
        pos += len(piece)
    if info.crc is not None and crc != info.crc:
        raise CorruptCheckpointError(f.path, f"checksum mismatch in tensor {info.name!r}")


def _assign(target: Any, value: Any, path: tuple[object, ...], strict: bool) -> Any:
    """Update ``target`` in place from ``value``; return what the parent should hold."""
    where = format_path(path)
    if isinstance(target, torch.Tensor):
        if value is not target:  # else it was read in place
            _check_like(value, torch.Tensor, target.shape, target.dtype, where)
            with torch.no_grad():
                target.copy_(value)
        return target
    if isinstance(target, np.ndarray):
        if value is not target:
            _check_like(value, np.ndarray, target.shape, target.dtype, where)
            np.copyto(target, value)
        return target
    if isinstance(target, dict):
        _assign_dict(target, value, path, strict)
        return target
    if isinstance(target, (list, tuple)) and not _holds_live(target):
        # A sequence of plain values is a value: the checkpoint's replaces it.
        if isinstance(target, list) and isinstance(value, (list, tuple)):
            target[:] = value
            return target
        return value
    if isinstance(target, (list, tuple)):
        _assign_seq(target, value, path, strict)
        return target
    if is_stateful(target):
        _load_state(target, value, where, strict)
        return target
    return value


def _holds_live(obj: Any) -> bool:
    """Whether obj holds something that must be updated in place."""
    if isinstance(obj, (torch.Tensor, np.ndarray)) or is_stateful(obj):
        return True
    if isinstance(obj, dict):
        return any(_holds_live(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_live(v) for v in obj)
    return False


def _check_like(value: Any, kind: type[Any], shape: Any, dtype: Any, where: str) -> None:
    if not isinstance(value, kind):
        raise StateMismatchError(f"{where}: checkpoint holds {type(value).__name__}, not {kind.__name__}")
    if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
        raise StateMismatchError(
            f"{where}: checkpoint has {value.dtype} {tuple(value.shape)}, target {dtype} {tuple(shape)}"
        )


def _assign_dict(target: dict[Any, Any], value: Any, path: tuple[object, ...], strict: bool) -> None:
    if not isinstance(value, dict):
        raise StateMismatchError(f"{format_path(path)}: checkpoint holds {type(value).__name__}, not dict")
    missing = [k for k in target if k not in value]
    unexpected = [k for k in value if k not in target]
    if strict and (missing or unexpected):
        raise StateMismatchError(f"{format_path(path)}: missing keys {missing}, unexpected keys {unexpected}")
    for key in target:
        if key in value:
            target[key] = _assign(target[key], value[key], (*path, key), strict)


def _assign_seq(
    target: list[Any] | tuple[Any, ...], value: Any, path: tuple[object, ...], strict: bool
) -> None:
    if not isinstance(value, (list, tuple)) or len(value) != len(target):
        raise StateMismatchError(f"{format_path(path)}: checkpoint holds a different sequence")
    for i, (old, new) in enumerate(zip(target, value, strict=True)):
        result = _assign(old, new, (*path, i), strict)
        if isinstance(target, list):
            target[i] = result
        elif result is not old and result != old:
            raise StateMismatchError(f"{format_path((*path, i))}: a tuple cannot be updated in place")


def _load_state(target: Any, value: Any, where: str, strict: bool) -> None:
    kwargs = {"strict": strict} if isinstance(target, torch.nn.Module) else {}
    try:
        result = target.load_state_dict(value, **kwargs)
    except CheckpointError:
        raise
    except Exception as exc:
        # What the object makes of a value that is not its state is up to it: torch's
        # Module calls key.startswith(...) on every key (AttributeError for an int key).
        raise StateMismatchError(f"{where}: load_state_dict failed: {type(exc).__name__}: {exc}") from exc
    if strict and (getattr(result, "missing_keys", None) or getattr(result, "unexpected_keys", None)):
        raise StateMismatchError(f"{where}: {result}")
