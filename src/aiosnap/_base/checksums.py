"""Checksums: CRC-32C of byte ranges, and of their concatenation from theirs.

crc32c is what every entry, block and header of a checkpoint is checked with: the
``crc32c`` package's C function releases the GIL and runs at ~11 GB/s here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import crc32c as _crc32c

#: ``crc32c(data, value=0)``: the C function itself, called per tensor (a wrapper
#: around it cost a Python call each).
crc32c: Callable[..., int] = _crc32c.crc32c

_POLY = 0x82F63B78  # CRC-32C, reflected
_SHIFTS: list[list[int]] = []  # _SHIFTS[k]: the operator that appends 2**k zero bytes


def _times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, row) for row in matrix]


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32c of ``a + b`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)`` (zlib's
    ``crc32_combine``, for CRC-32C): the whole-entry checksum from its block checksums,
    without a second pass over the data."""
    if not _SHIFTS:
        op = [_POLY] + [1 << n for n in range(31)]  # one zero bit
        for _ in range(3):
            op = _square(op)
        for _ in range(48):  # up to 2**48 bytes
            _SHIFTS.append(op)
            op = _square(op)
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(_SHIFTS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


#: The content hash that names a blob (see docs/format.md, "Blobs").
CONTENT_HASH = "xxh3-128"


def _xxhash() -> Any:
    try:
        import xxhash
    except ImportError as exc:  # a dependency; this says what to do if it was left out
        raise ImportError("incremental saves need the xxhash package: pip install xxhash") from exc
    return xxhash


def content_hash(data: memoryview | bytes) -> str:
    """The 128-bit xxh3 hash of ``data``, as the 32 lowercase hex digits that name its
    blob. Releases the GIL; ~8-30 GB/s, faster than the crc32c the entry carries too."""
    digest: str = _xxhash().xxh3_128_hexdigest(data)
    return digest


def content_hasher() -> Any:
    """``content_hash`` of bytes fed in pieces: ``update(piece)``, then ``hexdigest()``."""
    return _xxhash().xxh3_128()


def is_content_hash(name: object) -> bool:
    """Whether ``name`` is a blob name: exactly 32 lowercase hex digits."""
    return isinstance(name, str) and len(name) == 32 and not name.strip("0123456789abcdef")
