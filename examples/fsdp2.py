"""FSDP2 training that checkpoints with aiosnap, and resumes at any world size.

    torchrun --standalone --nproc-per-node 4 examples/fsdp2.py --dir /tmp/fsdp2-ckpt --steps 4
    torchrun --standalone --nproc-per-node 2 examples/fsdp2.py --dir /tmp/fsdp2-ckpt --steps 8

The first run trains steps 1-4 on 4 ranks; the second resumes from step 4 on 2 ranks: each
rank fills its own shards of the model and of AdamW's state from the shards the 4 ranks
saved, reading only the bytes it needs. Runs on CPUs with gloo; on GPUs, use "nccl" and
``init_device_mesh("cuda", ...)``.
"""

from __future__ import annotations

import argparse
import asyncio

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import aiosnap


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(48, 32, generator=g), torch.randn(48, 8, generator=g)
    per = 48 // world  # every rank its slice of the same global batch
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


async def main(directory: str, steps: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(world)
    state = {"model": model, "optim": optimizer}
    async with aiosnap.CheckpointManager(directory, keep=aiosnap.retention.KeepLast(2)) as manager:
        restored = await manager.resume(target=state)  # DTensors on this run's mesh; None: fresh
        start = 0 if restored is None else restored.step
        if restored is not None and rank == 0:
            print(f"resumed at step {start} on {world} ranks")
        for step in range(start + 1, steps + 1):
            x, y = batch(step, rank, world)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            await manager.save(step, state)  # returns once captured; written in the background
            total = loss.detach().clone()
            dist.all_reduce(total)
            if rank == 0:
                print(f"step {step}: loss {float(total) / world:.6f}")
    # Leaving the block waited until every save was committed (every rank durable).


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        asyncio.run(main(args.dir, args.steps))
    finally:
        dist.destroy_process_group()
