"""The node encoding of a state's tree, read back: check a tree from a file, rebuild its
objects, walk its leaves. ``tree`` writes it (capture); see its docstring for the
encoding, and docs/format.md.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .._base.heap import release

Node = Any  # a JSON value, as described in tree's docstring
#: At most this many containers nest, at capture and at load: every walk of a tree is
#: then bounded, whatever a file says.
MAX_DEPTH = 100
LEAF_TAGS = frozenset(("tensor", "dtensor", "ndarray", "npscalar", "pickle"))
#: Key nodes that are the key itself (the others are float nodes).
PLAIN_KEYS = (str, int, bool, type(None), float)
_FLOAT_WORDS = ("nan", "inf", "-inf")


def format_path(parts: tuple[object, ...]) -> str:
    return ".".join(map(str, parts)) if parts else "<root>"


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
