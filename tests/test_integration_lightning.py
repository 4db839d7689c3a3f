"""aiosnap.integrations.lightning against the real Lightning: a killed run resumes with
``fit(ckpt_path="last")`` with the same losses, bit for bit; ModelCheckpoint's removals
wait for the newer file and delete only aiosnap files; the plugin works again after
``teardown``; a SLURM requeue save is durable when it returns; pickling is opt-in."""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning", reason="needs aiosnap[lightning]")

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

import aiosnap
from aiosnap.integrations.lightning import AiosnapCheckpointIO, load_from_checkpoint
from tests.integration_runs import (
    Child,
    assert_aiosnap_checkpoint,
    assert_resumed_exactly,
    loss,
    report,
    temp_entries,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated"),  # Lightning's own, with torch 2.13
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]

EPOCHS = 6
STEPS = 8  # per epoch
TOP_K = 2


class _Module(L.LightningModule):
    def __init__(self, hidden: int = 256, lr: float = 1e-2, extra: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        value = torch.nn.functional.mse_loss(self.net(x), y)
        loss(self.global_step + 1, value.item())
        return value

    def on_train_start(self) -> None:
        report("resumed", self.global_step)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def _data() -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * 8, 32, generator=g)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
    )


def _trainer(out: str, epochs: int, io: Any, **options: Any) -> tuple[L.Trainer, ModelCheckpoint]:
    checkpoint = ModelCheckpoint(
        dirpath=out, every_n_epochs=1, save_top_k=TOP_K, monitor="step", mode="max", save_last=True, **options
    )
    trainer = L.Trainer(
        max_epochs=epochs,
        plugins=[io],
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return trainer, checkpoint


class _Reporting(AiosnapCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        report("saved", os.path.basename(path))


def child(out: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    trainer, checkpoint = _trainer(out, EPOCHS, _Reporting())
    trainer.fit(_Module(), _data(), ckpt_path="last")
    report("tracked", *(os.path.basename(p) for p in checkpoint.best_k_models))


def test_killed_run_resumes_from_last_bit_identical(tmp_path: Path) -> None:
    run = tmp_path / "run"
    reference = Child("tests.test_integration_lightning.child", tmp_path / "ref", log=tmp_path / "ref.log")
    killed = Child("tests.test_integration_lightning.child", run, log=tmp_path / "killed.log")
    # Each epoch saves its top-k file, then last.ckpt: the 5th is epoch 3's top-k file. A save
    # call returns with at most max_pending + 1 = 3 saves in flight: epoch 1's last.ckpt is durable.
    assert killed.finish(kill_after_save=5).killed
    ref = reference.finish()
    left = set(os.listdir(run))
    resumed = Child("tests.test_integration_lightning.child", run, log=tmp_path / "resumed.log").finish()
    start = assert_resumed_exactly(ref, resumed, EPOCHS * STEPS)
    assert start in (STEPS, 2 * STEPS), f"resumed from step {start}: not from a last.ckpt of the killed run"
    files = set(os.listdir(run))
    tracked = set(resumed.other["tracked"])
    assert len(tracked) == TOP_K and tracked | {"last.ckpt"} <= files
    # Besides what the resumed run tracks, only what the killed run left (a top-k file
    # newer than the last.ckpt it resumed from, which Lightning no longer tracks).
    assert files - tracked - {"last.ckpt"} <= left
    for name in files:
        assert_aiosnap_checkpoint(run / name)
    assert temp_entries(run) == []


def test_plugin_works_again_after_teardown(tmp_path: Path) -> None:
    io = AiosnapCheckpointIO()
    torch.manual_seed(0)
    first, _ = _trainer(str(tmp_path), 2, io)
    first.fit(_Module(), _data())  # ends with teardown: the background loop stops
    second, checkpoint = _trainer(str(tmp_path), 4, io)
    second.fit(_Module(), _data(), ckpt_path="last")
    assert second.global_step == 4 * STEPS
    assert sorted(os.listdir(tmp_path)) == sorted(
        [*(os.path.basename(p) for p in checkpoint.best_k_models), "last.ckpt"]
    )
    model = load_from_checkpoint(_Module, tmp_path / "last.ckpt")
    for name, value in second.lightning_module.state_dict().items():
        assert torch.equal(model.state_dict()[name], value)
    assert model.hparams.hidden == 256


def test_removal_waits_for_the_newer_file_and_spares_foreign_files(tmp_path: Path) -> None:
    io = AiosnapCheckpointIO()
    state = {"state_dict": _Module().state_dict(), "global_step": 1}
    io.save_checkpoint(state, tmp_path / "old.ckpt")
    (tmp_path / "new.ckpt").mkdir()  # the newer save fails at its rename
    io.save_checkpoint(state, tmp_path / "new.ckpt")
    io.remove_checkpoint(tmp_path / "old.ckpt")  # as ModelCheckpoint does right after
    with pytest.raises(IsADirectoryError):
        io.teardown()
    assert_aiosnap_checkpoint(tmp_path / "old.ckpt")  # the newest good checkpoint is kept
    torch.save(state, tmp_path / "foreign.ckpt")
    io.save_checkpoint(state, tmp_path / "newer.ckpt")
    io.remove_checkpoint(tmp_path / "old.ckpt")
    io.remove_checkpoint(tmp_path / "foreign.ckpt")  # not aiosnap's: left, with a warning
    io.teardown()
    assert sorted(os.listdir(tmp_path)) == ["foreign.ckpt", "new.ckpt", "newer.ckpt"]


def test_requeue_save_is_durable_when_it_returns(tmp_path: Path) -> None:
    io = AiosnapCheckpointIO()
    big = {"state_dict": {"w": torch.randn(16 << 20)}}  # 64 MiB: its commit takes a while
    io.save_checkpoint(big, tmp_path / "hpc_ckpt_1.ckpt")
    assert_aiosnap_checkpoint(tmp_path / "hpc_ckpt_1.ckpt")
    io.teardown()


@dataclasses.dataclass
class _Config:
    depth: int


def test_hyper_parameter_objects_need_the_pickle_opt_in(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer, _ = _trainer(str(tmp_path / "refused"), 1, AiosnapCheckpointIO())
    with pytest.raises(aiosnap.errors.UnsupportedTypeError):
        trainer.fit(_Module(extra=_Config(3)), _data())
    trainer, _ = _trainer(str(tmp_path / "pickled"), 1, AiosnapCheckpointIO(allow_pickle=True))
    trainer.fit(_Module(extra=_Config(3)), _data())
    path = tmp_path / "pickled" / "last.ckpt"
    with pytest.raises(aiosnap.errors.PickleNotAllowedError):
        aiosnap.load_sync(str(path))
    loaded = aiosnap.load_sync(str(path), allow_pickle=True)
    assert loaded["hyper_parameters"]["extra"] == _Config(3)
    assert load_from_checkpoint(_Module, path, allow_pickle=True).hparams.extra == _Config(3)


def test_standalone_pytorch_lightning_twin(tmp_path: Path) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from aiosnap.integrations.pytorch_lightning import AiosnapCheckpointIO as Twin

    class Module(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(32, 1)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        max_epochs=1, plugins=[Twin()], default_root_dir=tmp_path, logger=False, enable_progress_bar=False
    )
    trainer.fit(Module(), _data())
    (found,) = (tmp_path / "checkpoints").iterdir()
    assert_aiosnap_checkpoint(found)
