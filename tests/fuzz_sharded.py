"""Sharded group steps for the fuzzer (``sharded`` cases): DTensor boxes behind valid checksums.

A seed step is saved once per run, as a group of 4 would save it, in one process: each
rank's DTensors are made on a DeviceMesh that knows its rank but has no process group
(``_init_backend=False``), saved with ``aiosnap.save`` (the capture the manager runs,
replicated globs external on ranks > 0), and the manifest is what rank 0 commits from
the ranks' reports (``file_report``, ``_decisions.commit``). Uneven and empty shards,
a replicated DTensor stored once, a 2x2 mesh, bf16, shards over 1 MiB with block
checksums, an all-empty DTensor, replicated and per-rank plain leaves.

Each case mutates the manifest (its shard index: boxes' offsets, lengths, files and
entry names, dtypes and shapes up to allocation bombs, the tree paths, ``per_rank``,
the files) or rank files (``shard`` and ``blocks`` metadata, bytes inside a block with
or without their block checksums, dtypes, dtensor nodes, truncation, and any mutation
of the single-file fuzzer), then seals both again (the rank files' header checksums,
the manifest's record of them and its crc32c) unless the mutation is the seal.

The step is read as a user can: ``load`` (a group of one), ``load(rank=N)``, a restore
as rank r of a group of w (no target, DTensors of a mesh of w, whole tensors),
``verify``. Beyond "only CheckpointErrors", the oracles: every read that succeeded
gives the same bytes for each DTensor (a DTensor target's local shard is the box of
the whole), a whole read returns each DTensor at its whole shape, a step ``verify``
accepts is not refused as corrupt by any read, and a bit flipped inside a block
behind its block checksums is refused naming the file.

White-box: seeds are made and mutated with the format's own pieces (the manifest, the
header, rank 0's commit decision, the reports ranks send), so it imports aiosnap's private
modules.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import string
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import aiosnap
from aiosnap._base.checksums import crc32c
from aiosnap._base.typed import decode
from aiosnap._dist.decisions import commit
from aiosnap._format.codec import read_header
from aiosnap._format.grids import Grid, grid_problem
from aiosnap._format.header import BLOCK, CRC_KEY
from aiosnap._format.manifest import Manifest, rank_file, read_manifest, replicated_matcher
from aiosnap._format.tree import ExternalLeaves, format_path, walk_leaves
from aiosnap._load.load import Step, load_step
from aiosnap._manager.step_dirs import file_report
from aiosnap.storage import MANIFEST_NAME

from . import hostile
from .fuzz import (
    BIG_INTS,
    DTYPE_NAMES,
    MUTATIONS,
    ODD_STRINGS,
    Call,
    Case,
    Doc,
    Edit,
    Seed,
    _manifest_junk,
    _nodes,
    _sorted,
    junk,
    render,
    shape_value,
)
from .hostile import Raw

WORLD = 4
REPLICATED = ["shared"]
#: float32s in a row of "big": 1 MiB and 800 bytes, so its shards carry block checksums.
BIG = 262_200
#: name -> (whole shape, dtype, placements at save: "flat" mesh of WORLD or the 2x2 "grid").
LAYOUT: dict[str, tuple[tuple[int, ...], torch.dtype, str, str]] = {
    "row": ((10, 6), torch.float32, "flat", "S0"),  # 3, 3, 3, 1 rows
    "col": ((8, 6), torch.float32, "flat", "S1"),  # 2, 2, 2, 0 columns: an empty shard
    "rep": ((5, 5), torch.float64, "flat", "R"),  # stored once, by rank 0
    "grid": ((8, 6), torch.float32, "grid", "S0,S1"),
    "bf16": ((6, 4), torch.bfloat16, "grid", "R,S0"),  # stored by ranks 0 and 1
    "big": ((2, BIG), torch.float32, "flat", "S0"),  # 1 row on ranks 0 and 1, none on 2 and 3
    "empty": ((0, 4), torch.float32, "flat", "S1"),  # no bytes anywhere: not in the index
}
#: Placements of a restore's DTensor targets (on a 1-D mesh of the group; "grid" on 2x2 at 4).
TARGET = {"row": "S1", "col": "S0", "rep": "S0", "grid": "S1,S0", "bf16": "S1", "big": "S1", "empty": "S0"}
#: Dtypes of other sizes or kinds a manifest may claim for a DTensor.
SAME_BYTES = ["int32", "uint32", "float16", "bfloat16", "float64"]
#: (rank, world) of the restores into DTensors: the cases draw one.
COMBOS = [(0, 1), (1, 2), (0, 3), (2, 3), (3, 4), (1, 4), (5, 8)]
#: What a DTensor target holds before a restore: a byte no seed value is made of.
SENTINEL = 0xA5


def whole(name: str) -> torch.Tensor:
    shape, dtype, _, _ = LAYOUT[name]
    n = math.prod(shape)
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * 0.5 + len(name)).to(dtype)


def _mesh(shape: tuple[int, ...], rank: int) -> Any:
    """A mesh as rank ``rank`` of a group sees it, with no process group behind it: the
    boxes of DTensors on it are what they would be in a real group of that size."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(math.prod(shape)).reshape(shape)
    return DeviceMesh("cpu", ranks, _init_backend=False, _rank=rank)


def _placements(spec: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1])) for p in spec.split(",")]


def dtensor(value: torch.Tensor, mesh: Any, spec: str) -> Any:
    """This rank's DTensor of the whole ``value``: its local box, no communication."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = _placements(spec)
    shape, offset = compute_local_shape_and_global_offset(value.shape, mesh, placements)
    local = value[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))].clone()
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=value.shape, stride=value.stride()
    )


def rank_state(rank: int) -> dict[str, Any]:
    meshes = {"flat": _mesh((WORLD,), rank), "grid": _mesh((2, 2), rank)}
    dt = {name: dtensor(whole(name), meshes[m], spec) for name, (_, _, m, spec) in LAYOUT.items()}
    return {
        "dt": dt,
        "tied": dt["row"],  # one DTensor at two paths: indexed at both, read once
        "shared": torch.ones(3),  # replicated: stored by rank 0, external on the others
        "arr": np.arange(4),  # the same on every rank, stored by each
        "step": 7,
        "rank": rank,  # per-rank
        "opt": {"m": torch.full((2,), float(rank))},  # per-rank
    }


def targets(rank: int, world: int) -> dict[str, Any]:
    """Zero DTensors (filled with SENTINEL before each use) to restore into, as rank
    ``rank`` of a group of ``world``."""
    meshes = {"flat": _mesh((world,), rank), "grid": _mesh((2, 2), rank) if world == 4 else None}
    out = {}
    for name, spec in TARGET.items():
        grid = "," in spec and meshes["grid"] is not None
        mesh = meshes["grid"] if grid else meshes["flat"]
        out[name] = dtensor(torch.zeros_like(whole(name)), mesh, spec if grid else spec.split(",")[0])
    return {"dt": out}


def plain_target() -> dict[str, Any]:
    return {"dt": {name: torch.zeros_like(whole(name)) for name in LAYOUT}}


@dataclass
class StepSeed:
    """The valid step: each rank file's bytes (and taken apart), the manifest's."""

    files: dict[str, bytes]
    manifest: bytes
    seeds: dict[str, Seed] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.seeds = {n: Seed(n, raw, [], lambda: None) for n, raw in self.files.items()}


async def make_step(directory: Path) -> StepSeed:
    """Save the seed step into ``directory`` as 4 ranks and their rank 0 would."""
    directory.mkdir(parents=True, exist_ok=True)
    storage, matches = aiosnap.storage.LocalStorage(), replicated_matcher(REPLICATED)
    reports = []
    for rank in range(WORLD):
        path = str(directory / rank_file(rank))
        state = rank_state(rank)
        await aiosnap.save(path, state if rank == 0 else ExternalLeaves(state, matches))
        reports.append(file_report(storage, path, REPLICATED, rank == 0, True))
    manifest = commit(7, None, reports, REPLICATED)
    assert manifest is not None
    (directory / MANIFEST_NAME).write_bytes(manifest.to_bytes())
    files = {rank_file(r): (directory / rank_file(r)).read_bytes() for r in range(WORLD)}
    return StepSeed(files, manifest.to_bytes())


# -- mutations ------------------------------------------------------------------------------


class StepEdit:
    """A mutation context: the manifest (taken apart), the rank files edited so far."""

    def __init__(self, rng: random.Random, seed: StepSeed, marker: str) -> None:
        self.rng, self.seed, self.marker = rng, seed, marker
        self.outer: Any = json.loads(seed.manifest)
        self.edits: dict[str, Edit] = {}
        self.post: dict[str, list[Callable[[bytes], bytes]]] = {}
        self.stale: set[str] = set()  # rank files whose new header checksum the manifest keeps out
        self.reseal = True
        self.flipped: str | None = None  # a file with a byte changed behind its block checksums
        self.raw_manifest: bytes | None = None

    @property
    def body(self) -> Any:
        return self.outer.get("body") if isinstance(self.outer, dict) else None

    def shards(self) -> dict[str, Any] | None:
        body = self.body
        shards = body.get("shards") if isinstance(body, dict) else None
        return shards if isinstance(shards, dict) else None

    def saved(self, listed: bool = False) -> tuple[str, dict[str, Any]] | None:
        """A DTensor's entry of the index; ``listed``: its grid (if it has one) replaced
        by the boxes it gives, so that mutations of boxes have some to work on."""
        shards = self.shards()
        if not shards:
            return None
        path = self.rng.choice(list(shards))
        saved = shards[path]
        if not isinstance(saved, dict):
            return None
        if listed and isinstance(saved.get("grid"), dict):
            try:  # only a grid as the seed has it (a mutated one could claim any number of boxes)
                grid = decode(Grid, saved["grid"])
                valid = not grid_problem(grid, saved["shape"], WORLD)
            except (ValueError, TypeError):
                valid = False
            if valid:
                saved["boxes"] = [dataclasses.asdict(b) for b in grid.every(saved["shape"])]
                saved["grid"] = None
        return path, saved

    def box(self) -> tuple[str, dict[str, Any]] | None:
        found = self.saved(listed=True)
        boxes = found[1].get("boxes") if found else None
        if not found or not isinstance(boxes, list) or not boxes or not isinstance(boxes[0], dict):
            return None
        b = self.rng.choice(boxes)
        return (found[0], b) if isinstance(b, dict) else None

    def file(self) -> tuple[str, Edit]:
        name = self.rng.choice(list(self.seed.files))
        if name not in self.edits:
            seed = self.seed.seeds[name]
            self.edits[name] = Edit(self.rng, seed.doc(), seed, self.marker)
        return name, self.edits[name]

    def entries(self, name: str) -> list[str]:
        """The names a rank file stores or describes."""
        doc = self.seed.seeds[name].doc()
        meta = doc.meta if isinstance(doc.meta, dict) else {}
        return [*meta.get("tensors", {}), *meta.get("external", {})]


def _ints(values: list[Any]) -> bool:
    return all(type(v) is int for v in values)


def _int_value(rng: random.Random, old: Any) -> Any:
    base = old if type(old) is int else 1
    return rng.choice(
        [
            base + 1,
            base - 1,
            0,
            -1,
            -base,
            2 * base,
            base + 1000,
            rng.choice(BIG_INTS),
            2**40,
            True,
            1.0,
            "1",
            None,
            [base],
            Raw("9" * rng.choice([20, 4000])),
            Raw("1e400"),
        ]
    )


def sm_box(c: StepEdit) -> str:
    """One field of one box: offsets and lengths (overlaps, gaps, out of range, negative,
    huge, another rank), the file it is in, the entry it names."""
    found = c.box()
    if found is None:
        return "no box"
    path, b = found
    key = c.rng.choice(["offsets", "lengths", "offsets", "lengths", "file", "name", "extra"])
    old = b.get(key)
    if key in ("offsets", "lengths") and isinstance(old, list) and old:
        action = c.rng.random()
        new = list(old)
        if action < 0.6:
            d = c.rng.randrange(len(new))
            new[d] = _int_value(c.rng, new[d])
        elif action < 0.75:
            new = [*new, c.rng.choice([0, 1, 2])]
        elif action < 0.85:
            new = new[:-1]
        else:
            new = c.rng.choice([[], None, "0", [[0]] * len(new), [x * 2 for x in new if type(x) is int]])
        b[key] = new
    elif key == "file":
        b[key] = c.rng.choice([-1, 0, 1, 2, 3, WORLD, WORLD + 1, 2**64, True, "0", None, 1.0])
    elif key == "name":
        file = b.get("file")
        pool = c.entries(rank_file(file)) if type(file) is int and 0 <= file < WORLD else []
        b[key] = c.rng.choice([*pool, *pool, *ODD_STRINGS[:6], "missing", 0, None])
    else:
        b[key] = junk(c.rng)
    return f"{path}: box {key} = {b.get(key)!r:.60}"


def sm_boxes(c: StepEdit) -> str:
    """A DTensor's list of boxes: one dropped, doubled, moved, split, emptied, reordered."""
    found = c.saved(listed=True)
    if found is None or not isinstance(found[1].get("boxes"), list):
        return "no boxes"
    path, saved = found
    boxes: list[Any] = saved["boxes"]
    action = c.rng.randrange(8)
    if action == 0 and boxes:
        boxes.pop(c.rng.randrange(len(boxes)))
        return f"{path}: a box dropped"
    if action == 1 and boxes:
        boxes.append(json.loads(json.dumps(c.rng.choice(boxes))))
        return f"{path}: a box doubled"
    if action == 2:
        other = c.saved()
        if other is None or not isinstance(other[1].get("boxes"), list) or not other[1]["boxes"]:
            return "no other boxes"
        boxes.append(json.loads(json.dumps(c.rng.choice(other[1]["boxes"]))))
        return f"{path}: a box of {other[0]} added"
    if action == 3 and boxes and isinstance(boxes[0], dict):
        b = c.rng.choice(boxes)
        lengths = b.get("lengths")
        if not isinstance(lengths, list) or not lengths or type(lengths[0]) is not int or lengths[0] < 2:
            return "not splittable"
        half = lengths[0] // 2
        second = json.loads(json.dumps(b))
        b["lengths"] = [half, *lengths[1:]]
        second["lengths"] = [lengths[0] - half, *lengths[1:]]
        if isinstance(second.get("offsets"), list) and second["offsets"] and _ints(second["offsets"][:1]):
            second["offsets"][0] += half
        boxes.append(second)
        return f"{path}: a box split in two"
    if action == 4:
        saved["boxes"] = []
        return f"{path}: no boxes"
    if action == 5:
        boxes.reverse()
        return f"{path}: boxes reversed"
    if action == 6 and boxes and isinstance(boxes[0], dict):  # an empty box, anywhere
        b = json.loads(json.dumps(c.rng.choice(boxes)))
        if isinstance(b.get("lengths"), list) and b["lengths"]:
            b["lengths"][c.rng.randrange(len(b["lengths"]))] = 0
        boxes.append(b)
        return f"{path}: an empty box added"
    saved["boxes"] = c.rng.choice([None, {}, [1], [[]], [{}], "x", junk(c.rng)])
    return f"{path}: boxes = {saved['boxes']!r:.40}"


def sm_saved(c: StepEdit) -> str:
    """A DTensor's dtype or shape: another dtype of the same or another size, hostile
    shapes, and shapes the boxes are made to tile (allocation bombs: 2^40 elements
    claimed by one box of a small entry)."""
    found = c.saved(listed=c.rng.random() < 0.5)
    if found is None:
        return "no DTensor"
    path, saved = found
    action = c.rng.randrange(5)
    if action == 0:
        saved["dtype"] = c.rng.choice(
            [*SAME_BYTES, "complex64", "bool", "float8_e4m3fn", c.rng.choice(DTYPE_NAMES)]
        )
        return f"{path}: dtype {saved['dtype']!r:.40}"
    if action == 1:
        saved["shape"] = value = shape_value(c.rng, saved.get("shape"))
        return f"{path}: shape {value!r:.60}"
    boxes = saved.get("boxes")
    if not isinstance(boxes, list) or not boxes or not isinstance(boxes[0], dict):
        return "no boxes"
    if action == 2:  # one box claims a huge whole
        dims = c.rng.choice([[2**40], [2**31, 2**10], [1 << 62], [2**20, 2**20, 8], [0, 2**64], [2**63]])
        b = boxes[0]
        saved["shape"] = dims
        saved["boxes"] = [{**b, "offsets": [0] * len(dims), "lengths": dims}]
        return f"{path}: one box of {dims}"
    if action == 3:  # every box and the shape gain a dimension
        extra = c.rng.choice([1, 1, 2, 2**40, 0])
        if isinstance(saved.get("shape"), list):
            saved["shape"] = [*saved["shape"], extra]
        for b in boxes:
            if (
                isinstance(b, dict)
                and isinstance(b.get("offsets"), list)
                and isinstance(b.get("lengths"), list)
            ):
                b["offsets"] = [*b["offsets"], 0]
                b["lengths"] = [*b["lengths"], extra]
        return f"{path}: a dimension of {extra} added"
    # the shape scaled along its first dimension, the last box stretched to fill it
    shape = saved.get("shape")
    if not isinstance(shape, list) or not shape or type(shape[0]) is not int:
        return "no shape"
    factor = c.rng.choice([2, 1000, 2**30, 2**40])
    grown = shape[0] * factor
    for b in boxes:
        offsets, lengths = (b.get("offsets"), b.get("lengths")) if isinstance(b, dict) else (None, None)
        ints = isinstance(offsets, list) and isinstance(lengths, list) and _ints(offsets[:1] + lengths[:1])
        if ints and len(offsets + lengths) >= 2 and offsets[0] + lengths[0] == shape[0]:
            lengths[0] += grown - shape[0]
    saved["shape"] = [grown, *shape[1:]]
    return f"{path}: {factor}x as long, the last boxes stretched"


def sm_grid(c: StepEdit) -> str:
    """One field of a DTensor's grid rule (pieces, first file, strides, entry name), the
    grid replaced by junk, or a grid beside its boxes."""
    found = c.saved()
    grid = found[1].get("grid") if found else None
    if not found or not isinstance(grid, dict):
        return "no grid"
    path, saved = found
    key = c.rng.choice(["pieces", "strides", "first", "first", "name", "extra", "whole"])
    old = grid.get(key)
    if key in ("pieces", "strides") and isinstance(old, list) and old:
        new = list(old)
        action = c.rng.random()
        if action < 0.7:
            d = c.rng.randrange(len(new))
            new[d] = _int_value(c.rng, new[d])
        elif action < 0.85:
            new = [*new, c.rng.choice([0, 1, 2])]
        else:
            new = c.rng.choice([[], None, new[:-1], [x * 2 for x in new if type(x) is int]])
        grid[key] = new
    elif key == "first":
        grid[key] = _int_value(c.rng, old)
    elif key == "name":
        first = grid.get("first")
        pool = c.entries(rank_file(first)) if type(first) is int and 0 <= first < WORLD else []
        grid[key] = c.rng.choice([*pool, *pool, *ODD_STRINGS[:6], "missing", 0, None])
    elif key == "extra":
        saved["boxes"] = [{"file": 0, "name": path, "offsets": [0] * len(old or []), "lengths": [1]}]
        return f"{path}: a grid and boxes"
    else:
        saved["grid"] = c.rng.choice([{}, [], "x", 0, junk(c.rng)])
    return f"{path}: grid {key} = {grid.get(key)!r:.60}"


def sm_paths(c: StepEdit) -> str:
    """The index's tree paths: a DTensor not indexed, indexed twice, under another's
    path, a plain leaf's or an odd one."""
    shards = c.shards()
    if shards is None:
        return "no index"
    paths = list(shards)
    action = c.rng.randrange(5)
    if action == 0 and paths:
        path = c.rng.choice(paths)
        del shards[path]
        return f"{path} not indexed"
    if action == 1 and len(paths) >= 2:
        a, b = c.rng.sample(paths, 2)
        shards[a], shards[b] = shards[b], shards[a]
        return f"{a} and {b} swapped"
    if action == 2 and paths:
        path = c.rng.choice(paths)
        new = c.rng.choice(["step", "shared", "arr", "opt.m", "rank", "dt", "dt.empty", "dt.x", *ODD_STRINGS])
        shards[new] = shards.pop(path)
        return f"{path} indexed as {new!r}"
    if action == 3 and paths:
        path = c.rng.choice(paths)
        new = c.rng.choice(["dt.empty", "shared", "step", "dt.col", "opt.m"])
        shards[new] = json.loads(json.dumps(shards[path]))
        return f"{path} also indexed as {new!r}"
    c.body["shards"] = value = c.rng.choice([{}, [], None, "x", junk(c.rng), {"dt.row": junk(c.rng)}])
    return f"shards = {value!r:.40}"


def sm_per_rank(c: StepEdit) -> str:
    """``per_rank``: paths dropped or added (DTensors, odd strings, many), wrong types."""
    body = c.body
    if not isinstance(body, dict):
        return "no body"
    old = body.get("per_rank") if isinstance(body.get("per_rank"), list) else []
    body["per_rank"] = value = c.rng.choice(
        [
            [],
            old[:1],
            [*old, "dt.row"],
            [*old, "dt"],
            [*old, "shared", "step"],
            [*old, *ODD_STRINGS],
            [f"p{i}" for i in range(10_000)],
            [*old, *old],
            [1],
            None,
            "rank",
            junk(c.rng),
        ]
    )
    return f"per_rank = {value!r:.60}"


def sm_files(c: StepEdit) -> str:
    """The files: two swapped (checksums and sizes too, or not), a missing name, the
    replicas another rank's, a rank dropped or added with consistent lists."""
    body = c.body
    if not isinstance(body, dict) or not all(
        isinstance(body.get(k), list) for k in ("files", "checksums", "sizes")
    ):
        return "no files"
    files, sums, sizes = body["files"], body["checksums"], body["sizes"]
    action = c.rng.randrange(5)
    if action == 0 and len(files) >= 2:
        i, j = c.rng.sample(range(len(files)), 2)
        files[i], files[j] = files[j], files[i]
        if c.rng.random() < 0.7 and len(sums) == len(sizes) == len(files):
            sums[i], sums[j] = sums[j], sums[i]
            sizes[i], sizes[j] = sizes[j], sizes[i]
        return f"files {i} and {j} swapped"
    if action == 1 and files:
        i = c.rng.randrange(len(files))
        files[i] = c.rng.choice(["rank_00009", "missing", MANIFEST_NAME, *files])
        return f"file {i} = {files[i]!r}"
    if action == 2:
        body["replicas"] = c.rng.choice([*files, "missing", MANIFEST_NAME]) if files else "missing"
        return f"replicas = {body['replicas']!r}"
    if action == 3 and files:
        n = c.rng.choice([1, 2, 3]) if len(files) > 1 else 1
        for k in ("files", "checksums", "sizes"):
            body[k] = body[k][:n]
        body["world_size"] = n
        return f"world size {n}"
    if not (files and sums and sizes):  # emptied by a mutation before this one
        return "no rank to copy"
    n = len(files) + 1
    body.update(
        world_size=n, files=[*files, files[-1]], checksums=[*sums, sums[-1]], sizes=[*sizes, sizes[-1]]
    )
    return f"a rank {n - 1} with rank {n - 2}'s file"


def sm_body(c: StepEdit) -> str:
    """Any field of the manifest, as the manifest fuzzer does it; or its seal."""
    body = c.body
    if not isinstance(body, dict) or c.rng.random() < 0.1:
        c.reseal = False
        if isinstance(c.outer, dict):
            c.outer["crc32c"] = c.rng.choice(["00000000", "", None, 1])
        return "manifest seal broken"
    key = c.rng.choice([*body, "extra"])
    body[key] = _manifest_junk(c.rng, body.get(key))
    return f"body: {key} = {body[key]!r:.60}"


# -- mutations of rank files ------------------------------------------------------------------


def _shard_descs(e: Edit) -> list[tuple[str, dict[str, Any]]]:
    """(name, description) of every entry a rank file stores or describes with a shard."""
    meta = e.doc.meta if isinstance(e.doc.meta, dict) else {}
    out = []
    for section in ("tensors", "external"):
        for name, d in (meta.get(section) or {}).items() if isinstance(meta.get(section), dict) else []:
            if isinstance(d, dict) and "shard" in d:
                out.append((name, d))
    return out


def sf_shard(c: StepEdit) -> str:
    """A shard's metadata in a rank file: the whole's shape or the box's offsets changed,
    deleted, added to a plain entry, hostile values."""
    file, e = c.file()
    descs = _shard_descs(e)
    meta = e.doc.meta if isinstance(e.doc.meta, dict) else {}
    if c.rng.random() < 0.15 and isinstance(meta.get("tensors"), dict):
        name = c.rng.choice(list(meta["tensors"]) or ["none"])
        d = meta["tensors"].get(name)
        if isinstance(d, dict):
            shape = d.get("shape") if isinstance(d.get("shape"), list) else []
            d["shard"] = {"shape": shape, "offset": [0] * len(shape)}
            return f"{file}: {name!r} made a shard"
    if not descs:
        return "no shard"
    name, d = c.rng.choice(descs)
    shard = d["shard"]
    action = c.rng.randrange(6)
    if action == 0:
        del d["shard"]
        return f"{file}: {name!r} no longer a shard"
    if not isinstance(shard, dict) or action == 1:
        d["shard"] = junk(c.rng)
        return f"{file}: {name!r} shard = {d['shard']!r:.40}"
    key = c.rng.choice(["shape", "offset"])
    old = shard.get(key)
    if isinstance(old, list) and old and action < 5:
        new = list(old)
        i = c.rng.randrange(len(new))
        new[i] = _int_value(c.rng, new[i])
        shard[key] = new
    else:
        shard[key] = c.rng.choice([[], None, [0], shape_value(c.rng, old)])
        e.mark(shard[key])
    return f"{file}: {name!r} shard {key} = {shard[key]!r:.60}"


def sf_blocks(c: StepEdit) -> str:
    """A shard's block checksums: one wrong, one too few or many, not hex, upper case, of
    another type, deleted; blocks on a small shard or a plain entry."""
    file, e = c.file()
    described = e.doc.described() or {}
    with_blocks = [n for n, d in described.items() if _hex_blocks(d)]
    if not with_blocks or c.rng.random() < 0.15:
        name = c.rng.choice(list(described) or ["none"])
        d = described.get(name)
        if not isinstance(d, dict):
            return "no entry"
        d["blocks"] = c.rng.choice([d.get("crc32c", ""), "", "00000000" * 2, junk(c.rng)])
        return f"{file}: blocks on {name!r} = {d['blocks']!r:.30}"
    name = c.rng.choice(with_blocks)
    d = described[name]
    blocks: str = d["blocks"]
    action = c.rng.randrange(7)
    if action == 0:
        i = c.rng.randrange(len(blocks) // 8)
        d["blocks"] = blocks[: 8 * i] + f"{int(blocks[8 * i : 8 * i + 8], 16) ^ 1:08x}" + blocks[8 * i + 8 :]
    elif action == 1:
        d["blocks"] = blocks[:-8]
    elif action == 2:
        d["blocks"] = blocks + blocks[:8]
    elif action == 3:
        d["blocks"] = c.rng.choice([blocks.upper(), "z" * len(blocks), blocks[:-1] + "g", " " + blocks[1:]])
    elif action == 4:
        d["blocks"] = c.rng.choice([[blocks[:8], blocks[8:]], int(blocks[:8], 16), None, {"0": blocks}])
    elif action == 5:
        del d["blocks"]
    else:
        d["blocks"] = blocks[8:] + blocks[:8]  # the right checksums, in the wrong order
    return f"{file}: {name!r} blocks = {d.get('blocks', '<deleted>')!r:.40}"


def _hex_blocks(d: Any) -> bool:
    """Whether a description has block checksums to edit (a mutation before may have
    left "" or text that is not hex)."""
    blocks = d.get("blocks") if isinstance(d, dict) else None
    return isinstance(blocks, str) and len(blocks) >= 8 and all(ch in string.hexdigits for ch in blocks)


def _recompute_blocks(doc: Doc) -> None:
    described = doc.described() or {}
    for name, d in described.items():
        if isinstance(d, dict) and isinstance(d.get("blocks"), str):
            blob = doc.blob(name)
            d["blocks"] = "".join(f"{crc32c(blob[i : i + BLOCK]):08x}" for i in range(0, len(blob), BLOCK))


def sf_flip(c: StepEdit) -> str:
    """Bytes of a shard changed: behind its whole checksum and block checksums (then valid,
    arbitrary values), behind its whole checksum only (a block's checksum must catch it,
    naming the file), or behind nothing."""
    file, e = c.file()
    described = e.doc.described() or {}
    shards = [n for n, d in described.items() if isinstance(d, dict) and "shard" in d and e.doc.blob(n)]
    if not shards:
        return "no stored shard"
    big = [n for n in shards if isinstance(described[n].get("blocks"), str)]
    name = c.rng.choice(big if big and c.rng.random() < 0.7 else shards)
    st = e.doc.st.get(name)
    offsets = st.get("data_offsets") if isinstance(st, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and _ints(offsets)):
        return "no offsets"
    start, end = offsets
    if not 0 <= start < end <= len(e.doc.data):
        return "offsets out of the data"
    data = bytearray(e.doc.data)
    at = c.rng.choice([start, end - 1, start + BLOCK - 1, start + BLOCK, c.rng.randrange(start, end)])
    at = min(max(at, start), end - 1)
    data[at] ^= 1 << c.rng.randrange(8)
    e.doc.data = bytes(data)
    how = (
        c.rng.choice(["blocks", "whole", "whole", "nothing"])
        if name in big
        else c.rng.choice(["whole", "nothing"])
    )
    if how != "nothing":
        e.doc.recompute = True
    if how == "blocks":
        _recompute_blocks(e.doc)
    elif how == "whole" and name in big:
        c.flipped = file
    return f"{file}: a bit of {name!r} at {at - start} flipped behind its {how} checksum"


def sf_dtype(c: StepEdit) -> str:
    """A shard entry redescribed as another dtype of its bytes, consistently in the file."""
    file, e = c.file()
    described = e.doc.described() or {}
    shards = [n for n, d in described.items() if isinstance(d, dict) and "shard" in d]
    if not shards:
        return "no shard"
    name = c.rng.choice(shards)
    d = described[name]
    new = c.rng.choice(["int32", "uint32", "float16", "int16", "float64", "int64", "uint8", "bool"])
    size = {"float32": 4, "float64": 8, "bfloat16": 2}.get(str(d.get("dtype")), 0)
    new_size = getattr(torch, new).itemsize
    shape = d.get("shape")
    if not size or not isinstance(shape, list) or not shape or not _ints(shape) or size % new_size:
        return "no dtype fits"
    d["dtype"] = new
    d["shape"] = [*shape[:-1], shape[-1] * (size // new_size)]
    shard = d.get("shard") if isinstance(d.get("shard"), dict) else {}
    for key in ("shape", "offset"):  # each as a mutation before may have left it
        if isinstance(shard.get(key), list) and shard[key] and _ints(shard[key]):
            shard[key][-1] *= size // new_size
    from aiosnap._format.codec import st_entry

    nbytes = len(e.doc.blob(name))
    code, st_shape = st_entry("tensor", new, tuple(d["shape"]), nbytes)
    if isinstance(e.doc.st.get(name), dict):
        e.doc.st[name].update(dtype=code, shape=st_shape)
    return f"{file}: {name!r} is now {new} {d['shape']}"


def sf_tree(c: StepEdit) -> str:
    """The dtensor nodes of a rank file's tree: made plain tensors, pointed at another
    entry (a plain one, another DTensor's, an external one), a plain tensor made a
    dtensor, a dtensor node moved under a path the index does not know."""
    file, e = c.file()
    leaves = [n for n in _nodes(e.doc.tree()) if isinstance(n, dict) and n.get("$") in ("dtensor", "tensor")]
    if not leaves:
        return "no leaves"
    leaf = c.rng.choice(leaves)
    action = c.rng.randrange(4)
    if action == 0:
        leaf["$"] = "tensor" if leaf["$"] == "dtensor" else "dtensor"
        return f"{file}: {leaf!r:.60} retagged"
    if action == 1:
        leaf["n"] = c.rng.choice([*c.entries(file), "missing"])
        return f"{file}: leaf now {leaf!r:.60}"
    tree = e.doc.tree()
    items = tree.get("items") if isinstance(tree, dict) else None
    if not isinstance(items, list):
        return "no root dict"
    if action == 2:
        items.append([c.rng.choice(["moved", "dt.row", "dt", "x.y"]), {"$": "dtensor", "n": leaf.get("n")}])
        return f"{file}: a dtensor node for {leaf.get('n')!r} added at the root"
    dt = (
        next((v for k, v in items if k == "dt"), None)
        if all(isinstance(p, list) and len(p) == 2 for p in items)
        else None
    )
    if not isinstance(dt, dict) or not isinstance(dt.get("items"), list):
        return "no dt"
    dt["items"].append([c.rng.choice(["new", "row ", 1, None]), {"$": "dtensor", "n": leaf.get("n")}])
    return f"{file}: a dtensor node for {leaf.get('n')!r} under dt"


def sf_raw(c: StepEdit) -> str:
    """A rank file truncated (in its header, its data, a block) or grown, after sealing."""
    file, _ = c.file()
    size = len(c.seed.files[file])
    cut = c.rng.choice([0, 7, 100, 4096, size - 1, size - BLOCK, size // 2, size - 4])
    if c.rng.random() < 0.2:
        tail = b"\0" * c.rng.choice([1, 4096])
        c.post.setdefault(file, []).append(lambda raw: raw + tail)
        return f"{file}: bytes appended"
    c.post.setdefault(file, []).append(lambda raw: raw[: max(cut, 0)])
    return f"{file}: truncated to {cut}"


def sf_generic(c: StepEdit) -> str:
    """One mutation of the single-file fuzzer, on a rank file."""
    file, e = c.file()
    op = c.rng.choices([m for m, _ in MUTATIONS], [w for _, w in MUTATIONS])[0]
    return f"{file}: {op.__name__}: {op(e)}"


def sf_stale(c: StepEdit) -> str:
    """A rank file altered (validly) while the manifest keeps its old checksum."""
    file, e = c.file()
    c.stale.add(file)
    e.doc.md_at = 1  # the same header, in another order: another header checksum
    return f"{file}: the manifest keeps its old checksum"


STEP_MUTATIONS: list[tuple[Callable[[StepEdit], str], int]] = [
    (sm_box, 14),
    (sm_boxes, 8),
    (sm_grid, 10),
    (sm_saved, 8),
    (sm_paths, 6),
    (sm_per_rank, 4),
    (sm_files, 5),
    (sm_body, 3),
    (sf_shard, 10),
    (sf_blocks, 8),
    (sf_flip, 8),
    (sf_dtype, 4),
    (sf_tree, 8),
    (sf_raw, 3),
    (sf_generic, 10),
    (sf_stale, 1),
]
_OPS = [m for m, _ in STEP_MUTATIONS]
_WEIGHTS = [w for _, w in STEP_MUTATIONS]


@dataclass
class StepMutant:
    """Case ``i`` of the sharded fuzzer: the step's files, what was done, its random
    stream (for the calls), and the file whose block was altered behind its checksum."""

    files: dict[str, bytes]
    manifest: bytes
    done: list[str]
    rng: random.Random
    flipped: str | None
    broken: Exception | None = None


def _header_checksum(raw: bytes) -> str | None:
    try:
        (n,) = struct.unpack("<Q", raw[:8])
        value = json.loads(raw[8 : 8 + n])["__metadata__"][CRC_KEY]
    except (ValueError, KeyError, TypeError, RecursionError, struct.error):
        return None
    return value if isinstance(value, str) else None


def mutate_step(i: int, seed: StepSeed, marker: str) -> StepMutant:
    rng = random.Random(f"sharded:{i}")
    c = StepEdit(rng, seed, marker)
    done: list[str] = []
    broken = None
    for op in rng.choices(_OPS, _WEIGHTS, k=rng.choice([1, 1, 2, 3])):
        try:
            done.append(f"{op.__name__}: {op(c)}")
        except Exception as exc:  # the fuzzer's own bug: reported as a finding, the run goes on
            done.append(f"{op.__name__}: failed")
            broken = exc
    files = dict(seed.files)
    for name, e in c.edits.items():
        files[name] = render(e.doc, special=e.special)
    for name, transforms in c.post.items():
        for transform in transforms:
            files[name] = transform(files[name])
    body = c.body
    if isinstance(body, dict):
        for name in set(c.edits) - c.stale:
            r = int(name.rpartition("_")[2])
            crc = _header_checksum(files[name])
            sums, sizes = body.get("checksums"), body.get("sizes")
            if crc is not None and isinstance(sums, list) and r < len(sums) and sums[r] == _seed_sum(seed, r):
                sums[r] = crc
            if isinstance(sizes, list) and r < len(sizes) and type(sizes[r]) is int:
                sizes[r] = len(files[name])
    if c.reseal and isinstance(body, dict):
        text = hostile.dumps(_sorted(body))
        c.outer["crc32c"] = f"{crc32c(text.encode('utf-8', 'surrogatepass')):08x}"
    manifest = hostile.dumps(c.outer).encode("utf-8", "surrogatepass")
    return StepMutant(files, manifest, done, rng, c.flipped if len(done) == 1 else None, broken)


def _seed_sum(seed: StepSeed, rank: int) -> str:
    return str(json.loads(seed.manifest)["body"]["checksums"][rank])


# -- reading a step, and the oracles ----------------------------------------------------------


@dataclass
class Reads:
    """What the calls of a case returned, for the oracles: call -> tree (or None), and
    call -> the exception it raised."""

    values: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, BaseException] = field(default_factory=dict)
    #: call -> (the rank file whose tree it read, whether it reads DTensors whole).
    bases: dict[str, tuple[int, bool]] = field(default_factory=dict)


def _recorded(reads: Reads, name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    async def call() -> None:
        try:
            reads.values[name] = await fn()
        except Exception as exc:
            reads.errors[name] = exc
            raise

    return call


def _parsed(directory: Path) -> Manifest | None:
    """The case's manifest, if it parses (any failure is the calls' to report)."""
    try:
        return read_manifest(aiosnap.storage.LocalStorage(), str(directory))
    except Exception:
        return None


class StepCalls:
    """The calls that read a mutated step, and the oracles over their results."""

    def __init__(self, directory: Path, combos: dict[tuple[int, int], dict[str, Any]]) -> None:
        self.directory, self.combos = directory, combos
        self.storage = aiosnap.storage.LocalStorage()

    def calls(self, rng: random.Random, reads: Reads) -> list[Call]:
        step, storage = str(self.directory), self.storage
        allowed = (aiosnap.errors.CheckpointError,)
        manifest = _parsed(self.directory)
        n = manifest.world_size if manifest is not None else 1
        keys = rng.choice([["dt"], ["dt"], ["dt.big"], ["dt.row", "tied", "shared"], ["dt", "arr"], None])
        rank = rng.randrange(n)
        world = rng.choice([1, 2, 3, 4, 8])
        restore_rank = rng.randrange(world)
        combo = rng.choice(COMBOS)
        target = self.combos[combo]
        plain = plain_target()

        async def as_rank() -> Any:
            return await aiosnap.load(step, rank=rank, keys=rng.choice([None, ["dt"]]))

        async def restore() -> Any:
            m = read_manifest(storage, step)
            return load_step(storage, Step(step, m, restore_rank, world), keys, None, False, None, True)

        async def into_dtensors() -> Any:
            for t in target["dt"].values():
                t.to_local().view(-1).view(torch.uint8).fill_(SENTINEL)
            m = read_manifest(storage, step)
            load_step(storage, Step(step, m, combo[0], combo[1]), ["dt"], None, False, target, True)
            return {"dt": {k: v.to_local().clone() for k, v in target["dt"].items()}}

        async def into_tensors() -> Any:
            return await aiosnap.load_into(step, plain, keys=["dt"])

        def base(r: int) -> int:  # the file a rank reads its tree from (_decisions.base_file)
            return r if manifest is not None and r < manifest.world_size else 0

        reads.bases.update(
            {
                "load": (0, True),
                f"load(rank={rank})": (rank, True),
                f"restore {restore_rank}/{world}": (base(restore_rank), True),
                f"restore {combo[0]}/{combo[1]} into DTensors": (base(combo[0]), False),
                "load_into": (0, True),
            }
        )
        named: list[tuple[str, Callable[[], Any]]] = [
            ("load", lambda: aiosnap.load(step, keys=keys)),
            (f"load(rank={rank})", as_rank),
            (f"restore {restore_rank}/{world}", restore),
            (f"restore {combo[0]}/{combo[1]} into DTensors", into_dtensors),
            ("load_into", into_tensors),
            ("verify", lambda: aiosnap.verify(step)),
        ]
        return [(name, _recorded(reads, name, fn), allowed) for name, fn in named]

    def checks(self, reads: Reads, mutant: StepMutant) -> list[Call]:
        async def agree() -> None:
            self.agree(reads)

        async def verified() -> None:
            if "verify" in reads.values:
                corrupt = {
                    n: e
                    for n, e in reads.errors.items()
                    if isinstance(e, aiosnap.errors.CorruptCheckpointError)
                }
                if corrupt:
                    name, exc = next(iter(corrupt.items()))
                    raise AssertionError(f"verify accepted the step, {name} refused it: {exc}")

        async def named() -> None:
            if mutant.flipped is None:
                return
            path = str(self.directory / mutant.flipped)
            for name in ("verify",):
                exc = reads.errors.get(name)
                if not isinstance(exc, aiosnap.errors.CorruptCheckpointError) or path not in str(exc):
                    raise AssertionError(f"{name} of a bit flipped in a block of {path}: {exc!r:.200}")

        return [("reads agree", agree, ()), ("verify agrees", verified, ()), ("flip named", named, ())]

    def agree(self, reads: Reads) -> None:
        """Every successful read gives the same bytes for each DTensor of the index, at
        its whole shape; a DTensor target's local shard is its box of the whole."""
        manifest = _parsed(self.directory)
        if manifest is None:
            return
        trees = {r: self._dtensor_paths(r, manifest) for r in range(manifest.world_size)}
        wholes: dict[str, tuple[str, torch.Tensor]] = {}
        locals_: list[tuple[str, str, torch.Tensor]] = []
        for call, value in reads.values.items():
            if call == "verify" or call not in reads.bases:
                continue
            base, is_whole = reads.bases[call]
            for path, expected in trees.get(base, {}).items():
                got = _at(value, path)
                if not isinstance(got, torch.Tensor):
                    continue
                if not is_whole:
                    locals_.append((call, path, got))
                    continue
                if tuple(got.shape) != expected:
                    raise AssertionError(f"{call}: {path} is {tuple(got.shape)}, its whole is {expected}")
                if path in wholes and not _empty(wholes[path][1], got) and not _same(wholes[path][1], got):
                    raise AssertionError(f"{call} and {wholes[path][0]} read {path} differently")
                wholes.setdefault(path, (call, got))
        for call, path, got in locals_:
            if path in wholes and _empty(wholes[path][1], got):
                continue
            if path in wholes and path.startswith("dt.") and path[3:] in TARGET:
                combo = tuple(int(x) for x in call.split()[1].split("/"))
                box = _target_box(path[3:], combo)  # type: ignore[arg-type]
                if box is None:
                    continue
                part = wholes[path][1][tuple(slice(o, o + n) for o, n in zip(*box, strict=True))]
                if not _same(part, got):
                    raise AssertionError(
                        f"{call}: the local shard of {path} is not its box of {wholes[path][0]}"
                    )

    def _dtensor_paths(self, rank: int, manifest: Manifest) -> dict[str, tuple[int, ...]]:
        """The dtensor nodes of rank file ``rank``'s tree and the whole shape a read must
        give each: the index's, or (for a DTensor the index lacks) its entry's."""
        try:
            f = self.storage.open_read(str(self.directory / manifest.files[rank]))
            try:
                header = read_header(f)
            finally:
                f.close()
            leaves = list(walk_leaves(header.tree))
        except (aiosnap.errors.CheckpointError, ValueError, OSError):
            return {}
        out = {}
        for parts, kind, name in leaves:
            path = format_path(parts)
            if kind != "dtensor":
                continue
            if path in manifest.shards:
                out[path] = tuple(manifest.shards[path].shape)
                continue
            info = header.tensors.get(name) or header.external.get(name)
            if info is not None and info.shard is not None:  # not indexed: only if empty
                out[path] = info.shard[0]
        return out


def _at(tree: Any, path: str) -> Any:
    node = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _empty(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two reads of a DTensor hold no bytes. An empty DTensor is indexed nowhere:
    each rank's file describes it, and rank files may differ on its shape and dtype (a
    read from one file and a restore based on another then differ in those alone)."""
    return a.numel() == 0 and b.numel() == 0


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(
        torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    )


def _target_box(name: str, combo: tuple[int, int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offsets, lengths) of the local shard of target ``name`` as rank r of w."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    rank, world = combo
    spec = TARGET[name]
    grid = "," in spec and world == 4
    mesh = _mesh((2, 2), rank) if grid else _mesh((world,), rank)
    shape, offset = compute_local_shape_and_global_offset(
        LAYOUT[name][0], mesh, _placements(spec if grid else spec.split(",")[0])
    )
    return tuple(offset), tuple(shape)


# -- the runner's side ------------------------------------------------------------------------


class StepFuzz:
    """Makes and reads the ``sharded`` cases of a run: the seed step, the DTensor targets
    of each (rank, world), the case directory (only files that changed are rewritten)."""

    def __init__(self, workdir: Path, marker: str, seed: StepSeed) -> None:
        self.marker, self.seed = marker, seed
        self.directory = workdir / "sharded_case"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.on_disk: dict[str, bytes] = {}
        self.combos = {combo: targets(*combo) for combo in COMBOS}
        self.reader = StepCalls(self.directory, self.combos)

    @classmethod
    async def open(cls, workdir: Path, marker: str) -> StepFuzz:
        return cls(workdir, marker, await make_step(workdir / "sharded_seed"))

    def write(self, files: dict[str, bytes]) -> None:
        for name, raw in files.items():
            if self.on_disk.get(name) != raw:
                (self.directory / name).write_bytes(raw)
                self.on_disk[name] = raw

    def case(self, i: int) -> Case:
        m = mutate_step(i, self.seed, self.marker)
        self.write({**m.files, MANIFEST_NAME: m.manifest})
        reads = Reads()
        calls = self.reader.calls(m.rng, reads)
        if m.broken is not None:
            broken = m.broken

            async def mutation() -> None:
                raise broken

            calls.insert(0, ("mutate", mutation, ()))
        return Case("sharded", m.done, calls, self.reader.checks(reads, m))

    def seed_case(self, rng: random.Random) -> Case:
        """The unmutated step, read as a case is (the unit of the time limit)."""
        self.write({**self.seed.files, MANIFEST_NAME: self.seed.manifest})
        reads = Reads()
        m = StepMutant(self.seed.files, self.seed.manifest, [], rng, None)
        return Case("sharded seed", [], self.reader.calls(rng, reads), self.reader.checks(reads, m))
