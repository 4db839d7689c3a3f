"""Rank 0 alone at a large group's commit: how long its event loop is blocked.

    python benchmarks/scale_rank0.py [RANKS]        (default 1,024)

``bench_scale.py`` simulates every rank in one process, so the other ranks' objects
(a million at 1,024 ranks) and their own work share rank 0's loop and collector. Here
rank 0 is alone, as in a real group: the other ranks' messages are made first, as the
bytes gloo would deliver (a llama-7B FSDP2 layout, ``scale_layouts``), then rank 0
decodes them (``group.accept``) and settles them (``reports.Keeper.settle``: expand,
index, build the manifest) in its worker threads, exactly as ``Member.vote`` does, for
a first commit (whole reports) and a steady-state one (digests), while a 1 ms heartbeat
on the loop records its worst lateness.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_layouts import Layout

from aiosnap._base import offload
from aiosnap._dist.group import accept, encode_json
from aiosnap._dist.messages import Envelope
from aiosnap._manager.reports import Collected, Keeper, Sender


def messages(layout: Layout, senders: list[Sender], seq: int) -> dict[int, bytes]:
    """What every rank but 0 sends rank 0 at this commit, as bytes."""
    out = {}
    for r in range(1, layout.size):
        body, _ = senders[r].prepare(layout.report(r), False)
        out[r] = encode_json(Envelope(seq, "save", body).to_json())
    return out


async def commit(layout: Layout, keeper: Keeper, raw: dict[int, bytes], seq: int) -> dict[str, Any]:
    """Rank 0's part of one commit under a heartbeat: seconds and the loop's worst block."""
    worst = 0.0
    done = anyio.Event()
    own, _ = Sender().prepare(layout.report(0), True)  # its own report: its work(), offloaded in a vote

    async def beat() -> None:
        nonlocal worst
        while not done.is_set():
            start = time.perf_counter()
            await anyio.sleep(0.001)
            worst = max(worst, time.perf_counter() - start - 0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(beat)
        start, cpu = time.perf_counter(), time.process_time()
        got, failed = await offload.run_coord(accept, Envelope(seq, "save", None), raw)
        assert not failed, failed
        bodies = [own] + [got[r] for r in range(1, layout.size)]
        settled = await offload.run_cpu(keeper.settle, seq, None, bodies, Collected(), [])
        assert settled.manifest is not None, "rank 0 committed nothing"
        assert not settled.resend, settled.resend
        keeper.adopt(settled.held)
        done.set()
    return {
        "wall_s": time.perf_counter() - start,
        "cpu_s": time.process_time() - cpu,
        "worst_block_ms": worst * 1000,
        "per_rank": list(settled.manifest.per_rank),
    }


async def main(size: int) -> None:
    await offload.warm()
    layout, keeper = Layout(size, size), Keeper()
    senders = [Sender() for _ in range(size)]
    for seq, name in ((1, "first"), (2, "steady")):
        raw = messages(layout, senders, seq)
        row = await commit(layout, keeper, raw, seq)
        for r in range(size):  # every rank learns the commit, as from rank 0's verdict
            senders[r].committed(senders[r].prepare(layout.report(r), r == 0)[1], row["per_rank"])
        sent = sum(map(len, raw.values())) / (size - 1)
        print(
            f"{size} ranks, {name} commit: rank 0 {row['wall_s']:.2f} s ({row['cpu_s']:.2f} s CPU), "
            f"loop's worst block {row['worst_block_ms']:.0f} ms, {sent:.0f} bytes per rank",
            flush=True,
        )


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 1024)
