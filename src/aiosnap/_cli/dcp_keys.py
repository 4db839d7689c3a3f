"""The dict keys of a state written as a DCP directory, kept across the round trip.

DCP flattens a state into text paths: every dict key becomes ``str(key)`` (an
optimizer's state ``{0: ...}`` comes back as ``{"0": ...}``, which the optimizer takes
and ignores), and an empty dict is not stored at all. So ``convert --to dcp`` writes,
beside DCP's files, ``aiosnap-keys.json``: the skeleton of the dicts DCP walked (their
keys, of their types, in order; the lists it walked; a 0 for each value it stored),
and the crc32c of the ``.metadata`` it was written with. Reading the directory back
(``convert``, ``diff``), the keys get their types again and the empty dicts come back;
a directory that DCP has written since (another ``.metadata``) is read as DCP left it.
The file is written only where it changes something.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from .._base.checksums import crc32c
from .._base.errors import CorruptCheckpointError
from .._format.tree import check, decode_key, dict_items
from .._storage.local import LocalStorage
from .._storage.protocol import put

KEYS_FILE = "aiosnap-keys.json"
#: A keys file larger than this is not ours.
_MOST = 256 << 20
_LEAF = 0


def skeleton(state: Mapping[Any, Any]) -> Any:
    """The skeleton of the dicts and lists DCP walks in ``state`` (as its
    ``traverse_state_dict`` does: every Mapping, the lists that hold a tensor or a
    container it walks); 0 where it stores a value."""
    return {"$": "dict", "items": [[_key_node(k), _walked(v)] for k, v in state.items()]}


def _walked(value: Any) -> Any:
    if isinstance(value, Mapping):
        return skeleton(value)
    if isinstance(value, list) and not _terminal(value):
        return [_walked(v) for v in value]
    return _LEAF


def _terminal(values: list[Any]) -> bool:
    """Whether DCP stores a list as one value (it walks one holding a tensor, a
    Mapping, or a list it walks)."""
    return not any(
        isinstance(v, (Mapping, torch.Tensor)) or (isinstance(v, list) and not _terminal(v)) for v in values
    )


def _key_node(key: Any) -> Any:
    """A key as the tree writes one; a key of no scalar type as DCP writes it (text)."""
    if key is None or isinstance(key, (bool, int, str)):
        return key
    if isinstance(key, float):
        return key if math.isfinite(key) else {"$": "float", "v": repr(key)}
    return str(key)


def leaf_paths(skel: Any, path: tuple[object, ...] = ()) -> set[tuple[object, ...]]:
    """The paths DCP names the stored values by: dict keys as text, list indices."""
    if isinstance(skel, list):
        return {p for i, v in enumerate(skel) for p in leaf_paths(v, (*path, i))}
    if isinstance(skel, dict):
        return {p for k, v in dict_items(skel) for p in leaf_paths(v, (*path, str(decode_key(k))))}
    return {path}


def _changes_anything(skel: Any) -> bool:
    """Whether the skeleton holds a key that is not text, or an empty dict."""
    if isinstance(skel, list):
        return any(_changes_anything(v) for v in skel)
    if isinstance(skel, dict):
        items = skel["items"]
        return not items or any(type(k) is not str or _changes_anything(v) for k, v in items)
    return False


def record(path: str, state: Mapping[Any, Any], planner_data: Any) -> list[str]:
    """Write ``path``'s keys file for ``state``, just saved there by DCP (whose
    ``planner_data`` maps each stored value to its path), if it changes anything.
    Notes for the user: why the types could not be kept, if they could not."""
    skel = skeleton(state)
    if not _changes_anything(skel):
        return []
    try:
        check(skel)
    except ValueError as exc:
        return [f"the keys' types were not kept ({exc}): they load as text"]
    if not isinstance(planner_data, Mapping) or leaf_paths(skel) != {tuple(p) for p in planner_data.values()}:
        return ["the keys' types were not kept (this torch's DCP walks states otherwise): they load as text"]
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = f.read()
    body = {"aiosnap": "dcp keys", "version": 1, "metadata_crc32c": f"{crc32c(metadata):08x}", "tree": skel}
    put(LocalStorage(), os.path.join(path, KEYS_FILE), json.dumps(body, allow_nan=False).encode())
    return []


def restore(path: str, state: dict[Any, Any]) -> dict[Any, Any]:
    """``state`` as read from the DCP directory ``path``, its keys of the types they
    were written with, if its keys file is for the ``.metadata`` there."""
    where = os.path.join(path, KEYS_FILE)
    try:
        with open(where, "rb") as f:
            raw = f.read(_MOST + 1)
        with open(os.path.join(path, ".metadata"), "rb") as f:
            metadata = f.read()
    except FileNotFoundError:
        return state
    try:
        body = json.loads(raw) if len(raw) <= _MOST else None
        if not isinstance(body, dict) or body.get("aiosnap") != "dcp keys" or body.get("version") != 1:
            raise ValueError("not an aiosnap keys file of a version this aiosnap reads")
        if body.get("metadata_crc32c") != f"{crc32c(metadata):08x}":
            return state  # DCP wrote the directory again since: its keys are DCP's
        skel = body.get("tree")
        check(skel)
        if not isinstance(skel, dict) or skel.get("$") != "dict":
            raise ValueError("its tree is no dict")
        return _retyped(state, skel)  # type: ignore[no-any-return]
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(where, f"bad keys file: {exc}") from None


def _retyped(value: Any, skel: Any) -> Any:
    """``value`` (as DCP read it) with the keys and the empty dicts of ``skel``."""
    if isinstance(skel, dict) and skel.get("$") == "dict" and isinstance(value, dict):
        out: dict[Any, Any] = {}
        taken = set()
        for key_node, child in dict_items(skel):
            key = decode_key(key_node)
            if _holds_nothing(child):  # DCP stored nothing of it, whatever is under its name
                out[key] = _empty(child)
            elif str(key) in value:
                taken.add(str(key))
                out[key] = _retyped(value[str(key)], child)
        out.update((k, v) for k, v in value.items() if k not in taken)  # what the file does not know
        return out
    if isinstance(skel, list) and isinstance(value, list) and len(skel) == len(value):
        return [_retyped(v, s) for v, s in zip(value, skel, strict=True)]
    return value


def _holds_nothing(skel: Any) -> bool:
    """A dict of nothing but dicts that hold nothing (DCP stores no entry of them)."""
    return (
        isinstance(skel, dict)
        and skel.get("$") == "dict"
        and all(_holds_nothing(child) for _, child in dict_items(skel))
    )


def _empty(skel: Any) -> dict[Any, Any]:
    return {decode_key(k): _empty(child) for k, child in dict_items(skel)}
