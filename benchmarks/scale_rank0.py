"""Rank 0 alone at a large group's commit: how long its event loop is blocked.

    python benchmarks/scale_rank0.py [RANKS] [--repeat N] [--shard S]   (default 1,024, 1)

``bench_scale.py`` simulates every rank in one process, so the other ranks' objects
(a million at 1,024 ranks) and their own work share rank 0's loop and collector. Here
rank 0 is alone, as in a real group: the other ranks' messages are made first, as the
bytes gloo would deliver (a llama-7B FSDP2 layout, ``scale_layouts``), and rank 0 runs
its real ``Member.vote`` over a real ``GroupChannel`` whose transport hands it those
bytes (``Canned``: decoded in a worker thread, as ``coord``'s gather does) and writes
the manifest with the real ``StepDirectories``. A 1 ms heartbeat on the loop records
its worst lateness from the vote's start to its end (everything the vote made is freed
by then), for a first commit (whole reports) and a steady-state one (digests).

The collector is run to completion before each measured commit, so that a collection
during it is one the commit's own allocations set off; each one that took over 3 ms
is listed (generation, milliseconds, thread). For scale: a full collection of this
process (torch imported) takes ~130 ms on the reference machine.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_group import ReportedLayout
from scale_layouts import Layout

from aiosnap._base import offload
from aiosnap._base.tasks import SaveFailure
from aiosnap._dist.group import GroupChannel, RealClock, accept, encode_json
from aiosnap._dist.messages import Envelope, Outcome, WorkState
from aiosnap._format.manifest import Manifest
from aiosnap._manager.member import Member
from aiosnap._manager.records import CheckpointRecord
from aiosnap._manager.reports import Sender
from aiosnap._save.handle import Resolver, SaveStats


def messages(layout: Layout, senders: list[Sender], seq: int, op: str) -> dict[int, bytes]:
    """What every rank but 0 sends rank 0 at a save's first round, as bytes: its work
    is done, and its result is its report (a digest of it once rank 0 holds it)."""
    out = {}
    for r in range(1, layout.size):
        body, _ = senders[r].prepare(layout.report(r), False)
        out[r] = encode_json(Envelope(seq, op, WorkState("done", result=body).to_json()).to_json())
    return out


class Canned:
    """Rank 0's transport, the other ranks' messages given: ``inbox[seq]``, each rank's
    bytes of exchange ``seq``. Decoding and encoding run in a worker thread, as over gloo."""

    rank, clock = 0, RealClock()

    def __init__(self, size: int) -> None:
        self.size = size
        self.inbox: dict[int, dict[int, bytes]] = {}

    async def gather(self, envelope: Envelope, silence: float) -> tuple[list[Any], dict[int, str]]:
        return await offload.run_coord(self._gather, envelope)

    def _gather(self, envelope: Envelope) -> tuple[list[Any], dict[int, str]]:
        raw = self.inbox.pop(envelope.seq)  # the worker's own, as gloo's buffers are
        bodies, failed = accept(envelope, raw)
        return [envelope.body] + [bodies.get(r) for r in range(1, self.size)], failed

    async def scatter(self, verdict: Outcome, skip: set[int], silence: float) -> None:
        await offload.run_coord(lambda: encode_json(verdict.to_json()))

    async def send_and_receive(self, envelope: Envelope, silence: float) -> Outcome:
        raise AssertionError("rank 0 only gathers and scatters")

    def close(self) -> None:
        pass


class Watch:
    """A 1 ms heartbeat's worst lateness on the loop, and the collections (> 3 ms) meanwhile."""

    def __init__(self) -> None:
        self.worst = 0.0
        #: When the worst tick slept and woke (``time.perf_counter``, CLOCK_MONOTONIC).
        self.window = (0.0, 0.0)
        self.collections: list[str] = []
        self._start = 0.0

    async def beat(self, done: anyio.Event) -> None:
        while not done.is_set():
            start = time.perf_counter()
            await anyio.sleep(0.001)
            if (late := time.perf_counter() - start - 0.001) > self.worst:
                self.worst, self.window = late, (start, start + late + 0.001)

    def collected(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif (took := time.perf_counter() - self._start) > 0.003:
            where = threading.current_thread().name
            self.collections.append(f"gen{info['generation']} {took * 1000:.0f} ms ({where})")


async def vote(member: Member, step: int, directory: Path) -> tuple[Watch, float, float]:
    """Rank 0's vote on ``step`` under a ``Watch``: the watch, wall and CPU seconds."""
    record = CheckpointRecord(step, f"step_{step:08d}")
    (directory / record.file).mkdir(parents=True, exist_ok=True)
    path = str(directory / record.file / "rank_00000")
    inner, outer = Resolver(path), Resolver(path)
    inner.finish(SaveStats(path, 1, 0.0, 0.0, 0.0, 0.0, 0.0))
    turn = member.votes.turn(f"save step {step}")
    watch, done = Watch(), anyio.Event()
    gc.collect()  # a collection during the vote is then one that its allocations set off
    gc.callbacks.append(watch.collected)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch.beat, done)
            await anyio.sleep(0.005)  # the heartbeat is running
            start, cpu = time.perf_counter(), time.process_time()
            await member.vote(turn, inner.handle, record, outer, lambda exc: SaveFailure(path, exc))
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            done.set()
    finally:
        gc.callbacks.remove(watch.collected)
    outcome = await outer.handle.outcome()
    if isinstance(outcome, SaveFailure):
        raise RuntimeError(f"step {step} failed") from outcome.error
    return watch, wall, cpu


async def run(size: int, shard: int, directory: Path) -> list[tuple[str, Watch, float, float, float]]:
    """A first and a steady-state commit: (which, watch, wall s, CPU s, bytes per rank)."""
    await offload.warm()
    layout = Layout(size, shard)
    transport = Canned(size)
    member = Member(
        GroupChannel(transport, timeout=300.0),
        GroupChannel(Canned(size), timeout=300.0),
        layout=ReportedLayout(str(directory), layout.report),
        catalog=None,
        replicated=[],
    )
    senders = [Sender() for _ in range(size)]
    rows = []
    for step, name in ((1, "first"), (2, "steady")):
        gc.disable()  # making the other ranks' messages is not rank 0's work
        transport.inbox[step] = raw = messages(layout, senders, step, f"save step {step}")
        gc.enable()
        sent = sum(map(len, raw.values())) / (size - 1)
        del raw
        watch, wall, cpu = await vote(member, step, directory)
        manifest = directory / f"step_{step:08d}" / "aiosnap-manifest.json"
        per_rank = Manifest.parse(str(manifest), manifest.read_bytes()).per_rank
        for r in range(1, size):  # every rank learns the commit, from rank 0's verdict
            senders[r].committed(senders[r].prepare(layout.report(r), False)[1], list(per_rank))
        rows.append((name, watch, wall, cpu, sent))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("ranks", type=int, nargs="?", default=1024)
    parser.add_argument("--shard", type=int, help="ranks per FSDP group (HSDP); all by default")
    parser.add_argument("--repeat", type=int, default=1, help="runs, each a first and a steady commit")
    args = parser.parse_args()
    worst: dict[str, list[float]] = {"first": [], "steady": []}
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            rows = anyio.run(run, args.ranks, args.shard or args.ranks, Path(tmp))
        for name, watch, wall, cpu, sent in rows:
            worst[name].append(watch.worst * 1000)
            print(
                f"{args.ranks} ranks, {name} commit: rank 0 {wall:.2f} s ({cpu:.2f} s CPU), loop's worst "
                f"block {watch.worst * 1000:.0f} ms, {sent:.0f} bytes per rank; collections: "
                f"{', '.join(watch.collections) or 'none over 3 ms'}",
                flush=True,
            )
    if args.repeat > 1:
        for name, ms in worst.items():
            spread = f"{min(ms):.0f}-{max(ms):.0f}"
            print(f"{name}: worst block median {statistics.median(ms):.0f} ms, {spread} ms")


if __name__ == "__main__":
    main()
