"""The checksummed header, as far as a commit needs it: render it, seal an image.

Kept free of torch and NumPy so the offload worker process, which seals images in
shared memory, starts in a blink.
"""

from __future__ import annotations

import array
import itertools
import json
import operator
import struct
from collections.abc import Iterator, Mapping, Sequence

from .._base.checksums import crc32c, crc32c_combine
from .._storage.protocol import ALIGN as ALIGN  # re-exported: the staging aligns by it

META_KEY = "aiosnap"
CRC_KEY = "aiosnap_crc32c"
CRC_ZERO = "00000000"
#: What ``__metadata__`` holds beside aiosnap's two keys, unless a file is given other
#: entries: readers that look for it (accelerate's ``load_state_dict``, transformers' 4.x
#: ``from_pretrained``) refuse a safetensors file without it.
DEFAULT_METADATA = {"format": "pt"}


_ESCAPE = json.encoder.encode_basestring_ascii
#: Characters escaped per C call: escaping megabytes in one call holds the GIL, and so
#: stalls the event loop, for tens of milliseconds.
_ESCAPE_SLICE = 1 << 16


def json_string(s: str) -> str:
    """``s`` as an ASCII JSON string literal, escaped a slice at a time."""
    if len(s) <= _ESCAPE_SLICE:
        return _ESCAPE(s)
    slices = (_ESCAPE(s[i : i + _ESCAPE_SLICE])[1:-1] for i in range(0, len(s), _ESCAPE_SLICE))
    return '"' + "".join(slices) + '"'


#: Shard entries longer than this carry a checksum per block of it, so a restore that
#: reads part of a shard still verifies every byte it reads.
BLOCK = 1 << 20


def entry_crcs(data: memoryview, blocks: int) -> list[int]:
    """The checksums of one entry, in the order its header holds them: one per block of
    BLOCK bytes (if ``blocks``), then the whole entry's."""
    if not blocks:
        return [crc32c(data)]
    parts = [crc32c(data[i : i + BLOCK]) for i in range(0, len(data), BLOCK)]
    whole = parts[0] if parts else crc32c(b"")
    for i, part in enumerate(parts[1:], 1):
        whole = crc32c_combine(whole, part, min(BLOCK, len(data) - i * BLOCK))
    return [*parts, whole]


def block_count(nbytes: int) -> int:
    return -(-nbytes // BLOCK)


class HeaderTemplate:
    """A header laid out before the checksums are known; ``render`` fills them in.

    Built from ``pieces`` of the aiosnap metadata JSON, escaped as the inside of a JSON
    string (ASCII), with a *hole* for checksums
    between each two (``holes[i]`` checksums of 8 hex digits between pieces i and i+1:
    an entry's whole checksum, or its block checksums), ``blocks`` (per entry, whether
    it has block checksums) and ``entries``, the safetensors entries without their
    braces; ``metadata``, the other entries of ``__metadata__`` (DEFAULT_METADATA
    unless given). The checksums are fixed-width hex, so the header is laid out once, with
    zeros, and rendering only overwrites them at known offsets. A few compact objects
    (bytes and arrays) cross to the offload process cheaply, and a large one is never
    freed all at once.
    """

    def __init__(
        self,
        pieces: list[str],
        holes: list[int],
        blocks: list[int],
        entries: str,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        # The metadata is stored as a JSON string inside the header: the pieces come
        # escaped, so all of it is ASCII, and offsets in the text are offsets in the bytes.
        escaped = pieces
        start = f'{{"__metadata__":{{"{META_KEY}":"'
        parts = [start]
        pos, at = 8 + len(start), array.array("q")
        if holes.count(1) == len(holes) == len(escaped) - 1:
            # One checksum after each piece but the last (whole tensors only): laid out
            # by C-level iteration, ~0.5 us less per tensor than the loop below; a batch
            # per C call, as one over 100,000 pieces held the GIL for 9 ms.
            for i in range(0, len(holes), _JOINED):
                batch = escaped[i : min(i + _JOINED, len(holes))]
                ends = itertools.islice(itertools.accumulate(map(len, batch), initial=pos), 1, None)
                at.extend(map(operator.add, ends, range(0, 8 * len(batch), 8)))
                pos += sum(map(len, batch)) + 8 * len(batch)
                parts += [CRC_ZERO.join(batch), CRC_ZERO]
            parts.append(escaped[-1])
            pos += len(escaped[-1])
        else:
            for piece, hole in zip(escaped, [*holes, 0], strict=True):
                parts += [piece, CRC_ZERO * hole]
                pos += len(piece)
                at.extend(range(pos, pos + 8 * hole, 8))
                pos += 8 * hole
        self._holes = at  # where each checksum goes
        self._crc_at = pos + len(CRC_KEY) + 6  # after '","' CRC_KEY '":"'
        extra = "".join(
            f",{json_string(k)}:{json_string(v)}"
            for k, v in (DEFAULT_METADATA if metadata is None else metadata).items()
        )
        parts += [f'","{CRC_KEY}":"{CRC_ZERO}"{extra}}}', "," if entries else "", entries, "}"]
        self.size = -(-(pos + sum(map(len, parts[-4:]))) // ALIGN) * ALIGN
        # Laid out a slice at a time: the header of 100,000 tensors is 26 MB, and each
        # whole-header copy held the GIL (and so stalled the event loop) ~10 ms; so did
        # bytearray(size), zeroing 26 MB of fresh memory (its page faults) in one call.
        raw = bytearray(struct.pack("<Q", self.size - 8))
        for chunk in _encoded(parts):
            raw += chunk
        while len(raw) < self.size:
            raw += b" " * min(_SLICE, self.size - len(raw))
        self._bytes = raw
        self.blocks = array.array("q", blocks)

    def render(self, crcs: Sequence[int]) -> bytes:
        """The first ``size`` bytes of the file, with these checksums (in hole order)."""
        raw = bytearray(self.size)
        self.render_into(memoryview(raw), crcs)
        return bytes(raw)

    def render_into(self, dest: memoryview, crcs: Sequence[int]) -> None:
        """Write the header into ``dest`` (``size`` bytes), with these checksums."""
        src = memoryview(self._bytes)
        for i in range(0, self.size, _SLICE):
            dest[i : i + _SLICE] = src[i : i + _SLICE]
        for at, crc in zip(self._holes, crcs, strict=True):
            dest[at : at + 8] = b"%08x" % crc
        dest[self._crc_at : self._crc_at + 8] = b"%08x" % crc32c(dest)


#: Bytes encoded or copied per C call while a header is laid out or rendered.
_SLICE = 1 << 20
#: Pieces joined per C call while a header is laid out: ~100 KB of text.
_JOINED = 1024


def _encoded(parts: list[str]) -> Iterator[bytes]:
    """``parts`` (ASCII) joined and encoded, in chunks of about _SLICE bytes."""
    batch: list[str] = []
    size = 0
    for part in parts:
        if len(part) > _SLICE:
            if batch:
                yield "".join(batch).encode()
                batch, size = [], 0
            for i in range(0, len(part), _SLICE):
                yield part[i : i + _SLICE].encode()
            continue
        batch.append(part)
        size += len(part)
        if size >= _SLICE:
            yield "".join(batch).encode()
            batch, size = [], 0
    if batch:
        yield "".join(batch).encode()


def seal(image: memoryview, template: HeaderTemplate, spans: Sequence[int]) -> list[int]:
    """Checksum each staged entry (``spans``: data-section offsets, start and end of each
    in turn) and write the header in front of them. Runs in the commit, after the caller
    has moved on."""
    start = template.size
    crcs: list[int] = []
    whole = crc32c
    for i, blocks in enumerate(template.blocks):
        data = image[start + spans[2 * i] : start + spans[2 * i + 1]]
        if blocks:
            crcs += entry_crcs(data, blocks)
        else:  # the common entry, inline: a call less per tensor
            crcs.append(whole(data))
    template.render_into(image[:start], crcs)
    return crcs


class EntryCrc:
    """The checksums of an entry that arrives a piece at a time (a save in pieces)."""

    def __init__(self, blocks: int) -> None:
        self.blocks, self._parts, self._pos = blocks, [0], 0

    def update(self, data: memoryview) -> None:
        while len(data):
            room = BLOCK - self._pos % BLOCK if self.blocks else len(data)
            if self.blocks and self._pos and self._pos % BLOCK == 0:
                self._parts.append(0)
            piece, data = data[:room], data[room:]
            self._parts[-1] = crc32c(piece, self._parts[-1])
            self._pos += len(piece)

    def values(self) -> list[int]:
        if not self.blocks or not self._pos:
            return self._parts
        whole = self._parts[0]
        for i, part in enumerate(self._parts[1:], 1):
            whole = crc32c_combine(whole, part, min(BLOCK, self._pos - i * BLOCK))
        return [*self._parts, whole]
