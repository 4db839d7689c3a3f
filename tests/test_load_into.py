"""load_into: in-place restore into tensors, arrays, containers and Stateful objects."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aiosnap
from aiosnap._format.tree import format_path

from .conftest import assert_tree_equal, training_state


async def test_load_into_updates_in_place(tmp_path: Path) -> None:
    saved = {"w": torch.arange(6.0).reshape(2, 3), "a": np.arange(4), "n": 3, "l": [1, torch.ones(2)]}
    await aiosnap.save(str(tmp_path / "c"), saved)
    target = {
        "w": torch.zeros(2, 3, requires_grad=True),
        "a": np.zeros(4, dtype=np.int64),
        "n": 0,
        "l": [0, torch.zeros(2)],
    }
    w, a, t = target["w"], target["a"], target["l"][1]
    assert await aiosnap.load_into(str(tmp_path / "c"), target) is target
    assert target["w"] is w and torch.equal(w.detach(), saved["w"])
    assert target["a"] is a and (a == np.arange(4)).all()
    assert target["l"][1] is t and torch.equal(t, torch.ones(2))
    assert target["n"] == 3 and target["l"][0] == 1


async def test_load_into_stateful_objects(tmp_path: Path) -> None:
    state = training_state(seed=0)
    await aiosnap.save(str(tmp_path / "c"), state)
    fresh = training_state(seed=5)
    await aiosnap.load_into(str(tmp_path / "c"), fresh)
    assert_tree_equal(state["model"].state_dict(), fresh["model"].state_dict())
    assert_tree_equal(state["optimizer"].state_dict(), fresh["optimizer"].state_dict())
    module = torch.nn.Linear(8, 16)
    await aiosnap.save(str(tmp_path / "m"), module)
    other = torch.nn.Linear(8, 16)
    await aiosnap.load_into(str(tmp_path / "m"), other)
    assert torch.equal(other.weight, module.weight)


@pytest.mark.parametrize(
    ("target", "match"),
    [
        ({"w": torch.zeros(3, 2), "n": 0}, "shape|float32"),
        ({"w": torch.zeros(2, 3, dtype=torch.float64), "n": 0}, "float64"),
        ({"w": torch.zeros(2, 3)}, "unexpected keys \\['n'\\]"),
        ({"w": torch.zeros(2, 3), "n": 0, "extra": 1}, "missing keys \\['extra'\\]"),
        ({"w": np.zeros((2, 3)), "n": 0}, "not ndarray"),
        ({"w": torch.zeros(2, 3), "n": 0, "m": torch.nn.Linear(2, 2)}, "missing"),
    ],
)
async def test_strict_mismatches_raise(tmp_path: Path, target: dict[str, Any], match: str) -> None:
    await aiosnap.save(str(tmp_path / "c"), {"w": torch.ones(2, 3), "n": 1})
    with pytest.raises(aiosnap.errors.StateMismatchError, match=match):
        await aiosnap.load_into(str(tmp_path / "c"), target)


async def test_non_strict_loads_the_common_part(tmp_path: Path) -> None:
    await aiosnap.save(str(tmp_path / "c"), {"w": torch.ones(2, 3), "n": 1})
    target = {"w": torch.zeros(2, 3), "extra": 5}
    await aiosnap.load_into(str(tmp_path / "c"), target, strict=False)
    assert torch.equal(target["w"], torch.ones(2, 3)) and target["extra"] == 5


async def test_module_mismatch_is_named(tmp_path: Path) -> None:
    await aiosnap.save(str(tmp_path / "m"), torch.nn.Linear(8, 16))
    with pytest.raises(
        aiosnap.errors.StateMismatchError, match=r"weight: checkpoint has shape \(16, 8\), the module's is"
    ):
        await aiosnap.load_into(str(tmp_path / "m"), torch.nn.Linear(8, 4))


class _Refuses:
    """A Stateful object whose load_state_dict refuses what it is given."""

    def state_dict(self) -> dict[str, Any]:
        return {"n": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise RuntimeError(f"no {state}")


async def test_a_stateful_objects_refusal_is_translated(tmp_path: Path) -> None:
    await aiosnap.save(str(tmp_path / "m"), {"n": 1})
    with pytest.raises(
        aiosnap.errors.StateMismatchError, match="load_state_dict failed: RuntimeError"
    ) as info:
        await aiosnap.load_into(str(tmp_path / "m"), _Refuses())
    assert isinstance(info.value.__cause__, RuntimeError)


def test_blocking_twins_refuse_a_running_loop(tmp_path: Path) -> None:
    aiosnap.save_sync(str(tmp_path / "c"), {"x": torch.ones(1)})
    target = {"x": torch.zeros(1)}
    aiosnap.load_into_sync(str(tmp_path / "c"), target)
    assert float(target["x"][0]) == 1.0
    assert aiosnap.verify_sync(str(tmp_path / "c")).tensors == 1

    async def inside() -> None:
        aiosnap.load_sync(str(tmp_path / "c"))

    import asyncio

    with pytest.raises(RuntimeError, match="await aiosnap.load"):
        asyncio.run(inside())


async def test_matching_tensors_are_read_straight_into_the_target(tmp_path: Path, monkeypatch: Any) -> None:
    saved = {
        "w": torch.randn(256, 256),
        "a": np.arange(1000, dtype=np.float32),
        "b": torch.ones(3, dtype=torch.int8),
        "odd": torch.ones(4, 4),
    }
    await aiosnap.save(str(tmp_path / "c"), saved)
    target = {
        "w": torch.zeros(256, 256),
        "a": np.zeros(1000, dtype=np.float32),
        "b": torch.zeros(3, dtype=torch.int8),
        "odd": torch.zeros(4, 8)[:, ::2],
    }  # not contiguous: read, then copied
    pointers = (target["w"].data_ptr(), target["a"].ctypes.data)
    allocated: list[str] = []
    real_allocate = aiosnap._load.readers._allocate

    def spy(info: Any) -> Any:
        allocated.append(info.name)
        return real_allocate(info)

    monkeypatch.setattr(aiosnap._load.readers, "_allocate", spy)
    await aiosnap.load_into(str(tmp_path / "c"), target)
    assert not set(allocated) - {"odd"}  # everything else went straight into the target's memory
    assert (target["w"].data_ptr(), target["a"].ctypes.data) == pointers
    assert torch.equal(target["w"], saved["w"]) and (target["a"] == saved["a"]).all()
    assert torch.equal(target["odd"], torch.ones(4, 4)) and torch.equal(
        target["b"], torch.ones(3, dtype=torch.int8)
    )


# -- dicts of tensors read in place: nothing rebuilt ------------------------------------
def _saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    opt = {"m": torch.ones(100_000), "v": torch.full((3,), 2.0)}
    state = {"w": torch.arange(6.0).reshape(2, 3), "opt": opt}
    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), state)
    return path, state


def _calls(monkeypatch: pytest.MonkeyPatch, owner: object, attr: str) -> list[int]:
    """A 1 for every call of ``owner.attr`` from here on (a function of a module, or a
    method of a class)."""
    calls: list[int] = []
    real = getattr(owner, attr)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attr, counted)
    return calls


def _rebuilds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from aiosnap._load import load as _load

    return _calls(monkeypatch, _load, "rebuild")


def test_a_dict_of_tensors_read_in_place_is_neither_rebuilt_nor_assigned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, state = _saved(tmp_path)
    target = {"w": torch.zeros(2, 3), "opt": {"m": torch.zeros(100_000), "v": torch.zeros(3)}}
    tensors = [target["w"], target["opt"]["m"], target["opt"]["v"]]
    calls = _rebuilds(monkeypatch)
    assert aiosnap.load_into_sync(str(path), target) is target
    assert not calls
    assert_tree_equal(target, state)
    assert [target["w"], target["opt"]["m"], target["opt"]["v"]] == tensors  # the same objects


def test_plain_values_beside_the_tensors_are_set_without_a_rebuild(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"
    values = {"step": 7, "lr": 0.5, "name": "adam", "done": True, "none": None}
    saved = {i: {"exp_avg": torch.full((3,), float(i)), **values} for i in range(3)}
    aiosnap.save_sync(str(path), saved)
    target = {
        i: {"exp_avg": torch.zeros(3), "step": 0, "lr": 1.0, "name": "", "done": False, "none": 1}
        for i in range(3)
    }
    tensors = [target[i]["exp_avg"] for i in range(3)]
    calls = _rebuilds(monkeypatch)
    aiosnap.load_into_sync(str(path), target)
    assert not calls
    assert_tree_equal(target, saved)
    assert [target[i]["exp_avg"] for i in range(3)] == tensors  # the same objects
    assert type(target[0]["step"]) is int and type(target[0]["lr"]) is float


def test_plain_values_are_left_alone_when_a_checksum_fails(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), {"w": torch.ones(4), "step": 7})
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # the data section is w's 16 bytes
    path.write_bytes(bytes(raw))
    target = {"w": torch.zeros(4), "step": 0}
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="checksum mismatch in tensor 'w'"):
        aiosnap.load_into_sync(str(path), target)
    assert target["step"] == 0


@pytest.mark.parametrize(
    ("case", "strict"),
    [
        ("a key the file lacks", False),
        ("a key the target lacks", False),
        ("a tensor of another layout", True),
        ("a plain value where the target holds a list", True),
        ("one tensor twice", True),
    ],
)
def test_anything_else_is_rebuilt_and_assigned(
    case: str, strict: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, state = _saved(tmp_path)
    if case == "a plain value where the target holds a list":
        state["step"] = 7
        aiosnap.save_sync(str(path), state)
    target: dict[str, Any] = {"w": torch.zeros(2, 3), "opt": {"m": torch.zeros(100_000), "v": torch.zeros(3)}}
    want: dict[str, Any] = {"w": state["w"], "opt": dict(state["opt"])}
    if case == "a key the file lacks":
        target["extra"] = torch.zeros(2)
        want["extra"] = torch.zeros(2)
    elif case == "a key the target lacks":
        del target["opt"]["v"], want["opt"]["v"]
    elif case == "a tensor of another layout":
        target["w"] = torch.zeros(3, 2).t()  # not contiguous: copied in by assign
    elif case == "a plain value where the target holds a list":
        target["step"], want["step"] = [0], 7
    elif case == "one tensor twice":
        state["opt"]["v"] = state["w"]  # saved once, under both names
        aiosnap.save_sync(str(path), state)
        target["opt"]["v"] = torch.zeros(2, 3)
        want["opt"]["v"] = state["w"]
    calls = _rebuilds(monkeypatch)
    aiosnap.load_into_sync(str(path), target, strict=strict)
    assert calls == [1]
    assert_tree_equal(target, want)


def test_a_key_saved_twice_is_not_taken_for_two(tmp_path: Path) -> None:
    from .hostile import parse, render

    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), {"a": torch.ones(2), "b": torch.ones(2)})
    parts = parse(path.read_bytes())
    items = parts.meta["tree"]["items"]
    items[1][0] = "a"  # the dict's keys "a" and "a": as many as the target's, one of them missing
    path.write_bytes(render(parts))
    with pytest.raises(aiosnap.errors.StateMismatchError, match="missing keys \\['b'\\]"):
        aiosnap.load_into_sync(str(path), {"a": torch.zeros(2), "b": torch.zeros(2)})


@pytest.mark.parametrize(("back", "entry"), [(1, "opt.v"), (12 + 1000, "opt.m")])
def test_a_damaged_tensor_read_in_place_is_refused(tmp_path: Path, back: int, entry: str) -> None:
    path, _ = _saved(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-back] ^= 0xFF  # the data section ends with opt.m's 400,000 bytes, then opt.v's 12
    path.write_bytes(bytes(raw))
    target = {"w": torch.zeros(2, 3), "opt": {"m": torch.zeros(100_000), "v": torch.zeros(3)}}
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match=f"checksum mismatch in tensor '{entry}'"):
        aiosnap.load_into_sync(str(path), target)


def test_a_tree_in_another_order_than_the_file_is_read_in_file_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from .hostile import parse, render

    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), {"a": torch.ones(2), "b": torch.full((2,), 2.0), "c": torch.full((3,), 3.0)})
    parts = parse(path.read_bytes())
    parts.meta["tree"]["items"].reverse()  # c, b, a: the file holds a, b, c
    path.write_bytes(render(parts))
    target = {"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(3)}
    calls = _rebuilds(monkeypatch)
    aiosnap.load_into_sync(str(path), target)
    assert not calls  # read in place: the path that takes the leaves from the walk of the target
    assert_tree_equal(target, {"a": torch.ones(2), "b": torch.full((2,), 2.0), "c": torch.full((3,), 3.0)})


def test_a_tensor_leaf_naming_a_shard_is_refused_in_a_dict_of_tensors(tmp_path: Path) -> None:
    from .hostile import parse, render

    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), {"a": torch.ones(2), "b": torch.full((2,), 2.0)})
    parts = parse(path.read_bytes())
    parts.meta["tensors"]["b"]["shard"] = {"shape": [4], "offset": [2]}  # a box of a DTensor
    path.write_bytes(render(parts))
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="bad tree: b is a tensor but 'b' is not"):
        aiosnap.load_into_sync(str(path), {"a": torch.zeros(2), "b": torch.zeros(2)})


def _resolved(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from aiosnap._load.readers import EntryReader

    return _calls(monkeypatch, EntryReader, "resolve")


def test_whole_dicts_beside_a_list_come_back_as_they_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"
    moments = {
        i: {"step": torch.tensor(float(i)), "exp_avg": torch.full((4,), float(i)), "n": i} for i in range(3)
    }
    saved = {"state": moments, "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}]}
    aiosnap.save_sync(str(path), saved)
    target = {
        "state": {i: {"step": torch.tensor(0.0), "exp_avg": torch.zeros(4), "n": -1} for i in range(3)},
        "param_groups": [{"lr": 1.0, "params": [0, 1, 2]}],
    }
    inner = [target["state"][i] for i in range(3)]
    resolved, walked = _resolved(monkeypatch), _walked(monkeypatch)
    aiosnap.load_into_sync(str(path), target)
    assert resolved == []  # every tensor is in a dict read whole: none was rebuilt
    assert walked == [[]]  # nor walked again to be read: find listed them
    assert_tree_equal(target, saved)
    assert all(target["state"][i] is inner[i] for i in range(3))


def _walked(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The dotted paths of the leaves each walk of a tree before a read returns."""
    from aiosnap._load import readers as _readers

    walks: list[list[str]] = []
    real = _readers.walk_leaves

    def recorded(*args: Any, **kwargs: Any) -> Any:
        leaves = real(*args, **kwargs)
        walks.append([format_path(p) for p, _, _ in leaves])
        return leaves

    monkeypatch.setattr(_readers, "walk_leaves", recorded)
    return walks


def test_a_tensor_in_a_whole_dict_and_elsewhere_is_read_once_for_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"
    tied = torch.arange(4.0)
    moments = {"exp_avg": tied, "exp_avg_sq": torch.ones(4), "n": 1}
    saved = {"state": {0: moments}, "tied": [tied, 2, torch.arange(6.0).reshape(2, 3)]}
    aiosnap.save_sync(str(path), saved)
    # The last has no place to be read into (not contiguous): it is made, then copied.
    target = {
        "state": {0: {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4), "n": 0}},
        "tied": [torch.zeros(4), 0, torch.zeros(3, 2).t()],
    }
    inner, other = target["state"][0], target["tied"][0]
    walked = _walked(monkeypatch)
    aiosnap.load_into_sync(str(path), target)
    assert walked == [["tied.0", "tied.2"]]  # the whole dict's leaf is not walked, the others are
    assert_tree_equal(target, saved)
    assert target["state"][0] is inner and target["tied"][0] is other


def test_an_entry_of_a_whole_dict_used_elsewhere_as_another_kind_is_refused(tmp_path: Path) -> None:
    from .hostile import parse, render

    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), {"state": {0: {"m": torch.ones(2)}}, "x": [np.zeros(2)]})
    parts = parse(path.read_bytes())
    name = parts.meta["tree"]["items"][0][1]["items"][0][1]["items"][0][1]["n"]
    parts.meta["tree"]["items"][1][1][0]["n"] = name  # the list's ndarray names the dict's tensor
    path.write_bytes(render(parts))
    target = {"state": {0: {"m": torch.zeros(2)}}, "x": [np.zeros(2)]}
    refused = f"bad tree: x.0 is a ndarray but {name!r} is a tensor"
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match=refused):
        aiosnap.load_into_sync(str(path), target)


class _HandsOutItsDict:
    """A Stateful object whose state_dict is its own dict, and whose load_state_dict
    empties that dict before it takes what it is given."""

    def __init__(self) -> None:
        self.sd: dict[str, Any] = {"w": torch.zeros(3), "n": 0}

    def state_dict(self) -> dict[str, Any]:
        return self.sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sd.clear()
        self.sd.update(sd)


def test_a_stateful_object_gets_a_dict_of_its_own_even_when_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), {"h": {"w": torch.ones(3), "n": 5}})
    holder = _HandsOutItsDict()
    aiosnap.load_into_sync(str(path), {"h": holder})
    assert_tree_equal(holder.sd, {"w": torch.ones(3), "n": 5})
