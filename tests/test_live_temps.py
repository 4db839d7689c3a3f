"""No sweep takes the temp file of a live commit, whoever sweeps (issue 39, item 1).

A sweep runs when a CheckpointManager opens a directory and when an integration's writer
first saves into one; several may share a directory, in one process or in several. A
live commit locks its temp file until the rename; the kernel drops the lock of a killed
process, whose temp files the next sweep takes. Real files and real processes: the
children below hold a commit open, or are SIGKILLed holding one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import aiosnap
from aiosnap.integrations import _files
from aiosnap.storage import Posix

from .conftest import temp_files
from .faults import HookedPosix
from .integration_runs import ROOT

MARKER = "state.aiosnap"

#: A child that opens a commit of ``argv[1]`` and reports its temp file; on a line from the
#: parent it commits; with ``fork`` it first forks a grandchild that only waits (a
#: DataLoader worker), which must not keep the commit's lock if the child is killed.
_HOLDER = """
import os, sys
import aiosnap
upload = aiosnap.storage.LocalStorage().create(sys.argv[1], 4)
upload.write_at(0, memoryview(b"data"))
if sys.argv[2:] == ["fork"] and os.fork() == 0:
    os.read(0, 1)  # until the test closes our stdin
    os._exit(0)
print(upload.tmp, flush=True)
sys.stdin.readline()
upload.commit()
print("committed", flush=True)
"""

#: Another process that sweeps a directory when told (a line: the directory), as a
#: manager's open and the integrations' writers sweep; it answers what it removed.
_SWEEPER = """
import json, sys
import aiosnap
from aiosnap.integrations import _files
for line in sys.stdin:
    folder = line.strip()
    swept = aiosnap.storage.LocalStorage().sweep_incomplete(folder)
    swept += _files.sweep_temps(folder, "state.aiosnap")
    print(json.dumps(swept), flush=True)
"""


class Sweeper:
    def __init__(self) -> None:
        self.child = _python(_SWEEPER, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def __call__(self, directory: Path) -> list[str]:
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write(f"{directory}\n")
        self.child.stdin.flush()
        swept: list[str] = json.loads(self.child.stdout.readline())
        return swept


@pytest.fixture(scope="module")
def sweeper() -> Iterator[Sweeper]:
    sweeping = Sweeper()
    yield sweeping
    sweeping.child.kill()
    sweeping.child.wait()


def _python(code: str, *args: str, **kwargs: object) -> subprocess.Popen[str]:
    source = os.path.dirname(os.path.dirname(aiosnap.__file__))  # the aiosnap this process runs
    path = os.pathsep.join([source, str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
        [sys.executable, "-c", code, *args], text=True, env=env, **kwargs
    )


def _sweeps(directory: Path) -> list[str]:
    """Every sweep there is: the storage's (a manager's open), and the integrations'."""
    return aiosnap.storage.LocalStorage().sweep_incomplete(str(directory)) + _files.sweep_temps(
        str(directory)
    )


def test_a_sweep_keeps_a_live_commits_temp_file_and_takes_a_dead_ones(tmp_path: Path) -> None:
    upload = aiosnap.storage.LocalStorage().create(str(tmp_path / "ckpt"), 4)
    upload.write_at(0, memoryview(b"data"))
    dead = tmp_path / f"{aiosnap.storage.TEMP_PREFIX}ckpt.0123456789ab"  # a killed save's
    dead.write_bytes(b"half a checkpoint")
    assert _sweeps(tmp_path) == [str(dead)]

    async def open_a_manager() -> None:  # it sweeps under its lease: the writer has none
        async with aiosnap.CheckpointManager(str(tmp_path)):
            pass

    asyncio.run(open_a_manager())
    assert len(temp_files(tmp_path)) == 1
    upload.commit()
    assert (tmp_path / "ckpt").read_bytes() == b"data" and temp_files(tmp_path) == []


def test_another_processs_live_commit_is_kept_and_a_killed_ones_swept(tmp_path: Path) -> None:
    live = _python(_HOLDER, str(tmp_path / "live"), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    killed = _python(_HOLDER, str(tmp_path / "killed"), "fork", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert live.stdout is not None and killed.stdout is not None and live.stdin is not None
        live_tmp, killed_tmp = live.stdout.readline().strip(), killed.stdout.readline().strip()
        assert _sweeps(tmp_path) == []
        live.stdin.write("\n")
        live.stdin.flush()
        assert live.stdout.readline().strip() == "committed"
        assert (tmp_path / "live").read_bytes() == b"data" and not os.path.exists(live_tmp)
        killed.send_signal(signal.SIGKILL)  # its forked grandchild lives on, holding a copy
        killed.wait()
        assert os.path.exists(killed_tmp)
        assert _sweeps(tmp_path) == [killed_tmp]
    finally:
        for child in (live, killed):
            child.kill()
            child.wait()
            if child.stdin is not None:
                child.stdin.close()  # the grandchild reads end-of-file and exits


def test_a_sweep_in_another_process_racing_a_commits_creation_never_takes_its_file(
    tmp_path: Path, sweeper: Sweeper
) -> None:
    # Another process sweeps right after the commit created its temp file, before the
    # commit's next call on it (its lock): the commit goes on in a file of another name.
    final = str(tmp_path / "ckpt")
    swept: list[list[str]] = []

    def hook(op: str, path: str) -> None:
        if path == final and op != "open" and not swept:
            swept.append(sweeper(tmp_path))

    aiosnap.save_sync(final, {"step": 3}, storage=aiosnap.storage.LocalStorage(posix=HookedPosix(hook)))
    assert len(swept) == 1 and len(swept[0]) == 1  # it took the first temp file, not yet held
    assert aiosnap.load_sync(final) == {"step": 3} and temp_files(tmp_path) == []


def _checkpoint(folder: Path, version: int) -> None:
    aiosnap.save_sync(str(folder / MARKER), {"version": version})


def test_no_sweep_takes_a_temp_directory_being_filled(tmp_path: Path, sweeper: Sweeper) -> None:
    # The integrations' checkpoint directories (Transformers, Accelerate) are filled in a
    # temp directory first, then published.
    tmp = _files.temp_dir(str(tmp_path), "checkpoint")
    _checkpoint(Path(tmp), 1)
    assert _files.sweep_temps(str(tmp_path), MARKER) == [] and sweeper(tmp_path) == []
    _files.publish_dir(tmp, str(tmp_path / "checkpoint"), MARKER)
    assert aiosnap.load_sync(str(tmp_path / "checkpoint" / MARKER)) == {"version": 1}
    assert os.listdir(tmp_path) == ["checkpoint"]


def test_no_sweep_puts_back_or_takes_the_old_directory_a_live_publish_moved_aside(
    tmp_path: Path, sweeper: Sweeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A publish over an older checkpoint renames the old one aside, then the new one into
    # place: a sweep between the two would take the old one for a publish cut short there.
    final = tmp_path / "checkpoint"
    _checkpoint(final, 1)
    tmp = _files.temp_dir(str(tmp_path), "checkpoint")
    _checkpoint(Path(tmp), 2)
    rename, seen = Posix.rename, []

    def between(self: Posix, src: str, dst: str) -> None:
        if src == tmp:  # the old one is aside, the new one not yet in place
            seen.append(_files.sweep_temps(str(tmp_path), MARKER) + sweeper(tmp_path))
        rename(self, src, dst)

    monkeypatch.setattr(Posix, "rename", between)
    _files.publish_dir(tmp, str(final), MARKER)
    assert seen == [[]]
    assert aiosnap.load_sync(str(final / MARKER)) == {"version": 2} and os.listdir(tmp_path) == ["checkpoint"]


def test_a_child_forked_during_an_index_write_does_not_keep_the_directory_locked(tmp_path: Path) -> None:
    """A replace (the index's write) holds its directory's flock; a child forked meanwhile
    (a DataLoader starting its workers) shares it. Once the replace is done the directory
    must be free, whatever the child does: before, the child's copy kept the lock, and the
    next index write waited for it as long as the worker lived (a docs example hung so)."""
    import fcntl

    children: list[tuple[int, int]] = []

    def fork_at_rename(op: str, path: str) -> None:
        if op == "rename" and not children:  # the directory's lock is held here
            read_end, write_end = os.pipe()
            started_read, started_write = os.pipe()
            pid = os.fork()
            if pid == 0:  # a worker that lives on until told
                os.close(write_end)
                os.write(started_write, b"1")  # past the fork's handlers: fork() has returned
                os.read(read_end, 1)
                os._exit(0)
            os.close(read_end)
            os.close(started_write)
            assert os.read(started_read, 1) == b"1"
            os.close(started_read)
            children.append((pid, write_end))

    storage = aiosnap.storage.LocalStorage(posix=HookedPosix(fork_at_rename))
    storage.replace_if(str(tmp_path / "index.json"), b"{}", None)
    assert children
    pid, tell = children[0]
    try:
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError before
        finally:
            os.close(fd)
    finally:
        os.close(tell)
        os.waitpid(pid, 0)
