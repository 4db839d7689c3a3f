"""Views and aliases: what capture stores once, and what it must store apart.

A tensor reached twice is stored once (tied weights). Two tensors that only look alike
(a conjugate or negative view over its base's bytes; two empty tensors, whose storages
all have the data pointer 0) are two entries. A seeded fuzz of view kinds round-trips
bit-exact through aiosnap, through safetensors reading aiosnap's file, and through
aiosnap reading safetensors' file. Also: a state_dict() chain that never ends is refused.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file

import aiosnap


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of the values ``t`` shows (its conjugate and negative bits applied), in
    order. Copied into a fresh flat tensor: a view's size-1 or empty dimensions may have
    any strides, which torch counts as contiguous and then refuses to view as bytes."""
    x = t.detach().resolve_conj().resolve_neg()
    x = x.view(_SAME_WIDTH[x.dtype.itemsize])  # exotic dtypes have no copy kernel of their own
    out = torch.empty(x.numel(), dtype=x.dtype)
    out.copy_(x.reshape(-1))
    return out.view(torch.uint8)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(_bits(got), _bits(want))


def _stored_names(path: Path) -> dict[str, str]:
    """Key -> the safetensors entry an aiosnap file of a flat dict stores it under."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    doc = json.loads(json.loads(raw[8 : 8 + n])["__metadata__"]["aiosnap"])
    return {key: node["n"] for key, node in doc["tree"]["items"]}


def _complex(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.complex(torch.randn(n, generator=g), torch.randn(n, generator=g))


_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# -- the two defects -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda x: {"a": x, "b": x.conj()},
        lambda x: {"a": x.imag, "b": x.conj().imag},  # a negative view of the same bytes
        lambda x: {"a": x.conj(), "b": x},
        lambda x: {"a": x.real, "b": torch._neg_view(x.real)},
    ],
    ids=["conj", "imag-of-conj", "conj-first", "neg"],
)
def test_a_conjugate_or_negative_view_is_stored_apart_from_its_base(
    tmp_path: Path, make: Callable[[torch.Tensor], dict[str, torch.Tensor]]
) -> None:
    # Was: one entry for both (the alias key left out the conj and neg bits), so `b`
    # loaded with its base's values, and safetensors saw no `b` at all.
    state = make(_complex(6, 0).reshape(2, 3))
    path = tmp_path / "c"
    aiosnap.save_sync(str(path), state)
    loaded = aiosnap.load_sync(str(path))
    by_safetensors = load_file(str(path))
    for key, want in state.items():
        assert _same(loaded[key], want), key
        assert _same(by_safetensors[key], want), key


def test_distinct_empty_tensors_are_two_entries(tmp_path: Path) -> None:
    # safetensors' test_multiple_zero_sized. Was: one entry (both storages have the data
    # pointer 0), KeyError 'test2' in load_file, one object under both names in load.
    empty = torch.zeros((2, 0))
    state = {"test": torch.zeros((2, 0)), "test2": torch.zeros((2, 0)), "tied": empty, "tied_again": empty}
    path = tmp_path / "c"
    aiosnap.save_sync(str(path), state)
    loaded = aiosnap.load_sync(str(path))
    assert loaded["test"] is not loaded["test2"]
    assert loaded["tied"] is loaded["tied_again"]  # one tensor reached twice stays one
    by_safetensors = load_file(str(path))
    assert {"test", "test2", "tied"} <= set(by_safetensors)
    for key in ("test", "test2"):
        assert torch.equal(by_safetensors[key], state[key]) and torch.equal(loaded[key], state[key])


# -- the fuzz --------------------------------------------------------------------------------------


def _ops(t: torch.Tensor) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """The view operations that apply to ``t``."""
    ops: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [
        ("same", lambda v: v),
        ("neg", torch._neg_view),
        ("slice", lambda v: v[1:] if v.dim() and v.shape[0] > 1 else v),
        ("step", lambda v: v[::2] if v.dim() else v),
        ("empty", lambda v: v[1:1] if v.dim() and v.shape[0] >= 1 else v),
        ("index", lambda v: v[0] if v.dim() and v.shape[0] else v),
        ("element", lambda v: v[(0,) * v.dim()] if v.numel() else v),  # a 0-d view
        ("unsqueeze", lambda v: v.unsqueeze(0)),
        ("expand", lambda v: v.unsqueeze(0).expand(3, *v.shape)),  # stride 0
    ]
    if t.dim() >= 2:
        ops += [("t", lambda v: v.transpose(0, 1)), ("diagonal", lambda v: v.diagonal())]
    if t.is_complex():
        ops += [("conj", torch.conj), ("imag", lambda v: v.imag), ("real", lambda v: v.real)]
        if not t.is_conj() and (t.dim() == 0 or t.stride(-1) == 1):
            ops.append(("as_real", torch.view_as_real))
    return ops


def _case(rng: random.Random) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A state of views of one or two bases (some tensors reached twice), and how each
    view was made."""
    seed = rng.randrange(1 << 30)
    bases = [
        _complex(24, seed).reshape(2, 3, 4),
        torch.randn(4, 6, generator=torch.Generator().manual_seed(seed)),
    ]
    bases = [bases[0], bases[1], bases[1].to(torch.bfloat16), torch.zeros(0, 3)][: rng.randint(1, 4)]
    state: dict[str, torch.Tensor] = {}
    made: list[str] = []
    for i in range(rng.randint(2, 7)):
        view = rng.choice(bases)
        steps = []
        for _ in range(rng.randint(0, 3)):
            name, op = rng.choice(_ops(view))
            view = op(view)
            steps.append(name)
        if state and rng.random() < 0.15:  # a tensor reached twice
            key = rng.choice(list(state))
            view, steps = state[key], [f"={key}"]
        state[f"v{i}"] = view
        made.append(f"v{i}: {'.'.join(steps) or 'base'} {tuple(view.shape)} {view.dtype}")
    return state, made


def _round_trips(tmp_path: Path, state: dict[str, torch.Tensor], made: list[str]) -> None:
    how = "; ".join(made)
    path = tmp_path / "c"
    aiosnap.save_sync(str(path), state)
    loaded = aiosnap.load_sync(str(path))
    by_safetensors, names = load_file(str(path)), _stored_names(path)
    for key, want in state.items():
        assert _same(loaded[key], want), f"aiosnap.load {key}: {how}"
        assert _same(by_safetensors[names[key]], want), f"safetensors.load_file {key}: {how}"
    # safetensors writes only contiguous tensors of their own: each view's values, apart.
    plain = {k: v.resolve_conj().resolve_neg().contiguous().clone() for k, v in state.items()}
    save_file(plain, str(tmp_path / "st.safetensors"))
    from_safetensors = aiosnap.load_sync(str(tmp_path / "st.safetensors"))
    for key, want in state.items():
        assert _same(from_safetensors[key], want), f"aiosnap.load of save_file's {key}: {how}"


@pytest.mark.parametrize("seed", range(3))
def test_views_of_every_kind_round_trip_bit_exact(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(12):
        _round_trips(tmp_path, *_case(rng))


@pytest.mark.slow
def test_views_of_every_kind_round_trip_bit_exact_long(tmp_path: Path) -> None:
    rng = random.Random(1234)
    for _ in range(1500):
        _round_trips(tmp_path, *_case(rng))


def test_the_fuzz_makes_the_views_it_means_to() -> None:
    # The fuzz is only as good as its cases: every view kind, mixed with others, occurs.
    rng = random.Random(0)
    seen: set[str] = set()
    flags = {"conj": False, "neg": False, "empty": False, "zero_d": False, "stride0": False, "twice": False}
    for _ in range(36):
        state, made = _case(rng)
        seen |= {step for line in made for step in line.split()[1].split(".")}
        for v in state.values():
            flags["conj"] |= v.is_conj()
            flags["neg"] |= v.is_neg()
            flags["empty"] |= v.numel() == 0
            flags["zero_d"] |= v.dim() == 0
            flags["stride0"] |= 0 in v.stride() and v.numel() > 1
        flags["twice"] |= any("=" in line for line in made)
    assert all(flags.values()), flags
    assert {name for name, _ in _ops(_complex(4, 0).reshape(2, 2))} <= seen


# -- state_dict() chains ---------------------------------------------------------------------------


class _Returns:
    """A stateful object whose state_dict() returns what ``state`` makes of it."""

    def __init__(self, state: Callable[[Any], Any]) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state(self)

    def load_state_dict(self, state: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (_Returns(lambda self: self), "holds that object again"),
        (_Returns(lambda self: {"me": self}), "holds that object again"),
        (_Returns(lambda self: _Returns(lambda inner: self)), "holds that object again"),
        (_Returns(lambda self: _Returns(self.state)), "16 times in a row"),  # a new one every time
        (mock.MagicMock(), "16 times in a row"),  # ppe's test_simple_writer saves one
    ],
    ids=["itself", "itself-inside", "back-to-the-first", "endless", "MagicMock"],
)
def test_a_state_dict_that_never_ends_is_refused_naming_its_path(
    tmp_path: Path, value: Any, match: str
) -> None:
    # Was: RecursionError.
    with pytest.raises(aiosnap.errors.UnsupportedTypeError, match=match) as caught:
        aiosnap.save_sync(str(tmp_path / "c"), {"trainer": [1, value]})
    assert " trainer.1" in str(caught.value)
    assert not (tmp_path / "c").exists()


def test_a_state_dict_that_returns_another_stateful_object_is_followed(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    wrapper = _Returns(lambda self: model)  # a wrapper handing over its inner object's state
    shared = _Returns(lambda self: {"w": torch.ones(1)})
    state = {"wrapped": wrapper, "a": shared, "b": shared}  # one object twice: no cycle
    aiosnap.save_sync(str(tmp_path / "c"), state)
    loaded = aiosnap.load_sync(str(tmp_path / "c"))
    assert torch.equal(loaded["wrapped"]["weight"], model.weight.detach())
    assert torch.equal(loaded["a"]["w"], torch.ones(1)) and torch.equal(loaded["b"]["w"], torch.ones(1))
