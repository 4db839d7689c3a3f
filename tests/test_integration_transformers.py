"""aiosnap.integrations.transformers against the real Trainer (a tiny BERT built here, no
download): a killed run resumes with ``train(resume_from_checkpoint=True)`` with the same
losses, bit for bit; each ``checkpoint-N`` appears whole; ``save_total_limit`` rotates
after the commit and only aiosnap's directories; a failed save is raised by ``train``; a
re-save of an existing ``checkpoint-N``, killed at a rename or fsync of its publish, leaves
a directory the Trainer resumes from and its next ``train()`` keeps."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="needs aiosnap[transformers]")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import (
    BertConfig,
    BertForSequenceClassification,
    TrainerCallback,
    TrainingArguments,
)

from aiosnap.integrations.transformers import STATE_NAME, AiosnapTrainer
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

EPOCHS = 3
STEPS = 8  # per epoch: 64 samples in batches of 8
EVERY = 4
LIMIT = 2


class _Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 100, (STEPS * 8, 12), generator=g)
        self.labels = torch.randint(0, 2, (STEPS * 8,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class _Report(TrainerCallback):
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        report("resumed", state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            loss(state.global_step, logs["loss"])

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        report("saved", state.global_step)  # fires right after the save call returned


def _trainer(
    out: str, epochs: int = EPOCHS, callbacks: tuple[TrainerCallback, ...] = (), **options: Any
) -> AiosnapTrainer:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37
    )
    args = TrainingArguments(
        out,
        per_device_train_batch_size=8,
        num_train_epochs=epochs,
        save_steps=EVERY,
        save_total_limit=LIMIT,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        **options,
    )
    return AiosnapTrainer(
        model=BertForSequenceClassification(config),
        args=args,
        train_dataset=_Data(),
        callbacks=[_Report(), *callbacks],
    )


def child(out: str, resume: str) -> None:
    torch.set_num_threads(1)
    _trainer(out).train(resume_from_checkpoint=resume == "resume")


def _checkpoints(directory: Path) -> list[str]:
    return sorted(
        (n for n in os.listdir(directory) if n.startswith("checkpoint-")), key=lambda n: int(n[11:])
    )


def test_killed_run_resumes_from_the_last_checkpoint_bit_identical(tmp_path: Path) -> None:
    run = tmp_path / "run"
    reference = Child(
        "tests.test_integration_transformers.child", tmp_path / "ref", "fresh", log=tmp_path / "r.log"
    )
    killed = Child("tests.test_integration_transformers.child", run, "fresh", log=tmp_path / "killed.log")
    assert killed.finish(kill_after_save=4).killed  # right after the save of step 16 returned
    ref = reference.finish()
    resumed = Child("tests.test_integration_transformers.child", run, "resume", log=tmp_path / "resumed.log")
    got = resumed.finish()
    start = assert_resumed_exactly(ref, got, EPOCHS * STEPS)
    # A save call returns with at most max_pending + 1 = 3 saves in flight: the first is durable.
    assert start in (4, 8, 12, 16), f"resumed from step {start}: not from a checkpoint of the killed run"
    assert _checkpoints(run) == [f"checkpoint-{EPOCHS * STEPS - EVERY}", f"checkpoint-{EPOCHS * STEPS}"]
    for name in _checkpoints(run):
        assert sorted(os.listdir(run / name)) == [STATE_NAME, "trainer_state.json"]
        assert_aiosnap_checkpoint(run / name / STATE_NAME)
        assert json.loads((run / name / "trainer_state.json").read_text())["global_step"] == int(name[11:])
    assert temp_entries(run) == []


def test_rotation_spares_directories_aiosnap_did_not_write(tmp_path: Path) -> None:
    foreign = tmp_path / "checkpoint-1"
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"not ours")
    _trainer(str(tmp_path), epochs=2).train()  # returns once every save is durable
    assert _checkpoints(tmp_path) == ["checkpoint-1", "checkpoint-12", "checkpoint-16"]
    assert (foreign / "model.safetensors").read_bytes() == b"not ours"
    assert temp_entries(tmp_path) == []


def test_a_failed_save_is_raised_by_train_and_leaves_no_temp_directory(tmp_path: Path) -> None:
    taken = tmp_path / "checkpoint-4"
    taken.mkdir()
    (taken / "notes.txt").write_text("someone else's")  # publishing checkpoint-4 must fail
    with pytest.raises(FileExistsError, match="aiosnap did not write it"):
        _trainer(str(tmp_path), epochs=1).train()
    assert (taken / "notes.txt").read_text() == "someone else's"
    assert temp_entries(tmp_path) == []
    for name in _checkpoints(tmp_path):
        if name != "checkpoint-4":
            assert_aiosnap_checkpoint(tmp_path / name / STATE_NAME)


class _Fill(TrainerCallback):
    """Sets the classifier's bias to ``value`` after every step: a constructed value that
    tells which save a checkpoint holds."""

    def __init__(self, value: float) -> None:
        self.value = value

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        with torch.no_grad():
            model.classifier.bias.fill_(self.value)


class _Resumed(TrainerCallback):
    """The step and the classifier's bias a run started from."""

    step = -1
    bias: torch.Tensor

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.step, self.bias = state.global_step, model.classifier.bias.detach().clone()

    def holds(self) -> float:
        values = self.bias.unique()
        assert len(values) == 1, values
        return float(values[0])


def resave_child(out: str) -> None:
    """Trains 4 steps and saves checkpoint-4 (bias 1); trains again from the start in the
    same folder and saves checkpoint-4 again (bias 2), each system call of that run paused
    for the parent."""
    torch.set_num_threads(1)
    _trainer(out, max_steps=EVERY, callbacks=(_Fill(1.0),)).train()
    pause_at_file_ops(out)
    _trainer(out, max_steps=EVERY, callbacks=(_Fill(2.0),)).train()


def _after_the_kill(case: Path, expected: float) -> None:
    """What the killed re-save left: the Trainer resumes from a whole checkpoint-4, the old
    or the new (``expected``), named explicitly (the load path's own repair, before any
    save) or found by ``resume_from_checkpoint=True`` after the next ``train()``'s sweep,
    which keeps it; that run's next save leaves no temp directory."""
    named = shutil.copytree(case, case.with_name(case.name + "-named"), symlinks=True)
    resumed = _Resumed()
    elsewhere = str(case.with_name(case.name + "-elsewhere"))
    _trainer(elsewhere, max_steps=EVERY, callbacks=(resumed,)).train(str(named / "checkpoint-4"))
    assert (resumed.step, resumed.holds()) == (EVERY, expected)
    found = shutil.copytree(case, case.with_name(case.name + "-found"), symlinks=True)
    resumed = _Resumed()
    _trainer(str(found), max_steps=2 * EVERY, callbacks=(resumed,)).train(resume_from_checkpoint=True)
    assert (resumed.step, resumed.holds()) == (EVERY, expected)
    assert _checkpoints(found) == ["checkpoint-4", "checkpoint-8"] and temp_entries(found) == []


# "aside" (before the old folder moves) and every other call: in the slow run.
@pytest.mark.parametrize("point", ["between", "after", pytest.param("every", marks=pytest.mark.slow)])
def test_a_resave_of_checkpoint_n_killed_at_its_publish(tmp_path: Path, point: str) -> None:
    # A real child, SIGKILLed before a rename or fsync of its second save of checkpoint-4.
    def prepare(case: Path) -> list[object]:
        return [case]

    runs = kill_points(
        "tests.test_integration_transformers.resave_child", tmp_path, "checkpoint-4", point, prepare
    )
    for n, run in enumerate(runs):
        if n == 0 and point == "every":  # the run left to finish: what the others are killed before
            assert {"fsync", "dirsync", "rename"} <= {kind for kind, _, _ in run.made}, run.made
        try:
            _after_the_kill(run.case, 2.0 if run.renamed_into(run.case / "checkpoint-4") else 1.0)
        except AssertionError as exc:
            exc.add_note(f"killed before {run.at} (calls made: {run.made})")
            raise
