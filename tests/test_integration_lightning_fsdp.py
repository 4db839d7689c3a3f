"""aiosnap's ``AiosnapModelParallelStrategy``: Lightning's FSDP2 strategy saving its sharded
checkpoints through aiosnap's DCP backend, in real torch.distributed jobs (gloo on 127.0.0.1,
a CPU device mesh): the job SIGKILLed right after a save returned resumes with
``fit(ckpt_path="last")`` with every rank's losses bit for bit those of a run never killed;
the loop state read without unpickling. (A flipped byte is refused naming the item by the
same reader: tests/test_dcp.py.)"""

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
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.fsdp import fully_shard

import aiosnap
from aiosnap.integrations.lightning import AiosnapModelParallelStrategy
from aiosnap.storage import Posix
from tests.integration_runs import (
    RankJob,
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

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        value = torch.nn.functional.mse_loss(self.net(x), y)
        rank_loss(self.global_step + 1, value.item())
        return value

    def on_train_start(self) -> None:
        rank_report("resumed", self.global_step)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _Reporting(AiosnapModelParallelStrategy):
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.global_rank == 0:
            report("saved", os.path.basename(filepath))


def _fail_shard_commits_from(save: int) -> None:
    """On this rank, the commit of its shard file fails as on a full disk from its
    ``save``-th save on."""
    rename, seen = Posix.rename, []

    def failing(self: Posix, src: str, dst: str) -> None:
        if dst.endswith(".distcp"):
            seen.append(dst)
            if len(seen) >= save:
                raise OSError(errno.ENOSPC, "No space left on device (injected)", dst)
        rename(self, src, dst)

    Posix.rename = failing  # type: ignore[method-assign]


def fsdp_child(out: str, fault: str = "") -> None:
    """A fit of EPOCHS epochs on every rank, FSDP2 over all of them, resuming from
    ``last``; a top-k checkpoint and last.ckpt each epoch. ``fault``: ``disk`` (rank 1's
    shard files fail to commit from the 3rd save on). Reports what fit raised."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    world = int(os.environ["WORLD_SIZE"])
    if fault == "disk" and os.environ["RANK"] == "1":
        _fail_shard_commits_from(3)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * 8 * world, 32, generator=g)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
    )
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=_Reporting(data_parallel_size=world, tensor_parallel_size=1),
        devices=world,
        max_epochs=EPOCHS,
        callbacks=[
            ModelCheckpoint(
                dirpath=out, every_n_epochs=1, save_top_k=1, monitor="step", mode="max", save_last=True
            )
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(_Module(), data, ckpt_path="last")
    except Exception as exc:
        rank_report("raised", type(exc).__name__)
        sys.stderr.write(f"fit raised: {exc!r}\n")
    torch.distributed.destroy_process_group()


def _job(name: str, out: Path, log: Path) -> RankJob:
    return RankJob("tests.test_integration_lightning_fsdp.fsdp_child", out, ranks=2, log=log / name)


# slow for the CI budget (~70 s): Lightning's representative in the default run is the failure
# test below (2 ranks, the same strategy, saves in the background, every rank raising).
@pytest.mark.slow
def test_a_killed_fsdp2_fit_resumes_from_last_on_every_rank_bit_identical(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # Each epoch saves its top-k checkpoint, then last.ckpt: killed once epoch 1's last.ckpt call
    # returned (staged; its commit may still be in flight: epoch 0's last.ckpt is committed).
    assert _job("killed", run, tmp_path).finish(kill_after_save=4).killed
    reference = _job("reference", tmp_path / "ref", tmp_path).finish()
    resumed = _job("resumed", run, tmp_path).finish()
    assert not any(resumed.of(r, "raised") for r in range(2)), resumed.reports
    start = assert_ranks_resumed_exactly(reference, resumed, EPOCHS * STEPS)
    assert start in (STEPS, 2 * STEPS), f"resumed from step {start}: not a last.ckpt of the killed run"
    last = run / "last.ckpt"
    names = sorted(os.listdir(last))
    metas = [n for n in names if n.startswith("lightning-meta-")]
    assert len(metas) == 1 and ".metadata" in names, names  # earlier saves' loop states removed
    meta = aiosnap.load_sync(str(last / metas[0]))  # an aiosnap file, nothing pickled
    assert meta["global_step"] == EPOCHS * STEPS
    assert temp_entries(run) == []


def test_a_shard_that_fails_to_commit_makes_every_rank_s_fit_raise(tmp_path: Path) -> None:
    out = tmp_path / "out"
    child = "tests.test_integration_lightning_fsdp.fsdp_child"
    done = RankJob(child, out, "disk", ranks=2, log=tmp_path / "job").finish(check=False)
    # The 3rd save (epoch 1's top-k) fails in the background. Lightning then removes epoch 0's
    # top-k: that waits for the 3rd, which raises there, on rank 1 as itself.
    assert done.of(1, "raised") == ["OSError"], done.reports
    assert done.of(0, "raised") == ["RankFailedError"], done.reports
    assert max(int(s) for r in range(2) for s in done.losses.get(r, {})) < EPOCHS * STEPS
    assert (out / "epoch=0-step=4.ckpt" / ".metadata").is_file()  # the last good one, kept
    assert temp_entries(out) == []


def _example(out: Path, epochs: int) -> str:
    return run_torchrun_example("lightning_fsdp2.py", out, "--epochs", str(epochs))


@pytest.mark.slow
def test_the_torchrun_example_of_the_docs_resumes_with_the_same_losses(tmp_path: Path) -> None:
    _example(tmp_path / "run", 2)
    resumed = _example(tmp_path / "run", 4)
    assert "rank 0: resumed at step 8" in resumed and "rank 1: resumed at step 8" in resumed, resumed
    later, reference = printed_losses(resumed), printed_losses(_example(tmp_path / "reference", 4))
    assert sorted(later) == [(r, s) for r in (0, 1) for s in range(9, 17)], sorted(later)
    assert all(reference[key] == value for key, value in later.items())


def test_a_settled_save_removes_only_the_loop_state_files_aiosnap_wrote(tmp_path: Path) -> None:
    """After a save to a directory committed, rank 0 removes the earlier saves' loop state
    files there: aiosnap's own only. A user's file, a directory or a symlink under such a
    name stays (the symlink's target too)."""
    from concurrent.futures import Future

    from aiosnap.integrations._lightning_sharded import Pending

    path = tmp_path / "last.ckpt"
    path.mkdir()
    for name in ("lightning-meta-new", "lightning-meta-old"):
        aiosnap.save_sync(str(path / name), {"global_step": 1})
    (path / "lightning-meta-notes").write_text("a user's notes")
    (path / "lightning-meta-dir").mkdir()
    elsewhere = tmp_path / "elsewhere"
    aiosnap.save_sync(str(elsewhere), {"global_step": 0})
    (path / "lightning-meta-link").symlink_to(elsewhere)
    done: Future[None] = Future()
    done.set_result(None)
    Pending(done, path, "lightning-meta-new").settle(rank=1)  # only rank 0 removes
    assert (path / "lightning-meta-old").is_file()
    Pending(done, path, "lightning-meta-new").settle(rank=0)
    assert sorted(os.listdir(path)) == [
        "lightning-meta-dir",
        "lightning-meta-link",
        "lightning-meta-new",
        "lightning-meta-notes",
    ]
    assert elsewhere.is_file()
