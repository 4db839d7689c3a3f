"""The demo: an async training run that checkpoints, is killed, resumes, and checks itself.

    python -m aiosnap.demo [--out DIR] [--steps N] [--kill-at STEP]

1. A reference run trains a small MLP on generated data for N steps, uninterrupted.
2. A child process runs the same training, saving every few steps through a
   QueueWriter, and is killed with SIGKILL at step ``--kill-at``, mid-flight.
3. This process resumes from the newest checkpoint that verifies, finishes the run,
   and compares final loss and parameter checksum with the reference run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiofiles.os
import anyio
import torch

import aiosnap

FEATURES, HIDDEN, SAMPLES, BATCH = 32, 64, 4096, 64
_NAME = re.compile(r"snapshot_iter_(\d+)$")


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    return x, x @ w + 0.1 * torch.randn(SAMPLES, 1, generator=g)


def make_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    return {"model": model, "optimizer": optimizer, "step": 0, "losses": []}


def train_step(state: dict[str, Any], data: tuple[torch.Tensor, torch.Tensor]) -> float:
    # The batch depends only on the step number, so a resumed run sees the same batches.
    step = state["step"]
    idx = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(step))[:BATCH]
    x, y = data[0][idx], data[1][idx]
    state["optimizer"].zero_grad()
    loss = torch.nn.functional.mse_loss(state["model"](x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    state["optimizer"].step()
    state["step"] = step + 1
    value = loss.detach().item()
    state["losses"].append(value)
    return value


def checksum(state: dict[str, Any]) -> str:
    crc = 0
    for t in state["model"].state_dict().values():
        crc = aiosnap._format.crc32c(t.detach().contiguous().numpy().tobytes(), crc)
    return f"{crc:08x}"


async def run(out: Path, steps: int, save_every: int, kill_at: int | None, state: dict[str, Any]) -> None:
    data = make_data()
    async with aiosnap.QueueWriter(max_pending=2) as writer:
        writer.add_post_save_hook(_report)
        while state["step"] < steps:
            loss = train_step(state, data)
            step = state["step"]
            await asyncio.sleep(0.01)  # stands in for the rest of a real step (I/O, logging)
            if step % save_every == 0:
                t0 = time.perf_counter()
                await writer(f"snapshot_iter_{step}", str(out), state)
                print(
                    f"  step {step:4d}  loss {loss:.4f}  save accepted, stall "
                    f"{(time.perf_counter() - t0) * 1e3:.1f} ms",
                    flush=True,
                )
            if step == kill_at:
                print(f"  step {step:4d}  SIGKILL (queued saves die with the process)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


def _report(stats: aiosnap.SaveStats) -> None:
    print(
        f"          committed {Path(stats.path).name}: {stats.bytes / 1024:.0f} KiB, "
        f"call->durable {stats.total_s * 1e3:.1f} ms (fsync {stats.fsync_s * 1e3:.1f} ms)",
        flush=True,
    )


async def newest_valid(out: Path) -> Path | None:
    names = await aiofiles.os.listdir(out)
    found = sorted(((int(m.group(1)), out / n) for n in names if (m := _NAME.match(n))), reverse=True)
    for _, path in found:
        try:
            await aiosnap.verify(str(path))
            return path
        except aiosnap.CheckpointError as exc:
            print(f"  skipping {path.name}: {exc}")
    return None


async def main_async(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.child:
        await run(out, args.steps, args.save_every, args.kill_at, make_state())
        return 0
    print(f"aiosnap demo: output in {out}\n\n[1/3] reference run, {args.steps} steps, no interruption")
    reference = make_state()
    data = make_data()
    while reference["step"] < args.steps:
        train_step(reference, data)
    print(f"  final loss {reference['losses'][-1]:.6f}, parameter crc32c {checksum(reference)}")

    print(
        f"\n[2/3] training in a child process, saving every {args.save_every} steps, "
        f"killed at step {args.kill_at}"
    )
    child = await anyio.run_process(
        [
            sys.executable,
            "-m",
            "aiosnap.demo",
            "--child",
            "--out",
            str(out),
            "--steps",
            str(args.steps),
            "--save-every",
            str(args.save_every),
            "--kill-at",
            str(args.kill_at),
        ],
        check=False,
        stdout=None,
        stderr=None,
    )
    print(f"  child exited with {child.returncode} ({'SIGKILL' if child.returncode == -9 else '?'})")
    on_disk = sorted(await aiofiles.os.listdir(out), key=lambda n: (len(n), n))
    print(f"  on disk: {on_disk}")

    print("\n[3/3] resume from the newest checkpoint that verifies")
    latest = await newest_valid(out)
    state = make_state()
    if latest is not None:
        t0 = time.perf_counter()
        await aiosnap.load_into(str(latest), state)
        print(f"  restored {latest.name} (step {state['step']}) in {(time.perf_counter() - t0) * 1e3:.1f} ms")
    await run(out, args.steps, args.save_every, None, state)
    same = checksum(state) == checksum(reference) and state["losses"] == reference["losses"]
    print(f"\n  resumed run:   final loss {state['losses'][-1]:.6f}, parameter crc32c {checksum(state)}")
    print(
        f"  reference run: final loss {reference['losses'][-1]:.6f}, parameter crc32c {checksum(reference)}"
    )
    print(
        f"  {'IDENTICAL' if same else 'DIFFERENT'}: the resumed run "
        f"{'is' if same else 'is NOT'} the run that never stopped"
    )
    return 0 if same else 1


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="demo-output", help="output directory (emptied first)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--kill-at", type=int, default=190)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out = os.path.abspath(args.out)
    torch.set_num_threads(1)  # same kernels in every process, so results are bit-identical
    if not args.child:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for old in out.iterdir():
            old.unlink()
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
