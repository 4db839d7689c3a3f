"""What the integrations share: ``import aiosnap`` imports no framework, their benchmark
runs end to end at a small size (its numbers are not checked), a checkpoint directory's
removal, cut short, leaves no checkpoint's name behind, and a publish that replaces a
directory, SIGKILLed before any of its system calls (or the repair after it, before any of
its own), leaves the old directory or the new one under its name once repaired.

White-box, those tests: they call the integrations' shared functions
(``aiosnap.integrations._files``) through a disk that dies midway, or in a child killed
before a chosen system call.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import aiosnap
from aiosnap.integrations import _files

from .integration_runs import kill_points, pause_at_file_ops

ROOT = Path(__file__).resolve().parent.parent


def test_importing_aiosnap_imports_no_framework() -> None:
    frameworks = ("pytorch_pfn_extras", "lightning", "pytorch_lightning", "transformers", "accelerate")
    code = f"import sys, aiosnap, aiosnap.integrations; print([m for m in {frameworks} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert done.stdout.strip() == "[]"


def test_integrations_benchmark_runs_small(tmp_path: Path) -> None:
    for framework in ("pytorch_pfn_extras", "lightning", "transformers", "accelerate"):
        pytest.importorskip(framework, reason="needs aiosnap[integrations]")
    out = tmp_path / "results"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_integrations.py"), "--size", "8MiB"]
    command += ["--reps", "1", "--dir", str(tmp_path / "scratch"), "--out", str(out)]
    done = subprocess.run(command, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, f"exited {done.returncode}:\n{done.stderr[-4000:]}"
    results = json.loads((out / "integrations.json").read_text())["results"]
    assert set(results) == {"ppe", "lightning", "hf", "accelerate"}
    for data in results.values():
        for method in ("aiosnap", "framework default", "durable torch.save"):
            assert data[method]["call"][0] > 0
    assert "| Accelerate (" in (out / "integrations.md").read_text()


def test_a_removal_cut_short_leaves_a_temp_directory_never_a_checkpoints_name(tmp_path: Path) -> None:
    # The process dies once the first file went.
    from .faults import HookedPosix

    folder = tmp_path / "checkpoint_0"
    folder.mkdir()
    aiosnap.save_sync(str(folder / "state.aiosnap"), {"w": 1})
    (folder / "extra.json").write_text("{}")
    unlinked: list[str] = []

    def killed(op: str, path: str) -> None:
        if op == "unlink":
            if unlinked:
                raise SystemExit("killed")
            unlinked.append(path)

    dying = aiosnap.storage.LocalStorage(posix=HookedPosix(killed))
    with pytest.raises(SystemExit):
        _files.remove_dir(str(folder), "state.aiosnap", storage=dying)
    assert len(unlinked) == 1
    assert not folder.exists()  # no checkpoint_0 without its marker, which nothing would take
    assert len(_files.sweep_temps(str(tmp_path))) == 1 and list(tmp_path.iterdir()) == []


MARKER = "state.aiosnap"


def _checkpoint(folder: Path, version: int) -> None:
    """A checkpoint directory of an integration, two files, both saying ``version``."""
    folder.mkdir(parents=True, exist_ok=True)
    aiosnap.save_sync(str(folder / MARKER), {"version": version})
    (folder / "notes.json").write_text(json.dumps(version))


def _version(folder: Path) -> int:
    """Which checkpoint ``folder`` holds, whole (both files from the same one)."""
    version: int = aiosnap.load_sync(str(folder / MARKER))["version"]
    assert json.loads((folder / "notes.json").read_text()) == version, folder
    return version


def publish_child(tmp: str, final: str) -> None:
    pause_at_file_ops(os.path.dirname(final))
    _files.publish_dir(tmp, final, MARKER)


def sweep_child(directory: str) -> None:
    pause_at_file_ops(directory)
    _files.sweep_temps(directory, MARKER)


def _replacing(case: Path) -> list[object]:
    """``case/latest`` holds checkpoint 1; a temp directory beside it, checkpoint 2."""
    _checkpoint(case / "latest", 1)
    tmp = _files.temp_dir(str(case), "latest")
    _checkpoint(Path(tmp), 2)
    _files._let_go(tmp)  # the child publishes it: this process holds it no longer
    return [tmp, case / "latest"]


def _settles(case: Path, expected: int) -> None:
    """The repair alone (a loader's) puts ``expected`` under ``latest``; the sweep too,
    deleting every temp directory; a publish after it replaces it as usual."""
    repaired = shutil.copytree(case, case.with_name(case.name + "-repaired"), symlinks=True)
    _files.repair_publishes(str(repaired), "latest")
    assert _version(repaired / "latest") == expected
    swept = shutil.copytree(case, case.with_name(case.name + "-swept"), symlinks=True)
    _files.sweep_temps(str(swept), MARKER)
    assert _version(swept / "latest") == expected and os.listdir(swept) == ["latest"]
    tmp = _files.temp_dir(str(swept), "latest")
    _checkpoint(Path(tmp), 3)
    _files.publish_dir(tmp, str(swept / "latest"), MARKER)
    assert _version(swept / "latest") == 3 and os.listdir(swept) == ["latest"]


def test_a_publish_killed_before_any_call_leaves_the_old_directory_or_the_new(tmp_path: Path) -> None:
    # Every rename, fsync, directory fsync, unlink and rmdir of a publish replacing a directory.
    runs = list(
        kill_points("tests.test_integration_common.publish_child", tmp_path, "latest", "every", _replacing)
    )
    for run in runs:
        try:
            _settles(run.case, 2 if run.renamed_into(run.case / "latest") else 1)
        except AssertionError as exc:
            exc.add_note(f"killed before {run.at} (calls made: {run.made})")
            raise
    kinds = [kind for kind, _, _ in runs[0].made]
    assert {"fsync", "dirsync", "rename", "unlink", "rmdir"} <= set(kinds) and len(runs) == len(kinds) + 1


@pytest.mark.slow  # CI's budget: the publish killed at every call above stays in the default run
def test_a_sweep_killed_before_any_call_still_puts_the_old_directory_back(tmp_path: Path) -> None:
    # The state a publish killed between its renames leaves, then the repair killed too.
    start = tmp_path / "start"
    killed = next(
        kill_points("tests.test_integration_common.publish_child", start, "latest", "between", _replacing)
    )
    assert not (killed.case / "latest").exists()

    def prepare(case: Path) -> list[object]:
        shutil.copytree(killed.case, case, symlinks=True)
        return [case]

    runs = list(
        kill_points(
            "tests.test_integration_common.sweep_child", tmp_path / "sweeps", "latest", "every", prepare
        )
    )
    for run in runs:
        _settles(run.case, 1)
    assert [kind for kind, _, _ in runs[0].made][:2] == ["rename", "dirsync"]  # put back, durably, first


def test_a_repair_touches_only_what_its_names_say(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    prefix = aiosnap.storage.TEMP_PREFIX
    # An old directory whose checkpoint is missing goes back; a new one whose checkpoint is
    # missing is a save that never arrived, swept; names that look alike but are not
    # aiosnap's temp names stay, whatever they hold.
    _checkpoint(tmp_path / f"{prefix}old-0123456789ab-new-0123456789ab-x", 1)  # of "new-0123456789ab-x"
    _checkpoint(tmp_path / f"{prefix}new-0123456789ab-old-0123456789ab-x", 2)  # of "old-0123456789ab-x"
    _checkpoint(tmp_path / "old-0123456789ab-y", 3)
    _checkpoint(tmp_path / f"{prefix}replaced-z.0123456789ab", 4)  # not a name of this version
    # An old directory beside the checkpoint that replaced it goes; beside a foreign one, it stays.
    _checkpoint(tmp_path / "done", 5)
    _checkpoint(tmp_path / f"{prefix}old-aaaaaaaaaaaa-done", 6)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("someone else's")
    _checkpoint(tmp_path / f"{prefix}old-bbbbbbbbbbbb-theirs", 7)
    # An empty directory where the old one belongs is replaced by it.
    (tmp_path / "emptied").mkdir()
    _checkpoint(tmp_path / f"{prefix}old-cccccccccccc-emptied", 8)
    # Two old directories of one missing checkpoint: which is its last is unknown; both stay.
    _checkpoint(tmp_path / f"{prefix}old-dddddddddddd-twice", 9)
    _checkpoint(tmp_path / f"{prefix}old-eeeeeeeeeeee-twice", 10)
    with caplog.at_level(logging.WARNING):
        _files.sweep_temps(str(tmp_path), MARKER)
    assert sorted(os.listdir(tmp_path)) == [
        f"{prefix}old-bbbbbbbbbbbb-theirs",
        f"{prefix}old-dddddddddddd-twice",
        f"{prefix}old-eeeeeeeeeeee-twice",
        "done",
        "emptied",
        "new-0123456789ab-x",
        "old-0123456789ab-y",
        "theirs",
    ]
    names = ("new-0123456789ab-x", "old-0123456789ab-y", "done", "emptied")
    assert [_version(tmp_path / n) for n in names] == [1, 3, 5, 8]
    assert "which one is its last is unknown" in caplog.text
    assert "aiosnap did not write what stands" in caplog.text
