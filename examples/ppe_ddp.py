"""DDP training with pytorch-pfn-extras that snapshots through aiosnap from one rank.

    torchrun --standalone --nproc-per-node 2 examples/ppe_ddp.py --out /tmp/ppe-ddp --iterations 20
    torchrun --standalone --nproc-per-node 2 examples/ppe_ddp.py --out /tmp/ppe-ddp --iterations 40

Rank 0 snapshots every 10 iterations (``saver_rank=0``); every rank learns how each save
call went before it trains on, so a failed save raises on every rank. The second run (or a
run started again after a kill) autoloads the newest snapshot on every rank and goes on
with the losses of a run that never stopped. Runs on CPUs with gloo.
"""

from __future__ import annotations

import argparse

import pytorch_pfn_extras as ppe
import torch
import torch.distributed as dist

from aiosnap.integrations.ppe import snapshot


def main(out: str, iterations: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    manager = ppe.training.ExtensionsManager(model, optimizer, 1, iters_per_epoch=iterations, out_dir=out)
    manager.extend(snapshot(saver_rank=0, n_retains=2, autoload=True), trigger=(10, "iteration"))
    first = True
    while not manager.stop_trigger:  # its first check autoloads, on every rank
        if first and manager.iteration:
            print(f"rank {rank}: resumed at iteration {manager.iteration}", flush=True)
        first = False
        with manager.run_iteration():
            g = torch.Generator().manual_seed(manager.iteration * world + rank)  # this rank's batch
            x = torch.randn(8, 16, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"rank {rank} iteration {manager.iteration + 1}: loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()  # the manager finalized the snapshot: every save is durable, or raised


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, required=True)
    args = parser.parse_args()
    main(args.out, args.iterations)
