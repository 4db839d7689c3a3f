"""aiosnap.integrations.accelerate against the real Accelerate: a killed run resumes with
``load_state()`` with the same losses, bit for bit (dropout included: the RNG states come
back); ``load_state`` restores the naming counter; ``total_limit`` deletes only after the
new folder is durable, and only aiosnap's; a damaged newest checkpoint is skipped; a
``save_state`` into an existing folder, killed at a rename or fsync of its publish, leaves
a folder ``load_state`` reads and the next save keeps."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate", reason="needs aiosnap[accelerate]")

from accelerate.utils import ProjectConfiguration

from aiosnap.integrations.accelerate import STATE_NAME, AiosnapAccelerator
from tests.integration_runs import (
    Child,
    assert_aiosnap_checkpoint,
    assert_resumed_exactly,
    kill_points,
    loss,
    pause_at_file_ops,
    report,
    temp_entries,
)

STEPS = 24
EVERY = 4
LIMIT = 2


class _Progress:
    """The loop's position, registered for checkpointing."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def _setup(project: str) -> tuple[AiosnapAccelerator, Any, Any, Any, _Progress]:
    torch.manual_seed(0)
    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True, total_limit=LIMIT)
    accelerator = AiosnapAccelerator(cpu=True, project_config=config)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(256, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    progress = _Progress()
    accelerator.register_for_checkpointing(progress)
    return accelerator, model, optimizer, scheduler, progress


def _train(parts: tuple[AiosnapAccelerator, Any, Any, Any, _Progress], until: int) -> None:
    accelerator, model, optimizer, scheduler, progress = parts
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, 32, generator=g)
    y = x.sum(-1, keepdim=True)
    report("resumed", progress.step)
    while progress.step < until:
        i = progress.step % len(x)
        value = torch.nn.functional.mse_loss(model(x[i]), y[i])
        accelerator.backward(value)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        progress.step += 1
        loss(progress.step, value.item())
        if progress.step % EVERY == 0:
            report("saved", accelerator.save_state().name)
    accelerator.end_training()


def child(project: str, resume: str) -> None:
    torch.set_num_threads(1)
    parts = _setup(project)
    if resume == "resume":
        parts[0].load_state()
    _train(parts, STEPS)


def _folders(project: Path) -> list[str]:
    return sorted(os.listdir(project / "checkpoints"), key=lambda n: int(n.split("_")[-1]))


def test_killed_run_resumes_with_load_state_bit_identical(tmp_path: Path) -> None:
    run = tmp_path / "run"
    reference = Child(
        "tests.test_integration_accelerate.child", tmp_path / "ref", "fresh", log=tmp_path / "r.log"
    )
    killed = Child("tests.test_integration_accelerate.child", run, "fresh", log=tmp_path / "killed.log")
    assert killed.finish(kill_after_save=4).killed  # right after the save of step 16 returned
    ref = reference.finish()
    resumed = Child("tests.test_integration_accelerate.child", run, "resume", log=tmp_path / "resumed.log")
    start = assert_resumed_exactly(ref, resumed.finish(), STEPS)
    # A save call returns with at most max_pending + 1 = 3 saves in flight: the first is durable.
    assert start in (4, 8, 12, 16), f"resumed from step {start}: not from a checkpoint of the killed run"
    folders = _folders(run)
    # The counter went on from the newest folder the killed run left, whatever its number.
    assert len(folders) == LIMIT and folders[-1] == f"checkpoint_{int(folders[-2][11:]) + 1}"
    for name in folders:
        assert os.listdir(run / "checkpoints" / name) == [STATE_NAME]
        assert_aiosnap_checkpoint(run / "checkpoints" / name / STATE_NAME)
    assert temp_entries(run) == []


def test_load_state_restores_the_naming_counter(tmp_path: Path) -> None:
    _train(_setup(str(tmp_path)), 8)  # checkpoint_0, checkpoint_1
    parts = _setup(str(tmp_path))
    parts[0].load_state()
    assert parts[4].step == 8
    _train(parts, 12)  # would fail with "already exists" without the counter
    assert _folders(tmp_path) == ["checkpoint_1", "checkpoint_2"]


def test_total_limit_spares_folders_aiosnap_did_not_write(tmp_path: Path) -> None:
    foreign = tmp_path / "checkpoints" / "checkpoint_0"
    foreign.mkdir(parents=True)
    (foreign / "model.safetensors").write_bytes(b"not ours")
    parts = _setup(str(tmp_path))
    parts[0].project_configuration.iteration = 1
    _train(parts, 16)
    assert _folders(tmp_path) == ["checkpoint_0", "checkpoint_3", "checkpoint_4"]
    assert (foreign / "model.safetensors").read_bytes() == b"not ours"


def test_load_state_skips_a_damaged_newest_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _train(_setup(str(tmp_path)), 8)
    newest = tmp_path / "checkpoints" / "checkpoint_1" / STATE_NAME
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF
    newest.write_bytes(bytes(data))
    parts = _setup(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        parts[0].load_state()
    assert parts[4].step == 4 and "load_state skips" in caplog.text
    assert parts[0].project_configuration.iteration == 2  # past the damaged one still


def test_end_training_raises_a_failed_save(tmp_path: Path) -> None:
    torch.manual_seed(0)
    accelerator = AiosnapAccelerator(cpu=True)  # no automatic naming: save_state(folder)
    accelerator.prepare(torch.nn.Linear(4, 1))
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("someone else's")
    assert accelerator.save_state(str(taken)) == taken  # returns at once; publishing fails
    with pytest.raises(FileExistsError, match="aiosnap did not write it"):
        accelerator.end_training()
    assert os.listdir(taken) == ["notes.txt"]
    assert temp_entries(tmp_path) == []


def _plain(value: float) -> tuple[AiosnapAccelerator, Any]:
    """An accelerator without automatic naming and a model whose every weight is ``value``
    (a constructed value: which save a folder holds is read off it)."""
    accelerator = AiosnapAccelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 1))
    _fill(model, value)
    return accelerator, model


def _fill(model: Any, value: float) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(value)


def _holds(model: Any) -> float:
    values = torch.cat([p.detach().flatten() for p in model.parameters()]).unique()
    assert len(values) == 1, values
    return float(values[0])


def resave_child(folder: str) -> None:
    """Saves ``folder`` (every weight 1), then saves it again (every weight 2), each system
    call of the second save paused for the parent."""
    torch.set_num_threads(1)
    accelerator, model = _plain(1.0)
    accelerator.save_state(folder)
    accelerator.flush()
    pause_at_file_ops(os.path.dirname(folder))
    _fill(model, 2.0)
    accelerator.save_state(folder)
    accelerator.end_training()


def _after_the_kill(case: Path, expected: float) -> None:
    """What the killed re-save left: ``load_state`` reads a whole folder, the old or the
    new (``expected``); a later process's first save beside it (its sweep) keeps it; the
    next save into it replaces it and leaves no temp folder."""
    loaded = shutil.copytree(case, case.with_name(case.name + "-load"), symlinks=True)
    accelerator, model = _plain(0.0)
    accelerator.load_state(str(loaded / "latest"))  # before any save: the load path's own repair
    assert _holds(model) == expected
    accelerator.end_training()
    saved = shutil.copytree(case, case.with_name(case.name + "-save"), symlinks=True)
    accelerator, model = _plain(3.0)
    accelerator.save_state(str(saved / "best"))  # sweeps the folder's parent first
    accelerator.flush()
    accelerator.load_state(str(saved / "latest"))
    assert _holds(model) == expected
    _fill(model, 3.0)
    accelerator.save_state(str(saved / "latest"))
    accelerator.end_training()
    accelerator, model = _plain(0.0)
    accelerator.load_state(str(saved / "latest"))
    assert _holds(model) == 3.0
    accelerator.end_training()
    assert sorted(os.listdir(saved)) == ["best", "latest"] and temp_entries(saved) == []


# "aside" (before the old folder moves) and every other call: in the slow run.
@pytest.mark.parametrize("point", ["between", "after", pytest.param("every", marks=pytest.mark.slow)])
def test_save_state_into_an_existing_folder_killed_at_its_publish(tmp_path: Path, point: str) -> None:
    # A real child, SIGKILLed before a rename or fsync of its second save_state("latest").
    def prepare(case: Path) -> list[object]:
        return [case / "latest"]

    runs = kill_points("tests.test_integration_accelerate.resave_child", tmp_path, "latest", point, prepare)
    for n, run in enumerate(runs):
        if n == 0 and point == "every":  # the run left to finish: what the others are killed before
            assert {"fsync", "dirsync", "rename"} <= {kind for kind, _, _ in run.made}, run.made
        try:
            _after_the_kill(run.case, 2.0 if run.renamed_into(run.case / "latest") else 1.0)
        except AssertionError as exc:
            exc.add_note(f"killed before {run.at} (calls made: {run.made})")
            raise
