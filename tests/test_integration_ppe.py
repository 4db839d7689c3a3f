"""aiosnap.integrations.ppe against the real pytorch-pfn-extras: a killed run resumes
through ppe's autoload with the same losses, bit for bit; ppe's cleanup (``n_retains``)
runs after commits and deletes only aiosnap files; failures surface at flush/finalize."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("pytorch_pfn_extras", reason="needs aiosnap[ppe]")

import pytorch_pfn_extras as ppe
from pytorch_pfn_extras.training import extensions

import aiosnap
from aiosnap.integrations.ppe import Writer, snapshot, snapshot_object
from aiosnap.storage import Posix
from tests.conftest import WAIT_CAP
from tests.integration_runs import (
    Child,
    assert_aiosnap_checkpoint,
    assert_resumed_exactly,
    loss,
    report,
    temp_entries,
)

ITERATIONS = 24
EVERY = 4  # a snapshot every 4 iterations
RETAIN = 2


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, 32, generator=g)
    return x, x.sum(-1, keepdim=True)


def _manager(out: str, iterations: int, writer: Any, **snapshot_options: Any) -> Any:
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = ppe.training.ExtensionsManager(
        model, optimizer, 1, iters_per_epoch=iterations, out_dir=out, extensions=[]
    )
    manager.extend(snapshot(writer=writer, **snapshot_options), trigger=(EVERY, "iteration"))
    return manager, model, optimizer


def _train(manager: Any, model: torch.nn.Module, optimizer: Any) -> None:
    x, y = _batches()
    first = True
    while not manager.stop_trigger:
        if first:
            report("resumed", manager.iteration)
            first = False
        with manager.run_iteration():
            i = manager.iteration % len(x)
            value = torch.nn.functional.mse_loss(model(x[i]), y[i])
            optimizer.zero_grad()
            value.backward()
            optimizer.step()
            loss(manager.iteration + 1, value.item())


class _Reporting(Writer):
    """Reports each save call once it returned (the parent kills the run on that line)."""

    def __call__(self, filename: str, out_dir: str, target: Any, **kwargs: Any) -> None:
        super().__call__(filename, out_dir, target, **kwargs)
        report("saved", filename)


def child(out: str) -> None:
    """A run of ITERATIONS iterations that snapshots every EVERY and autoloads."""
    torch.set_num_threads(1)
    manager, model, optimizer = _manager(out, ITERATIONS, _Reporting(out), n_retains=RETAIN, autoload=True)
    _train(manager, model, optimizer)


def test_killed_run_resumes_through_autoload_bit_identical(tmp_path: Path) -> None:
    reference = Child(
        "tests.test_integration_ppe.child", tmp_path / "reference", log=tmp_path / "reference.log"
    )
    killed = Child("tests.test_integration_ppe.child", tmp_path / "run", log=tmp_path / "killed.log")
    assert killed.finish(kill_after_save=4).killed  # right after the save of iteration 16 returned
    ref = reference.finish()
    resumed = Child(
        "tests.test_integration_ppe.child", tmp_path / "run", log=tmp_path / "resumed.log"
    ).finish()
    start = assert_resumed_exactly(ref, resumed, ITERATIONS)
    # A save call returns with at most max_pending + 1 = 3 saves in flight: the first is durable.
    assert start in (4, 8, 12, 16), f"resumed from iteration {start}: not from a snapshot of the killed run"
    files = sorted(os.listdir(tmp_path / "run"))
    assert files == [f"snapshot_iter_{ITERATIONS - EVERY}", f"snapshot_iter_{ITERATIONS}"]
    for name in files:
        assert_aiosnap_checkpoint(tmp_path / "run" / name)
    assert temp_entries(tmp_path / "run") == []


def test_stock_snapshot_extension_saves_through_the_writer(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    torch.save({"not": "aiosnap"}, out / "snapshot_iter_0")  # oldest, matching the name
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = ppe.training.ExtensionsManager(model, optimizer, 1, iters_per_epoch=12, out_dir=str(out))
    writer = Writer(str(out))
    seen: list[list[str]] = []
    # Hooks of ppe's own kind (as n_retains' cleanup) run after each commit, in order.
    writer._add_cleanup_hook(lambda: seen.append(os.listdir(out)))
    manager.extend(extensions.snapshot(writer=writer, n_retains=RETAIN), trigger=(EVERY, "iteration"))
    _train(manager, model, optimizer)  # the manager finalizes the writer at the end
    assert [f"snapshot_iter_{EVERY * (k + 1)}" in names for k, names in enumerate(seen)] == [True] * 3
    names = sorted(os.listdir(out))
    assert names == ["snapshot_iter_0", "snapshot_iter_12", "snapshot_iter_8"]  # the foreign file stays
    for name in names[1:]:
        assert_aiosnap_checkpoint(out / name)
    assert torch.load(out / "snapshot_iter_0") == {"not": "aiosnap"}


def test_a_failed_save_is_raised_at_finalize_and_keeps_the_older_snapshot(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "snapshot_iter_8").mkdir(parents=True)  # the commit's rename onto it fails
    writer = Writer(str(out))
    with pytest.raises(IsADirectoryError):
        _train(*_manager(str(out), 8, writer, n_retains=1))  # raised as the manager finalizes
    writer.flush()  # reported once
    assert_aiosnap_checkpoint(out / "snapshot_iter_4")  # no newer file: nothing was cleaned up
    assert temp_entries(out) == []


def test_autoload_skips_a_damaged_newest_snapshot(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = str(tmp_path / "out")
    _train(*_manager(out, 8, Writer(out), autoload=True))
    newest = tmp_path / "out" / "snapshot_iter_8"
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF  # the last tensor's last byte
    newest.write_bytes(bytes(data))
    os.utime(newest)  # still the newest by modification time
    with pytest.raises(aiosnap.errors.CorruptCheckpointError):
        aiosnap.verify_sync(str(newest))
    manager = _manager(out, 8, Writer(out), autoload=True)[0]
    with caplog.at_level(logging.WARNING):
        assert manager.iteration == 4
    assert "autoload skips" in caplog.text


def _drop_in_run(out: str, *, gate: Any = None) -> torch.nn.Module:
    """The documented drop-in with two extensions, each with a writer of its own, on one
    directory: ``snapshot`` every iteration, ``snapshot_object`` of the model every
    second. ``gate`` runs first in every iteration."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ppe.training.ExtensionsManager(model, optimizer, 1, iters_per_epoch=4, out_dir=out)
    if gate is not None:
        manager.extend(gate, name="gate", trigger=(1, "iteration"), priority=ppe.training.PRIORITY_WRITER)
    manager.extend(snapshot(), trigger=(1, "iteration"))
    manager.extend(snapshot_object(model, "model_{.iteration}"), trigger=(2, "iteration"))
    while not manager.stop_trigger:
        with manager.run_iteration():
            loss = model(torch.randn(4, 8)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model  # the manager finalized both writers: every save is durable, or raised


def _assert_every_snapshot(out: Path, model: torch.nn.Module) -> None:
    names = sorted(os.listdir(out))
    assert names == ["model_2", "model_4", *(f"snapshot_iter_{i}" for i in range(1, 5))], names
    for name in names:
        assert_aiosnap_checkpoint(out / name)
    saved = aiosnap.load_sync(str(out / "model_4"))
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def test_two_snapshot_extensions_on_one_directory_both_save_every_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The second extension's first save sweeps the directory while the first extension's
    # first commit waits between its write and its rename (held there until the second's
    # commit reaches its own rename). Before, that sweep deleted the first's temp file.
    parked, second = threading.Event(), threading.Event()
    rename = Posix.rename

    def held(self: Posix, src: str, dst: str) -> None:
        if os.path.basename(dst) == "snapshot_iter_1":
            parked.set()
            assert second.wait(WAIT_CAP), "the second extension's save never reached its rename"
        elif os.path.basename(dst) == "model_2":
            second.set()
        rename(self, src, dst)

    def gate(manager: Any) -> None:  # iteration 2 saves only once the first commit waits
        if manager.iteration == 2:
            assert parked.wait(WAIT_CAP), "the first commit never reached its rename"

    monkeypatch.setattr(Posix, "rename", held)
    model = _drop_in_run(str(tmp_path / "out"), gate=gate)
    assert second.is_set()
    _assert_every_snapshot(tmp_path / "out", model)


@pytest.mark.slow
def test_two_snapshot_extensions_save_every_time_in_100_runs(tmp_path: Path) -> None:
    for run in range(100):
        out = tmp_path / f"run{run}"
        _assert_every_snapshot(out, _drop_in_run(str(out)))


def test_a_snapshot_taken_before_the_manager_initialised_it_is_aiosnaps_and_autoloads(tmp_path: Path) -> None:
    # ppe's test_snapshot_autoload_initialize_without_writer: the extension called by hand.
    out = str(tmp_path)
    first, trained, _ = _manager(out, 8, None)
    with torch.no_grad():
        trained[0].weight.add_(1.0)  # not what a fresh manager starts from
    taken = snapshot(filename="snapshot_file")
    taken(first)
    assert isinstance(taken.writer, Writer)  # not ppe's own torch.save writer of the manager
    taken.writer.flush()
    assert_aiosnap_checkpoint(tmp_path / "snapshot_file")
    second, model, _ = _manager(out, 8, None)
    assert not torch.equal(model[0].weight, trained[0].weight)
    loading = snapshot(filename="snapshot_file", autoload=True)
    assert loading.initialize(second) == "snapshot_file"
    assert all(torch.equal(v, trained.state_dict()[k]) for k, v in model.state_dict().items())


def test_the_writer_takes_ppe_writers_savefun_and_its_keyword_arguments(tmp_path: Path) -> None:
    calls: list[dict[str, Any]] = []

    def savefun(target: Any, f: Any, **kwargs: Any) -> None:
        calls.append(kwargs)
        torch.save(target, f)

    writer = Writer(str(tmp_path), savefun=savefun, tag="v1")
    writer("state.pt", "", {"w": torch.ones(3)})
    writer("own.pt", "", {"w": torch.ones(3)}, savefun=savefun)  # the call's savefun gets them too
    writer.finalize()
    assert calls == [{"tag": "v1"}, {"tag": "v1"}]
    assert torch.equal(torch.load(tmp_path / "state.pt")["w"], torch.ones(3))
    plain = Writer(str(tmp_path), tag="v1")  # as ppe's SimpleWriter(foo=True): for a savefun
    with pytest.raises(TypeError, match="tag"):
        plain("aiosnap.file", "", {"w": torch.ones(3)})  # aiosnap's own format has no arguments
    plain.finalize()


def test_sharded_snapshots_are_refused_with_a_clear_error() -> None:
    with pytest.raises(NotImplementedError, match="SHARDED") as info:
        snapshot(snapshot_mode=extensions.SnapshotMode.SHARDED, saver_rank=0)
    assert "ppe's own" in str(info.value)


def test_a_saver_rank_needs_torch_distributed_as_in_ppe() -> None:
    # ppe's _DistributedSnapshot raises RuntimeError without a process group; so do we.
    with pytest.raises(RuntimeError, match="torch.distributed"):
        snapshot(saver_rank=0)
    with pytest.raises(ValueError, match="saver_rank"):
        snapshot(snapshot_mode=extensions.SnapshotMode.DISTRIBUTED)
