"""A pytest plugin for Lightning's own test suite: every Trainer whose strategy would make
Lightning's default ``TorchCheckpointIO`` gets ``AiosnapCheckpointIO`` instead.

    pytest -p tests.peers.lightning_substitute tests_pytorch/checkpointing/test_model_checkpoint.py

(``tests/peers/run_lightning_tests.py`` fetches nothing: it runs a Lightning checkout's
tests this way.) A test that reads a checkpoint with ``torch.load`` itself would only
find out that the file is an aiosnap file: with ``AIOSNAP_TORCH_LOAD=1`` in the
environment, ``torch.load`` of an aiosnap file reads it through ``aiosnap.load`` (with
pickling allowed, as ``torch.load(weights_only=False)`` would), so the tests check the
plugin's behaviour rather than its format. ``AIOSNAP_SYNC_SAVES=1`` (see ``_Plugin``)
sets the other deliberate difference aside: a save returns before its file exists.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import aiosnap
from aiosnap.integrations._files import is_aiosnap_file
from aiosnap.integrations.lightning import AiosnapCheckpointIO

_torch_load = torch.load


def _load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
    path = os.fspath(f) if isinstance(f, str | os.PathLike) else _name_of(f)
    if path is not None and os.path.isfile(path) and is_aiosnap_file(path):
        return aiosnap.load_sync(path, allow_pickle=True)
    return _torch_load(f, map_location, *args, **kwargs)


def _name_of(f: Any) -> str | None:
    """The path of a file object opened on one (fsspec's have ``path``), else None."""
    try:
        name = getattr(f, "path", None) or getattr(f, "name", None)
    except AttributeError:  # a buffered reader over aiosnap's own reader: no name
        return None
    return name if isinstance(name, str) else None


class _Plugin(AiosnapCheckpointIO):
    """Lightning's tests pickle hyper-parameters (Namespace, dataclasses): allowed here.
    With ``AIOSNAP_SYNC_SAVES=1``, each save returns once durable, so that a test that
    looks for the file right after a save sees the other differences, if any."""

    def __init__(self) -> None:
        super().__init__(allow_pickle=True)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        if os.environ.get("AIOSNAP_SYNC_SAVES") == "1":
            self.flush()


@pytest.fixture(autouse=True)
def _aiosnap_checkpoint_io(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning.pytorch.strategies.strategy as strategy

    monkeypatch.setattr(strategy, "TorchCheckpointIO", _Plugin)
    if os.environ.get("AIOSNAP_TORCH_LOAD") == "1":
        monkeypatch.setattr(torch, "load", _load)
