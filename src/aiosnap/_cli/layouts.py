"""The checkpoints aiosnap's trainer integrations write, as the command line finds them.

No CheckpointManager keeps these directories (no index, no name template), so the
commands recognise them by what each integration writes:

- **Hugging Face Trainer** (``integrations.transformers``): ``checkpoint-N/`` folders, N
  the global step, each holding ``state.aiosnap`` (the training state; the model too, in
  checkpoints of the earlier layout), ``model.safetensors`` (an aiosnap file; the only
  one with ``save_only_model``) and ``trainer_state.json`` (the epoch, as a fraction, and
  what was logged at that step); the commands show ``state.aiosnap`` where there is one;
- **Accelerate** (``integrations.accelerate``): ``checkpoint_N/`` folders, N the save's
  number, each holding ``state.aiosnap``, under ``project_dir/checkpoints``;
- **Lightning** (``integrations.lightning``): ``*.ckpt`` files that are aiosnap files
  (``epoch=E-step=S.ckpt``, ``last.ckpt`` or any ``filename=``): the step and epoch are
  read off the file's header (``global_step``, ``epoch``), other ``key=value`` pairs of
  the name are metrics.

pytorch-pfn-extras' ``snapshot_iter_N`` files are the manager's default name and need
nothing here. A directory holding none of these, but a ``checkpoints/`` folder that
does (Accelerate's ``project_dir``, Lightning's ``lightning_logs/version_0``), is read
there. Every function blocks: callers run them in worker threads.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from .._base.errors import CheckpointError
from .._base.names import template
from .._format.codec import read_header, written_by_aiosnap
from .._format.nodes import decode_key, dict_items
from .._storage.protocol import Entry, Storage, get

#: The aiosnap file of an integration's checkpoint folder (the integrations' STATE_NAME).
STATE_NAME = "state.aiosnap"
#: The weights of a Hugging Face Trainer's checkpoint folder (the integration's MODEL_NAME):
#: a folder's aiosnap file where it holds no STATE_NAME (``save_only_model``).
MODEL_NAME = "model.safetensors"
#: The Trainer's own record of a checkpoint, beside its state.
TRAINER_STATE = "trainer_state.json"
#: Where Accelerate (``project_dir``) and Lightning (a logger's version folder) put them.
SUBFOLDER = "checkpoints"
_FOLDERS = (
    ("transformers", "Hugging Face Trainer", re.compile(r"checkpoint-(?P<step>\d+)")),
    ("accelerate", "Accelerate", re.compile(r"checkpoint_(?P<step>\d+)")),
)
_CKPT = ".ckpt"
#: What the command line looks for, in words.
DESCRIBED = (
    f"checkpoint-N/ or checkpoint_N/ folders holding {STATE_NAME} (or an aiosnap {MODEL_NAME}), "
    f"aiosnap {_CKPT} files, here or in {SUBFOLDER}/"
)
#: ``key=number`` in a Lightning file name (``epoch=2-step=24-val_loss=0.52``).
_PAIR = re.compile(r"(?:^|-)(?P<key>[A-Za-z_][\w/.]*?)=(?P<value>-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)(?=-|$)")


@dataclass(frozen=True, slots=True)
class Item:
    """One checkpoint of an integration's layout."""

    name: str  # the folder or file, in the layout's directory
    path: str  # the aiosnap file that holds it
    step: int | None
    epoch: int | float | None
    size: int
    metrics: dict[str, Any] = field(default_factory=dict)
    corrupt: str | None = None  # why its header cannot be read


@dataclass(frozen=True, slots=True)
class Layout:
    """The checkpoints of one integration in ``directory``, by step."""

    kind: str  # transformers, accelerate, lightning
    title: str  # what the user knows it as
    directory: str
    items: list[Item]


def find(storage: Storage, directory: str, name: str | None) -> Layout | None:
    """The integration checkpoints of ``directory`` (or of its ``checkpoints/``
    folder); with ``name``, only folders named like that template. None if there are none."""
    entries = storage.list(directory)
    found = _scan(storage, directory, entries, name)
    if found is None and name is None and any(e.is_dir and e.name == SUBFOLDER for e in entries):
        below = storage.join(directory, SUBFOLDER)
        found = _scan(storage, below, storage.list(below), None)
    return found


def folder_state(storage: Storage, folder: str) -> str | None:
    """The aiosnap file of an integration's checkpoint folder, if ``folder`` is one: its
    ``state.aiosnap``, else a ``model.safetensors`` that aiosnap wrote (the Trainer's own
    checkpoints hold a plain one, and are not aiosnap's)."""
    path = storage.join(folder, STATE_NAME)
    entry = storage.stat(path)
    if entry is not None and entry.is_file:
        return path
    path = storage.join(folder, MODEL_NAME)
    entry = storage.stat(path)
    if entry is None or not entry.is_file:
        return None
    f = storage.open_read(path)
    try:
        return path if written_by_aiosnap(f) else None
    finally:
        f.close()


def _scan(storage: Storage, directory: str, entries: list[Entry], name: str | None) -> Layout | None:
    for kind, title, pattern in _FOLDERS:
        items = _folders(storage, directory, entries, pattern if name is None else template(name))
        if items:
            return Layout(kind, title, directory, items)
        if name is not None:
            return None  # one template: the folders named by it, or nothing
    items = _lightning(storage, directory, entries)
    return Layout("lightning", "Lightning", directory, items) if items else None


def _folders(storage: Storage, directory: str, entries: list[Entry], pattern: re.Pattern[str]) -> list[Item]:
    items = []
    for entry in entries:
        match = pattern.fullmatch(entry.name) if entry.is_dir else None
        folder = storage.join(directory, entry.name) if match else None
        state = None if folder is None else folder_state(storage, folder)
        if match is None or folder is None or state is None:
            continue  # a folder the Trainer itself wrote, or something else: not aiosnap's
        stat = storage.stat(state)
        size = 0 if stat is None else stat.size
        epoch, metrics = _trainer_state(storage, folder, int(match.group("step")))
        groups = match.groupdict()
        if groups.get("epoch") is not None:
            epoch = int(groups["epoch"])
        items.append(Item(entry.name, state, int(match.group("step")), epoch, size, metrics))
    return sorted(items, key=lambda i: (i.step or 0, i.name))


def _trainer_state(storage: Storage, folder: str, step: int) -> tuple[float | None, dict[str, Any]]:
    """The epoch (a fraction) and what the Trainer logged at ``step``, from its
    ``trainer_state.json`` (nothing, where it is missing or unreadable)."""
    try:
        state = json.loads(get(storage, storage.join(folder, TRAINER_STATE)))
        epoch, history = state.get("epoch"), state.get("log_history", [])
    except (CheckpointError, OSError, ValueError, AttributeError):
        return None, {}
    metrics: dict[str, Any] = {}
    for logged in history if isinstance(history, list) else []:
        if isinstance(logged, dict) and logged.get("step") == step:
            metrics |= {
                k: v
                for k, v in logged.items()
                if k not in ("step", "epoch") and isinstance(v, (int, float)) and not isinstance(v, bool)
            }
    number = isinstance(epoch, (int, float)) and not isinstance(epoch, bool) and math.isfinite(epoch)
    return (epoch if number else None), metrics


def _lightning(storage: Storage, directory: str, entries: list[Entry]) -> list[Item]:
    items = []
    for entry in entries:
        if entry.is_file and entry.name.endswith(_CKPT):
            item = _ckpt(storage, storage.join(directory, entry.name), entry)
            if item is not None:
                items.append(item)
    return sorted(items, key=lambda i: (-1 if i.step is None else i.step, i.name))


def _ckpt(storage: Storage, path: str, entry: Entry) -> Item | None:
    """A ``.ckpt`` file, if aiosnap wrote it (Lightning's own are torch.save files)."""
    pairs = {m["key"]: m["value"] for m in _PAIR.finditer(entry.name[: -len(_CKPT)])}
    step = int(pairs["step"]) if pairs.get("step", "").isdigit() else None
    epoch: int | None = int(pairs["epoch"]) if pairs.get("epoch", "").isdigit() else None
    metrics = {k: float(v) for k, v in pairs.items() if k not in ("step", "epoch")}
    f = storage.open_read(path)
    try:
        if not written_by_aiosnap(f):
            return None
        try:
            header = read_header(f)
        except CheckpointError as exc:
            return Item(entry.name, path, step, epoch, entry.size, metrics, str(exc))
    finally:
        f.close()
    saved = _counters(header.tree)
    step, epoch = saved.get("global_step", step), saved.get("epoch", epoch)
    return Item(entry.name, path, step, epoch, entry.size, metrics)


def _counters(tree: Any) -> dict[object, int]:
    """Lightning's ``global_step`` and ``epoch``: whole numbers at the root of the tree
    (plain values, which the header holds as themselves)."""
    if not isinstance(tree, dict) or tree.get("$") != "dict":
        return {}
    found: dict[object, int] = {}
    try:
        for key_node, value in dict_items(tree):
            key = decode_key(key_node)
            if key in ("global_step", "epoch") and type(value) is int and value >= 0:
                found[key] = value
    except ValueError:  # a malformed tree: verify says how
        return {}
    return found
