"""Hostile checkpoint files behind valid checksums: what a malicious or buggy writer can
produce, so that only the reader's own checks stand between the file and the caller.

A file is parsed into its safetensors header, its aiosnap metadata and its data
section; after edits it is rendered again, its header checksum sealed and, if asked,
every tensor checksum recomputed from the data.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from aiosnap._header import CRC_KEY, META_KEY, crc32c


class Raw(str):
    """JSON text to put in the metadata as it is (too deep for json.dumps to write)."""


_PLACEHOLDER = "\u0000raw\u0000"


def _dumps(value: Any) -> str:
    """``json.dumps``, with every Raw string inside put in verbatim."""
    raws: list[Raw] = []

    def swap(v: Any) -> Any:
        if isinstance(v, Raw):
            raws.append(v)
            return _PLACEHOLDER
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(value), separators=(",", ":"))
    for raw in raws:
        text = text.replace(json.dumps(_PLACEHOLDER), raw, 1)
    return text


@dataclass
class Parts:
    header: dict[str, Any]  # the safetensors header, without __metadata__
    meta: Any  # the aiosnap metadata (any JSON value, once edited)
    data: bytes  # the data section


def parse(raw: bytes) -> Parts:
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = json.loads(header.pop("__metadata__")[META_KEY])
    return Parts(header, meta, raw[8 + n :])


def render(parts: Parts, *, recompute_tensor_crcs: bool = False) -> bytes:
    """The file of ``parts`` with a valid header checksum (and tensor checksums, if asked
    and the metadata still has the shape to hold them)."""
    meta = parts.meta
    if recompute_tensor_crcs and isinstance(meta, dict) and isinstance(meta.get("tensors"), dict):
        for name, described in meta["tensors"].items():
            entry = parts.header.get(name)
            if isinstance(described, dict) and isinstance(entry, dict):
                try:
                    start, end = entry["data_offsets"]
                    described["crc32c"] = f"{crc32c(parts.data[start:end]):08x}"
                except (KeyError, TypeError, ValueError):
                    pass
    metadata = {META_KEY: _dumps(meta), CRC_KEY: "00000000"}
    text = json.dumps({"__metadata__": metadata, **parts.header}, separators=(",", ":")).encode()
    raw = struct.pack("<Q", len(text)) + text
    at = raw.index(f'"{CRC_KEY}":"00000000"'.encode()) + len(CRC_KEY) + 4
    sealed = raw[:at] + f"{crc32c(raw):08x}".encode() + raw[at + 8 :]
    return sealed + parts.data
