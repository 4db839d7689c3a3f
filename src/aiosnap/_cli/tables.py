"""The tables of ``inspect`` and ``diff``.

A name is never cut: the entry column folds a long name onto the next line, and
``--wide`` gives each row one line however wide that is. Which rows there are is
``_cli_select``'s: the leaves asked for, a container of many plain values as one row,
everything below ``--depth`` as one row per container.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Column, Table

from .._format.tree import format_path
from .diff import Change, Status
from .entries import Described, Entry
from .select import Group, grouped, is_sequence, plain_value, select
from .views import human, out, stored

#: The console width ``--wide`` sets: wide enough for any row.
WIDE = 100_000
_ORDER: tuple[Status, ...] = ("changed", "added", "removed", "close", "equal")
#: The width the value (or detail) column keeps however long the names are.
SOFT_MIN = 12


@dataclass(frozen=True, slots=True)
class Shown:
    """What the table shows: ``--keys``, ``--exclude``, ``--depth``, ``--expand``, ``--wide``."""

    keys: Sequence[str] = ()
    exclude: Sequence[str] = ()
    depth: int | None = None
    expand: bool = False
    wide: bool = False

    def console(self) -> Console:
        if not self.wide:
            return out()
        return Console(highlight=False, soft_wrap=True, markup=False, width=WIDE)


def _path(item: Entry | Change) -> tuple[object, ...]:
    return item.path


def _is_plain(item: Entry) -> bool:
    return not item.stored and plain_value(item.value)


# -- inspect -----------------------------------------------------------------------------------------


def print_described(described: Described, shown: Shown) -> None:
    console = shown.console()
    entries = select(described.entries, _path, shown.keys, shown.exclude)
    for line in summary(described):
        console.print(line)
    if len(entries) != len(described.entries):
        console.print(f"showing {len(entries)} of {len(described.entries)} entries (--keys, --exclude)")
    if described.files:
        files = Table(Column("file", overflow="fold"), "size", "header crc32c")
        for file, size, crc in described.files:
            files.add_row(file, human(size), crc)
        console.print(files)
    rows = list(tree_rows(grouped(entries, _path, _is_plain, depth=shown.depth, expand=shown.expand)))
    headers = ["entry", "type", "shape / value", "size", "crc32c"]
    console.print(table(console.width, headers, rows, soft=2, wide=shown.wide))


def summary(d: Described) -> list[str]:
    """Two lines: the file (or step directory); what its tree holds and what it stores
    (the stored count and bytes are verify's)."""
    first = f"{d.path}: {d.format}, {human(d.size)}"
    if d.step is not None:
        first += f", step {d.step}"
    if d.checksum:
        first += f", header crc32c {d.checksum}"
    plain = len(d.entries) - d.tensors
    second = f"{len(d.entries)} entries: {d.tensors} tensor(s) and array(s), {plain} plain value(s)"
    if d.stored is not None and d.data is not None:
        second += f"; {stored(d.stored, d.data)}"
    return [first, second]


def tree_rows(items: list[Entry | Group[Entry]]) -> Iterator[list[str]]:
    """The rows, indented as the tree nests; a row per container above a shown leaf."""
    shown: tuple[object, ...] = ()
    for item in items:
        parent = item.path[:-1]
        same = 0
        while same < min(len(shown), len(parent)) and shown[same] == parent[same]:
            same += 1
        for depth in range(same, len(parent)):
            yield ["  " * depth + str(parent[depth]), "", "", "", ""]
        shown = parent
        label = "  " * len(parent) + (str(item.path[-1]) if item.path else "<root>")
        yield group_cells(label, item) if isinstance(item, Group) else entry_cells(label, item)


def entry_cells(label: str, e: Entry) -> list[str]:
    if e.stored:
        shape = str(list(e.shape or ())) + (f" ({e.note})" if e.note else "")
        return [label, f"{e.kind} {e.dtype}", shape, human(e.nbytes), e.crc32c or ""]
    value = repr(e.value)
    return [label, e.kind, value if len(value) <= 60 else value[:57] + "...", "", ""]


def group_cells(label: str, group: Group[Entry]) -> list[str]:
    members = group.members
    if all(_is_plain(e) for e in members) and is_sequence([e.path for e in members], group.path):
        kinds = "|".join(sorted({e.kind for e in members}))
        return [label, f"{len(members)} x {kinds}", preview([e.value for e in members]), "", ""]
    tensors = sum(e.stored for e in members)
    nbytes = sum(e.nbytes or 0 for e in members)
    counts = [(tensors, "tensor(s)"), (len(members) - tensors, "value(s)")]
    what = ", ".join(f"{n} {noun}" for n, noun in counts if n)
    return [label, f"{len(members)} entries", what, human(nbytes) if tensors else "", ""]


def preview(values: list[object], limit: int = 24) -> str:
    """The first values, as many as fit ``limit`` characters: ``[3, 7, 12, ...]``."""
    parts: list[str] = []
    size = 2
    for value in values:
        text = repr(value)
        if parts and size + len(text) + 5 > limit:  # 5: the ", ..." that would follow
            return "[" + ", ".join(parts) + ", ...]"
        parts.append(text)
        size += len(text) + 2
    return "[" + ", ".join(parts) + "]"


# -- diff --------------------------------------------------------------------------------------------


def print_diff(changes: list[Change], show_all: bool, shown: Shown) -> None:
    rows = []
    for item in grouped(changes, _path, lambda c: c.plain, depth=shown.depth, expand=shown.expand):
        status, detail = group_status(item) if isinstance(item, Group) else (item.status, item.detail)
        if show_all or status != "equal":
            rows.append([status, format_path(item.path), detail])
    if rows:
        console = shown.console()
        console.print(table(console.width, ["", "entry", "detail"], rows, entry=1, soft=2, wide=shown.wide))


def group_status(group: Group[Change]) -> tuple[Status, str]:
    """One status for the changes of a group (``changed`` where they differ), and their
    counts: ``624 changed, 1 equal``."""
    counts = Counter(c.status for c in group.members)
    detail = ", ".join(f"{counts[s]} {s}" for s in _ORDER if counts[s])
    if not group.folded or (
        all(c.plain for c in group.members) and is_sequence([c.path for c in group.members], group.path)
    ):
        detail += f" (of {len(group.members)} plain values)"
    if len(counts) == 1:
        return group.members[0].status, detail
    return ("close" if set(counts) <= {"close", "equal"} else "changed"), detail


# -- layout ------------------------------------------------------------------------------------------


def table(
    width: int, headers: list[str], rows: list[list[str]], *, soft: int, wide: bool, entry: int = 0
) -> Table:
    """A table ``width`` wide at most, whose ``entry`` column is never cut: its names wrap
    (see wrap_name), and get the room the others leave, but for SOFT_MIN characters of
    the ``soft`` column (values, details), which folds. ``wide``: every column as wide
    as its widest cell."""
    natural = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    names, values = natural[entry], natural[soft]
    if not wide:
        room = width - 1 - 3 * len(headers) - sum(w for i, w in enumerate(natural) if i not in (entry, soft))
        keep = min(values, max(SOFT_MIN, len(headers[soft])))
        names = min(names, max(room - keep, 12))
        values = max(min(values, room - names), len(headers[soft]))
    columns = [
        Column(h, width=names, no_wrap=True)
        if i == entry
        else Column(h, width=values, overflow="fold")
        if i == soft
        else Column(h, no_wrap=True)
        for i, h in enumerate(headers)
    ]
    out = Table(*columns)
    for row in rows:
        out.add_row(*[wrap_name(cell, names) if i == entry else cell for i, cell in enumerate(row)])
    return out


#: Where a name may break but at a dot: after a space, a slash, an underscore, an equals
#: sign or a hyphen, and before an opening bracket (a Lightning callback's key is
#: ``ModelCheckpoint{'monitor': 'step', ...}``; a path may be a key).
_WORD_END = re.compile(r"(?<=[ /_=\-])|(?=[{\[(])")


def wrap_name(label: str, width: int) -> str:
    """``label`` (a name after its indentation) in lines of at most ``width``, each line
    after the first indented two more spaces than the first: broken after a dot, else
    between words (see _WORD_END), never inside a word unless one word is longer than a
    whole line."""
    if len(label) <= width:
        return label
    indent = len(label) - len(label.lstrip(" "))
    more = " " * min(indent + 2, max(width - 4, 0))
    lines, line = [], label[:indent]
    for part in re.split(r"(?<=\.)", label[indent:]):
        pieces = [part] if len(more) + len(part) <= width else [p for p in _WORD_END.split(part) if p]
        for piece in pieces:
            if line.strip() and len(line) + len(piece) > width:
                lines.append(line)
                line = more
            while len(line) + len(piece) > width:  # one word longer than a line: cut, as nothing else fits
                room = max(width - len(line), 1)
                lines.append(line + piece[:room])
                line, piece = more, piece[room:]
            line += piece
    lines.append(line)
    return "\n".join(lines)
