"""Node-local checkpoints: each machine's ranks save to its own disk, and resume from it.

    torchrun --standalone --nproc-per-node 4 examples/nodes.py --root /tmp/nodes --steps 4
    torchrun --standalone --nproc-per-node 4 examples/nodes.py --root /tmp/nodes --steps 8

On one machine, per-rank directories stand in for each node's own disk: ranks 0-1 save
to ROOT/node-0 and ranks 2-3 to ROOT/node-1 (``--ranks-per-node``). The ranks find out
which of them share a directory; each node's directory holds its ranks' files and each
step's manifest, and is locked, swept and rotated by its lowest rank. The second run
resumes from step 4, every rank reading only its own node's disk. ``--remote DIR`` (or an
``s3://`` URL) adds a durable tier behind the nodes. Runs on CPUs with gloo; on GPUs, use
"nccl" and ``init_device_mesh("cuda", ...)``.
"""

from __future__ import annotations

import argparse
import asyncio
import os

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


async def main(root: str, steps: int, per_node: int, remote: str | None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(world)
    state = {"model": model, "optim": optimizer}
    directory = os.path.join(root, f"node-{rank // per_node}")  # this "machine's" own disk
    keep = aiosnap.retention.KeepLast(2)
    async with aiosnap.CheckpointManager(directory, remote=remote, keep=keep) as manager:
        restored = await manager.resume(target=state)  # from this node's disk; None: fresh
        start = 0 if restored is None else restored.step
        if restored is not None:
            print(f"rank {rank} resumed at step {start} from {restored.path}")
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
        await manager.flush()
        if rank == 0:
            print(f"steps every node holds: {await manager.steps()}")
        else:
            await manager.steps()  # every rank asks: a group's calls pair up


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--remote", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        asyncio.run(main(args.root, args.steps, args.ranks_per_node, args.remote))
    finally:
        dist.destroy_process_group()
