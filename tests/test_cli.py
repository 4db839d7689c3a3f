"""The command line: every subcommand through its real entry point (``python -m aiosnap``,
with the sources this test imports), golden outputs with temp paths and times
normalised, exit codes 0/1/2 and one-line errors. Further cases call ``main`` in this
process, which is what the entry point runs."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

import aiosnap
from aiosnap.cli import main

from .test_distributed import run_ranks

SRC = str(Path(aiosnap.__file__).resolve().parent.parent)
ROOT = Path(__file__).resolve().parent.parent
NAME = "ckpt-e{epoch}-s{step}"
COLUMNS = "100"
#: Expected outputs, one file each. To rewrite them from what the command line prints now
#: (after a deliberate change of an output), run
#:     AIOSNAP_REGOLDEN=1 pytest tests/test_cli.py
#: and read the change with `git diff tests/golden`: every other run compares.
GOLDEN = Path(__file__).resolve().parent / "golden"


def start(*args: str) -> subprocess.Popen[str]:
    """``python -m aiosnap ARGS`` in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "AIOSNAP_DEBUG")}
    env |= {"PYTHONPATH": SRC, "COLUMNS": COLUMNS}
    command = [sys.executable, "-m", "aiosnap", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(process: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    out, err = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return finish(start(*args))


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``main(ARGS)`` in this process: (exit code, stdout, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", COLUMNS)
    monkeypatch.delenv("FORCE_COLOR", raising=False)


def normal(text: str, *paths: Path) -> str:
    """Temp paths as <dir>, local times as a placeholder of their width."""
    for path in paths:
        text = text.replace(str(path), "<dir>")
    return re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", "YYYY-MM-DD hh:mm:ss", text)


def golden(name: str, text: str) -> None:
    """``text`` is what ``tests/golden/NAME.txt`` holds (see GOLDEN)."""
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("AIOSNAP_REGOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name}: the output differs from tests/golden/{name}.txt"


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("aiosnap: error: "), err
    assert "Traceback" not in err
    return lines[0]


def state(step: int) -> dict[str, Any]:
    return {
        "model": {
            "weight": torch.arange(6.0).reshape(2, 3) * step,
            "bias": torch.zeros(3, dtype=torch.bfloat16),
        },
        "step": step,
        "rng": np.arange(4),
    }


async def _save_run(directory: Path, steps: list[int], **options: Any) -> None:
    async with aiosnap.CheckpointManager(str(directory), name=NAME, **options) as manager:
        for i, step in enumerate(steps):
            metrics = {"loss": 1 / 2 ** (i + 1)}
            await (await manager.save(step, state(step), epoch=i + 1, metrics=metrics)).wait()


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(data)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 100, 200, 300 (epochs 1-3); step 300's file is damaged, and a restore has
    marked it corrupt in the index."""
    directory = tmp_path_factory.mktemp("run")
    anyio.run(_save_run, directory, [100, 200, 300])
    _flip_last_byte(directory / "ckpt-e3-s300")

    async def restore() -> None:
        async with aiosnap.CheckpointManager(str(directory), name=NAME) as manager:
            assert (await manager.restore()).step == 200

    anyio.run(restore)
    return directory


@pytest.fixture(scope="module")
def runs(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The runs through the real entry point, started together: most of each one's time
    is the new process importing torch. Each test checks its own."""
    pt = tmp_path_factory.mktemp("pt")
    torch.save({"model": torch.nn.Linear(3, 2).state_dict()}, pt / "model.pt")
    bench = tmp_path_factory.mktemp("bench")
    started = {
        "ls": start("ls", str(run_dir)),  # the name (with {epoch}) is read off the index
        "inspect": start("inspect", str(run_dir / "ckpt-e1-s100")),
        "verify": start("verify", str(run_dir)),
        "diff": start("diff", str(run_dir / "ckpt-e1-s100"), str(run_dir / "ckpt-e2-s200")),
        "convert": start("convert", str(pt / "model.pt"), str(pt / "model.snap")),
        "bench": start("bench", "--dir", str(bench), "--size", "1MiB", "--reps", "1", "--json"),
    }
    return {name: finish(p) for name, p in started.items()} | {"pt": pt, "bench_dir": bench}


# -- ls ----------------------------------------------------------------------------------------------

LS_GOLDEN = """\
┏━━━━━━┳━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┓
┃ step ┃ epoch ┃ saved               ┃ size    ┃ metrics    ┃ status                               ┃
┡━━━━━━╇━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┩
│ 100  │ 1     │ YYYY-MM-DD hh:mm:ss │ 4.1 KiB │ loss=0.5   │                                      │
│ 200  │ 2     │ YYYY-MM-DD hh:mm:ss │ 4.1 KiB │ loss=0.25  │ latest                               │
│ 300  │ 3     │ YYYY-MM-DD hh:mm:ss │ 4.1 KiB │ loss=0.125 │ corrupt: checksum mismatch in tensor │
│      │       │                     │         │            │ 'rng'                                │
└──────┴───────┴─────────────────────┴─────────┴────────────┴──────────────────────────────────────┘
3 checkpoint(s) in <dir>; latest: step 200
"""


def test_ls_shows_steps_epochs_times_sizes_metrics_the_latest_and_corrupt_marks(
    run_dir: Path, runs: dict[str, Any]
) -> None:
    done = runs["ls"]
    assert (done.returncode, done.stderr) == (0, "")
    assert normal(done.stdout, run_dir) == LS_GOLDEN


def test_ls_json_and_the_remote_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    remote = f"memory://cli-tier-{uuid.uuid4().hex}/run"  # fsspec's memory store is process-wide
    anyio.run(functools.partial(_save_run, tmp_path, [1, 2], remote=remote))
    (tmp_path / "ckpt-e2-s2").unlink()  # only the remote tier holds step 2 now
    code, out, _ = cli(capsys, "ls", str(tmp_path), "--remote", remote, "--json")
    listed = json.loads(out)
    assert code == 0 and listed["name"] == NAME and listed["latest"] == 1
    rows = {r["step"]: r for r in listed["checkpoints"]}
    assert (rows[1]["local"], rows[1]["uploaded"], rows[1]["bytes"] > 4096) == (True, True, True)
    assert (rows[2]["local"], rows[2]["uploaded"]) == (False, True)
    code, out, _ = cli(capsys, "ls", str(tmp_path), "--remote", remote)
    assert "remote only" in out and "uploaded" in out


def test_library_warnings_are_one_line_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    anyio.run(_save_run, tmp_path, [1])
    (tmp_path / "aiosnap-index.json").write_text("{not json")
    code, out, err = cli(capsys, "ls", str(tmp_path), "--name", NAME)
    assert code == 0 and "│ 1    │ 1     │ -  " in out  # the index is lost: the time is unknown
    assert err.startswith("aiosnap: warning: index ") and len(err.splitlines()) == 1


# -- inspect -------------------------------------------------------------------------------------------


def test_inspect_shows_the_tree_with_dtypes_shapes_sizes_and_checksums(
    run_dir: Path, runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(run_dir / "ckpt-e1-s100")
    done = runs["inspect"]
    assert (done.returncode, done.stderr) == (0, "")
    code, out, _ = cli(capsys, "inspect", path, "--json")
    described = json.loads(out)
    golden("inspect", normal(done.stdout, run_dir).replace(described["crc32c"], "<header crc32c>"))
    assert (code, described["format"], described["tensors"]) == (0, "aiosnap", 3)
    by_path = {e["path"]: e for e in described["entries"]}
    assert by_path["model.weight"] == {
        "path": "model.weight",
        "kind": "tensor",
        "dtype": "float32",
        "shape": [2, 3],
        "bytes": 24,
        "crc32c": "129ab1e7",
    }
    assert by_path["step"] == {"path": "step", "kind": "int", "value": 100}


async def _save_steps(rank: int, world: int, directory: str) -> None:
    async with aiosnap.CheckpointManager(directory) as manager:
        for step in (1, 2):
            await (await manager.save(step, state(step))).wait()


def _step_dirs(directory: Path) -> None:
    """Checkpoints as a group writes them: step directories, by a group of one."""
    assert run_ranks(1, _save_steps, str(directory)) == {0: None}


def test_inspect_a_step_directory_lists_its_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _step_dirs(tmp_path)
    code, out, _ = cli(capsys, "inspect", str(tmp_path / "snapshot_iter_2"), "--json")
    described = json.loads(out)
    assert (code, described["format"], described["step"]) == (0, "aiosnap step (1 rank)", 2)
    assert [f["name"] for f in described["files"]] == ["rank_00000"]
    assert [e["path"] for e in described["entries"]] == ["model.weight", "model.bias", "step", "rng"]
    code, out, _ = cli(capsys, "verify", str(tmp_path))  # a directory of step directories
    assert code == 0 and out.count("checksums match") == 2 and "2 checkpoint(s)" in out


def test_names_from_a_file_are_shown_as_they_are(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    aiosnap.save_sync(str(tmp_path / "c"), {"[bold]x[/bold]": torch.zeros(1), "[red]": "[/]"})
    code, out, _ = cli(capsys, "inspect", str(tmp_path / "c"))
    assert code == 0 and "[bold]x[/bold]" in out and "'[/]'" in out


# -- verify --------------------------------------------------------------------------------------------

VERIFY_GOLDEN = """\
ok      <dir>/ckpt-e1-s100 (stored: 3 tensor(s), 62 B of data; checksums match)
ok      <dir>/ckpt-e2-s200 (stored: 3 tensor(s), 62 B of data; checksums match)
FAILED  <dir>/ckpt-e3-s300: checksum mismatch in tensor 'rng'
3 checkpoint(s) in <dir>: 1 of 3 FAILED
"""


def test_verify_checks_every_step_of_a_directory_and_names_what_failed(
    run_dir: Path, runs: dict[str, Any]
) -> None:
    done = runs["verify"]
    assert (done.returncode, done.stderr) == (1, "")  # no terminal: no progress bar
    assert normal(done.stdout, run_dir) == VERIFY_GOLDEN


def test_verify_one_checkpoint(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "verify", str(run_dir / "ckpt-e2-s200"))
    assert code == 0 and out.startswith("ok ")
    damaged = tmp_path / "two-bad-entries"
    data = bytearray((run_dir / "ckpt-e2-s200").read_bytes())
    data[-1] ^= 1  # rng
    data[-40] ^= 1  # model.weight
    damaged.write_bytes(data)
    code, out, _ = cli(capsys, "verify", str(damaged))
    assert code == 1 and "checksum mismatch in tensors 'model.weight', 'rng'" in out


def test_verify_reports_progress_in_bytes(run_dir: Path, tmp_path: Path) -> None:
    _step_dirs(tmp_path)
    for path in (run_dir / "ckpt-e1-s100", tmp_path / "snapshot_iter_1"):
        seen: list[tuple[int, int]] = []
        aiosnap.verify_sync(str(path), progress=lambda done, total, seen=seen: seen.append((done, total)))
        size = sum(p.stat().st_size for p in [path, *path.glob("rank_*")] if p.is_file())
        assert seen[-1] == (size, size) and seen == sorted(seen)


# -- diff ----------------------------------------------------------------------------------------------

DIFF_GOLDEN = """\
┏━━━━━━━━━┳━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┓
┃         ┃ entry        ┃ detail                                    ┃
┡━━━━━━━━━╇━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┩
│ changed │ model.weight │ max abs 500, rel 0.5, 5/6 elements differ │
│ changed │ step         │ int 100 -> int 200                        │
└─────────┴──────────────┴───────────────────────────────────────────┘
0 added, 0 removed, 2 changed, 0 close, 2 equal
"""


def test_diff_says_what_changed_and_by_how_much(runs: dict[str, Any]) -> None:
    done = runs["diff"]
    assert (done.returncode, done.stderr) == (1, "")
    assert done.stdout == DIFF_GOLDEN


def test_diff_added_removed_close_and_equal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    x, nan = torch.linspace(-1, 1, 8), torch.tensor([float("nan")])
    aiosnap.save_sync(str(a), {"x": x, "gone": 1, "same": [1, 2], "nan": nan})
    aiosnap.save_sync(str(b), {"x": x + 1e-4, "new": "yes", "same": [1, 2], "nan": nan.clone()})
    code, out, _ = cli(capsys, "diff", str(a), str(b), "--json")
    entries = {e["path"]: e for e in json.loads(out)["entries"]}
    assert code == 1
    assert {p: e["status"] for p, e in entries.items()} == {
        "x": "changed",
        "gone": "removed",
        "same.0": "equal",
        "same.1": "equal",
        "nan": "equal",
        "new": "added",
    }
    assert entries["x"]["max_abs"] == pytest.approx(1e-4, rel=0.1) and entries["x"]["differing"] == 8
    assert entries["x"]["max_rel"] == pytest.approx(1e-4, rel=0.1)
    code, out, _ = cli(capsys, "diff", str(a), str(a))
    assert (code, out) == (0, "0 added, 0 removed, 0 changed, 0 close, 5 equal\n")
    aiosnap.save_sync(str(b), {"x": x + 1e-4, "gone": 1, "same": [1, 2], "nan": nan})
    code, out, _ = cli(capsys, "diff", str(a), str(b), "--atol", "1e-3")
    assert code == 0 and out.endswith("0 added, 0 removed, 0 changed, 1 close, 4 equal\n")


# -- prune ---------------------------------------------------------------------------------------------

PRUNE_GOLDEN = """\
┏━━━━━━┳━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━━━┓
┃ step ┃ epoch ┃ saved               ┃ size    ┃ metrics    ┃
┡━━━━━━╇━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━━━┩
│ 2    │ 2     │ YYYY-MM-DD hh:mm:ss │ 4.1 KiB │ loss=0.25  │
│ 3    │ 3     │ YYYY-MM-DD hh:mm:ss │ 4.1 KiB │ loss=0.125 │
└──────┴───────┴─────────────────────┴─────────┴────────────┘
{verb} 2 checkpoint(s) (8.1 KiB); keeping steps 1, 4, 5
"""


def test_prune_applies_retention_and_a_dry_run_removes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anyio.run(_save_run, tmp_path, [1, 2, 3, 4, 5])
    policy = ["--keep-last", "2", "--keep-best", "loss", "--best-mode", "max"]  # 1 has the largest loss
    code, out, _ = cli(capsys, "prune", str(tmp_path), *policy, "--dry-run")
    assert code == 0 and normal(out) == PRUNE_GOLDEN.format(verb="would remove")
    assert len(list(tmp_path.glob("ckpt-*"))) == 5
    code, out, _ = cli(capsys, "prune", str(tmp_path), *policy)
    assert code == 0 and normal(out) == PRUNE_GOLDEN.format(verb="removed")
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-e1-s1", "ckpt-e4-s4", "ckpt-e5-s5"]
    code, _, err = cli(capsys, "prune", str(tmp_path))
    assert code == 2 and "say what to keep" in err


def test_the_manager_methods_under_prune_and_ls(tmp_path: Path) -> None:
    anyio.run(_save_run, tmp_path, [1, 2, 3])

    async def check() -> None:
        async with aiosnap.CheckpointManager(str(tmp_path), name=NAME, read_only=True) as reader:
            assert [r.step for r in await reader.records()] == [1, 2, 3]
            assert await reader.prune(dry_run=True) == []  # no policy: nothing goes
            with pytest.raises(aiosnap.errors.CheckpointError, match="read-only"):
                await reader.prune()
        keep = aiosnap.retention.KeepLast(1)
        async with aiosnap.CheckpointManager(str(tmp_path), name=NAME, keep=keep) as manager:
            assert [r.step for r in await manager.prune(dry_run=True)] == [1, 2]
            assert [r.step for r in await manager.prune()] == [1, 2]
            assert await manager.steps() == [3] and await manager.prune() == []

    anyio.run(check)


def test_prune_fails_clearly_while_training_holds_the_directory(tmp_path: Path) -> None:
    anyio.run(_save_run, tmp_path, [1, 2])

    async def prune_while_training() -> subprocess.CompletedProcess[str]:
        async with aiosnap.CheckpointManager(str(tmp_path), name=NAME):
            return await anyio.to_thread.run_sync(run, "prune", str(tmp_path), "--keep-last", "1")

    done = anyio.run(prune_while_training)
    line = one_error_line(done.stderr)
    assert done.returncode == 2 and "in use by another CheckpointManager" in line and "--dry-run" in line
    assert len(list(tmp_path.glob("ckpt-*"))) == 2


# -- convert -------------------------------------------------------------------------------------------


def test_convert_a_torch_save_file_needs_the_pickle_opt_in(
    runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    done = runs["convert"]
    assert (done.returncode, done.stdout) == (2, "")
    line = normal(one_error_line(done.stderr), runs["pt"])
    assert line == (
        "aiosnap: error: <dir>/model.pt is a torch.save file: reading it runs pickled code from the file; "
        "pass --allow-pickle if you trust it"
    )
    model = torch.nn.Linear(3, 2)
    torch.save({"model": model.state_dict(), "epoch": 3}, tmp_path / "model.pt")
    src, dst = str(tmp_path / "model.pt"), str(tmp_path / "model.snap")
    code, out, _ = cli(capsys, "convert", src, dst, "--allow-pickle")
    assert code == 0
    assert (
        normal(out, tmp_path)
        == "<dir>/model.pt (torch.save) -> <dir>/model.snap (aiosnap): 2 tensor(s), 32 B\n"
    )
    loaded = aiosnap.load_sync(str(tmp_path / "model.snap"))
    assert loaded["epoch"] == 3 and torch.equal(loaded["model"]["weight"], model.weight.detach())
    code, _, err = cli(capsys, "convert", src, dst, "--allow-pickle")
    assert code == 2 and "--force" in one_error_line(err)


def test_convert_to_plain_safetensors(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors import safe_open

    out_path = tmp_path / "flat.safetensors"
    code, _, _ = cli(capsys, "convert", str(run_dir / "ckpt-e2-s200"), str(out_path))
    assert code == 0
    with safe_open(str(out_path), "pt") as f:
        assert set(f.keys()) == {"model.weight", "model.bias", "rng"}
        assert torch.equal(f.get_tensor("model.weight"), state(200)["model"]["weight"])
        assert f.get_tensor("model.bias").dtype == torch.bfloat16
        meta = f.metadata()
    assert set(meta) == {"format", "aiosnap_tree"} and meta["format"] == "pt"
    assert json.loads(meta["aiosnap_tree"])["items"][1] == ["step", 200]  # the tree, plain values in it
    # aiosnap.load reads it as any safetensors file: its tensors, by name
    assert set(aiosnap.load_sync(str(out_path))) == {"model.weight", "model.bias", "rng"}
    code, out, _ = cli(capsys, "verify", str(out_path))
    assert code == 0 and "plain safetensors, no checksums" in out


def test_convert_a_step_directory_to_one_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _step_dirs(tmp_path)
    one = tmp_path / "one.snap"
    code, out, _ = cli(capsys, "convert", str(tmp_path / "snapshot_iter_2"), str(one))
    assert code == 0 and "(aiosnap step)" in out
    code, _, _ = cli(capsys, "diff", str(tmp_path / "snapshot_iter_2"), str(one))
    assert code == 0


def test_convert_to_dcp_and_back(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, dcp_dir, back = run_dir / "ckpt-e2-s200", tmp_path / "dcp", tmp_path / "back.snap"
    code, _, _ = cli(capsys, "convert", str(source), str(dcp_dir), "--to", "dcp")
    assert code == 0 and (dcp_dir / ".metadata").exists()
    code, _, err = cli(capsys, "convert", str(dcp_dir), str(back))
    assert code == 2 and ".metadata is a pickle" in one_error_line(err)
    code, out, _ = cli(capsys, "convert", str(dcp_dir), str(back), "--allow-pickle")
    assert code == 0 and "(dcp)" in out
    code, _, _ = cli(capsys, "diff", str(source), str(back))
    assert code == 0


# -- bench ---------------------------------------------------------------------------------------------


def test_bench_measures_the_disk_it_is_given(runs: dict[str, Any]) -> None:
    done = runs["bench"]
    assert (done.returncode, done.stderr) == (0, "")
    report = json.loads(done.stdout)
    assert report["bytes"] >= 1 << 20 and report["reps"] == 1
    methods = {r["method"]: r for r in report["results"]}
    assert {
        "disk: write + fsync",
        "torch.save + fsync",
        "aiosnap QueueWriter (open)",
        "aiosnap.load (cold)",
    } <= set(methods)
    assert all(0 < r["stall_s"] <= r["total_s"] for r in methods.values())
    assert list(runs["bench_dir"].iterdir()) == []  # the scratch directory is gone


# -- bad input -----------------------------------------------------------------------------------------


def test_a_missing_path_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("ls", "inspect", "verify", "prune", "convert"):
        extra = {"prune": ["--keep-last", "1"], "convert": [str(tmp_path / "out")]}.get(command, [])
        code, out, err = cli(capsys, command, str(tmp_path / "nothing"), *extra)
        assert (code, out) == (2, "")
        line = normal(one_error_line(err), tmp_path)
        assert line == "aiosnap: error: <dir>/nothing: no such file or directory"


@pytest.mark.parametrize(
    ("command", "content", "expected"),
    [
        ("inspect", b"\x93NUMPY\x01\x00", "read it with numpy.load"),
        ("verify", b"\x93NUMPY\x01\x00", "read it with numpy.load"),
        ("inspect", b"hello, world, not a checkpoint", "not an aiosnap or safetensors checkpoint"),
        ("diff", (8).to_bytes(8, "little") + b'{"a": 1}', "tensor 'a': malformed entry"),
        ("ls", b"a file", "is a file, not a directory of checkpoints"),
        ("prune", b"a file", "is a file, not a directory of checkpoints"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, content: bytes, expected: str
) -> None:
    path = tmp_path / "input"
    path.write_bytes(content)
    extra = {"diff": [str(path)], "prune": ["--keep-last", "1"]}.get(command, [])
    code, out, err = cli(capsys, command, str(path), *extra)
    assert (code, out) == (2, "")
    assert expected in one_error_line(err)


def test_help_usage_errors_and_the_console_script(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = cli(capsys, "--help")
    assert code == 0
    for command in ("ls", "inspect", "verify", "diff", "prune", "convert", "bench"):
        assert re.search(rf"│ {command} ", out), command
    code, _, err = cli(capsys, "ls")
    assert code == 2 and "Missing argument" in err and "Traceback" not in err
    code, _, err = cli(capsys, "diff", "a", "b", "--bogus")
    assert code == 2 and "No such option: --bogus" in err
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"aiosnap": "aiosnap.cli:main"}  # what `python -m aiosnap` runs too
