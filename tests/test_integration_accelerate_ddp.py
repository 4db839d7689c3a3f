"""aiosnap.integrations.accelerate in multi-process DDP runs: real jobs of 2 and 4 processes
on CPU (gloo on 127.0.0.1, launched as torchrun launches them), running the docs' example
(examples/accelerate_ddp.py). A job SIGKILLed right after a ``save_state`` returned on every rank
resumes with ``load_state()`` on every rank with the losses of a job never stopped, bit for
bit, each rank's dropout included (every rank's RNG states come back, each its own); a
rank whose part of a save fails makes the save fail on every rank, and no step that lacks
a rank's part is ever committed."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate", reason="needs aiosnap[accelerate]")


import aiosnap
from aiosnap._format.manifest import MANIFEST_NAME
from examples.accelerate_ddp import train
from tests.integration_runs import (
    RankJob,
    assert_ranks_resumed_exactly,
    rank_loss,
    rank_report,
    report,
    temp_entries,
)

STEPS = 16
EVERY = 2
LIMIT = 2
CHILD = "tests.test_integration_accelerate_ddp.ddp_child"


def _fail_rank_file(rank: int, step_dir: str) -> None:
    """This rank's file of ``step_dir`` cannot be opened, as on a full disk."""
    from aiosnap.storage import Posix

    original = Posix.open
    victim = f"{step_dir}{os.sep}"

    def open_(self: Posix, path: str, flags: int, mode: int = 0o644) -> int:
        if victim in path and f"rank_{rank:05d}" in path:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        return original(self, path, flags, mode)

    Posix.open = open_  # type: ignore[method-assign]


def ddp_child(project: str, fail_rank: str = "-1") -> None:
    """A rank of the docs' example (examples/accelerate_ddp.py), reporting to the parent;
    ``fail_rank``'s part of the second checkpoint fails to be written."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if rank == int(fail_rank):
        _fail_rank_file(rank, "checkpoint_1")

    def show(kind: str, rank: int, *values: Any) -> None:
        if kind == "loss":
            rank_loss(*values)
        elif kind == "saved":
            report("saved", rank, Path(values[0]).name)
        else:
            rank_report(kind, *values)

    try:
        train(project, STEPS, EVERY, show)
    except aiosnap.errors.RankFailedError as exc:
        report("raised", rank, type(exc).__name__, *sorted(exc.failed))


def _committed(project: Path) -> list[str]:
    root = project / "checkpoints"
    return sorted(
        (n for n in os.listdir(root) if (root / n / MANIFEST_NAME).is_file()),
        key=lambda n: int(n.split("_")[-1]),
    )


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_killed_ddp_job_resumes_with_load_state_bit_identical_on_every_rank(
    tmp_path: Path, world: int
) -> None:
    run = tmp_path / "run"
    reference = RankJob(CHILD, tmp_path / "ref", ranks=world, log=tmp_path / "ref.log").finish()
    killed = RankJob(CHILD, run, ranks=world, log=tmp_path / "killed.log")
    assert killed.finish(kill_after_save=3 * world).killed  # every rank's third save returned
    resumed = RankJob(CHILD, run, ranks=world, log=tmp_path / "resumed.log").finish()
    start = assert_ranks_resumed_exactly(reference, resumed, STEPS)
    assert start in (2, 4, 6), f"resumed from step {start}: not from a committed save of the killed job"
    committed = _committed(run)
    assert len(committed) == LIMIT
    # The killed job's last save, never committed, is nowhere to be seen.
    assert sorted(n for n in os.listdir(run / "checkpoints") if n.startswith("checkpoint_")) == sorted(
        committed
    )
    for name in committed:
        step_dir = run / "checkpoints" / name
        ranks = sorted(n for n in os.listdir(step_dir) if n.startswith("rank_"))
        assert ranks == [f"rank_{r:05d}" for r in range(world)]
        for r in range(world):  # each rank's part, its RNG state its own
            part = aiosnap.load_sync(str(step_dir), rank=r)
            assert part["custom"][0]["step"] % EVERY == 0 and part["rng"]["torch_manual_seed"].numel() > 0
        assert not torch.equal(
            aiosnap.load_sync(str(step_dir), rank=0)["rng"]["torch_manual_seed"],
            aiosnap.load_sync(str(step_dir), rank=1)["rng"]["torch_manual_seed"],
        )
    assert temp_entries(run) == []


@pytest.mark.slow
def test_a_rank_failing_its_part_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    project = tmp_path / "run"
    run = RankJob(CHILD, project, "1", ranks=2, log=tmp_path / "fail.log").finish()
    # Every rank raised RankFailedError naming rank 1, and no later step was saved after it.
    assert {r: run.of(r, "raised") for r in (0, 1)} == {r: ["RankFailedError", "1"] for r in (0, 1)}, (
        run.reports
    )
    assert "checkpoint_1" not in _committed(project)


@pytest.mark.parametrize("mode", ["DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM"])
def test_an_unsupported_mode_says_so_and_what_to_use(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.utils import DistributedType

    from aiosnap.integrations.accelerate import AiosnapAccelerator

    accelerator = AiosnapAccelerator(cpu=True)
    monkeypatch.setattr(accelerator.state, "distributed_type", DistributedType[mode])
    with pytest.raises(NotImplementedError, match=rf"{mode}.*use accelerate.Accelerator's own save_state"):
        accelerator.save_state("unused")
