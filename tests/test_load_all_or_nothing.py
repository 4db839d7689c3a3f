"""load_into is all or nothing (issue 40): a load that fails for any reason -- a key, a
shape, a dtype, an optimizer's parameter groups, a checksum -- leaves every tensor of the
target as it was, bit for bit, and calls no load_state_dict. Each case is a target whose
other tensors fit, so that a load which checked as it went would have written them."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aiosnap

from .conftest import raw_bytes


def _mlp(hidden: int, extra: bool = False, seed: int = 0) -> torch.nn.Sequential:
    """Two layers; ``extra``: a third after them (the first two's keys and shapes alike)."""
    torch.manual_seed(seed)
    parts: list[torch.nn.Module] = [torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4)]
    if extra:
        parts += [torch.nn.ReLU(), torch.nn.Linear(4, 4)]
    return torch.nn.Sequential(*parts)


def _trained(hidden: int, extra: bool = False, seed: int = 0) -> dict[str, Any]:
    model = _mlp(hidden, extra, seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "step": 7}


def _tensors(obj: Any) -> list[torch.Tensor | np.ndarray[Any, Any]]:
    """Every tensor and array the target holds, its Stateful objects' included."""
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return [obj]
    if isinstance(obj, torch.optim.Optimizer):
        return [t for s in obj.state.values() for t in _tensors(s)] + [
            p for g in obj.param_groups for p in g["params"]
        ]
    if isinstance(obj, torch.nn.Module):
        return list(obj.state_dict(keep_vars=True).values())
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _image(target: Any) -> list[tuple[int, bytes]]:
    """The identity and the bytes of every tensor of the target."""
    out = []
    for t in _tensors(target):
        data = raw_bytes(t.detach()).numpy().tobytes() if isinstance(t, torch.Tensor) else t.tobytes()
        out.append((id(t), data))
    return out


@pytest.fixture
def loads_of_state(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the classes whose load_state_dict was called."""
    calls: list[str] = []
    for cls in (torch.nn.Module, torch.optim.Optimizer):
        real = cls.load_state_dict

        def spy(self: Any, *args: Any, _real: Callable[..., Any] = real, **kwargs: Any) -> Any:
            calls.append(type(self).__name__)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "load_state_dict", spy)
    return calls


def _refused(path: Path, target: Any, error: type[Exception], match: str, **kwargs: Any) -> None:
    before = _image(target)
    with pytest.raises(error) as info:
        aiosnap.load_into_sync(str(path), target, **kwargs)
    assert _image(target) == before, "the target changed"
    assert re.search(match, str(info.value)), str(info.value)


def test_a_wider_model_is_refused_before_any_parameter_changes(
    tmp_path: Path, loads_of_state: list[str]
) -> None:
    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), _trained(hidden=32))
    target = _trained(hidden=64, seed=1)  # the last layer's bias (4,) fits; the rest does not
    _refused(path, target, aiosnap.errors.StateMismatchError, r"model\.0\.weight: .*\(64, 8\)")
    assert loads_of_state == []


def test_a_shape_mismatch_in_a_dict_leaves_the_others(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), {"a": torch.ones(1000), "b": torch.ones(2, 3), "c": np.ones(5)})
    target = {"a": torch.zeros(1000), "b": torch.zeros(3, 2), "c": np.zeros(5)}
    _refused(path, target, aiosnap.errors.StateMismatchError, r"b: checkpoint has torch.float32 \(2, 3\)")


def test_a_dtype_mismatch_leaves_the_others(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), {"a": torch.ones(1000), "b": torch.ones(4), "c": np.ones(3, np.float32)})
    target = {"a": torch.zeros(1000), "b": torch.zeros(4, dtype=torch.float64), "c": np.zeros(3, np.float32)}
    _refused(path, target, aiosnap.errors.StateMismatchError, r"b: .*torch.float64")
    target = {"a": torch.zeros(1000), "b": torch.zeros(4), "c": np.zeros(3, np.float64)}
    _refused(path, target, aiosnap.errors.StateMismatchError, r"c: .*float64")


def test_a_missing_key_leaves_the_target(tmp_path: Path, loads_of_state: list[str]) -> None:
    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), {"a": torch.ones(1000), "b": torch.ones(4)})
    _refused(
        path,
        {"a": torch.zeros(1000), "b": torch.zeros(4), "c": torch.zeros(2)},
        aiosnap.errors.StateMismatchError,
        "c",
    )
    state = _trained(hidden=16)
    aiosnap.save_sync(str(path), state)
    bigger = _trained(hidden=16, extra=True, seed=1)  # its first two layers fit
    _refused(
        path,
        {**bigger, "step": 0},
        aiosnap.errors.StateMismatchError,
        r"model: missing keys \['4\.weight', '4\.bias'\]",
    )
    assert loads_of_state == []


def test_an_unexpected_key_leaves_the_target(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), {"a": torch.ones(1000), "b": torch.ones(4), "n": 3})
    target = {"a": torch.zeros(1000), "b": torch.zeros(4)}
    _refused(path, target, aiosnap.errors.StateMismatchError, r"unexpected keys \['n'\]")


def test_an_optimizer_of_other_groups_leaves_the_model_as_it_was(
    tmp_path: Path, loads_of_state: list[str]
) -> None:
    """The issue's case: strict=False and a model with an extra layer loaded the model,
    then the optimizer refused its state."""
    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), _trained(hidden=16))
    target = _trained(hidden=16, extra=True, seed=1)
    match = r"optimizer\.param_groups\.0: the checkpoint's group has 4 parameters, the optimizer's 6"
    _refused(path, target, aiosnap.errors.StateMismatchError, match, strict=False)
    assert loads_of_state == []
    fresh = _mlp(16, extra=True, seed=2)  # an optimizer with no state yet: its group still differs
    target = {"model": fresh, "optimizer": torch.optim.Adam(fresh.parameters())}
    _refused(path, target, aiosnap.errors.StateMismatchError, match, strict=False)
    assert loads_of_state == [] and not target["optimizer"].state


def test_an_optimizer_of_another_number_of_groups_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), _trained(hidden=16))
    model = _mlp(16, seed=1)
    halves = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.1}]
    target = {"model": model, "optimizer": torch.optim.Adam(halves), "step": 0}
    _refused(
        path,
        target,
        aiosnap.errors.StateMismatchError,
        "the checkpoint has 1 parameter groups, the optimizer 2",
    )


@pytest.mark.parametrize("where", ["model", "optimizer"])
def test_a_damaged_tensor_leaves_every_tensor_as_it_was(
    tmp_path: Path, where: str, loads_of_state: list[str]
) -> None:
    """A byte flipped in one entry's data: refused with every tensor of the target as it
    was, whether the entry is one read in place (the model's) or into memory of its own
    (the optimizer's moments, for an optimizer that has no state yet)."""
    from .hostile import parse

    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), _trained(hidden=64))
    parts = parse(path.read_bytes())
    name = "model.2.bias" if where == "model" else "optimizer.state.3.exp_avg_sq"
    raw = bytearray(path.read_bytes())
    raw[len(raw) - len(parts.data) + parts.header[name]["data_offsets"][1] - 1] ^= 0x01
    path.write_bytes(bytes(raw))
    target = _trained(hidden=64, seed=1) if where == "model" else {**_trained(hidden=64, seed=1), "step": 0}
    if where == "optimizer":
        target["optimizer"] = torch.optim.Adam(target["model"].parameters())
    _refused(path, target, aiosnap.errors.CorruptCheckpointError, f"checksum mismatch in tensor '{name}'")
    assert loads_of_state == [] and target["step"] in (0, 7)


def test_a_mismatch_says_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), {"model": {"w": torch.ones(2)}, "extra": {"n": 1}})
    with pytest.raises(aiosnap.errors.StateMismatchError) as info:
        aiosnap.load_into_sync(str(path), {"model": {"w": torch.zeros(2)}})
    message = str(info.value)
    assert "unexpected keys ['extra']" in message and "missing keys" not in message
    assert "strict=False" in message and "keys=['model']" in message


async def test_a_corrupt_newest_checkpoint_leaves_the_target_to_the_one_restored(tmp_path: Path) -> None:
    """The manager's restore falls back past a corrupt newest checkpoint: the older one
    it then restores is all the target holds. Step 2 holds ``a`` and ``b`` (``b``
    damaged), step 1 ``b`` alone: restored with strict=False, ``a`` is as it was."""
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        await mgr.save(1, {"b": torch.full((1000,), 1.0)})
        await mgr.save(2, {"a": torch.full((1000,), 2.0), "b": torch.full((1000,), 2.0)})
    newest = tmp_path / "snapshot_iter_2"
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0x01  # the data section ends with b's
    newest.write_bytes(bytes(data))
    target = {"a": torch.zeros(1000), "b": torch.zeros(1000)}
    async with aiosnap.CheckpointManager(str(tmp_path)) as mgr:
        restored = await mgr.restore(target=target, strict=False)
    assert restored.step == 1
    assert torch.equal(target["b"], torch.full((1000,), 1.0)) and torch.equal(target["a"], torch.zeros(1000))
