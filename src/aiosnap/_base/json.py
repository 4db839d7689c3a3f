"""``json.loads`` for large headers, in C calls over a bounded slice of text each.

One ``json.loads`` over the header of a 20,000-tensor checkpoint holds the GIL for a
few hundred milliseconds, and the event loop stalls for as long. Here the C scanner
parses one value at a time inside a window of ``WINDOW`` characters; a value that
does not fit is descended into (objects and arrays member by member, strings slice
by slice), so no single call sees more than a window. The result, and the errors
(ValueError), are those of ``json.loads``.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import re
from collections.abc import Callable
from typing import Any

#: Characters one C call may parse: a few milliseconds.
WINDOW = 1 << 16
#: Characters of a member's end that a run's cut is looked for by (see ``_gap``).
GAP = 16
#: Containers larger than a window nested deeper than this are refused (json.loads
#: itself stops at the interpreter's recursion limit).
MAX_DEPTH = 200

_WS_CHARS = frozenset(" \t\n\r")
_WS = re.compile(r"[ \t\n\r]*").match  # JSON's whitespace, as json.decoder has it


def loads(text: str, *, window: int = WINDOW) -> Any:
    """``json.loads(text)``, in C calls over at most ``window`` characters each."""
    if len(text) <= window:
        return json.loads(text)
    return _Parser(text, window).parse()


def loads_at(text: str, i: int, *, window: int = WINDOW) -> tuple[Any, int]:
    """The JSON value that starts at ``text[i]`` (after any whitespace) and the index
    just after it, as ``json.JSONDecoder().raw_decode(text, i)`` gives them."""
    parser = _Parser(text, window)
    return parser.value(parser.ws(i), 0)


class _Parser:
    def __init__(self, text: str, window: int) -> None:
        self.s, self.size = text, window
        # The C functions, as the json module has them when the parse starts.
        self.scan = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
        self.scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
        self.start = 0  # the window is s[start : start + len(view)]
        self.view = ""

    def parse(self) -> Any:
        value, end = self.value(self.ws(0), 0)
        if self.ws(end) != len(self.s):
            raise json.JSONDecodeError("Extra data", self.s, end)
        return value

    def ws(self, i: int) -> int:
        if self.s[i : i + 1] not in _WS_CHARS:  # the common case: compact JSON
            return i
        match = _WS(self.s, i)
        assert match is not None  # the pattern matches the empty string
        return match.end()

    def value(self, i: int, depth: int) -> tuple[Any, int]:
        fitted = self.small(i)
        if fitted is not None:
            return fitted
        if depth >= MAX_DEPTH:
            raise json.JSONDecodeError("large containers nested too deeply", self.s, i)
        c = self.s[i : i + 1]
        if c == "{":
            return self.obj(i + 1, depth + 1)
        if c == "[":
            return self.array(i + 1, depth + 1)
        if c == '"':
            return self.string(i + 1)
        try:  # a number longer than a window: the scanner reads only the number itself
            value, end = self.scan(self.s, i)
        except StopIteration:
            raise json.JSONDecodeError("Expecting value", self.s, i) from None
        return value, end

    def small(self, i: int) -> tuple[Any, int] | None:
        """The value at ``i`` and where it ends, if it parses within one window: the
        current one if ``i`` is well inside it (the common case), else a fresh one at
        ``i``. A scan that fails is never repeated on the same window: in a large
        container nested in others, every level costs a failed scan."""
        for fresh in (False, True):
            at = i - self.start
            if fresh or not (at >= 0 and at + 3 < len(self.view)):
                if fresh and self.start == i:
                    return None  # a fresh window at i already failed
                self.start, self.view = i, self.s[i : i + self.size]
            truncated = self.start + len(self.view) < len(self.s)
            try:
                value, end = self.scan(self.view, i - self.start)
            except (StopIteration, ValueError, RecursionError):
                if truncated:
                    continue  # perhaps cut off by the window: retry, then descend
                return None  # a real error: descending finds and reports it
            # A number cut off by the window can still parse ("2.5e-7" cut to "2.5e" reads
            # as 2.5): its end is trusted only with the 2 characters the grammar looks
            # ahead (".d", "e-d") and one more inside the window.
            if end + 3 <= len(self.view) or not truncated:
                return value, self.start + end
        return None

    def obj(self, i: int, depth: int) -> tuple[dict[str, Any], int]:
        s, out = self.s, dict[str, Any]()

        def member(i: int) -> int:
            if s[i : i + 1] != '"':
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", s, i)
            key, i = self.value(i, depth)
            i = self.ws(i)
            if s[i : i + 1] != ":":
                raise json.JSONDecodeError("Expecting ':' delimiter", s, i)
            out[key], i = self.value(self.ws(i + 1), depth)
            return i

        return out, self.members(i, "}", member, out.update)

    def array(self, i: int, depth: int) -> tuple[list[Any], int]:
        out = list[Any]()

        def member(i: int) -> int:
            value, i = self.value(i, depth)
            out.append(value)
            return i

        return out, self.members(i, "]", member, out.extend)

    def members(self, i: int, close: str, member: Callable[[int], int], merge: Callable[[Any], None]) -> int:
        """Parse ``member`` after ``member``, comma-separated, up to ``close``; the index
        just after it. Runs of small members are parsed a window at a time (``run``):
        one by one, each costs ~10 us of Python, 15x json.loads on a list of numbers."""
        s = self.s
        i = self.ws(i)
        if s[i : i + 1] == close:
            return i + 1
        retry, gap, last, end = i, "", -1, -1
        while True:
            if last >= 0 and i >= retry:  # two members: their ends make the gap
                gap = gap or _gap(s, last, end, i)
                cut = self.run(i, close, merge, gap)
                if cut is not None:
                    i = self.ws(cut + 1)
                    continue
                # A failed run costs a few scans of a window: try again half a window
                # on, with the gap of the members there.
                retry, gap = i + self.size // 2, ""
            last, end = end, member(i)
            i = self.ws(end)
            if s[i : i + 1] == close:
                return i + 1
            if s[i : i + 1] != ",":
                raise json.JSONDecodeError("Expecting ',' delimiter", s, i)
            i = self.ws(i + 1)

    def run(self, i: int, close: str, merge: Callable[[Any], None], gap: str) -> int | None:
        """Parse the members from ``i`` up to a comma inside a window in one C call, as
        the container ``open + s[i:comma] + close``; ``merge`` them and return where the
        comma is, or None. Only a comma between members gives a container that parses
        to its end: a cut inside a string leaves it unterminated (the closer becomes its
        text), a cut inside a member leaves a bracket unclosed.

        The commas tried are those in the last two places that look like the ``gap``
        between the last two members (see ``_gap``), then the last comma of all."""
        s = self.s
        end, comma = min(i + self.size, len(s)), gap.rindex(",")
        found = s.rfind(gap, i, end)
        cuts = [found, s.rfind(gap, i, found + len(gap) - 1) if found > i else -1]
        cuts = [c + comma for c in cuts if c > i]
        for cut in [*cuts, s.rfind(",", i, end)]:
            if cut <= i:
                continue
            text = ("[" if close == "]" else "{") + s[i:cut] + close
            try:
                value, stop = self.scan(text, 0)
            except (StopIteration, ValueError, RecursionError):
                continue
            if stop == len(text):
                merge(value)
                return cut
        return None

    def string(self, p: int) -> tuple[str, int]:
        """A string longer than a window, from just after its opening quote: decoded a
        slice at a time, each cut where no escape sequence (nor a surrogate pair of
        them) is split. Slices without escapes (the common case) are not kept: they
        are sliced out of the text once at the end, so a string of plain text costs one
        copy of itself, not two."""
        s, start, parts = self.s, p, list[str]()
        while True:
            q = min(p + self.size, len(s))
            if q < len(s):
                q = _safe_cut(s, p, q)
            piece = '"' + s[p:q] + '"'
            text, end = self.scanstring(piece, 1)  # raises on a control character or bad escape
            stop = p + end - 2 if end < len(piece) else q  # where this slice's text ends in s
            if parts or len(text) != stop - p:  # escapes decode shorter: keep the decoded text
                if not parts:
                    parts.append(s[start:p])
                parts.append(text)
            if end < len(piece):  # the string's own closing quote is inside this slice
                return ("".join(parts) if parts else s[start:stop]), stop + 1
            if q == len(s):
                raise json.JSONDecodeError("Unterminated string starting at", s, start - 1)
            p = q


def _gap(s: str, last: int, end: int, start: int) -> str:
    """How the member that ends at ``end`` ends and the next (at ``start``) begins: the
    comma between them, with the next one's first character and the closing quotes
    and brackets that the end shares with the end of the member before (at ``last``),
    up to ``GAP`` of them. Where members hold containers of their own, a short gap is
    found inside them too (``],[`` in ``[0,{"items":[["a",1],["b",2],["c",3]]}]``);
    a run cut there fails, and each member then costs a call (~2 us a tensor of an
    optimizer's state). ``]]}],[`` is found only between such members."""
    k = 1
    while k < GAP and last - k > 0 and s[end - k - 1] == s[last - k - 1] and s[last - k - 1] in _CLOSERS:
        k += 1
    return s[end - k : start + 1]


_CLOSERS = frozenset('"]}')


def _safe_cut(s: str, p: int, q: int) -> int:
    """A cut at or before ``q`` (and after ``p``) outside any escape sequence: before the
    run of backslashes holding the last backslash of the 6 characters before ``q``, or,
    if that run reaches back to ``p``, after an even number of its backslashes."""
    b = s.rfind("\\", max(p, q - 6), q)
    if b < 0:
        return q
    start = b
    while start > p and s[start - 1] == "\\":
        start -= 1
    if start > p:
        return start
    return p + max(2, (b + 1 - p) // 2 * 2)
