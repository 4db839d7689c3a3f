"""The file format: safetensors bytes, with aiosnap's tree and checksums in the header.

    u64 little-endian N | N bytes of JSON header, space-padded | data section

The header is safetensors' (``{"name": {"dtype", "shape", "data_offsets"}, ...}``),
padded so the data section starts at a multiple of ``ALIGN``. Its ``__metadata__``
holds two strings: ``aiosnap`` (JSON: format version, tree, per tensor its kind, real
dtype, shape and crc32c, and optionally the ``external`` entries the tree refers to but
another file stores) and ``aiosnap_crc32c``, the crc32c of the first 8 + N
bytes with that value read as ``00000000``. Together they cover every byte of the file.
See docs/format.md.

Parsing trusts nothing: every length, offset, shape and dtype is checked against the
file size before anything is allocated, and every failure is a CorruptCheckpointError.
"""

from __future__ import annotations

import codecs
import dataclasses
import operator
import re
import struct
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._base import json as _json
from .._base.checksums import crc32c, is_content_hash
from .._base.errors import CheckpointError, CorruptCheckpointError, NotACheckpointError
from .._base.heap import gc_paused, release, zip_dict
from .._storage.protocol import Reader, ReaderFile
from . import dtypes as _dtypes
from . import tree as _tree
from .dtypes import MAX_EXTENT as MAX_EXTENT  # re-exported: the limits and sizes of shapes
from .dtypes import itemsize as itemsize
from .dtypes import nbytes as nbytes
from .dtypes import st_entry as st_entry
from .dtypes import st_entry_written, st_nbytes
from .header import BLOCK, CRC_KEY, CRC_ZERO, META_KEY, HeaderTemplate, block_count, json_string

FORMAT_VERSION = 1
#: A larger header is refused before it is read (a lying length must not allocate).
MAX_HEADER = 1 << 30
#: NumPy arrays have at most this many dimensions (numpy.empty refuses more).
NUMPY_MAX_NDIM = 64
KINDS = ("tensor", "ndarray", "npscalar", "pickle")


@dataclass(slots=True, unsafe_hash=True)
class TensorInfo:
    """One entry of the data section, as aiosnap describes it. Treated as immutable, but
    not frozen: a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``, 0.5 us more per entry (50 ms per 100,000-entry header)."""

    name: str
    kind: str  # one of KINDS
    dtype: str  # torch dtype name, NumPy dtype.str, or "|u1" for pickles
    shape: tuple[int, ...]
    start: int  # offsets inside the data section
    end: int
    crc: int | None  # None in plain safetensors files
    #: A shard of a distributed tensor: the whole's shape, and this box's offsets in it
    #: (its lengths are ``shape``).
    shard: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    #: The checksum of each BLOCK-byte block (shards longer than a block).
    blocks: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed, validated header."""

    data_start: int  # file offset of the data section
    tensors: dict[str, TensorInfo]
    tree: Any  # the skeleton, or None for a plain safetensors file
    version: int | None
    #: Entries the tree refers to that another file holds (offsets 0, no checksum).
    external: dict[str, TensorInfo] = field(default_factory=dict)
    #: The header's own crc32c (hex): a summary of the whole file, since the header
    #: holds the checksum of every entry.
    checksum: str | None = None
    #: Entries whose bytes are in a blob (an incremental save), by name.
    refs: dict[str, Ref] = field(default_factory=dict)
    #: Where those blobs are: None, ``aiosnap-blobs/`` beside the file; a rank's folder
    #: name (``rank_00001``), ``aiosnap-blobs/<it>/`` beside the file's step directory.
    blob_dir: str | None = None
    #: The other string entries of ``__metadata__`` (``"format": "pt"``, a user's), in
    #: file order; aiosnap's own two are not among them.
    metadata: dict[str, str] = field(default_factory=dict)


#: Ways a blob's bytes may be stored (``Ref.compression``).
COMPRESSIONS = ("zstd",)


@dataclass(frozen=True, slots=True)
class Ref:
    """An entry stored in a blob: what it is (``info``: offsets 0 to its byte count, its
    crc32c of the bytes as loaded), the blob's name (its content hash), and how the blob
    holds it: ``stored`` bytes, compressed by ``compression`` or raw (None)."""

    info: TensorInfo
    blob: str
    stored: int
    compression: str | None = None


def tree_of(header: Header) -> Any:
    """The tree a file is read by: its own, or for a file without one (a plain safetensors
    file), a dict of its entries as tensors, by name. Load and verify check the same one."""
    if header.tree is not None:
        return header.tree
    items = sorted(header.tensors.values(), key=lambda t: t.start)
    return {"$": "dict", "items": [[t.name, {"$": "tensor", "n": t.name}] for t in items]}


@dataclass(frozen=True, slots=True)
class EntryPieces:
    """The part of a header that depends on its entries alone (see header_template):
    all of it but the skeleton and the external entries, which end the last piece."""

    pieces: list[str]  # every piece but the last, each followed by its hole
    holes: list[int]
    blocks: list[int]
    entries: str  # the safetensors entries, joined
    last: str  # the start of the last piece


def header_template(
    tensors: list[TensorInfo],
    tree: str,
    external: list[TensorInfo] | None = None,
    laid: EntryPieces | None = None,
    refs: list[Ref] | None = None,
    blob_dir: str | None = None,
    metadata: Mapping[str, str] | None = None,
) -> HeaderTemplate:
    """Lay out the header of these entries around the skeleton's JSON text; the
    checksums are filled in at the commit. ``laid``: ``entry_pieces(tensors)``, if
    known already (a plan of the same entries with another skeleton). ``metadata``: the
    other entries of ``__metadata__`` (see HeaderTemplate)."""
    laid = laid or entry_pieces(tensors)
    tail = ['},"tree":', tree]
    if external:
        described = (
            f'{json_string(t.name)}:{{"kind":"{t.kind}","dtype":{json_string(t.dtype)},'
            f'"shape":{_int_list(t.shape)}{"," + _shard_text(t)[:-1] if t.shard else ""}}}'
            for t in external
        )
        tail += [',"external":{', ",".join(described), "}"]
    if refs:
        tail += [',"refs":{', ",".join(map(_ref_text, refs)), "}"]
        if blob_dir is not None:
            tail.append(f',"blob_dir":{json_string(blob_dir)}')
    last = (laid.last[:-1] if tensors else laid.last) + _escaped("".join(tail) + "}")
    return HeaderTemplate([*laid.pieces, last], laid.holes, laid.blocks, laid.entries, metadata)


def _ref_text(ref: Ref) -> str:
    """A referred entry's description (its checksums known already: a referring header is
    laid out in the commit, after the entries were sealed)."""
    t = ref.info
    blocks = "" if t.blocks is None else f',"blocks":"{"".join(f"{b:08x}" for b in t.blocks)}"'
    packed = "" if ref.compression is None else f',"compression":"{ref.compression}","stored":{ref.stored}'
    return (
        f'{json_string(t.name)}:{{"kind":"{t.kind}","dtype":{json_string(t.dtype)},"shape":{_int_list(t.shape)},'
        f'{_shard_text(t)}"blob":"{ref.blob}","crc32c":"{t.crc or 0:08x}"{blocks}{packed}}}'
    )


def entry_pieces(tensors: list[TensorInfo]) -> EntryPieces:
    """The header's pieces that describe ``tensors``.

    The per-tensor JSON is written directly: a generic encoder spends ~10 us on each
    small object (seconds for a state of 100,000 tensors), or holds the GIL for the
    whole header if called once. Names go through the C string escaper. The aiosnap
    document is a JSON string inside the header, so its pieces are written escaped:
    a whole tensor's piece directly in that form (escaping it costs ~0.5 us), any other
    text through the escaper."""
    pieces: list[str] = []
    holes: list[int] = []
    blocks: list[int] = []
    entries: list[str] = []
    dtypes: dict[str, str] = {}
    plain: dict[str, tuple[str, str]] = {}  # dtype name: (its JSON, escaped; its safetensors code)
    text = _escaped(f'{{"version":{FORMAT_VERSION},"checksum":"crc32c","tensors":{{')
    for t in tensors:
        name, shape = json_string(t.name), _int_list(t.shape)
        if t.kind == "tensor" and t.shard is None and t.dtype not in _RESHAPED:
            # The common entry (a whole tensor) in fewer steps: ~1.5 us of 3 per tensor.
            known = plain.get(t.dtype)
            if known is None:
                code = _dtypes.native_st_code(t.dtype) or "U8"
                known = plain[t.dtype] = (_escaped(json_string(t.dtype)), code)
            dtype, code = known
            # A name whose JSON has no escape has none when escaped again but its quotes.
            quoted = f'\\"{name[1:-1]}\\"' if "\\" not in name else _escaped(name)
            pieces.append(
                f'{text}{quoted}:{{\\"kind\\":\\"tensor\\",\\"dtype\\":{dtype},\\"shape\\":{shape},\\"crc32c\\":\\"'
            )
            holes.append(1)
            blocks.append(0)
            text = _CLOSE
            st_shape_text = shape if code != "U8" or t.dtype == "uint8" else f"[{t.end - t.start}]"
            entries.append(_entry_text(name, code, st_shape_text, t.start, t.end))
            continue
        dtype = dtypes.get(t.dtype) or dtypes.setdefault(t.dtype, json_string(t.dtype))
        text += _escaped(f'{name}:{{"kind":"{t.kind}","dtype":{dtype},"shape":{shape},{_shard_text(t)}')
        k = block_count(t.nbytes) if t.shard is not None and t.nbytes > BLOCK else 0
        if k:
            pieces.append(text + _escaped('"blocks":"'))
            holes.append(k)
            text = _escaped('",')
        pieces.append(text + _escaped('"crc32c":"'))
        holes.append(1)
        blocks.append(k)
        text = _CLOSE
        code, st_shape = st_entry(t.kind, t.dtype, t.shape, t.nbytes)
        st_shape_text = shape if st_shape == list(t.shape) else _int_list(st_shape)
        entries.append(_entry_text(name, code, st_shape_text, t.start, t.end))
    return EntryPieces(pieces, holes, blocks, ",".join(entries), text)


#: Dtypes whose safetensors shape is another than their own (entry_pieces).
_RESHAPED = frozenset((_dtypes.PACKED_F4,))


def _entry_text(name: str, code: str, shape: str, start: int, end: int) -> str:
    """A safetensors entry, as the writer writes it and the reader expects it (see
    ``_Parser.as_written``); ``name`` and ``shape`` are JSON already."""
    return f'{name}:{{"dtype":"{code}","shape":{shape},"data_offsets":[{start},{end}]}}'


def _escaped(text: str) -> str:
    """``text`` as the inside of a JSON string."""
    return json_string(text)[1:-1]


_CLOSE = _escaped('"},')


def _shard_text(t: TensorInfo) -> str:
    if t.shard is None:
        return ""
    whole, offsets = t.shard
    return f'"shard":{{"shape":{_int_list(whole)},"offset":{_int_list(offsets)}}},'


def _int_list(values: tuple[int, ...] | list[int]) -> str:
    return f"[{','.join(map(str, values))}]"


#: What a legacy (pre-zip) torch.save file starts with: a pickled long, its magic number.
_TORCH_LEGACY = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def sniff(f: Reader) -> str | None:
    """What another program wrote ``f`` with, if it is not a safetensors-style file:
    "torch.save" (a zip with a ``data.pkl``), "torch.save (legacy)", "pickle",
    "NumPy .npy", "NumPy .npz", "zip"; None for a file to parse as a checkpoint."""
    head = bytearray(min(16, f.size))
    f.readinto(0, memoryview(head))
    if head.startswith(b"PK\x03\x04"):
        try:
            names = zipfile.ZipFile(ReaderFile(f)).namelist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError):
            return "zip (damaged)"
        if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
            return "torch.save"
        return "NumPy .npz" if names and all(n.endswith(".npy") for n in names) else "zip"
    if head.startswith(_TORCH_LEGACY):
        return "torch.save (legacy)"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    if head.startswith(b"\x93NUMPY"):
        return "NumPy .npy"
    return None


#: How every file aiosnap writes begins, after the 8 bytes of the header's length.
_OWN_OPEN = b'{"__metadata__":{"' + META_KEY.encode() + b'":"'


def written_by_aiosnap(f: Reader) -> bool:
    """Whether ``f`` begins as every checkpoint file aiosnap writes does (a header whose
    metadata comes first and holds aiosnap's document). A cheap test of where a file
    came from, not of its integrity: a damaged checkpoint passes it, a plain
    safetensors file or anything else does not."""
    head = bytearray(min(f.size, 8 + len(_OWN_OPEN)))
    f.readinto(0, memoryview(head))
    if len(head) < 8 + len(_OWN_OPEN):
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return len(_OWN_OPEN) <= n <= f.size - 8 and head[8:] == _OWN_OPEN


def how_to_read(path: str, kind: str) -> str:
    """What to do with a file of another format."""
    if kind.startswith("torch.save"):
        return (
            f"{path}: a torch.save file (written by torch.save, or by a writer's savefun=torch.save): "
            "loading it runs pickled code from the file, so aiosnap reads it only with allow_pickle=True; "
            "or read it with torch.load, or convert it with `aiosnap convert`"
        )
    if kind.startswith("NumPy"):
        return f"{path}: not an aiosnap checkpoint but a {kind} file: read it with numpy.load"
    if kind == "pickle":
        return f"{path}: not an aiosnap checkpoint but a pickle: read it with pickle.load, if you trust it"
    return f"{path}: not an aiosnap checkpoint but a {kind} file"


def read_header(f: Reader, *, shortcut: bool = True) -> Header:
    """Read and validate the header of an open file. The collector is held off: parsing
    builds objects that are all kept, and collections over them doubled the time to
    parse a 20,000-tensor header (1.3 s instead of 0.65 s).

    ``shortcut=False`` reads a header as aiosnap writes it by the general parse too, as
    any other (tests hold the two ways to the same result)."""
    with gc_paused():
        return _Parser(f).parse(shortcut=shortcut)


def read_written_header(f: Reader) -> Header | None:
    """The header of an open file as the shortcut for headers as aiosnap writes them
    reads it; None where the general parse is needed (for tests: which way was taken)."""
    with gc_paused():
        parser = _Parser(f)
        text, seal, n = parser.text()
        return parser.as_written(text, seal, f.size - 8 - n, 8 + n)


class _Parser:
    def __init__(self, f: Reader) -> None:
        self.f = f

    def fail(self, reason: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(self.f.path, reason)

    def text(self) -> tuple[str, tuple[str, bool] | None, int]:
        """The header's text, its seal and its length (checked against the file's)."""
        size = self.f.size
        if size < 8:
            raise self.fail(f"truncated: {size} bytes, less than the 8-byte header length")
        prefix = bytearray(8)
        self.f.readinto(0, memoryview(prefix))
        (n,) = struct.unpack("<Q", prefix)
        if n < 2 or n > size - 8 or n > MAX_HEADER:
            start = bytearray(min(size - 8, 2))
            self.f.readinto(8, memoryview(start))
            if start[:1] != b"{":  # not even the start of a JSON header: another format
                raise NotACheckpointError(
                    self.f.path,
                    f"not an aiosnap or safetensors checkpoint (it starts with {bytes(prefix[:8])!r})",
                )
            raise self.fail(f"header length {n} does not fit a file of {size} bytes")
        raw = bytearray(8 + n)
        with memoryview(raw) as view:  # released here, even if something holds the reader's frame
            self.f.readinto(0, view)
        # The checksum is taken before the text is decoded, so that the raw bytes are
        # freed before the text is joined: the parse never holds more than two copies of
        # the header (a hostile one can be 1 GiB).
        seal = _seal(raw)
        try:
            return _decode(raw), seal, n
        except UnicodeDecodeError:
            raise self.fail("header is not valid JSON (UnicodeDecodeError)") from None

    def parse(self, *, shortcut: bool) -> Header:
        size = self.f.size
        text, seal, n = self.text()
        if shortcut:
            written = self.as_written(text, seal, size - 8 - n, 8 + n)
            if written is not None:
                return written
        obj = self.json(text, "header")
        del text
        if not isinstance(obj, dict):
            raise self.fail("header is not a JSON object")
        entries = self.entries(obj, size - 8 - n)
        meta = obj.get("__metadata__")
        release(obj)
        if meta is None or (isinstance(meta, dict) and META_KEY not in meta):
            # A plain file's metadata is not checked (safetensors refuses values of other
            # types; aiosnap reads such a file, as it did): its strings are kept.
            kept = {k: v for k, v in meta.items() if type(v) is str} if isinstance(meta, dict) else {}
            return Header(8 + n, self.plain(entries), None, None, metadata=kept)
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise self.fail("__metadata__ is not a map of strings")
        self.check_header_crc(seal, meta)
        header = self.aiosnap(8 + n, entries, self.json(meta[META_KEY], "metadata"))
        release(entries)
        return dataclasses.replace(header, checksum=meta[CRC_KEY], metadata=_other_metadata(meta))

    def json(self, text: str, what: str) -> Any:
        # The metadata is text already, and may hold lone surrogates (JSON escapes can
        # write them): it is parsed as it is, never encoded again.
        try:
            return _json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise self.fail(f"{what} is not valid JSON ({type(exc).__name__})") from None

    def as_written(
        self, text: str, seal: tuple[str, bool] | None, data_len: int, data_start: int
    ) -> Header | None:
        """The header of a file as aiosnap writes it, read without parsing its
        safetensors entries: each is rendered from its description, as the writer
        renders it, and found in the text (the entries' parse and checks cost ~2 us per
        tensor). None for any other header: the general parse reads it, and says what
        is wrong with it if anything is."""
        if not text.startswith(_META_OPEN):
            return None
        try:
            meta, at = _json.loads_at(text, len(_META_OPEN))
            if type(meta) is not dict or not meta.keys() >= _META_KEYS or seal != (meta[CRC_KEY], True):
                return None
            if len(meta) > 2 and not all(type(v) is str for v in meta.values()):
                return None  # the general parse says what is wrong
            doc = None
            if type(meta[META_KEY]) is str:
                doc = _document(meta[META_KEY]) or _json.loads(meta[META_KEY])
        except (ValueError, RecursionError):
            return None
        if (
            type(doc) is not dict
            or type(doc.get("tensors")) is not dict
            or doc.get("version") != FORMAT_VERSION
        ):
            return None
        described: dict[str, Any] = doc["tensors"]
        tensors = self.entries_at(text, at, described, data_len)
        release(described)
        if tensors is None:
            return None
        # Every check the general parse makes before these has passed: it would raise
        # what these raise, after parsing the header again.
        try:
            _tree.check(doc.get("tree"))
        except ValueError as exc:
            raise self.fail(f"bad tree: {exc}") from None
        external = self.external(doc, tensors)
        refs = self.refs(doc, tensors, external)
        tree = doc.get("tree")
        return Header(
            data_start,
            tensors,
            tree,
            FORMAT_VERSION,
            external,
            meta[CRC_KEY],
            refs,
            self.blob_dir(doc),
            _other_metadata(meta),
        )

    def entries_at(
        self, text: str, at: int, described: dict[str, Any], data_len: int
    ) -> dict[str, TensorInfo] | None:
        """The described tensors, if the text from ``at`` holds exactly their
        safetensors entries (in file order, from offset 0 to ``data_len``) as the writer
        writes them, then the header's end and its padding; else None."""
        tensors: dict[str, TensorInfo] = {}
        pos = 0
        # Shapes repeat (every layer of a model, every bias): each (dtype, shape) is
        # checked and rendered once, found again by the shape's repr (which no other JSON
        # value shares with a list of ints) or its JSON: 2 us less per entry.
        common: dict[tuple[str, str], Any] = {}
        for name, d in described.items():
            key = None
            if type(d) is tuple:  # as _document found it: (name, dtype, the shape's JSON, crc, ...)
                dtype, shape, crc = d[1:4]
                key = (dtype, shape)
            elif (whole := _whole_description(d)) is not None:
                dtype, shape, crc = whole
                key = (dtype, repr(shape)) if type(shape) is list else None
            if key is not None:
                spec = common.get(key, _MISS)
                if spec is _MISS:
                    spec = common[key] = _common(dtype, _ints_of(shape) if type(shape) is str else shape)
                if spec is not None:
                    st_shape, code, shape_text, size = spec
                    end = pos + size
                    entry = "," + _entry_text(json_string(name), code, shape_text, pos, end)
                    if not text.startswith(entry, at) or name == "__metadata__":
                        return None
                    tensors[name] = TensorInfo(name, "tensor", dtype, st_shape, pos, end, int(crc, 16))
                    pos, at = end, at + len(entry)
                    continue
            if type(d) is tuple:
                d = {"kind": "tensor", "dtype": d[1], "shape": _ints_of(d[2]), "crc32c": d[3]}
            found = self.entry_at(text, at, name, d, pos)
            if found is None:
                return None
            info, at = found
            tensors[name], pos = info, info.end
        if pos != data_len or text[at : at + 1] != "}" or text.count(" ", at + 1) != len(text) - at - 1:
            return None
        return tensors

    def entry_at(self, text: str, at: int, name: str, d: Any, pos: int) -> tuple[TensorInfo, int] | None:
        """Any other description (an array, a pickle, a shard, a dtype without its own
        safetensors code) at ``pos``, checked by info(), with where its entry ends."""
        if type(d) is not dict or d.get("kind") not in KINDS or type(d.get("dtype")) is not str:
            return None
        kind, dtype, shape, size = d["kind"], d["dtype"], d.get("shape"), itemsize(d["kind"], d["dtype"])
        if size is None or not _ints(shape) or name == "__metadata__":
            return None
        assert isinstance(shape, list)
        extent = nbytes(shape, size)
        if extent is None:
            return None
        code, st_shape = st_entry(kind, dtype, tuple(shape), extent)
        end = pos + extent
        entry = "," + _entry_text(json_string(name), code, _int_list(st_shape), pos, end)
        if not text.startswith(entry, at):
            return None
        try:
            return self.info(name, d, (code, st_shape, pos, end)), at + len(entry)
        except CorruptCheckpointError:
            return None

    def entries(self, obj: dict[str, Any], data_len: int) -> dict[str, tuple[str, list[int], int, int]]:
        found: dict[str, tuple[str, list[int], int, int]] = {}
        for name, e in obj.items():
            if name == "__metadata__":
                continue
            if type(e) is not dict or e.keys() != _ENTRY_KEYS:
                raise self.fail(f"tensor {name!r}: malformed entry")
            code, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
            if not isinstance(code, str) or code not in _dtypes.ST_BITS:
                raise self.fail(f"tensor {name!r}: unknown dtype {code!r:.40}")
            if not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
                raise self.fail(f"tensor {name!r}: shape or offsets are not non-negative integers")
            start, end = offsets
            if end - start != st_nbytes(code, shape):
                raise self.fail(f"tensor {name!r}: offsets {offsets} do not match shape {_short(shape)}")
            found[name] = (code, shape, start, end)
        self.check_layout(found, data_len)
        return found

    def check_layout(self, entries: dict[str, tuple[str, list[int], int, int]], data_len: int) -> None:
        pos = 0
        for _, _, start, end in entries.values():  # aiosnap lists entries in file order
            if start != pos:
                break
            pos = end
        else:
            self.check_end(pos, data_len)
            return
        # Any other order is sorted: one C call, 25 ms for 100,000 entries.
        pos = 0
        for name, (_, _, start, end) in sorted(entries.items(), key=lambda kv: kv[1][2:]):
            if start != pos:
                what = "overlaps the previous one" if start < pos else "leaves a gap before it"
                raise self.fail(f"tensor {name!r} at offset {start} {what}")
            pos = end
        self.check_end(pos, data_len)

    def check_end(self, pos: int, data_len: int) -> None:
        if pos > data_len:
            raise self.fail(f"truncated: tensors need {pos} data bytes, the file has {data_len}")
        if pos < data_len:
            raise self.fail(f"{data_len - pos} unexpected bytes after the last tensor")

    def plain(self, entries: dict[str, tuple[str, list[int], int, int]]) -> dict[str, TensorInfo]:
        """The entries of a plain safetensors file, as the torch tensors they load as."""
        tensors = {}
        for name, (code, shape, start, end) in entries.items():
            dtype = _dtypes.ST_TORCH.get(code)
            if dtype is not None and code == "F4":  # two F4 values to each torch element
                if not shape or shape[-1] % 2:
                    dtype = None
                else:
                    shape = [*shape[:-1], shape[-1] // 2]
            if dtype is None:
                pairs = " (it holds F4 values in pairs)" if code == "F4" else ""
                raise CheckpointError(
                    f"{self.f.path}: tensor {name!r} is {code} {_short(shape)}, which torch has no dtype "
                    f"to hold{pairs}: aiosnap cannot load it"
                )
            tensors[name] = TensorInfo(
                name, "tensor", _dtypes.torch_name(dtype), tuple(shape), start, end, None
            )
        return tensors

    def check_header_crc(self, seal: tuple[str, bool] | None, meta: dict[str, str]) -> None:
        stored = meta.get(CRC_KEY)
        if stored is None or len(stored) != 8 or not _is_hex(stored):
            raise self.fail("header checksum is missing or malformed")
        if seal is None or seal[0] != stored:
            raise self.fail("header checksum is not where the format puts it")
        if not seal[1]:
            raise self.fail("header checksum mismatch: the header was altered")

    def aiosnap(
        self, data_start: int, entries: dict[str, tuple[str, list[int], int, int]], meta: Any
    ) -> Header:
        if not isinstance(meta, dict) or not isinstance(meta.get("tensors"), dict):
            raise self.fail("aiosnap metadata is malformed")
        version = meta.get("version")
        if version != FORMAT_VERSION:
            raise self.fail(f"format version {version!r} is not {FORMAT_VERSION}")
        described = meta["tensors"]
        if described.keys() != entries.keys():
            raise self.fail("aiosnap metadata and safetensors entries list different tensors")
        tensors = {name: self.info(name, d, entries[name]) for name, d in described.items()}
        release(described)
        tree = meta.get("tree")
        try:
            _tree.check(tree)
        except ValueError as exc:
            raise self.fail(f"bad tree: {exc}") from None
        external = self.external(meta, tensors)
        refs = self.refs(meta, tensors, external)
        return Header(data_start, tensors, tree, version, external, refs=refs, blob_dir=self.blob_dir(meta))

    def external(self, meta: dict[str, Any], tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
        described = meta.get("external", {})
        if not isinstance(described, dict):
            raise self.fail("aiosnap metadata: external entries are malformed")
        external = {}
        for name, d in described.items():
            if name in tensors:
                raise self.fail(f"tensor {name!r} is both stored and external")
            kind = d.get("kind") if isinstance(d, dict) else None
            if kind not in KINDS[:3] or not isinstance(d.get("dtype"), str):  # a pickle is never external
                raise self.fail(f"external entry {name!r}: malformed description")
            shape, size = d.get("shape"), itemsize(kind, d["dtype"])
            if size is None or not _ints(shape) or nbytes(shape, size) is None:
                raise self.fail(f"external entry {name!r}: bad dtype or shape")
            if kind != "tensor" and len(shape) > NUMPY_MAX_NDIM:
                raise self.fail(f"external entry {name!r}: bad dtype or shape")
            shard = self.shard(name, d, shape, kind)
            external[name] = TensorInfo(name, kind, d["dtype"], tuple(shape), 0, 0, None, shard)
        return external

    def refs(
        self, meta: dict[str, Any], tensors: dict[str, TensorInfo], external: dict[str, TensorInfo]
    ) -> dict[str, Ref]:
        """The entries stored in blobs, each checked as a stored entry's description is
        (its byte count from its shape, within MAX_EXTENT) and named by a content hash."""
        described = meta.get("refs", {})
        if not isinstance(described, dict):
            raise self.fail("aiosnap metadata: refs are malformed")
        refs = {}
        for name, d in described.items():
            if name in tensors or name in external:
                raise self.fail(f"tensor {name!r} is both stored and referred to a blob")
            if not isinstance(d, dict) or d.get("kind") not in KINDS or not isinstance(d.get("dtype"), str):
                raise self.fail(f"referred entry {name!r}: malformed description")
            kind, size = d["kind"], itemsize(d["kind"], d["dtype"])
            shape: Any = d.get("shape")
            extent = nbytes(shape, size) if size is not None and _ints(shape) else None
            if extent is None or not is_content_hash(d.get("blob")):
                raise self.fail(f"referred entry {name!r}: malformed description")
            info = self.info(name, d, (*st_entry(kind, d["dtype"], tuple(shape), extent), 0, extent))
            compression, stored = d.get("compression"), d.get("stored", extent)
            if compression is not None and compression not in COMPRESSIONS:
                raise self.fail(f"referred entry {name!r}: unknown compression {compression!r:.40}")
            if type(stored) is not int or stored < 0 or (compression is None and stored != extent):
                raise self.fail(f"referred entry {name!r}: bad stored size")
            refs[name] = Ref(info, d["blob"], stored, compression)
        return refs

    def blob_dir(self, meta: dict[str, Any]) -> str | None:
        """The rank folder of a step directory's blobs, if the file names one: only a
        rank's folder name, so it never leads out of aiosnap's blob folder."""
        where = meta.get("blob_dir")
        if where is not None and (type(where) is not str or not _RANK_DIR.fullmatch(where)):
            raise self.fail(f"aiosnap metadata: bad blob_dir {_short(where)}")
        return where

    def shard(
        self, name: str, d: dict[str, Any], shape: list[int], kind: str
    ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The ``shard`` field of a description: the whole's shape, and the offsets of this
        box (of lengths ``shape``) inside it."""
        if "shard" not in d:
            return None
        shard = d["shard"]
        whole = shard.get("shape") if isinstance(shard, dict) else None
        offsets = shard.get("offset") if isinstance(shard, dict) else None
        if kind != "tensor" or not _ints(whole) or not _ints(offsets):
            raise self.fail(f"tensor {name!r}: malformed shard description")
        assert isinstance(whole, list)
        assert isinstance(offsets, list)
        # A whole with no elements is indexed nowhere: a restore makes it from this
        # description, so torch must be able to hold it (see MAX_EXTENT).
        size = itemsize(kind, d["dtype"])
        if size is None or nbytes(whole, size) is None:
            raise self.fail(f"tensor {name!r}: shard of a whole {_short(whole)} torch cannot hold")
        if not len(whole) == len(offsets) == len(shape) or any(
            o + n > w for o, n, w in zip(offsets, shape, whole, strict=True)
        ):
            raise self.fail(f"tensor {name!r}: shard {shape} at {offsets} does not fit in {whole}")
        return tuple(whole), tuple(offsets)

    def info(self, name: str, d: Any, entry: tuple[str, list[int], int, int]) -> TensorInfo:
        code, st_shape, start, end = entry
        whole = _whole_tensor(d)
        # Its safetensors entry, checked already, vouches for the size of this shape, so
        # the checks below reduce to these (1 us less per entry).
        if whole is not None and whole[1] == code and d["shape"] == st_shape:
            return TensorInfo(name, "tensor", d["dtype"], tuple(st_shape), start, end, whole[2])
        if not isinstance(d, dict) or d.get("kind") not in KINDS or not isinstance(d.get("dtype"), str):
            raise self.fail(f"tensor {name!r}: malformed description")
        kind, dtype, shape, crc = d["kind"], d["dtype"], d.get("shape"), d.get("crc32c")
        size = itemsize(kind, dtype)
        if size is None:
            raise self.fail(f"tensor {name!r}: unknown {kind} dtype {dtype!r}")
        if not _ints(shape):
            raise self.fail(f"tensor {name!r}: shape {_short(shape)} is not a list of non-negative integers")
        assert isinstance(shape, list)
        if kind != "tensor" and len(shape) > NUMPY_MAX_NDIM:
            raise self.fail(
                f"tensor {name!r}: shape of {len(shape)} dimensions, more than NumPy's {NUMPY_MAX_NDIM}"
            )
        if nbytes(shape, size) != end - start:
            raise self.fail(f"tensor {name!r}: shape {_short(shape)} does not match its {end - start} bytes")
        if (kind == "npscalar" and shape) or (kind == "pickle" and len(shape) != 1):
            raise self.fail(f"tensor {name!r}: bad shape for a {kind}")
        if not st_entry_written(kind, dtype, tuple(shape), end - start, (code, st_shape)):
            raise self.fail(f"tensor {name!r}: safetensors entry disagrees with its description")
        if not isinstance(crc, str) or len(crc) != 8 or not _is_hex(crc):
            raise self.fail(f"tensor {name!r}: bad checksum field")
        shard = self.shard(name, d, shape, kind)
        blocks = d.get("blocks")
        if blocks is not None:
            want = 8 * block_count(end - start)
            if shard is None or not isinstance(blocks, str) or len(blocks) != want or not _is_hex(blocks):
                raise self.fail(f"tensor {name!r}: bad block checksums")
            blocks = tuple(int(blocks[i : i + 8], 16) for i in range(0, want, 8))
        return TensorInfo(name, kind, dtype, tuple(shape), start, end, int(crc, 16), shard, blocks)


def _other_metadata(meta: dict[str, Any]) -> dict[str, str]:
    """The entries of an aiosnap file's ``__metadata__`` (all strings) but aiosnap's two."""
    return {k: v for k, v in meta.items() if k not in _META_KEYS}


#: UTF-8 decoded per C call: the header of 100,000 tensors (26 MB) at once held the GIL
#: for 12 ms.
_DECODE_SLICE = 1 << 20


def _decode(raw: bytearray) -> str:
    """The header text of ``raw`` (its length prefix, then UTF-8), decoded a slice at a
    time. ``raw`` is emptied before the slices are joined, to hold two copies at most."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with memoryview(raw) as data:
        parts = [decoder.decode(data[i : i + _DECODE_SLICE]) for i in range(8, len(data), _DECODE_SLICE)]
    parts.append(decoder.decode(b"", final=True))
    try:
        raw.clear()
    except BufferError:
        # A view of ``raw`` outlived its call: a frame of the read that made it is held
        # by a profiler or a stack sampler (``benchmarks/loop_stalls.py``'s watchdog did:
        # the load failed). Only the memory bound is lost: ``raw`` goes with its caller.
        pass
    return "".join(parts)


_SEAL = f'"{CRC_KEY}":"'.encode()


def _seal(raw: bytearray) -> tuple[str, bool] | None:
    """The header checksum ``raw`` holds where the format puts it (the one value of
    ``CRC_KEY``, in compact JSON), and whether it matches ``raw``; None if the key is
    not there exactly once. ``raw`` is left as it was."""
    at = raw.find(_SEAL)
    if at < 0 or raw.find(_SEAL, at + 1) >= 0:
        return None
    at += len(_SEAL)
    stored = bytes(raw[at : at + 8])
    if len(stored) != 8 or raw[at + 8 : at + 9] != b'"':
        return None
    raw[at : at + 8] = CRC_ZERO.encode()
    computed = f"{crc32c(raw):08x}"
    raw[at : at + 8] = stored
    return stored.decode("latin-1"), computed == stored.decode("latin-1")


def _short(value: Any) -> str:
    """A value from the file, for a message: a hostile one can be megabytes long, and
    the repr of an int of thousands of digits alone takes milliseconds."""
    text = repr(value[:4])[:-1] + ", ...]" if isinstance(value, list) and len(value) > 4 else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _ints(value: Any) -> bool:
    # map(type, ...) and min in C: a generator expression costs twice as much per shape.
    return type(value) is list and (not value or (set(map(type, value)) == _INT_ONLY and min(value) >= 0))


_DOCUMENT_OPEN = f'{{"version":{FORMAT_VERSION},"checksum":"crc32c","tensors":{{'
#: The common description (a whole tensor) as the writer writes it: its name (no
#: escapes), dtype, shape (ints of at most 19 digits: a larger one is past MAX_EXTENT)
#: and checksum.
_DESCRIPTION = re.compile(
    r'"([^"\\\x00-\x1f]{0,4096})":\{"kind":"tensor","dtype":"([0-9a-z_]{1,32})",'
    r'"shape":(\[(?:(?:0|[1-9][0-9]{0,18})(?:,(?:0|[1-9][0-9]{0,18}))*)?\]),"crc32c":"([0-9a-f]{8})"\}([,}])'
)


def _document(text: str) -> dict[str, Any] | None:
    """The aiosnap document, as ``json.loads`` reads it, if the text is as the writer
    writes it; but each common description is the groups of one match of _DESCRIPTION
    (name, dtype, the shape's JSON, checksum, the character after it), not a dict of four
    keys that entries_at would look up again (~1 us per entry). Any other description is
    parsed as JSON; None for a text written otherwise (a name twice, whitespace between
    the parts): the JSON parser reads it whole."""
    if not text.startswith(_DOCUMENT_OPEN):
        return None
    pos, match = len(_DOCUMENT_OPEN), _DESCRIPTION.match
    common = _all_common(text, pos)
    if common is not None:
        (tensors, end), more = common, False
        pos = end - 1  # at the brace that closes them, as the loop leaves it
    else:
        tensors = {}
        more = not text.startswith("}", pos)
    while more:
        m = match(text, pos)
        if m is not None:  # (name, dtype, shape, crc, the "," or "}" after it)
            found = m.groups()
            name, value, pos, more = found[0], found, m.end() - 1, found[4] == ","
        else:
            name, pos = _json.loads_at(text, pos)
            if type(name) is not str or not text.startswith(":", pos):
                return None
            value, pos = _json.loads_at(text, pos + 1)
            more = text.startswith(",", pos)
            if not more and not text.startswith("}", pos):
                return None
        if name in tensors:
            return None
        tensors[name] = value
        pos += more
    if not text.startswith(',"tree":', pos + 1):
        return None
    tree, pos = _json.loads_at(text, pos + 9)
    doc = {"version": FORMAT_VERSION, "checksum": "crc32c", "tensors": tensors, "tree": tree}
    if text.startswith(',"external":', pos):
        doc["external"], pos = _json.loads_at(text, pos + 12)
    if text.startswith(',"refs":', pos):
        doc["refs"], pos = _json.loads_at(text, pos + 8)
    if text.startswith(',"blob_dir":', pos):
        doc["blob_dir"], pos = _json.loads_at(text, pos + 12)
    return doc if text[pos:] == "}" else None


def _all_common(text: str, pos: int) -> tuple[dict[str, Any], int] | None:
    """The descriptions from ``pos``, as _document gives them, if all are common ones:
    matched by a C call per window of text, not a call per description (~1 us each).
    The matches must tile the text up to the first ``,"tree":`` (which in JSON only ever
    follows a value at a key's place: never inside a string): each ends with a comma,
    the last with the brace that closes the tensors, their lengths add up to the span,
    no name comes twice. With them, where the text after them starts. Else None (the
    caller matches one description at a time)."""
    end = text.find(',"tree":', pos)
    if end <= pos:
        return None
    found: list[tuple[str, ...]] = []
    at, findall = pos, _DESCRIPTION.findall
    while at < end:
        # A window ends after a description's comma, where the next name's quote opens:
        # one C call holds the GIL, and over 100,000 descriptions stalled the event
        # loop for 50 ms. A cut elsewhere (inside an uncommon description) leaves some
        # text unmatched, which the lengths below find.
        cut = text.find('"},"', at + _WINDOW, end)
        cut = end if cut < 0 else cut + 3
        found += findall(text, at, cut)
        at = cut
    if not found or found[-1][4] != "}" or list(map(_LAST, found)).count(",") != len(found) - 1:
        return None
    # A match is its name, dtype and shape, and _FIXED characters more; matches lie
    # within their window, apart, so the lengths add up to the span only if they tile it.
    varying = sum(map(len, map(_NAME, found))) + sum(map(len, map(_DTYPE, found)))
    if varying + sum(map(len, map(_SHAPE, found))) + _FIXED * len(found) != end - pos:
        return None
    tensors = zip_dict(list(map(_NAME, found)), found)
    return (tensors, end) if len(tensors) == len(found) else None


#: Characters of text matched per C call (~700 descriptions, ~0.3 ms).
_WINDOW = 1 << 16


_NAME, _DTYPE, _SHAPE, _LAST = (operator.itemgetter(i) for i in (0, 1, 2, 4))
#: The characters of a _DESCRIPTION match beside its name, dtype and shape: quotes,
#: keys, the checksum's 8 digits, and the comma or brace after it.
_FIXED = len('"":{"kind":"tensor","dtype":"","shape":,"crc32c":"01234567"}}')


def _ints_of(shape: str) -> list[int]:
    """The ints of a shape's JSON as _DESCRIPTION matches it."""
    return [int(n) for n in shape[1:-1].split(",")] if shape != "[]" else []


#: A whole tensor's (dtype, shape) as entries_at takes it: the shape, the dtype's
#: safetensors code, the shape's JSON and the entry's bytes.
_Common = tuple[tuple[int, ...], str, str, int]


def _common(dtype: str, shape: list[Any]) -> _Common | None:
    """None if the dtype has no safetensors code of its own or the shape is not one."""
    code = _dtypes.native_st_code(dtype)
    size = None if code is None or not _ints(shape) else nbytes(shape, _dtypes.ST_BITS[code] // 8)
    return None if size is None or code is None else (tuple(shape), code, _int_list(shape), size)


def _whole_description(d: Any) -> tuple[str, Any, str] | None:
    """The dtype, shape and checksum of a whole tensor's description whose keys, dtype and
    checksum are well formed; None for any other. The shape is the caller's to check:
    ``_ints``, or ``_common`` once per shape."""
    if type(d) is not dict or d.keys() != _WHOLE_TENSOR_KEYS or d["kind"] != "tensor":
        return None
    dtype, shape, crc = d["dtype"], d["shape"], d["crc32c"]
    if type(dtype) is not str or type(crc) is not str or len(crc) != 8 or not _is_hex(crc):
        return None
    return dtype, shape, crc


def _whole_tensor(d: Any) -> tuple[list[int], str, int] | None:
    """The shape, safetensors code and checksum of the common description: a whole
    tensor of a dtype safetensors has a code for, well formed; None for any other."""
    whole = _whole_description(d)
    if whole is None:
        return None
    dtype, shape, crc = whole
    code = _dtypes.native_st_code(dtype)
    if code is None or not _ints(shape):
        return None
    return shape, code, int(crc, 16)


def _is_hex(s: str) -> bool:
    return not s.strip("0123456789abcdef")


_INT_ONLY = {int}
#: A rank's blob folder in a directory of step directories (``Header.blob_dir``).
_RANK_DIR = re.compile(r"rank_[0-9]{5}")
_MISS: Any = object()
_META_OPEN = '{"__metadata__":'
_META_KEYS = frozenset((META_KEY, CRC_KEY))
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))
_WHOLE_TENSOR_KEYS = frozenset(("kind", "dtype", "shape", "crc32c"))
