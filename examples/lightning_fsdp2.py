"""FSDP2 training with Lightning whose sharded checkpoints go through aiosnap, resumed on every rank.

    torchrun --standalone --nproc-per-node 2 examples/lightning_fsdp2.py --out /tmp/lightning-fsdp2 --epochs 2
    torchrun --standalone --nproc-per-node 2 examples/lightning_fsdp2.py --out /tmp/lightning-fsdp2 --epochs 4

Every rank writes its shards of each epoch's checkpoints (the top one and ``last.ckpt``, each a
directory) through aiosnap's DCP backend, in the background; the second run (or a run started
again after a kill) resumes from ``last.ckpt`` on every rank and goes on with the losses of a
run that never stopped. Runs on CPUs with gloo (FSDP2 on a CPU device mesh).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.fsdp import fully_shard

from aiosnap.integrations.lightning import AiosnapModelParallelStrategy


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def configure_model(self) -> None:  # Lightning's FSDP2 hook: shard over the data-parallel mesh
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        print(f"rank {self.global_rank} step {self.global_step + 1}: loss {loss.item():.6f}", flush=True)
        return loss

    def on_train_start(self) -> None:
        if self.global_step:
            print(f"rank {self.global_rank}: resumed at step {self.global_step}", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def main(out: str, epochs: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=AiosnapModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        devices=world,
        max_epochs=epochs,
        callbacks=[ModelCheckpoint(dirpath=out, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), data, ckpt_path="last")  # returns once every checkpoint is committed
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    args = parser.parse_args()
    main(args.out, args.epochs)
