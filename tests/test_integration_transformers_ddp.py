"""aiosnap.integrations.transformers in multi-process DDP runs: real jobs of 2 and 4
processes on CPU (gloo on 127.0.0.1, launched as torchrun launches them), running the docs'
example (examples/transformers_ddp.py). A job SIGKILLed right after a save returned on every
rank resumes with ``train(resume_from_checkpoint=True)`` on every rank with the losses of a
job never stopped, bit for bit (dropout included); a rank whose part of a save fails makes
``train`` raise on every rank, and the step is never committed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="needs aiosnap[transformers]")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import TrainerCallback

import aiosnap
from aiosnap._format.manifest import MANIFEST_NAME
from examples.transformers_ddp import train
from tests.integration_runs import (
    RankJob,
    assert_ranks_resumed_exactly,
    rank_loss,
    rank_report,
    report,
    temp_entries,
)
from tests.test_integration_accelerate_ddp import _fail_rank_file

EPOCHS = 2
STEPS = 16  # 64 samples, 8 a step (4 per rank at 2 ranks), 2 epochs; a save every 2 steps
CHILD = "tests.test_integration_transformers_ddp.ddp_child"


class _Report(TrainerCallback):
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rank_report("resumed", state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            rank_loss(state.global_step, logs["loss"])

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        report("saved", args.process_index, state.global_step)  # right after the save call returned


def ddp_child(out: str, fail_rank: str = "-1") -> None:
    """A rank of the docs' example, reporting to the parent; ``fail_rank``'s part of
    ``checkpoint-4`` fails to be written."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if rank == int(fail_rank):
        _fail_rank_file(rank, "checkpoint-4")
    try:
        train(out, EPOCHS, _Report())
    except aiosnap.errors.RankFailedError as exc:
        report("raised", rank, type(exc).__name__, *sorted(exc.failed))


def _committed(out: Path) -> list[str]:
    return sorted(
        (n for n in os.listdir(out) if (out / n / MANIFEST_NAME).is_file()),
        key=lambda n: int(n.split("-")[-1]),
    )


# Slow at 2 ranks too (CI's budget): the default run keeps the Trainer's kill-and-resume in
# one process (test_integration_transformers.py), a DDP group's kill-and-resume through
# Accelerate and ppe, and this file's other tests of the Trainer's group.
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_killed_ddp_job_resumes_from_the_last_checkpoint_bit_identical(tmp_path: Path, world: int) -> None:
    out = tmp_path / "run"
    steps = STEPS * 2 // world
    reference = RankJob(CHILD, tmp_path / "ref", ranks=world, log=tmp_path / "ref.log").finish()
    killed = RankJob(CHILD, out, ranks=world, log=tmp_path / "killed.log")
    assert killed.finish(kill_after_save=3 * world).killed  # every rank's third save returned
    resumed = RankJob(CHILD, out, ranks=world, log=tmp_path / "resumed.log").finish()
    start = assert_ranks_resumed_exactly(reference, resumed, steps)
    assert start in (2, 4, 6), f"resumed from step {start}: not from a committed save of the killed job"
    committed = _committed(out)
    assert committed == [f"checkpoint-{steps - 2}", f"checkpoint-{steps}"]
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == sorted(committed)  # none half
    for name in committed:
        ranks = sorted(n for n in os.listdir(out / name) if n.startswith("rank_"))
        assert ranks == [f"rank_{r:05d}" for r in range(world)]
        for r in range(world):
            part = aiosnap.load_sync(str(out / name), rank=r)
            assert f'"global_step": {name[11:]}' in part["trainer_state"] and "rng" in part
    assert temp_entries(out) == []


@pytest.mark.slow
def test_a_rank_failing_its_part_makes_train_raise_on_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = RankJob(CHILD, out, "1", ranks=2, log=tmp_path / "fail.log").finish()
    # Every rank raised RankFailedError naming rank 1, and no later step was saved after it.
    assert {r: run.of(r, "raised") for r in (0, 1)} == {r: ["RankFailedError", "1"] for r in (0, 1)}, (
        run.reports
    )
    assert "checkpoint-4" not in _committed(out)


@pytest.mark.parametrize("mode", ["DeepSpeed", "FSDP", "tpu", "sagemaker_model_parallel"])
def test_an_unsupported_mode_says_so_and_what_to_use(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import TrainingArguments
    from transformers.training_args import ParallelMode

    from tests.test_integration_transformers import _trainer

    run = _trainer(str(tmp_path), epochs=1)  # one process: the modes' flags are set below
    if mode == "DeepSpeed":
        monkeypatch.setattr(run, "is_deepspeed_enabled", True)
    elif mode == "FSDP":
        monkeypatch.setattr(run, "is_fsdp_enabled", True)
    else:
        monkeypatch.setattr(TrainingArguments, "parallel_mode", property(lambda self: ParallelMode(mode)))
    with pytest.raises(NotImplementedError, match=rf"{mode}.*use transformers.Trainer for this run"):
        run.train()
