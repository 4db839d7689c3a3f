"""What Lightning's own tests expect of a CheckpointIO, with AiosnapCheckpointIO (issue 39):
the plugin pickles and works under ``ddp_spawn``; ModelCheckpoint's version counter sees
the names still being committed; a stale ``save_last="link"`` link is removed (the link
only); ``AsyncCheckpointIO`` wrapping the plugin is refused; ``load_from_checkpoint``
works from the class method; a checkpoint's weights export to safetensors in one call."""

from __future__ import annotations

import logging
import os
import pickle
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning", reason="needs aiosnap[lightning]")

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO

import aiosnap
from aiosnap.integrations.lightning import (
    AiosnapCheckpointIO,
    AiosnapLoadMixin,
    export_safetensors,
)
from aiosnap.storage import Posix
from tests.conftest import WAIT_CAP
from tests.integration_runs import assert_aiosnap_checkpoint

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated"),  # Lightning's own, with torch 2.13
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:.*is not a dataloader attribute"),
]


class _Module(AiosnapLoadMixin, L.LightningModule):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> torch.utils.data.DataLoader[Any]:
    x = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 32
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4
    )


def _trainer(epochs: int, io: Any, *callbacks: Any, **options: Any) -> L.Trainer:
    return L.Trainer(
        max_epochs=epochs,
        plugins=[io] if io is not None else [],
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


# -- (2) pickling, ddp_spawn -------------------------------------------------------------------------


def _new_threads(before: set[threading.Thread]) -> set[threading.Thread]:
    """Threads started since ``before``, but aiosnap's helper threads (one pool per
    process, started by a load or a copy, kept for the next)."""
    return {t for t in set(threading.enumerate()) - before if not t.name.startswith("aiosnap-side")}


def test_plugin_pickles_fresh_in_flight_and_after_teardown(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    io = AiosnapCheckpointIO(max_pending=3)
    fresh = pickle.loads(pickle.dumps(io))
    io.save_checkpoint({"w": torch.ones(4)}, tmp_path / "a.ckpt")
    in_flight = pickle.loads(pickle.dumps(io))  # its saves stay with the original
    io.teardown()
    assert _new_threads(before) == set()  # the loop and its threads are gone
    torn_down = pickle.loads(pickle.dumps(io))
    for n, copy in enumerate([fresh, in_flight, torn_down]):
        assert not copy.committing(tmp_path / "a.ckpt")
        copy.save_checkpoint({"w": torch.full((4,), float(n))}, tmp_path / f"copy{n}.ckpt")
        copy.teardown()
        assert torch.equal(copy.load_checkpoint(tmp_path / f"copy{n}.ckpt")["w"], torch.full((4,), float(n)))
    trainer = _trainer(1, io, ModelCheckpoint(dirpath=tmp_path / "ckpts"))
    trainer.fit(_Module(), _data())
    torch.save(trainer, tmp_path / "trainer.pt")  # the whole Trainer, its plugin and callbacks
    again = torch.load(tmp_path / "trainer.pt", weights_only=False)
    assert again.strategy.checkpoint_io.allow_pickle is False


@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_ddp_spawn_fit_with_the_plugin(tmp_path: Path, processes: int) -> None:
    """Spawned processes on gloo (one in the default run: each costs seconds of imports):
    the Trainer (and the plugin) is pickled to each; rank 0's checkpoints are aiosnap
    files, and the main process gets the trained weights back through the plugin
    (Lightning saves them in rank 0, loads them in the parent and removes the file)."""
    before = set(threading.enumerate())
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}")
    options = {"strategy": "ddp_spawn", "accelerator": "cpu", "devices": processes}
    trainer = _trainer(2, AiosnapCheckpointIO(), checkpoint, **options)
    model = _Module()
    initial = [p.detach().clone() for p in model.parameters()]
    trainer.fit(model, _data())
    assert sorted(os.listdir(tmp_path)) == ["epoch=0.ckpt", "epoch=1.ckpt"]
    for name in os.listdir(tmp_path):
        assert_aiosnap_checkpoint(tmp_path / name)
    saved = aiosnap.load_sync(str(tmp_path / "epoch=1.ckpt"))["state_dict"]
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert any(not torch.equal(a, b) for a, b in zip(initial, model.parameters(), strict=True))
    assert _new_threads(before) == set()  # nothing of the plugin's left running here


# -- (3) names still being committed -------------------------------------------------------------------


class _Gate:
    """Holds the commit (the final rename) of every ``.ckpt`` until the save call after
    its own starts: ModelCheckpoint then picks the next name while the last save is still
    being committed, every time, on any machine."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._calls = 0
        self._renames = 0

    def call(self) -> None:
        with self._cond:
            self._calls += 1
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._calls = 1 << 30
            self._cond.notify_all()

    def hold(self, rename: Callable[[Posix, str, str], None]) -> Callable[[Posix, str, str], None]:
        def held(posix: Posix, src: str, dst: str) -> None:
            if dst.endswith(".ckpt"):
                with self._cond:
                    self._renames += 1
                    n = self._renames
                    assert self._cond.wait_for(lambda: self._calls > n, WAIT_CAP), "the save call never came"
            rename(posix, src, dst)

        return held


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Gate]:
    held = _Gate()
    monkeypatch.setattr(Posix, "rename", held.hold(Posix.rename))
    yield held
    held.open()


class _Held(AiosnapCheckpointIO):
    def __init__(self, gate: _Gate) -> None:
        super().__init__()
        self.gate = gate

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.gate.call()  # the previous save's commit may end now: the new name is chosen
        super().save_checkpoint(checkpoint, path, storage_options)

    def teardown(self) -> None:
        self.gate.open()
        super().teardown()

    def flush(self) -> None:
        self.gate.open()
        super().flush()


EPOCHS = 4


def _fixed_name(directory: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=directory, filename="ckpt", save_top_k=-1, monitor="step", mode="max")


def test_a_name_still_being_committed_is_not_taken_again(tmp_path: Path, gate: _Gate) -> None:
    default = _fixed_name(tmp_path / "default")
    _trainer(EPOCHS, None, default).fit(_Module(), _data())  # Lightning's TorchCheckpointIO
    names = sorted(os.listdir(tmp_path / "default"))
    assert len(names) == EPOCHS  # ckpt.ckpt, ckpt-v1.ckpt, ...
    ours = _fixed_name(tmp_path / "ours")
    _trainer(EPOCHS, _Held(gate), ours).fit(_Module(), _data())
    assert sorted(os.listdir(tmp_path / "ours")) == names
    assert sorted(os.path.basename(p) for p in ours.best_k_models) == names
    epochs = {aiosnap.load_sync(str(tmp_path / "ours" / n), keys=["epoch"])["epoch"] for n in names}
    assert epochs == set(range(EPOCHS))  # each file holds its own epoch: none was replaced


def test_committing_says_which_names_are_taken(tmp_path: Path, gate: _Gate) -> None:
    io = _Held(gate)
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "a.ckpt")
    assert io.committing(tmp_path / "a.ckpt") and io.exists(tmp_path / "a.ckpt")
    assert not os.path.exists(tmp_path / "a.ckpt") and not io.committing(tmp_path / "b.ckpt")
    io.teardown()
    assert not io.committing(tmp_path / "a.ckpt") and io.exists(tmp_path / "a.ckpt")


# -- (4) save_last="link" ------------------------------------------------------------------------------


def test_stale_last_links_are_removed_the_link_only(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, filename="{epoch}", save_top_k=2, monitor="step", mode="max", save_last="link"
    )
    checkpoint.CHECKPOINT_NAME_LAST = "last-{epoch}"
    _trainer(4, AiosnapCheckpointIO(), checkpoint).fit(_Module(), _data())
    assert sorted(os.listdir(tmp_path)) == ["epoch=2.ckpt", "epoch=3.ckpt", "last-epoch=3.ckpt"]
    assert os.readlink(tmp_path / "last-epoch=3.ckpt") == "epoch=3.ckpt"
    for name in ("epoch=2.ckpt", "epoch=3.ckpt"):
        assert_aiosnap_checkpoint(tmp_path / name)


def test_a_link_to_a_foreign_file_is_left(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    os.symlink("notes.txt", tmp_path / "last.ckpt")
    io = AiosnapCheckpointIO()
    with caplog.at_level(logging.WARNING, logger="aiosnap"):
        io.remove_checkpoint(tmp_path / "last.ckpt")
    assert os.path.islink(tmp_path / "last.ckpt") and (tmp_path / "notes.txt").read_text() == "mine"
    assert "not removing the link" in caplog.text


# -- AsyncCheckpointIO, load_from_checkpoint, export ----------------------------------------------------


def test_async_checkpoint_io_wrapping_the_plugin_is_refused(tmp_path: Path) -> None:
    wrapped = AsyncCheckpointIO(AiosnapCheckpointIO())
    trainer = _trainer(1, wrapped, ModelCheckpoint(dirpath=tmp_path))
    with pytest.raises(TypeError, match="Pass the plugin alone"):
        trainer.fit(_Module(), _data())
    assert os.listdir(tmp_path) == []
    with pytest.raises(TypeError, match="AsyncCheckpointIO"):
        wrapped.remove_checkpoint(tmp_path / "x.ckpt")


def test_load_from_checkpoint_from_the_class_method(tmp_path: Path) -> None:
    for name, io in [("aiosnap", AiosnapCheckpointIO()), ("torch", None)]:
        trainer = _trainer(1, io, ModelCheckpoint(dirpath=tmp_path / name, filename="last"))
        trainer.fit(_Module(hidden=6), _data())
        model = _Module.load_from_checkpoint(tmp_path / name / "last.ckpt")
        assert model.hparams.hidden == 6
        for key, value in trainer.lightning_module.state_dict().items():
            assert torch.equal(model.state_dict()[key], value)
    assert (
        _Module.load_from_checkpoint(tmp_path / "aiosnap" / "last.ckpt", hidden=6, strict=True).hparams.hidden
        == 6
    )


def test_a_load_right_after_a_save_reads_the_new_file(tmp_path: Path, gate: _Gate) -> None:
    """``trainer.save_checkpoint(p)`` then ``Model.load_from_checkpoint(p)``: the load waits
    for the commit still in flight (held until then), and never reads the file it replaces."""
    io = _Held(gate)
    trainer = _trainer(1, io, enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit(_Module(), _data())  # ends with teardown
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    io.teardown()
    with torch.no_grad():
        for p in trainer.lightning_module.parameters():
            p.add_(1.0)
    trainer.save_checkpoint(tmp_path / "model.ckpt")  # its commit is held
    assert io.committing(tmp_path / "model.ckpt")
    model = _Module.load_from_checkpoint(tmp_path / "model.ckpt")
    for key, value in trainer.lightning_module.state_dict().items():
        assert torch.equal(model.state_dict()[key], value)
    io.teardown()


def test_export_weights_to_safetensors(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    trainer = _trainer(1, AiosnapCheckpointIO(), ModelCheckpoint(dirpath=tmp_path, filename="last"))
    trainer.fit(_Module(), _data())
    weights = trainer.lightning_module.state_dict()
    names = export_safetensors(tmp_path / "last.ckpt", tmp_path / "model.safetensors")
    assert names == list(weights)
    exported = load_file(tmp_path / "model.safetensors")
    assert exported.keys() == weights.keys() and all(torch.equal(exported[k], v) for k, v in weights.items())
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.metadata()["format"] == "pt"
    with pytest.raises(aiosnap.errors.ForeignFileError):
        export_safetensors(tmp_path / "last.ckpt", tmp_path / "model.safetensors")
    export_safetensors(
        tmp_path / "last.ckpt", tmp_path / "model.safetensors", strip_prefix="net.", overwrite=True
    )
    assert sorted(load_file(tmp_path / "model.safetensors")) == sorted(
        k.removeprefix("net.") for k in weights
    )


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*num_workers.*")
        yield
