"""What the integrations share: ``import aiosnap`` imports no framework, their benchmark
runs end to end at a small size (its numbers are not checked), and a checkpoint directory's
removal, cut short, leaves no checkpoint's name behind.

White-box, that last test: it calls the integrations' shared removal
(``aiosnap.integrations._files.remove_dir``) through a disk that dies midway.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    import aiosnap
    from aiosnap.integrations import _files

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

    dying = aiosnap.LocalStorage(posix=HookedPosix(killed))
    with pytest.raises(SystemExit):
        _files.remove_dir(str(folder), "state.aiosnap", storage=dying)
    assert len(unlinked) == 1
    assert not folder.exists()  # no checkpoint_0 without its marker, which nothing would take
    assert len(_files.sweep_temps(str(tmp_path))) == 1 and list(tmp_path.iterdir()) == []
