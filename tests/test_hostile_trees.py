"""Hostile trees behind valid checksums: every rejection is a CorruptCheckpointError.

White-box: the trees are built against the reader's own limit (``MAX_DEPTH`` of
``aiosnap._format.tree``) and written behind valid checksums (tests/hostile.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap
from aiosnap._format.tree import MAX_DEPTH

from .hostile import Raw, parse, render


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "good"
    aiosnap.save_sync(str(path), {"a": torch.arange(4.0), "n": 3})
    return path


def nested(depth: int, *, kind: str) -> Raw:
    """JSON text of ``depth`` containers of ``kind``, one inside the other."""
    opening, closing = {
        "list": ("[", "]"),
        "tuple": ('{"$":"tuple","v":[', "]}"),
        "dict": ('{"$":"dict","items":[["k",', "]]}"),
    }[kind]
    return Raw(opening * depth + "1" + closing * depth)


def _with_tree(good: Path, tree: Any) -> Path:
    parts = parse(good.read_bytes())
    parts.meta["tree"] = tree
    good.write_bytes(render(parts))
    return good


def _refused(path: Path, match: str) -> None:
    target = {"a": torch.zeros(4), "n": 0}
    calls = [
        lambda: aiosnap.load_sync(str(path)),
        lambda: aiosnap.load_sync(str(path), keys=["a"]),
        lambda: aiosnap.load_into_sync(str(path), target),
        lambda: aiosnap.verify_sync(str(path)),
    ]
    for call in calls:
        with pytest.raises(aiosnap.errors.CorruptCheckpointError, match=match) as info:
            call()
        assert info.value.path == str(path)


@pytest.mark.parametrize(
    "key",
    [
        [1, 2],
        {"$": "dict", "items": []},
        {"$": "tuple", "v": [1]},
        {"$": "tensor", "n": "a"},
        {"$": "bytes", "v": "AA=="},
        {"$": "float", "v": "1e999"},
    ],
)
def test_a_container_or_a_leaf_as_a_dict_key_is_refused(good: Path, key: Any) -> None:
    _refused(
        _with_tree(good, {"$": "dict", "items": [[key, 1], ["a", {"$": "tensor", "n": "a"}]]}), "dict key"
    )


@pytest.mark.parametrize("kind", ["list", "tuple", "dict"])
@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 400, 990, 5000, 60_000])
def test_deeply_nested_small_containers_are_refused(good: Path, kind: str, depth: int) -> None:
    tree = Raw(f'{{"$":"dict","items":[["deep",{nested(depth, kind=kind)}],["a",{{"$":"tensor","n":"a"}}]]}}')
    _refused(_with_tree(good, tree), "nested|not valid JSON")


def test_the_deepest_tree_capture_takes_still_loads(tmp_path: Path) -> None:
    state: Any = {"leaf": torch.ones(2)}
    for _ in range(MAX_DEPTH - 1):  # MAX_DEPTH dicts in all
        state = {"k": state}
    aiosnap.save_sync(str(tmp_path / "c"), state)
    loaded = aiosnap.load_sync(str(tmp_path / "c"))
    aiosnap.verify_sync(str(tmp_path / "c"))
    for _ in range(MAX_DEPTH - 1):
        loaded = loaded["k"]
    assert torch.equal(loaded["leaf"], torch.ones(2))
    with pytest.raises(aiosnap.errors.UnsupportedTypeError, match="nested more than"):
        aiosnap.save_sync(str(tmp_path / "d"), {"k": state})


@pytest.mark.parametrize(
    ("tree", "match"),
    [
        ({"$": "dict", "items": {"a": 1}}, "bad dict node"),
        ({"$": "dict", "items": [[1, 2, 3]]}, "bad dict item"),
        ({"$": "tuple", "v": "abc"}, "bad tuple node"),
        ({"$": "float", "v": "1.5"}, "bad float node"),
        ({"$": "bytes", "v": 7}, "bad bytes node"),
        ({"$": "tensor", "n": ["a"]}, "bad tensor node"),
        ({"$": "set", "v": []}, "unknown node type"),
        ({"$": "dict", "items": [["a", {"$": "tensor", "n": "missing"}]]}, "missing"),
    ],
)
def test_malformed_nodes_are_refused(good: Path, tree: Any, match: str) -> None:
    _refused(_with_tree(good, tree), match)
