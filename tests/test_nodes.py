"""A group whose ranks do not share one directory: node-local directories (issue 43).

Four real gloo ranks as two "nodes": ranks 0-1 pass directory A, ranks 2-3 directory B
(per-rank directories stand in for each machine's own disk), with a moto S3 remote
tier. Each node must hold the kept steps whole (its ranks' files and the manifest), be
swept and rotated by its own leader, and a resume must read nothing remotely.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import torch

import aiosnap
from aiosnap._dist.decisions import Refused
from aiosnap._format.manifest import MANIFEST_NAME, Manifest, node_runs, read_manifest
from aiosnap._manager.nodes import PROBE_PREFIX, Nodes, _write_probe, decide_nodes, sweep_probes
from aiosnap._manager.replicas import Replicator, covered, moves, partners
from aiosnap._storage.local import LocalStorage
from aiosnap._storage.protocol import Entry

from . import servers
from .integration_runs import JOB_CAP, ROOT
from .test_distributed import ok, run_ranks

WORLD = 4


def node_dir(root: str, rank: int) -> str:
    return os.path.join(root, "node-a" if rank < 2 else "node-b")


def state_of(rank: int, step: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(64, dtype=torch.float32) + step},
        "mine": torch.full((8,), float(rank * 100 + step)),
    }


async def _train(rank: int, world: int, root: str, remote: str, env: dict[str, str]) -> Any:
    os.environ.update(env)
    async with aiosnap.CheckpointManager(
        node_dir(root, rank),
        remote=remote,
        ranks=aiosnap.Ranks(replicated=["model"], timeout=60),
        keep=aiosnap.retention.KeepLast(2),
    ) as mgr:
        for step in (1, 2, 3, 4):
            await mgr.save(step, state_of(rank, step))
        await mgr.flush()
        return {
            "steps": await mgr.steps(),
            "latest": await mgr.latest_step(),
            "remote": await mgr.remote_steps(),
        }


async def _resume(
    rank: int, world: int, root: str, remote: str, env: dict[str, str], wait: float = 30
) -> Any:
    os.environ.update(env)
    async with aiosnap.CheckpointManager(
        node_dir(root, rank),
        # Down, the remote tier would get the newest local step at once (a catch-up),
        # and the close wait upload_timeout for it: this run uploads only if asked.
        remote=aiosnap.Remote(remote, timeout=wait, upload="every" if wait >= 30 else "manual"),
        ranks=aiosnap.Ranks(replicated=["model"], timeout=60),
    ) as mgr:
        steps = await mgr.steps()
        restored = await mgr.restore()
    mine = float(restored.state["mine"][0])
    return {"steps": steps, "step": restored.step, "path": restored.path, "mine": mine}


async def _while_down(rank: int, world: int, root: str, remote: str, env: dict[str, str], up: bool) -> Any:
    """Saves with the remote tier down (``up`` False: its close gives up on the uploads), or
    an open with it up again, which catches up and restores from the nodes."""
    os.environ.update(env)
    async with aiosnap.CheckpointManager(
        node_dir(root, rank),
        remote=aiosnap.Remote(remote, timeout=1.0),
        ranks=aiosnap.Ranks(replicated=["model"], timeout=60),
        keep=aiosnap.retention.KeepLast(2),
    ) as mgr:
        if not up:
            for step in (5, 6):
                await (await mgr.save(step, state_of(rank, step))).wait()
            steps = await mgr.steps()
            with pytest.raises(aiosnap.errors.RemoteStorageError):
                await mgr.aclose(upload_timeout=1.0)
            return {"steps": steps}
        await mgr.flush()  # the catch-up: the newest local step, uploaded
        restored = await mgr.restore()
        return {"remote": await mgr.remote_steps(), "step": restored.step, "path": restored.path}


def _listing(directory: str) -> dict[str, list[str]]:
    return {
        name: sorted(os.listdir(os.path.join(directory, name)))
        for name in sorted(os.listdir(directory))
        if os.path.isdir(os.path.join(directory, name))
    }


def _read_remotely(since: int) -> list[str]:
    """The checkpoint objects (rank files, manifests) the remote served since ``since``."""
    return [p for m, p in servers.REQUESTS[since:] if m == "GET" and ("/rank_" in p or MANIFEST_NAME in p)]


def _cli(*args: str) -> tuple[int, str, str]:
    """The ``aiosnap`` command in a process of its own: (exit code, stdout, stderr)."""
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "aiosnap", *args], capture_output=True, text=True, env=env)
    return done.returncode, done.stdout, done.stderr


def _files_read_remotely(since: int) -> set[str]:
    """``_read_remotely``'s objects, as "step directory/file"."""
    return {"/".join(p.rsplit("/", 2)[-2:]) for p in _read_remotely(since)}


def test_each_node_holds_its_kept_steps_whole_and_a_resume_reads_nothing_remotely(
    s3: Any, tmp_path: Path
) -> None:
    root, remote = str(tmp_path), f"s3://{s3.bucket()}/run"
    results = run_ranks(WORLD, _train, root, remote, s3.env)
    ok(results, WORLD)
    for r in results.values():  # every rank lists what every node holds
        assert r == {"steps": [3, 4], "latest": 4, "remote": [3, 4]}, results
    for node, ranks in (("node-a", (0, 1)), ("node-b", (2, 3))):
        held = _listing(os.path.join(root, node))
        want = sorted([MANIFEST_NAME, *(f"rank_{r:05d}" for r in ranks)])
        # The kept steps, whole, rotated by the node's own leader; no probe, no temp file.
        assert {k: v for k, v in held.items() if k.startswith("snapshot")} == {
            "snapshot_iter_3": want,
            "snapshot_iter_4": want,
        }, (node, held)
        assert not [n for n in os.listdir(os.path.join(root, node)) if n.startswith(".aiosnap-tmp")], node

    # Each node's directory holds its ranks' files: the CLI verifies and shows those.
    for node, ranks in (("node-a", "0-1"), ("node-b", "2-3")):
        step_dir = os.path.join(root, node, "snapshot_iter_4")
        assert read_manifest(LocalStorage(), step_dir).nodes == [[0, 2], [2, 2]]
        code, out, _ = _cli("verify", step_dir)
        assert code == 0 and f"the node of ranks {ranks}: 2 of the step's 4 files" in out, out
        code, out, _ = _cli("inspect", step_dir)
        assert code == 0 and f"the node of ranks {ranks}" in out and "mine" in out, out
        assert ("rank_00001" in out, "rank_00002" in out) == (
            (True, False) if ranks == "0-1" else (False, True)
        )

    since = len(servers.REQUESTS)
    results = run_ranks(WORLD, _resume, root, remote, s3.env)
    ok(results, WORLD)
    for rank, r in results.items():
        assert r["steps"] == [3, 4] and r["step"] == 4, results
        assert r["path"] == os.path.join(node_dir(root, rank), "snapshot_iter_4")
        assert r["mine"] == rank * 100 + 4
    assert _read_remotely(since) == []

    # The remote tier gone (nothing listens at its endpoint): the group goes on from the
    # nodes once rank 0 found it unavailable (Remote(timeout=...): here 1 s, not 30).
    down = {**s3.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{servers.free_port()}"}
    results = run_ranks(WORLD, _resume, root, remote, down, 1.0)
    ok(results, WORLD)
    assert all(r["step"] == 4 and r["mine"] == rank * 100 + 4 for rank, r in results.items()), results

    # A file on node B fails its checksum (no replica here): the same step from the nodes,
    # that file alone read from the remote, and node B's copy mended.
    damaged = Path(root, "node-b", "snapshot_iter_4", "rank_00003")
    good = damaged.read_bytes()
    data = bytearray(good)
    data[-1] ^= 0x01
    damaged.write_bytes(bytes(data))
    since = len(servers.REQUESTS)
    results = run_ranks(WORLD, _resume, root, remote, s3.env)
    ok(results, WORLD)
    for rank, r in results.items():
        assert r["step"] == 4 and r["path"] == os.path.join(node_dir(root, rank), "snapshot_iter_4"), results
        assert r["mine"] == rank * 100 + 4, results
    assert _files_read_remotely(since) == {"snapshot_iter_4/rank_00003"}
    assert damaged.read_bytes() == good

    # A file node A lost: the same, from the remote (no older step, no other file read).
    lost = Path(root, "node-a", "snapshot_iter_4", "rank_00001")
    kept = lost.read_bytes()
    lost.unlink()
    since = len(servers.REQUESTS)
    results = run_ranks(WORLD, _resume, root, remote, s3.env)
    ok(results, WORLD)
    assert all(r["step"] == 4 and r["path"].startswith(root) for r in results.values()), results
    assert _files_read_remotely(since) == {"snapshot_iter_4/rank_00001"}
    assert lost.read_bytes() == kept

    # The remote tier down while the group saves: the saves go on on the nodes; when it
    # answers again, the next open uploads the newest step from the nodes' files.
    results = run_ranks(WORLD, _while_down, root, remote, down, False)
    ok(results, WORLD)
    assert all(r == {"steps": [5, 6]} for r in results.values()), results
    results = run_ranks(WORLD, _while_down, root, remote, s3.env, True)
    ok(results, WORLD)
    for rank, r in results.items():
        assert r == {
            "remote": [3, 4, 6],
            "step": 6,
            "path": os.path.join(node_dir(root, rank), "snapshot_iter_6"),
        }


async def _local_run(rank: int, world: int, root: str, steps: list[int]) -> Any:
    async with aiosnap.CheckpointManager(
        node_dir(root, rank),
        ranks=aiosnap.Ranks(replicated=["model"], timeout=60),
        keep=aiosnap.retention.KeepLast(3),
    ) as mgr:
        listed = await mgr.steps()
        restored = await mgr.restore() if listed else None
        for step in steps:
            await mgr.save(step, state_of(rank, step))
        await mgr.flush()
        after = await mgr.steps()
    return {
        "before": listed,
        "after": after,
        "restored": None if restored is None else [restored.step, float(restored.state["mine"][0])],
    }


def test_a_node_missing_a_manifest_gets_it_back_and_one_missing_a_step_is_not_listed(tmp_path: Path) -> None:
    root = str(tmp_path)
    ok(run_ranks(WORLD, _local_run, root, [1, 2, 3]), WORLD)
    b = os.path.join(root, "node-b")
    # A crash between rank 0's commit and node B's: B holds step 3's files, not its manifest.
    os.remove(os.path.join(b, "snapshot_iter_3", MANIFEST_NAME))
    shutil.rmtree(os.path.join(b, "snapshot_iter_2"))  # node B lost step 2
    results = run_ranks(WORLD, _local_run, root, [4])
    ok(results, WORLD)
    for rank, r in results.items():
        # Step 3 is whole again on B (its files kept, not swept as an unfinished save's);
        # step 2 is not listed: its files of ranks 2 and 3 are on no node.
        assert r["before"] == [1, 3] and r["restored"] == [3, rank * 100 + 3], results
        # Rank 0 keeps [2, 3, 4] (KeepLast(3)); node B follows it: its step 1 goes.
        assert r["after"] == [3, 4], results
    assert sorted(os.listdir(os.path.join(b, "snapshot_iter_3"))) == [
        MANIFEST_NAME,
        "rank_00002",
        "rank_00003",
    ]
    assert sorted(n for n in os.listdir(b) if n.startswith("snapshot")) == [
        "snapshot_iter_3",
        "snapshot_iter_4",
    ]
    a = os.path.join(root, "node-a")
    assert sorted(n for n in os.listdir(a) if n.startswith("snapshot")) == [
        f"snapshot_iter_{s}" for s in (2, 3, 4)
    ]


def test_ranks_sharing_a_directory_by_another_path_are_one_node(tmp_path: Path) -> None:
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "node-a"))
    os.symlink(os.path.join(root, "node-a"), os.path.join(root, "node-b"))  # one disk, two names
    ok(run_ranks(WORLD, _local_run, root, [1, 2]), WORLD)
    held = _listing(os.path.join(root, "node-a"))
    assert held == {
        f"snapshot_iter_{s}": [MANIFEST_NAME, *(f"rank_{r:05d}" for r in range(WORLD))] for s in (1, 2)
    }
    shutil.rmtree(os.path.join(root, "node-a"))


# -- replicas on a partner node ---------------------------------------------------------------
async def _replicated(
    rank: int, world: int, root: str, steps: list[int], victim: int = -1, remote: str = "", env: Any = None
) -> Any:
    os.environ.update(env or {})
    if rank == victim:  # dies in the middle of taking its partner's replica
        from aiosnap._dist import peers

        taking = peers.recv_file

        async def dying(*args: Any, **kwargs: Any) -> int:
            return await taking(*args, **kwargs, on_piece=lambda _: os.kill(os.getpid(), signal.SIGKILL))

        peers.recv_file = dying  # type: ignore[assignment]
    ranks = aiosnap.Ranks(replicated=["model"], timeout=20, replicas=1)
    async with aiosnap.CheckpointManager(
        node_dir(root, rank), ranks=ranks, keep=aiosnap.retention.KeepLast(2), remote=remote or None
    ) as mgr:
        restored = await mgr.restore() if await mgr.steps() else None
        try:
            for step in steps:
                await (await mgr.save(step, state_of(rank, step))).wait()
        except aiosnap.errors.RankFailedError as exc:
            return {"failed": sorted(exc.failed)}
        return None if restored is None else [restored.step, restored.path, float(restored.state["mine"][0])]


def test_each_rank_s_file_has_a_replica_on_its_partner_node_which_a_restore_uses(tmp_path: Path) -> None:
    root = str(tmp_path)
    ok(run_ranks(WORLD, _replicated, root, [1, 2]), WORLD)
    a, b = os.path.join(root, "node-a"), os.path.join(root, "node-b")
    everyone = sorted([MANIFEST_NAME, *(f"rank_{r:05d}" for r in range(WORLD))])
    for step in (1, 2):  # each node holds its ranks' files and its partners' replicas, the same bytes
        name = f"snapshot_iter_{step}"
        assert (
            sorted(os.listdir(os.path.join(a, name))) == everyone == sorted(os.listdir(os.path.join(b, name)))
        )
        for r in range(WORLD):
            assert Path(a, name, f"rank_{r:05d}").read_bytes() == Path(b, name, f"rank_{r:05d}").read_bytes()
    # The manifest records the nodes and the copies; each node's directory verifies whole.
    manifest = read_manifest(LocalStorage(), os.path.join(b, "snapshot_iter_2"))
    assert (manifest.nodes, manifest.copies) == ([[0, 2], [2, 2]], 1)
    assert manifest.holdings() == {0: [0, 1, 2, 3], 2: [0, 1, 2, 3]}
    for node in (a, b):
        report = aiosnap.verify_sync(os.path.join(node, "snapshot_iter_2"))
        assert report.tensors > 0 and report.node == "a node's directory holding every file of the step"

    lost = Path(b, "snapshot_iter_2", "rank_00002")
    kept = lost.read_bytes()
    lost.unlink()  # node B lost rank 2's file of the newest step
    with pytest.raises(aiosnap.errors.CheckpointNotFoundError, match="rank_00002 as well: not there"):
        aiosnap.verify_sync(os.path.join(b, "snapshot_iter_2"))
    results = run_ranks(WORLD, _replicated, root, [3])
    ok(results, WORLD)
    for rank, r in results.items():  # step 2 restored from the nodes: rank 2's file from node A
        assert r == [2, os.path.join(node_dir(root, rank), "snapshot_iter_2"), rank * 100 + 2], results
    assert lost.read_bytes() == kept

    shutil.rmtree(b)  # node B replaced: its disk comes back empty
    results = run_ranks(WORLD, _replicated, root, [])
    ok(results, WORLD)
    for rank, r in results.items():  # step 3, the newest, restored from the nodes all the same
        assert r == [3, os.path.join(node_dir(root, rank), "snapshot_iter_3"), rank * 100 + 3], results
    # Node B holds the kept steps whole again: its ranks' files, its partners' replicas, the
    # manifest (step 3 to restore it, step 2 right after), and indexes them.
    assert sorted(os.listdir(os.path.join(b, "snapshot_iter_3"))) == everyone
    assert sorted(os.listdir(os.path.join(b, "snapshot_iter_2"))) == everyone
    assert '"step": 2' in Path(b, "aiosnap-index.json").read_text()

    shutil.rmtree(a)  # rank 0's node replaced: its index is gone with it; node B lists the steps
    results = run_ranks(WORLD, _replicated, root, [])
    ok(results, WORLD)
    for rank, r in results.items():
        assert r == [3, os.path.join(node_dir(root, rank), "snapshot_iter_3"), rank * 100 + 3], results
    for step in (2, 3):
        name = f"snapshot_iter_{step}"
        assert sorted(os.listdir(os.path.join(a, name))) == everyone
        for f in everyone:
            assert Path(a, name, f).read_bytes() == Path(b, name, f).read_bytes(), (name, f)
    index = Path(a, "aiosnap-index.json").read_text()
    assert '"step": 2' in index and '"step": 3' in index


async def _sharded(
    rank: int, world: int, root: str, save: bool, replicas: int = 1, remote: str = "", env: Any = None
) -> Any:
    """FSDP-like state (each DTensor split over the group's ranks); ranks 0-1 on node A,
    the others on node B, whatever the group's size."""
    from tests.test_sharded import LAYOUTS, dtensors, target_spec, whole

    os.environ.update(env or {})

    names = [n for n, (_, _, spec) in LAYOUTS.items() if "," not in spec]  # a 1-D mesh of any size
    if save:
        state = {"dt": dtensors({n: LAYOUTS[n][2] for n in names}, world, fill=True)}
    else:
        state = {"dt": dtensors({n: target_spec(n).split(",")[0] for n in names}, world, fill=False)}
    ranks = aiosnap.Ranks(timeout=60, replicas=replicas)
    async with aiosnap.CheckpointManager(node_dir(root, rank), ranks=ranks, remote=remote or None) as mgr:
        if save:
            await (await mgr.save(5, state)).wait()
            return None
        restored = await mgr.restore(target=state)
    wrong = [n for n, t in state["dt"].items() if not torch.equal(t.full_tensor(), whole(n))]
    return {"step": restored.step, "path": restored.path, "wrong": wrong}


def test_a_step_of_4_ranks_on_2_nodes_with_replicas_restores_at_2_and_at_8_ranks_from_the_nodes(
    tmp_path: Path,
) -> None:
    """Each node holds every file (its ranks' and its partners' copies): a group of another
    size, resharding, reads only its own node's directory, bit for bit."""
    root = str(tmp_path)
    ok(run_ranks(WORLD, _sharded, root, True), WORLD)
    for world in (2, 8):  # 2: both on node A; 8: ranks 0-1 on A, 2-7 on B
        results = run_ranks(world, _sharded, root, False)
        ok(results, world)
        for rank, r in results.items():
            assert r == {
                "step": 5,
                "path": os.path.join(node_dir(root, rank), "snapshot_iter_5"),
                "wrong": [],
            }


def test_a_reshard_without_replicas_copies_only_the_other_node_s_files_from_the_remote(
    s3: Any, tmp_path: Path
) -> None:
    """Saved at 4 ranks on 2 nodes without replicas, restored at 2 ranks on node A: node A
    holds ranks 0-1's files; ranks 2-3's alone come from the remote tier, bit for bit."""
    root, remote = str(tmp_path), f"s3://{s3.bucket()}/run"
    ok(run_ranks(WORLD, _sharded, root, True, 0, remote, s3.env), WORLD)
    since = len(servers.REQUESTS)
    results = run_ranks(2, _sharded, root, False, 0, remote, s3.env)
    ok(results, 2)
    for rank, r in results.items():
        assert r == {"step": 5, "path": os.path.join(node_dir(root, rank), "snapshot_iter_5"), "wrong": []}
    assert _files_read_remotely(since) == {"snapshot_iter_5/rank_00002", "snapshot_iter_5/rank_00003"}


def test_a_file_that_fails_its_checksum_is_read_from_its_replica_on_the_partner_node(tmp_path: Path) -> None:
    root = str(tmp_path)
    ok(run_ranks(WORLD, _replicated, root, [1, 2]), WORLD)
    damaged = Path(root, "node-b", "snapshot_iter_2", "rank_00002")
    good = Path(root, "node-a", "snapshot_iter_2", "rank_00002").read_bytes()
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0x01  # a flipped bit in rank 2's last tensor, on node B only
    damaged.write_bytes(bytes(data))
    results = run_ranks(WORLD, _replicated, root, [])
    ok(results, WORLD)
    for rank, r in results.items():  # not an older step, nor another tier: its copy on node A
        assert r == [2, os.path.join(node_dir(root, rank), "snapshot_iter_2"), rank * 100 + 2], results
    assert damaged.read_bytes() == good
    # Both copies damaged: the group falls back to step 1, as without replicas.
    for node in ("node-a", "node-b"):
        path = Path(root, node, "snapshot_iter_2", "rank_00002")
        path.write_bytes(bytes(data))
    results = run_ranks(WORLD, _replicated, root, [])
    ok(results, WORLD)
    assert all(r[0] == 1 for r in results.values()), results


def test_a_user_s_file_directory_or_link_in_place_of_a_rank_file_is_never_replaced(tmp_path: Path) -> None:
    """A copy (from the remote tier, or a partner) replaces only a rank file aiosnap wrote
    (damaged) or none: a user's file, a directory, a link to a checkpoint file of the
    user's, or a link to nothing in its place stays as it is (the link's target too), and
    the step is read from the remote tier instead (its whole step: the local one fails).
    A load follows links, so the links were taken for a damaged or missing file and
    replaced. Each case in a run of its own: a step that failed is marked in the index."""
    strays: dict[str, Any] = {
        "a user's file": lambda place, theirs: place.write_bytes(b"a user's notes"),
        "a directory": lambda place, theirs: place.mkdir(),
        "a link to the user's checkpoint": lambda place, theirs: place.symlink_to(theirs),
        "a link to nothing": lambda place, theirs: place.symlink_to(theirs.with_name("nowhere")),
    }
    for i, (what, make) in enumerate(strays.items()):
        case = tmp_path / str(i)
        root, remote = str(case / "nodes"), str(case / "remote")
        ok(run_ranks(WORLD, _train, root, remote, {}), WORLD)
        place = Path(root, "node-b", "snapshot_iter_4", "rank_00003")
        theirs = case / "theirs"  # a checkpoint file of the user's: not the step's bytes
        theirs.write_bytes(Path(root, "node-b", "snapshot_iter_3", "rank_00003").read_bytes())
        kept = theirs.read_bytes()
        place.unlink()
        make(place, theirs)
        before = os.readlink(place) if place.is_symlink() else None
        results = run_ranks(WORLD, _resume, root, remote, {})
        ok(results, WORLD)
        want = {rank: (4, f"{remote}/snapshot_iter_4", rank * 100 + 4) for rank in range(WORLD)}
        assert {rank: (r["step"], r["path"], r["mine"]) for rank, r in results.items()} == want, what
        assert place.is_dir() == (what == "a directory"), what
        assert (os.readlink(place) if place.is_symlink() else None) == before, what
        if what == "a user's file":
            assert place.read_bytes() == b"a user's notes"
        assert theirs.read_bytes() == kept, what


def test_a_file_damaged_on_its_node_and_on_its_partner_s_comes_from_the_remote_alone(
    s3: Any, tmp_path: Path
) -> None:
    """Both copies of rank 2's file fail their checksums: that file is read from the remote
    tier, the step is not skipped, and nothing else is read from the remote."""
    root, remote = str(tmp_path), f"s3://{s3.bucket()}/run"
    ok(run_ranks(WORLD, _replicated, root, [1, 2], -1, remote, s3.env), WORLD)
    good = Path(root, "node-b", "snapshot_iter_2", "rank_00002").read_bytes()
    data = bytearray(good)
    data[-1] ^= 0x01
    for node in ("node-a", "node-b"):
        Path(root, node, "snapshot_iter_2", "rank_00002").write_bytes(bytes(data))
    since = len(servers.REQUESTS)
    results = run_ranks(WORLD, _replicated, root, [], -1, remote, s3.env)
    ok(results, WORLD)
    for rank, r in results.items():
        assert r == [2, os.path.join(node_dir(root, rank), "snapshot_iter_2"), rank * 100 + 2], results
    assert _files_read_remotely(since) == {"snapshot_iter_2/rank_00002"}
    assert Path(root, "node-b", "snapshot_iter_2", "rank_00002").read_bytes() == good


def test_a_partner_killed_while_taking_a_replica_fails_the_group_s_next_save_and_leaves_no_file(
    tmp_path: Path,
) -> None:
    root = str(tmp_path)
    results = run_ranks(WORLD, _replicated, root, [1, 2, 3], 2)
    assert sorted(results) == [0, 1, 3], results  # rank 2 died; nobody hangs
    for rank in (0, 1, 3):
        assert results[rank] == {"failed": [2]}, results
    step_dir = os.path.join(root, "node-b", "snapshot_iter_1")
    assert "rank_00000" not in os.listdir(step_dir)  # its replica never became visible
    # The group starts again: the newest step it committed restores (step 1, or step 2 if
    # its vote ended before rank 2 died copying step 1), and node B's open sweeps the temp
    # file the killed receive left.
    results = run_ranks(WORLD, _replicated, root, [])
    ok(results, WORLD)
    restored = {r[0] for r in results.values()}
    assert len(restored) == 1 and restored <= {1, 2}, results
    assert all(r[2] == rank * 100 + r[0] for rank, r in results.items()), results
    assert not [n for n in os.listdir(step_dir) if n.startswith(".aiosnap-tmp")]


def test_the_sweep_of_crashed_probes_removes_only_probes_aiosnap_wrote(tmp_path: Path) -> None:
    """A crashed open's probe goes; a user's file, directory or link under a probe's name
    stays, and the link's target is untouched."""
    storage = LocalStorage()
    _write_probe(storage, str(tmp_path), "crashed")
    (tmp_path / f"{PROBE_PREFIX}mine").write_bytes(b"a user's notes")
    (tmp_path / f"{PROBE_PREFIX}dir").mkdir()
    target = tmp_path / "elsewhere"
    target.write_bytes(Path(tmp_path, f"{PROBE_PREFIX}crashed").read_bytes())  # a probe's very bytes
    (tmp_path / f"{PROBE_PREFIX}link").symlink_to(target)
    assert sweep_probes(storage, str(tmp_path)) == [f"{PROBE_PREFIX}crashed"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["elsewhere", *(f"{PROBE_PREFIX}{n}" for n in ("dir", "link", "mine"))])
    assert target.read_bytes().startswith(b"aiosnap:")


def test_the_sweep_skips_a_probe_its_rank_removes_as_the_leader_sweeps(tmp_path: Path) -> None:
    """Each rank removes its own probe after the grouping, unordered with the leader's
    open: a probe listed by the sweep and gone before it is read is skipped (an open
    failed on it: seen in CI at 4 ranks)."""

    class Racing(LocalStorage):
        def list(self, path: str) -> list[Entry]:
            entries = super().list(path)
            (tmp_path / f"{PROBE_PREFIX}live").unlink()  # its rank's own removal
            return entries

    storage = Racing()
    _write_probe(storage, str(tmp_path), "live")
    _write_probe(storage, str(tmp_path), "crashed")
    assert sweep_probes(storage, str(tmp_path)) == [f"{PROBE_PREFIX}crashed"]
    assert list(tmp_path.iterdir()) == []


def test_rank_0_groups_ranks_by_the_probes_they_see() -> None:
    assert decide_nodes([[0, 1], [0, 1], [2, 3], [2, 3]]) == [0, 0, 2, 2]
    assert decide_nodes([[0, 2], [1], [0, 2]]) == [0, 1, 0]
    assert Nodes((0, 1, 0)).members(0) == [0, 2] and Nodes((0, 1, 0)).leaders == [0, 1]
    assert not Nodes.one(3).many and Nodes((0, 0, 2, 2)).many
    with pytest.raises(Refused, match="cannot see the probe"):
        decide_nodes([[0], [0]])
    with pytest.raises(Refused, match="rank 1 sees those of ranks"):  # not mutual: refused, never guessed
        decide_nodes([[0, 1], [1], [2]])


def test_a_manifest_s_record_of_nodes_and_copies_is_checked_and_tells_what_each_node_holds() -> None:
    files = [f"rank_{r:05d}" for r in range(5)]
    base = Manifest(3, None, 5, files, ["0" * 8] * 5, [1] * 5, [], "rank_00000")
    assert b'"nodes"' not in base.to_bytes() and b'"copies"' not in base.to_bytes()  # as before
    nodes = replace(base, nodes=node_runs([0, 0, 2, 2, 2]), copies=1)
    assert nodes.nodes == [[0, 2], [2, 3]] and Manifest.parse("m", nodes.to_bytes()) == nodes
    # Partners: 0->2, 1->3, 2->0, 3->1, 4->1 (node A is smaller: its last rank takes place 2).
    assert nodes.holdings() == {0: [0, 1, 2, 3, 4], 2: [0, 1, 2, 3, 4]}
    assert replace(nodes, copies=0).holdings() == {0: [0, 1], 2: [2, 3, 4]}
    hostile = [
        [[0, 2], [2, 2]],  # short of the world size
        [[0, 2], [2, 4]],  # beyond it
        [[0, 2], [1, 3]],  # a node named by a rank that is not its lowest
        [[0, 2], [3, 3]],  # ... nor in it
        [[0, 0], [0, 5]],  # an empty run
        [[0, 2, 1], [2, 3]],  # not a pair
        [[-1, 5]],
    ]
    for runs in hostile:
        with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="bad manifest"):
            Manifest.parse("m", replace(nodes, nodes=runs).to_bytes())
    for copies in (2, -1):
        with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="bad manifest"):
            Manifest.parse("m", replace(nodes, copies=copies).to_bytes())
    with pytest.raises(aiosnap.errors.CorruptCheckpointError, match="bad manifest"):  # copies without nodes
        Manifest.parse("m", replace(base, copies=1).to_bytes())


def test_partners_are_the_same_place_in_the_next_node_and_rank_0_plans_each_missing_file() -> None:
    assert partners(Nodes((0, 0, 2, 2))) == [2, 3, 0, 1]
    assert partners(Nodes((0, 0, 0, 3, 3, 5))) == [3, 4, 4, 5, 5, 0]  # a smaller node: its last rank
    assert partners(Nodes.one(4)) == [-1, -1, -1, -1]
    # Rank 2 lacks its file, which rank 0 holds a replica of; rank 3's is nowhere.
    assert moves([[], [], [2], [3]], [[0, 2], [1], [0], []]) == [[0, 2, 2]]
    # Node B (ranks 2, 3) came back empty: own files and replicas, from node A.
    assert moves([[], [], [2, 0], [3, 1]], [[0, 2], [1, 3], [], []]) == [
        [0, 2, 2],
        [0, 2, 0],
        [1, 3, 3],
        [1, 3, 1],
    ]
    # [ranks that saved it (its manifest; 0: none there), *files held], per node.
    assert covered([{"4": [4, 0, 1, 2, 3], "3": [4, 0, 1]}, {"3": [0, 2]}]) == {4}
    assert covered([{"5": [4, 0, 1]}, {"5": [0, 2, 3]}]) == {5}  # at any size of the group


@pytest.mark.slow
def test_the_docs_example_resumes_from_each_nodes_disk_as_if_never_stopped(tmp_path: Path) -> None:
    """examples/nodes.py as docs/nodes.md runs it: 4 ranks on 2 "nodes", steps 1-4, then
    8; the resumed run's losses are those of a run that never stopped (8 steps at once)."""

    def run(root: Path, steps: int) -> str:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
        script = [str(ROOT / "examples" / "nodes.py"), "--root", str(root), "--steps", str(steps)]
        done = subprocess.run([*command, *script], capture_output=True, text=True, timeout=JOB_CAP)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    run(tmp_path / "stopped", 4)
    resumed, whole = run(tmp_path / "stopped", 8), run(tmp_path / "whole", 8)
    for rank in range(WORLD):
        node = tmp_path / "stopped" / f"node-{rank // 2}" / "snapshot_iter_4"
        assert f"rank {rank} resumed at step 4 from {node}" in resumed
    losses = [line for line in resumed.splitlines() if line.startswith("step ")]
    assert losses and losses == [line for line in whole.splitlines() if line.startswith("step ")][4:]
    assert "steps every node holds: [7, 8]" in resumed


@pytest.mark.slow
def test_the_nodes_benchmark_runs_small(tmp_path: Path) -> None:
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_nodes.py"),
        "--size",
        "16MiB",
        "--reps",
        "1",
        "--interval",
        "0",
    ]
    done = subprocess.run([*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=JOB_CAP)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restore: the nodes, one file from its partner" in (tmp_path / "nodes.md").read_text()


async def test_copies_run_in_the_order_of_their_tickets_whichever_task_comes_first() -> None:
    """Tickets are taken in the votes' turns (the same order on every rank); a vote's task
    may reach its copy before an earlier one's does, and must wait for it: else two ranks
    would each wait for a transfer the other has not started."""
    link = SimpleNamespace(rank=0, size=4)
    replicator = Replicator(link, LocalStorage(), "unused", Nodes((0, 0, 2, 2)))  # type: ignore[arg-type]
    done: list[int] = []

    async def copy(record: Any, manifest: str, count: int) -> None:
        done.append(count)

    replicator._replicate = copy  # type: ignore[method-assign]
    first, second = replicator.ticket(), replicator.ticket()
    async with anyio.create_task_group() as tg:
        tg.start_soon(replicator.replicate, None, "", second)
        await anyio.wait_all_tasks_blocked()
        assert done == []  # the later ticket waits
        tg.start_soon(replicator.replicate, None, "", first)
    assert done == [first, second]


def test_replicas_is_0_or_1_and_needs_a_group(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="replicas=2: 0 or 1"):
        aiosnap.Ranks(replicas=2)
    with pytest.raises(ValueError, match="replicas= needs a process group"):
        aiosnap.CheckpointManager(str(tmp_path), ranks=aiosnap.Ranks(group=False, replicas=1))
