"""Plain safetensors files for ``aiosnap convert``, with the state's tree kept.

A safetensors file holds named tensors and a ``__metadata__`` map of strings. What
``convert --to safetensors`` writes is a plain file any safetensors reader takes: the
tensors and arrays under their dotted paths (``model.0.weight``), and in
``__metadata__``, beside ``"format": "pt"``, the state's tree under ``aiosnap_tree``:
the JSON skeleton of an aiosnap header (``_tree``), containers and plain values by
value, each tensor as a reference to its name. ``convert`` and ``diff`` read that tree
back, so aiosnap -> safetensors -> aiosnap loses nothing; any other reader, and
``aiosnap.load``, see a flat file of tensors. The source's own ``__metadata__`` entries
are kept beside them. Written here, so the ``safetensors`` package is not needed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .._base.errors import CheckpointError, CorruptCheckpointError
from .._format.dtypes import PACKED_F4, numpy_st_code, torch_name, torch_st_form
from .._format.header import CRC_KEY, META_KEY
from .._format.tree import LEAF_TAGS, capture, check, format_path, rebuild
from .._storage.backends import resolve
from .._storage.protocol import Storage

#: The ``__metadata__`` key that holds the tree.
TREE_KEY = "aiosnap_tree"
#: A header longer than this is not read for its tree (safetensors' own limit).
_MAX_HEADER = 100 << 20
#: A tensor of a safetensors file: name, dtype code, shape, its bytes (flat uint8).
StEntry = tuple[str, str, list[int], np.ndarray[Any, Any]]
#: ``__metadata__`` entries aiosnap writes itself: never copied from a source.
OWN_KEYS = frozenset((META_KEY, CRC_KEY, TREE_KEY))


def user_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """The entries of a file's ``__metadata__`` that a conversion keeps: all but aiosnap's."""
    return {k: v for k, v in metadata.items() if k not in OWN_KEYS}


def write_safetensors(dst: str, state: Any, metadata: Mapping[str, str] | None = None) -> list[str]:
    """Write ``state`` as a plain safetensors file with its tree in the metadata, beside
    ``metadata`` (a source file's: ``"format"`` is ``"pt"`` unless it says otherwise).
    Values of no state type (read from a torch.save file) cannot be stored: they are
    None in the tree, and the note returned names them. Blocking."""
    snapshot = capture(state, allow_pickle=True)
    tree = json.loads(snapshot.tree)
    dropped = {leaf.name for leaf in snapshot.leaves if leaf.kind == "pickle"}
    entries = [_st_entry(leaf.name, leaf.value) for leaf in snapshot.leaves if leaf.kind != "pickle"]
    if dropped:
        tree = _without(tree, dropped)
    storage, where = resolve(dst)
    meta = {
        "format": "pt",
        **user_metadata(metadata or {}),
        TREE_KEY: json.dumps(tree, separators=(",", ":")),
    }
    _write(storage, where, entries, meta)
    if not dropped:
        return []
    names = ", ".join(sorted(dropped)[:5]) + (f" and {len(dropped) - 5} more" if len(dropped) > 5 else "")
    return [f"left out {len(dropped)} value(s) of no state type, None in the file's tree: {names}"]


def _without(node: Any, names: set[str]) -> Any:
    """The tree with references to ``names`` replaced by None (a checked tree: at most
    MAX_DEPTH deep, so the recursion is bounded)."""
    if isinstance(node, list):
        return [_without(v, names) for v in node]
    if not isinstance(node, dict):
        return node
    if node.get("$") == "pickle" and node.get("n") in names:
        return None
    if node.get("$") == "dict":
        return {"$": "dict", "items": [[k, _without(v, names)] for k, v in node["items"]]}
    if node.get("$") == "tuple":
        return {"$": "tuple", "v": [_without(v, names) for v in node["v"]]}
    return node


def _st_entry(name: str, value: Any) -> StEntry:
    """(name, safetensors dtype code, shape, the bytes as a flat uint8 array)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        form = torch_st_form(torch_name(t.dtype), t.shape)
        if form is None:
            packed = torch_name(t.dtype) == PACKED_F4  # F4 counts its values in the last dimension
            raise CheckpointError(
                f"{name}: safetensors has no dtype for {'a 0-d ' if packed else ''}{t.dtype}"
            )
        flat = t.reshape(-1)
        raw = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
        return name, form[0], form[1], raw
    a = np.asarray(value)  # not ascontiguousarray: it makes a NumPy scalar an array of shape [1]
    a = a if a.flags.c_contiguous else np.ascontiguousarray(a)
    code = numpy_st_code(a.dtype)
    if code == "U8" and a.dtype.str != "|u1":
        raise CheckpointError(f"{name}: safetensors has no dtype for NumPy {a.dtype.str}")
    return name, code, list(a.shape), a.reshape(-1).view(np.uint8)


def _write(storage: Storage, path: str, entries: list[StEntry], meta: dict[str, str]) -> None:
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, code, shape, raw in entries:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + raw.nbytes]}
        offset += raw.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data section starts 8-aligned, as safetensors does
    prefix = len(text).to_bytes(8, "little") + text
    upload = storage.create(path, len(prefix) + offset)
    try:
        upload.write_at(0, memoryview(prefix))
        pos = len(prefix)
        for _, _, _, raw in entries:
            if raw.nbytes:
                upload.write_at(pos, memoryview(raw))  # type: ignore[arg-type]
            pos += raw.nbytes
        upload.commit()
    except BaseException:
        upload.abort()
        raise


# -- reading the tree back -------------------------------------------------------------------------


def saved_tree(storage: Storage, path: str) -> Any:
    """The checked tree a safetensors file keeps in ``__metadata__.aiosnap_tree``, or
    None if it keeps none. Blocking."""
    f = storage.open_read(path)
    try:
        prefix = bytearray(8)
        f.readinto(0, memoryview(prefix))
        n = int.from_bytes(prefix, "little")
        if not 2 <= n <= min(f.size - 8, _MAX_HEADER):
            return None  # not a header read_header accepted: no tree of ours
        raw = bytearray(n)
        f.readinto(8, memoryview(raw))
    finally:
        f.close()
    try:
        meta = json.loads(raw).get("__metadata__")
        text = meta.get(TREE_KEY) if isinstance(meta, dict) else None
        if not isinstance(text, str):
            return None
        tree = json.loads(text)
        check(tree)
    except (ValueError, AttributeError, RecursionError) as exc:
        raise CorruptCheckpointError(path, f"bad {TREE_KEY} in __metadata__: {exc}") from None
    return tree


def rebuild_state(path: str, tree: Any, flat: dict[str, Any]) -> Any:
    """The state ``tree`` describes, its tensors taken from ``flat`` (the file's
    tensors by name): NumPy arrays and scalars back as NumPy values."""

    def leaf(kind: str, name: str, where: tuple[object, ...]) -> object:
        value = flat.get(name)
        if value is None or kind not in LEAF_TAGS - {"dtensor", "pickle"}:
            what = f"a {kind} stored as {name!r}" if value is not None else f"the missing tensor {name!r}"
            raise CorruptCheckpointError(path, f"bad {TREE_KEY}: {format_path(where)} is {what}")
        if kind == "tensor":
            return value
        array = value.numpy()
        return array if kind == "ndarray" else array[()]

    try:
        return rebuild(tree, leaf)
    except CorruptCheckpointError:
        raise
    except ValueError as exc:
        raise CorruptCheckpointError(path, f"bad {TREE_KEY}: {exc}") from None
