"""A structured fuzzer for the reader, behind the checksums (issue 10).

Random bit flips are caught by the checksums, so the fuzzer mutates behind them: it
takes valid seed files apart (safetensors entries, ``__metadata__``, the aiosnap
document, the data section), mutates 1-3 things in them (entries, dtypes, shapes,
offsets, tree nodes, the document, the ``external`` entries, the data, the length
prefix and padding, huge headers) and renders the file again with a valid header
checksum, and valid tensor checksums after data mutations. Each case is read by
``load``, ``load`` with ``keys=``, ``load_into`` and ``verify``: any exception that is
not a CheckpointError is a finding. Group manifests (re-sealed with a valid crc32c)
and the index file are fuzzed the same way (``manifest`` and ``index`` cases).

Case ``i`` of a kind draws everything from its own ``random.Random``, so a case is
reproduced by its kind and number alone (``-v`` prints each case's mutations and the
traceback of each finding)::

    PYTHONPATH=src python -m tests.fuzz checkpoint:1234:1 -v
    PYTHONPATH=src python -m tests.fuzz checkpoint:0:100000 manifest:0:20000 index:0:2000

The runner is meant for a child process (tests/test_fuzz.py starts it): it limits its
own address space with RLIMIT_AS, times each case against the unmutated seeds, and
watches for any unpickling (an audit hook) and for the planted pickle's marker file.
It prints one JSON report on stdout.

White-box: the fuzzer builds its mutations from the format's own pieces (the header's keys
and seal, the codec's limits, dtypes, tree tags, the manifest and the index), so it imports
aiosnap's private modules.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import ctypes
import functools
import gc
import json
import math
import os
import pickle
import random
import resource
import shutil
import statistics
import struct
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

import aiosnap
from aiosnap._base import json as _json
from aiosnap._base.checksums import crc32c
from aiosnap._base.json import WINDOW
from aiosnap._format.codec import MAX_HEADER, read_header, st_entry
from aiosnap._format.dtypes import ST_BITS, TORCH_DTYPES
from aiosnap._format.header import CRC_KEY, CRC_ZERO, META_KEY
from aiosnap._format.manifest import Manifest, read_manifest, replicated_matcher
from aiosnap._format.tree import LEAF_TAGS, MAX_DEPTH, ExternalLeaves
from aiosnap._load.load import Step, load_step
from aiosnap._manager.catalog import HISTORY_LIMIT
from aiosnap.storage import INDEX_NAME, MANIFEST_NAME

from . import hostile
from .hostile import Pairs, Raw

# -- seeds ---------------------------------------------------------------------------------


class Planted:
    """Pickles to a call of ``open(marker, "w")``: if a fuzzed file's pickle is ever
    unpickled, the marker file appears."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def _exotic(dtype: torch.dtype, n: int) -> torch.Tensor:
    """A tensor of a dtype torch cannot fill (uint3, float8_e8m0fnu ...): bytes viewed."""
    return torch.arange(n, dtype=torch.uint8).view(dtype)


def dtypes_state() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        c32 = torch.zeros(2, dtype=torch.complex32)
    return {
        "f32": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "bf16": torch.arange(4, dtype=torch.bfloat16),
        "c64": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64),
        "c128": torch.tensor([1j], dtype=torch.complex128),
        "c32": c32,
        "bool": torch.tensor([True, False, True]),
        "u8": torch.arange(5, dtype=torch.uint8),
        "i64": torch.tensor(7),
        "empty": torch.zeros((0, 3), dtype=torch.float16),
        "u16": torch.tensor([1, 2, 65535], dtype=torch.uint16),
        "u3": _exotic(torch.uint3, 4),
        "f8": _exotic(torch.float8_e4m3fn, 4),
        "f8fnuz": _exotic(torch.float8_e5m2fnuz, 2),
        "e8m0": _exotic(torch.float8_e8m0fnu, 3),
        "fp4": _exotic(torch.float4_e2m1fn_x2, 2),
        "bits": _exotic(torch.bits8, 2),
    }


def numpy_state() -> dict[str, Any]:
    return {
        "f4": np.arange(4, dtype="<f4"),
        "be": np.arange(3, dtype=">f8"),
        "i2": np.arange(6, dtype="<i2").reshape(3, 2),
        "b1": np.array([True, False]),
        "c16": np.array([1 + 1j], dtype="<c16"),
        "f16": np.zeros(2, dtype=np.longdouble),
        "u1": np.arange(3, dtype=np.uint8),
        "scalar": np.float64(1.5),
        "scalar_be": np.array(7, dtype=">i4")[()],
        "flag": np.bool_(True),
    }


def containers_state() -> dict[Any, Any]:
    tied = torch.arange(3.0)
    return {
        "tuple": (1, "two", None, (3.5, [])),
        "keys": {1: "int", 2.5: "float", float("nan"): "nan", None: "none", False: "bool", "": "empty"},
        "floats": [float("inf"), -float("inf"), float("nan"), -0.0, 1e308],
        "bytes": b"\x00\xffbytes",
        "tied": {"a": tied, "b": tied},
        "mixed": (torch.ones(2), 5),  # a tuple holding a tensor and a plain value
        "nested": [[1, [2, [3, {"deep": torch.zeros(1)}]]], "é\u2028\U0001f600"],
        "size": torch.Size([2, 3]),
        "step": 7,
    }


def module_state() -> dict[str, Any]:
    model = torch.nn.Linear(3, 2)  # not torch.manual_seed: it costs 2 ms (it asks every device)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6.0).reshape(2, 3))
        model.bias.copy_(torch.ones(2))
    return {"model": model, "lr": 0.1, "arr": np.arange(2)}


def external_state() -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(4.0).reshape(2, 2), "n": np.arange(3), "s": np.int16(5)},
        "mine": torch.ones(2),
    }


@dataclass
class Seed:
    """One valid file to mutate, and what to read it with."""

    name: str
    raw: bytes
    keys: list[str]  # dotted keys for load(keys=...)
    target: Callable[[], Any]  # a fresh target for load_into
    replicas: str | None = None  # the file of the replicated entries it refers to
    template: str = ""  # the header, taken apart, as JSON text (fast to copy)
    data: bytes = b""

    def __post_init__(self) -> None:
        (n,) = struct.unpack("<Q", self.raw[:8])
        header = json.loads(self.raw[8 : 8 + n])
        md = header.pop("__metadata__", _ABSENT)
        meta = json.loads(md[META_KEY]) if isinstance(md, dict) and META_KEY in md else _ABSENT
        if meta != _ABSENT:
            md = {**md, META_KEY: _META, CRC_KEY: CRC_ZERO}
        self.template = json.dumps({"st": header, "md": md, "meta": meta})
        self.data = self.raw[8 + n :]

    def doc(self) -> Doc:
        t = json.loads(self.template)
        return Doc(t["st"], t["md"], t["meta"], self.data)


def make_seeds(directory: Path, marker: str) -> list[Seed]:
    """The seed files, saved into ``directory``: every feature of the format."""
    seeds = []

    def saved(name: str, state: Any, **kwargs: Any) -> bytes:
        path = str(directory / f"seed_{name}")
        aiosnap.save_sync(path, state, **kwargs)
        return Path(path).read_bytes()

    seeds.append(Seed("dtypes", saved("dtypes", dtypes_state()), ["f32", "bf16", "u3"], dtypes_state))
    seeds.append(Seed("numpy", saved("numpy", numpy_state()), ["be", "scalar"], numpy_state))
    seeds.append(
        Seed(
            "containers",
            saved("containers", containers_state()),
            ["tied", "mixed.0", "keys"],
            containers_state,
        )
    )
    seeds.append(Seed("module", saved("module", module_state()), ["model.weight", "arr"], module_state))

    def pickled() -> dict[str, Any]:
        return {"evil": Planted(marker), "w": torch.arange(3.0), "n": 1}

    seeds.append(Seed("pickle", saved("pickle", pickled(), allow_pickle=True), ["w", "evil"], pickled))
    replicas = str(directory / "seed_replicas")
    aiosnap.save_sync(replicas, external_state())
    matcher = replicated_matcher(["model"])
    seeds.append(
        Seed(
            "external",
            saved("external", ExternalLeaves(external_state(), matcher)),
            ["mine", "model.w"],
            external_state,
            replicas,
        )
    )
    plain = str(directory / "seed_plain")
    save_file({"a": torch.arange(4.0), "b": torch.ones(2, 2, dtype=torch.int32)}, plain, metadata={"x": "y"})

    def plain_state() -> dict[str, Any]:
        return {"a": torch.zeros(4), "b": torch.zeros(2, 2, dtype=torch.int32)}

    seeds.append(Seed("safetensors", Path(plain).read_bytes(), ["a"], plain_state))
    return seeds


# -- the document of one case --------------------------------------------------------------

_ABSENT: Any = "\u0000absent\u0000"  # a JSON-able sentinel: the template is JSON text
_META = "\u0000meta\u0000"  # in __metadata__: the aiosnap document goes here, rendered


@dataclass
class Doc:
    """A file taken apart: safetensors entries, ``__metadata__``, aiosnap document, data."""

    st: dict[str, Any]
    md: Any  # __metadata__ (or _ABSENT); its "aiosnap" value _META is the rendered ``meta``
    meta: Any  # the aiosnap document (or _ABSENT: a plain safetensors file)
    data: bytes
    recompute: bool = False  # recompute the tensor checksums from the data
    pad: bytes = b""  # after the JSON header, inside the length the prefix gives
    md_at: int = 0  # where __metadata__ goes among the entries
    extra: list[tuple[str, str]] = field(default_factory=list)  # more (key, JSON text) members
    post: list[Callable[[bytes], bytes]] = field(default_factory=list)  # on the sealed file

    # Helpers the mutations share.
    def described(self) -> dict[str, Any] | None:
        if isinstance(self.meta, dict) and isinstance(self.meta.get("tensors"), dict):
            return self.meta["tensors"]  # type: ignore[no-any-return]
        return None

    def blob(self, name: str) -> bytes:
        offsets = self.st.get(name, {}).get("data_offsets") if isinstance(self.st.get(name), dict) else None
        if isinstance(offsets, list) and len(offsets) == 2 and all(type(v) is int for v in offsets):
            return self.data[offsets[0] : offsets[1]]
        return b""

    def relayout(self, blobs: dict[str, bytes]) -> None:
        """Lay the entries out contiguously, in their order, with these bytes."""
        pos, data = 0, []
        for name, entry in self.st.items():
            b = blobs.get(name, b"")
            if isinstance(entry, dict):
                entry["data_offsets"] = [pos, pos + len(b)]
            data.append(b)
            pos += len(b)
        self.data = b"".join(data)
        self.recompute = True

    def tree(self) -> Any:
        return self.meta.get("tree") if isinstance(self.meta, dict) else None


def render(doc: Doc, *, special: bool) -> bytes:
    if doc.recompute:
        hostile.tensor_crcs(doc.meta, doc.st, doc.data)
    md = doc.md
    if isinstance(md, dict) and md.get(META_KEY) == _META:
        text = hostile.dumps(doc.meta) if special else json.dumps(doc.meta, separators=(",", ":"))
        md = {**md, META_KEY: text}
    dump = hostile.dumps if special else (lambda v: json.dumps(v, separators=(",", ":")))
    members = [f"{json.dumps(k)}:{dump(v)}" for k, v in doc.st.items()]
    if md != _ABSENT:
        members.insert(min(doc.md_at, len(members)), f'"__metadata__":{dump(md)}')
    members += [f"{json.dumps(k)}:{v}" for k, v in doc.extra]
    text = ("{" + ",".join(members) + "}").encode("utf-8", "surrogatepass")
    raw = hostile.seal(struct.pack("<Q", len(text) + len(doc.pad)) + text + doc.pad) + doc.data
    for transform in doc.post:
        raw = transform(raw)
    return raw


# -- values a hostile writer might put anywhere ----------------------------------------------

ODD_STRINGS = [
    "",
    " ",
    "a",
    "é",
    "\x00",
    "\ud800",
    "\udfff",
    "\udc80x",
    "\U0001f600",
    "\u202e",
    "\\",
    '"',
    "\n",
    "a.b",
    "__metadata__",
    "#2",
    "\uffff",
    "$",
    "n",
    "x" * 300,
    "tensor",
    "0",
    "-1",
    "../../etc/passwd",
    "/abs",
    ".hidden",
]
DTYPE_NAMES: list[Any] = [
    *TORCH_DTYPES,
    "<f4",
    ">f8",
    "|b1",
    "|u1",
    "<c16",
    "<f16",
    "|i1",
    "<i8",
    ">i4",
    "<U1",
    "|O",
    "<M8",
    "|V4",
    "|S1",
    "=f8",
    "f4",
    "float",
    "|V0",
    "<U0",
    "torch.float32",
    "object",
    "",
    "F32",
    "\x00",
    "(2,)f4",
    "f4,i4",
    "i99999999999999999999",
    "\ud800",
    1,
    None,
    ["float32"],
    {"a": 1},
    True,
]
ST_CODES: list[Any] = [
    *ST_BITS,
    "F128",
    "u8",
    "",
    "U8 ",
    "f32",
    1,
    None,
    ["F32"],
    {"F32": 1},
    True,
    "\ud800",
]
KINDS: list[Any] = [
    "tensor",
    "ndarray",
    "npscalar",
    "pickle",
    "float",
    "dict",
    "bytes",
    "",
    None,
    1,
    ["tensor"],
]
BIG_INTS = [2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**100, -(2**63), 10**30]


def junk(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value of any type."""
    r = rng.random()
    if depth > 2 or r < 0.55:
        return rng.choice(
            [
                None,
                True,
                False,
                0,
                1,
                -1,
                rng.choice(BIG_INTS),
                1.5,
                -0.0,
                float("nan"),
                float("inf"),
                1e308,
                rng.choice(ODD_STRINGS),
                rng.choice(DTYPE_NAMES),
                "{}",
                "[]",
            ]
        )
    if r < 0.75:
        return [junk(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if r < 0.85:
        return {rng.choice(ODD_STRINGS): junk(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return {
        "$": rng.choice(["dict", "tuple", "float", "bytes", "tensor", "x", 1, None, ["dict"]]),
        "v": junk(rng, 3),
    }


def shape_value(rng: random.Random, shape: Any) -> Any:
    """A hostile shape: negative, huge, zero, the wrong rank or product, not ints."""
    base = shape if isinstance(shape, list) else [1]
    choices: list[Callable[[], Any]] = [
        lambda: [-1],
        lambda: [2**62],
        lambda: [2**62, 2**62],
        lambda: [0, 2**62],
        lambda: [0, 2**64],
        lambda: [0, 2**63 - 1, 2**63 - 1],
        lambda: [2**63],
        lambda: [0],
        lambda: [],
        lambda: [*base, 1],
        lambda: [*base, 2],
        lambda: base[:-1],
        lambda: [x * 2 for x in base if type(x) is int],
        lambda: [1.0],
        lambda: [True],
        lambda: [[2]],
        lambda: ["3"],
        lambda: None,
        lambda: "3",
        lambda: 3,
        lambda: {"0": 1},
        lambda: [1] * rng.choice([100, 10_000]),
        lambda: [float("nan")],
        lambda: [-(2**63)],
        lambda: Raw(
            "[" + ",".join(["9" * rng.choice([19, 100, 4000])] * rng.choice([1, 1, 50, 50, 100])) + "]"
        ),
        lambda: Raw("[1e400]"),
        lambda: Raw("[-0]"),
        lambda: Raw("[1E2]"),
    ]
    return rng.choice(choices)()


def _choose(rng: random.Random, items: list[Any]) -> Any:
    return rng.choice(items) if items else None


# -- mutations of a checkpoint file -------------------------------------------------------


class Edit:
    """A mutation context: the document, its seed, and whether JSON needs hostile.dumps."""

    def __init__(self, rng: random.Random, doc: Doc, seed: Seed, marker: str) -> None:
        self.rng, self.doc, self.seed, self.marker = rng, doc, seed, marker
        self.special = False  # Raw or Pairs inside: render through hostile.dumps

    def mark(self, value: Any) -> Any:
        if isinstance(value, (Raw, Pairs)):
            self.special = True
        return value

    def name(self) -> str | None:
        names = [n for n in self.doc.st if n != "__metadata__"]
        return _choose(self.rng, names)

    def desc(self) -> tuple[str, dict[str, Any]] | None:
        described = self.doc.described()
        if not described:
            return None
        name = self.rng.choice(list(described))
        d = described[name]
        return (name, d) if isinstance(d, dict) else None


def m_desc_field(c: Edit) -> str:
    """Change, remove or add keys of a tensor's description."""
    found = c.desc()
    if found is None:
        return "no description"
    name, d = found
    key = c.rng.choice(["kind", "dtype", "shape", "crc32c", "extra", "kind", "dtype"])
    action = c.rng.random()
    if action < 0.15:
        d.pop(key, None)
        return f"desc {name!r}: delete {key}"
    pools: dict[str, list[Any]] = {
        "kind": KINDS,
        "dtype": DTYPE_NAMES,
        "shape": [shape_value(c.rng, d.get("shape"))],
        "crc32c": ["ABCDEF01", "0000000", "000000000", 12345678, None, "zzzzzzzz", " 0000000", "+0000000"],
        "extra": [junk(c.rng)],
    }
    d[key] = c.mark(c.rng.choice(pools[key]) if action < 0.8 else junk(c.rng))
    return f"desc {name!r}: {key} = {d[key]!r:.60}"


def _dtype_choices(nbytes: int) -> list[tuple[str, str, int]]:
    """(kind, dtype, itemsize) that can describe ``nbytes`` bytes."""
    out = []
    for name, dt in TORCH_DTYPES.items():
        if dt.itemsize and nbytes % dt.itemsize == 0:
            out.append(("tensor", name, dt.itemsize))
    for s in ("<f4", ">f8", "|b1", "|u1", "<c16", "<f16", "|i1", "<i2", ">u2", "<c8", ">c8"):
        size = np.dtype(s).itemsize
        if nbytes % size == 0:
            out.append(("ndarray", s, size))
            if nbytes == size:
                out.append(("npscalar", s, size))
    if nbytes:
        out.append(("pickle", "|u1", 1))
    return out


def _factor(rng: random.Random, n: int) -> list[int]:
    """A random shape of ``n`` elements."""
    if n == 0:
        return rng.choice([[0], [0, 3], [2, 0], [0, 0, 0]])
    shape, left = [], n
    for d in range(2, min(n, 1000) + 1):  # small factors only: n may be huge
        while left % d == 0 and rng.random() < 0.6:
            shape.append(d)
            left //= d
    if left > 1:
        shape.append(left)
    if rng.random() < 0.3:
        shape.insert(rng.randint(0, len(shape)), 1)
    rng.shuffle(shape)
    return shape


def _set_tags(c: Edit, name: str, tag: str) -> None:
    """Point every leaf reference to ``name`` at the tag ``tag`` (a coherent change of kind)."""
    for node in _nodes(c.doc.tree()):
        if (
            isinstance(node, dict)
            and node.get("n") == name
            and node.get("$") in ("tensor", "ndarray", "npscalar", "pickle")
        ):
            node["$"] = tag


def m_entry_field(c: Edit) -> str:
    """Change, remove or add keys of a safetensors entry, or replace the entry."""
    name = c.name()
    if name is None:
        return "no entry"
    entry = c.doc.st[name]
    if not isinstance(entry, dict) or c.rng.random() < 0.1:
        c.doc.st[name] = value = junk(c.rng)
        return f"entry {name!r} = {value!r:.60}"
    key = c.rng.choice(["dtype", "dtype", "shape", "data_offsets", "extra"])
    if c.rng.random() < 0.15:
        entry.pop(key, None)
        return f"entry {name!r}: delete {key}"
    pools: dict[str, list[Any]] = {
        "dtype": ST_CODES,
        "shape": [shape_value(c.rng, entry.get("shape"))],
        "data_offsets": [[0, 0], [], None, "0", [0, 1, 2]],
        "extra": [junk(c.rng)],
    }
    entry[key] = c.mark(c.rng.choice(pools[key]) if c.rng.random() < 0.8 else junk(c.rng))
    return f"entry {name!r}: {key} = {entry[key]!r:.60}"


def m_coherent_dtype(c: Edit) -> str:
    """Redescribe an entry's bytes as another kind/dtype/shape, consistently on both sides,
    so it passes the parser's cross-checks (a pickle made an array, an array a tensor ...)."""
    found = c.desc()
    if found is None:
        return "no description"
    name, d = found
    nbytes = len(c.doc.blob(name))
    choices = _dtype_choices(nbytes)
    if not choices:
        return "no dtype fits"
    kind, dtype, size = c.rng.choice(choices)
    shape = [] if kind == "npscalar" else [nbytes] if kind == "pickle" else _factor(c.rng, nbytes // size)
    if kind == "tensor" and c.rng.random() < 0.2:
        shape = []  # a 0-d tensor: only fits one element
        if nbytes != size:
            shape = [nbytes // size]
    d.update(kind=kind, dtype=dtype, shape=shape)
    code, st_shape = st_entry(kind, dtype, tuple(shape), nbytes)
    entry = c.doc.st.get(name)
    if isinstance(entry, dict):
        entry.update(dtype=code, shape=st_shape)
    if c.rng.random() < 0.8:
        _set_tags(c, name, kind)
    return f"{name!r} is now {kind} {dtype} {shape}"


def m_shape(c: Edit) -> str:
    """A hostile shape on one side or both."""
    name = c.name()
    if name is None:
        return "no entry"
    value = c.mark(
        shape_value(c.rng, c.doc.st[name].get("shape") if isinstance(c.doc.st[name], dict) else None)
    )
    sides = c.rng.choice(["st", "desc", "both"])
    entry, described = c.doc.st[name], c.doc.described() or {}
    if sides in ("st", "both") and isinstance(entry, dict):
        entry["shape"] = value
    if sides in ("desc", "both") and isinstance(described.get(name), dict):
        described[name]["shape"] = value
    return f"shape of {name!r} ({sides}) = {value!r:.60}"


def m_reshape(c: Edit) -> str:
    """The same bytes as another shape of the same size, consistently: still valid."""
    found = c.desc()
    if found is None:
        return "no description"
    name, d = found
    shape = d.get("shape")
    if not isinstance(shape, list) or not all(type(x) is int for x in shape) or d.get("kind") != "tensor":
        return "not reshapable"
    new = _factor(c.rng, math.prod(shape))
    d["shape"] = new
    entry = c.doc.st.get(name)
    if isinstance(entry, dict) and isinstance(d.get("dtype"), str):
        _, st_shape = st_entry("tensor", d["dtype"], tuple(new), len(c.doc.blob(name)))
        entry["shape"] = st_shape
    return f"reshape {name!r} to {new}"


def m_offsets(c: Edit) -> str:
    """Offsets that overlap, leave gaps, pass the end, run backwards, are huge or not ints;
    or two entries swapped consistently (their bytes too)."""
    name = c.name()
    if name is None or not isinstance(c.doc.st[name], dict):
        return "no entry"
    entry = c.doc.st[name]
    size = len(c.doc.data)
    old = entry.get("data_offsets")
    ints = isinstance(old, list) and len(old) == 2 and all(type(v) is int for v in old)
    s, e = old if ints else (0, 0)
    action = c.rng.randrange(4)
    if action == 0 and len(c.doc.st) >= 2:
        other = c.rng.choice([n for n in c.doc.st if n != name])
        blobs = {n: c.doc.blob(n) for n in c.doc.st}
        keys = list(c.doc.st)
        i, j = keys.index(name), keys.index(other)
        keys[i], keys[j] = keys[j], keys[i]
        c.doc.st = {k: c.doc.st[k] for k in keys}
        c.doc.relayout(blobs)
        return f"swap the bytes of {name!r} and {other!r}"
    choices: list[Any] = [
        [s, e + 1],
        [s + 1, e + 1],
        [s - 1, e - 1],
        [e, s],
        [0, e - s],
        [size, size + e - s],
        [s, s],
        [2**62, 2**62 + e - s],
        [2**64 - 1, 2**64 - 1 + e - s],
        [-(e - s), 0],
        [s],
        [s, e, e],
        [float(s), float(e)],
        [str(s), e],
        [True, e],
        None,
        {"0": s},
        [s + size, e + size],
        [0, 2**63],
    ]
    entry["data_offsets"] = value = c.rng.choice(choices)
    if c.rng.random() < 0.3:  # and make the size consistent with the bytes they claim
        c.doc.data += bytes(max(0, min(64, c.rng.choice([1, 4, 16]))))
    return f"offsets of {name!r} = {value!r}"


def _rename_in_tree(tree: Any, old: str, new: str) -> None:
    for node in _nodes(tree):
        if isinstance(node, dict) and node.get("n") == old:
            node["n"] = new


def m_rename(c: Edit) -> str:
    """Rename an entry everywhere (still valid), or on one side only."""
    name = c.name()
    if name is None:
        return "no entry"
    new = c.rng.choice([*ODD_STRINGS, name + "#9", name.upper()])
    if new in c.doc.st:
        return "name taken"
    where = c.rng.choice(["all", "all", "st", "desc", "tree"])
    if where in ("all", "st"):
        c.doc.st = {new if k == name else k: v for k, v in c.doc.st.items()}
    described = c.doc.described()
    if where in ("all", "desc") and described is not None and name in described:
        c.doc.meta["tensors"] = {new if k == name else k: v for k, v in described.items()}
    if where in ("all", "tree"):
        _rename_in_tree(c.doc.tree(), name, new)
    return f"rename {name!r} to {new!r} ({where})"


def m_duplicate(c: Edit) -> str:
    """An entry twice in the safetensors header, or twice in the aiosnap description."""
    name = c.name()
    if name is None:
        return "no entry"
    entry = c.doc.st[name]
    if c.rng.random() < 0.5:
        value = c.rng.choice(
            [entry, {**entry, "data_offsets": [0, 0]} if isinstance(entry, dict) else 1, junk(c.rng)]
        )
        c.doc.extra.append((name, json.dumps(value)))
        return f"duplicate safetensors entry {name!r}"
    described = c.doc.described()
    if described is None:
        return "no description"
    pairs = Pairs(described.items())
    pairs.insert(c.rng.randint(0, len(pairs)), (name, c.rng.choice([described.get(name), junk(c.rng)])))
    c.doc.meta["tensors"] = c.mark(pairs)
    return f"duplicate description of {name!r}"


def m_delete(c: Edit) -> str:
    """Delete an entry from one side, or from both with its bytes (the tree still refers to it)."""
    name = c.name()
    if name is None:
        return "no entry"
    where = c.rng.choice(["st", "desc", "both", "both"])
    described = c.doc.described()
    blobs = {n: c.doc.blob(n) for n in c.doc.st}
    if where in ("st", "both"):
        del c.doc.st[name]
    if where in ("desc", "both") and described is not None:
        described.pop(name, None)
    if where == "both":
        c.doc.relayout(blobs)
    return f"delete {name!r} ({where})"


def m_add(c: Edit) -> str:
    """Add a consistent entry of random kind, dtype and bytes; perhaps refer to it."""
    nbytes = c.rng.choice([0, 1, 2, 4, 8, 12, 16, 64])
    choices = _dtype_choices(nbytes)
    if not choices:
        return "no dtype fits"
    kind, dtype, size = c.rng.choice(choices)
    shape = [] if kind == "npscalar" else [nbytes] if kind == "pickle" else _factor(c.rng, nbytes // size)
    name = c.rng.choice([*ODD_STRINGS, "new", "new.x", "evil"])
    if name in c.doc.st or name == "__metadata__":
        return "name taken"
    blob = bytes(c.rng.getrandbits(8) for _ in range(nbytes))
    if kind == "pickle" and c.rng.random() < 0.5:
        blob = pickle.dumps(Planted(c.marker))
        shape, nbytes = [len(blob)], len(blob)
    code, st_shape = st_entry(kind, dtype, tuple(shape), nbytes)
    blobs = {n: c.doc.blob(n) for n in c.doc.st}
    blobs[name] = blob
    sides = c.rng.choice(["both", "both", "both", "st", "desc"])
    if sides in ("both", "st"):
        c.doc.st[name] = {"dtype": code, "shape": st_shape, "data_offsets": [0, 0]}
    described = c.doc.described()
    if sides in ("both", "desc") and described is not None:
        described[name] = {"kind": kind, "dtype": dtype, "shape": shape, "crc32c": CRC_ZERO}
    c.doc.relayout(blobs)
    tree = c.doc.tree()
    if c.rng.random() < 0.7 and tree is not None:
        _insert(c, {"$": c.rng.choice([kind, kind, "tensor", "pickle", "ndarray"]), "n": name})
    return f"add {kind} {dtype} {shape} as {name!r} ({sides})"


def _nodes(tree: Any) -> list[Any]:
    """Every container node of a tree, iteratively (the tree may be deep)."""
    out, stack = [], [tree]
    while stack and len(out) < 100_000:
        node = stack.pop()
        if isinstance(node, list):
            out.append(node)
            stack.extend(node)
        elif isinstance(node, dict):
            out.append(node)
            stack.extend(node.values())
    return out


def _insert(c: Edit, value: Any) -> str:
    """Put ``value`` somewhere in the tree: replace a node, or add to a container."""
    tree = c.doc.tree()
    if tree is None or not isinstance(c.doc.meta, dict):
        return "no tree"
    containers = [n for n in _nodes(tree) if isinstance(n, list) or (isinstance(n, dict) and n)]
    if not containers or c.rng.random() < 0.05:
        c.doc.meta["tree"] = value
        return "the whole tree"
    node = c.rng.choice(containers)
    if isinstance(node, list):
        if node and c.rng.random() < 0.6:
            node[c.rng.randrange(len(node))] = value
        else:
            node.insert(c.rng.randint(0, len(node)), value)
        return "list element"
    key = c.rng.choice(list(node))
    if key == "items" and isinstance(node[key], list) and c.rng.random() < 0.7:
        node[key].append([c.rng.choice(["k", "new", 1, None, 2.5]), value])
        return "dict item"
    node[key] = value
    return f"node field {key!r}"


def tree_node(c: Edit) -> Any:
    """A hostile tree node."""
    rng = c.rng
    names = list(c.doc.st) + list(c.doc.described() or {})
    name = rng.choice([*names, "missing", "", "\ud800"]) if names else "missing"
    big = rng.choice([100, 1000, 1000, 3000])
    choices: list[Callable[[], Any]] = [
        lambda: junk(rng),
        lambda: {"$": rng.choice(["tensor", "ndarray", "npscalar", "pickle"]), "n": name},
        lambda: {"$": rng.choice(["tensor", "ndarray", "npscalar", "pickle"]), "n": junk(rng)},
        lambda: {"$": rng.choice(["tensor", "pickle"])},
        lambda: {"$": junk(rng), "n": name},
        lambda: {"$": ["tensor"], "n": name},
        lambda: {"$": {"t": 1}, "v": []},
        lambda: {"$": rng.choice(["set", "frozenset", "complex", "", "$", "Tensor", "DICT"]), "v": []},
        lambda: {
            "$": "dict",
            "items": rng.choice([{}, "x", None, [1], [[1]], [[1, 2, 3]], [["k"]], [[[], 1]], [[{}, 1]]]),
        },
        lambda: {
            "$": "dict",
            "items": [[k, 1] for k in (None, True, 1, -0.0, 1.5, "a", {"$": "float", "v": "nan"})],
        },
        lambda: {
            "$": "dict",
            "items": [[{"$": "float", "v": rng.choice(["1.5", "NaN", 1, None, "inf"])}, 1]],
        },
        lambda: {"$": "dict", "items": [[{"$": "tensor", "n": name}, 1]]},
        lambda: {"$": "dict", "items": [[{"$": "bytes", "v": "AA=="}, 1]]},
        lambda: {"$": "dict", "items": [["k", 1], ["k", 2]]},
        lambda: {"$": "dict", "items": [[True, 1], [1, 2], [1.0, 3]]},
        lambda: {"$": "tuple", "v": rng.choice([{}, "abc", None, 1, [1, [2]]])},
        lambda: {"$": "tuple"},
        lambda: {"$": "float", "v": rng.choice(["nan", "inf", "-inf", "1.5", "NaN", "", 1.0, None])},
        lambda: {"$": "bytes", "v": rng.choice(["AA==", "A", "!!!!", "é", "", 7, None, "AA==\n", "=" * 8])},
        lambda: {"$": "bytes", "v": base64.b64encode(bytes(big)).decode()},
        lambda: {"$": "dict", "items": [[i, {"$": "tensor", "n": name}] for i in range(big)]},
        lambda: [{"$": "tensor", "n": name} for _ in range(big)],  # not [node] * big: aliases
        lambda: list(range(big)),
        lambda: {"$": "dict", "items": [[s, s] for s in ODD_STRINGS]},
        lambda: rng.choice(ODD_STRINGS) * rng.choice([1, 1000]),
        lambda: rng.choice(BIG_INTS),
        lambda: Raw("9" * rng.choice([20, 4300, 4301, 20_000])),
        lambda: Raw(
            rng.choice(["NaN", "Infinity", "-Infinity", "1e999", "-0", "1E-400", "0.0000000000000000001"])
        ),
        lambda: Raw('"\\ud800\\udc00\\udbff"'),
        lambda: Raw(rng.choice(['"\\u0000"', '"\\uDFFF"', '"\\/"', '"\\u00e9"'])),
        lambda: _nested(rng, rng.choice([MAX_DEPTH - 2, MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1, 150, 1000])),
    ]
    return c.mark(rng.choice(choices)())


def _nested(rng: random.Random, depth: int) -> Raw:
    """``depth`` containers of one kind, one inside the other, around a leaf."""
    opening, closing = rng.choice(
        [("[", "]"), ('{"$":"tuple","v":[', "]}"), ('{"$":"dict","items":[["k",', "]]}"), ('{"a":', "}")]
    )
    return Raw(opening * depth + rng.choice(["1", '{"$":"tensor","n":"missing"}', "[]"]) + closing * depth)


def m_tree(c: Edit) -> str:
    """A hostile node somewhere in the tree."""
    where = _insert(c, tree_node(c))
    return f"tree node at {where}"


def _slots(tree: Any) -> list[tuple[Any, Any]]:
    """Every place in a tree that holds a node: (list, index) or (dict node, key), as the
    reader walks it (list elements, dict item values, tuple elements)."""
    out: list[tuple[Any, Any]] = []
    stack = [tree]
    while stack and len(out) < 100_000:
        node = stack.pop()
        children: list[tuple[Any, Any]] = []
        if isinstance(node, list):
            children = [(node, i) for i in range(len(node))]
        elif isinstance(node, dict) and node.get("$") == "dict" and isinstance(node.get("items"), list):
            children = [(p, 1) for p in node["items"] if isinstance(p, list) and len(p) == 2]
        elif isinstance(node, dict) and node.get("$") == "tuple" and isinstance(node.get("v"), list):
            children = [(node["v"], i) for i in range(len(node["v"]))]
        out.extend(children)
        stack.extend(parent[key] for parent, key in children)
    return out


def m_graft(c: Edit) -> str:
    """A subtree copied over, or swapped with, another: leaves where plain values were,
    containers where leaves were, the same entry twice."""
    slots = _slots(c.doc.tree())
    if len(slots) < 2:
        return "no slots"
    (pa, ka), (pb, kb) = c.rng.sample(slots, 2)
    a, b = pa[ka], pb[kb]
    if c.rng.random() < 0.5:
        pa[ka] = json.loads(json.dumps(b))
        return f"{b!r:.40} copied over {a!r:.40}"
    if any(x is b for x in _nodes(a)) or any(x is a for x in _nodes(b)):
        return "nested"
    pa[ka], pb[kb] = b, a
    return f"{a!r:.40} swapped with {b!r:.40}"


def leaf_refs(tree: Any) -> list[tuple[str, str]]:
    """(tag, name) of every leaf reference the reader would resolve."""
    refs = []
    for parent, key in [(None, None), *_slots(tree)]:
        node = tree if parent is None else parent[key]
        if isinstance(node, dict) and node.get("$") in tuple(LEAF_TAGS) and isinstance(node.get("n"), str):
            refs.append((node["$"], node["n"]))
    return refs


def m_leaf_tag(c: Edit) -> str:
    """A leaf reference's tag changed, or pointed at another entry (of the wrong kind)."""
    leaves = [n for n in _nodes(c.doc.tree()) if isinstance(n, dict) and "n" in n]
    if not leaves:
        return "no leaf"
    leaf = c.rng.choice(leaves)
    if c.rng.random() < 0.5:
        leaf["$"] = c.rng.choice(["tensor", "ndarray", "npscalar", "pickle", "bytes", "float"])
    else:
        leaf["n"] = c.rng.choice([*c.doc.st, "missing"])
    return f"leaf now {leaf!r:.60}"


def m_document(c: Edit) -> str:
    """The document or its parts replaced: version, tensors, tree, checksum, other keys."""
    rng = c.rng
    if not isinstance(c.doc.meta, dict) or rng.random() < 0.1:
        c.doc.meta = junk(rng)
        return f"document = {c.doc.meta!r:.60}"
    key = rng.choice(["version", "version", "tensors", "tree", "checksum", "other", "external"])
    if rng.random() < 0.2:
        c.doc.meta.pop(key, None)
        return f"document: delete {key}"
    versions = [0, 2, "1", 1.0, True, None, -1, 2**64, [1], Raw("1.0"), Raw("1e0"), Raw("1E0"), Raw("01")]
    c.doc.meta[key] = value = c.mark(rng.choice(versions) if key == "version" else junk(rng))
    return f"document: {key} = {value!r:.60}"


def m_external(c: Edit) -> str:
    """The ``external`` map: wrong types, stored names, pickles, huge shapes, refs to it."""
    rng = c.rng
    if not isinstance(c.doc.meta, dict):
        return "no document"
    ext = c.doc.meta.get("external")
    if not isinstance(ext, dict) or rng.random() < 0.15:
        c.doc.meta["external"] = ext = rng.choice([{}, [], None, "x", 1, junk(rng)])
        if not isinstance(ext, dict):
            return f"external = {ext!r:.60}"
    name = rng.choice([*ext, "ext", *c.doc.st][:8] or ["ext"])
    action = rng.random()
    if action < 0.2:
        ext.pop(name, None)
        return f"external: delete {name!r}"
    d = ext.get(name)
    if action < 0.6 or not isinstance(d, dict):
        kind, dtype, _ = rng.choice(_dtype_choices(8))
        d = {"kind": kind, "dtype": dtype, "shape": [] if kind == "npscalar" else [rng.choice([2, 0, 1])]}
    key = rng.choice(["kind", "dtype", "shape", "extra", "none"])
    if key == "shape":
        d["shape"] = c.mark(shape_value(rng, d.get("shape")))
    elif key != "none":
        d[key] = rng.choice(KINDS if key == "kind" else DTYPE_NAMES if key == "dtype" else [junk(rng)])
    ext[name] = d
    if rng.random() < 0.5:
        _insert(c, {"$": d.get("kind") if rng.random() < 0.7 else "tensor", "n": name})
    return f"external {name!r} = {d!r:.80}"


def m_metadata(c: Edit) -> str:
    """``__metadata__`` itself: its keys, the header checksum, the document's text, its place."""
    rng = c.rng
    md = c.doc.md
    action = rng.randrange(9)
    if action == 0 or not isinstance(md, dict):
        c.doc.md = rng.choice([None, [], "x", 1, {}, {"format": "pt"}, junk(rng)])
        return f"__metadata__ = {c.doc.md!r:.40}"
    if action == 1:
        md.pop(META_KEY, None)  # a plain safetensors file now
        return "no aiosnap document"
    if action == 2:
        md.pop(CRC_KEY, None)
        return "no header checksum"
    if action == 3:
        md[CRC_KEY] = rng.choice(["0000000", 12345678, None, "00000000 ", "zzzzzzzz", "ABCDEF01"])
        return f"header checksum = {md[CRC_KEY]!r}"
    if action == 4:
        md[rng.choice(ODD_STRINGS)] = rng.choice(["x", 1, None, [], CRC_ZERO, f'"{CRC_KEY}":"{CRC_ZERO}"'])
        return "another __metadata__ key"
    if action == 5:
        md[META_KEY] = rng.choice(
            [
                "",
                "{",
                "[]",
                "null",
                "1",
                '"x"',
                "{}",
                '{"version":1}',
                "\ud800",
                '{"tensors":{},"version":1}x',
            ]
        )
        return f"document text = {md[META_KEY]!r}"
    if action == 6:
        c.doc.md_at = rng.randint(0, len(c.doc.st))
        return f"__metadata__ at {c.doc.md_at}"
    if action == 7:
        c.doc.extra.append(("__metadata__", json.dumps(rng.choice([md, {}, {"x": "y"}]))))
        return "__metadata__ twice"
    c.doc.extra.append((CRC_KEY, json.dumps(CRC_ZERO)))
    return "the checksum's key as an entry"


def m_data(c: Edit) -> str:
    """Bytes of the data section changed, tensor checksums recomputed: valid but arbitrary
    values (arbitrary pickles too, which must never be unpickled)."""
    rng = c.rng
    if not c.doc.data:
        return "no data"
    data = bytearray(c.doc.data)
    action = rng.randrange(4)
    if action == 0:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.getrandbits(8)
        what = "random bytes"
    elif action == 1:
        i = rng.randrange(len(data))
        fill = rng.choice([0xFF, 0x7F, 0x80, 0x02])
        data[i : i + rng.randint(1, 16)] = bytes([fill]) * len(data[i : i + 16])
        what = "a run of one byte"
    elif action == 2:
        names = [
            n
            for n, d in (c.doc.described() or {}).items()
            if isinstance(d, dict) and d.get("kind") == "pickle"
        ]
        name = _choose(rng, names)
        blobs = {n: c.doc.blob(n) for n in c.doc.st}
        if name is None or name not in blobs:
            return "no pickle"
        payload = rng.choice(
            [
                pickle.dumps(Planted(c.marker), protocol=rng.randint(0, 5)),
                b"cos\nsystem\n(S'true'\ntR.",
                bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 40))),
                b"\x80\x05" + bytes(30),
            ]
        )
        blobs[name] = payload
        if isinstance(c.doc.st.get(name), dict):
            c.doc.st[name]["shape"] = [len(payload)]
        c.doc.meta["tensors"][name]["shape"] = [len(payload)]
        c.doc.relayout(blobs)
        return f"pickle {name!r} = {payload[:20]!r}"
    else:
        data[:] = bytes(rng.getrandbits(8) for _ in range(len(data)))
        what = "all random"
    c.doc.data = bytes(data)
    c.doc.recompute = True
    return f"data: {what}"


def m_file(c: Edit) -> str:
    """The length prefix, the padding, the file's end, its first bytes."""
    rng = c.rng
    action = rng.randrange(8)
    if action == 0:  # inside the sealed header: valid JSON whitespace, or not
        c.doc.pad = rng.choice(
            [b" " * 4000, b"\t\n\r ", b"\x00" * 8, b"\xff\xfe", b"x", b"\n" * 70_000, b"\x0b"]
        )
        return f"padding {c.doc.pad[:8]!r} x{len(c.doc.pad)}"

    def prefix(value: Callable[[int, int], int]) -> Callable[[bytes], bytes]:
        def apply(raw: bytes) -> bytes:
            raw = raw.ljust(8, b"\0")  # perhaps truncated first
            (n,) = struct.unpack("<Q", raw[:8])
            return struct.pack("<Q", value(n, len(raw)) % 2**64) + raw[8:]

        return apply

    if action in (1, 2):
        choices: list[tuple[str, Callable[[int, int], int]]] = [
            ("n+1", lambda n, s: n + 1),
            ("n-1", lambda n, s: n - 1),
            ("0", lambda n, s: 0),
            ("1", lambda n, s: 1),
            ("2", lambda n, s: 2),
            ("size-8", lambda n, s: s - 8),
            ("size", lambda n, s: s),
            ("MAX_HEADER", lambda n, s: MAX_HEADER),
            ("MAX_HEADER+1", lambda n, s: MAX_HEADER + 1),
            ("2**63", lambda n, s: 2**63),
            ("2**64-1", lambda n, s: 2**64 - 1),
        ]
        what, fn = rng.choice(choices)
        c.doc.post.append(prefix(fn))
        return f"length prefix {what}"
    if action == 3:
        cut = rng.choice([1, 8, 100, -1, -8])
        c.doc.post.append(lambda raw: raw[:cut])
        return f"truncated at {cut}"
    if action == 4:
        tail = rng.choice([b"x", bytes(4096), b"\x00"])
        c.doc.post.append(lambda raw: raw + tail)
        return f"{len(tail)} bytes appended"
    if action == 5:
        head = rng.choice(
            [b"PK\x03\x04", b"\x80\x02", b"\x93NUMPY", b"\x80\x05\x95", b"{\x00\x00\x00\x00\x00\x00\x00"]
        )
        c.doc.post.append(lambda raw: head + raw[len(head) :])
        return f"starts with {head!r}"
    if action == 6:
        c.doc.post.append(lambda raw: raw[:8] + raw[8:].replace(b"{", b"[", 1))
        return "header not an object"
    c.doc.post.append(lambda raw: raw[:8] + b"\xff" + raw[9:])
    return "header not UTF-8"


def m_huge(c: Edit) -> str:
    """A header larger than the JSON window (the windowed parser), many entries, long
    names, wide or deep containers near the limits."""
    rng = c.rng
    action = rng.randrange(6)
    if action == 0:
        _insert(
            c, rng.choice(['\\"é\ud800\n', "x", "\u2028"]) * rng.choice([WINDOW, 3 * WINDOW // 2, 100_000])
        )
        return "a long string in the tree"
    if action == 1:
        _insert(c, list(range(rng.choice([5_000, 20_000]))))
        return "a wide list in the tree"
    if action == 2:  # many small consistent entries
        n = rng.choice([300, 300, 1000])  # a load costs ~50 us an entry: 1000 is 100x a seed
        blobs = {name: c.doc.blob(name) for name in c.doc.st}
        described = c.doc.described()
        for i in range(n):
            name = f"many.{i}"
            c.doc.st[name] = {"dtype": "U8", "shape": [1], "data_offsets": [0, 0]}
            blobs[name] = bytes([i % 256])
            if described is not None:
                described[name] = {"kind": "tensor", "dtype": "uint8", "shape": [1], "crc32c": CRC_ZERO}
        c.doc.relayout(blobs)
        if rng.random() < 0.5:
            _insert(c, [{"$": "tensor", "n": f"many.{i}"} for i in range(n)])
        return f"{n} more entries"
    if action == 3:  # a long name, consistently
        name = c.name()
        if name is None:
            return "no entry"
        new = "n" * rng.choice([WINDOW, 100_000])
        c.doc.st = {new if k == name else k: v for k, v in c.doc.st.items()}
        described = c.doc.described()
        if described is not None and name in described:
            c.doc.meta["tensors"] = {new if k == name else k: v for k, v in described.items()}
        _rename_in_tree(c.doc.tree(), name, new)
        return f"{name!r} renamed to {len(new)} characters"
    if action == 4:  # large containers nested around the windowed parser's depth limit
        depth = rng.choice([MAX_DEPTH, 190, 199, 200, 201, 400])
        filler = '"' + "f" * (WINDOW + 10) + '"'
        _insert(c, c.mark(Raw("[" * depth + filler + "]" * depth)))
        return f"{depth} large lists nested"
    _insert(c, c.mark(Raw("[" + ",".join(["[1," + "9" * 30 + "]"] * 3000) + "]")))
    return "a wide list of lists"


MUTATIONS: list[tuple[Callable[[Edit], str], int]] = [
    (m_desc_field, 10),
    (m_entry_field, 6),
    (m_coherent_dtype, 10),
    (m_shape, 8),
    (m_reshape, 3),
    (m_offsets, 8),
    (m_rename, 5),
    (m_duplicate, 4),
    (m_delete, 5),
    (m_add, 6),
    (m_tree, 14),
    (m_leaf_tag, 6),
    (m_graft, 8),
    (m_document, 6),
    (m_external, 6),
    (m_metadata, 5),
    (m_data, 8),
    (m_file, 5),
    (m_huge, 1),
]
_OPS = [m for m, _ in MUTATIONS]
_WEIGHTS = [w for _, w in MUTATIONS]


@dataclass
class Mutant:
    """Case ``i`` of the checkpoint fuzzer: its seed, its file, what was done to it, its
    random stream (for the calls), and the entries its tree uses as two kinds."""

    seed: Seed
    raw: bytes
    done: list[str]
    rng: random.Random
    confused: set[str]
    broken: Exception | None = None  # a mutation failed (the fuzzer's bug)


def mutate(i: int, seeds: list[Seed], marker: str) -> Mutant:
    rng = random.Random(i)
    seed = seeds[rng.randrange(len(seeds))]
    c = Edit(rng, seed.doc(), seed, marker)
    done, broken = [], None
    for op in rng.choices(_OPS, _WEIGHTS, k=rng.choice([1, 1, 2, 3])):
        try:
            done.append(f"{op.__name__}: {op(c)}")
        except Exception as exc:  # the fuzzer's own bug: reported as a finding, the run goes on
            done.append(f"{op.__name__}: failed")
            broken = exc
    raw = render(c.doc, special=c.special)
    tags: dict[str, set[str]] = {}
    for tag, name in leaf_refs(_rendered_tree(raw)):
        tags.setdefault(name, set()).add(tag)
    confused = {name for name, seen in tags.items() if len(seen) > 1}
    return Mutant(seed, raw, done, rng, confused, broken)


def _rendered_tree(raw: bytes) -> Any:
    """The tree of a rendered file, as a reader finds it (None where it finds none)."""
    n = int.from_bytes(raw[:8], "little")
    try:
        document = json.loads(json.loads(raw[8 : 8 + n])["__metadata__"][META_KEY])
    except (ValueError, RecursionError, TypeError, KeyError):
        return None
    return document.get("tree") if isinstance(document, dict) else None


# -- running cases --------------------------------------------------------------------------

Call = tuple[str, Callable[[], Awaitable[Any]], tuple[type[BaseException], ...]]


@dataclass
class Case:
    """One case, ready to run: what it was made from, and the calls that read it."""

    label: str  # the seed, or the policy
    mutations: list[str]
    calls: list[Call]
    checks: list[Call] = field(default_factory=list)  # the fuzzer's own oracles: not timed


@dataclass
class Finding:
    kind: str
    case: int
    label: str
    mutations: list[str]
    call: str
    error: str
    where: str

    def key(self) -> tuple[str, str, str]:
        return self.call, self.error.partition(":")[0], self.where


@dataclass
class Report:
    """What a run of cases ``start .. start + count`` of one kind found."""

    kind: str
    start: int
    count: int
    findings: list[Finding] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    baseline_s: float = 0.0
    slowest: tuple[float, int] = (0.0, -1)
    max_ratio: float = 0.0
    slow: list[dict[str, Any]] = field(default_factory=list)  # over the limit, twice over
    elapsed_s: float = 0.0

    def summary(self, limit: int) -> dict[str, Any]:
        distinct: dict[tuple[str, str, str], Finding] = {}
        for f in self.findings:
            distinct.setdefault(f.key(), f)
        return {
            "kind": self.kind,
            "start": self.start,
            "count": self.count,
            "findings": len(self.findings),
            "distinct": [vars(f) for f in distinct.values()][:limit],
            "slow": self.slow[:limit],
            "outcomes": dict(sorted(self.outcomes.items())),
            "baseline_ms": round(self.baseline_s * 1e3, 3),
            "median_ms": round(statistics.median(self.times) * 1e3, 3) if self.times else None,
            "max_ms": round(self.slowest[0] * 1e3, 2),
            "slowest_case": self.slowest[1],
            "max_ratio": round(max(self.max_ratio, self.slowest[0] / self.baseline_s), 1),
            "elapsed_s": round(self.elapsed_s, 1),
        }


def _where(exc: BaseException) -> str:
    """The innermost frame of aiosnap (or else the innermost) an exception came from."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "aiosnap" in f.filename] or frames
    return f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].name}" if ours else "?"


async def run_calls(calls: list[Call]) -> list[tuple[str, str, BaseException | None]]:
    """Each call's name, its outcome, and the exception if it is a finding: any exception
    but those the call may raise."""
    results: list[tuple[str, str, BaseException | None]] = []
    for name, call, allowed in calls:
        try:
            await call()
            results.append((name, "ok", None))
        except allowed as exc:
            results.append((name, type(exc).__name__, None))
        except Exception as exc:  # every other exception is what the fuzzer looks for
            results.append((name, f"FOREIGN {type(exc).__name__}", exc))
    return results


class Runner:
    """Runs cases in this process, under the limits ``main`` sets."""

    def __init__(self, workdir: Path, ratio: float, verbose: bool = False) -> None:
        self.workdir, self.ratio, self.verbose = workdir, ratio, verbose
        self.marker = str(workdir / "PICKLE-RAN")
        self.seeds = make_seeds(workdir, self.marker)
        self.path = str(workdir / "case")
        self.unpickled: list[str] = []
        self.baseline_s = 0.0
        self.storage = aiosnap.storage.LocalStorage()
        self.step_dir, self.manifest = "", b""
        self.index: dict[str, Any] = {}
        self.steps: Any = None  # fuzz_sharded.StepFuzz, made if a run has sharded cases
        self.step_unit_s = 0.0
        self.seed_problems: list[tuple[str, str, BaseException | None]] = []

    def audit(self, event: str, args: tuple[Any, ...]) -> None:
        # Any unpickling at all resolves globals through find_class: none may happen.
        if event == "pickle.find_class":
            self.unpickled.append(f"{args[0]}.{args[1]}")

    async def setup(self, kinds: set[str]) -> None:
        """Warm every code path (and thread) and measure the unit of time; make the group
        step and the directory the manifest and index cases use, and the sharded step."""
        self.baseline_s = await self.measure(7)
        self.step_dir, self.manifest = await group_step(self.workdir)
        self.index = await index_base(self.workdir / "index_base")
        if "sharded" in kinds:
            from .fuzz_sharded import StepFuzz

            self.steps = await StepFuzz.open(self.workdir, self.marker)
            self.step_unit_s = await self.measure_steps(7)

    def unit(self, kind: str) -> float:
        """The time limit's unit of a kind of case: reading its unmutated seed."""
        return {"checkpoint": self.baseline_s, "sharded": self.step_unit_s}.get(kind, 0.0)

    async def measure_steps(self, rounds: int) -> float:
        """The median time of reading the unmutated sharded step, as the cases read it."""
        times = []
        for i in range(rounds):
            case = self.steps.seed_case(random.Random(f"sharded seed:{i}"))
            t0 = time.perf_counter()
            results = await run_calls(case.calls)
            times.append(time.perf_counter() - t0)
            if i == 0:  # the seed must read back (but per-rank state as a group of one)
                results += await run_calls(case.checks)
                self.seed_problems = [r for r in results if r[1] not in ("ok", "StateMismatchError")]
        return statistics.median(times)

    async def measure(self, rounds: int) -> float:
        """The median time of reading an unmutated seed: the unit of the time limit."""
        times = []
        for _ in range(rounds):
            for seed in self.seeds:
                Path(self.path).write_bytes(render(seed.doc(), special=False))
                calls = self.checkpoint_calls(seed, random.Random(0))
                t0 = time.perf_counter()
                await run_calls(calls)
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def checkpoint_calls(self, seed: Seed, rng: random.Random) -> list[Call]:
        path = self.path
        keys = [rng.choice([*seed.keys, *seed.keys, "missing", "", "a..b", "0", "tied.a.x"])]
        strict = rng.random() < 0.8
        target = seed.target()
        allowed = (aiosnap.errors.CheckpointError,)
        calls: list[Call] = [
            ("load", lambda: aiosnap.load(path), allowed),
            ("load(keys)", lambda: aiosnap.load(path, keys=keys), allowed),
            ("load_into", lambda: aiosnap.load_into(path, target, strict=strict), allowed),
            ("verify", lambda: aiosnap.verify(path), allowed),
        ]
        if seed.replicas is not None:
            calls.append(("load(replicas)", lambda: aiosnap.load(path, replicas=seed.replicas), allowed))
        return calls

    def checkpoint_case(self, i: int) -> Case:
        m = mutate(i, self.seeds, self.marker)
        Path(self.path).write_bytes(m.raw)
        calls = self.checkpoint_calls(m.seed, m.rng)
        if m.confused:  # a file whose tree uses an entry as two kinds must be refused
            name, load, _ = calls[0]

            async def refused() -> None:
                await load()
                raise AssertionError(f"loaded a tree that uses {sorted(m.confused)} as two kinds")

            calls[0] = (name, refused, (aiosnap.errors.CheckpointError,))
        checks: list[Call] = [("_json.loads", functools.partial(_same_as_json_in, m.raw), ())]
        if m.broken is not None:
            broken = m.broken

            async def mutation() -> None:
                raise broken

            calls.insert(0, ("mutate", mutation, ()))
        return Case(m.seed.name, m.done, calls, checks)

    def manifest_case(self, i: int) -> Case:
        raw, done = mutate_manifest(i, self.manifest)
        path = os.path.join(self.step_dir, MANIFEST_NAME)
        Path(path).write_bytes(raw)
        rng = random.Random(f"manifest-calls:{i}")

        async def parse() -> None:
            Manifest.parse(path, raw)

        calls: list[Call] = [("Manifest.parse", parse, (aiosnap.errors.CorruptCheckpointError,))]
        for rank in (0, 1, 2):  # rank 2 is beyond the group: only replicated entries
            keys = rng.choice([None, ["model"], ["mine"], ["model.w"]])

            async def restore(rank: int = rank, keys: list[str] | None = keys) -> None:
                restore_part(self.storage, self.step_dir, rank, keys)

            calls.append((f"restore rank {rank}", restore, (aiosnap.errors.CheckpointError,)))
        return Case("manifest", done, calls)

    def index_case(self, i: int) -> Case:
        raw, done, marks = mutate_index(i, self.index)
        rng = random.Random(f"index-calls:{i}")
        policy, may_delete = rng.choice(POLICIES)
        save = rng.random() < 0.5
        directory = self.workdir / "index_case"
        shutil.rmtree(directory, ignore_errors=True)
        shutil.copytree(self.workdir / "index_base", directory)
        (directory / INDEX_NAME).write_bytes(raw)

        async def session() -> None:
            await index_session(directory, policy, may_delete, save, marks)

        return Case(f"keep={policy!r} save={save}", done, [("manager", session, ())])

    async def run(self, kind: str, start: int, count: int) -> Report:
        report = Report(kind, start, count, baseline_s=self.unit(kind) or self.baseline_s)
        makers = {
            "checkpoint": self.checkpoint_case,
            "manifest": self.manifest_case,
            "index": self.index_case,
            "sharded": lambda i: self.steps.case(i),
        }
        make, began = makers[kind], time.perf_counter()
        if kind == "sharded":
            for name, outcome, exc in self.seed_problems:
                error = f"{type(exc).__name__}: {exc}"[:300] if exc else outcome
                where = _where(exc) if exc else "?"
                report.findings.append(Finding(kind, -1, "sharded seed", [], name, error, where))
        for i in range(start, start + count):
            try:
                with _harness_memory():
                    case = make(i)
            except Exception as exc:  # the fuzzer's own bug: reported, and the run goes on
                error = f"{type(exc).__name__}: {exc}"[:300]
                report.findings.append(Finding(kind, i, "", [], "make the case", error, _where(exc)))
                continue
            if self.verbose:
                print(f"{kind} case {i} ({case.label}): {case.mutations}", file=sys.stderr)
            t0 = time.perf_counter()
            results = await run_calls(case.calls)
            elapsed = time.perf_counter() - t0
            with _harness_memory():  # the oracles are the fuzzer's: json.dumps of a 95 MB header
                results += await run_calls(case.checks)
            for name, outcome, exc in results:
                report.outcomes[f"{name}: {outcome}"] = report.outcomes.get(f"{name}: {outcome}", 0) + 1
                if exc is not None:
                    error = f"{type(exc).__name__}: {exc}"[:300]
                    report.findings.append(
                        Finding(kind, i, case.label, case.mutations, name, error, _where(exc))
                    )
                    if self.verbose:
                        traceback.print_exception(exc, file=sys.stderr)
            if self.unit(kind) and elapsed > self.ratio * self.unit(kind):
                elapsed = await self.recheck(report, i, case, elapsed)
            report.times.append(elapsed)
            if elapsed > report.slowest[0]:
                report.slowest = (elapsed, i)
        report.elapsed_s = time.perf_counter() - began
        return report

    async def recheck(self, report: Report, i: int, case: Case, elapsed: float) -> float:
        """A case over the time limit is run twice more, its fastest run counting, against
        the unit measured again just now: a shared machine's hiccup, or a load that came
        and went, is not taken for a slow reader."""
        for _ in range(2):
            t0 = time.perf_counter()
            await run_calls(case.calls)
            elapsed = min(elapsed, time.perf_counter() - t0)
        again = await (self.measure(1) if report.kind == "checkpoint" else self.measure_steps(1))
        unit = max(self.unit(report.kind), again)
        ratio = elapsed / unit
        report.max_ratio = max(report.max_ratio, ratio)
        if ratio > self.ratio:
            report.slow.append(
                {"case": i, "ms": round(elapsed * 1e3, 1), "ratio": round(ratio), "mutations": case.mutations}
            )
        return elapsed


def _large_json(raw: bytes) -> Iterator[str]:
    """The header and aiosnap document texts of a file that are larger than the JSON
    window: the windowed parser reads them, and must read them as json.loads does.
    One at a time: a hostile header can be 1 GiB."""
    n = int.from_bytes(raw[:8], "little")
    try:
        text = raw[8 : 8 + n].decode("utf-8") if 8 + n <= len(raw) else ""
    except UnicodeDecodeError:
        return
    if len(text) > WINDOW:
        yield text
    try:
        document = json.loads(text)["__metadata__"][META_KEY]
    except (ValueError, RecursionError, TypeError, KeyError):
        return
    del text
    if isinstance(document, str) and len(document) > WINDOW:
        yield document


async def _same_as_json_in(raw: bytes) -> None:
    for text in _large_json(raw):
        await _same_as_json(text)
        del text  # before the next text is made


def _outcome(parse: Callable[[str], Any], text: str) -> tuple[int, str]:
    """What ``parse`` makes of ``text``, as a hash and the start of a repr that tells NaN
    and -0.0 apart: the reprs of a 1 GiB header are not held side by side."""
    try:
        shown = json.dumps(parse(text))
    except json.JSONDecodeError as exc:
        if parse is _json.loads and exc.msg == "large containers nested too deeply":
            return (0, "deep")  # a limit of its own, by design
        shown = "refused"
    except (ValueError, RecursionError):
        shown = "refused"
    return hash(shown), shown[:100]


async def _same_as_json(text: str) -> None:
    windowed = _outcome(_json.loads, text)
    if windowed == (0, "deep"):
        return
    plain = _outcome(json.loads, text)
    if windowed != plain:
        raise AssertionError(f"_json.loads gave {windowed[1]!r}, json.loads {plain[1]!r}")


@contextlib.contextmanager
def _harness_memory() -> Iterator[None]:
    """The address-space limit lifted while the fuzzer itself works (making a case with
    a 100,000-character name took 570 MB for a 95 MB file), then set again, with what it
    freed given back to the system first: the limit is on the reader, not the fuzzer."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == hard:  # no limit set (or one main did not set): nothing to lift
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    try:
        yield
    finally:
        gc.collect()
        _malloc_trim()
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _malloc_trim() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _vm(key: str) -> int:
    """A Vm* line of /proc/self/status, in bytes (0 where there is no /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# -- manifests ------------------------------------------------------------------------------


def _manifest_junk(rng: random.Random, value: Any) -> Any:
    """A hostile replacement for one manifest field."""
    names = ["rank_00000", "rank_00001", *ODD_STRINGS, "a/b", "\x00", "n" * 300, "\udc80", "\ud800"]
    return rng.choice(
        [
            junk(rng),
            rng.choice(BIG_INTS),
            -1,
            0,
            True,
            None,
            "3",
            3.0,
            [],
            [rng.choice(names)],
            [rng.choice(names), rng.choice(names)],
            [1, 2],
            [rng.choice(BIG_INTS)] * 2,
            ["00000000", None],
            [[]] * 2,
            rng.choice(names),
            {"a": value},
            [value],
            value if not isinstance(value, list) else value[::-1],
            value if not isinstance(value, list) else value + value[:1],
        ]
    )


def mutate_manifest(i: int, valid: bytes) -> tuple[bytes, list[str]]:
    """Case ``i`` of the manifest fuzzer: a manifest with structured edits, sealed again
    with a valid crc32c (unless the edit is to the seal itself)."""
    rng = random.Random(f"manifest:{i}")
    outer = json.loads(valid)
    done: list[str] = []
    reseal = True
    for _ in range(rng.choice([1, 1, 2, 3])):
        action = rng.random()
        body = outer.get("body") if isinstance(outer, dict) else None
        if action < 0.55 and isinstance(body, dict):
            key = rng.choice([*body, "extra"])
            if rng.random() < 0.15:
                body.pop(key, None)
                done.append(f"body: delete {key}")
            else:
                body[key] = _manifest_junk(rng, body.get(key))
                done.append(f"body: {key} = {body[key]!r:.60}")
        elif action < 0.65 and isinstance(body, dict):  # consistent lists of another length
            n = rng.choice([0, 1, 3, 100])
            body.update(
                world_size=n,
                files=[f"rank_{r:05d}" for r in range(n)],
                checksums=[CRC_ZERO] * n,
                sizes=[1] * n,
            )
            done.append(f"world size {n}")
        elif action < 0.72:
            outer = rng.choice([junk(rng), [outer], {"body": outer}, None])
            done.append(f"outer = {outer!r:.60}")
        elif action < 0.8 and isinstance(outer, dict):
            key = rng.choice(["format", "crc32c", "body", "extra"])
            outer[key] = junk(rng) if key != "format" else rng.choice(["aiosnap-manifest/2", "", None, 1])
            reseal = reseal and key != "crc32c"
            done.append(f"outer {key} = {outer[key]!r:.60}")
        elif action < 0.87:
            done.append("raw text")
            texts: list[Callable[[], bytes]] = [
                lambda: b"",
                lambda: b"\xff\xfe",
                lambda: b"[" * 100_000 + b"]" * 100_000,
                lambda: b'{"body":' * 50_000 + b"1" + b"}" * 50_000,
                lambda: b"\x00",
                lambda: b"NaN",
                lambda: b'{"format":"aiosnap-manifest/1","body":{},"crc32c":"00000000"}' * 2,
                lambda: '{"format": "\ud800"}'.encode("utf-8", "surrogatepass"),
                lambda outer=outer: hostile.dumps(outer).encode("utf-16"),
            ]
            return rng.choice(texts)(), done
        elif isinstance(outer, dict) and isinstance(body, dict):
            depth = rng.choice([100, 900, 5000])
            body[rng.choice(["replicated", "epoch", "extra"])] = Raw("[" * depth + "1" + "]" * depth)
            done.append(f"a field {depth} lists deep")
    if reseal and isinstance(outer, dict) and "body" in outer:
        body_text = hostile.dumps(_sorted(outer["body"]))  # as Manifest.to_bytes writes it
        outer["crc32c"] = f"{crc32c(body_text.encode('utf-8', 'surrogatepass')):08x}"
    return hostile.dumps(outer).encode("utf-8", "surrogatepass"), done


def _sorted(value: Any) -> Any:
    """``value`` with the keys of every object sorted, as ``json.dumps(sort_keys=True)``."""
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list) and not isinstance(value, Pairs):
        return [_sorted(v) for v in value]
    return value


def restore_part(storage: Any, step_dir: str, rank: int, keys: list[str] | None) -> Any:
    """What a rank's restore of a group step does (blocking; as the manager's restore
    does, without a process group): a rank past the saving group's reads as a rank of a
    larger group."""
    manifest = read_manifest(storage, step_dir)
    world = max(manifest.world_size, rank + 1)
    return load_step(storage, Step(step_dir, manifest, rank, world), keys, None, False, None, True)


def _checksum(path: str) -> str:
    f = aiosnap.storage.LocalStorage().open_read(path)
    try:
        return read_header(f).checksum or ""
    finally:
        f.close()


async def group_step(directory: Path) -> tuple[str, bytes]:
    """A valid step of a group of 2: rank 0's file with the replicated entries, rank 1's
    marking them external, and its manifest. Returns the step directory and the manifest."""
    step_dir = directory / "step_3"
    step_dir.mkdir(parents=True, exist_ok=True)
    rank0, rank1 = str(step_dir / "rank_00000"), str(step_dir / "rank_00001")
    await aiosnap.save(rank0, external_state())
    await aiosnap.save(rank1, ExternalLeaves(external_state(), replicated_matcher(["model"])))
    checksums = [_checksum(p) for p in (rank0, rank1)]
    sizes = [os.path.getsize(rank0), os.path.getsize(rank1)]
    manifest = Manifest(3, None, 2, ["rank_00000", "rank_00001"], checksums, sizes, ["model"], "rank_00000")
    return str(step_dir), manifest.to_bytes()


# -- the index ------------------------------------------------------------------------------

INDEX_STEPS = (1, 2, 3)


def _record_junk(rng: random.Random) -> Any:
    return rng.choice(
        [
            junk(rng),
            "5",
            [],
            {},
            3,
            "x",
            -1,
            True,
            None,
            float("nan"),
            float("inf"),
            rng.choice(BIG_INTS),
            10**400,
            {"loss": "x"},
            {"loss": float("nan")},
            {"stall_s": "x"},
            [1, 2],
            "snapshot_iter_1",
            "../snapshot_iter_1",
        ]
    )


def mutate_index(i: int, valid: dict[str, Any]) -> tuple[bytes, list[str], bool]:
    """Case ``i`` of the index fuzzer: the index text, what was done, and whether the
    edits may have marked a checkpoint corrupt with a well-formed reason."""
    rng = random.Random(f"index:{i}")
    data: Any = json.loads(json.dumps(valid))
    done: list[str] = []
    marks = False
    for _ in range(rng.choice([1, 1, 2, 3])):
        action = rng.random()
        records = data.get("checkpoints") if isinstance(data, dict) else None
        if action < 0.5 and isinstance(records, list) and records:
            r = rng.choice(records)
            if not isinstance(r, dict):
                continue
            key = rng.choice(
                [
                    "step",
                    "file",
                    "epoch",
                    "wall_time",
                    "bytes",
                    "metrics",
                    "metadata",
                    "timings",
                    "corrupt",
                    "other",
                ]
            )
            if rng.random() < 0.15:
                r.pop(key, None)
                done.append(f"record: delete {key}")
            else:
                r[key] = _record_junk(rng)
                marks = marks or (key == "corrupt" and isinstance(r[key], str))
                done.append(f"record: {key} = {r[key]!r:.60}")
        elif action < 0.6 and isinstance(records, list):
            extra = rng.choice(
                [
                    junk(rng),
                    {"step": 2, "file": "snapshot_iter_3"},
                    {"step": 9, "file": "snapshot_iter_9"},
                    {"step": 3, "file": "snapshot_iter_3", "corrupt": "said so"},
                    {"step": True, "file": "snapshot_iter_1"},
                ]
            )
            marks = marks or (isinstance(extra, dict) and "corrupt" in extra)
            records.insert(rng.randint(0, len(records)), extra)
            done.append(f"extra record {extra!r:.60}")
        elif action < 0.7 and isinstance(data, dict):
            key = rng.choice(["version", "latest", "checkpoints", "history", "other"])
            data[key] = rng.choice([junk(rng), None, [], {}, "x", [junk(rng)] * 3])
            done.append(f"index {key} = {data[key]!r:.60}")
        elif action < 0.78 and isinstance(data, dict) and isinstance(data.get("history"), list):
            data["history"] = [rng.choice([*data["history"], junk(rng)])] * rng.choice(
                [1, 100, HISTORY_LIMIT + 200]
            )
            done.append(f"history of {len(data['history'])}")
        elif action < 0.86:
            done.append("raw text")
            raw = rng.choice(
                [
                    b"",
                    b"\xff\xfe",
                    b"[" * 100_000 + b"]" * 100_000,
                    b'{"checkpoints":' * 50_000,
                    b"\x00" * 10,
                    b"NaN",
                    b"1e999999",
                    b"{not json",
                ]
            )
            return raw, done, False
        else:
            data = junk(rng)
            done.append(f"index = {data!r:.60}")
    return json.dumps(data).encode(), done, marks


POLICIES: list[tuple[Any, set[int] | None]] = [
    # A policy, and the steps a save of step 5 may delete under it, whatever the index
    # says (None: the index's wall times and metrics decide, so any older step).
    (None, set()),
    (aiosnap.retention.KeepLast(2), {1, 2}),
    (aiosnap.retention.KeepEvery(2), {1, 3}),
    (aiosnap.retention.KeepWithin(3600.0), None),
    (aiosnap.retention.KeepBest("loss"), None),
]


async def index_base(directory: Path) -> dict[str, Any]:
    """A directory of three checkpoints and their index; the index, parsed."""
    async with aiosnap.CheckpointManager(str(directory)) as mgr:
        for step in INDEX_STEPS:
            await mgr.save(
                step, {"step": step, "w": torch.full((2,), float(step))}, metrics={"loss": 1.0 / step}
            )
    return json.loads((directory / INDEX_NAME).read_text())  # type: ignore[no-any-return]


async def index_session(
    directory: Path, policy: Any, may_delete: set[int] | None, save: bool, marks: bool
) -> None:
    """Open a manager over a mutated index: no exception may escape, steps() lists every
    checkpoint (but those a well-formed record marks corrupt), history() only well-typed
    records, restore() the newest; a save deletes only what the policy alone would."""
    async with aiosnap.CheckpointManager(str(directory), keep=policy) as mgr:
        steps = await mgr.steps()
        if not set(steps) <= set(INDEX_STEPS) or (not marks and steps != list(INDEX_STEPS)):
            raise AssertionError(f"steps() = {steps}")
        for r in await mgr.history():
            _check_record(r)
        if steps:
            restored = await mgr.restore()
            if restored.step != steps[-1] or restored.state["step"] != steps[-1]:
                raise AssertionError(f"restored step {restored.step}, not {steps[-1]}")
        if save:
            await (await mgr.save(5, {"step": 5}, metrics={"loss": 0.5})).wait()
    left = {int(p.name.rpartition("_")[2]) for p in directory.iterdir() if p.name.startswith("snapshot")}
    gone = set(INDEX_STEPS) - left
    allowed = set(INDEX_STEPS) if may_delete is None else (may_delete if save else set())
    if not gone <= allowed or (save and 5 not in left):
        raise AssertionError(f"checkpoints {sorted(gone)} deleted (keep={policy!r}, save={save})")


def _check_record(r: aiosnap.CheckpointRecord) -> None:
    """A record the manager hands out has the documented types."""
    ok = (
        type(r.step) is int
        and isinstance(r.file, str)
        and (r.epoch is None or type(r.epoch) is int)
        and type(r.wall_time) in (int, float)
        and math.isfinite(r.wall_time)
        and type(r.bytes) is int
        and isinstance(r.metrics, dict)
        and isinstance(r.metadata, dict)
        and isinstance(r.timings, dict)
        and all(isinstance(k, str) and type(v) in (int, float) for k, v in r.timings.items())
        and (r.corrupt is None or isinstance(r.corrupt, str))
    )
    if not ok:
        raise AssertionError(f"history() returned a malformed record: {r!r:.200}")


# -- the child process -------------------------------------------------------------------------


def parse_run(text: str) -> tuple[str, int, int]:
    kind, start, count = text.split(":")
    if kind not in ("checkpoint", "manifest", "index", "sharded"):
        raise argparse.ArgumentTypeError(f"unknown kind {kind!r}")
    return kind, int(start), int(count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument(
        "runs", nargs="+", type=parse_run, help="KIND:START:COUNT (checkpoint, manifest, index, sharded)"
    )
    parser.add_argument(
        "--ratio", type=float, default=300.0, help="time limit of a checkpoint case, in seed cases"
    )
    parser.add_argument("--headroom-mib", type=int, default=512, help="RLIMIT_AS above the warmed-up size")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="aiosnap-fuzz-", dir=_scratch()))
    workdir.mkdir(parents=True, exist_ok=True)
    runner = Runner(workdir, args.ratio, args.verbose)
    reports: list[Report] = []
    memory, limit_works = 0, False

    async def run() -> None:
        nonlocal memory, limit_works
        await runner.setup({kind for kind, _, _ in args.runs})
        # What torch and the seeds made is kept for good: collections that walk it all
        # cost ~100 ms each, which would be charged to whichever case they fall in.
        gc.freeze()
        # The limit: what this process maps once warmed up, plus a headroom far above what
        # the seed files justify (each a few KiB; a case's header a few MiB at most) and
        # far below what a size the reader failed to check would make it allocate.
        memory = _vm("VmSize") + (args.headroom_mib << 20)
        # A soft limit: the fuzzer lifts it while it makes a case (_harness_memory).
        resource.setrlimit(resource.RLIMIT_AS, (memory, resource.getrlimit(resource.RLIMIT_AS)[1]))
        try:  # the limit bites: an allocation past the headroom fails
            bytearray((args.headroom_mib + 64) << 20)
            limit_works = False
        except MemoryError:
            limit_works = True
        sys.addaudithook(runner.audit)
        for kind, start, count in args.runs:
            reports.append(await runner.run(kind, start, count))

    asyncio.run(run())
    if os.path.exists(runner.marker):
        runner.unpickled.append(f"the marker file {runner.marker} exists")
    result = {
        "runs": [r.summary(50) for r in reports],
        "unpickled": runner.unpickled[:50],
        "rlimit_as_mib": memory >> 20,
        "rlimit_works": limit_works,
        "vm_peak_mib": _vm("VmPeak") >> 20,
    }
    print(json.dumps(result))
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _scratch() -> str | None:
    """tmpfs where there is one: the fuzzer writes a file per case."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


if __name__ == "__main__":
    sys.exit(main())
