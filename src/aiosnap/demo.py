"""The demo, aiosnap's main job: train, checkpoint, get killed, resume, and check the result.

    python -m aiosnap.demo [--out DIR] [--epochs N] [--kill-at EPOCH.BATCH]

1. A reference run trains a small classifier on generated data, uninterrupted.
2. The same training runs again with Job, JobRunner, AsyncLoader, RNGState and a
   CheckpointManager over a QueueWriter, and kills itself with SIGKILL mid-epoch.
3. A new process resumes it from the newest valid checkpoint and finishes.
Then the resumed run's final loss and parameter checksum are compared with the
reference run's: they must be identical, bit for bit. Everything goes under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import signal
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import aiofiles.os
import anyio
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

import aiosnap

FEATURES, CLASSES, SAMPLES, BATCH = 32, 4, 4096, 64


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    centers = torch.randn(CLASSES, FEATURES, generator=g) * 2
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    return TensorDataset(centers[labels] + torch.randn(SAMPLES, FEATURES, generator=g) * 2.5, labels)


def make_state() -> dict[str, Any]:
    # Every generator starts from a seed, so the reference run's last checkpoint and the
    # resumed run's are equal entry for entry, RNG states included (`aiosnap diff` says so).
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 128),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, CLASSES),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    loader = DataLoader(
        make_data(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(5)
    )
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "loader": aiosnap.AsyncLoader(loader),
        "rng": aiosnap.RNGState(),
        "losses": [],
    }


def checksum(model: torch.nn.Module) -> str:
    crc = 0
    for t in model.state_dict().values():
        crc = zlib.crc32(t.detach().contiguous().numpy().tobytes(), crc)
    return f"{crc:08x}"


class Progress:
    """One bar per epoch; redrawn in place on a terminal, printed once otherwise."""

    def __init__(self, epoch: int, total: int) -> None:
        self.epoch, self.total, self.tty = epoch, total, sys.stdout.isatty()

    def show(self, done: int, loss: float, final: bool = False) -> None:
        if not (self.tty or final):
            return
        filled = 30 * done // self.total
        bar = "#" * filled + "." * (30 - filled)
        line = f"  epoch {self.epoch:2d} [{bar}] {done:3d}/{self.total} loss {loss:.4f}"
        print(("\r" if self.tty else "") + line, end="\n" if final else "", flush=True)


def build_job(state: dict[str, Any], epochs: int, kill_at: tuple[int, int] | None) -> aiosnap.Job:
    job = aiosnap.Job()
    model, optimizer, loader = state["model"], state["optimizer"], state["loader"]

    @job.epoch_group.add
    async def train_epoch(ctx: aiosnap.RunContext) -> None:
        bar, total, loss_sum, done = Progress(ctx.epoch, len(loader.source)), 0.0, 0.0, 0
        async for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            done, loss_sum = done + 1, loss_sum + loss.item()
            bar.show(done, loss_sum / done)
            await asyncio.sleep(0.005)  # stands in for the rest of a real step
            if kill_at == (ctx.epoch, done):
                print(f"\n  >>> SIGKILL at epoch {ctx.epoch}, batch {done} (a crash, mid-epoch)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        total = loss_sum / max(done, 1)
        bar.show(done, total, final=True)
        state["scheduler"].step()
        state["losses"].append(total)

    aiosnap.epoch_limiter(job, epochs)
    return job


def report(stats: aiosnap.SaveStats) -> None:
    print(
        f"     checkpoint {Path(stats.path).name}: {stats.bytes / 1024:.0f} KiB, caller stalled "
        f"{stats.stall_s * 1e3:.1f} ms, durable after {stats.total_s * 1e3:.1f} ms",
        flush=True,
    )


async def train(directory: Path, epochs: int, kill_at: tuple[int, int] | None) -> dict[str, Any]:
    state = make_state()
    writer = aiosnap.QueueWriter(max_pending=2)
    writer.add_post_save_hook(report)
    async with aiosnap.CheckpointManager(
        str(directory), writer=writer, keep=aiosnap.retention.KeepLast(3)
    ) as mgr:
        start = await mgr.latest_step()
        if start is not None:
            print(f"  resuming from the newest valid checkpoint: epoch {start}", flush=True)
        runner = aiosnap.JobRunner(build_job(state, epochs, kill_at), mgr, state=state, on_save_error="raise")
        last = await runner.train()
    return {"epoch": last, "loss": state["losses"][-1], "checksum": checksum(state["model"])}


async def child(args: argparse.Namespace) -> None:
    kill_at = tuple(int(v) for v in args.kill_at.split(".")) if args.kill_at != "none" else None
    result = await train(Path(args.out), args.epochs, kill_at)  # type: ignore[arg-type]
    async with await anyio.open_file(Path(args.out, "result.json"), "w") as f:
        await f.write(json.dumps(result))


async def run_child(out: Path, epochs: int, kill_at: str | None) -> int:
    command = [sys.executable, "-m", "aiosnap.demo", "--child", "--out", str(out), "--epochs", str(epochs)]
    done = await anyio.run_process(
        [*command, "--kill-at", kill_at or "none"], check=False, stdout=None, stderr=None
    )
    return done.returncode


async def main_async(args: argparse.Namespace) -> int:
    out = Path(args.out)
    t0 = time.perf_counter()
    print(f"aiosnap demo: everything goes under {out}\n")
    print(f"[1/3] reference run: {args.epochs} epochs, no interruption", flush=True)
    assert await run_child(out / "reference", args.epochs, None) == 0
    print(f"\n[2/3] the same run, killed at epoch.batch {args.kill_at}", flush=True)
    code = await run_child(out / "run", args.epochs, args.kill_at)
    print(
        f"  the training process died with {code} ({'SIGKILL' if code == -signal.SIGKILL else 'unexpected'})"
    )
    names = sorted(n for n in await aiofiles.os.listdir(out / "run") if n.startswith("snapshot"))
    print(f"  left on disk: {names}")
    print("\n[3/3] resume in a new process", flush=True)
    assert await run_child(out / "run", args.epochs, None) == 0
    reference = json.loads(await anyio.Path(out / "reference" / "result.json").read_text())
    resumed = json.loads(await anyio.Path(out / "run" / "result.json").read_text())
    same = reference == resumed
    print(f"\n  reference run: final loss {reference['loss']:.6f}, parameter crc32c {reference['checksum']}")
    print(f"  resumed run:   final loss {resumed['loss']:.6f}, parameter crc32c {resumed['checksum']}")
    verdict = (
        "IDENTICAL: the resumed run is the run that never stopped" if same else "DIFFERENT: resume is broken"
    )
    print(f"  {verdict}  ({time.perf_counter() - t0:.0f} s)")
    source, cwd = await anyio.Path(__file__).resolve(), await anyio.Path.cwd()
    next_steps(out, await aiofiles.os.listdir(out / "run"), Path(source), Path(cwd))
    return 0 if same else 1


def next_steps(out: Path, names: list[str], code: Path, cwd: Path) -> None:
    """Where the demo's code is, and three commands to run on what it wrote (``names``:
    the files of the resumed run's directory)."""
    steps = sorted(int(n.rpartition("_")[2]) for n in names if n.startswith("snapshot_iter_"))
    last = f"snapshot_iter_{steps[-1]}"
    cli = "aiosnap" if shutil.which("aiosnap") else f"{shlex.quote(sys.executable)} -m aiosnap"
    print(f"\nThe code of this demo: {code.relative_to(cwd) if code.is_relative_to(cwd) else code}")
    print("Look at what it wrote:")
    for command, why in (
        (f"ls {out / 'run'}", "the checkpoints left, their epochs, sizes and the latest"),
        (f"inspect {out / 'run' / last} --depth 2", "what one holds: model, optimizer, loader, RNG"),
        (
            f"diff {out / 'reference' / last} {out / 'run' / last}",
            "the resumed run's last one against the reference's",
        ),
    ):
        print(f"  {cli} {command}\n      {why}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="demo-output", help="output directory (emptied first)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--kill-at", default="5.37", help="EPOCH.BATCH at which the second run is killed")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out = os.path.abspath(args.out)
    torch.set_num_threads(1)  # the same kernels in every process, so results are bit-identical
    if args.child:
        asyncio.run(child(args))
        return
    shutil.rmtree(args.out, ignore_errors=True)
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
