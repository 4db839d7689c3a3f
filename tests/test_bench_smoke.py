"""The benchmark suite runs end to end at a small size (its numbers are not checked here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_bench(script: str, tmp_path: Path, *args: str) -> Path:
    """Run a benchmark script with a scratch directory under ``tmp_path``; its output directory."""
    out = tmp_path / "results"
    command = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    command += ["--dir", str(tmp_path / "scratch"), "--out", str(out)]
    done = subprocess.run(command, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return out


def test_benchmark_suite_runs_small(tmp_path: Path) -> None:
    out = run_bench("bench.py", tmp_path, "--quick", "--size", "16MiB")
    table = (out / "latest.md").read_text()
    assert "aiosnap QueueWriter (thread)" in table and "peer: dcp.async_save" in table
    assert "Cold loads in a new process" in table
    cold = json.loads((out / "latest.json").read_text())["extra"]["cold"]
    methods = {r["method"] for r in cold}
    assert {"torch.load", "aiosnap.load", "limit: read, one reused 16 MiB buffer"} <= methods
    assert all(r["s"] > 0 for r in cold)
    summary = json.loads((out / "latest.json").read_text())["summary"]
    assert all(row["total"] > 0 for row in summary.values())
    assert (out / "latest.png").stat().st_size > 1000


@pytest.mark.slow  # CI's budget: test_benchmark_suite_runs_small stands for the scripts
def test_multi_rank_benchmark_runs_small(tmp_path: Path) -> None:
    out = run_bench("bench_ranks.py", tmp_path, "--size", "32MiB", "--reps", "1")
    data = json.loads((out / "ranks.json").read_text())
    assert data["ranks"] == 2 and set(data["summary"]) >= {
        "peer: dcp.save",
        "aiosnap CheckpointManager (replicated model)",
    }
    assert all(row["total"] > 0 for row in data["summary"].values())


@pytest.mark.slow  # CI's budget, as above
def test_sharded_benchmark_runs_small(tmp_path: Path) -> None:
    out = run_bench("bench_sharded.py", tmp_path, "--size", "32MiB", "--reps", "1")
    data = json.loads((out / "sharded.json").read_text())
    assert (data["save_ranks"], data["load_ranks"]) == (4, 2)
    assert {"peer: dcp.save", "aiosnap CheckpointManager"} <= set(data["save"])
    assert {"peer: dcp.load", "aiosnap CheckpointManager.restore(target=)"} <= set(data["load"])
    assert all(row["total"] > 0 for phase in ("save", "load") for row in data[phase].values())


@pytest.mark.slow  # two 7B-shaped commits of 16 simulated ranks, and 2 gloo processes
def test_scale_benchmark_runs_small(tmp_path: Path) -> None:
    out = run_bench("bench_scale.py", tmp_path, "--quick")
    data = json.loads((out / "scale.json").read_text())
    rows = {(r["ranks"], r["commit"]): r for r in data["simulated"]}
    assert set(rows) == {(8, "first"), (8, "steady"), (16, "first"), (16, "steady")}
    assert all(r["rank0_cpu_s"] > 0 and r["messages_per_rank"] > 0 for r in rows.values())
    assert rows[(16, "steady")]["bytes_to_rank0_per_rank"] < rows[(16, "first")]["bytes_to_rank0_per_rank"]
    assert [a["ranks"] for a in data["anchor"]] == [2] and data["anchor"][0]["s"] > 0
    assert "| 16 | 7B-FSDP | steady |" in (out / "scale.md").read_text()


def test_loop_stall_probe_runs_small(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps.txt"
    command = [sys.executable, str(ROOT / "benchmarks" / "loop_stalls.py"), "--tensors", "300", "--reps", "1"]
    command += ["--dir", str(tmp_path), "--out", str(dumps), "--deadline-ms", "1"]
    out = subprocess.run(command, check=True, timeout=300, capture_output=True, text=True).stdout
    assert "save #0" in out and "load #0" in out and "largest gap" in out
    assert "Thread 0x" in dumps.read_text()  # a 1 ms deadline is always missed: dumps were written


def test_object_storage_benchmark_runs_small(tmp_path: Path) -> None:
    out = run_bench("bench_remote.py", tmp_path, "--size", "16MiB", "--reps", "1", "--saves", "1")
    data = json.loads((out / "remote.json").read_text())
    assert {"aiosnap.save(url)", "peer: boto3 upload_file", "peer: s3fs put_file"} <= set(data["upload"])
    assert {"aiosnap.load(url)", "peer: boto3 download_file"} <= set(data["download"])
    assert "tiered, the previous upload running" in data["tiered"]
    rows = [row for phase in ("upload", "download", "tiered") for row in data[phase].values()]
    assert all(row["median"] > 0 for row in rows)


def test_publishing_replaces_only_its_own_section(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _harness import publish
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nProse a person wrote.\n")
    publish("main", "main table, run 1", docs)
    publish("ranks", "ranks table", docs)
    publish("main", "main table, run 2", docs)
    page = docs.read_text()
    assert page.startswith("# Benchmarks\n\nProse a person wrote.\n")
    assert "run 1" not in page and page.count("main table, run 2") == 1
    assert page.index("main table, run 2") < page.index("ranks table")  # kept in its place


@pytest.mark.slow  # CI's budget, as above
def test_incremental_benchmark_runs_small(tmp_path: Path) -> None:
    out = run_bench("bench_incremental.py", tmp_path, "--size", "16MiB", "--saves", "3", "--rows", "20000")
    data = json.loads((out / "incremental.json").read_text())
    assert data["lora"]["restored_bit_equal"] and data["lora"]["restored_after_retention"]
    assert "bytes written per save" in (out / "incremental.md").read_text()
    # A restart: its first save reads the frozen base back once, the next save nothing.
    for run in data["lora"]["restart"].values():
        read = [run[k]["blob_bytes_read"] for k in ("without", "first", "next")]
        assert read == [0, data["lora"]["base_bytes"], 0]
    assert "first save after a restart" in (out / "incremental.md").read_text()


def test_dcp_benchmark_runs_small(tmp_path: Path) -> None:
    out = run_bench("bench_dcp.py", tmp_path, "--size", "16MiB", "--reps", "1", "--ranks", "1")
    (row,) = json.loads((out / "dcp.json").read_text())["rows"]
    assert row["ranks"] == 1 and row["ratio"] > 0 and all(s > 0 for s in row["median_s"].values())
    assert "AiosnapStorageWriter" in (out / "dcp.md").read_text()


@pytest.mark.slow  # two 2-process jobs, each importing its framework
def test_integrations_ranks_benchmark_runs_small(tmp_path: Path) -> None:
    out = run_bench("bench_ranks_hf_accelerate.py", tmp_path, "--size", "8MiB", "--reps", "1")
    data = json.loads((out / "ranks_hf_accelerate.json").read_text())
    assert data["nproc"] == 2 and sorted(data["results"]) == ["accelerate", "hf"]
    for ranks in data["results"].values():
        assert sorted(ranks) == ["0", "1"]
        assert all(t > 0 for times in ranks.values() for series in times.values() for t in series)
