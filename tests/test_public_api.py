"""The public surface, pinned: every name of the public modules' ``__all__`` with its
signature, and each public class's own methods, properties and attributes.

A change of the public surface shows up here as a change of tests/golden/public-api.txt,
so that it is a decision made in review, not a side effect. To write the file anew after
a deliberate change, run ``AIOSNAP_REGOLDEN=1 pytest tests/test_public_api.py`` and read
``git diff tests/golden``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import typing
from pathlib import Path
from types import ModuleType
from typing import Any

GOLDEN = Path(__file__).resolve().parent / "golden" / "public-api.txt"
MODULES = ("aiosnap", "aiosnap.errors", "aiosnap.retention", "aiosnap.storage", "aiosnap.triggers")


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def _ours(cls: type, name: str) -> Any:
    """``name``'s value as the first of aiosnap's classes in ``cls``'s MRO defines it."""
    for base in cls.__mro__:
        if base.__module__.startswith("aiosnap") and name in vars(base):
            return vars(base)[name]
    return None


def _members(cls: type) -> list[str]:
    rows = []
    for name in sorted({n for base in cls.__mro__ for n in vars(base)}):
        if name.startswith("_") and name not in ("__call__", "__aenter__", "__aexit__"):
            continue
        value = _ours(cls, name)
        if value is None:
            continue
        if isinstance(value, property):
            rows.append(f"    {name}: property")
        elif isinstance(value, staticmethod | classmethod):
            rows.append(f"    {name}{_signature(value.__func__)}")
        elif inspect.isfunction(value):
            kind = "async def" if inspect.iscoroutinefunction(value) else "def"
            rows.append(f"    {kind} {name}{_signature(value)}")
        else:
            rows.append(f"    {name}: {type(value).__name__}")
    return rows


def _describe(name: str, obj: Any) -> list[str]:
    if isinstance(obj, ModuleType):
        return [f"  {name}: module {obj.__name__}"]
    if typing.is_typeddict(obj):
        keys = obj.__annotations__
        return [f"  TypedDict {name}", *(f"    {k}: {v}" for k, v in keys.items())]
    if inspect.isclass(obj):
        bases = ", ".join(b.__name__ for b in obj.__bases__ if b is not object)
        return [f"  class {name}({bases}){_signature(obj)}", *_members(obj)]
    if callable(obj):
        kind = "async def" if inspect.iscoroutinefunction(obj) else "def"
        return [f"  {kind} {name}{_signature(obj)}"]
    return [f"  {name}: {type(obj).__name__} = {obj!r}"]


def surface() -> str:
    lines = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        lines.append(f"module {module_name}")
        for name in sorted(module.__all__):
            lines += _describe(name, getattr(module, name))
    return "\n".join(lines) + "\n"


def test_the_public_surface_is_the_one_pinned() -> None:
    text = surface()
    if os.environ.get("AIOSNAP_REGOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "the public surface changed: see tests/golden/public-api.txt"
