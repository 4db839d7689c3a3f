"""Accelerate DDP training on CPUs (gloo) that checkpoints with aiosnap and resumes after a kill.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_ddp.py --project /tmp/acc-ddp --steps 16

Kill it at any point (Ctrl-C, or a SIGKILL of every rank), then run the same command again:
every rank resumes from the newest checkpoint the whole group committed, each with its own
RNG state, and trains on with the losses of a run that never stopped.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from accelerate.utils import ProjectConfiguration

import aiosnap
from aiosnap.integrations.accelerate import AiosnapAccelerator


class Progress:
    """The loop's position, registered for checkpointing."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def show(kind: str, rank: int, *values: object) -> None:
    print(kind, f"rank {rank}:", *values, flush=True)


def train(project: str, steps: int, every: int = 2, show: Callable[..., None] = show) -> None:
    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = AiosnapAccelerator(cpu=True, project_config=config)  # was: Accelerator(...)
    rank = accelerator.process_index
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(128, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    torch.manual_seed(100 + rank)  # each rank its own dropout masks
    try:
        accelerator.load_state()  # every rank: the newest step the whole group committed
    except aiosnap.errors.CheckpointNotFoundError:
        pass  # a fresh start
    show("resumed", rank, progress.step)
    data = torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(1 + rank))  # rank's shard
    while progress.step < steps:
        x = data[progress.step % len(data)]
        loss = torch.nn.functional.mse_loss(model(x), x.sum(-1, keepdim=True))
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        progress.step += 1
        show("loss", rank, progress.step, loss.item())
        if progress.step % every == 0:
            show("saved", rank, accelerator.save_state())  # returns once captured
    accelerator.end_training()  # every save committed by the group, or its failure raised


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--project", required=True)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    train(args.project, args.steps)
