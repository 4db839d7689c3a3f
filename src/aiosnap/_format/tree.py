"""Capture: turn a state tree into a JSON skeleton plus a list of array leaves.

The skeleton holds every container and small value *by value* (so the caller may
mutate them once the save call returns); tensors and arrays become references by
name, and their bytes are copied by the staging step. Capture writes the skeleton
as JSON text as it walks: a tree of Python nodes would cost a second walk to encode
it, and freeing a large one holds the GIL for as long as the cascade of
deallocations runs. Objects with
``state_dict()``/``load_state_dict()`` are captured through ``state_dict()``.

Node encoding (JSON):
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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._base.errors import UnsupportedTypeError
from .._base.offload import release
from .dtypes import is_storable_torch, numpy_file_dtype
from .header import json_string
from .shards import is_dtensor, shard_of

Node = Any  # a JSON value, as described in the module docstring
_KEY_TYPES = (str, int, float, bool, type(None))
#: At most this many containers nest, at capture and at load: every walk of a tree is
#: then bounded, whatever a file says.
MAX_DEPTH = 100
LEAF_TAGS = frozenset(("tensor", "dtensor", "ndarray", "npscalar", "pickle"))
#: Key nodes that are the key itself (the others are float nodes).
PLAIN_KEYS = (str, int, bool, type(None), float)
_FLOAT_WORDS = ("nan", "inf", "-inf")
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


@dataclass(frozen=True, slots=True)
class ExternalLeaves:
    """A state to capture whose tensors and arrays at paths where ``is_external(path)``
    holds are stored elsewhere: replicated entries that one rank writes for all. The
    path is the dotted path where capture first reaches the leaf."""

    state: object
    is_external: Callable[[str], bool]


def is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _wraps_optimizer(obj: object) -> bool:
    """An optimizer wrapper that is no ``Optimizer`` (Accelerate's, Lightning's, a
    trainer's own): it holds the optimizer as ``.optimizer``."""
    return callable(getattr(getattr(obj, "optimizer", None), "register_step_pre_hook", None))


def format_path(parts: tuple[object, ...]) -> str:
    return ".".join(map(str, parts)) if parts else "<root>"


def capture(target: object, *, allow_pickle: bool = False) -> Snapshot:
    """Capture ``target``; raise UnsupportedTypeError naming the first bad place."""
    return _Capture(allow_pickle).run(target)


class _Capture:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.snapshot = Snapshot(tree="")
        self.names: set[str] = set()
        self.aliases: dict[object, str] = {}
        self.active: set[int] = set()
        self.is_external: Callable[[str], bool] | None = None

    def run(self, target: object) -> Snapshot:
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
            if isinstance(obj, torch.optim.Optimizer) or _wraps_optimizer(obj):
                self.snapshot.optimizers.append(obj)
            return self.node(obj.state_dict(), path)  # type: ignore[attr-defined]
        return self.other(obj, path)

    def container(self, obj: Any, path: tuple[object, ...]) -> str:
        if id(obj) in self.active:
            raise UnsupportedTypeError(f"the state tree contains itself at {format_path(path)}")
        if len(path) >= MAX_DEPTH:
            where = format_path(path[:8])
            raise UnsupportedTypeError(f"the state tree is nested more than {MAX_DEPTH} deep at {where}...")
        self.active.add(id(obj))
        try:
            if isinstance(obj, dict):
                items = ",".join([self.item(k, v, path) for k, v in obj.items()])
                return f'{{"$":"dict","items":[{items}]}}'
            values = ",".join([self.node(v, (*path, i)) for i, v in enumerate(obj)])
            return f"[{values}]" if isinstance(obj, list) else f'{{"$":"tuple","v":[{values}]}}'
        finally:
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
        problem = _tensor_problem(t)
        if problem:
            return self.other(t, path, problem)
        key = (
            "tensor",
            t.device,
            t.dtype,
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            t.shape,  # a torch.Size is a tuple: no copy needed to hash it
            t.stride(),
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


def check(tree: Node) -> None:
    """Check a tree read from a file, without recursion: at most MAX_DEPTH containers
    nested, every node of a known shape, and dict keys only what capture writes
    (scalars, and float nodes). ValueError names the first bad place. Walks of a checked
    tree are safe."""
    stack: list[tuple[Node, tuple[object, ...]]] = [(tree, ())]
    while stack:
        node, path = stack.pop()
        if node is None or isinstance(node, (bool, int, float, str)):
            continue
        tag = node.get("$") if isinstance(node, dict) else None
        if tag is not None and not isinstance(tag, str):  # a list or an object: unhashable, never a tag
            raise ValueError(f"unknown node type at {format_path(path)}")
        if (isinstance(node, list) or tag in ("dict", "tuple")) and len(path) >= MAX_DEPTH:
            raise ValueError(f"the tree is nested more than {MAX_DEPTH} deep at {format_path(path[:8])}...")
        if isinstance(node, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(node))
        elif not isinstance(node, dict):
            raise ValueError(f"bad node at {format_path(path)}")
        elif tag == "dict":
            for key_node, value in dict_items(node, path):
                if not _is_reference(value):  # else checked here: the common leaf, no path built
                    stack.append((value, (*path, decode_key(key_node, path))))
        elif tag == "tuple":
            stack.extend((v, (*path, i)) for i, v in enumerate(sequence_values(node, path)))
        elif tag == "float":
            _str(node, "v", path, _FLOAT_WORDS)
        elif tag == "bytes":
            _bytes(node, path)  # decoded here too: verify checks a tree with this alone
        elif tag in LEAF_TAGS:
            _str(node, "n", path)
        else:
            raise ValueError(f"unknown node type {tag!r:.40} at {format_path(path)}")


def _is_reference(node: Node) -> bool:
    """Whether a node is a well-formed reference to a stored value."""
    if type(node) is not dict:
        return False
    tag = node.get("$")
    return type(tag) is str and tag in LEAF_TAGS and type(node.get("n")) is str


def rebuild(
    node: Node,
    resolve: Callable[[str, str, tuple[object, ...]], object],
    consume: bool = False,
    known: Mapping[int, tuple[Any, Any]] | None = None,
) -> object:
    """Turn a skeleton back into objects; ``resolve(kind, name, path)`` gives leaves.

    ``consume``: the skeleton is not used again, and its large lists are emptied a
    slice at a time once rebuilt (``release``), deepest first: freeing a tree of
    100,000 leaves at once held the GIL for 20 ms. ``known``: dict nodes already made
    (id of the node -> the node and the object it is: see ``_targets.Destinations``),
    returned as they are."""
    return _rebuild(node, resolve, (), consume, known)


def _rebuild(
    node: Node,
    resolve: Callable[[str, str, tuple[object, ...]], object],
    path: tuple[object, ...],
    consume: bool = False,
    known: Mapping[int, tuple[Any, Any]] | None = None,
) -> object:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        out_list = [_rebuild(v, resolve, (*path, i), consume, known) for i, v in enumerate(node)]
        if consume:
            release(node)
        return out_list
    if not isinstance(node, dict):
        raise ValueError(f"bad node at {format_path(path)}")
    tag = node.get("$")
    if tag == "dict":
        made = known_object(node, known)
        if made is not None:
            if consume:
                release_dicts(node)
            return made
        out: dict[object, object] = {}
        for key_node, value in dict_items(node, path):
            key = key_node if type(key_node) in PLAIN_KEYS else _rebuild(key_node, resolve, path)
            if _is_reference(value):
                out[key] = resolve(value["$"], value["n"], (*path, key))
            else:
                out[key] = _rebuild(value, resolve, (*path, key), consume, known)
        if consume:
            release(node["items"])
        return out
    if tag == "tuple":
        values = sequence_values(node, path)
        out_tuple = tuple(_rebuild(v, resolve, (*path, i), consume, known) for i, v in enumerate(values))
        if consume:
            release(values)
        return out_tuple
    if tag == "float":
        return float(_str(node, "v", path, _FLOAT_WORDS))
    if tag == "bytes":
        return _bytes(node, path)
    if tag in LEAF_TAGS:
        return resolve(tag, _str(node, "n", path), path)
    raise ValueError(f"unknown node type {tag!r:.40} at {format_path(path)}")


def known_object(node: Node, known: Mapping[int, tuple[Any, Any]] | None) -> Any:
    """The object ``known`` (id of a dict node -> the node and the object it is: see
    ``_targets.Destinations.known``) holds for ``node``, or None."""
    made = known.get(id(node)) if known else None
    return made[1] if made is not None and made[0] is node else None


def release_dicts(node: Node) -> None:
    """Free a checked tree's dict nodes a slice of items at a time, deepest first, as
    ``rebuild(consume=True)`` does (freed at once, 100,000 leaves held the GIL 20 ms)."""
    if type(node) is dict and node.get("$") == "dict":
        for _, value in node["items"]:
            if type(value) is dict and value.get("$") == "dict":
                release_dicts(value)
        release(node["items"])


def dict_items(node: dict[str, Any], path: tuple[object, ...] = ()) -> Iterator[tuple[Node, Node]]:
    """The (key node, value node) pairs of a dict node, checked."""
    items = node.get("items")
    if not isinstance(items, list):
        raise ValueError(f"bad dict node at {format_path(path)}")
    for pair in items:
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"bad dict item at {format_path(path)}")
        key = pair[0]
        if not (key is None or isinstance(key, (bool, int, float, str)) or _is_float_node(key)):
            raise ValueError(f"bad dict key at {format_path(path)}: only scalars are keys")
        yield key, pair[1]


def _is_float_node(node: Node) -> bool:
    return isinstance(node, dict) and node.get("$") == "float" and node.get("v") in _FLOAT_WORDS


def sequence_values(node: Node, path: tuple[object, ...] = ()) -> list[Node]:
    """The element nodes of a list node or a tuple node, checked."""
    values = node if isinstance(node, list) else node.get("v")
    if not isinstance(values, list):
        raise ValueError(f"bad tuple node at {format_path(path)}")
    return values


def decode_key(key_node: Node, path: tuple[object, ...] = ()) -> object:
    """A dict key, from its node (a key can be a float node but never a leaf)."""
    return _rebuild(key_node, _no_leaf, path)


def _bytes(node: dict[str, Any], path: tuple[object, ...]) -> bytes:
    try:
        return base64.b64decode(_str(node, "v", path), validate=True)
    except ValueError:  # binascii.Error, or a character that is not ASCII
        raise ValueError(f"bad bytes node at {format_path(path)}") from None


def _str(
    node: dict[str, Any], key: str, path: tuple[object, ...], allowed: tuple[str, ...] | None = None
) -> str:
    value = node.get(key)
    if not isinstance(value, str) or (allowed is not None and value not in allowed):
        raise ValueError(f"bad {node.get('$')} node at {format_path(path)}")
    return value


def walk_nodes(node: Node, path: tuple[object, ...] = ()) -> list[tuple[tuple[object, ...], Node]]:
    """(path, node) of every leaf of a checked tree: the references to stored values
    and the plain values; keys are decoded as in rebuild. A list, not a generator: with
    100,000 leaves, every level of nested generators cost ~0.2 us per leaf."""
    out: list[Any] = []
    _walk(node, path, out, False)
    return out


def walk_leaves(
    node: Node, path: tuple[object, ...] = (), skip: Mapping[int, tuple[Any, Any]] | None = None
) -> list[tuple[tuple[object, ...], str, str]]:
    """(path, kind, name) of every reference to a stored value; none under the dict
    nodes in ``skip`` (id of the node -> the node and anything: see
    ``_targets.Destinations.known``)."""
    out: list[Any] = []
    _walk(node, path, out, True, skip)
    return out


def _walk(
    node: Node,
    path: tuple[object, ...],
    out: list[Any],
    refs: bool,
    skip: Mapping[int, tuple[Any, Any]] | None = None,
) -> None:
    # A checked tree is nested at most MAX_DEPTH deep: the recursion is bounded.
    if isinstance(node, list):
        for i, v in enumerate(node):
            _walk(v, (*path, i), out, refs, skip)
        return
    tag = node.get("$") if isinstance(node, dict) else None
    if tag == "dict":
        if known_object(node, skip) is not None:
            return
        for key_node, value in node["items"]:  # pairs, as check found them (dict_items)
            key = key_node if type(key_node) in PLAIN_KEYS else decode_key(key_node, path)
            if not _is_reference(value):
                _walk(value, (*path, key), out, refs, skip)
            elif refs:
                out.append(((*path, key), value["$"], value["n"]))
            else:
                out.append(((*path, key), value))
    elif tag == "tuple":
        for i, v in enumerate(sequence_values(node, path)):
            _walk(v, (*path, i), out, refs, skip)
    elif not refs:
        out.append((path, node))
    elif type(tag) is str and tag in LEAF_TAGS:
        out.append((path, tag, _str(node, "n", path)))


def _no_leaf(kind: str, name: str, path: tuple[object, ...]) -> object:
    raise ValueError(f"a dict key cannot be a {kind} (at {format_path(path)})")
