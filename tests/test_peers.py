"""Files moving between ranks over a PeerLink (``_dist/peers``): real processes, real gloo
groups on 127.0.0.1, real files; a peer that dies is SIGKILLed at a point it synchronises on."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import aiosnap
from aiosnap._dist import peers
from aiosnap._dist.peers import open_peer_link, recv_file, send_file
from aiosnap.errors import PeerTransferError
from aiosnap.storage import LocalStorage

from .faults import failing_writes
from .test_distributed import ok, run_ranks

MiB = 1 << 20
SILENCE = 30.0  # the links' timeout where no test waits it out


def _write_random(path: Path, size: int, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        .numpy()
        .tobytes()
    )


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


class CountingStorage(LocalStorage):
    """The real local storage, counting the uploads it starts."""

    created = 0

    def create(self, path: str, size: int | None) -> Any:
        CountingStorage.created += 1
        return super().create(path, size)


# -- one file, whole ----------------------------------------------------------------------
async def _one_way(rank: int, world: int, root: str, size: int) -> dict[str, Any]:
    link = await open_peer_link(None, SILENCE)
    storage, pieces = LocalStorage(), []
    try:
        if rank == 0:
            sent = await send_file(
                link, 1, 5, storage, f"{root}/a/rank_00000", piece=MiB, on_piece=pieces.append
            )
            return {"bytes": sent, "pieces": pieces}
        path = f"{root}/b/rank_00000"
        got = await recv_file(link, 0, 5, storage, path, expected_size=size, on_piece=pieces.append)
        return {"bytes": got, "pieces": pieces}
    finally:
        link.close()


def test_a_file_moves_whole_in_pieces(tmp_path: Path) -> None:
    size = 24 * MiB + 12345  # a last piece shorter than the others
    _write_random(tmp_path / "a" / "rank_00000", size, seed=1)
    (tmp_path / "b").mkdir()
    results = run_ranks(2, _one_way, str(tmp_path), size)
    ok(results, 2)
    expected = [MiB] * 24 + [12345]
    for r in range(2):
        assert results[r] == {"bytes": size, "pieces": expected}
    assert (tmp_path / "b" / "rank_00000").read_bytes() == (tmp_path / "a" / "rank_00000").read_bytes()
    assert _files(tmp_path / "b") == ["rank_00000"]  # no temp file left


# -- several at once ------------------------------------------------------------------------
async def _exchange(rank: int, world: int, root: str, size: int, tags: list[int]) -> list[int]:
    """Rank r sends its file to r+1 and receives r-1's, at once (tags[r]: r's sending tag)."""
    link = await open_peer_link(None, SILENCE)
    storage = LocalStorage()
    to, frm = (rank + 1) % world, (rank - 1) % world
    sizes: list[int] = []
    try:

        async def send() -> None:
            sizes.append(await send_file(link, to, tags[rank], storage, f"{root}/{rank}/own", piece=MiB))

        async def recv() -> None:
            path = f"{root}/{rank}/from_{frm}"
            sizes.append(await recv_file(link, frm, tags[frm], storage, path, expected_size=size))

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            tg.start_soon(recv)
        return sizes
    finally:
        link.close()


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_send_and_receive_at_once(tmp_path: Path, world: int) -> None:
    """2 ranks: 0->1 and 1->0 under the same tag (each direction has its slots); 3 ranks: a
    ring 0->1->2->0, each rank sending while it receives from another."""
    size = 8 * MiB + 7
    for r in range(world):
        _write_random(tmp_path / str(r) / "own", size, seed=10 + r)
    tags = [3] * world if world == 2 else [11, 12, 13]
    results = run_ranks(world, _exchange, str(tmp_path), size, tags)
    ok(results, world)
    for r in range(world):
        assert results[r] == [size, size]
        frm = (r - 1) % world
        assert (tmp_path / str(r) / f"from_{frm}").read_bytes() == (tmp_path / str(frm) / "own").read_bytes()


# -- refusals -----------------------------------------------------------------------------
async def _refused(rank: int, world: int, root: str, size: int) -> dict[str, Any]:
    """A size the receiver does not expect is refused; the link goes on (another tag)."""
    link = await open_peer_link(None, SILENCE)
    storage = CountingStorage()
    out: dict[str, Any] = {}
    try:
        try:
            if rank == 0:
                await send_file(link, 1, 1, storage, f"{root}/a/f", piece=MiB)
            else:
                await recv_file(link, 0, 1, storage, f"{root}/b/f", expected_size=size + 1)
        except PeerTransferError as exc:
            out.update(
                refused=str(exc), peer=exc.peer, created=CountingStorage.created, left=_files(Path(root, "b"))
            )
        with pytest.raises(ValueError, match="in use, or failed"):  # its slots may hold the old stream's
            await (
                send_file(link, 1, 1, storage, "", piece=MiB)
                if rank == 0
                else recv_file(link, 0, 1, storage, "", expected_size=0)
            )
        if rank == 0:
            out["again"] = await send_file(link, 1, 2, storage, f"{root}/a/f", piece=MiB)
        else:
            out["again"] = await recv_file(link, 0, 2, storage, f"{root}/b/f", expected_size=size)
        return out
    finally:
        link.close()


def test_a_size_not_expected_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    size = 3 * MiB
    _write_random(tmp_path / "a" / "f", size, seed=2)
    (tmp_path / "b").mkdir()
    results = run_ranks(2, _refused, str(tmp_path), size)
    ok(results, 2)
    sender, receiver = results[0], results[1]
    assert receiver["peer"] == 0 and receiver["created"] == 0 and receiver["left"] == []
    assert f"announced {size} bytes where {size + 1} were expected" in receiver["refused"]
    assert (
        sender["peer"] == 1
        and f"refused the file of {size} bytes: it expects {size + 1}" in sender["refused"]
    )
    assert receiver["again"] == sender["again"] == size
    assert (tmp_path / "b" / "f").read_bytes() == (tmp_path / "a" / "f").read_bytes()


async def _no_file_or_no_room(rank: int, world: int, root: str) -> dict[str, str]:
    """Rank 0 offers a file that is gone (retention removed it before its copy was made),
    then one rank 1 cannot create (its directory is a file): each end learns it from the
    other at once; the link's timeout (10 minutes here) is never waited out."""
    link = await open_peer_link(None, 600.0)
    storage, out = LocalStorage(), {}
    try:
        for tag, name, sent, into in ((1, "gone", "a/gone", "b/gone"), (2, "blocked", "a/f", "blocked/f")):
            try:
                if rank == 0:
                    await send_file(link, 1, tag, storage, f"{root}/{sent}")
                else:
                    await recv_file(link, 0, tag, storage, f"{root}/{into}", expected_size=MiB)
            except (PeerTransferError, OSError, aiosnap.errors.CheckpointNotFoundError) as exc:
                out[name] = f"{type(exc).__name__}: {exc}"
        return out
    finally:
        link.close()


def test_a_file_gone_at_the_sender_or_not_creatable_at_the_receiver_ends_both_ends_at_once(
    tmp_path: Path,
) -> None:
    _write_random(tmp_path / "a" / "f", MiB, seed=3)
    (tmp_path / "b").mkdir()
    (tmp_path / "blocked").write_bytes(b"a file where rank 1 wants a directory")
    results = run_ranks(2, _no_file_or_no_room, str(tmp_path), limit=120)
    ok(results, 2)
    sender, receiver = results[0], results[1]
    assert sender["gone"].startswith("CheckpointNotFoundError") and "has no such file" in receiver["gone"]
    assert "refused the file" in sender["blocked"] and receiver["blocked"].startswith(
        ("OSError", "NotADirectory")
    )
    assert not (tmp_path / "b" / "gone").exists()


async def _forged(rank: int, world: int, root: str, size: int) -> dict[str, Any]:
    """Rank 0 speaks the protocol by hand and sends a trailer whose crc32c is not its bytes'."""
    link = await open_peer_link(None, SILENCE)
    try:
        if rank == 1:
            try:
                await recv_file(link, 0, 4, LocalStorage(), f"{root}/b/f", expected_size=size)
            except PeerTransferError as exc:
                return {"error": None, "raised": str(exc), "left": _files(Path(root, "b"))}
            return {"raised": None}
        data, reply = peers._slots(4)
        answer, verdict = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
        g = link.group
        for work in (
            g.send([torch.tensor([size, size], dtype=torch.int64)], 1, data),
            g.recv([answer], 1, reply),
            g.send([torch.ones(size, dtype=torch.uint8)], 1, data),
            g.send([torch.tensor([12345, 0], dtype=torch.int64)], 1, data),
            g.recv([verdict], 1, reply),
        ):
            work.wait()
        return {"answer": int(answer[0]), "verdict": int(verdict[0])}
    finally:
        link.close()


def test_bytes_that_fail_the_streams_crc32c_are_not_committed(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    results = run_ranks(2, _forged, str(tmp_path), 4096)
    assert results[0] == {"answer": peers._GO, "verdict": peers._FAILED}
    assert "crc32c" in results[1]["raised"] and results[1]["left"] == []


# -- a peer that dies or falls silent -------------------------------------------------------
async def _sender_dies(rank: int, world: int, root: str, size: int, arrived: Any) -> dict[str, Any]:
    """Rank 1 sends and is SIGKILLed once rank 0 has written the first piece."""
    link = await open_peer_link(None, SILENCE)
    storage = LocalStorage()

    def die(n: int) -> None:
        arrived.wait(60)  # a bound only for a receiver that never got a piece
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == 1:
        await send_file(link, 0, 9, storage, f"{root}/a/f", piece=MiB, on_piece=die)
        return {"error": "the sender lived"}
    t0 = time.monotonic()
    try:
        await recv_file(
            link, 1, 9, storage, f"{root}/b/f", expected_size=size, on_piece=lambda n: arrived.set()
        )
    except PeerTransferError as exc:
        return {
            "raised": str(exc),
            "peer": exc.peer,
            "seconds": time.monotonic() - t0,
            "left": _files(Path(root, "b")),
        }
    finally:
        link.close()
    return {"error": "the file arrived"}


def test_a_sender_killed_mid_file_leaves_nothing_and_the_receiver_raises(tmp_path: Path) -> None:
    size = 8 * MiB
    _write_random(tmp_path / "a" / "f", size, seed=3)
    (tmp_path / "b").mkdir()
    arrived = multiprocessing.get_context("forkserver").Event()
    results = run_ranks(2, _sender_dies, str(tmp_path), size, arrived)
    assert sorted(results) == [0], results  # rank 1 died before it reported
    r = results[0]
    assert r.get("peer") == 1, r
    assert "rank 1 is gone" in r["raised"] and r["seconds"] < SILENCE
    assert r["left"] == []


async def _receiver_dies(rank: int, world: int, root: str, size: int) -> dict[str, Any]:
    """Rank 1 receives, and is SIGKILLed once it has written its first piece."""
    link = await open_peer_link(None, SILENCE)
    storage = LocalStorage()
    if rank == 1:
        kill = lambda n: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
        await recv_file(link, 0, 8, storage, f"{root}/b/f", expected_size=size, on_piece=kill)
        return {"error": "the receiver lived"}
    t0 = time.monotonic()
    try:
        await send_file(link, 1, 8, storage, f"{root}/a/f", piece=MiB)
    except PeerTransferError as exc:
        return {"raised": str(exc), "peer": exc.peer, "seconds": time.monotonic() - t0}
    finally:
        link.close()
    return {"error": "the file was taken"}


def test_a_receiver_killed_mid_file_makes_the_sender_raise(tmp_path: Path) -> None:
    size = 8 * MiB
    _write_random(tmp_path / "a" / "f", size, seed=6)
    (tmp_path / "b").mkdir()
    results = run_ranks(2, _receiver_dies, str(tmp_path), size)
    assert sorted(results) == [0], results
    r = results[0]
    assert r.get("peer") == 1 and "rank 1 is gone" in r["raised"] and r["seconds"] < SILENCE, r
    # What a killed receiver leaves is a temp file of its own, for its next open to sweep.
    assert not (tmp_path / "b" / "f").exists()


async def _disk_full(rank: int, world: int, root: str, size: int) -> dict[str, Any]:
    """Rank 1's disk refuses its first piece: it raises the storage's error, leaves nothing,
    and closes its link; rank 0 then raises too."""
    link = await open_peer_link(None, SILENCE)
    try:
        if rank == 0:
            await send_file(link, 1, 7, LocalStorage(), f"{root}/a/f", piece=MiB)
            return {"error": "the file was taken"}
        storage = failing_writes(lambda path: path == f"{root}/b/f")  # its temp file, as the target
        await recv_file(link, 0, 7, storage, f"{root}/b/f", expected_size=size)
        return {"error": "the file was written"}
    except (OSError, PeerTransferError) as exc:
        return {"raised": type(exc).__name__, "message": str(exc), "left": _files(Path(root, "b"))}
    finally:
        link.close()


def test_a_receivers_storage_error_is_raised_as_it_is_and_leaves_nothing(tmp_path: Path) -> None:
    size = 4 * MiB
    _write_random(tmp_path / "a" / "f", size, seed=7)
    (tmp_path / "b").mkdir()
    results = run_ranks(2, _disk_full, str(tmp_path), size)
    ok(results, 2)
    assert results[1]["raised"] == "OSError" and "No space left" in results[1]["message"]
    assert results[1]["left"] == []
    assert (
        results[0]["raised"] == "PeerTransferError" and "with rank 1 failed: rank 1 " in results[0]["message"]
    )


async def _partner_dies(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 1, rank 0's partner (connected as the link opens), dies before any file."""
    link = await open_peer_link(None, SILENCE, partners=[1 - rank])
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        await send_file(link, 1, 1, LocalStorage(), f"{root}/a/f", piece=MiB)
    except PeerTransferError as exc:
        return {"raised": str(exc), "seconds": time.monotonic() - t0}
    finally:
        link.close()
    return {"error": "the file was taken"}


def test_a_partner_that_died_before_any_file_is_seen_gone_at_once(tmp_path: Path) -> None:
    """(Unconnected, a first message to it waits out gloo's connect deadline: 5 timeouts.)"""
    _write_random(tmp_path / "a" / "f", 4096, seed=8)
    results = run_ranks(2, _partner_dies, str(tmp_path))
    assert sorted(results) == [0], results
    assert "rank 1 is gone" in results[0]["raised"] and results[0]["seconds"] < SILENCE, results


async def _receiver_cancelled(rank: int, world: int, root: str, size: int) -> dict[str, Any]:
    """Rank 1's receive is cancelled once its first piece is written; it then closes its link."""
    link = await open_peer_link(None, SILENCE)
    storage = LocalStorage()
    try:
        if rank == 0:
            await send_file(link, 1, 6, storage, f"{root}/a/f", piece=MiB)
            return {"error": "the file was sent"}
        with anyio.CancelScope() as scope:
            await recv_file(
                link, 0, 6, storage, f"{root}/b/f", expected_size=size, on_piece=lambda n: scope.cancel()
            )
        return {"cancelled": scope.cancelled_caught, "left": _files(Path(root, "b"))}
    except PeerTransferError as exc:
        return {"raised": str(exc)}
    finally:
        link.close()


def test_a_cancelled_receive_leaves_nothing_and_the_sender_raises(tmp_path: Path) -> None:
    size = 8 * MiB
    _write_random(tmp_path / "a" / "f", size, seed=5)
    (tmp_path / "b").mkdir()
    results = run_ranks(2, _receiver_cancelled, str(tmp_path), size)
    ok(results, 2)
    assert results[1] == {"cancelled": True, "left": []}
    assert "with rank 1 failed: rank 1 " in results[0]["raised"]


async def _sender_stalls(
    rank: int, world: int, root: str, size: int, silence: float, gave_up: Any
) -> dict[str, Any]:
    """Rank 1 stops sending after its first piece, alive, until rank 0 has given up."""
    link = await open_peer_link(None, silence)
    storage, pieces = LocalStorage(), []
    try:
        if rank == 1:
            await send_file(
                link, 0, 9, storage, f"{root}/a/f", piece=MiB, on_piece=lambda n: gave_up.wait(60)
            )
        else:
            await recv_file(link, 1, 9, storage, f"{root}/b/f", expected_size=size, on_piece=pieces.append)
        return {"error": "the file arrived"}
    except PeerTransferError as exc:
        return {"raised": str(exc), "left": _files(Path(root, "b")), "pieces": len(pieces)}
    finally:
        gave_up.set()
        link.close()


def test_a_silent_sender_makes_the_receiver_raise_after_the_timeout(tmp_path: Path) -> None:
    size = 8 * MiB
    _write_random(tmp_path / "a" / "f", size, seed=4)
    (tmp_path / "b").mkdir()
    gave_up = multiprocessing.get_context("forkserver").Event()
    results = run_ranks(2, _sender_stalls, str(tmp_path), size, 2.0, gave_up)
    ok(results, 2)
    assert "rank 1 did not answer within 2 s" in results[0]["raised"] and results[0]["left"] == []
    assert results[0]["pieces"] >= 1  # it fell silent mid-file (piece 0 sent, then it stopped)
    # The sender, let go, finds its piece not taken: it raises too, within its timeout.
    # (timed out, or seen gone when rank 0 closed its link first).
    assert "with rank 0 failed: rank 0 " in results[1]["raised"]
