"""Which leaves ``inspect`` and ``diff`` show, and which they show together as one row.

A real training state has hundreds of leaves that are plain values -- Python's RNG state
is 625 ints, an optimizer's ``param_groups`` list every parameter's id -- and a table
with a row for each buries the tensors. So:

- ``--keys`` / ``--exclude`` take glob patterns (``fnmatch``, case-sensitive) matched
  against the dotted path of a leaf or of any container above it: ``optimizer`` is
  the whole subtree, ``*.exp_avg`` every leaf of that name, ``rng.python*`` the
  subtree and anything named like it.
- A container whose leaves are all plain values directly under it (a list of ints,
  a tuple of floats) and more than ``LIST_LIMIT`` of them is one row; ``--expand``
  lists them.
- ``--depth N`` shows the tree down to N levels; everything deeper is one row per
  container at level N.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .._format.tree import format_path

Path = tuple[object, ...]
T = TypeVar("T")
#: A container with more plain values than this is shown as one row.
LIST_LIMIT = 8


def matches(path: Path, patterns: Sequence[str]) -> bool:
    """Whether the dotted path of ``path``, or of a container above it, matches a pattern."""
    return any(
        fnmatch.fnmatchcase(format_path(path[:n]), pattern)
        for n in range(1, len(path) + 1)
        for pattern in patterns
    ) or (not path and any(fnmatch.fnmatchcase("<root>", p) for p in patterns))


def select(
    items: Iterable[T], path_of: Callable[[T], Path], keys: Sequence[str], exclude: Sequence[str]
) -> list[T]:
    """The items under ``keys`` (all, without any) and not under ``exclude``."""
    return [
        item
        for item in items
        if (not keys or matches(path_of(item), keys)) and not (exclude and matches(path_of(item), exclude))
    ]


@dataclass(slots=True)
class Group(Generic[T]):
    """Leaves shown as one row: the plain values of one container (``folded`` False),
    or everything under a container at the ``--depth`` asked for (``folded`` True)."""

    path: Path
    folded: bool
    members: list[T] = field(default_factory=list)


def grouped(
    items: Sequence[T],
    path_of: Callable[[T], Path],
    is_plain: Callable[[T], bool],
    *,
    depth: int | None = None,
    expand: bool = False,
) -> list[T | Group[T]]:
    """``items`` with those to be shown together replaced by their Group, at the place
    of the first of them (the others need not follow it: diff lists additions last)."""
    lists = set() if expand else _plain_lists(items, path_of, is_plain)
    out: list[T | Group[T]] = []
    groups: dict[tuple[bool, Path], Group[T]] = {}
    for item in items:
        path = path_of(item)
        if depth is not None and len(path) > depth:
            key = (True, path[:depth])
        elif path[:-1] in lists:
            key = (False, path[:-1])
        else:
            out.append(item)
            continue
        group = groups.get(key)
        if group is None:
            group = groups[key] = Group(key[1], key[0])
            out.append(group)
        group.members.append(item)
    return out


def _plain_lists(
    items: Sequence[T], path_of: Callable[[T], Path], is_plain: Callable[[T], bool]
) -> set[Path]:
    """The sequences (their keys 0, 1, 2 ...) of more than LIST_LIMIT leaves, every one
    a plain value directly under it. A dict of plain values is not one: its keys say
    what each value is."""
    count: dict[Path, int] = {}
    mixed: set[Path] = set()
    for item in items:
        path = path_of(item)
        if not path:
            continue
        parent = path[:-1]
        index = count.get(parent, 0)
        if is_plain(item) and type(path[-1]) is int and path[-1] == index:
            count[parent] = index + 1
        else:
            mixed.add(parent)
        mixed.update(path[:n] for n in range(len(path) - 1))  # a grandparent holds more than values
    return {parent for parent, n in count.items() if n > LIST_LIMIT and parent not in mixed}


def is_sequence(paths: Sequence[Path], parent: Path) -> bool:
    """Whether ``paths`` are the items 0, 1, 2 ... directly under ``parent``."""
    return all(len(p) == len(parent) + 1 and type(p[-1]) is int and p[-1] == i for i, p in enumerate(paths))


def plain_value(value: object) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))
