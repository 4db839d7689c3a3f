"""``aiosnap diff``: which leaves of two loaded trees were added, removed, changed or equal.

Tensors and arrays of the same kind, dtype and shape are compared bit for bit first;
those that differ are compared as numbers, a piece at a time (so a comparison holds
float64 copies of one piece, not of the whole tensor): the largest absolute
difference, the relative one (that, over the largest magnitude either side holds),
and how many elements differ.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from .._format.tree import format_path
from .entries import Path, jsonable, walk_object
from .select import plain_value

Status = Literal["added", "removed", "changed", "close", "equal"]
#: Elements compared at a time.
_PIECE = 1 << 22


@dataclass(frozen=True, slots=True)
class Change:
    path: Path
    status: Status
    detail: str = ""
    max_abs: float | None = None
    max_rel: float | None = None
    differing: int | None = None
    #: Both sides (the one side, if added or removed) are plain values: inspect's and
    #: diff's tables show many of those in one container as one row.
    plain: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": format_path(self.path), "status": self.status, "detail": self.detail}
        if self.max_abs is not None:
            out |= {"max_abs": jsonable(self.max_abs), "max_rel": jsonable(self.max_rel)}
            out["differing"] = self.differing
        return out


def diff(a: Any, b: Any, *, atol: float = 0.0) -> list[Change]:
    """Every leaf of ``a`` and ``b``, compared: ``a``'s order, then what only ``b`` has.
    Arrays whose largest difference is at most ``atol`` are ``close``."""
    left, right = dict(walk_object(a)), dict(walk_object(b))
    out = []
    for path, x in left.items():
        if path not in right:
            out.append(Change(path, "removed", describe(x), plain=plain_value(x)))
        else:
            out.append(_compare(path, x, right[path], atol))
    out += [
        Change(path, "added", describe(y), plain=plain_value(y))
        for path, y in right.items()
        if path not in left
    ]
    return _key_types(out)


def _key_types(changes: list[Change]) -> list[Change]:
    """The changes, those at paths that print alike (``0`` and ``'0'``: keys a
    conversion turned into text) saying the types of the keys where they differ."""
    alike: dict[str, list[Path]] = {}
    for change in changes:
        alike.setdefault(format_path(change.path), []).append(change.path)
    out = []
    for change in changes:
        paths = alike[format_path(change.path)]
        if len(paths) > 1:
            same = [p for p in paths if len(p) == len(change.path)]
            keys = [k for i, k in enumerate(change.path) if len({_typed(p[i]) for p in same}) > 1]
            # Else keys with dots in them: ("a.b",) prints as ("a", "b") does.
            said = ", ".join(f"key {k!r} is {type(k).__name__}" for k in keys) or f"keys {change.path!r}"
            change = dataclasses.replace(change, detail=f"{change.detail}; {said}".lstrip("; "))
        out.append(change)
    return out


def _typed(key: object) -> tuple[str, str]:
    return type(key).__name__, repr(key)


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    if isinstance(value, (np.ndarray, np.generic)):
        kind = "ndarray" if isinstance(value, np.ndarray) else "npscalar"
        return f"{kind} {value.dtype.name} {list(value.shape)}"
    return f"{'None' if value is None else type(value).__name__} {_short(value)}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_array(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray, np.generic))


def _compare(path: Path, x: Any, y: Any, atol: float) -> Change:
    if _is_array(x) and _is_array(y):
        return _compare_arrays(path, x, y, atol)
    plain = plain_value(x) and plain_value(y)
    if not _is_array(x) and not _is_array(y) and _same(x, y):
        return Change(path, "equal", plain=plain)
    return Change(path, "changed", f"{describe(x)} -> {describe(y)}", plain=plain)


def _same(x: Any, y: Any) -> bool:
    if type(x) is not type(y):
        return False
    if isinstance(x, float) and math.isnan(x):
        return math.isnan(y)
    try:
        return bool(x == y)
    except Exception:  # a pickled object whose __eq__ fails
        return repr(x) == repr(y)


def _compare_arrays(path: Path, x: Any, y: Any, atol: float) -> Change:
    if describe(x) != describe(y):
        return Change(path, "changed", f"{describe(x)} -> {describe(y)}")
    tx, ty = _as_tensor(x), _as_tensor(y)
    if tx is None or ty is None:  # a NumPy dtype torch has no counterpart for
        same = np.asarray(x).tobytes() == np.asarray(y).tobytes()
        return Change(path, "equal" if same else "changed", "" if same else "bytes differ")
    if torch.equal(_raw(tx), _raw(ty)):
        return Change(path, "equal")
    max_abs, scale, differing = 0.0, 0.0, 0
    for px, py in _pieces(tx, ty):
        d = (px - py).abs()
        d[(px == py) | (px.isnan() & py.isnan())] = 0  # equal infinities, NaN against NaN
        differing += int((d != 0).sum())  # NaN against a number counts (NaN != 0)
        nan = d.isnan()
        max_abs = max(max_abs, math.inf if bool(nan.any()) else 0.0, float(d.masked_fill(nan, 0).max()))
        scale = max(scale, float(_finite(px).abs().max()), float(_finite(py).abs().max()))
    if not differing:
        return Change(path, "equal", "equal values in other bits (-0.0 and 0.0, or NaN payloads)")
    rel = max_abs / scale if scale else math.inf
    detail = f"max abs {max_abs:.4g}, rel {rel:.4g}, {differing}/{tx.numel()} elements differ"
    status: Status = "close" if max_abs <= atol else "changed"
    return Change(path, status, detail, max_abs, rel, differing)


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    try:
        return torch.from_numpy(np.ascontiguousarray(value))
    except TypeError:
        return None


def _raw(t: torch.Tensor) -> torch.Tensor:
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat


def _pieces(x: torch.Tensor, y: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Both, a piece at a time, as float64 (complex128 for complex dtypes)."""
    wide = torch.complex128 if x.is_complex() else torch.float64
    fx, fy = x.reshape(-1), y.reshape(-1)
    for start in range(0, fx.numel(), _PIECE):
        yield fx[start : start + _PIECE].to(wide), fy[start : start + _PIECE].to(wide)


def _finite(t: torch.Tensor) -> torch.Tensor:
    finite = t[t.isfinite()]
    return finite if finite.numel() else torch.zeros(1, dtype=t.dtype)
