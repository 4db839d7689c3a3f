"""The checksummed header, as far as a commit needs it: render it, seal an image.

Kept free of torch and NumPy so the offload worker process, which seals images in
shared memory, starts in a blink.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

import crc32c as _crc32c

ALIGN = 4096
META_KEY = "aiosnap"
CRC_KEY = "aiosnap_crc32c"
CRC_ZERO = "00000000"
SLOT = f'"crc32c":"{CRC_ZERO}"'


def crc32c(data: memoryview | bytes | bytearray, value: int = 0) -> int:
    return int(_crc32c.crc32c(data, value))


class HeaderTemplate:
    """A header laid out before the checksums are known; ``render`` fills them in.

    ``pieces`` is the aiosnap metadata JSON split at its checksum slots, ``entries``
    the safetensors entries without their braces. The checksums are fixed-width hex,
    so the padded length (``size``, the data section's offset) never changes.
    """

    def __init__(self, pieces: list[str], entries: str) -> None:
        self._pieces = pieces
        self._entries = entries
        self.size = -(-(8 + len(self._text([0] * (len(pieces) - 1)))) // ALIGN) * ALIGN

    def _text(self, crcs: list[int]) -> bytes:
        filled = [self._pieces[0]]
        for crc, piece in zip(crcs, self._pieces[1:], strict=True):
            filled += [f'"crc32c":"{crc:08x}"', piece]
        metadata = f'{{"{META_KEY}":{json.dumps("".join(filled))},"{CRC_KEY}":"{CRC_ZERO}"}}'
        body = f'{{"__metadata__":{metadata}{"," if self._entries else ""}{self._entries}}}'
        return body.encode()

    def render(self, crcs: list[int]) -> bytes:
        """The first ``size`` bytes of the file, with these tensor checksums."""
        text = self._text(crcs)
        raw = bytearray(struct.pack("<Q", self.size - 8) + text + b" " * (self.size - 8 - len(text)))
        at = raw.index(f'"{CRC_KEY}":"{CRC_ZERO}"'.encode()) + len(CRC_KEY) + 4
        raw[at : at + 8] = f"{crc32c(raw):08x}".encode()
        return bytes(raw)


def seal(image: memoryview, template: HeaderTemplate, spans: Sequence[int]) -> list[int]:
    """Checksum each staged entry (``spans``: data-section offsets, start and end of each
    in turn) and write the header in front of them. Runs in the commit, after the caller
    has moved on."""
    start = template.size
    crcs = [crc32c(image[start + spans[i] : start + spans[i + 1]]) for i in range(0, len(spans), 2)]
    image[:start] = template.render(crcs)
    return crcs
