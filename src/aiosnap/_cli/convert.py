"""``aiosnap convert``: read a state in one format, write it in another.

Read: an aiosnap file or step directory (a step loads whole, its DTensors assembled),
a plain safetensors file (as the tree ``convert`` kept in it, if it did), a torch.save
file and a torch.distributed.checkpoint (DCP) directory; the last two only with the
pickle opt-in (torch.load runs pickled code, and DCP's ``.metadata`` is a pickle).
Written: an aiosnap file, a plain safetensors file (``_cli_safetensors``), a torch.save
file, or a DCP directory (through DCP's own writer, with no process group).

The output format is ``--to``, or else the one DST's extension names (``.pt``, ``.pth``,
``.bin``: torch.save; ``.safetensors``), else aiosnap. An extension that names another
format than ``--to`` is refused: ``convert ckpt out.pt --to aiosnap`` would write a file
that ``torch.load`` cannot read. An aiosnap file is a safetensors file, so
``--to aiosnap`` may write ``*.safetensors``.

A file's own ``__metadata__`` entries (a safetensors file's, or those an aiosnap file
keeps beside its own) go with it to an aiosnap or safetensors file; torch.save files and
DCP directories have no place for them, and a note says so.
"""

from __future__ import annotations

import collections
import functools
import warnings
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Literal

import numpy as np
import torch

from .._api import save_sync
from .._base.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    PickleNotAllowedError,
)
from .._format.codec import read_header, sniff
from .._format.header import DEFAULT_METADATA
from .._format.tree import WithMetadata, format_path, walk_leaves
from .._load.load import load_blocking
from .._load.standalone import standalone_now
from .._storage.backends import resolve
from .._storage.local import LocalStorage
from .._storage.protocol import write_with
from . import dcp_keys
from .dirs import Located, locate
from .entries import pickle_hint, walk_object
from .safetensors import rebuild_state, saved_tree, user_metadata, write_safetensors
from .select import plain_value

Format = Literal["aiosnap", "safetensors", "torch", "dcp"]
#: The output format a file extension names.
EXTENSIONS: dict[str, Format] = {
    ".pt": "torch",
    ".pth": "torch",
    ".bin": "torch",
    ".safetensors": "safetensors",
}
_WHAT: dict[Format, str] = {
    "aiosnap": "an aiosnap file",
    "safetensors": "a plain safetensors file",
    "torch": "a torch.save file",
    "dcp": "a DCP directory",
}


@dataclass(slots=True)
class Converted:
    source: str  # the format read
    target: Format  # the format written
    tensors: int
    bytes: int
    notes: list[str] = field(default_factory=list)


def output_format(dst: str, to: Format | None) -> Format:
    """The format ``dst`` is written in: ``to``, or what its extension names, else
    aiosnap. CheckpointError if the extension names another format than ``to``."""
    suffix = PurePosixPath(dst.rstrip("/")).suffix.lower()
    named = EXTENSIONS.get(suffix)
    if to is None:
        return named or "aiosnap"
    if named is None or named == to or (named, to) == ("safetensors", "aiosnap"):
        return to
    raise CheckpointError(
        f"{dst} ends in {suffix}, the extension of {_WHAT[named]}, but --to {to} writes {_WHAT[to]}: "
        f"name it otherwise, or pass --to {named}"
    )


def convert(
    src: str, dst: str, to: Format | None, *, allow_pickle: bool, force: bool, standalone: bool = False
) -> Converted:
    """Read ``src`` whole and write it to ``dst`` as ``to`` (see output_format). Blocking.
    ``standalone``: copy an aiosnap file with the entries it refers to (an incremental
    save's blobs) stored in it, byte for byte, checksums included."""
    target = output_format(dst, to)
    if standalone and target != "aiosnap":
        raise CheckpointError(f"--standalone writes an aiosnap file, not {_WHAT[target]}")
    place = locate(src)
    _refuse_existing(dst, target, force)
    if standalone:
        return _standalone(place, dst)
    state, source = read_state(place, allow_pickle)
    meta = source_metadata(place) if place.kind == "file" and source in _HEADED else {}
    tensors = [v for _, v in walk_object(state) if isinstance(v, (torch.Tensor, np.ndarray))]
    done = Converted(source, target, len(tensors), sum(_nbytes(t) for t in tensors))
    if target == "aiosnap":
        kept = WithMetadata(state, {**DEFAULT_METADATA, **meta}) if meta else state
        save_sync(dst, kept, allow_pickle=allow_pickle)
        done.notes += _pickled(dst)
    elif target == "safetensors":
        done.notes += write_safetensors(dst, state, meta)
    else:
        if target == "torch":
            storage, where = resolve(dst)
            write_with(storage, where, functools.partial(_torch_save, state))
            done.notes += _not_weights_only(state)
        else:
            done.notes += write_dcp(dst, state)
        lost = sorted(k for k, v in meta.items() if (k, v) not in DEFAULT_METADATA.items())
        if lost:
            done.notes.append(
                f"not kept: {src}'s __metadata__ entries {', '.join(lost)} ({_WHAT[target]} has none)"
            )
    return done


#: Sources read from a file with a safetensors header, whose __metadata__ is kept.
_HEADED = ("aiosnap", "safetensors", "safetensors with its tree")


def source_metadata(place: Located) -> dict[str, str]:
    """The ``__metadata__`` entries of the file at ``place`` that a conversion keeps (all
    but aiosnap's own). Blocking."""
    f = place.storage.open_read(place.path)
    try:
        return user_metadata(read_header(f).metadata)
    finally:
        f.close()


def _standalone(place: Located, dst: str) -> Converted:
    if place.kind != "file":
        raise CheckpointError(f"{place.path}: --standalone copies one checkpoint file")
    f = place.storage.open_read(place.path)
    try:
        header = read_header(f)
    finally:
        f.close()
    times = standalone_now(place.path, dst, place.storage)
    kept = len(header.tensors) + len(header.refs)
    notes = [f"{len(header.refs)} entries copied in from blobs"] if header.refs else []
    return Converted("aiosnap", "aiosnap", kept, times.bytes, notes)


def _torch_save(state: Any, path: str) -> None:
    torch.save(state, path)


def _not_weights_only(state: Any) -> list[str]:
    """A note naming what ``torch.load``'s default ``weights_only=True`` refuses."""
    refused = [format_path(p) for p, v in walk_object(state) if not _weights_only(v)]
    if not refused:
        return []
    shown = ", ".join(refused[:5]) + (f" and {len(refused) - 5} more" if len(refused) > 5 else "")
    return [
        f"{len(refused)} value(s) are NumPy values or objects ({shown}): torch.load refuses them with its "
        "default weights_only=True; pass weights_only=False if you trust the file"
    ]


def _weights_only(value: Any) -> bool:
    # An empty container is a leaf of walk_object; torch.load's weights_only takes it.
    empty = type(value) in (dict, list, tuple, collections.OrderedDict) and not value
    return empty or isinstance(value, (torch.Tensor, torch.Size, bytes, bytearray)) or plain_value(value)


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
        state = load_blocking(place.storage, place.path, None, None, allow_pickle)
    except PickleNotAllowedError as exc:
        raise PickleNotAllowedError(f"{exc} (pass --allow-pickle if you trust it)") from None
    if source == "safetensors":
        tree = saved_tree(place.storage, place.path)
        if tree is not None:
            return rebuild_state(place.path, tree, state), "safetensors with its tree"
    return state, source


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


# -- torch.distributed.checkpoint ------------------------------------------------------------------


def _local_dcp(place_or_path: Located | str) -> str:
    if isinstance(place_or_path, str):
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
    return dcp_keys.restore(path, state)  # its keys of their types again, if aiosnap wrote it


def write_dcp(dst: str, state: Any) -> list[str]:
    """Save ``state`` (a dict) as a DCP directory, with no process group, and the types
    of its keys beside it (see ``dcp_keys``). Blocking. Notes for the user."""
    path = _local_dcp(dst)
    if not isinstance(state, dict):
        raise CheckpointError(f"DCP saves a dict, and this state is a {type(state).__name__}")
    from torch.distributed.checkpoint.state_dict_saver import save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metadata = save(state, checkpoint_id=path, no_dist=True)
    return dcp_keys.record(path, state, metadata.planner_data)
