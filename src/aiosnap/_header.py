"""The checksummed header, as far as a commit needs it: render it, seal an image.

Kept free of torch and NumPy so the offload worker process, which seals images in
shared memory, starts in a blink.
"""

from __future__ import annotations

import array
import json
import struct
from collections.abc import Sequence

import crc32c as _crc32c

ALIGN = 4096
META_KEY = "aiosnap"
CRC_KEY = "aiosnap_crc32c"
CRC_ZERO = "00000000"


def crc32c(data: memoryview | bytes | bytearray, value: int = 0) -> int:
    return int(_crc32c.crc32c(data, value))


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


class HeaderTemplate:
    """A header laid out before the checksums are known; ``render`` fills them in.

    Built from ``pieces``, the aiosnap metadata JSON split where each tensor's checksum
    goes (``"crc32c":"<hex>"`` belongs between pieces i and i+1), and ``entries``, the
    safetensors entries without their braces. The checksums are fixed-width hex, so
    the header is laid out once, with zeros, and rendering only overwrites them at
    known offsets. Two compact objects (bytes and an offset array) cross to the
    offload process cheaply, and a large one is never freed all at once.
    """

    def __init__(self, pieces: list[str], entries: str) -> None:
        # The metadata is stored as a JSON string inside the header: pieces are escaped.
        slot_head, slot = '\\"crc32c\\":\\"', f'\\"crc32c\\":\\"{CRC_ZERO}\\"'
        escaped = [json_string(p)[1:-1] for p in pieces]
        start = f'{{"__metadata__":{{"{META_KEY}":"'
        text = "".join(
            [
                start,
                slot.join(escaped),
                f'","{CRC_KEY}":"{CRC_ZERO}"}}',
                "," if entries else "",
                entries,
                "}",
            ]
        ).encode()
        self.size = -(-(8 + len(text)) // ALIGN) * ALIGN
        self._bytes = struct.pack("<Q", self.size - 8) + text + b" " * (self.size - 8 - len(text))
        pos, slots = 8 + len(start) + len(slot_head), array.array("q")
        for piece in escaped[:-1]:
            pos += len(piece)
            slots.append(pos)
            pos += len(slot)
        self._slots = slots
        self._crc_at = self._bytes.index(f'"{CRC_KEY}":"{CRC_ZERO}"'.encode()) + len(CRC_KEY) + 4

    def render(self, crcs: Sequence[int]) -> bytes:
        """The first ``size`` bytes of the file, with these tensor checksums."""
        raw = bytearray(self._bytes)
        for at, crc in zip(self._slots, crcs, strict=True):
            raw[at : at + 8] = b"%08x" % crc
        raw[self._crc_at : self._crc_at + 8] = b"%08x" % crc32c(raw)
        return bytes(raw)


def seal(image: memoryview, template: HeaderTemplate, spans: Sequence[int]) -> list[int]:
    """Checksum each staged entry (``spans``: data-section offsets, start and end of each
    in turn) and write the header in front of them. Runs in the commit, after the caller
    has moved on."""
    start = template.size
    crcs = [crc32c(image[start + spans[i] : start + spans[i + 1]]) for i in range(0, len(spans), 2)]
    image[:start] = template.render(crcs)
    return crcs
