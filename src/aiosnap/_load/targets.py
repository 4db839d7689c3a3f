"""``load_into``: where what is read lands in the caller's objects.

Before anything is read, the target and the saved tree are walked together to find
the tensors and arrays that can be read straight into their own memory, and the
DTensors whose local shards are filled from the saved boxes that overlap them.
Stateful objects are walked through their ``state_dict()``: the tensors it returns
share memory with the live parameters and optimizer state, so they are filled in
place, and ``load_state_dict`` then gets them back with everything else. After the
read, what is left is assigned in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._base.errors import CheckpointError, StateMismatchError
from .._base.heap import hand_over
from .._format import dtypes as _dtypes
from .._format.codec import TensorInfo
from .._format.shards import is_dtensor
from .._format.tree import PLAIN_KEYS, decode_key, format_path, is_stateful, sequence_values

#: Entries under this many bytes are read with their neighbours into a scratch buffer,
#: checked there and copied to their tensor's address (``memmove``, 0.3 us for 1 KiB):
#: cheaper than a buffer object per entry for a scattered read (~2.5 us each).
SMALL = 64 << 10
#: Keys a message lists before it says how many there are in all.
SHOWN = 10


@dataclass(slots=True)
class Destinations:
    """What a load fills in place."""

    #: Entry name -> (the target tensor or array, where its bytes go: see ``direct_view``).
    direct: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    #: Entry name of a DTensor node -> the target tensor (a DTensor, or a whole tensor).
    shards: dict[str, Any] = field(default_factory=dict)
    #: Tree paths of the leaves the target has a place for (formatted only if asked:
    #: see ``held_paths``). Kept only if ``track_held``: a group step's load asks for
    #: them, and a tuple per leaf is 0.15 us a tensor otherwise spent for nothing.
    held: list[tuple[object, ...]] = field(default_factory=list)
    track_held: bool = True
    #: The state dicts of Stateful targets, taken once (id of the object -> its state).
    states: dict[int, Any] = field(default_factory=dict)
    #: The saved tree's dict nodes where the target is whole (id of the node -> the node
    #: and the target's dict): dicts of tensors and plain values alone, with the saved
    #: dict's keys, no more, no fewer, every tensor read into in place and every plain
    #: value saved as one. Once read and ``values`` set, such a dict is what rebuilding
    #: its node and assigning it would leave: rebuild returns it as it is, and assign
    #: leaves it (each would take ~1 us a tensor to arrive there).
    known: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    #: How many Stateful objects ``find`` is inside (nothing under one is ``known``).
    stateful: int = 0
    #: The entries in ``direct`` that ``find`` took as common leaves (plain tensors,
    #: tensor entries of this file): among them, every tensor leaf of a ``known`` dict.
    infos: list[TensorInfo] = field(default_factory=list)
    #: (dict, key, value): a plain value saved where a ``known`` dict holds a plain
    #: value, which assign would have replaced with the saved one (``set_values``).
    values: list[tuple[dict[Any, Any], Any, Any]] = field(default_factory=list)


def find(target: Any, node: Any, lookup: Any, out: Destinations, path: tuple[object, ...] = ()) -> bool:
    """Walk ``target`` and the saved ``node`` together, filling ``out``. ``lookup(name)``
    is the TensorInfo of an entry (or None). True if the target is whole here: a dict
    that, once read (and its plain values set), is what rebuilding ``node`` and
    assigning it would leave (see ``Destinations.known``)."""
    tag = node.get("$") if isinstance(node, dict) else None
    # Plain containers and tensors are never Stateful: is_stateful's two failed getattr
    # were a fifth of the walk.
    if type(target) not in _NOT_STATEFUL and not isinstance(target, torch.Tensor) and is_stateful(target):
        # Its load_state_dict is still to be called, with containers of its own: what
        # it does with them is its business (its state_dict may have handed out its
        # own dicts), so nothing under it is known.
        out.stateful += 1
        try:
            find(state_of(target, out), node, lookup, out, path)
        finally:
            out.stateful -= 1
        return False
    if tag == "dict" and isinstance(target, dict):
        direct, items, keys, values = out.direct, node["items"], set(), []
        whole = len(items) == len(target)
        for key_node, value in items:  # pairs: the tree was checked (see dict_items)
            key = key_node if type(key_node) in PLAIN_KEYS else decode_key(key_node)
            if key not in target:
                whole = False
                continue
            keys.add(key)
            sub = target[key]
            if type(sub) in _PLAIN_TENSORS and type(value) is dict and value.get("$") == "tensor":
                # The common leaf, as _leaf takes it, without a call of find or of _leaf.
                hand_over()  # a walk of torch calls in a worker thread: the loop gets its turn
                if out.track_held:
                    out.held.append((*path, key))
                info = lookup(value.get("n"))
                flat = None
                if info is not None and info.kind == "tensor" and not info.shard and info.name not in direct:
                    flat = direct_view(sub, info)
                    if flat is not None:
                        direct[info.name] = (sub, flat)
                        out.infos.append(info)
                whole = whole and flat is not None
            elif type(value) in PLAIN_KEYS and type(sub) in PLAIN_KEYS:
                # A plain value for a plain value (a step count, a learning rate): what
                # rebuild makes of the node is the node; assign puts it in the dict.
                if out.track_held:
                    out.held.append((*path, key))
                values.append((target, key, value))
            else:
                whole = find(sub, value, lookup, out, (*path, key)) and whole
        # A key twice in the saved dict leaves one of the target's without a value.
        if not whole or len(keys) != len(target) or out.stateful:
            return False
        out.values += values
        out.known[id(node)] = (node, target)
        return True
    if isinstance(target, (list, tuple)) and (isinstance(node, list) or tag == "tuple"):
        sequence = sequence_values(node)
        if len(sequence) == len(target):
            for i, (sub_target, sub_node) in enumerate(zip(target, sequence, strict=True)):
                find(sub_target, sub_node, lookup, out, (*path, i))
        return False  # assigned: a tuple's items are compared, a list's set
    if tag in ("dict", "tuple") or isinstance(node, list):
        return False  # a container where the target has none: assign reports it
    _leaf(target, node, lookup, out, path)
    return False


def set_values(out: Destinations) -> None:
    """Put the plain values of the ``known`` dicts into them (once every tensor was read
    and checked: a load whose read fails leaves them as they were)."""
    for container, key, value in out.values:
        container[key] = value


def _leaf(target: Any, node: Any, lookup: Any, out: Destinations, path: tuple[object, ...]) -> None:
    tag = node.get("$") if isinstance(node, dict) else None
    if out.track_held:
        out.held.append(path)
    if tag == "dtensor" and isinstance(target, torch.Tensor):
        out.shards.setdefault(node.get("n"), target)
    elif tag in ("tensor", "ndarray"):
        info = lookup(node.get("n"))
        if info is not None and info.kind == tag and info.name not in out.direct:
            flat = direct_view(target, info)
            if flat is not None:
                out.direct[info.name] = (target, flat)


_NOT_STATEFUL = (dict, list, tuple)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def held_paths(out: Destinations) -> set[str]:
    """The dotted paths of the leaves the target has a place for."""
    return {format_path(p) for p in out.held}


def state_of(target: Any, out: Destinations) -> Any:
    """A Stateful target's state dict, taken once per load. An optimizer over DTensors
    with no state yet gets it first (a zero-lr step, as DCP does), so that its state has
    the placements to restore into."""
    key = id(target)
    if key not in out.states:
        if isinstance(target, torch.optim.Optimizer) and not target.state and _over_dtensors(target):
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(target)
        out.states[key] = target.state_dict()
    return out.states[key]


def _over_dtensors(optimizer: torch.optim.Optimizer) -> bool:
    return any(is_dtensor(p) for group in optimizer.param_groups for p in group["params"])


def direct_view(target: Any, info: TensorInfo) -> np.ndarray[Any, np.dtype[np.uint8]] | int | None:
    """Where an entry can be read straight into the target's bytes, if it can: a flat
    uint8 view, or the address of a small tensor's data (see ``_readers.Made``)."""
    if isinstance(target, torch.Tensor):
        if (
            (type(target) not in _PLAIN_TENSORS and is_dtensor(target))
            or target.shape != info.shape
            or target.dtype is not _dtypes.TORCH_DTYPES.get(info.dtype)  # by name: a dtype hashes slowly
            or not target.is_cpu
            or not target.is_contiguous()
            or target.is_conj()
            or target.is_neg()
        ):
            return None
        if info.end - info.start < SMALL:
            return int(target.data_ptr())
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


def assign(target: Any, value: Any, path: tuple[object, ...], strict: bool, out: Destinations) -> Any:
    """Update ``target`` in place from ``value``; return what the parent should hold."""
    if value is target and isinstance(target, (torch.Tensor, np.ndarray, dict)):
        return target  # read in place (a dict: one of Destinations.known, filled)
    if isinstance(target, torch.Tensor):
        _check_like(value, torch.Tensor, target.shape, target.dtype, format_path(path))
        with torch.no_grad():
            target.copy_(value)
        return target
    if isinstance(target, np.ndarray):
        _check_like(value, np.ndarray, target.shape, target.dtype, format_path(path))
        np.copyto(target, value)
        return target
    if type(target) not in _NOT_STATEFUL and is_stateful(target):
        _load_state(target, value, format_path(path), strict)
        return target
    if isinstance(target, dict):
        _assign_dict(target, value, path, strict, out)
        return target
    if isinstance(target, (list, tuple)) and not holds_live(target):
        # A sequence of plain values is a value: the checkpoint's replaces it.
        if isinstance(target, list) and isinstance(value, (list, tuple)):
            target[:] = value
            return target
        return value
    if isinstance(target, (list, tuple)):
        _assign_seq(target, value, path, strict, out)
        return target
    return value


def holds_live(obj: Any) -> bool:
    """Whether obj holds something that must be updated in place."""
    if isinstance(obj, (torch.Tensor, np.ndarray)) or is_stateful(obj):
        return True
    if isinstance(obj, dict):
        return any(holds_live(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_live(v) for v in obj)
    return False


def _check_like(value: Any, kind: type[Any], shape: Any, dtype: Any, where: str) -> None:
    if not isinstance(value, kind):
        raise StateMismatchError(f"{where}: checkpoint holds {type(value).__name__}, not {kind.__name__}")
    if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
        raise StateMismatchError(
            f"{where}: checkpoint has {value.dtype} {tuple(value.shape)}, target {dtype} {tuple(shape)}"
        )


def _assign_dict(
    target: dict[Any, Any], value: Any, path: tuple[object, ...], strict: bool, out: Destinations
) -> None:
    if not isinstance(value, dict):
        raise StateMismatchError(f"{format_path(path)}: checkpoint holds {type(value).__name__}, not dict")
    missing = [k for k in target if k not in value]
    unexpected = [k for k in value if k not in target]
    if strict and (missing or unexpected):
        common = [k for k in target if k in value]
        raise StateMismatchError(keys_mismatch(path, missing, unexpected, common))
    for key in target:
        if key in value:
            old, new = target[key], value[key]
            if new is not old or not isinstance(old, (torch.Tensor, np.ndarray)):  # else read in place
                target[key] = assign(old, new, (*path, key), strict, out)


def _assign_seq(
    target: list[Any] | tuple[Any, ...], value: Any, path: tuple[object, ...], strict: bool, out: Destinations
) -> None:
    if not isinstance(value, (list, tuple)) or len(value) != len(target):
        raise StateMismatchError(f"{format_path(path)}: checkpoint holds a different sequence")
    for i, (old, new) in enumerate(zip(target, value, strict=True)):
        result = assign(old, new, (*path, i), strict, out)
        if isinstance(target, list):
            target[i] = result
        elif result is not old and not tuple_item_equal(result, old):
            raise StateMismatchError(f"{format_path((*path, i))}: a tuple cannot be updated in place")


def tuple_item_equal(a: object, b: object) -> bool:
    """Whether a tuple's item may stay as it is; arrays never compare equal here (their
    ``==`` is elementwise, and has no kernel at all for dtypes such as int6)."""
    if isinstance(a, (torch.Tensor, np.ndarray)) or isinstance(b, (torch.Tensor, np.ndarray)):
        return False
    try:
        return bool(a == b)
    except Exception:  # a foreign object's __eq__: not equal
        return False


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


def keys_mismatch(
    path: tuple[object, ...], missing: list[Any], unexpected: list[Any], common: list[Any]
) -> str:
    """What differs between the target's keys and the checkpoint's at ``path``, and what
    to do about it (issue 40: the bare lists gave no hint at ``strict`` or ``keys``)."""
    said = []
    if missing:
        said.append(f"missing keys {shown(missing)} (in the target, not in the checkpoint)")
    if unexpected:
        said.append(f"unexpected keys {shown(unexpected)} (in the checkpoint, not in the target)")
    text = f"{format_path(path)}: {'; '.join(said)}"
    printed = {str(m): m for m in missing}
    alike = [(printed[str(u)], u) for u in unexpected if str(u) in printed]
    if alike:
        m, u = alike[0]
        text += (
            f". The checkpoint's key {u!r} is a {type(u).__name__} where the target's {m!r} is a "
            f"{type(m).__name__}: a conversion changed the keys' type (DCP writes every key as text)"
        )
    text += ". Pass strict=False to load the keys both have (the rest of the target is left as it is)"
    if unexpected and not missing and 0 < len(common) <= SHOWN:  # keys= helps where the target has less
        text += f", or keys={[format_path((*path, k)) for k in common]} to load only those"
    return text


def shown(keys: list[Any]) -> str:
    """``keys`` as a list, the first SHOWN of them if there are more."""
    if len(keys) <= SHOWN:
        return repr(keys)
    return f"{repr(keys[:SHOWN])[:-1]}, ... {len(keys)} in all]"
