"""``aiosnap convert``: read a state in one format, write it in another.

Read: an aiosnap file or step directory (a step loads whole, its DTensors assembled),
a plain safetensors file, a torch.save file and a torch.distributed.checkpoint (DCP)
directory; the last two only with the pickle opt-in (torch.load runs pickled code, and
DCP's ``.metadata`` is a pickle). Written: an aiosnap file, a plain safetensors file
(flattened: dotted names, no aiosnap metadata, written here so the ``safetensors``
package is not needed), or a DCP directory (through DCP's own writer, with no process
group).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from ._api import save_sync
from ._cli_dirs import Located, locate
from ._cli_entries import pickle_hint, walk_object
from ._dtypes import ST_TORCH, numpy_st_code
from ._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, PickleNotAllowedError
from ._format import read_header, sniff
from ._load import load_blocking
from ._local import LocalStorage
from ._storage import Storage
from ._tree import format_path, walk_leaves

Format = Literal["aiosnap", "safetensors", "dcp"]
#: A tensor of a safetensors file: name, dtype code, shape, its bytes (flat uint8).
StEntry = tuple[str, str, list[int], np.ndarray[Any, Any]]
_ST_CODES = {dtype: code for code, dtype in ST_TORCH.items()}


@dataclass(slots=True)
class Converted:
    source: str  # the format read
    tensors: int
    bytes: int
    notes: list[str] = field(default_factory=list)


def convert(src: str, dst: str, to: Format, *, allow_pickle: bool, force: bool) -> Converted:
    """Read ``src`` whole and write it to ``dst`` as ``to``. Blocking."""
    place = locate(src)
    _refuse_existing(dst, to, force)
    state, source = read_state(place, allow_pickle)
    tensors = [v for _, v in walk_object(state) if isinstance(v, (torch.Tensor, np.ndarray))]
    done = Converted(source, len(tensors), sum(_nbytes(t) for t in tensors))
    if to == "aiosnap":
        save_sync(dst, state, allow_pickle=allow_pickle)
        done.notes += _pickled(dst)
    elif to == "safetensors":
        done.notes += write_safetensors(dst, state)
    else:
        write_dcp(dst, state)
    return done


def read_state(place: Located, allow_pickle: bool) -> tuple[Any, str]:
    """The whole state at ``place``, and the format it was read from."""
    if place.kind == "dcp":
        return read_dcp(place, allow_pickle), "dcp"
    if place.kind == "directory":
        raise CheckpointError(f"{place.path} is a directory of checkpoints: name one of them (aiosnap ls)")
    source = "aiosnap step" if place.kind == "step" else _file_format(place)
    if source.startswith("torch.save") and not allow_pickle:
        raise PickleNotAllowedError(pickle_hint(place.path))
    try:
        return load_blocking(place.storage, place.path, None, None, allow_pickle), source
    except PickleNotAllowedError as exc:
        raise PickleNotAllowedError(f"{exc} (pass --allow-pickle if you trust it)") from None


def _file_format(place: Located) -> str:
    f = place.storage.open_read(place.path)
    try:
        foreign = sniff(f)
        if foreign is not None:
            return foreign
        return "aiosnap" if read_header(f).tree is not None else "safetensors"
    finally:
        f.close()


def _refuse_existing(dst: str, to: Format, force: bool) -> None:
    try:
        found = locate(dst)
    except CheckpointNotFoundError:
        return
    if not force:
        raise CheckpointError(f"{dst} exists: pass --force to replace it")
    if (found.kind == "file") != (to != "dcp"):
        raise CheckpointError(f"{dst} exists and is a {found.kind}, which a {to} output would not replace")


def _nbytes(value: torch.Tensor | np.ndarray[Any, Any]) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return int(value.nbytes)


def _pickled(path: str) -> list[str]:
    """A note naming the values an aiosnap file stores pickled, if any."""
    place = locate(path)
    f = place.storage.open_read(place.path)
    try:
        tree = read_header(f).tree
    finally:
        f.close()
    paths = [format_path(p) for p, kind, _ in walk_leaves(tree) if kind == "pickle"]
    if not paths:
        return []
    shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    return [f"{len(paths)} value(s) of no state type were stored pickled: {shown}"]


# -- safetensors ---------------------------------------------------------------------------------


def write_safetensors(dst: str, state: Any) -> list[str]:
    """Write the tensors and arrays of ``state`` as a plain safetensors file, named by
    their dotted paths; plain values that JSON holds go to ``__metadata__`` (as JSON
    text), others are left out. Returns notes on what was left out. Blocking."""
    from ._backends import resolve

    entries: list[StEntry] = []
    meta: dict[str, str] = {"format": "pt"}
    left_out: list[str] = []
    names: set[str] = set()
    for path, value in walk_object(state):
        name = _unique(format_path(path), names)
        if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
            entries.append(_st_entry(name, value))
            continue
        try:
            meta[name] = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            left_out.append(name)
    storage, where = resolve(dst)
    _write_st(storage, where, entries, meta)
    if not left_out:
        return []
    return [f"left out {len(left_out)} value(s) that are neither tensors nor JSON: {', '.join(left_out[:5])}"]


def _unique(name: str, names: set[str]) -> str:
    base, n = name, 1
    while name in names or name == "__metadata__":
        n += 1
        name = f"{base}#{n}"
    names.add(name)
    return name


def _st_entry(name: str, value: Any) -> StEntry:
    """(name, safetensors dtype code, shape, the bytes as a flat uint8 array)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        code = _ST_CODES.get(t.dtype)
        if code is None:
            raise CheckpointError(f"{name}: safetensors has no dtype for {t.dtype}")
        flat = t.reshape(-1)
        raw = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
        return name, code, list(t.shape), raw
    a = np.ascontiguousarray(value)
    code = numpy_st_code(a.dtype)
    if code == "U8" and a.dtype.str != "|u1":
        raise CheckpointError(f"{name}: safetensors has no dtype for NumPy {a.dtype.str}")
    return name, code, list(a.shape), a.reshape(-1).view(np.uint8)


def _write_st(storage: Storage, path: str, entries: list[StEntry], meta: dict[str, str]) -> None:
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, code, shape, raw in entries:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + raw.nbytes]}
        offset += raw.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data section starts 8-aligned, as safetensors does
    prefix = len(text).to_bytes(8, "little") + text
    upload = storage.create(path, len(prefix) + offset)
    try:
        upload.write_at(0, memoryview(prefix))
        pos = len(prefix)
        for _, _, _, raw in entries:
            if raw.nbytes:
                upload.write_at(pos, memoryview(raw))  # type: ignore[arg-type]
            pos += raw.nbytes
        upload.commit()
    except BaseException:
        upload.abort()
        raise


# -- torch.distributed.checkpoint ------------------------------------------------------------------


def _local_dcp(place_or_path: Located | str) -> str:
    if isinstance(place_or_path, str):
        from ._backends import resolve

        storage, path = resolve(place_or_path)
    else:
        storage, path = place_or_path.storage, place_or_path.path
    if not isinstance(storage, LocalStorage):
        raise CheckpointError(f"{path}: DCP directories are read and written on a local file system only")
    return path


def read_dcp(place: Located, allow_pickle: bool) -> Any:
    """A DCP directory loaded whole in this process (no process group). Blocking."""
    path = _local_dcp(place)
    if not allow_pickle:
        raise PickleNotAllowedError(
            f"{path} is a torch.distributed.checkpoint directory: its .metadata is a pickle, and "
            "reading it runs code from the file; pass --allow-pickle if you trust it"
        )
    try:
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner  # type: ignore[attr-defined]
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    except ImportError as exc:
        raise CheckpointError(f"reading DCP needs torch.distributed.checkpoint ({exc})") from None
    state: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns of every call without a process group
            reader = FileSystemReader(path)
            planner = _EmptyStateDictLoadPlanner()  # type: ignore[no-untyped-call]
            _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    except Exception as exc:  # what DCP raises for a damaged directory varies
        raise CorruptCheckpointError(path, f"DCP could not read it ({type(exc).__name__}: {exc})") from None
    return state


def write_dcp(dst: str, state: Any) -> None:
    """Save ``state`` (a dict) as a DCP directory, with no process group. Blocking."""
    path = _local_dcp(dst)
    if not isinstance(state, dict):
        raise CheckpointError(f"DCP saves a dict, and this state is a {type(state).__name__}")
    from torch.distributed.checkpoint.state_dict_saver import save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save(state, checkpoint_id=path, no_dist=True)
