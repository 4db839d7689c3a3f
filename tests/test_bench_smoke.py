"""The benchmark suite runs end to end at a small size (its numbers are not checked here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_benchmark_suite_runs_small(tmp_path: Path) -> None:
    out = tmp_path / "results"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench.py"),
            "--quick",
            "--size",
            "16MiB",
            "--dir",
            str(tmp_path / "scratch"),
            "--out",
            str(out),
        ],
        check=True,
        timeout=600,
        capture_output=True,
    )
    table = (out / "latest.md").read_text()
    assert "aiosnap QueueWriter (thread)" in table and "peer: dcp.async_save" in table
    summary = json.loads((out / "latest.json").read_text())["summary"]
    assert all(row["total"] > 0 for row in summary.values())
    assert (out / "latest.png").stat().st_size > 1000


def test_multi_rank_benchmark_runs_small(tmp_path: Path) -> None:
    out = tmp_path / "results"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_ranks.py"),
            "--size",
            "32MiB",
            "--reps",
            "1",
            "--dir",
            str(tmp_path / "scratch"),
            "--out",
            str(out),
        ],
        check=True,
        timeout=600,
        capture_output=True,
    )
    data = json.loads((out / "ranks.json").read_text())
    assert data["ranks"] == 2 and set(data["summary"]) >= {
        "peer: dcp.save",
        "aiosnap CheckpointManager (replicated model)",
    }
    assert all(row["total"] > 0 for row in data["summary"].values())
