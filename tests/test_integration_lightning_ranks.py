"""aiosnap's Lightning plugin under ``strategy="ddp"`` in real torch.distributed jobs (gloo
on 127.0.0.1, CPU): rank 0 writes; the job SIGKILLed right after a save call returned
resumes with ``fit(ckpt_path="last")`` with every rank's losses bit for bit those of a run
never killed; a save that fails makes every rank's fit raise, and nothing hangs."""

from __future__ import annotations

import errno
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning", reason="needs aiosnap[lightning]")

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import aiosnap
from aiosnap.integrations.lightning import AiosnapCheckpointIO
from aiosnap.storage import Posix
from tests.integration_runs import (
    RankJob,
    assert_aiosnap_checkpoint,
    assert_ranks_resumed_exactly,
    printed_losses,
    rank_loss,
    rank_report,
    report,
    run_torchrun_example,
    temp_entries,
)

EPOCHS = 4
STEPS = 4  # per epoch and rank


class _Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        value = torch.nn.functional.mse_loss(self.net(x), y)
        rank_loss(self.global_step + 1, value.item())
        return value

    def on_train_start(self) -> None:
        rank_report("resumed", self.global_step)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data(world: int) -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * 8 * world, 32, generator=g)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
    )


class _Reporting(AiosnapCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        report("saved", os.path.basename(path))


class _Unstorable(Callback):
    """Puts a value aiosnap cannot store (without allow_pickle) into epoch ``at``'s checkpoints."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        if trainer.current_epoch == self.at:
            checkpoint["unstorable"] = object()


def _fail_last_rename(out: str) -> None:
    """On this rank, the commit of the run's last ``last.ckpt`` fails as on a full disk."""
    rename, seen = Posix.rename, []

    def failing(self: Posix, src: str, dst: str) -> None:
        if dst == os.path.join(out, "last.ckpt"):
            seen.append(dst)
            if len(seen) == EPOCHS:
                raise OSError(errno.ENOSPC, "No space left on device (injected)", dst)
        rename(self, src, dst)

    Posix.rename = failing  # type: ignore[method-assign]


def ddp_child(out: str, fault: str = "") -> None:
    """A fit of EPOCHS epochs on 2 ranks, resuming from ``last``; a top-k file and
    last.ckpt each epoch. ``fault``: ``commit`` (the last save's commit fails on rank 0)
    or ``unstorable`` (epoch 1's save call raises on rank 0). Reports what fit raised."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    world = int(os.environ["WORLD_SIZE"])
    if fault == "commit" and os.environ["RANK"] == "0":
        _fail_last_rename(out)
    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(
        dirpath=out, every_n_epochs=1, save_top_k=2, monitor="step", mode="max", save_last=True
    )
    callbacks: list[Callback] = [checkpoint] + ([_Unstorable(1)] if fault == "unstorable" else [])
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=world,
        max_epochs=EPOCHS,
        plugins=[_Reporting()],
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(_Module(), _data(world), ckpt_path="last")
    except Exception as exc:
        rank_report("raised", type(exc).__name__)
        sys.stderr.write(f"fit raised: {exc!r}\n")
    else:
        # fit returned on this rank: rank 0's last save is durable (every rank agreed at teardown).
        last = aiosnap.load_sync(os.path.join(out, "last.ckpt"), keys=["global_step"])
        rank_report("returned", last["global_step"])


# slow for the CI budget: Lightning's multi-process test in the default run is the FSDP2
# strategy's failure test (tests/test_integration_lightning_fsdp.py).
@pytest.mark.slow
def test_a_killed_ddp_fit_resumes_from_last_on_every_rank_bit_identical(tmp_path: Path) -> None:
    ranks = 2

    def job(name: str, out: Path) -> RankJob:
        return RankJob(
            "tests.test_integration_lightning_ranks.ddp_child", out, ranks=ranks, log=tmp_path / name
        )

    run = tmp_path / "run"
    # Each epoch saves its top-k file, then last.ckpt: the 5th is epoch 2's top-k file. A save
    # call returns with at most max_pending + 1 = 3 saves in flight: epoch 0's last.ckpt is durable.
    assert job("killed", run).finish(kill_after_save=5).killed
    reference = job("reference", tmp_path / "ref").finish()
    resumed = job("resumed", run).finish()
    assert [resumed.of(r, "returned") for r in range(ranks)] == [[str(EPOCHS * STEPS)]] * ranks, (
        resumed.reports
    )
    start = assert_ranks_resumed_exactly(reference, resumed, EPOCHS * STEPS)
    assert start in (STEPS, 2 * STEPS), f"resumed from step {start}: not from a last.ckpt of the killed run"
    names = set(os.listdir(run))
    assert {"last.ckpt", f"epoch={EPOCHS - 1}-step={EPOCHS * STEPS}.ckpt"} <= names, names
    for name in names:
        assert_aiosnap_checkpoint(run / name)
    assert temp_entries(run) == []


@pytest.mark.slow
def test_a_commit_failing_on_rank_0_makes_every_rank_s_fit_raise(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = RankJob(
        "tests.test_integration_lightning_ranks.ddp_child", out, "commit", ranks=2, log=tmp_path / "job"
    ).finish()
    # Rank 0 learns it as the fit tears down; rank 1 from the agreement there.
    assert done.of(0, "raised") == ["OSError"], done.reports
    assert done.of(1, "raised") == ["RankFailedError"], done.reports
    assert temp_entries(out) == []


@pytest.mark.slow
def test_a_save_call_failing_on_rank_0_makes_every_rank_s_fit_raise(tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = RankJob(
        "tests.test_integration_lightning_ranks.ddp_child", out, "unstorable", ranks=2, log=tmp_path / "job"
    )
    done = job.finish()
    assert done.of(0, "raised") == ["UnsupportedTypeError"], done.reports
    assert done.of(1, "raised"), done.reports  # gloo's error: rank 0 left the group


def _example(out: Path, epochs: int) -> str:
    return run_torchrun_example("lightning_ddp.py", out, "--epochs", str(epochs))


@pytest.mark.slow
def test_the_torchrun_example_of_the_docs_resumes_with_the_same_losses(tmp_path: Path) -> None:
    _example(tmp_path / "run", 2)
    resumed = _example(tmp_path / "run", 4)
    assert "rank 0: resumed at step 8" in resumed and "rank 1: resumed at step 8" in resumed, resumed
    later, reference = printed_losses(resumed), printed_losses(_example(tmp_path / "reference", 4))
    assert sorted(later) == [(r, s) for r in (0, 1) for s in range(9, 17)], sorted(later)
    assert all(reference[key] == value for key, value in later.items())
