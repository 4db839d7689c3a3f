"""Loading: read, verify and rebuild a checkpoint; or copy it into live objects.

Each call does its blocking work as one worker-thread call. Every tensor is read
straight into the memory of the tensor or array that is returned (or of the target,
for ``load_into``), and its crc32c is checked before the tree is handed back. A step
directory of a group checkpoint loads as a group of one reads it: DTensors whole,
assembled from their boxes (``_readers``).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._base import heap as _heap
from .._base import offload as _offload
from .._base.errors import (
    CheckpointError,
    CheckpointKeyError,
    CorruptCheckpointError,
    NotACheckpointError,
    PickleNotAllowedError,
    StateMismatchError,
)
from .._format.codec import Header, TensorInfo, how_to_read, read_header, sniff, tree_of
from .._format.manifest import MANIFEST_NAME, Manifest, base_file, read_manifest, refused_per_rank
from .._format.tree import (
    decode_key,
    dict_items,
    format_path,
    known_object,
    rebuild,
    release_dicts,
    sequence_values,
    walk_leaves,
    walk_nodes,
)
from .._storage.backends import resolve
from .._storage.protocol import Reader, ReaderFile, Storage, exists
from .fit import Fit, Guard, TreeSide, ValueSide
from .progress import counted
from .readers import EntryReader, MapLocation, Shards
from .refs import follow
from .targets import Destinations, assign, find, held_paths, set_values
from .verify import Progress, verify_blocking
from .verify import VerifyReport as VerifyReport


async def load(
    path: str,
    *,
    keys: Sequence[str] | None = None,
    map_location: MapLocation = None,
    allow_pickle: bool = False,
    storage: Storage | None = None,
    replicas: str | None = None,
    rank: int | None = None,
    progress: Progress | None = None,
) -> Any:
    """Read a checkpoint back as the tree that was saved.

    ``path`` is a checkpoint file, or the step directory of a group checkpoint: that
    loads whole, its DTensors assembled from their shards. Leaves that differed
    between the ranks that saved it are refused (named), as nobody's in particular;
    ``rank=N`` reads the step as rank N of the group that saved it did, and gets
    rank N's. ``keys`` are dotted paths (``["model.layer1", "optimizer"]``); the
    result is the same tree pruned to those subtrees. A plain safetensors file loads
    as a flat dict. ``replicas`` is the file holding the entries a rank's file marks
    external (rank 0's file of the same step); a step directory needs none.
    ``progress(done, total)`` is told the bytes read so far, from the reading thread
    (``total``: the bytes of the files opened so far); its last call says ``total`` of
    ``total``.

    Entries under 64 KiB are read with their neighbours into one buffer of at most
    4 MiB and returned as views of it, each with a storage of its own bytes that cannot
    be resized (as ``torch.load(mmap=True)`` returns its tensors); the buffer lives while
    any of them does. Tensors of 4 MiB or more are allocated with transparent huge
    pages asked for (``MADV_HUGEPAGE`` on Linux), as NumPy asks for them for its large
    arrays; ``NUMPY_MADVISE_HUGEPAGE=0`` in the environment turns both off.
    """
    request = LoadRequest(
        keys=keys, map_location=map_location, allow_pickle=allow_pickle, replicas=replicas, rank=rank
    )
    return await _offload.run_io(load_now, path, request, storage, progress)


def load_now(
    path: str, request: LoadRequest, storage: Storage | None = None, progress: Progress | None = None
) -> Any:
    """``load`` in the calling thread: the blocking twin's (``load_sync``), and what
    ``load`` runs in a worker thread."""
    storage, path = resolve(path, storage)
    storage, finished = counted(storage, progress)
    loaded = read_blocking(storage, path, request)
    finished()
    return loaded


async def verify(
    path: str, *, storage: Storage | None = None, progress: Progress | None = None
) -> VerifyReport:
    """Recompute every checksum; raise CorruptCheckpointError on any mismatch, naming
    every entry that failed. A step directory is verified whole: its manifest, and every
    rank's file against it (on one node of a group of several, the files that node
    holds, each it should hold: ``node`` in the report names the node).
    ``progress(done, total)`` is called with the bytes read so far, from the worker
    thread that reads them."""
    return await _offload.run_io(verify_now, path, storage, progress)


def verify_now(path: str, storage: Storage | None = None, progress: Progress | None = None) -> VerifyReport:
    """``verify`` in the calling thread (see ``load_now``)."""
    storage, path = resolve(path, storage)
    return verify_blocking(storage, path, progress)


async def load_into(
    path: str,
    target: Any,
    *,
    strict: bool = True,
    keys: Sequence[str] | None = None,
    allow_pickle: bool = False,
    storage: Storage | None = None,
    replicas: str | None = None,
    rank: int | None = None,
    progress: Progress | None = None,
) -> Any:
    """Load a checkpoint into existing tensors, arrays, containers and Stateful objects.

    Tensors and arrays are updated in place; with ``strict`` a missing or unexpected
    key, or a shape or dtype mismatch, raises StateMismatchError; without it, the
    target's entries are loaded and the checkpoint's others ignored. ``keys`` loads
    only those subtrees (the rest of the target is left alone). Returns ``target``.

    All or nothing: every key, shape and dtype, a Module's keys and shapes, an
    Optimizer's parameter groups (as many, as large) and every checksum are checked
    before the first byte of the target changes; a load that fails leaves it as it was
    and calls no ``load_state_dict``. An optimizer state whose keys name none of the
    optimizer's parameters (int keys a conversion turned into text) is refused.

    CPU tensors and arrays whose dtype, shape and layout match are read straight into
    their own memory, with no intermediate copy; so are the tensors of a Stateful
    object's ``state_dict()`` (a model's parameters, an optimizer's state), and the
    local shards of DTensors, whatever their mesh and placements. Their checksums are
    checked first, in a pass that keeps none of their bytes; from a local file, the
    read that follows it is served by the page cache. ``replicas``, ``rank`` and
    ``progress`` as in ``load``.
    """
    request = LoadRequest(
        keys=keys, allow_pickle=allow_pickle, target=target, strict=strict, replicas=replicas, rank=rank
    )
    await _offload.run_io(load_into_now, path, request, storage, progress)
    return target


def load_into_now(
    path: str, request: LoadRequest, storage: Storage | None = None, progress: Progress | None = None
) -> None:
    """``load_into`` in the calling thread (see ``load_now``). What was rebuilt is dropped
    here, not on the event loop: its containers alone are ~15 ms of deallocation per
    100,000 tensors."""
    storage, path = resolve(path, storage)
    storage, finished = counted(storage, progress)
    read_blocking(storage, path, request)
    finished()


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """What a load reads and how: the arguments of ``load`` and ``load_into``, whole.

    ``keys``: the dotted subtrees to read (None: all). ``map_location``: where tensors go.
    ``allow_pickle``: unpickle what was stored pickled. ``target``: the objects to load
    into (None: build the tree), ``strict`` about its keys, shapes and dtypes.
    ``replicas``: the file of replicated entries. ``rank``: read a step directory as rank
    N of the group that saved it."""

    keys: Sequence[str] | None = None
    map_location: MapLocation = None
    allow_pickle: bool = False
    target: Any = None
    strict: bool = True
    replicas: str | None = None
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class Step:
    """A group checkpoint being read, as rank ``rank`` of a group of ``world``."""

    directory: str
    manifest: Manifest
    rank: int
    world: int
    #: The file to read the replicated entries from, if not ``manifest.replicas``: one
    #: of ``manifest.node_replicas``, on the reader's node.
    replicas: str | None = None


def read_blocking(storage: Storage, path: str, request: LoadRequest) -> Any:
    """``load``/``load_into`` of a file or a step directory. Blocking. The collector
    is held off throughout: the header and the tree are thousands of objects, freed by
    reference counting, and what is built is returned (see ``gc_paused``)."""
    with _heap.gc_paused(keep=True):
        if exists(storage, storage.join(path, MANIFEST_NAME)):
            manifest = read_manifest(storage, path)
            rank = request.rank
            if rank is not None and not 0 <= rank < manifest.world_size:
                raise ValueError(f"rank={rank}: {path} was saved by ranks 0..{manifest.world_size - 1}")
            step = Step(path, manifest, rank or 0, 1 if rank is None else manifest.world_size)
            return read_step(storage, step, request)
        return load_file(storage, path, request)


def load_blocking(
    storage: Storage,
    path: str,
    keys: Sequence[str] | None,
    map_location: MapLocation,
    allow_pickle: bool,
    target: Any = None,
    strict: bool = True,
    replicas: str | None = None,
    rank: int | None = None,
) -> Any:
    """``read_blocking`` with its request spelled out, for callers not moved to
    LoadRequest yet (the manager's layouts, the command line, the fuzzers)."""
    request = LoadRequest(keys, map_location, allow_pickle, target, strict, replicas, rank)
    return read_blocking(storage, path, request)


def load_step(
    storage: Storage,
    step: Step,
    keys: Sequence[str] | None,
    map_location: MapLocation,
    allow_pickle: bool,
    target: Any,
    strict: bool,
) -> Any:
    """``read_step`` with its request spelled out (see ``load_blocking``)."""
    return read_step(storage, step, LoadRequest(keys, map_location, allow_pickle, target, strict))


def read_step(storage: Storage, step: Step, request: LoadRequest) -> Any:
    """This rank's part of a group checkpoint: its tree and plain entries from the file
    ``base_file`` picks, DTensors from their boxes, anything per-rank refused if the
    group is another size. Blocking."""
    m = step.manifest
    join = storage.join
    checksums = {join(step.directory, f): c for f, c in zip(m.files, m.checksums, strict=True)}
    opened: dict[int, tuple[Reader, Header]] = {}

    def open_rank(i: int) -> tuple[Reader, Header]:
        if i not in opened:
            f = storage.open_read(join(step.directory, m.files[i]))
            try:
                opened[i] = f, _ = follow(storage, f, _read_checked(f, checksums))
            except BaseException:
                f.close()
                raise
        return opened[i]

    def refuse(asked: set[str]) -> None:
        refused = refused_per_rank(m, step.world, sorted(asked))
        if refused:
            raise StateMismatchError(
                f"{step.directory}: {', '.join(refused)} held state of each rank (it differed between the "
                f"{m.world_size} ranks that saved it), which no rank of a group of {step.world} can take: "
                "leave it out (keys=, or a target without it)"
                + ("" if step.world != 1 else ", or pass rank=N to read rank N's")
            )

    try:
        return load_file(
            storage,
            join(step.directory, m.files[base_file(m, step.rank, step.world)]),
            dataclasses.replace(request, replicas=join(step.directory, step.replicas or m.replicas)),
            checksums=checksums,
            shards=Shards(m.shards, open_rank, join(step.directory, MANIFEST_NAME)),
            refuse=refuse,
        )
    finally:
        for f, _ in opened.values():
            f.close()


def load_file(
    storage: Storage,
    path: str,
    request: LoadRequest,
    *,
    checksums: Mapping[str, str] | None = None,
    shards: Shards | None = None,
    refuse: Callable[[set[str]], None] | None = None,
) -> Any:
    """Load one checkpoint file. ``checksums`` (path -> header crc32c, as a manifest
    records them) refuses a file that is not the one committed; ``shards`` and
    ``refuse`` come with a step of a group (``read_step``). Blocking."""
    keys, map_location, allow_pickle = request.keys, request.map_location, request.allow_pickle
    target, strict, replicas = request.target, request.strict, request.replicas
    files: list[Reader] = [storage.open_read(path)]
    dests = Destinations(track_held=refuse is not None)
    try:
        # A step's file must be the aiosnap file its manifest vouches for: never sniffed
        # as another format (a torch.save file there would be unpickled).
        foreign = sniff(files[0]) if checksums is None else None
        if foreign is not None:
            loaded = _load_foreign(files[0], foreign, keys, map_location, allow_pickle)
            if target is not None:
                Fit(ValueSide(), strict, dests).fit(target, loaded, ())  # all or nothing: see _load/fit.py
                assign(target, loaded, (), strict, dests)
            return loaded
        files[0], header = follow(storage, files[0], _read_checked(files[0], checksums))
        tree = tree_of(header)
        try:
            if keys is not None:
                tree = _prune(tree, list(keys), path)
            reader = EntryReader(files[0], header, map_location, allow_pickle, shards)
            if header.external and _refers_to(tree, header.external, shards):
                if replicas is None:
                    raise CheckpointError(
                        f"{path}: some entries are stored in the file of the rank that wrote the replicated "
                        "entries; load the step directory, or pass replicas="
                    )
                files.append(storage.open_read(replicas))
                files[1], replicated = follow(storage, files[1], _read_checked(files[1], checksums))
                reader.add_replicas(files[1], replicated)
            guard = None
            if target is not None:
                # An entry of this file, or (with replicas) of theirs: with none, a lookup
                # in its own table is the same, without a method call a tensor.
                one = len(reader.sources) == 1 and not header.external
                lookup = header.tensors.get if one else reader.lookup
                find(target, tree, lookup, dests)
                # All or nothing: whatever would be refused, refused before anything is read.
                fit = Fit(TreeSide(lookup, shards, _own(header), dests), strict, dests)
                guard = Guard(fit, target, tree, reader.resolve)
            if refuse is not None:
                asked = (
                    held_paths(dests) if target is not None else {format_path(p) for p, _ in walk_nodes(tree)}
                )
                refuse(asked)
            reader.prefetch(tree, dests, guard)
            set_values(dests)
            if known_object(tree, dests.known) is not None:  # the target is a dict find knew whole
                # Read in place, every tensor: rebuilt and assigned, the tree would be
                # the target's own tensors, each already where it belongs, and its
                # plain values, which assign would have put where set_values did.
                filled, loaded = True, target
                release_dicts(tree)
            else:
                # What is known (see Destinations) comes back as the target's own dicts.
                filled, loaded = False, rebuild(tree, reader.resolve, consume=True, known=dests.known)
            # Not at once: see release. The tree goes whole (~20 ms per 100,000 leaves).
            _heap.release(header.tensors)
        except CheckpointError:
            raise
        except ValueError as exc:
            raise CorruptCheckpointError(path, f"bad tree: {exc}") from None
    finally:
        for f in files:
            f.close()
    if target is not None:
        if not filled:
            assign(target, loaded, (), strict, dests)
        _heap.release(dests.direct, dests.held, dests.values, dests.known, dests.infos)
    return loaded


def _own(header: Header) -> Callable[[str], TensorInfo | None]:
    """An entry of the file, stored in it or described as another's (see Shards.saved)."""
    return lambda name: header.tensors.get(name) or header.external.get(name)


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


def _refers_to(tree: Any, names: dict[str, TensorInfo], shards: Shards | None) -> bool:
    """Whether the tree needs an external entry that is not a DTensor's box (in a step,
    every DTensor is read from the boxes its manifest indexes)."""
    return any(
        name in names and not (kind == "dtensor" and shards is not None)
        for _, kind, name in walk_leaves(tree)
    )


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
