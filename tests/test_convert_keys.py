"""Dict keys keep their types across a conversion through DCP (issue 39 item 8), and a
state whose keys cannot match is refused rather than handed over to be ignored.

DCP writes every key as text: an optimizer's state ``{0: ...}`` came back from
``convert --to dcp`` and back as ``{"0": ...}``, which ``load_state_dict`` takes without
a word and the optimizer then ignores (no parameter got its moments)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosnap
from aiosnap.cli import main

from .conftest import assert_tree_equal


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    out, _ = capsys.readouterr()
    return code, out


def _model_and_optimizer(seed: int, step: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if step:
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
    return model, optimizer


def test_int_keys_and_empty_dicts_survive_a_round_trip_through_dcp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, optimizer = _model_and_optimizer(0, step=True)
    _, unused = _model_and_optimizer(1, step=False)  # its state is {}: DCP stores nothing of it
    saved = {"model": model, "optimizer": optimizer, "unused": unused, "by_id": {3: 1.5, None: "x", 2.5: [1]}}
    source, dcp_dir, back = tmp_path / "a.snap", tmp_path / "dcp", tmp_path / "back.snap"
    aiosnap.save_sync(str(source), saved)
    assert _run(capsys, "convert", str(source), str(dcp_dir), "--to", "dcp")[0] == 0
    assert _run(capsys, "convert", str(dcp_dir), str(back), "--allow-pickle")[0] == 0
    code, out = _run(capsys, "diff", str(source), str(back), "--allow-pickle")
    assert code == 0, out
    fresh, fresh_optimizer = _model_and_optimizer(2, step=False)
    _, fresh_unused = _model_and_optimizer(3, step=False)
    target = {"model": fresh, "optimizer": fresh_optimizer, "unused": fresh_unused, "by_id": None}
    aiosnap.load_into_sync(str(back), target)
    assert sorted(fresh_optimizer.state_dict()["state"]) == [0, 1, 2, 3]
    assert_tree_equal(fresh_optimizer.state_dict(), optimizer.state_dict())  # every parameter's moments
    assert target["by_id"] == {3: 1.5, None: "x", 2.5: [1]}


def test_a_dcp_directory_written_again_by_dcp_is_read_as_dcp_left_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch.distributed.checkpoint.state_dict_saver import save

    source, dcp_dir, back = tmp_path / "a.snap", tmp_path / "dcp", tmp_path / "back.snap"
    aiosnap.save_sync(str(source), {"state": {0: torch.ones(2)}})
    assert _run(capsys, "convert", str(source), str(dcp_dir), "--to", "dcp")[0] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns of every call without a process group
        save({"state": {0: torch.zeros(3)}, "more": torch.ones(1)}, checkpoint_id=str(dcp_dir), no_dist=True)
    assert _run(capsys, "convert", str(dcp_dir), str(back), "--allow-pickle", "--force")[0] == 0
    assert set(aiosnap.load_sync(str(back))["state"]) == {"0"}  # our keys file is for another .metadata


def test_an_optimizer_state_keyed_by_text_is_refused(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer(0, step=True)
    state = optimizer.state_dict()
    as_dcp_left_it = {
        "state": {str(k): v for k, v in state["state"].items()},
        "param_groups": state["param_groups"],
    }
    path = tmp_path / "ckpt"
    aiosnap.save_sync(str(path), {"model": model, "optimizer": as_dcp_left_it})
    fresh, fresh_optimizer = _model_and_optimizer(1, step=False)
    weights = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(
        aiosnap.errors.StateMismatchError, match=r"optimizer\.state: .* keys \['0', '1', '2', '3'\]"
    ):
        aiosnap.load_into_sync(str(path), {"model": fresh, "optimizer": fresh_optimizer})
    assert not fresh_optimizer.state and all(
        torch.equal(a, b) for a, b in zip(weights, fresh.parameters(), strict=True)
    )


def test_diff_shows_the_types_of_keys_that_print_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a.snap", tmp_path / "b.snap"
    aiosnap.save_sync(str(a), {"state": {0: torch.ones(2)}, "n": 1})
    aiosnap.save_sync(str(b), {"state": {"0": torch.ones(2)}, "n": 1})
    code, out = _run(capsys, "diff", str(a), str(b), "--json")
    entries: dict[str, Any] = {e["status"]: e for e in json.loads(out)["entries"] if e["path"] == "state.0"}
    assert code == 1 and set(entries) == {"removed", "added"}
    assert entries["removed"]["detail"] == "tensor float32 [2]; key 0 is int"
    assert entries["added"]["detail"] == "tensor float32 [2]; key '0' is str"
    code, out = _run(capsys, "diff", str(a), str(b))
    assert "key 0 is int" in out and "key '0' is str" in out
