"""Hostile checkpoint files behind valid checksums: what a malicious or buggy writer can
produce, so that only the reader's own checks stand between the file and the caller.

A file is parsed into its safetensors header, its aiosnap metadata and its data
section; after edits it is rendered again, its header checksum sealed and, if asked,
every tensor checksum recomputed from the data. The fuzzer (tests/fuzz.py) builds on
these pieces, and ``headers_both_ways`` reads a header by both of the reader's ways.

White-box: this is the header codec's own business (its keys, its seal, its two ways of
reading), so it imports aiosnap's private modules.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiosnap._base.checksums import crc32c
from aiosnap._format import codec
from aiosnap._format.header import CRC_KEY, CRC_ZERO, META_KEY
from aiosnap.storage import LocalStorage


class Raw(str):
    """JSON text to put in the metadata as it is (too deep for json.dumps to write)."""


class Pairs(list[tuple[str, Any]]):
    """A JSON object as its (key, value) pairs: keys may repeat, as no dict's can."""


_PLACEHOLDER = "\u0000raw\u0000"


def dumps(value: Any) -> str:
    """``json.dumps`` (compact), with every Raw string inside put in verbatim and every
    Pairs written as an object, duplicate keys and all."""
    raws: list[str] = []

    def swap(v: Any) -> Any:
        if isinstance(v, Raw):
            raws.append(v)
            return _PLACEHOLDER
        if isinstance(v, Pairs):
            raws.append("{" + ",".join(f"{json.dumps(k)}:{dumps(x)}" for k, x in v) + "}")
            return _PLACEHOLDER
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(value), separators=(",", ":"))
    if not raws:
        return text
    pieces = text.split(json.dumps(_PLACEHOLDER))
    assert len(pieces) == len(raws) + 1
    return "".join(p + r for p, r in zip(pieces, [*raws, ""], strict=True))


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


def tensor_crcs(meta: Any, header: dict[str, Any], data: bytes) -> None:
    """Set the checksum of every entry ``meta`` describes to that of its bytes, where
    the metadata and the entry still have the shape to say which bytes those are."""
    if not isinstance(meta, dict) or not isinstance(meta.get("tensors"), dict):
        return
    for name, described in meta["tensors"].items():
        entry = header.get(name) if isinstance(name, str) else None
        if not isinstance(described, dict) or not isinstance(entry, dict):
            continue
        offsets = entry.get("data_offsets")
        if (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(v) is int for v in offsets)
            and 0 <= offsets[0] <= offsets[1] <= len(data)
        ):
            described["crc32c"] = f"{crc32c(data[offsets[0] : offsets[1]]):08x}"


def seal(raw: bytes) -> bytes:
    """``raw`` (length prefix and header) with its header checksum filled in, if the
    header has the place for one."""
    needle = f'"{CRC_KEY}":"{CRC_ZERO}"'.encode()
    at = raw.find(needle)
    if at < 0:
        return raw
    at += len(CRC_KEY) + 4
    return raw[:at] + f"{crc32c(raw):08x}".encode() + raw[at + 8 :]


def render(parts: Parts, *, recompute_tensor_crcs: bool = False) -> bytes:
    """The file of ``parts`` with a valid header checksum (and tensor checksums, if asked
    and the metadata still has the shape to hold them)."""
    if recompute_tensor_crcs:
        tensor_crcs(parts.meta, parts.header, parts.data)
    metadata = {META_KEY: dumps(parts.meta), CRC_KEY: CRC_ZERO}
    text = json.dumps({"__metadata__": metadata, **parts.header}, separators=(",", ":")).encode()
    return seal(struct.pack("<Q", len(text)) + text) + parts.data


def headers_both_ways(path: Path) -> tuple[Any, Any, bool]:
    """The header of a file as read (and whether the shortcut for files as aiosnap
    writes them took it), and as the general parse reads it."""
    f = LocalStorage().open_read(str(path))
    try:
        return (
            codec.read_header(f),
            codec.read_header(f, shortcut=False),
            codec.read_written_header(f) is not None,
        )
    finally:
        f.close()
