"""``load_into``'s check of the whole target, before any of it changes.

A load into live objects is all or nothing. Before the first byte of the target is
written, the target and what the checkpoint holds are walked together as ``assign``
walks them, and whatever it would refuse is refused here: a container of another kind,
a key missing or unexpected (``strict``), a tensor or an array of another shape or
dtype, a tuple's plain item that differs. So is what torch's ``load_state_dict``
refuses of the Stateful objects whose rules are torch's: a Module's keys (``strict``)
and shapes (its dtypes it casts), an Optimizer's parameter groups of another number
or size; and an optimizer state whose keys name none of its parameters, which torch
would take and silently ignore (int keys turned into text by a conversion). Any other
Stateful object is its own judge. The checksums are checked before the first write
too (``EntryReader.prefetch``).

The checkpoint's side is read through a Side: the saved tree with the header's entries
(``TreeSide``), or a state already in memory (``ValueSide``: a torch.save file's). A
pickled value is checked once it is unpickled, before the first write (``Fit.later``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from .._base.errors import StateMismatchError
from .._format import dtypes as _dtypes
from .._format.codec import TensorInfo
from .._format.tree import (
    PLAIN_KEYS,
    decode_key,
    dict_items,
    format_path,
    is_stateful,
    rebuild,
    sequence_values,
    walk_leaves,
)
from .readers import Shards
from .targets import Destinations, holds_live, keys_mismatch, shown, state_of, tuple_item_equal


@dataclass(frozen=True, slots=True)
class Held:
    """What the checkpoint holds at a place, as far as a check needs it: ``kind`` is
    "dict", "list", "tuple", "tensor", "ndarray", "pickle" (known once read), "other"
    (any plain value) or "unknown" (a reference the read refuses as corrupt); ``name``
    is its type's name, as ``assign``'s messages call it."""

    kind: str
    name: str
    shape: tuple[int, ...] = ()
    dtype: Any = None


_DICT, _LIST, _TUPLE = Held("dict", "dict"), Held("list", "list"), Held("tuple", "tuple")
_PICKLE, _UNKNOWN = Held("pickle", "object"), Held("unknown", "object")
#: ``Side.plain`` of a node holding tensors or arrays; of one holding pickles alone.
NOT_PLAIN, PICKLED = object(), object()


class Side(Protocol):
    def held(self, x: Any, path: tuple[object, ...]) -> Held: ...
    def items(self, x: Any, path: tuple[object, ...]) -> dict[Any, Any]: ...
    def values(self, x: Any, path: tuple[object, ...]) -> Sequence[Any]: ...
    def plain(self, x: Any, path: tuple[object, ...]) -> Any: ...
    def known(self, x: Any) -> bool: ...


class TreeSide:
    """The saved tree, its leaves described by the header's entries (``lookup``), a
    group step's DTensors by their manifest (``shards``)."""

    def __init__(
        self,
        lookup: Callable[[str], TensorInfo | None],
        shards: Shards | None,
        own: Callable[[str], TensorInfo | None],
        dests: Destinations,
    ) -> None:
        self.lookup, self.shards, self.own, self.dests = lookup, shards, own, dests

    def held(self, x: Any, path: tuple[object, ...]) -> Held:
        if x is None or isinstance(x, (bool, int, float, str)):
            return Held("other", type(x).__name__)
        if isinstance(x, list):
            return _LIST
        tag = x.get("$")
        if tag == "dict":
            return _DICT
        if tag == "tuple":
            return _TUPLE
        if tag in ("float", "bytes"):
            return Held("other", tag)
        if tag == "pickle":
            return _PICKLE
        name = x.get("n")
        if tag == "dtensor" and self.shards is not None:
            saved = self.shards.saved(format_path(path), self.own(name))
            return Held("tensor", "DTensor", tuple(saved.shape), _dtypes.TORCH_DTYPES.get(saved.dtype))
        info = self.lookup(name)
        if info is None or info.kind != ("tensor" if tag == "dtensor" else tag):
            return _UNKNOWN  # the read refuses it as corrupt, before it writes anything
        if info.kind == "tensor":
            return Held("tensor", "Tensor", info.shape, _dtypes.TORCH_DTYPES.get(info.dtype))
        dtype = np.dtype(info.dtype)
        if info.kind == "ndarray":
            return Held("ndarray", "ndarray", info.shape, dtype)
        return Held("other", dtype.type.__name__)  # an npscalar, made a NumPy scalar

    def items(self, x: Any, path: tuple[object, ...]) -> dict[Any, Any]:
        # As rebuild makes it: a key saved twice keeps its last value.
        return {k if type(k) in PLAIN_KEYS else decode_key(k, path): v for k, v in dict_items(x, path)}

    def values(self, x: Any, path: tuple[object, ...]) -> Sequence[Any]:
        return sequence_values(x, path)

    def plain(self, x: Any, path: tuple[object, ...]) -> Any:
        kinds = {kind for _, kind, _ in walk_leaves(x, path)}
        if not kinds:
            return rebuild(x, _no_leaf)
        return PICKLED if kinds == {"pickle"} else NOT_PLAIN

    def known(self, x: Any) -> bool:
        made = self.dests.known.get(id(x))
        return made is not None and made[0] is x


class ValueSide:
    """A state in memory: what a torch.save file held, or a pickled value once read."""

    def held(self, x: Any, path: tuple[object, ...]) -> Held:
        if isinstance(x, torch.Tensor):
            return Held("tensor", type(x).__name__, tuple(x.shape), x.dtype)
        if isinstance(x, np.ndarray):
            return Held("ndarray", "ndarray", tuple(x.shape), x.dtype)
        if isinstance(x, dict):
            return _DICT
        if isinstance(x, list):
            return _LIST
        if isinstance(x, tuple):
            return _TUPLE
        return Held("other", type(x).__name__)

    def items(self, x: Any, path: tuple[object, ...]) -> dict[Any, Any]:
        return x  # type: ignore[no-any-return]

    def values(self, x: Any, path: tuple[object, ...]) -> Sequence[Any]:
        return x  # type: ignore[no-any-return]

    def plain(self, x: Any, path: tuple[object, ...]) -> Any:
        return x

    def known(self, x: Any) -> bool:
        return False


@dataclass(slots=True)
class Fit:
    """The check of one target against what a checkpoint holds (see the module)."""

    side: Side
    strict: bool
    dests: Destinations
    #: (check, target, node, path): what waits for pickled values (``check_later``).
    later: list[tuple[str, Any, Any, tuple[object, ...]]] = field(default_factory=list)

    def fit(self, target: Any, x: Any, path: tuple[object, ...]) -> None:
        """Refuse what ``assign(target, <x rebuilt>)`` would refuse."""
        if isinstance(target, torch.Tensor):
            self._like(target, x, path, "tensor", "Tensor")
        elif isinstance(target, np.ndarray):
            self._like(target, x, path, "ndarray", "ndarray")
        elif type(target) not in (dict, list, tuple) and is_stateful(target):
            if isinstance(target, torch.nn.Module):
                self._module(target, x, path)
            elif isinstance(target, torch.optim.Optimizer):
                self._optimizer(target, x, path)
        elif isinstance(target, dict):
            self._dict(target, x, path)
        elif isinstance(target, (list, tuple)) and holds_live(target):
            self._sequence(target, x, path)

    def _pickled(self, check: str, target: Any, x: Any, path: tuple[object, ...], held: Held) -> bool:
        if held.kind == "pickle":
            self.later.append((check, target, x, path))
        return held.kind in ("pickle", "unknown")

    def _like(self, target: Any, x: Any, path: tuple[object, ...], kind: str, noun: str) -> None:
        held = self.side.held(x, path)
        if self._pickled("fit", target, x, path, held):
            return
        if held.kind != kind:
            raise StateMismatchError(f"{format_path(path)}: checkpoint holds {held.name}, not {noun}")
        if held.shape != tuple(target.shape) or held.dtype != target.dtype:
            raise StateMismatchError(
                f"{format_path(path)}: checkpoint has {held.dtype} {held.shape}, "
                f"target {target.dtype} {tuple(target.shape)}"
            )

    def _dict(self, target: dict[Any, Any], x: Any, path: tuple[object, ...]) -> None:
        held = self.side.held(x, path)
        if self._pickled("fit", target, x, path, held):
            return
        if held.kind != "dict":
            raise StateMismatchError(f"{format_path(path)}: checkpoint holds {held.name}, not dict")
        if self.side.known(x):
            return  # find proved it whole: the same keys, each tensor of its shape and dtype
        saved = self.side.items(x, path)
        if self.strict:
            _same_keys(path, list(target), list(saved))
        for key, sub in target.items():
            if key in saved:
                self.fit(sub, saved[key], (*path, key))

    def _sequence(self, target: list[Any] | tuple[Any, ...], x: Any, path: tuple[object, ...]) -> None:
        held = self.side.held(x, path)
        if self._pickled("fit", target, x, path, held):
            return
        values = self.side.values(x, path) if held.kind in ("list", "tuple") else None
        if values is None or len(values) != len(target):
            raise StateMismatchError(f"{format_path(path)}: checkpoint holds a different sequence")
        for i, (old, sub) in enumerate(zip(target, values, strict=True)):
            if isinstance(target, tuple):
                self.tuple_item(old, sub, (*path, i))
            else:
                self.fit(old, sub, (*path, i))

    def tuple_item(self, old: Any, x: Any, path: tuple[object, ...]) -> None:
        """A tuple's item: updated in place, or else it must be what was saved."""
        if isinstance(old, (torch.Tensor, np.ndarray, dict)) or holds_live(old) or is_stateful(old):
            self.fit(old, x, path)
            return
        if isinstance(old, list) and self.side.held(x, path).kind in ("list", "tuple"):
            return  # refilled in place
        value = self.side.plain(x, path)
        if value is PICKLED:
            self.later.append(("tuple_item", old, x, path))
        elif value is NOT_PLAIN or not tuple_item_equal(value, old):
            raise StateMismatchError(f"{format_path(path)}: a tuple cannot be updated in place")

    # -- what torch's load_state_dict refuses ------------------------------------------------------
    def _module(self, module: torch.nn.Module, x: Any, path: tuple[object, ...]) -> None:
        held = self.side.held(x, path)
        if self._pickled("fit", module, x, path, held):
            return
        if held.kind != "dict":
            raise StateMismatchError(f"{format_path(path)}: checkpoint holds {held.name}, not a state dict")
        own = state_of(module, self.dests)
        saved = self.side.items(x, path)
        if self.strict:
            _same_keys(path, list(own), list(saved))
        for key, param in own.items():
            if key in saved and isinstance(param, torch.Tensor):
                self.module_tensor(param, saved[key], (*path, key))

    def module_tensor(self, param: torch.Tensor, x: Any, path: tuple[object, ...]) -> None:
        """A parameter or buffer: the checkpoint's must be a tensor of its shape (torch
        casts the dtype; it takes one element for a 0-d parameter, as it reads old files)."""
        held = self.side.held(x, path)
        if self._pickled("module_tensor", param, x, path, held):
            return
        if held.kind != "tensor":
            raise StateMismatchError(f"{format_path(path)}: checkpoint holds {held.name}, not Tensor")
        if torch.nn.parameter.is_lazy(param):
            return  # a lazy module's: it takes the shape it is given
        mine, theirs = tuple(param.shape), held.shape
        if mine != theirs and not (mine == () and len(theirs) == 1):
            raise StateMismatchError(
                f"{format_path(path)}: checkpoint has shape {theirs}, the module's is {mine}: "
                "the module is not the one saved (its size, or its layers)"
            )

    def _optimizer(self, optimizer: torch.optim.Optimizer, x: Any, path: tuple[object, ...]) -> None:
        held = self.side.held(x, path)
        if self._pickled("fit", optimizer, x, path, held):
            return
        where = format_path(path)
        saved = self.side.items(x, path) if held.kind == "dict" else {}
        if "state" not in saved or "param_groups" not in saved:
            raise StateMismatchError(
                f"{where}: checkpoint holds no optimizer state (a state and param_groups)"
            )
        ids = self._groups(optimizer, saved["param_groups"], (*path, "param_groups"))
        state = saved["state"]
        if self.side.held(state, (*path, "state")).kind != "dict":
            raise StateMismatchError(f"{where}.state: checkpoint holds no dict of states")
        stray = [key for key in self.side.items(state, (*path, "state")) if key not in ids]
        if stray:
            raise StateMismatchError(_stray_states(f"{where}.state", stray, ids))

    def _groups(self, optimizer: torch.optim.Optimizer, x: Any, path: tuple[object, ...]) -> set[Any]:
        """Check the saved parameter groups against the optimizer's, as torch does: as
        many, of as many parameters each. The ids of the saved parameters."""
        where = format_path(path)
        held = self.side.held(x, path)
        groups = self.side.values(x, path) if held.kind in ("list", "tuple") else None
        mine = optimizer.param_groups
        if groups is None:
            raise StateMismatchError(f"{where}: checkpoint holds {held.name}, not a list of parameter groups")
        if len(groups) != len(mine):
            raise StateMismatchError(
                f"{where}: the checkpoint has {len(groups)} parameter groups, the optimizer {len(mine)}"
            )
        ids: set[Any] = set()
        for i, (group, own) in enumerate(zip(groups, mine, strict=True)):
            params = self._params(group, (*path, i))
            if len(params) != len(own["params"]):
                raise StateMismatchError(
                    f"{where}.{i}: the checkpoint's group has {len(params)} parameters, the optimizer's "
                    f"{len(own['params'])}: the optimizer is not over the parameters saved"
                )
            ids.update(p for p in params if _hashable(p))
        return ids

    def _params(self, group: Any, path: tuple[object, ...]) -> Sequence[Any]:
        items = self.side.items(group, path) if self.side.held(group, path).kind == "dict" else {}
        params = self.side.plain(items["params"], (*path, "params")) if "params" in items else None
        if not isinstance(params, (list, tuple)):
            raise StateMismatchError(f"{format_path(path)}: checkpoint holds no list of params")
        return params

    def check_later(self, resolve: Callable[[str, str, tuple[object, ...]], object]) -> None:
        """The checks that waited for pickled values, once they are read (``resolve``:
        the reader's, which has made the pickled leaves of the nodes that waited)."""
        if self.later:
            by_value = Fit(ValueSide(), self.strict, self.dests)
            for check, target, x, path in self.later:
                getattr(by_value, check)(target, rebuild(x, resolve), path)


@dataclass(frozen=True, slots=True)
class Guard:
    """A load's Fit, for its reader (``readers.Guard``): the target and the tree walked
    once every reference of the tree was found good (a corrupt file is called corrupt,
    whatever it would not fit), the pickled values checked once read."""

    fit: Fit
    target: Any
    tree: Any
    resolve: Callable[[str, str, tuple[object, ...]], object]

    def before_read(self) -> None:
        self.fit.fit(self.target, self.tree, ())

    def before_write(self) -> None:
        self.fit.check_later(self.resolve)


def _no_leaf(kind: str, name: str, path: tuple[object, ...]) -> object:
    raise AssertionError("plain() rebuilds only nodes without leaves")


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _same_keys(path: tuple[object, ...], mine: list[Any], saved: list[Any]) -> None:
    have = set(saved)
    missing = [k for k in mine if k not in have]
    wanted = set(mine)
    unexpected = [k for k in saved if k not in wanted]
    if missing or unexpected:
        raise StateMismatchError(keys_mismatch(path, missing, unexpected, [k for k in mine if k in have]))


def _stray_states(where: str, stray: list[Any], ids: set[Any]) -> str:
    known = sorted(ids, key=repr)
    text = (
        f"{where}: the checkpoint's optimizer state is kept under keys {shown(stray)}, which name none "
        f"of its parameters ({shown(known)}): the optimizer would take it and use none of it"
    )
    printed = {str(i) for i in ids}
    if all(str(k) in printed for k in stray):
        kinds = sorted({type(k).__name__ for k in stray})
        text += (
            f". The keys are {'/'.join(kinds)} where the parameters are numbered with "
            f"{'/'.join(sorted({type(i).__name__ for i in ids}))}: a conversion changed their type "
            "(DCP writes every key as text); aiosnap convert keeps it since this version"
        )
    return text
