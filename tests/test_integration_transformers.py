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
from transformers.utils import SAFE_WEIGHTS_NAME as MODEL_NAME  # what from_pretrained reads

import aiosnap
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
    # A save call returns with at most 2 * max_pending + 1 = 5 files (2.5 checkpoints) in
    # flight: the first checkpoint is durable.
    assert start in (4, 8, 12, 16), f"resumed from step {start}: not from a checkpoint of the killed run"
    assert _checkpoints(run) == [f"checkpoint-{EPOCHS * STEPS - EVERY}", f"checkpoint-{EPOCHS * STEPS}"]
    for name in _checkpoints(run):
        assert sorted(os.listdir(run / name)) == ["config.json", MODEL_NAME, STATE_NAME, "trainer_state.json"]
        assert_aiosnap_checkpoint(run / name / MODEL_NAME)
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


# "aside" (before the old folder moves), "between" and every other call: in the slow run
# (CI's budget).
@pytest.mark.parametrize(
    "point",
    [pytest.param("between", marks=pytest.mark.slow), "after", pytest.param("every", marks=pytest.mark.slow)],
)
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


# -- what from_pretrained reads -------------------------------------------------------------------


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Causal LM samples: the labels are the inputs."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(12) * (i + 1)) % 50
        return {"input_ids": ids, "labels": ids}


def _gpt2_trainer(out: str, **options: Any) -> AiosnapTrainer:
    """A tiny GPT-2 whose output layer is tied to its input embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    args = TrainingArguments(
        out,
        per_device_train_batch_size=4,
        max_steps=4,
        save_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
        **options,
    )
    return AiosnapTrainer(model=GPT2LMHeadModel(config), args=args, train_dataset=_Tokens())


def _header_names(path: Path) -> list[str]:
    """The entries of a safetensors file's header, as safetensors' own reader lists them."""
    import safetensors

    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata()["format"] == "pt"
        return sorted(f.keys())


def _assert_reads_back(checkpoint: Path, trained: torch.nn.Module, auto: Any, *, gpt2: bool = False) -> None:
    """``auto.from_pretrained(checkpoint)`` is ``trained``, every tensor bit for bit, its
    tied weights (a GPT-2's) tied again; safetensors reads the file under the state dict's
    names, less the tied copy."""
    import safetensors.torch

    expected = trained.state_dict()
    tied = {"lm_head.weight"} if gpt2 else set()
    assert _header_names(checkpoint / MODEL_NAME) == sorted(set(expected) - tied)
    plain = safetensors.torch.load_file(str(checkpoint / MODEL_NAME))
    assert all(torch.equal(plain[k], expected[k]) for k in plain)
    loaded = auto.from_pretrained(str(checkpoint))
    got = loaded.state_dict()
    assert sorted(got) == sorted(expected)
    different = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert different == [], different
    if tied:
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_from_pretrained_reads_a_checkpoint_bit_exact(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    trainer = _trainer(str(tmp_path), epochs=1)
    trainer.train()  # the last save is of the final weights
    last = tmp_path / f"checkpoint-{STEPS}"
    assert sorted(os.listdir(last)) == ["config.json", MODEL_NAME, STATE_NAME, "trainer_state.json"]
    _assert_reads_back(last, trainer.model, AutoModelForSequenceClassification)
    assert "model" not in aiosnap.load_sync(str(last / STATE_NAME))  # the weights written once


def test_from_pretrained_reads_a_checkpoint_of_a_model_with_tied_weights(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    trainer = _gpt2_trainer(str(tmp_path))
    trainer.train()
    last = tmp_path / "checkpoint-4"
    assert {"config.json", "generation_config.json", MODEL_NAME} <= set(os.listdir(last))
    _assert_reads_back(last, trainer.model, AutoModelForCausalLM, gpt2=True)


def test_save_only_model_writes_the_weights_and_config_alone(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    trainer = _gpt2_trainer(str(tmp_path), save_only_model=True, save_total_limit=1)
    trainer.train()
    assert _checkpoints(tmp_path) == ["checkpoint-4"]  # rotated: aiosnap's without a state.aiosnap
    last = tmp_path / "checkpoint-4"
    files = ["config.json", "generation_config.json", MODEL_NAME, "trainer_state.json"]
    assert sorted(os.listdir(last)) == files
    _assert_reads_back(last, trainer.model, AutoModelForCausalLM, gpt2=True)
    resumed = _gpt2_trainer(str(tmp_path / "again"), save_only_model=True)
    resumed._load_from_checkpoint(str(last))  # what train(resume_from_checkpoint=...) calls
    expected = trainer.model.state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in resumed.model.state_dict().items())


def _to_the_earlier_layout(checkpoint: Path) -> None:
    """Rewrite ``checkpoint`` as AiosnapTrainer wrote checkpoints before model.safetensors:
    the model (every key, tied ones too) inside state.aiosnap, no config."""
    state = aiosnap.load_sync(str(checkpoint / STATE_NAME))
    weights = aiosnap.load_sync(str(checkpoint / MODEL_NAME))
    for name in (MODEL_NAME, STATE_NAME, "config.json"):
        (checkpoint / name).unlink()
    aiosnap.save_sync(str(checkpoint / STATE_NAME), {"model": weights, **state})


def test_a_checkpoint_of_the_earlier_layout_still_resumes_bit_exact(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    reference = _trainer(str(tmp_path / "ref"), max_steps=2 * EVERY)
    reference.train()
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "ref" / f"checkpoint-{EVERY}", old / f"checkpoint-{EVERY}")
    _to_the_earlier_layout(old / f"checkpoint-{EVERY}")
    resumed = _Resumed()
    _trainer(str(old), max_steps=2 * EVERY, callbacks=(resumed,)).train(resume_from_checkpoint=True)
    assert resumed.step == EVERY
    # The resumed run ends where the uninterrupted one did, its new checkpoint in the new layout.
    _assert_reads_back(old / f"checkpoint-{2 * EVERY}", reference.model, AutoModelForSequenceClassification)


def test_a_failed_save_of_the_weights_file_discards_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiosnap.storage import Posix
    from tests.faults import enospc, target_of

    real_open = Posix.open

    def full_disk_for_weights(self: Posix, path: str, flags: int, mode: int = 0o644) -> int:
        if os.path.basename(target_of(path)) == MODEL_NAME and flags & os.O_CREAT:
            raise enospc(path)
        return real_open(self, path, flags, mode)

    monkeypatch.setattr(Posix, "open", full_disk_for_weights)
    with pytest.raises(OSError, match="No space left on device"):
        _trainer(str(tmp_path), epochs=1).train()
    assert _checkpoints(tmp_path) == [] and temp_entries(tmp_path) == []
