"""Capture: turn a state tree into a JSON skeleton plus a list of array leaves.

The skeleton holds every container and small value *by value* (so the caller may
mutate them once the save call returns); tensors and arrays become references by
name, and their bytes are copied by the staging step. Capture writes the skeleton
as JSON text as it walks: a tree of Python nodes would cost a second walk to encode
it, and freeing a large one holds the GIL for as long as the cascade of
deallocations runs. Objects with
``state_dict()``/``load_state_dict()`` are captured through ``state_dict()``.

Node encoding (JSON; read back by ``nodes``):
    None, bool, int, str      -> themselves
    finite float              -> itself; nan/inf -> {"$": "float", "v": "nan"}
    list                      -> [node, ...]
    tuple                     -> {"$": "tuple", "v": [node, ...]}
    dict                      -> {"$": "dict", "items": [[key-node, node], ...]}
    bytes                     -> {"$": "bytes", "v": base64}
    torch.Tensor              -> {"$": "tensor", "n": name}
    DTensor                   -> {"$": "dtensor", "n": name}  (this rank's shard; see _shards)
    numpy.ndarray / scalar    -> {"$": "ndarray" | "npscalar", "n": name}
    anything else (opt-in)    -> {"$": "pickle", "n": name}
"""

from __future__ import annotations

import base64
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._base.errors import UnsupportedTypeError
from .._base.heap import hand_over
from .dtypes import is_storable_torch, numpy_file_dtype
from .header import json_string

# The read side of the node encoding, re-exported: what capture writes, and its readers.
from .nodes import LEAF_TAGS as LEAF_TAGS
from .nodes import MAX_DEPTH as MAX_DEPTH
from .nodes import PLAIN_KEYS as PLAIN_KEYS
from .nodes import Node as Node
from .nodes import check as check
from .nodes import decode_key as decode_key
from .nodes import dict_items as dict_items
from .nodes import format_path as format_path
from .nodes import known_object as known_object
from .nodes import rebuild as rebuild
from .nodes import release_dicts as release_dicts
from .nodes import sequence_values as sequence_values
from .nodes import walk_leaves as walk_leaves
from .nodes import walk_nodes as walk_nodes
from .shards import is_dtensor, shard_of

_KEY_TYPES = (str, int, float, bool, type(None))
#: At most this many state_dict() calls in a row, each on what the last returned: a
#: wrapper's state_dict() may return its inner object's, never sixteen levels of them.
MAX_STATE_HOPS = 16
_PLAIN_TENSORS = tuple(
    cls for cls in (torch.Tensor, torch.nn.Parameter, getattr(torch.nn, "Buffer", None)) if cls
)


@dataclass(slots=True)
class Leaf:
    """A value whose bytes go to the data section: tensor, array or pickle."""

    name: str
    kind: str  # "tensor" | "ndarray" | "npscalar" | "pickle"
    value: Any
    #: A shard of a DTensor: the whole's shape and this box's offsets in it.
    shard: tuple[tuple[int, ...], tuple[int, ...]] | None = None


@dataclass(slots=True)
class Snapshot:
    """The captured state: the skeleton as JSON text, and the leaves it refers to by name.

    ``external`` leaves are referred to by the skeleton but stored in another file
    (see ExternalLeaves): they are described in the header, never staged.
    """

    tree: str
    leaves: list[Leaf] = field(default_factory=list)
    external: list[Leaf] = field(default_factory=list)
    #: The optimizers whose ``state_dict()`` was taken: a lazy capture guards their step.
    optimizers: list[Any] = field(default_factory=list)
    #: The other entries of the file's ``__metadata__``; None: the default ones (see
    #: ``header.DEFAULT_METADATA``).
    metadata: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class ExternalLeaves:
    """A state to capture whose tensors and arrays at paths where ``is_external(path)``
    holds are stored elsewhere: replicated entries that one rank writes for all. The
    path is the dotted path where capture first reaches the leaf."""

    state: object
    is_external: Callable[[str], bool]


@dataclass(frozen=True, slots=True)
class WithMetadata:
    """A state to capture, and the entries its file's ``__metadata__`` holds beside
    aiosnap's own (``aiosnap convert`` keeps a safetensors file's this way)."""

    state: object
    metadata: dict[str, str]


def is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _wraps_optimizer(obj: object) -> bool:
    """An optimizer wrapper that is no ``Optimizer`` (Accelerate's, Lightning's, a
    trainer's own): it holds the optimizer as ``.optimizer``."""
    return callable(getattr(getattr(obj, "optimizer", None), "register_step_pre_hook", None))


def capture(target: object, *, allow_pickle: bool = False) -> Snapshot:
    """Capture ``target``; raise UnsupportedTypeError naming the first bad place."""
    return _Capture(allow_pickle).run(target)


class _Capture:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.snapshot = Snapshot(tree="")
        self.names: set[str] = set()
        self.aliases: dict[object, str] = {}
        #: The containers and stateful objects being walked (ids): one reached again is a cycle.
        self.active: set[int] = set()
        #: state_dict() calls in a row, each on what the last returned (see stateful).
        self.hops = 0
        self.is_external: Callable[[str], bool] | None = None

    def run(self, target: object) -> Snapshot:
        if isinstance(target, WithMetadata):
            self.snapshot.metadata, target = dict(target.metadata), target.state
        if isinstance(target, ExternalLeaves):
            self.is_external, target = target.is_external, target.state
        self.snapshot.tree = self.node(target, ())
        return self.snapshot

    def node(self, obj: object, path: tuple[object, ...]) -> str:
        """The JSON text of ``obj``'s node (see the module docstring)."""
        kind = type(obj)
        if kind in _PLAIN_TENSORS:  # first: the states of 100,000 leaves are mostly tensors
            return self.tensor(obj, path)  # type: ignore[arg-type]
        if isinstance(obj, np.generic):  # before float: np.float64 is a float subclass
            return self.array(obj, path, "npscalar")
        if kind is str:
            return json_string(obj)  # type: ignore[arg-type]
        if kind is int:
            try:
                return int.__repr__(obj)
            except ValueError:  # more digits than Python turns into text
                why = f"an int of more than {sys.get_int_max_str_digits()} digits cannot be written as text"
                return self.other(obj, path, why)
        if kind is bool:
            return "true" if obj else "false"
        if obj is None:
            return "null"
        if isinstance(obj, (bool, int, str)):
            return self.other(obj, path)
        if isinstance(obj, float):
            text = float.__repr__(obj)
            return text if math.isfinite(obj) else f'{{"$":"float","v":"{text}"}}'
        if isinstance(obj, torch.Tensor):
            if is_dtensor(obj):
                return self.dtensor(obj, path)
            return self.tensor(obj, path)
        if isinstance(obj, np.ndarray):
            if type(obj) not in (np.ndarray, np.memmap):
                # A subclass would come back as a plain array (a MaskedArray without its
                # mask): stored only pickled, which restores it exactly.
                why = f"{type(obj).__module__}.{type(obj).__qualname__} would load as a plain ndarray"
                return self.other(obj, path, why)
            return self.array(obj, path, "ndarray")
        if isinstance(obj, (bytes, bytearray)):
            return f'{{"$":"bytes","v":"{base64.b64encode(obj).decode()}"}}'
        if isinstance(obj, (dict, list)) or type(obj) in (tuple, torch.Size):
            return self.container(obj, path)
        if is_stateful(obj):
            return self.stateful(obj, path)
        return self.other(obj, path)

    def stateful(self, obj: object, path: tuple[object, ...]) -> str:
        """The node of what ``obj.state_dict()`` returns. Bounded: a state_dict() that
        returns a stateful object is followed MAX_STATE_HOPS times in a row at most (a
        MagicMock's returns a new MagicMock every time), and never back to an object
        whose state is being taken (itself, or one above it)."""
        if id(obj) in self.active:
            raise UnsupportedTypeError(
                f"the state_dict() of the {_type_name(obj)} at {format_path(path)} holds that object "
                "again (itself, or an object whose state it is part of): its state has no end"
            )
        if self.hops >= MAX_STATE_HOPS:
            raise UnsupportedTypeError(
                f"the state_dict() at {format_path(path)} returned an object with a state_dict() of "
                f"its own {MAX_STATE_HOPS} times in a row ({_type_name(obj)} last): a state must end "
                "in plain values"
            )
        if isinstance(obj, torch.optim.Optimizer) or _wraps_optimizer(obj):
            self.snapshot.optimizers.append(obj)
        self.active.add(id(obj))
        self.hops += 1
        try:
            return self.node(obj.state_dict(), path)  # type: ignore[attr-defined]
        finally:
            self.hops -= 1
            self.active.discard(id(obj))

    def container(self, obj: Any, path: tuple[object, ...]) -> str:
        if id(obj) in self.active:
            raise UnsupportedTypeError(f"the state tree contains itself at {format_path(path)}")
        if len(path) >= MAX_DEPTH:
            where = format_path(path[:8])
            raise UnsupportedTypeError(f"the state tree is nested more than {MAX_DEPTH} deep at {where}...")
        self.active.add(id(obj))
        hops, self.hops = self.hops, 0  # counted in a row: a container between them ends a run
        try:
            if isinstance(obj, dict):
                items = ",".join([self.item(k, v, path) for k, v in obj.items()])
                return f'{{"$":"dict","items":[{items}]}}'
            values = ",".join([self.node(v, (*path, i)) for i, v in enumerate(obj)])
            return f"[{values}]" if isinstance(obj, list) else f'{{"$":"tuple","v":[{values}]}}'
        finally:
            self.hops = hops
            self.active.discard(id(obj))

    def item(self, key: object, value: object, path: tuple[object, ...]) -> str:
        if type(key) is str:  # the common key, without node()'s dispatch
            return f"[{json_string(key)},{self.node(value, (*path, key))}]"
        if not isinstance(key, _KEY_TYPES):
            raise UnsupportedTypeError(
                f"dict key {key!r} of type {type(key).__name__} at {format_path(path)}: "
                "keys must be str, int, float, bool or None"
            )
        return f"[{self.node(key, path)},{self.node(value, (*path, key))}]"

    def tensor(self, t: torch.Tensor, path: tuple[object, ...]) -> str:
        hand_over()  # the walk runs in a worker thread: the event loop gets its turn
        problem = _tensor_problem(t)
        if problem:
            return self.other(t, path, problem)
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        key = (
            "tensor",
            t.device,
            t.dtype,
            # Storages of no bytes all have the data pointer 0: told apart by the storage
            # itself (its address is held while the first leaf keeps the tensor alive).
            ptr if ptr else ("storage", storage._cdata),
            t.storage_offset(),
            t.shape,  # a torch.Size is a tuple: no copy needed to hash it
            t.stride(),
            # A conjugate or negative view has its base's bytes and other values.
            t.is_conj(),
            t.is_neg(),
        )
        return f'{{"$":"tensor","n":{json_string(self.leaf(key, t, path, "tensor"))}}}'

    def dtensor(self, t: Any, path: tuple[object, ...]) -> str:
        """This rank's shard of a DTensor: stored if this rank is its replica group's
        writer, else only described (external), as another rank's file stores it."""
        key = ("dtensor", id(t))
        if key not in self.aliases:
            where = format_path(path)
            shard = shard_of(t, where)
            problem = _tensor_problem(shard.local) if shard is not None else ""
            if problem:
                raise UnsupportedTypeError(f"the DTensor at {where}: {problem}")
            if shard is None:  # this rank is not in its mesh: it holds nothing of it
                whole = tuple(int(n) for n in t.shape)
                local, meta = t.to_local(), (whole, (0,) * len(whole))
            else:
                local, meta = shard.local, (shard.shape, shard.box.offsets)
            name = self.unique_name(where)
            stored = shard is not None and shard.writer
            kept = self.snapshot.leaves if stored else self.snapshot.external
            kept.append(Leaf(name, "tensor", local, meta))
            self.aliases[key] = name
        return f'{{"$":"dtensor","n":{json_string(self.aliases[key])}}}'

    def array(self, a: np.ndarray[Any, Any] | np.generic, path: tuple[object, ...], kind: str) -> str:
        if numpy_file_dtype(a.dtype) is None:
            return self.other(a, path, f"NumPy dtype {a.dtype} has no raw form")
        key = ("ndarray", id(a)) if kind == "ndarray" else None
        return f'{{"$":"{kind}","n":{json_string(self.leaf(key, a, path, kind))}}}'

    def leaf(self, key: object, value: object, path: tuple[object, ...], kind: str) -> str:
        # The same tensor reached twice (tied weights) is stored once and loads as one.
        if key is not None and key in self.aliases:
            return self.aliases[key]
        where = format_path(path)
        name = self.unique_name(where)
        external = kind != "pickle" and self.is_external is not None and self.is_external(where)
        (self.snapshot.external if external else self.snapshot.leaves).append(Leaf(name, kind, value))
        if key is not None:
            self.aliases[key] = name
        return name

    def unique_name(self, base: str) -> str:
        name, n = base, 1
        while name in self.names or name == "__metadata__":
            n += 1
            name = f"{base}#{n}"
        self.names.add(name)
        return name

    def other(self, obj: object, path: tuple[object, ...], why: str = "") -> str:
        if self.allow_pickle:
            return f'{{"$":"pickle","n":{json_string(self.leaf(None, obj, path, "pickle"))}}}'
        reason = why or f"{type(obj).__module__}.{type(obj).__qualname__} is not a state type"
        raise UnsupportedTypeError(
            f"cannot store the value at {format_path(path)}: {reason}; "
            "pass allow_pickle=True to store it pickled"
        )


def _type_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _tensor_problem(t: torch.Tensor) -> str:
    if type(t) not in _PLAIN_TENSORS:
        return f"tensor subclass {type(t).__name__} is not supported"
    if t.layout != torch.strided:
        return f"{t.layout} tensors are not supported"
    if not is_storable_torch(t.dtype):
        return f"quantized dtype {t.dtype} is not supported"
    if t.is_meta:
        return "meta tensors hold no data"
    return ""
