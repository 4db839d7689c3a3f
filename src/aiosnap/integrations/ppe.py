"""pytorch-pfn-extras: an aiosnap ``Writer``, and snapshot extensions whose autoload reads it.

``Writer`` is a ``ppe.writing.Writer``: ``extensions.snapshot(writer=Writer(...))`` saves
through aiosnap. The call returns once the manager's state is captured; the file is
committed (durable, atomic) in the background, and ppe's cleanup hooks (``n_retains``)
run only after it is durable. ``finalize()`` and ``flush()`` wait for the saves and raise
a failed one's error.

ppe's own autoload takes the newest file by modification time and ``torch.load``\\ s it,
which cannot read aiosnap files: ``snapshot`` and ``snapshot_object`` here have ppe's
signatures and an autoload that reads them, newest first, verifying checksums and
falling back to an older file if the newest is damaged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Literal

import torch
from pytorch_pfn_extras.training import extension
from pytorch_pfn_extras.training._manager_protocol import ExtensionsManagerProtocol
from pytorch_pfn_extras.training.extensions import _snapshot
from pytorch_pfn_extras.writing._writer_base import Writer as _PpeWriter
from pytorch_pfn_extras.writing._writer_base import _PosixFileSystem

import aiosnap
from aiosnap.storage import TEMP_PREFIX

from ._bridge import SyncWriter, run_sync
from ._files import remove_file, sweep_temps
from ._ranks import RankAgreement

__all__ = ["Writer", "snapshot", "snapshot_object"]

logger = logging.getLogger(__name__)


class _OwnFiles:
    """ppe's POSIX filesystem, except that ``remove`` deletes only aiosnap checkpoints
    (ppe's ``n_retains`` cleanup removes every file matching the snapshot name) and that
    listings hide the temp files of commits in flight."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def list(self, path_or_prefix: str | None = None, recursive: bool = False) -> Iterator[str]:
        for name in self._fs.list(path_or_prefix, recursive=recursive):
            if not os.path.basename(name).startswith(TEMP_PREFIX):
                yield name

    def remove(self, file_path: str, recursive: bool = False) -> None:
        if recursive:
            raise NotImplementedError("aiosnap's ppe Writer does not remove directories")
        remove_file(self._fs.get_actual_path(file_path))


class _FileSaveFun:
    """A ppe ``savefun(target, file, **kwargs)`` as aiosnap's ``savefun(target, path)``."""

    def __init__(self, savefun: Any, kwargs: dict[str, Any]) -> None:
        self.savefun, self.kwargs = savefun, kwargs

    def __call__(self, target: Any, path: str) -> None:
        with open(path, "wb") as f:
            self.savefun(target, f, **self.kwargs)


class Writer(_PpeWriter):
    """A ppe snapshot writer that saves through aiosnap.

    ``out_dir`` and ``fs`` as ppe's writers (only POSIX filesystems: ppe's default);
    ``max_pending`` to ``allow_pickle`` are ``aiosnap.QueueWriter``'s options.
    ``allow_pickle=True`` stores values that are not tensors, arrays or plain containers
    pickled (and autoload then unpickles them): leave it off unless the state holds such
    values.

    ``savefun`` (ppe's ``savefun(target, file, **kwargs)``, e.g. ``torch.save``), here or
    in a call, writes that function's file instead of aiosnap's, still committed durably
    in the background; further keyword arguments go to the savefun a save uses, as ppe's
    writers pass theirs (a save in aiosnap's format with them raises TypeError).
    ``append=True`` (log files) writes synchronously through ``fs``, as ppe's
    ``SimpleWriter`` does.
    """

    def __init__(
        self,
        out_dir: str = "",
        *,
        savefun: Any = None,
        fs: Any = None,
        max_pending: int = 2,
        when_full: Literal["block", "skip", "replace"] = "block",
        offload: Literal["thread", "process"] = "thread",
        max_host_bytes: int | None = None,
        allow_pickle: bool = False,
        **savefun_kwargs: Any,
    ) -> None:
        fs = fs if fs is not None else _PosixFileSystem()
        if not isinstance(fs, _PosixFileSystem):
            raise TypeError(f"aiosnap's ppe Writer writes to POSIX filesystems only, not {type(fs).__name__}")
        super().__init__(fs=_OwnFiles(fs), out_dir=out_dir)
        self.savefun, self.savefun_kwargs = savefun, savefun_kwargs
        self.allow_pickle = allow_pickle
        self._bridge = SyncWriter(
            max_pending=max_pending,
            when_full=when_full,
            offload=offload,
            max_host_bytes=max_host_bytes,
            allow_pickle=allow_pickle,
        )
        self._swept: set[str] = set()

    def initialize(self, out_dir: str) -> None:
        super().initialize(out_dir)
        self._sweep(out_dir)

    def _sweep(self, directory: str) -> None:
        actual = self.fs.get_actual_path(directory)
        if actual not in self._swept:
            self._swept.add(actual)
            sweep_temps(actual)

    def __call__(
        self,
        filename: str,
        out_dir: str,
        target: Any,
        *,
        savefun: Any = None,
        append: bool = False,
    ) -> None:
        """Capture ``target`` and return; ``out_dir/filename`` is committed in the
        background (the writer's own ``out_dir`` takes precedence, as in ppe)."""
        directory = self.out_dir or out_dir
        if not self._initialized:
            self.initialize(directory)
        path = os.path.join(directory, filename)
        savefun = savefun if savefun is not None else self.savefun
        if append:
            with self.fs.open(path, "ab") as f:
                (savefun or torch.save)(target, f, **self.savefun_kwargs)
            return
        if savefun is None and self.savefun_kwargs:
            raise TypeError(
                f"the writer's keyword argument(s) {sorted(self.savefun_kwargs)} go to a savefun, and "
                "this save has none (aiosnap's own format takes no arguments)"
            )
        self._sweep(os.path.dirname(path))
        self._bridge.save(
            self.fs.get_actual_path(path),
            target,
            savefun=_FileSaveFun(savefun, self.savefun_kwargs) if savefun is not None else None,
            then=self._post_save,
        )

    def flush(self) -> None:
        """Wait until every save so far is durable (and its cleanup ran); raise the first
        failure not reported yet."""
        self._bridge.flush()

    def finalize(self) -> None:
        """Wait for every save, raise a failure not reported yet, stop the background
        loop. The writer opens again at its next save."""
        self._bridge.close()

    def __del__(self) -> None:
        # ppe's finalizes here; the bridge drains itself when collected or at exit.
        pass


class _AiosnapSnapshot(_snapshot._Snapshot):
    """ppe's snapshot extension with an autoload that reads aiosnap files."""

    def initialize(self, manager: ExtensionsManagerProtocol) -> str | None:  # type: ignore[override]
        if self.writer is None:
            self.writer = Writer(out_dir=manager.out)
        loaded = self._load_latest(manager) if self.autoload else None
        self._add_cleanup_hook(self.writer)
        return loaded

    def _make_snapshot(self, manager: ExtensionsManagerProtocol) -> None:
        # Called before ``initialize`` (a call by hand, ``snapshot_on_error``), ppe's own
        # would take the manager's writer, a torch.save one, which our autoload skips.
        if self.writer is None:
            self.writer = Writer(out_dir=manager.out)
        super()._make_snapshot(manager)

    def _load_latest(self, manager: ExtensionsManagerProtocol) -> str | None:
        writer = self.writer
        assert writer is not None
        if not isinstance(self.filename, str):
            return None
        found = _snapshot._find_snapshot_files(self.filename, writer.out_dir, writer.fs)
        allow_pickle = bool(getattr(writer, "allow_pickle", False))
        for _mtime, name in reversed(found):
            path = writer.fs.get_actual_path(os.path.join(writer.out_dir, name))
            try:
                state = run_sync(aiosnap.load, path, map_location="cpu", allow_pickle=allow_pickle)
            except aiosnap.errors.CheckpointError as exc:
                logger.warning("autoload skips %s: %s", path, exc)
                continue
            target: Any = manager if self._target is None else self._target
            if type(target) is dict:
                for key in target:
                    target[key].load_state_dict(state[key])
            else:
                target.load_state_dict(state)
            return name
        return None

    def finalize(self, manager: ExtensionsManagerProtocol) -> None:
        if self.writer is not None:
            self.writer.finalize()


class _SaverRankSnapshot(_AiosnapSnapshot):
    """ppe's ``saver_rank`` snapshot of a torch.distributed run: the saver rank writes,
    and every rank learns how that went before it trains on. Where ppe's own waits at a
    barrier (a saver that raised leaves the others there until the group times out),
    here every save, autoload and finalize is an agreement (``RankAgreement``): either
    every rank returns, or every rank raises."""

    def __init__(self, *, saver_rank: int, timeout: float, **options: Any) -> None:
        super().__init__(**options)
        if not torch.distributed.is_initialized():
            raise RuntimeError("The Distributed Snapshot extension requires torch.distributed initialized")
        self._agreement = RankAgreement(timeout=timeout)
        size = self._agreement.size
        if not 0 <= saver_rank < size:
            raise ValueError(f"Distributed snapshot requires a saver rank in the range [0-{size})")
        self._is_saver = self._agreement.rank == saver_rank

    def initialize(self, manager: ExtensionsManagerProtocol) -> str | None:  # type: ignore[override]
        self._agreement.open()  # the ranks set up together: the group is made here, not in a save
        if self.writer is None:
            self.writer = Writer(out_dir=manager.out)
        loaded, error = None, None
        if self.autoload:
            try:
                loaded = self._load_latest(manager)
            except Exception as exc:
                error = exc
        names = self._agreement.agree("ppe autoload", error, loaded)
        if len(set(names)) > 1:
            raise RuntimeError(
                f"autoload found different snapshots on the ranks ({dict(enumerate(names))}): every rank "
                f"must see the same output directory ({self.writer.out_dir!r})"
            )
        self._add_cleanup_hook(self.writer)
        return loaded

    def _add_cleanup_hook(self, writer: _PpeWriter) -> None:
        if self._is_saver:
            super()._add_cleanup_hook(writer)

    def _make_snapshot(self, manager: ExtensionsManagerProtocol) -> None:
        error = None
        if self._is_saver:
            try:
                super()._make_snapshot(manager)
            except Exception as exc:  # every rank raises it, below
                error = exc
        self._agreement.agree("ppe snapshot", error)

    def on_error(self, manager: ExtensionsManagerProtocol, exc: Exception, tb: TracebackType) -> None:
        # On a failing run's way out the other ranks may never come to an agreement (they
        # wait in a collective of the training, or died): the saver saves on its own, and
        # waits until the snapshot is durable, as the process is about to end.
        if self._snapshot_on_error and self._is_saver:
            _AiosnapSnapshot._make_snapshot(self, manager)
            if isinstance(self.writer, Writer):  # ppe's own writers are synchronous
                self.writer.flush()

    def finalize(self, manager: ExtensionsManagerProtocol) -> None:
        error = None
        if self._is_saver and self.writer is not None:
            try:
                self.writer.finalize()
            except Exception as exc:
                error = exc
        try:
            self._agreement.agree("ppe finalize", error)
        finally:
            self._agreement.close()


def snapshot(
    savefun: Any = None,
    filename: str = "snapshot_iter_{.iteration}",
    *,
    target: Any = None,
    condition: Any = None,
    writer: _PpeWriter | None = None,
    snapshot_on_error: bool = False,
    n_retains: int = -1,
    autoload: bool = False,
    saver_rank: int | None = None,
    snapshot_mode: _snapshot.SnapshotMode = _snapshot.SnapshotMode.DEFAULT,
    timeout: float = 300.0,
) -> extension.Extension:
    """ppe's ``extensions.snapshot``, saving through aiosnap and autoloading aiosnap files.

    Without ``writer``, it saves through an aiosnap ``Writer`` into the manager's output
    directory, also when called before the manager initialised it (pass
    ``writer=Writer(...)`` for its options). ``autoload`` reads the newest
    snapshot that loads, verifying checksums (a damaged one is skipped, with a warning).
    ``n_retains`` deletes older snapshots only after a newer one is durable, and only
    aiosnap files.

    ``saver_rank`` (in a torch.distributed run; ``SnapshotMode.DEFAULT`` or
    ``DISTRIBUTED``): that rank alone saves, every rank autoloads the same snapshot, and
    every rank learns how each save call went before it trains on: a save (or, at
    ``finalize``, a background commit) that failed on the saver raises there and
    ``aiosnap.errors.RankFailedError`` on every other rank; a rank silent for ``timeout``
    seconds (dead, or stuck elsewhere) makes the others raise. ``SnapshotMode.SHARDED``
    is ppe's own only: it raises NotImplementedError here.
    """
    if savefun is not None and writer is not None:
        raise TypeError("savefun and writer arguments cannot be specified together.")
    if snapshot_mode == _snapshot.SnapshotMode.SHARDED:
        raise NotImplementedError(
            "aiosnap's ppe snapshot has no SnapshotMode.SHARDED: use ppe's own, or "
            "aiosnap.CheckpointManager in a process group for per-rank state"
        )
    if snapshot_mode == _snapshot.SnapshotMode.DISTRIBUTED and saver_rank is None:
        raise ValueError("SnapshotMode.DISTRIBUTED needs a saver_rank")
    options: dict[str, Any] = dict(
        target=target,
        condition=condition,
        writer=writer,
        filename=filename,
        snapshot_on_error=snapshot_on_error,
        n_retains=n_retains,
        autoload=autoload,
        savefun=savefun,
    )
    if saver_rank is not None:
        return _SaverRankSnapshot(saver_rank=saver_rank, timeout=timeout, **options)
    return _AiosnapSnapshot(**options)


def snapshot_object(target: Any, filename: str, savefun: Any = None, **kwargs: Any) -> extension.Extension:
    """ppe's ``extensions.snapshot_object``, through aiosnap (see ``snapshot``)."""
    return snapshot(target=target, filename=filename, savefun=savefun, **kwargs)
